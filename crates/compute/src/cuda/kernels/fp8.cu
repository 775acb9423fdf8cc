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
    float amax = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
    amax = warp_max(amax);
    float scale = amax > 0.0f ? (float)((double)amax / 448.0) : 1.0f;
    u32 word = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) word |= f32_to_e4m3(__fdiv_rn(v[j], scale)) << (8 * j);
    *reinterpret_cast<u32*>(q + at) = word;
    if (lane == 0) scales[(u64)b * ld + m] = scale;
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
