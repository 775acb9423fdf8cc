// Part of the kernel source (cuda::KERNEL_SOURCE, after common.cuh): FP8 weights (issue 51).
//
// A weight [N, K] is held as float8_e4m3fn bytes and f32 scales, one per row and 128 columns
// ([N, ceil(K / 128)], "row scales"): w[n, k] = e4m3(q[n, k]) * scale[n, k / 128]. The published
// checkpoints scale 128 x 128 blocks; a block's scale repeated over its rows is the same
// numbers, and rows so described can be stacked (q/k/v) and interleaved (gate/up) freely.
#define FP8_BLOCK 128
#define FP8_MAX 448.0f

// An e4m3 byte as f32, exactly (no infinities; S.1111.111 is NaN), on any GPU.
__device__ __forceinline__ float e4m3_to_f32(u32 b) {
    u32 e = (b >> 3) & 15u, m = b & 7u;
    float v = e == 0 ? (float)m * 0.001953125f : __uint_as_float(((e + 120u) << 23) | (m << 20));
    if (e == 15u && m == 7u) v = __uint_as_float(0x7fc00000u);
    return (b & 0x80u) ? -v : v;
}

// Two e4m3 bytes (the low byte first) as a bf16 pair (the low half first), exactly: every
// e4m3 number is a bf16 number.
__device__ __forceinline__ u32 e4m3x2_to_bf16x2(u32 two) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    u32 h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h2) : "h"((unsigned short)two));
    float lo, hi;
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(lo) : "h"((unsigned short)(h2 & 0xffffu)));
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(hi) : "h"((unsigned short)(h2 >> 16)));
#else
    float lo = e4m3_to_f32(two & 0xffu), hi = e4m3_to_f32((two >> 8) & 0xffu);
#endif
    // Exact in bf16: the upper halves.
    return (__float_as_uint(lo) >> 16) | (__float_as_uint(hi) & 0xffff0000u);
}

// Two e4m3 bytes (the low byte first) as an f16 pair, exactly (every e4m3 number is an f16
// number).
__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 two) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    u32 h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h2) : "h"((unsigned short)(two & 0xffffu)));
    return h2;
#else
    return pack_f16x2(e4m3_to_f32(two & 0xffu), e4m3_to_f32((two >> 8) & 0xffu));
#endif
}

// Two e4m3 bytes (the low byte first) as f32, exactly, without the bf16 packing.
__device__ __forceinline__ void e4m3x2_to_f32x2(u32 two, float* out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    u32 h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h2) : "h"((unsigned short)two));
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(out[0]) : "h"((unsigned short)(h2 & 0xffffu)));
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(out[1]) : "h"((unsigned short)(h2 >> 16)));
#else
    out[0] = e4m3_to_f32(two & 0xffu);
    out[1] = e4m3_to_f32((two >> 8) & 0xffu);
#endif
}

// The e4m3 byte nearest x, ties to even, saturating at +-448 (weights.rs's f32_to_e4m3).
__device__ __forceinline__ u32 f32_to_e4m3(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned short two;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(two) : "f"(0.0f), "f"(x));
    return two & 0xffu;
#else
    if (x != x) return 0x7fu;
    u32 sign = x < 0.0f ? 0x80u : 0u;
    float a = fabsf(x);
    if (a >= FP8_MAX) return sign | 0x7eu;
    u32 byte;
    if (a < 0.015625f) {
        byte = (u32)__float2int_rn(a * 512.0f);
    } else {
        int e = (int)((__float_as_uint(a) >> 23) & 0xffu) - 127;
        u32 steps = (u32)__float2int_rn(a * __uint_as_float((u32)(127 + 3 - e) << 23));
        byte = ((u32)(e + 7) << 3) + steps - 8u;
    }
    return sign | byte;
#endif
}

// Quantizes a bf16 weight [N, K] as the FP8 checkpoints are made (weights.rs's quantize_fp8):
// each 128 x 128 block (the last ones partial) scaled by its largest magnitude over 448 (in
// f64, then f32; 1 for an all-zero block), each weight the e4m3 nearest its quotient by the
// scale. Writes the bytes q [N, K] and the row scales [N, ceil(K / 128)]. Grid: (ceil(N / 128),
// ceil(K / 128)). Block: 256.
#if KERNEL_GROUP(5)
extern "C" __global__ void __launch_bounds__(256)
    fp8_quantize(const bf16* __restrict__ w, unsigned char* __restrict__ q, float* __restrict__ scales, int N, int K) {
    __shared__ float partial[8];
    int r0 = blockIdx.x * FP8_BLOCK, c0 = blockIdx.y * FP8_BLOCK;
    int rows = min(FP8_BLOCK, N - r0), cols = min(FP8_BLOCK, K - c0), cells = rows * cols;
    // The previous kernel may be the one writing w.
    PDL_ENTER();
    float amax = 0.0f;
    for (int i = threadIdx.x; i < cells; i += blockDim.x)
        amax = fmaxf(amax, fabsf(bf2f(w[(u64)(r0 + i / cols) * K + c0 + i % cols])));
    amax = warp_max(amax);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = amax;
    __syncthreads();
    amax = partial[0];
    for (int i = 1; i < 8; ++i) amax = fmaxf(amax, partial[i]);
    float scale = amax > 0.0f ? (float)((double)amax / 448.0) : 1.0f;
    for (int i = threadIdx.x; i < cells; i += blockDim.x) {
        u64 at = (u64)(r0 + i / cols) * K + c0 + i % cols;
        q[at] = (unsigned char)f32_to_e4m3(__fdiv_rn(bf2f(w[at]), scale));
    }
    int kb = (K + FP8_BLOCK - 1) / FP8_BLOCK;
    if (threadIdx.x < rows) scales[(u64)(r0 + threadIdx.x) * kb + blockIdx.y] = scale;
}

// w[n, k] = bf16(e4m3(q[n, k]) * scale[n, k / 128]) for an [N, K] weight, K % 8 == 0: eight
// weights a thread (a product of many rows reads w, a scratch buffer, through cuBLAS). Grid: ceil(N * K / 2048). Block: 256.
extern "C" __global__ void __launch_bounds__(256)
    fp8_dequantize(const unsigned char* __restrict__ q, const float* __restrict__ scales, bf16* __restrict__ w, int N,
                   int K) {
    u64 i = ((u64)blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (i >= (u64)N * K) return;
    u64 n = i / K;
    int k = (int)(i % K), kb = (K + FP8_BLOCK - 1) / FP8_BLOCK;
    float scale = scales[n * kb + k / FP8_BLOCK];
    uint2 raw = *reinterpret_cast<const uint2*>(q + i);
    // The weight's bytes are never written; w (a scratch buffer) may still be read by an
    // earlier kernel until the wait.
    PDL_ENTER();
    u32 out[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        u32 word = j < 2 ? raw.x : raw.y;
        u32 pair = e4m3x2_to_bf16x2(j & 1 ? word >> 16 : word & 0xffffu);
        out[j] = pack_bf16x2(__uint_as_float(pair << 16) * scale, __uint_as_float(pair & 0xffff0000u) * scale);
    }
    *reinterpret_cast<uint4*>(w + i) = make_uint4(out[0], out[1], out[2], out[3]);
}
#endif

// A warp's 128-column block of activations rounded to e4m3, four values a lane (the lane's
// columns 4 lane .. 4 lane + 3): the block scaled by its largest magnitude over 448 (in f64,
// then f32; 1 for an all-zero block), each value the nearest e4m3 of its quotient. Writes the
// lane's four bytes at q and, from lane 0, the block's scale at scale.
__device__ __forceinline__ void fp8_round_block(const float* v, unsigned char* q, float* scale, int lane) {
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
    amax = warp_max(amax);
    float s = amax > 0.0f ? (float)((double)amax / 448.0) : 1.0f;
    u32 word = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) word |= f32_to_e4m3(__fdiv_rn(v[j], s)) << (8 * j);
    *reinterpret_cast<u32*>(q) = word;
    if (lane == 0) *scale = s;
}

// The activations of an FP8 product of many rows (ops::matmul_t_fp8 on cuBLASLt's block-scaled
// GEMM): each row's 128-column blocks of bf16 x [t, K] (K % 128 == 0) scaled by their largest
// magnitude over 448 (in f64, then f32; 1 for an all-zero block) and rounded to the nearest e4m3
// of each quotient, as fp8_quantize does a weight's 128 x 128 blocks. Writes q [t, K] and the
// scales block-major ([K / 128][ld], ld >= t: the token-major vectors cuBLASLt's VEC128 scaling
// reads). One warp a (row, block), four values a lane. Grid: (t, ceil(K / 128 / 8)). Block: 256.
#if KERNEL_GROUP(5)
extern "C" __global__ void __launch_bounds__(256)
    fp8_quantize_rows(const bf16* __restrict__ x, unsigned char* __restrict__ q, float* __restrict__ scales, int t,
                      int K, int ld) {
    int m = blockIdx.x, b = blockIdx.y * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    // The previous kernel writes x.
    PDL_ENTER();
    if (b >= K / FP8_BLOCK) return;
    u64 at = (u64)m * K + b * FP8_BLOCK + lane * 4;
    uint2 raw = *reinterpret_cast<const uint2*>(x + at);
    float v[4] = {__uint_as_float(raw.x << 16), __uint_as_float(raw.x & 0xffff0000u), __uint_as_float(raw.y << 16),
                  __uint_as_float(raw.y & 0xffff0000u)};
    fp8_round_block(v, q + at, scales + (u64)b * ld + m, lane);
}
#endif

