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

// The fused decode projection of an FP8 weight (`ops::Gemv` with row scales): gemv_mma's
// structure (a warp owns a 16-row A tile, up to 8 tokens' inputs from shared memory as B, K
// split over ksplit warps, the bf16 kernels' prologues and epilogues) reading one byte a
// weight. Per 64-column piece a lane loads 16 bytes of rows g and g + 8 (columns taken as in
// gemv_fp8: four mma steps), and the piece's sums are scaled by its two rows' scales (a piece
// lies inside one 128-column block) into FP8_PIECES independent accumulators, added in order
// at the end. The first batch of weights goes out before the programmatic-launch wait. (A
// build that loaded 512-column slices at once, and the next tile's during the epilogue, under
// launch bounds of two blocks an SM, measured slower on an H100: gate/up 44.4 against 31.6 us.)
// OUT_SILU reads gate/up stacked as FP8 weights keep them (gate rows [0, N / 2), up rows
// [N / 2, N)): a tile's rows g are gate rows j0 + g and its rows g + 8 the matching up rows,
// so each lane holds both halves of its outputs. K % 64 == 0. Block: 256. Dynamic shared
// memory: M * K * 2 bytes.
#define FP8_PIECES 4
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

template <int M, int IN, int OUT>
__device__ __forceinline__ void gemv_mma_fp8(const unsigned char* __restrict__ W, const float* __restrict__ scales,
                                             int N, int K, int ksplit, const void* in, const int* rows,
                                             const bf16* norm_w, float eps, void* out, const bf16* bias,
                                             int mcount) {
    extern __shared__ __align__(16) unsigned char gemv_smem[];
    __shared__ float scratch[32];
    __shared__ float partial[8][MMA_ROWS][8];
    bf16* xs = reinterpret_cast<bf16*>(gemv_smem);
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, q = lane & 3;
    int groups = 8 / ksplit, grp = warp / ksplit, slice = warp % ksplit;
    int kbc = (K + FP8_BLOCK - 1) / FP8_BLOCK;
    // Slices of whole 64-column pieces.
    int slice_len = (K / 64 + ksplit - 1) / ksplit * 64;
    int k_begin = slice * slice_len, k_end = min(K, k_begin + slice_len);
    // A tile's output rows: 16 (OUT_SILU: 8 outputs from 8 gate and 8 up rows).
    constexpr int TILE_OUT = OUT == OUT_SILU ? 8 : MMA_ROWS;
    int outs = OUT == OUT_SILU ? N / 2 : N;
    int tiles = (outs + TILE_OUT - 1) / TILE_OUT;
    // Weight rows of tile `tile` for this lane (rows past the end read the last one; never stored).
    auto rows_of = [&](int tile, int& lo, int& hi) {
        if (OUT == OUT_SILU) {
            lo = min(tile * 8 + g, outs - 1);
            hi = outs + lo;
        } else {
            lo = min(tile * 16 + g, N - 1);
            hi = min(tile * 16 + g + 8, N - 1);
        }
    };
    uint4 wlo[FP8_PIECES], whi[FP8_PIECES];
    float slo[FP8_PIECES], shi[FP8_PIECES];
    auto load = [&](int tile, int k0) {
        int lo, hi;
        rows_of(tile, lo, hi);
#pragma unroll
        for (int u = 0; u < FP8_PIECES; ++u) {
            int k = k0 + u * 64 + q * 16;
            if (k < k_end) {
                wlo[u] = ld_stream(reinterpret_cast<const bf16*>(W + (u64)lo * K + k));
                whi[u] = ld_stream(reinterpret_cast<const bf16*>(W + (u64)hi * K + k));
                slo[u] = __ldg(scales + (u64)lo * kbc + k / FP8_BLOCK);
                shi[u] = __ldg(scales + (u64)hi * kbc + k / FP8_BLOCK);
            } else {
                wlo[u] = whi[u] = make_uint4(0, 0, 0, 0);
                slo[u] = shi[u] = 0.0f;
            }
        }
    };
    int stride = gridDim.x * groups;
    int first = blockIdx.x * groups;
    // Weights are never written: the first batch streams while the previous kernel ends.
    if (first < tiles) load(first + grp, k_begin);
    PDL_ENTER();
    for (int m = 0; m < M; ++m) gemv_prologue<IN>(xs + (u64)m * K, K, in, rows, norm_w, eps, m, mcount, scratch);
    __syncthreads();
    const bf16* xrow = xs + (u64)(g < M ? g : 0) * K;
    bool loaded = true;
    for (int tile0 = first; tile0 < tiles; tile0 += stride) {
        int tile = tile0 + grp;
        float acc[FP8_PIECES][4];
#pragma unroll
        for (int u = 0; u < FP8_PIECES; ++u)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[u][e] = 0.0f;
        for (int k0 = k_begin; k0 < k_end; k0 += 64 * FP8_PIECES) {
            if (!loaded) load(tile, k0);
            loaded = false;
#pragma unroll
            for (int u = 0; u < FP8_PIECES; ++u) {
                int k = k0 + u * 64 + q * 16;
                uint4 x0 = make_uint4(0, 0, 0, 0), x1 = make_uint4(0, 0, 0, 0);
                if (g < M && k < k_end) {
                    x0 = *reinterpret_cast<const uint4*>(xrow + k);
                    x1 = *reinterpret_cast<const uint4*>(xrow + k + 8);
                }
                const u32 xw[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
                const u32 lw[4] = {wlo[u].x, wlo[u].y, wlo[u].z, wlo[u].w};
                const u32 hw[4] = {whi[u].x, whi[u].y, whi[u].z, whi[u].w};
                float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int step = 0; step < 4; ++step) {
                    u32 a[4] = {e4m3x2_to_bf16x2(lw[step] & 0xffffu), e4m3x2_to_bf16x2(hw[step] & 0xffffu),
                                e4m3x2_to_bf16x2(lw[step] >> 16), e4m3x2_to_bf16x2(hw[step] >> 16)};
                    mma_bf16(part, a, xw[2 * step], xw[2 * step + 1]);
                }
                acc[u][0] = fmaf(part[0], slo[u], acc[u][0]);
                acc[u][1] = fmaf(part[1], slo[u], acc[u][1]);
                acc[u][2] = fmaf(part[2], shi[u], acc[u][2]);
                acc[u][3] = fmaf(part[3], shi[u], acc[u][3]);
            }
        }
        float d[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            d[e] = acc[0][e];
#pragma unroll
            for (int u = 1; u < FP8_PIECES; ++u) d[e] += acc[u][e];
        }
        // d: A rows g (0, 1) and g + 8 (2, 3) by tokens 2q and 2q + 1.
        if (ksplit == 1) {
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
#pragma unroll
            for (int i = 0; i < 4; ++i) partial[warp][g + (i / 2) * 8][2 * q + i % 2] = d[i];
            __syncthreads();
            for (int i = tid; i < groups * TILE_OUT * M; i += blockDim.x) {
                int gg = i / (TILE_OUT * M), r = (i / M) % TILE_OUT, m = i % M;
                float v = 0.0f, up = 0.0f;
                for (int sl = 0; sl < ksplit; ++sl) {
                    v += partial[gg * ksplit + sl][r][m];
                    if (OUT == OUT_SILU) up += partial[gg * ksplit + sl][r + 8][m];
                }
                gemv_fp8_store<OUT>(out, bias, N, (tile0 + gg) * TILE_OUT + r, m, mcount, v, up);
            }
            __syncthreads();
        }
    }
}