// SiLU-and-multiply of gate/up rows (silu_mul's layouts: stacked, or gate and up interleaved)
// with the result rounded to e4m3 as fp8_quantize_rows rounds activations: the bytes and
// scales those two kernels give, without the bf16 rows between them (down's input in a step of
// many rows over FP8 weights). inter % 128 == 0. One warp a (row, 128-column block), four
// outputs a lane, as fp8_quantize_rows. Grid: (t, ceil(inter / 128 / 8)). Block: 256.
#if KERNEL_GROUP(5)
extern "C" __global__ void __launch_bounds__(256)
    silu_mul_fp8_rows(const bf16* __restrict__ gu, unsigned char* __restrict__ q, float* __restrict__ scales,
                      int t, int inter, int stacked, int ld) {
    int m = blockIdx.x, b = blockIdx.y * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    // The previous kernel writes gu.
    PDL_ENTER();
    if (b >= inter / FP8_BLOCK) return;
    int i = b * FP8_BLOCK + lane * 4;
    const bf16* row = gu + (u64)m * 2 * inter;
    u32 gate[2], up[2];
    if (stacked) {
        uint2 gv = *reinterpret_cast<const uint2*>(row + i), uv = *reinterpret_cast<const uint2*>(row + inter + i);
        gate[0] = gv.x, gate[1] = gv.y, up[0] = uv.x, up[1] = uv.y;
    } else {
        // gate i, up i, gate i + 1, up i + 1, ...
        uint4 v = *reinterpret_cast<const uint4*>(row + 2 * i);
        gate[0] = (v.x & 0xffffu) | (v.y << 16), up[0] = (v.x >> 16) | (v.y & 0xffff0000u);
        gate[1] = (v.z & 0xffffu) | (v.w << 16), up[1] = (v.z >> 16) | (v.w & 0xffff0000u);
    }
    u32 act[2] = {silu_mul_pack(gate[0], up[0]), silu_mul_pack(gate[1], up[1])};
    float v[4] = {__uint_as_float(act[0] << 16), __uint_as_float(act[0] & 0xffff0000u), __uint_as_float(act[1] << 16),
                  __uint_as_float(act[1] & 0xffff0000u)};
    fp8_round_block(v, q + (u64)m * inter + i, scales + (u64)b * ld + m, lane);
}
#endif

// add_rms_norm (its code and order of sums, rows r themselves) with each output row rounded to
// e4m3 as fp8_quantize_rows rounds activations: the bytes q [t, hidden] and scales
// ([hidden / 128][ld]) of those two kernels, without the bf16 rows between them (the input of
// qkv and gate/up in a step of many rows over FP8 weights). hidden % 128 == 0: each warp-step of
// the norm holds one 128-column block, four columns a lane, fp8_round_block's layout. Grid: t
// rows. Block: 256 (hidden <= 256 * 32), 1024 beyond.
#if KERNEL_GROUP(5)
extern "C" __global__ void __launch_bounds__(1024) add_rms_norm_fp8_rows(float* x, const bf16* delta, const float* parts, int slices,
                                                 u64 part_stride, const bf16* w, unsigned char* q, float* scales,
                                                 int ld, int hidden, float eps) {
    PDL_ENTER();
    int r = blockIdx.x, lane = threadIdx.x & 31;
    u64 at = (u64)r * hidden;
    add_rms_norm_row(x + at, delta ? delta + at : 0, parts ? parts + at : 0, slices, part_stride, w, hidden, eps,
                     [&](int i, uint2 pair) {
                         float v[4] = {__uint_as_float(pair.x << 16), __uint_as_float(pair.x & 0xffff0000u),
                                       __uint_as_float(pair.y << 16), __uint_as_float(pair.y & 0xffff0000u)};
                         fp8_round_block(v, q + at + i, scales + (u64)(i / FP8_BLOCK) * ld + r, lane);
                     });
}
#endif

// y[m, n] = sum_k x[m, k] * w[n, k] for m < t <= 8 * TILES rows of bf16 x [t, K] and an FP8
// weight (q, scales), K % 128 == 0: the decode product, reading one byte a weight. A warp owns
// 16 weight rows (an m16n8k16 A tile; the tokens are B, 8 a tile) and walks K 128 columns at a
// time: lane (g, c) reads 16 bytes of rows g and g + 8 and 16 values of token g at columns
// 16c..16c+15 of each 64-column half, which an mma step takes as its k = 2c, 2c + 1, 2c + 8,
// 2c + 9 (the same permutation of a step's columns for A and B, so the sum is the product's);
// each 128-column block's f32 sums are scaled once into the accumulators. FP8_AHEAD blocks are
// read ahead of their use (the first before the programmatic-launch wait). Out: bf16 [t, N], or
// f32 with f32_out. Block: 128 (4 warps). SPLIT 1: each warp its own 16 rows over all of K (64
// rows a block; grid ceil(N / 64)); SPLIT 4, for products of few rows (o, down: too few warps
// otherwise to stream the weight): the 4 warps share 16 rows, warp w taking the 128-column
// blocks w, w + 4, ..., their sums added in warp order at the end (grid ceil(N / 16)).
#define FP8_AHEAD 2
template <int TILES, int SPLIT>
__device__ __forceinline__ void gemv_fp8(const unsigned char* __restrict__ q, const float* __restrict__ scales,
                                         const bf16* __restrict__ x, void* y, int N, int K, int t, int f32_out) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    int n0 = SPLIT == 1 ? (blockIdx.x * 4 + warp) * 16 : blockIdx.x * 16;
    // With SPLIT > 1 every warp of the block has the same n0: all return or none.
    if (n0 >= N) return;
    // This warp's 128-column blocks: first, first + SPLIT, ... (mine of them).
    int kb = K / FP8_BLOCK, first = SPLIT == 1 ? 0 : warp;
    int mine = kb > first ? (kb - first + SPLIT - 1) / SPLIT : 0;
    // Rows past N read row N - 1 (never stored).
    const unsigned char* row_lo = q + (u64)min(n0 + g, N - 1) * K + 16 * c;
    const unsigned char* row_hi = q + (u64)min(n0 + g + 8, N - 1) * K + 16 * c;
    const float* scale_lo = scales + (u64)min(n0 + g, N - 1) * kb;
    const float* scale_hi = scales + (u64)min(n0 + g + 8, N - 1) * kb;
    float acc[TILES][4] = {};
    // A block's bytes: [half][row lo / hi].
    uint4 wq[FP8_AHEAD][2][2];
    auto load = [&](int slot, int j) {
        int b = first + j * SPLIT;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            wq[slot][h][0] = ld_stream(reinterpret_cast<const bf16*>(row_lo + b * FP8_BLOCK + h * 64));
            wq[slot][h][1] = ld_stream(reinterpret_cast<const bf16*>(row_hi + b * FP8_BLOCK + h * 64));
        }
    };
#pragma unroll
    for (int s = 0; s < FP8_AHEAD; ++s)
        if (s < mine) load(s, s);
    PDL_ENTER();
    for (int j0 = 0; j0 < mine; j0 += FP8_AHEAD) {
#pragma unroll
        for (int s = 0; s < FP8_AHEAD; ++s) {
            int j = j0 + s, b = first + j * SPLIT;
            if (j >= mine) break;
            float part[TILES][4] = {};
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                // Token g (and g + 8) at this lane's 16 columns of the half; zero past t.
                uint4 xv[TILES][2];
#pragma unroll
                for (int tile = 0; tile < TILES; ++tile) {
                    int m = tile * 8 + g;
                    const bf16* at = x + (u64)m * K + b * FP8_BLOCK + h * 64 + 16 * c;
                    xv[tile][0] = m < t ? *reinterpret_cast<const uint4*>(at) : make_uint4(0, 0, 0, 0);
                    xv[tile][1] = m < t ? *reinterpret_cast<const uint4*>(at + 8) : make_uint4(0, 0, 0, 0);
                }
                const uint4 lo = wq[s][h][0], hi = wq[s][h][1];
                const u32 lo_w[4] = {lo.x, lo.y, lo.z, lo.w}, hi_w[4] = {hi.x, hi.y, hi.z, hi.w};
#pragma unroll
                for (int step = 0; step < 4; ++step) {
                    // This lane's columns 4 step .. 4 step + 3: the first pair is k = 2c, 2c + 1
                    // (a0, a1), the second k = 2c + 8, 2c + 9 (a2, a3).
                    u32 a[4] = {e4m3x2_to_bf16x2(lo_w[step] & 0xffffu), e4m3x2_to_bf16x2(hi_w[step] & 0xffffu),
                                e4m3x2_to_bf16x2(lo_w[step] >> 16), e4m3x2_to_bf16x2(hi_w[step] >> 16)};
#pragma unroll
                    for (int tile = 0; tile < TILES; ++tile) {
                        const u32 xw[8] = {xv[tile][0].x, xv[tile][0].y, xv[tile][0].z, xv[tile][0].w,
                                           xv[tile][1].x, xv[tile][1].y, xv[tile][1].z, xv[tile][1].w};
                        mma_bf16(part[tile], a, xw[2 * step], xw[2 * step + 1]);
                    }
                }
            }
            // The slot takes the block FP8_AHEAD on.
            if (j + FP8_AHEAD < mine) load(s, j + FP8_AHEAD);
            float s_lo = scale_lo[b], s_hi = scale_hi[b];
#pragma unroll
            for (int tile = 0; tile < TILES; ++tile) {
                acc[tile][0] = fmaf(part[tile][0], s_lo, acc[tile][0]);
                acc[tile][1] = fmaf(part[tile][1], s_lo, acc[tile][1]);
                acc[tile][2] = fmaf(part[tile][2], s_hi, acc[tile][2]);
                acc[tile][3] = fmaf(part[tile][3], s_hi, acc[tile][3]);
            }
        }
    }
    if (SPLIT > 1) {
        // Warp 0 adds the others' sums to its own, in warp order.
        __shared__ float sums[SPLIT][TILES][4][32];
#pragma unroll
        for (int tile = 0; tile < TILES; ++tile)
#pragma unroll
            for (int e = 0; e < 4; ++e) sums[warp][tile][e][lane] = acc[tile][e];
        __syncthreads();
        if (warp != 0) return;
#pragma unroll
        for (int tile = 0; tile < TILES; ++tile)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                for (int w = 1; w < SPLIT; ++w) acc[tile][e] += sums[w][tile][e][lane];
    }
    // acc[tile]: rows n0 + g (e 0, 1) and n0 + g + 8 (e 2, 3) by tokens 8 tile + 2c, + 1.
#pragma unroll
    for (int tile = 0; tile < TILES; ++tile)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            int n = n0 + g + (e >> 1) * 8, m = tile * 8 + 2 * c + (e & 1);
            if (n >= N || m >= t) continue;
            u64 i = (u64)m * N + n;
            if (f32_out) reinterpret_cast<float*>(y)[i] = acc[tile][e];
            else reinterpret_cast<bf16*>(y)[i] = f2bf(acc[tile][e]);
        }
}

#define GEMV_FP8_KERNEL(NAME, TILES, SPLIT)                                                                       \
    extern "C" __global__ void __launch_bounds__(128)                                                             \
        NAME(const unsigned char* q, const float* scales, const bf16* x, void* y, int N, int K, int t, int f32_out) { \
        gemv_fp8<TILES, SPLIT>(q, scales, x, y, N, K, t, f32_out);                                                \
    }
#if KERNEL_GROUP(5)
GEMV_FP8_KERNEL(gemv_fp8_t8, 1, 1)
GEMV_FP8_KERNEL(gemv_fp8_t16, 2, 1)
GEMV_FP8_KERNEL(gemv_fp8_t8_k4, 1, 4)
GEMV_FP8_KERNEL(gemv_fp8_t16_k4, 2, 4)
#endif

// y = x · wᵀ for 17 to 64 rows of activations already rounded to e4m3 (the bytes xq [t, K] and
// block-major scales [K / 128][ld] that fp8_quantize_rows and the kernels rounding into FP8
// write for the block-scaled GEMM) and an FP8 weight (q [N, K], row scales [N, K / 128]):
// y[m, n] = sum over 128-column blocks b of (sum_k xq[m, k] q[n, k]) * xs[b][m] * ws[n, b], the
// block-scaled GEMM's numbers (its sums in another order), on m16n8k32 e4m3 MMAs that take the
// bytes as they are. For steps of a few dozen tokens, where cuBLASLt's tiles leave most of the
// GPU idle on products of few rows (Qwen3-32B's o and down at 64 rows: 40 tiles).
//
// A warp owns 16 weight rows (A), a block 8 warps (SKINNY_ROWS rows) and all the tokens (B, 8 a
// tile, TILES tiles); the block's items are (row group, K slice) pairs blockIdx.x, + gridDim.x,
// ... (the host gives every block the same number, `rounds`), each slice `slice_len` blocks of
// 128 columns (the last slice's steps past K add nothing). Per 128-column step a lane holds 32
// bytes of rows g and g + 8 (columns 32c..32c+31) and reads 32 bytes of token 8j + g's from
// shared memory: MMA step q takes bytes 8q..8q+7 of both as its k = 4c..4c+3, 16+4c..16+4c+3
// (the same permutation for A and B). The weights stream into registers SKINNY_AHEAD steps
// ahead (the first before the programmatic-launch wait); the activations' bytes and scales into
// a ring of SKINNY_AHEAD + 1 shared-memory stages by cp.async, one barrier a step. Out: with
// slices > 1 the f32 sums of slice s at y + s * t * N ([t, N] each, the residual add sums them in
// order); else [t, N] bf16, or f32 with f32_out. Block: 256.
// Measured slower than cuBLASLt on an H100 (2.5-3x; `fp8_skinny` stays off): sm_90 has no e4m3
// mma.sync, ptxas turns each into F2FP.F16.E4M3.UNPACK_B conversions of both operands (the
// activations' again for every warp) and two HMMA.16816. The next build: warpgroup FP8 MMAs.
#define SKINNY_ROWS 128
#define SKINNY_AHEAD 3
// A token's 128 bytes in shared memory, padded: lanes (g, c) read 16 bytes at 144 g + 32 c
// (+ 16), no two of a quarter-warp in the same banks.
#define SKINNY_PITCH 144

__device__ __forceinline__ void mma_e4m3(float* d, const u32* a, u32 b0, u32 b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    // No FP8 MMA before Ada: the host never launches these kernels there.
    __trap();
#endif
}