#define GEMV_FP8_FUSED_KERNEL(NAME, M, IN, OUT)                                                                  \
    extern "C" __global__ void __launch_bounds__(256, 3) NAME##_m##M##_fp8(                                     \
        const unsigned char* W, const float* scales, int N, int K, int ksplit, const void* in, const int* rows,  \
        const bf16* norm_w, float eps, void* out, const bf16* bias, int mcount) {                                \
        gemv_mma_fp8<M, IN, OUT>(W, scales, N, K, ksplit, in, rows, norm_w, eps, out, bias, mcount);            \
    }
#define GEMV_FP8_FUSED_ALL_M(NAME, IN, OUT)                                         \
    GEMV_FP8_FUSED_KERNEL(NAME, 1, IN, OUT) GEMV_FP8_FUSED_KERNEL(NAME, 2, IN, OUT) \
    GEMV_FP8_FUSED_KERNEL(NAME, 4, IN, OUT) GEMV_FP8_FUSED_KERNEL(NAME, 8, IN, OUT)
#if KERNEL_GROUP(1)
GEMV_FP8_FUSED_ALL_M(gemv_norm_bf16, IN_NORM, OUT_BF16)
GEMV_FP8_FUSED_ALL_M(gemv_norm_f32, IN_NORM, OUT_F32)
GEMV_FP8_FUSED_ALL_M(gemv_norm_silu, IN_NORM, OUT_SILU)
GEMV_FP8_FUSED_ALL_M(gemv_bf16_add, IN_BF16, OUT_ADD)
#endif