template <int TILES>
__device__ __forceinline__ void gemm_fp8_skinny(const unsigned char* __restrict__ W, const float* __restrict__ wscales,
                                                const unsigned char* __restrict__ xq, const float* __restrict__ xscales,
                                                int ld, void* y, int N, int K, int t, int slices, int rounds,
                                                int f32_out) {
    constexpr int M = TILES * 8, STAGES = SKINNY_AHEAD + 1;
    __shared__ __align__(16) unsigned char xs[STAGES][M][SKINNY_PITCH];
    __shared__ __align__(16) float xsc[STAGES][M];
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, c = lane & 3;
    int kb = K / FP8_BLOCK, slice_len = (kb + slices - 1) / slices;
    int items = (N + SKINNY_ROWS - 1) / SKINNY_ROWS * slices, total = rounds * slice_len;
    // Step s's item, and its 128-column block (-1: none, past K or past the items; the same
    // for every thread of the block).
    auto item_of = [&](int s) { return (int)blockIdx.x + s / slice_len * (int)gridDim.x; };
    auto block_of = [&](int s) {
        int item = item_of(s), b = item % slices * slice_len + s % slice_len;
        return item < items && b < kb ? b : -1;
    };
    uint4 w[SKINNY_AHEAD][4];
    float ws[SKINNY_AHEAD][2];
    auto load_weights = [&](int slot, int s) {
        int b = block_of(s);
        if (b < 0) return;
        int n0 = item_of(s) / slices * SKINNY_ROWS + warp * 16;
        // Rows past N read row N - 1 (never stored).
        int lo = min(n0 + g, N - 1), hi = min(n0 + g + 8, N - 1);
        const unsigned char* at_lo = W + (u64)lo * K + b * FP8_BLOCK + 32 * c;
        const unsigned char* at_hi = W + (u64)hi * K + b * FP8_BLOCK + 32 * c;
        w[slot][0] = ld_stream(reinterpret_cast<const bf16*>(at_lo));
        w[slot][1] = ld_stream(reinterpret_cast<const bf16*>(at_lo + 16));
        w[slot][2] = ld_stream(reinterpret_cast<const bf16*>(at_hi));
        w[slot][3] = ld_stream(reinterpret_cast<const bf16*>(at_hi + 16));
        ws[slot][0] = __ldg(wscales + (u64)lo * kb + b);
        ws[slot][1] = __ldg(wscales + (u64)hi * kb + b);
    };
    // Step s's activations into stage s % STAGES: every thread commits a group, empty or not,
    // so that waiting for all but the newest SKINNY_AHEAD - 1 finds step s's landed.
    auto load_acts = [&](int s) {
        int b = s < total ? block_of(s) : -1;
        if (b >= 0) {
            int stage = s % STAGES;
            // Tokens past t read token t - 1 (never stored).
            for (int i = tid; i < M * 8; i += blockDim.x) {
                int m = i >> 3, part = i & 7;
                cp_async16(&xs[stage][m][part * 16], xq + (u64)min(m, t - 1) * K + b * FP8_BLOCK + part * 16);
            }
            // ld (t rounded up to 4) <= M scales; those of tokens ld..M - 1 are never stored.
            if (tid * 4 < ld) cp_async16(&xsc[stage][tid * 4], xscales + (u64)b * ld + tid * 4);
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
#pragma unroll
    for (int s = 0; s < SKINNY_AHEAD; ++s)
        if (s < total) load_weights(s, s);
    PDL_ENTER();
#pragma unroll
    for (int s = 0; s < SKINNY_AHEAD; ++s) load_acts(s);
    float acc[TILES][4];
#pragma unroll
    for (int j = 0; j < TILES; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
    for (int s0 = 0; s0 < total; s0 += SKINNY_AHEAD) {
#pragma unroll
        for (int st = 0; st < SKINNY_AHEAD; ++st) {
            int s = s0 + st;
            // `total` is the block's: all its threads leave together.
            if (s >= total) break;
            asm volatile("cp.async.wait_group %0;\n" ::"n"(SKINNY_AHEAD - 1) : "memory");
            // Step s's stage is everyone's; step s - 1's is free for step s + SKINNY_AHEAD.
            __syncthreads();
            load_acts(s + SKINNY_AHEAD);
            if (block_of(s) >= 0) {
                const int stage = s % STAGES;
                const u32 lo[8] = {w[st][0].x, w[st][0].y, w[st][0].z, w[st][0].w,
                                   w[st][1].x, w[st][1].y, w[st][1].z, w[st][1].w};
                const u32 hi[8] = {w[st][2].x, w[st][2].y, w[st][2].z, w[st][2].w,
                                   w[st][3].x, w[st][3].y, w[st][3].z, w[st][3].w};
                const float s_lo = ws[st][0], s_hi = ws[st][1];
#pragma unroll
                for (int j = 0; j < TILES; ++j) {
                    const unsigned char* at = &xs[stage][j * 8 + g][32 * c];
                    const uint4 x0 = *reinterpret_cast<const uint4*>(at), x1 = *reinterpret_cast<const uint4*>(at + 16);
                    const u32 xw[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
                    float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        const u32 a[4] = {lo[2 * q], hi[2 * q], lo[2 * q + 1], hi[2 * q + 1]};
                        mma_e4m3(part, a, xw[2 * q], xw[2 * q + 1]);
                    }
                    // part: rows g (0, 1) and g + 8 (2, 3) by tokens 8j + 2c (0, 2) and + 1.
                    const float t0 = xsc[stage][j * 8 + 2 * c], t1 = xsc[stage][j * 8 + 2 * c + 1];
                    acc[j][0] = fmaf(part[0], s_lo * t0, acc[j][0]);
                    acc[j][1] = fmaf(part[1], s_lo * t1, acc[j][1]);
                    acc[j][2] = fmaf(part[2], s_hi * t0, acc[j][2]);
                    acc[j][3] = fmaf(part[3], s_hi * t1, acc[j][3]);
                }
            }
            // The slot takes the step SKINNY_AHEAD on.
            if (s + SKINNY_AHEAD < total) load_weights(st, s + SKINNY_AHEAD);
            if (s % slice_len != slice_len - 1) continue;
            // The item's last step: its sums leave.
            int item = item_of(s);
            if (item < items) {
                int n0 = item / slices * SKINNY_ROWS + warp * 16, slice = item % slices;
#pragma unroll
                for (int j = 0; j < TILES; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        int n = n0 + g + (e >> 1) * 8, m = j * 8 + 2 * c + (e & 1);
                        if (n >= N || m >= t) continue;
                        u64 i = (u64)m * N + n;
                        if (slices > 1) reinterpret_cast<float*>(y)[(u64)slice * t * N + i] = acc[j][e];
                        else if (f32_out) reinterpret_cast<float*>(y)[i] = acc[j][e];
                        else reinterpret_cast<bf16*>(y)[i] = f2bf(acc[j][e]);
                    }
            }
#pragma unroll
            for (int j = 0; j < TILES; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[j][e] = 0.0f;
        }
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
}

#define GEMM_FP8_SKINNY_KERNEL(NAME, TILES)                                                                     \
    extern "C" __global__ void __launch_bounds__(256, 1)                                                        \
        NAME(const unsigned char* W, const float* wscales, const unsigned char* xq, const float* xscales, int ld, \
             void* y, int N, int K, int t, int slices, int rounds, int f32_out) {                               \
        gemm_fp8_skinny<TILES>(W, wscales, xq, xscales, ld, y, N, K, t, slices, rounds, f32_out);               \
    }
#if KERNEL_GROUP(5)
GEMM_FP8_SKINNY_KERNEL(gemm_fp8_skinny_t32, 4)
GEMM_FP8_SKINNY_KERNEL(gemm_fp8_skinny_t48, 6)
GEMM_FP8_SKINNY_KERNEL(gemm_fp8_skinny_t64, 8)
#endif

// gemm_fp8_skinny's product (its arguments, items and outputs) on Hopper's warpgroup FP8 MMAs
// (`fp8_skinny=2`), which take the e4m3 bytes natively: a block is two warpgroups of 64 weight
// rows (A) by all 64 token rows (B; rows past t read row t - 1, never stored), both K-major in
// shared memory with 128-byte swizzling as gemm_wg keeps them (chunk c of a row's 128 bytes at
// c ^ (row % 8), 1024-byte atoms), so one 128-byte row is one 128-column scale block and its
// four wgmma m64n64k32 steps advance 32 bytes each. Each step (128 columns) goes into fresh
// accumulators that are then scaled by their weight row's and token's scales into the sums (the
// block-scaled GEMM's order of operations). Weights, tokens and token scales stream through a
// ring of FP8_WG_STAGES stages by cp.async (the weights of the first stages before the
// programmatic-launch wait), one barrier a step; the weight rows' scales come the same way.
// Block: 256. Dynamic shared memory: 1024 + FP8_WG_STAGES * FP8_WG_STAGE_BYTES
// (ops::FP8_WG_SMEM_BYTES).
#define FP8_WG_STAGES 6
#define FP8_WG_STAGE_BYTES 25600

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// d (64 weight rows x 64 tokens, f32) = (acc ? d : 0) + A (64 x 32 e4m3) x B (32 x 64 e4m3).
__device__ __forceinline__ void fp8_wg_mma(float (&d)[32], u64 a, u64 b, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
                 "%32, %33, p, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),
                   "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),
                   "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),
                   "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "l"(a), "l"(b), "r"(acc)
                 : "memory");
}

__device__ __forceinline__ void gemm_fp8_wg_body(const unsigned char* __restrict__ W, const float* __restrict__ wscales,
                                            const unsigned char* __restrict__ xq, const float* __restrict__ xscales,
                                            int ld, void* y, int N, int K, int t, int slices, int rounds,
                                            int f32_out) {
    extern __shared__ __align__(1024) unsigned char fp8_wg_smem[];
    u32 ring = ((u32)__cvta_generic_to_shared(fp8_wg_smem) + 1023) & ~1023u;
    const unsigned char* ring_ptr = fp8_wg_smem + (ring - (u32)__cvta_generic_to_shared(fp8_wg_smem));
    int tid = threadIdx.x, group = tid >> 7, lane = tid & 31, warp = (tid >> 5) & 3, g = lane >> 2, c = lane & 3;
    int kb = K / FP8_BLOCK, slice_len = (kb + slices - 1) / slices;
    int items = (N + SKINNY_ROWS - 1) / SKINNY_ROWS * slices, total = rounds * slice_len;
    constexpr int AHEAD = FP8_WG_STAGES - 1;
    // A stage: the two warpgroups' weight tiles (8 KB each), the tokens' (8 KB), their scales.
    auto weights = [&](int s, int grp) { return ring + (s % FP8_WG_STAGES) * FP8_WG_STAGE_BYTES + grp * 8192; };
    auto tokens = [&](int s) { return ring + (s % FP8_WG_STAGES) * FP8_WG_STAGE_BYTES + 16384; };
    auto token_scales = [&](int s) {
        return reinterpret_cast<const float*>(ring_ptr + (s % FP8_WG_STAGES) * FP8_WG_STAGE_BYTES + 24576);
    };
    // The 128 weight rows' scales of the step's block, after the tokens' 64.
    auto weight_scales = [&](int s) { return ring + (s % FP8_WG_STAGES) * FP8_WG_STAGE_BYTES + 24576 + 256; };
    auto item_of = [&](int s) { return (int)blockIdx.x + s / slice_len * (int)gridDim.x; };
    auto block_of = [&](int s) {
        int item = item_of(s), b = item % slices * slice_len + s % slice_len;
        return s < total && item < items && b < kb ? b : -1;
    };
    auto copy16 = [](u32 dst, const void* src) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
    };
    // Step s's 128 weight rows (rows past N read row N - 1), four 16-byte copies a thread.
    auto copy_weights = [&](int s) {
        int b = block_of(s);
        if (b < 0) return;
        int n0 = item_of(s) / slices * SKINNY_ROWS;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int j = tid + i * 256, row = j >> 3, chunk = j & 7, r = row & 63;
            const unsigned char* src = W + (u64)min(n0 + row, N - 1) * K + b * FP8_BLOCK + chunk * 16;
            copy16(weights(s, row >> 6) + r * 128 + ((chunk ^ (r & 7)) << 4), src);
        }
        // Their scales ride the ring too: a load waited on each step stalls the whole block for
        // a round trip to memory that is saturated by the weights' stream.
        if (tid < SKINNY_ROWS) {
            const float* src = wscales + (u64)min(n0 + tid, N - 1) * kb + b;
            asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(weight_scales(s) + tid * 4), "l"(src) : "memory");
        }
    };
    // Step s's 64 token rows and their scales (ld of them; those past ld are never stored).
    auto copy_tokens = [&](int s) {
        int b = block_of(s);
        if (b < 0) return;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            int j = tid + i * 256, m = j >> 3, chunk = j & 7;
            copy16(tokens(s) + m * 128 + ((chunk ^ (m & 7)) << 4), xq + (u64)min(m, t - 1) * K + b * FP8_BLOCK + chunk * 16);
        }
        if (tid * 4 < ld) copy16(ring + (s % FP8_WG_STAGES) * FP8_WG_STAGE_BYTES + 24576 + tid * 16, xscales + (u64)b * ld + tid * 4);
    };
    for (int s = 0; s < AHEAD; ++s) copy_weights(s);
    PDL_ENTER();
    // Group s holds stage s's tokens (and, for group 0, the first stages' weights).
    for (int s = 0; s < AHEAD; ++s) {
        copy_tokens(s);
        asm volatile("cp.async.commit_group;\n" ::: "memory");
    }
    // This thread's weight rows (of the warpgroup's 64): 16 warp + g and + 8.
    int row_lo = group * 64 + warp * 16 + g;
    float acc[32], d[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[i] = d[i] = 0.0f;
    for (int s = 0; s < total; ++s) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(AHEAD - 1) : "memory");
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        // Stage s is everyone's; stage s - 1's slot (every warpgroup waited for its products)
        // takes step s + AHEAD.
        __syncthreads();
        copy_weights(s + AHEAD);
        copy_tokens(s + AHEAD);
        asm volatile("cp.async.commit_group;\n" ::: "memory");
        int b = block_of(s);
        if (b >= 0) {
            const float* ws = reinterpret_cast<const float*>(ring_ptr + (weight_scales(s) - ring));
            float s_lo = ws[row_lo], s_hi = ws[row_lo + 8];
            wg_fence();
            u32 a = weights(s, group), bt = tokens(s);
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) fp8_wg_mma(d, wg_desc(a + kk * 32, 16, 1024), wg_desc(bt + kk * 32, 16, 1024), kk);
            wg_commit();
            wg_wait_all();
#pragma unroll
            for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(d[i])::"memory");
            const float* ts = token_scales(s);
            // d[4j + e]: weight row lo (e 0, 1) or lo + 8 (e 2, 3) by token 8j + 2c + (e & 1).
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                float t0 = ts[8 * j + 2 * c], t1 = ts[8 * j + 2 * c + 1];
                acc[4 * j] = fmaf(d[4 * j], s_lo * t0, acc[4 * j]);
                acc[4 * j + 1] = fmaf(d[4 * j + 1], s_lo * t1, acc[4 * j + 1]);
                acc[4 * j + 2] = fmaf(d[4 * j + 2], s_hi * t0, acc[4 * j + 2]);
                acc[4 * j + 3] = fmaf(d[4 * j + 3], s_hi * t1, acc[4 * j + 3]);
            }
        }
        if (s % slice_len != slice_len - 1) continue;
        // The item's last step: its sums leave.
        int item = item_of(s);
        if (item < items) {
            int n0 = item / slices * SKINNY_ROWS + row_lo, slice = item % slices;
#pragma unroll
            for (int i = 0; i < 32; ++i) {
                int n = n0 + ((i >> 1) & 1) * 8, m = 8 * (i >> 2) + 2 * c + (i & 1);
                if (n >= N || m >= t) continue;
                u64 at = (u64)m * N + n;
                if (slices > 1) reinterpret_cast<float*>(y)[(u64)slice * t * N + at] = acc[i];
                else if (f32_out) reinterpret_cast<float*>(y)[at] = acc[i];
                else reinterpret_cast<bf16*>(y)[at] = f2bf(acc[i]);
            }
        }
#pragma unroll
        for (int i = 0; i < 32; ++i) acc[i] = 0.0f;
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
}
#define GEMM_FP8_WG_BODY gemm_fp8_wg_body(W, wscales, xq, xscales, ld, y, N, K, t, slices, rounds, f32_out)

// d (64 weight rows x 32 tokens, f32) = (acc ? d : 0) + A (64 x 32 e4m3) x B (32 x 32 e4m3).
__device__ __forceinline__ void fp8_wg_mma(float (&d)[16], u64 a, u64 b, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
                 "%16, %17, p, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),
                   "+f"(d[15])
                 : "l"(a), "l"(b), "r"(acc)
                 : "memory");
}

// `fp8_skinny=3`: gemm_fp8_wg's product with its MMAs off the critical path. Two sets of
// accumulators take turns: step s's MMAs run while step s - 1's are scaled into the sums, so a
// step costs its barrier and copies plus the larger of the two, not their sum; the ring runs
// FP8_WG_STAGES - 2 steps ahead, so the slot a step's copies fill is that of step s - 2, whose
// MMAs every warpgroup waited for before the barrier. TOK token rows (32 where t <= 32: half the
// MMA work and token bytes, wgmma m64n32k32; else 64). Same stage layout as gemm_fp8_wg.
template <int TOK>
__device__ __forceinline__ void gemm_fp8_wg_pipe(const unsigned char* __restrict__ W,
                                                 const float* __restrict__ wscales,
                                                 const unsigned char* __restrict__ xq,
                                                 const float* __restrict__ xscales, int ld, void* y, int N, int K,
                                                 int t, int slices, int rounds, int f32_out) {
    constexpr int DN = TOK / 2;  // accumulators a thread: 64 x TOK over 128 threads
    constexpr int AHEAD = FP8_WG_STAGES - 2;
    extern __shared__ __align__(1024) unsigned char fp8_wg_smem[];
    u32 ring = ((u32)__cvta_generic_to_shared(fp8_wg_smem) + 1023) & ~1023u;
    const unsigned char* ring_ptr = fp8_wg_smem + (ring - (u32)__cvta_generic_to_shared(fp8_wg_smem));
    int tid = threadIdx.x, group = tid >> 7, lane = tid & 31, warp = (tid >> 5) & 3, c = lane & 3;
    int kb = K / FP8_BLOCK, slice_len = (kb + slices - 1) / slices;
    int items = (N + SKINNY_ROWS - 1) / SKINNY_ROWS * slices, total = rounds * slice_len;
    auto stage = [&](int s) { return (u32)((s % FP8_WG_STAGES) * FP8_WG_STAGE_BYTES); };
    auto item_of = [&](int s) { return (int)blockIdx.x + s / slice_len * (int)gridDim.x; };
    auto block_of = [&](int s) {
        int item = item_of(s), b = item % slices * slice_len + s % slice_len;
        return s < total && item < items && b < kb ? b : -1;
    };
    auto copy16 = [](u32 dst, const void* src) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
    };
    auto copy_weights = [&](int s) {
        int b = block_of(s);
        if (b < 0) return;
        int n0 = item_of(s) / slices * SKINNY_ROWS;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int j = tid + i * 256, row = j >> 3, chunk = j & 7, r = row & 63;
            const unsigned char* src = W + (u64)min(n0 + row, N - 1) * K + b * FP8_BLOCK + chunk * 16;
            copy16(ring + stage(s) + (row >> 6) * 8192 + r * 128 + ((chunk ^ (r & 7)) << 4), src);
        }
        if (tid < SKINNY_ROWS) {
            const float* src = wscales + (u64)min(n0 + tid, N - 1) * kb + b;
            asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(ring + stage(s) + 24832 + tid * 4),
                         "l"(src)
                         : "memory");
        }
    };
    auto copy_tokens = [&](int s) {
        int b = block_of(s);
        if (b < 0) return;
#pragma unroll
        for (int i = 0; i < TOK / 32; ++i) {
            int j = tid + i * 256, m = j >> 3, chunk = j & 7;
            copy16(ring + stage(s) + 16384 + m * 128 + ((chunk ^ (m & 7)) << 4),
                   xq + (u64)min(m, t - 1) * K + b * FP8_BLOCK + chunk * 16);
        }
        if (tid * 4 < ld) copy16(ring + stage(s) + 24576 + tid * 16, xscales + (u64)b * ld + tid * 4);
    };
    for (int s = 0; s < AHEAD; ++s) copy_weights(s);
    PDL_ENTER();
    for (int s = 0; s < AHEAD; ++s) {
        copy_tokens(s);
        asm volatile("cp.async.commit_group;\n" ::: "memory");
    }
    int row_lo = group * 64 + warp * 16 + (lane >> 2);
    float acc[DN], d0[DN], d1[DN];
#pragma unroll
    for (int i = 0; i < DN; ++i) acc[i] = d0[i] = d1[i] = 0.0f;
    // Step p's products (in `prev`, its MMAs waited for) into the sums; the item's last step
    // sends them out.
    auto sum_step = [&](int p, float (&prev)[DN]) {
#pragma unroll
        for (int i = 0; i < DN; ++i) asm volatile("" : "+f"(prev[i])::"memory");
        if (block_of(p) >= 0) {
            const float* ts = reinterpret_cast<const float*>(ring_ptr + stage(p) + 24576);
            const float* ws = reinterpret_cast<const float*>(ring_ptr + stage(p) + 24832);
            float s_lo = ws[row_lo], s_hi = ws[row_lo + 8];
            // prev[4j + e]: weight row lo (e 0, 1) or lo + 8 (e 2, 3) by token 8j + 2c + (e & 1).
#pragma unroll
            for (int j = 0; j < DN / 4; ++j) {
                float t0 = ts[8 * j + 2 * c], t1 = ts[8 * j + 2 * c + 1];
                acc[4 * j] = fmaf(prev[4 * j], s_lo * t0, acc[4 * j]);
                acc[4 * j + 1] = fmaf(prev[4 * j + 1], s_lo * t1, acc[4 * j + 1]);
                acc[4 * j + 2] = fmaf(prev[4 * j + 2], s_hi * t0, acc[4 * j + 2]);
                acc[4 * j + 3] = fmaf(prev[4 * j + 3], s_hi * t1, acc[4 * j + 3]);
            }
        }
        if (p % slice_len != slice_len - 1) return;
        int item = item_of(p);
        if (item < items) {
            int n0 = item / slices * SKINNY_ROWS + row_lo, slice = item % slices;
#pragma unroll
            for (int i = 0; i < DN; ++i) {
                int n = n0 + ((i >> 1) & 1) * 8, m = 8 * (i >> 2) + 2 * c + (i & 1);
                if (n >= N || m >= t) continue;
                u64 at = (u64)m * N + n;
                if (slices > 1) reinterpret_cast<float*>(y)[(u64)slice * t * N + at] = acc[i];
                else if (f32_out) reinterpret_cast<float*>(y)[at] = acc[i];
                else reinterpret_cast<bf16*>(y)[at] = f2bf(acc[i]);
            }
        }
#pragma unroll
        for (int i = 0; i < DN; ++i) acc[i] = 0.0f;
    };
    // Step s: its MMAs into `cur`, then step s - 1's products (in `prev`) into the sums. The MMAs
    // run whether or not the step has a block (its stage's bytes are then stale and its products
    // unused): accumulators written on some paths only would be copied between registers while
    // an MMA writes them, and ptxas would wait for every MMA to keep that safe.
    auto mma_step = [&](int s, float (&cur)[DN]) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(AHEAD - 1) : "memory");
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        copy_weights(s + AHEAD);
        copy_tokens(s + AHEAD);
        asm volatile("cp.async.commit_group;\n" ::: "memory");
        wg_fence();
        u32 a = ring + stage(s) + group * 8192, bt = ring + stage(s) + 16384;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
            fp8_wg_mma(cur, wg_desc(a + kk * 32, 16, 1024), wg_desc(bt + kk * 32, 16, 1024), kk);
        wg_commit();
    };
    auto step = [&](int s, float (&cur)[DN], float (&prev)[DN]) {
        mma_step(s, cur);
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
        sum_step(s - 1, prev);
    };
    if (total > 0) {
        mma_step(0, d0);
        int s = 1;
        for (; s + 1 < total; s += 2) {
            step(s, d1, d0);
            step(s + 1, d0, d1);
        }
        if (s < total) {
            step(s, d1, d0);
            wg_wait_all();
            sum_step(s, d1);
        } else {
            wg_wait_all();
            sum_step(s - 1, d0);
        }
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
}
#define GEMM_FP8_WG_PIPE_BODY(TOK) \
    gemm_fp8_wg_pipe<TOK>(W, wscales, xq, xscales, ld, y, N, K, t, slices, rounds, f32_out)
#else
#define GEMM_FP8_WG_BODY
#define GEMM_FP8_WG_PIPE_BODY(TOK)
#endif
#if KERNEL_GROUP(3)
extern "C" __global__ void __launch_bounds__(256, 1)
    gemm_fp8_wg(const unsigned char* W, const float* wscales, const unsigned char* xq, const float* xscales, int ld,
                void* y, int N, int K, int t, int slices, int rounds, int f32_out) {
    GEMM_FP8_WG_BODY;
}
#define GEMM_FP8_WG_PIPE_KERNEL(NAME, TOK)                                                                      \
    extern "C" __global__ void __launch_bounds__(256, 1)                                                        \
        NAME(const unsigned char* W, const float* wscales, const unsigned char* xq, const float* xscales, int ld, \
             void* y, int N, int K, int t, int slices, int rounds, int f32_out) {                               \
        GEMM_FP8_WG_PIPE_BODY(TOK);                                                                             \
    }
GEMM_FP8_WG_PIPE_KERNEL(gemm_fp8_wg_t32, 32)
GEMM_FP8_WG_PIPE_KERNEL(gemm_fp8_wg_t64, 64)
#endif

// The fused decode projection of an FP8 weight (`ops::Gemv` with row scales): gemv_mma's
// structure (a warp owns a 16-row A tile, up to 8 tokens' inputs from shared memory as B, K
// split over ksplit warps, the bf16 kernels' prologues and epilogues) reading one byte a
// weight. Per 64-column piece a lane loads 16 bytes of rows g and g + 8 (columns taken as in
// gemv_fp8: four mma steps), and the piece's sums are scaled by its two rows' scales (a piece
// lies inside one 128-column block) into PIECES independent accumulators, added in order at
// the end. A warp's work is a run of steps of PIECES pieces (its slice of K, tile after tile);
// STAGES steps' weights are in flight at once, the first ones issued before the
// programmatic-launch wait.
//
// F16: the weights' e4m3 pairs become f16 pairs in one conversion each (every e4m3 number is
// an f16 number) and the products run on f16 MMAs. The input rows (bf16, as the prologue
// rounds them) are scaled into f16 by a power of two per row that puts the row's largest
// magnitude in [2^14, 2^15), and the sums scaled back by its inverse: products are exact in
// f32 either way, so the sums are the bf16 build's, but for inputs below 2^-28 of their row's
// largest (f16 subnormals). Without F16 each e4m3 pair goes through f32 to a bf16 pair.
// (A build that loaded 512-column slices at once, and the next tile's during the epilogue,
// under launch bounds of two blocks an SM, measured slower on an H100: gate/up 44.4 against
// 31.6 us.) NARROW (F16 only) swaps the roles: the tokens are A's rows (8 of its 16 zero), 8
// weight rows B's columns, one row a lane (16 bytes a piece); a warp's tile is 8 rows, each
// lane's sums those of rows 2q and 2q + 1 for token g, scaled by their scales.
// OUT_SILU reads gate/up stacked as FP8 weights keep them (gate rows [0, N / 2), up rows
// [N / 2, N)): a wide tile's rows g are gate rows j0 + g and its rows g + 8 the matching up
// rows, a NARROW tile's columns 2i and 2i + 1 gate and up rows j0 + i, so each lane holds both
// halves of its outputs. K % 64 == 0. Block: 256. Dynamic shared memory: M * K * 2 bytes.
template <int OUT>
__device__ __forceinline__ void gemv_fp8_store(void* out, const bf16* bias, int N, int row, int m, int mcount,
                                               float v, float up) {
    if (OUT != OUT_SILU) {
        gemv_store<OUT>(out, bias, N, row, m, mcount, v);
        return;
    }
    int half = N / 2;
    if (row >= half || m >= mcount) return;
    if (bias) {
        v += bf2f(bias[row]);
        up += bf2f(bias[half + row]);
    }
    reinterpret_cast<bf16*>(out)[(u64)m * half + row] = (bf16)(silu_mul_pack(f2bf(v), f2bf(up)) & 0xffffu);
}

// Scales the M bf16 rows of K at xs, in place, into f16 rows times 2^s (s per row, clamped to
// +-100: an all-zero row gets 2^100, harmlessly) and writes 2^-s for row m at unscale[m]
// (1 for rows M..7). Every thread of the block calls it; it ends with a barrier.
template <int M>
__device__ __forceinline__ void gemv_rows_to_f16(bf16* xs, int K, float (*amax_of_warp)[MMA_ROWS][8],
                                                 float* unscale) {
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    float amax[M];
#pragma unroll
    for (int m = 0; m < M; ++m) {
        amax[m] = 0.0f;
        for (int i = tid * 8; i < K; i += blockDim.x * 8) {
            uint4 v = *reinterpret_cast<const uint4*>(xs + (u64)m * K + i);
            u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int j = 0; j < 4; ++j)
                amax[m] = fmaxf(amax[m], fmaxf(fabsf(__uint_as_float(w[j] << 16)),
                                               fabsf(__uint_as_float(w[j] & 0xffff0000u))));
        }
        amax[m] = warp_max(amax[m]);
        if (lane == 0) amax_of_warp[warp][0][m] = amax[m];
    }
    __syncthreads();
    int warps = blockDim.x >> 5;
#pragma unroll
    for (int m = 0; m < M; ++m) {
        float a = 0.0f;
        for (int w = 0; w < warps; ++w) a = fmaxf(a, amax_of_warp[w][0][m]);
        // a in [2^e, 2^(e + 1)): a * 2^(14 - e) in [2^14, 2^15).
        int e = (int)((__float_as_uint(a) >> 23) & 0xffu) - 127;
        int s = min(100, max(-100, 14 - e));
        float up = __uint_as_float((u32)(127 + s) << 23);
        if (tid == 0) unscale[m] = __uint_as_float((u32)(127 - s) << 23);
        for (int i = tid * 8; i < K; i += blockDim.x * 8) {
            uint4* at = reinterpret_cast<uint4*>(xs + (u64)m * K + i);
            uint4 v = *at;
            u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int j = 0; j < 4; ++j)
                w[j] = pack_f16x2(__uint_as_float(w[j] << 16) * up, __uint_as_float(w[j] & 0xffff0000u) * up);
            *at = make_uint4(w[0], w[1], w[2], w[3]);
        }
    }
    if (tid >= M && tid < 8) unscale[tid] = 1.0f;
    __syncthreads();
}

template <int M, int IN, int OUT, bool F16, int PIECES, int STAGES, bool NARROW>
__device__ __forceinline__ void gemv_mma_fp8(const unsigned char* __restrict__ W, const float* __restrict__ scales,
                                             int N, int K, int ksplit, const void* in, const int* rows,
                                             const bf16* norm_w, float eps, void* out, const bf16* bias,
                                             int mcount) {
    extern __shared__ __align__(16) unsigned char gemv_smem[];
    // scratch: the norm's block sums ([0, 8)), then (F16) each token's unscale ([16, 24)).
    __shared__ float scratch[32];
    __shared__ float partial[8][MMA_ROWS][8];
    bf16* xs = reinterpret_cast<bf16*>(gemv_smem);
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, q = lane & 3;
    int groups = 8 / ksplit, grp = warp / ksplit, slice = warp % ksplit;
    int kbc = (K + FP8_BLOCK - 1) / FP8_BLOCK;
    // Slices of whole 64-column pieces, each walked in steps of PIECES pieces (the last step's
    // pieces past the slice read nothing and add zero).
    constexpr int STEP = 64 * PIECES;
    int slice_len = (K / 64 + ksplit - 1) / ksplit * 64;
    int k_begin = slice * slice_len, k_end = min(K, k_begin + slice_len);
    int steps_per_tile = (slice_len + STEP - 1) / STEP;
    // A tile's output rows: 16 (OUT_SILU: 8 outputs from 8 gate and 8 up rows); NARROW: 8 (4).
    constexpr int TILE_ROWS = NARROW ? 8 : MMA_ROWS;
    constexpr int TILE_OUT = OUT == OUT_SILU ? TILE_ROWS / 2 : TILE_ROWS;
    int outs = OUT == OUT_SILU ? N / 2 : N;
    int tiles = (outs + TILE_OUT - 1) / TILE_OUT;
    // The block's groups take tiles first + grp, first + grp + stride, ...: the same number of
    // rounds for every warp of the block (a tile past the end reads the last rows and stores
    // nothing), so the barriers of the K-split merge line up.
    int stride = gridDim.x * groups, first = blockIdx.x * groups;
    int rounds = first < tiles ? (tiles - first + stride - 1) / stride : 0;
    int total = rounds * steps_per_tile;
    // Weight row `n` of tile `tile` (rows past the end read the last one; never stored). Wide
    // tiles: the A rows, OUT_SILU's gate rows first (n < 8) then the matching up rows. NARROW
    // tiles: the B columns, OUT_SILU's gate and up rows alternating (n = 2i, 2i + 1: output i).
    auto row_of = [&](int tile, int n) {
        if (OUT != OUT_SILU) return min(tile * TILE_ROWS + n, N - 1);
        int half = NARROW ? n & 1 : n >= 8, out_row = min(tile * TILE_OUT + (NARROW ? n >> 1 : n & 7), outs - 1);
        return half ? outs + out_row : out_row;
    };
    // This lane's weight rows (wide: A rows g and g + 8; NARROW: B column g, one row) and the
    // rows its sums belong to, whose scales it applies (wide: the same; NARROW: 2q and 2q + 1).
    auto rows_of = [&](int tile, int& lo, int& hi, int& scale_lo, int& scale_hi) {
        lo = row_of(tile, g);
        hi = NARROW ? lo : row_of(tile, g + 8);
        scale_lo = NARROW ? row_of(tile, 2 * q) : lo;
        scale_hi = NARROW ? row_of(tile, 2 * q + 1) : hi;
    };
    uint4 wlo[STAGES][PIECES], whi[STAGES][PIECES];
    float slo[STAGES][PIECES], shi[STAGES][PIECES];
    auto load = [&](int slot, int s) {
        int lo, hi, scale_lo, scale_hi;
        rows_of(first + grp + s / steps_per_tile * stride, lo, hi, scale_lo, scale_hi);
        int k0 = k_begin + s % steps_per_tile * STEP;
#pragma unroll
        for (int u = 0; u < PIECES; ++u) {
            int k = k0 + u * 64 + q * 16;
            if (k < k_end) {
                wlo[slot][u] = ld_stream(reinterpret_cast<const bf16*>(W + (u64)lo * K + k));
                whi[slot][u] = NARROW ? make_uint4(0, 0, 0, 0)
                                      : ld_stream(reinterpret_cast<const bf16*>(W + (u64)hi * K + k));
                slo[slot][u] = __ldg(scales + (u64)scale_lo * kbc + k / FP8_BLOCK);
                shi[slot][u] = __ldg(scales + (u64)scale_hi * kbc + k / FP8_BLOCK);
            } else {
                wlo[slot][u] = whi[slot][u] = make_uint4(0, 0, 0, 0);
                slo[slot][u] = shi[slot][u] = 0.0f;
            }
        }
    };
    // Weights are never written: the first steps stream while the previous kernel ends.
#pragma unroll
    for (int st = 0; st < STAGES; ++st)
        if (st < total) load(st, st);
    PDL_ENTER();
    for (int m = 0; m < M; ++m) gemv_prologue<IN>(xs + (u64)m * K, K, in, rows, norm_w, eps, m, mcount, scratch);
    __syncthreads();
    float* unscale = scratch + 16;
    if (F16) gemv_rows_to_f16<M>(xs, K, partial, unscale);
    const bf16* xrow = xs + (u64)(g < M ? g : 0) * K;
    float acc[PIECES][4];
#pragma unroll
    for (int u = 0; u < PIECES; ++u)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[u][e] = 0.0f;
    for (int s0 = 0; s0 < total; s0 += STAGES) {
#pragma unroll
        for (int st = 0; st < STAGES; ++st) {
            int s = s0 + st;
            // `total` is the block's: all its warps leave together.
            if (s >= total) break;
            int k0 = k_begin + s % steps_per_tile * STEP;
#pragma unroll
            for (int u = 0; u < PIECES; ++u) {
                int k = k0 + u * 64 + q * 16;
                uint4 x0 = make_uint4(0, 0, 0, 0), x1 = make_uint4(0, 0, 0, 0);
                if (g < M && k < k_end) {
                    x0 = *reinterpret_cast<const uint4*>(xrow + k);
                    x1 = *reinterpret_cast<const uint4*>(xrow + k + 8);
                }
                const u32 xw[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
                const u32 lw[4] = {wlo[st][u].x, wlo[st][u].y, wlo[st][u].z, wlo[st][u].w};
                const u32 hw[4] = {whi[st][u].x, whi[st][u].y, whi[st][u].z, whi[st][u].w};
                float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int step = 0; step < 4; ++step) {
                    if (NARROW) {
                        // The tokens are A (rows g; rows g + 8 zero), this lane's weight row B.
                        const u32 a[4] = {xw[2 * step], 0u, xw[2 * step + 1], 0u};
                        mma_f16(part, a, e4m3x2_to_f16x2(lw[step]), e4m3x2_to_f16x2(lw[step] >> 16));
                    } else if (F16) {
                        u32 a[4] = {e4m3x2_to_f16x2(lw[step]), e4m3x2_to_f16x2(hw[step]),
                                    e4m3x2_to_f16x2(lw[step] >> 16), e4m3x2_to_f16x2(hw[step] >> 16)};
                        mma_f16(part, a, xw[2 * step], xw[2 * step + 1]);
                    } else {
                        u32 a[4] = {e4m3x2_to_bf16x2(lw[step] & 0xffffu), e4m3x2_to_bf16x2(hw[step] & 0xffffu),
                                    e4m3x2_to_bf16x2(lw[step] >> 16), e4m3x2_to_bf16x2(hw[step] >> 16)};
                        mma_bf16(part, a, xw[2 * step], xw[2 * step + 1]);
                    }
                }
                // NARROW: rows 2q (part 0) and 2q + 1 (part 1) by token g; parts 2 and 3 are the
                // zero rows'.
                acc[u][0] = fmaf(part[0], slo[st][u], acc[u][0]);
                acc[u][1] = fmaf(part[1], NARROW ? shi[st][u] : slo[st][u], acc[u][1]);
                if (!NARROW) {
                    acc[u][2] = fmaf(part[2], shi[st][u], acc[u][2]);
                    acc[u][3] = fmaf(part[3], shi[st][u], acc[u][3]);
                }
            }
            // The slot takes the step STAGES on.
            if (s + STAGES < total) load(st, s + STAGES);
            if (s % steps_per_tile != steps_per_tile - 1) continue;
            // The tile's last step: its sums leave.
            int tile0 = first + s / steps_per_tile * stride, tile = tile0 + grp;
            float d[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                d[e] = acc[0][e];
#pragma unroll
                for (int u = 1; u < PIECES; ++u) d[e] += acc[u][e];
                // The token's scale undone (exact: a power of two): wide, token 2q + (e & 1);
                // NARROW, token g (e 0, 1; 2 and 3 are the zero rows').
                if (F16) d[e] *= unscale[NARROW ? g : 2 * q + (e & 1)];
#pragma unroll
                for (int u = 0; u < PIECES; ++u) acc[u][e] = 0.0f;
            }
            // Wide: d is A rows g (0, 1) and g + 8 (2, 3) by tokens 2q and 2q + 1. NARROW: token
            // g by B columns 2q (0) and 2q + 1 (1).
            if (NARROW && ksplit == 1) {
                if (OUT == OUT_SILU) {
                    gemv_fp8_store<OUT>(out, bias, N, tile * TILE_OUT + q, g, mcount, d[0], d[1]);
                } else {
                    gemv_fp8_store<OUT>(out, bias, N, tile * TILE_ROWS + 2 * q, g, mcount, d[0], 0.0f);
                    gemv_fp8_store<OUT>(out, bias, N, tile * TILE_ROWS + 2 * q + 1, g, mcount, d[1], 0.0f);
                }
            } else if (ksplit == 1) {
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    if (OUT == OUT_SILU) {
                        gemv_fp8_store<OUT>(out, bias, N, tile * 8 + g, 2 * q + i, mcount, d[i], d[2 + i]);
                    } else {
                        gemv_fp8_store<OUT>(out, bias, N, tile * 16 + g, 2 * q + i, mcount, d[i], 0.0f);
                        gemv_fp8_store<OUT>(out, bias, N, tile * 16 + g + 8, 2 * q + i, mcount, d[2 + i], 0.0f);
                    }
                }
            } else {
                // partial[warp][tile row][token]; an output's gate and up rows (OUT_SILU) at
                // r and r + 8 (wide) or 2r and 2r + 1 (NARROW).
                if (NARROW) {
                    if (g < M) partial[warp][2 * q][g] = d[0], partial[warp][2 * q + 1][g] = d[1];
                } else {
#pragma unroll
                    for (int i = 0; i < 4; ++i) partial[warp][g + (i / 2) * 8][2 * q + i % 2] = d[i];
                }
                __syncthreads();
                for (int i = tid; i < groups * TILE_OUT * M; i += blockDim.x) {
                    int gg = i / (TILE_OUT * M), r = (i / M) % TILE_OUT, m = i % M;
                    int gate_row = OUT != OUT_SILU ? r : NARROW ? 2 * r : r;
                    int up_row = NARROW ? 2 * r + 1 : r + 8;
                    float v = 0.0f, up = 0.0f;
                    for (int sl = 0; sl < ksplit; ++sl) {
                        v += partial[gg * ksplit + sl][gate_row][m];
                        if (OUT == OUT_SILU) up += partial[gg * ksplit + sl][up_row][m];
                    }
                    gemv_fp8_store<OUT>(out, bias, N, (tile0 + gg) * TILE_OUT + r, m, mcount, v, up);
                }
                __syncthreads();
            }
        }
    }
}

// The builds (`--cuda-tune fp8_gemv_build`, ops::FP8_GEMV_BUILDS): 0 `_fp8` bf16 MMAs, steps of
// 4 pieces one at a time, three blocks an SM (spills a few registers); 1 `_h_fp8` the same sums
// on f16 MMAs under two blocks an SM (no spills; on an H100, Qwen3-32B's decode step 0.88x
// build 0's); 2 `_p_fp8` f16, steps of 2 pieces, 2 in flight, two blocks an SM; 3 `_n_fp8`
// NARROW: tiles of 8 weight rows (twice as many tiles, so that products of few rows, Qwen3-32B's
// o and down at 320 wide tiles, spread evenly over the SMs), steps of 8 pieces of one row:
// measured slower (Qwen3-32B's decode step 16.329 ms against build 1's 13.8; its o and down no
// faster, its gate/up at 2051 GB/s against 2832), kept as a comparison.
#define GEMV_FP8_FUSED_KERNEL(NAME, SUFFIX, M, IN, OUT, F16, PIECES, STAGES, BLOCKS, NARROW)                   \
    extern "C" __global__ void __launch_bounds__(256, BLOCKS) NAME##_m##M##SUFFIX(                              \
        const unsigned char* W, const float* scales, int N, int K, int ksplit, const void* in, const int* rows,  \
        const bf16* norm_w, float eps, void* out, const bf16* bias, int mcount) {                                \
        gemv_mma_fp8<M, IN, OUT, F16, PIECES, STAGES, NARROW>(W, scales, N, K, ksplit, in, rows, norm_w, eps,     \
                                                              out, bias, mcount);                                \
    }
#define GEMV_FP8_FUSED_ALL_M(NAME, SUFFIX, IN, OUT, ...)            \
    GEMV_FP8_FUSED_KERNEL(NAME, SUFFIX, 1, IN, OUT, __VA_ARGS__)    \
    GEMV_FP8_FUSED_KERNEL(NAME, SUFFIX, 2, IN, OUT, __VA_ARGS__)    \
    GEMV_FP8_FUSED_KERNEL(NAME, SUFFIX, 4, IN, OUT, __VA_ARGS__)    \
    GEMV_FP8_FUSED_KERNEL(NAME, SUFFIX, 8, IN, OUT, __VA_ARGS__)
#define GEMV_FP8_FUSED_KINDS(SUFFIX, ...)                                       \
    GEMV_FP8_FUSED_ALL_M(gemv_norm_bf16, SUFFIX, IN_NORM, OUT_BF16, __VA_ARGS__) \
    GEMV_FP8_FUSED_ALL_M(gemv_norm_f32, SUFFIX, IN_NORM, OUT_F32, __VA_ARGS__)   \
    GEMV_FP8_FUSED_ALL_M(gemv_norm_silu, SUFFIX, IN_NORM, OUT_SILU, __VA_ARGS__) \
    GEMV_FP8_FUSED_ALL_M(gemv_bf16_add, SUFFIX, IN_BF16, OUT_ADD, __VA_ARGS__)
#if KERNEL_GROUP(1)
GEMV_FP8_FUSED_KINDS(_fp8, false, 4, 1, 3, false)
#endif
#if KERNEL_GROUP(5)
GEMV_FP8_FUSED_KINDS(_h_fp8, true, 4, 1, 2, false)
GEMV_FP8_FUSED_KINDS(_p_fp8, true, 2, 2, 2, false)
#endif
#if KERNEL_GROUP(0)
GEMV_FP8_FUSED_KINDS(_n_fp8, true, 8, 1, 2, true)
#endif
