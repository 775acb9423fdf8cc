// Part of the kernel source (cuda::KERNEL_SOURCE, after common.cuh): decode projections.

// ---------------------------------------------------------------------------------------------
// Decode projections (a few tokens): y[m, n] = sum_k x[m, k] * W[n, k] for m < mcount <= M.
// At batch 1-8 a projection is a stream over its weight matrix, so the kernel keeps many 16-byte
// weight loads in flight per thread and folds the small kernels around the projection into it:
// the input row(s) are formed in shared memory by a prologue that every block repeats (cheap:
// they come from L2), and the result leaves through an epilogue.
//   IN_BF16: x = bf16 rows of `in` ([mcount][K]).
//   IN_NORM: x = bf16(rms_norm(res[r]) * norm_w), res the f32 residual stream, r = rows[m] (or
//            m when rows is null): the RMSNorm in front of qkv / gate-up / the output head.
//   OUT_BF16: y -> bf16 [mcount][N]; OUT_F32: y -> f32 (logits); OUT_ADD: res[m, n] += y, the
//            residual add (each element has exactly one writer, so no race); OUT_SILU: rows come
//            in (gate, up) pairs (see interleave_rows) and act[m, n / 2] = bf16(silu(bf16(gate))
//            * bf16(up)) -> bf16 [mcount][N / 2]: SiLU-and-multiply behind gate/up.
// The rounding points are those of the unfused path (norm / activation outputs in bf16), and a
// row's arithmetic does not depend on mcount, so a padded CUDA-graph step gives the same values.
// A group of `ksplit` warps (1, 2, 4 or 8) owns GEMV_ROWS output rows at a time, each warp one
// slice of K read 8 elements per lane per load; slices are added in a fixed order, so results
// do not vary between runs. Block: 256. Dynamic shared memory: M * K * 2 bytes. K % 8 == 0.
#define IN_BF16 0
#define IN_NORM 1
#define OUT_BF16 0
#define OUT_F32 1
#define OUT_ADD 2
#define OUT_SILU 3
#define GEMV_ROWS 2
#define GEMV_UNROLL 4

// 16 bytes of a weight row, read once per step: through the read-only path, not kept in L1.
__device__ __forceinline__ uint4 ld_stream(const bf16* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// Stores row n of token m of a decode projection (see OUT_*), bias added. OUT_SILU: n is even
// and `up` row n + 1's sum.
template <int OUT>
__device__ __forceinline__ void gemv_store(void* out, const bf16* bias, int N, int n, int m, int mcount, float v,
                                           float up = 0.0f) {
    if (n >= N || m >= mcount) return;
    if (OUT == OUT_SILU) {
        if (bias) {
            v += bf2f(bias[n]);
            up += bf2f(bias[n + 1]);
        }
        reinterpret_cast<bf16*>(out)[(u64)m * (N / 2) + n / 2] =
            (bf16)(silu_mul_pack(f2bf(v), f2bf(up)) & 0xffffu);
        return;
    }
    if (bias) v += bf2f(bias[n]);
    u64 i = (u64)m * N + n;
    if (OUT == OUT_BF16) reinterpret_cast<bf16*>(out)[i] = f2bf(v);
    else if (OUT == OUT_F32) reinterpret_cast<float*>(out)[i] = v;
    else reinterpret_cast<float*>(out)[i] = residual_add(reinterpret_cast<float*>(out)[i], v);
}

// 16 read-only bytes through the non-coherent path. The prologue's inputs are never written
// while the kernel runs, and these loads (unlike plain ones through a generic pointer) may be
// issued as a batch ahead of the shared-memory stores between them.
__device__ __forceinline__ uint4 ld_nc16(const void* p) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// Forms input row m of a decode projection in shared memory (see IN_*). Loads go out in
// batches before any is used: the prologue is a few round trips to L2, not one per element.
// IN_NORM reads its row in pieces of NORM_PIECE_J * 4 * blockDim elements (3072 for 256
// threads): the first piece stays in registers, so a row that fits (Qwen3-4B's 2560) is read
// once; longer rows sum their other pieces and read them again (from L1) to scale them. A
// bigger piece puts the kernel's first weight loads behind twice the code.
constexpr int NORM_PIECE_J = 3;
template <int IN>
__device__ __forceinline__ void gemv_prologue(bf16* xm, int K, const void* in, const int* rows, const bf16* norm_w,
                                              float eps, int m, int mcount, float* scratch) {
    int tid = threadIdx.x, nt = blockDim.x;
    auto ld_in = [](const void* p) { return ld_nc16(p); };
    if (m >= mcount) {
        for (int i = tid * 8; i < K; i += nt * 8) *reinterpret_cast<uint4*>(xm + i) = make_uint4(0, 0, 0, 0);
    } else if (IN == IN_BF16) {
        const bf16* src = reinterpret_cast<const bf16*>(in) + (u64)m * K;
        for (int seg = 0; seg < K; seg += nt * 64) {
            uint4 v[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                int i = seg + (tid + j * nt) * 8;
                if (i < K) v[j] = ld_in(src + i);
            }
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                int i = seg + (tid + j * nt) * 8;
                if (i < K) *reinterpret_cast<uint4*>(xm + i) = v[j];
            }
        }
    } else if (IN == IN_NORM) {
        int r = rows ? rows[m] : m;
        const float* src = reinterpret_cast<const float*>(in) + (u64)r * K;
        const int piece = NORM_PIECE_J * 4 * nt;
        auto load = [&](int seg, float4 (&v)[NORM_PIECE_J], uint2 (&w)[NORM_PIECE_J]) {
#pragma unroll
            for (int j = 0; j < NORM_PIECE_J; ++j) {
                int i = seg + (tid + j * nt) * 4;
                if (i < K) {
                    uint4 raw = ld_in(src + i);
                    v[j] = make_float4(__uint_as_float(raw.x), __uint_as_float(raw.y), __uint_as_float(raw.z),
                                       __uint_as_float(raw.w));
                    w[j] = *reinterpret_cast<const uint2*>(norm_w + i);
                }
            }
        };
        auto squares = [&](int seg, const float4 (&v)[NORM_PIECE_J]) {
            float ss = 0.0f;
#pragma unroll
            for (int j = 0; j < NORM_PIECE_J; ++j)
                if (seg + (tid + j * nt) * 4 < K)
                    ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
            return ss;
        };
        auto store = [&](int seg, const float4 (&v)[NORM_PIECE_J], const uint2 (&w)[NORM_PIECE_J], float inv) {
#pragma unroll
            for (int j = 0; j < NORM_PIECE_J; ++j) {
                int i = seg + (tid + j * nt) * 4;
                if (i < K)
                    *reinterpret_cast<uint2*>(xm + i) =
                        make_uint2(norm_pack(v[j].x, v[j].y, inv, w[j].x), norm_pack(v[j].z, v[j].w, inv, w[j].y));
            }
        };
        float4 v[NORM_PIECE_J], rest[NORM_PIECE_J];
        uint2 w[NORM_PIECE_J], rest_w[NORM_PIECE_J];
        load(0, v, w);
        float ss = squares(0, v);
        for (int seg = piece; seg < K; seg += piece) {
            load(seg, rest, rest_w);
            ss += squares(seg, rest);
        }
        ss = block_sum(ss, scratch);
        float inv = rsqrtf(ss / (float)K + eps);
        store(0, v, w, inv);
        for (int seg = piece; seg < K; seg += piece) {
            load(seg, rest, rest_w);
            store(seg, rest, rest_w, inv);
        }
    }
}

template <int M, int IN, int OUT, bool PIPE>
__device__ __forceinline__ void gemv(const bf16* __restrict__ W, int N, int K, int ksplit, const void* in,
                                     const int* rows, const bf16* norm_w, float eps, void* out, const bf16* bias,
                                     int mcount) {
    extern __shared__ __align__(16) unsigned char gemv_smem[];
    __shared__ float scratch[32];
    __shared__ float partial[8][GEMV_ROWS][M];
    bf16* xs = reinterpret_cast<bf16*>(gemv_smem);
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    // The block's 8 warps form groups of `ksplit`: a group owns GEMV_ROWS rows, each of its
    // warps one slice of K (short, wide matrices need the extra loads in flight).
    int groups = 8 / ksplit, grp = warp / ksplit, slice = warp % ksplit;
    int rows_per_block = groups * GEMV_ROWS;
    int slice_len = ((K / 8 + ksplit - 1) / ksplit) * 8;
    int k_begin = slice * slice_len, k_end = min(K, k_begin + slice_len);
    int row_base = blockIdx.x * rows_per_block;
    // PIPE: two register buffers, so that while one batch is multiplied the next is in flight
    // (the rest of this row group's slice, or the block's next row group), and the first batch
    // goes out before the prologue. Otherwise one buffer, loaded at the top of each batch (the
    // first batch's first slice before the prologue, below): fewer registers, more warps per
    // multiprocessor.
    uint4 wv[GEMV_UNROLL][GEMV_ROWS], nx[GEMV_UNROLL][GEMV_ROWS];
    // Loads slices [u_from, u_to) of a batch.
    auto load_slices = [&](uint4 (&dst)[GEMV_UNROLL][GEMV_ROWS], int n0, int base, int u_from, int u_to) {
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u)
#pragma unroll
            for (int r = 0; r < GEMV_ROWS; ++r)
                if (u >= u_from && u < u_to && base + u * 256 < k_end)
                    dst[u][r] = ld_stream(W + (u64)min(n0 + r, N - 1) * K + base + u * 256);
    };
    auto load_batch = [&](uint4 (&dst)[GEMV_UNROLL][GEMV_ROWS], int n0, int base) {
        load_slices(dst, n0, base, 0, GEMV_UNROLL);
    };
    int stride = gridDim.x * rows_per_block;
    // The pipelined build's first batch of weights goes out before waiting on the previous
    // kernel (weights are never written).
    if (PIPE) load_batch(wv, row_base + grp * GEMV_ROWS, k_begin + lane * 8);
    // The plain build issues the first slice of its first batch before the prologue too (8
    // registers), so the memory streams while the prologue's round trips run. More would spill
    // in the prologue and queue more bytes ahead of its reads.
    constexpr int EARLY_U = PIPE ? 0 : 1;
    if (EARLY_U > 0) load_slices(wv, row_base + grp * GEMV_ROWS, k_begin + lane * 8, 0, EARLY_U);
    int early_left = EARLY_U;  // slices of the next batch already in wv
    PDL_ENTER();
    for (int m = 0; m < M; ++m) gemv_prologue<IN>(xs + (u64)m * K, K, in, rows, norm_w, eps, m, mcount, scratch);
    __syncthreads();
    for (; row_base < N; row_base += stride) {
        int n0 = row_base + grp * GEMV_ROWS;
        float acc[GEMV_ROWS][M];
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; ++r)
#pragma unroll
            for (int m = 0; m < M; ++m) acc[r][m] = 0.0f;
        for (int base = k_begin + lane * 8; base < k_end; base += 256 * GEMV_UNROLL) {
            if (PIPE) {
                if (base + 256 * GEMV_UNROLL < k_end) load_batch(nx, n0, base + 256 * GEMV_UNROLL);
                else if (row_base + stride < N) load_batch(nx, row_base + stride + grp * GEMV_ROWS, k_begin + lane * 8);
            } else {
                load_slices(wv, n0, base, early_left, GEMV_UNROLL);
                early_left = 0;
            }
#pragma unroll
            for (int u = 0; u < GEMV_UNROLL; ++u) {
                int k = base + u * 256;
                if (k < k_end) {
                    float wf[GEMV_ROWS][8];
#pragma unroll
                    for (int r = 0; r < GEMV_ROWS; ++r) unpack8(wv[u][r], wf[r]);
#pragma unroll
                    for (int m = 0; m < M; ++m) {
                        float xf[8];
                        unpack8(*reinterpret_cast<const uint4*>(xs + (u64)m * K + k), xf);
#pragma unroll
                        for (int r = 0; r < GEMV_ROWS; ++r)
#pragma unroll
                            for (int j = 0; j < 8; ++j) acc[r][m] = fmaf(wf[r][j], xf[j], acc[r][m]);
                    }
                }
            }
            if (PIPE) {
#pragma unroll
                for (int u = 0; u < GEMV_UNROLL; ++u)
#pragma unroll
                    for (int r = 0; r < GEMV_ROWS; ++r) wv[u][r] = nx[u][r];
            }
        }
        // Sum each row over the warp, then over the group's K slices in slice order. OUT_SILU
        // stores the pair of rows (gate, up) as one value.
        constexpr int R_OUT = OUT == OUT_SILU ? 1 : GEMV_ROWS;
#pragma unroll
        for (int r = 0; r < GEMV_ROWS; ++r)
#pragma unroll
            for (int m = 0; m < M; ++m) acc[r][m] = warp_sum(acc[r][m]);
#pragma unroll
        for (int r = 0; r < R_OUT; ++r)
#pragma unroll
            for (int m = 0; m < M; ++m) {
                if (lane == ((r * M + m) & 31)) {
                    if (ksplit == 1) gemv_store<OUT>(out, bias, N, n0 + r, m, mcount, acc[r][m], acc[GEMV_ROWS - 1][m]);
                    else
#pragma unroll
                        for (int rr = r; rr < (OUT == OUT_SILU ? GEMV_ROWS : r + 1); ++rr) partial[warp][rr][m] = acc[rr][m];
                }
            }
        if (ksplit > 1) {
            __syncthreads();
            if (tid < groups * R_OUT * M) {
                int g = tid / (R_OUT * M), r = (tid / M) % R_OUT, m = tid % M;
                float v = 0.0f, up = 0.0f;
                for (int s = 0; s < ksplit; ++s) {
                    v += partial[g * ksplit + s][r][m];
                    if (OUT == OUT_SILU) up += partial[g * ksplit + s][1][m];
                }
                gemv_store<OUT>(out, bias, N, row_base + g * GEMV_ROWS + r, m, mcount, v, up);
            }
            __syncthreads();
        }
    }
}

#define GEMV_KERNEL(NAME, M, IN, OUT, PIPE, MIN_BLOCKS)                                                       \
    extern "C" __global__ void __launch_bounds__(256, MIN_BLOCKS) NAME(                                          \
        const bf16* W, int N, int K, int ksplit, const void* in, const int* rows, const bf16* norm_w, float eps, \
        void* out, const bf16* bias, int mcount) {                                                              \
        gemv<M, IN, OUT, PIPE>(W, N, K, ksplit, in, rows, norm_w, eps, out, bias, mcount);                       \
    }
#define GEMV_ALL_M(NAME, IN, OUT)                          \
    GEMV_KERNEL(NAME##_m1, 1, IN, OUT, false, 4)           \
    GEMV_KERNEL(NAME##_m2, 2, IN, OUT, false, 3)           \
    GEMV_KERNEL(NAME##_m4, 4, IN, OUT, false, 2)           \
    GEMV_KERNEL(NAME##_m8, 8, IN, OUT, false, 2)           \
    GEMV_KERNEL(NAME##_m1_pipe, 1, IN, OUT, true, 2)       \
    GEMV_KERNEL(NAME##_m2_pipe, 2, IN, OUT, true, 2)       \
    GEMV_KERNEL(NAME##_m4_pipe, 4, IN, OUT, true, 2)       \
    GEMV_KERNEL(NAME##_m8_pipe, 8, IN, OUT, true, 2)
#if KERNEL_GROUP(1)
GEMV_ALL_M(gemv_norm_bf16, IN_NORM, OUT_BF16)
GEMV_ALL_M(gemv_norm_f32, IN_NORM, OUT_F32)
#endif
#if KERNEL_GROUP(2)
GEMV_ALL_M(gemv_norm_silu, IN_NORM, OUT_SILU)
GEMV_ALL_M(gemv_bf16_add, IN_BF16, OUT_ADD)
#endif

// ---------------------------------------------------------------------------------------------
// Decode projection on tensor cores (`GemvBuild::Mma`): a warp owns 16
// rows (mma.sync m16n8k16, the weight tile as A, up to 8 tokens' inputs as B), its lanes each
// load 16 bytes of two rows (g and g + 8, g = lane / 4) per 32 columns and use them as A
// fragments as they are: the mma's k order is a permutation of the columns, and B takes the
// same columns of each token's input, so each 32 columns cost two 16-byte loads, one shared
// memory load and two mma instructions per lane instead of sixteen FMAs and the unpacking.
// Sums come out whole per row (no warp shuffles); K slices of ksplit warps add in slice order,
// and a token's sums never depend on the other tokens (B's columns are independent).
#define MMA_ROWS 16
#define MMA_UNROLL 4
template <int M, int IN, int OUT>
__device__ __forceinline__ void gemv_mma(const bf16* __restrict__ W, int N, int K, int ksplit, const void* in,
                                         const int* rows, const bf16* norm_w, float eps, void* out,
                                         const bf16* bias, int mcount) {
    extern __shared__ __align__(16) unsigned char gemv_smem[];
    __shared__ float scratch[32];
    __shared__ float partial[8][MMA_ROWS][8];
    bf16* xs = reinterpret_cast<bf16*>(gemv_smem);
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, q = lane & 3;
    int groups = 8 / ksplit, grp = warp / ksplit, slice = warp % ksplit;
    int rows_per_block = groups * MMA_ROWS;
    // Slices of whole 32-column pieces, so a lane's 8 columns never straddle two slices.
    int slice_len = ((K + 31) / 32 + ksplit - 1) / ksplit * 32;
    int k_begin = slice * slice_len, k_end = min(K, k_begin + slice_len);
    PDL_ENTER();
    for (int m = 0; m < M; ++m) gemv_prologue<IN>(xs + (u64)m * K, K, in, rows, norm_w, eps, m, mcount, scratch);
    __syncthreads();
    const bf16* xrow = xs + (u64)(g < M ? g : 0) * K;
    int stride = gridDim.x * rows_per_block;
    for (int row_base = blockIdx.x * rows_per_block; row_base < N; row_base += stride) {
        int n0 = row_base + grp * MMA_ROWS;
        const bf16* w_lo = W + (u64)min(n0 + g, N - 1) * K;
        const bf16* w_hi = W + (u64)min(n0 + g + 8, N - 1) * K;
        // Piece p of the slice goes into acc[p % MMA_UNROLL] (independent chains), added up in
        // order at the end. The trip count is the warp's (mma.sync needs every lane); lanes past
        // K load zeros.
        float acc[MMA_UNROLL][4];
#pragma unroll
        for (int u = 0; u < MMA_UNROLL; ++u)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[u][e] = 0.0f;
        for (int kb = k_begin; kb < k_end; kb += 32 * MMA_UNROLL) {
            int base = kb + q * 8;
            uint4 lo[MMA_UNROLL], hi[MMA_UNROLL];
#pragma unroll
            for (int u = 0; u < MMA_UNROLL; ++u) {
                int k = base + u * 32;
                if (k < k_end) {
                    lo[u] = ld_stream(w_lo + k);
                    hi[u] = ld_stream(w_hi + k);
                } else {
                    lo[u] = make_uint4(0, 0, 0, 0);
                    hi[u] = make_uint4(0, 0, 0, 0);
                }
            }
#pragma unroll
            for (int u = 0; u < MMA_UNROLL; ++u) {
                int k = base + u * 32;
                uint4 xv = g < M && k < k_end ? *reinterpret_cast<const uint4*>(xrow + k) : make_uint4(0, 0, 0, 0);
                u32 a0[4] = {lo[u].x, hi[u].x, lo[u].y, hi[u].y};
                mma_bf16(acc[u], a0, xv.x, xv.y);
                u32 a1[4] = {lo[u].z, hi[u].z, lo[u].w, hi[u].w};
                mma_bf16(acc[u], a1, xv.z, xv.w);
            }
        }
        float d[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            d[e] = acc[0][e];
#pragma unroll
            for (int u = 1; u < MMA_UNROLL; ++u) d[e] += acc[u][e];
        }
        // d: rows g and g + 8, tokens 2q and 2q + 1. OUT_SILU: the (gate, up) pair of rows
        // 2i, 2i + 1 sits in lanes l (g even) and l + 4.
        float up[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) up[i] = __shfl_down_sync(0xffffffffu, d[i], 4);
        if (ksplit == 1) {
            if (OUT != OUT_SILU || g % 2 == 0) {
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    gemv_store<OUT>(out, bias, N, n0 + g + (i / 2) * 8, 2 * q + i % 2, mcount, d[i], up[i]);
            }
        } else {
#pragma unroll
            for (int i = 0; i < 4; ++i) partial[warp][g + (i / 2) * 8][2 * q + i % 2] = d[i];
            __syncthreads();
            for (int i = tid; i < groups * MMA_ROWS * M; i += blockDim.x) {
                int gg = i / (MMA_ROWS * M), r = (i / M) % MMA_ROWS, m = i % M;
                if (OUT == OUT_SILU && r % 2 == 1) continue;
                float v = 0.0f, u = 0.0f;
                for (int sl = 0; sl < ksplit; ++sl) {
                    v += partial[gg * ksplit + sl][r][m];
                    if (OUT == OUT_SILU) u += partial[gg * ksplit + sl][r + 1][m];
                }
                gemv_store<OUT>(out, bias, N, row_base + gg * MMA_ROWS + r, m, mcount, v, u);
            }
            __syncthreads();
        }
    }
}

#define GEMV_MMA_KERNEL(NAME, M, IN, OUT)                                                                        \
    extern "C" __global__ void __launch_bounds__(256, 3) NAME##_m##M##_mma(                                     \
        const bf16* W, int N, int K, int ksplit, const void* in, const int* rows, const bf16* norm_w, float eps, \
        void* out, const bf16* bias, int mcount) {                                                              \
        gemv_mma<M, IN, OUT>(W, N, K, ksplit, in, rows, norm_w, eps, out, bias, mcount);                         \
    }
#define GEMV_MMA_ALL_M(NAME, IN, OUT) \
    GEMV_MMA_KERNEL(NAME, 1, IN, OUT) \
    GEMV_MMA_KERNEL(NAME, 2, IN, OUT) GEMV_MMA_KERNEL(NAME, 4, IN, OUT) GEMV_MMA_KERNEL(NAME, 8, IN, OUT)
#if KERNEL_GROUP(5)
GEMV_MMA_ALL_M(gemv_norm_bf16, IN_NORM, OUT_BF16)
GEMV_MMA_ALL_M(gemv_norm_f32, IN_NORM, OUT_F32)
GEMV_MMA_ALL_M(gemv_norm_silu, IN_NORM, OUT_SILU)
GEMV_MMA_ALL_M(gemv_bf16_add, IN_BF16, OUT_ADD)
#endif

// ---------------------------------------------------------------------------------------------
// Decode projection, bulk build (bf16 input -> residual add: the o projection). Each block's
// BULK_ROWS weight rows are copied whole into shared memory (cp.async.bulk, one per row) as the
// block starts, *before* it waits on the previous kernel: launched with programmatic dependent
// launch after the decode attention (which lets dependents launch as it enters), the blocks are
// resident and their weights streaming while the attention runs, when the memory would
// otherwise idle; once the attention is done only the multiply and the residual add are left.
// Tensor cores: the weight rows are mma's B operand (n = 8 rows), up to 8 tokens its A
// operand; warp w sums K slice w (K / 8 columns) into four accumulators taken in turn by k16
// step, added in order, and the block adds the warps' slices in warp order. A token's sums do
// not depend on the other tokens. K % 256 == 0. Dynamic shared memory: (BULK_ROWS + tokens)
// rows of 2K + 16 bytes (the 16 put consecutive rows in distinct banks).
#define BULK_ROWS 8
#if KERNEL_GROUP(2)
extern "C" __global__ void __launch_bounds__(256) gemv_bulk_add(const bf16* W, int N, int K, const bf16* in,
                                                                float* out, const bf16* bias, int mcount,
                                                                int early_rows) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) unsigned char bulk_smem[];
    __shared__ __align__(8) u64 bar;
    __shared__ float partial[8][8][BULK_ROWS];
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, q = lane & 3;
    u32 stride = (u32)K * 2 + 16;
    unsigned char* ws = bulk_smem;
    unsigned char* xs = bulk_smem + BULK_ROWS * stride;
    int row0 = blockIdx.x * BULK_ROWS, rows = min(BULK_ROWS, N - row0);
    u32 bar_s = (u32)__cvta_generic_to_shared(&bar);
    // The phase completes when all of the block's rows have landed, whenever each was issued.
    if (tid == 0) mbar_expect(bar_s, rows * K * 2);
    // Weights are never written: no need to wait on the previous kernel for them. The first
    // `early_rows` rows go before the wait, the rest after it: a stream at full rate under the
    // attention slows the attention's own round trips to memory.
    auto copy_rows = [&](int from, int to) {
        if (tid == 0)
            for (int r = from; r < to; ++r)
                bulk_copy((u32)__cvta_generic_to_shared(ws + r * stride), W + (u64)(row0 + r) * K, K * 2, bar_s);
    };
    int early = min(max(early_rows, 0), rows);
    copy_rows(0, early);
    PDL_ENTER();
    copy_rows(early, rows);
    for (int i = tid * 8; i < mcount * K; i += 256 * 8)
        *reinterpret_cast<uint4*>(xs + (i / K) * stride + (i % K) * 2) = ld_nc16(in + i);
    __syncthreads();
    // The copies always complete (valid addresses, sizes within the row); the wait is bounded
    // anyway: past a second something is broken, and the launch fails instead of hanging.
    for (u64 t0 = global_ns(); !mbar_try(bar_s, 0);)
        if (global_ns() - t0 > 1000000000ull) __trap();
    int slice = K / 8, k0 = warp * slice;
    float acc[4][4];
#pragma unroll
    for (int a_ = 0; a_ < 4; ++a_)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[a_][e] = 0.0f;
    // ldmatrix.x4: lanes 8j..8j+7 address rows 0-7 of the 8 columns at +8j (two k16 steps).
    const unsigned char* wrow = ws + (lane & 7) * stride + (lane >> 3) * 16;
    const unsigned char* xrow = xs + g * stride + q * 4;
    bool has_token = g < mcount;
    // 64 columns a trip: k16 step s of the slice into acc[s % 4].
    for (int kk = k0; kk < k0 + slice; kk += 64) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            int kh = kk + half * 32;
            if (kh >= k0 + slice) break;
            u32 b[4];
            ldmatrix_x4(b, reinterpret_cast<const bf16*>(wrow + kh * 2));
            u32 a0[4] = {0, 0, 0, 0}, a1[4] = {0, 0, 0, 0};
            if (has_token) {
                const unsigned char* xp = xrow + kh * 2;
                a0[0] = *reinterpret_cast<const u32*>(xp);
                a0[2] = *reinterpret_cast<const u32*>(xp + 16);
                a1[0] = *reinterpret_cast<const u32*>(xp + 32);
                a1[2] = *reinterpret_cast<const u32*>(xp + 48);
            }
            mma_bf16(acc[2 * half], a0, b[0], b[1]);
            mma_bf16(acc[2 * half + 1], a1, b[2], b[3]);
        }
    }
    // Lane (g, q) holds token g's sums of rows 2q and 2q + 1.
    partial[warp][g][2 * q] = ((acc[0][0] + acc[1][0]) + acc[2][0]) + acc[3][0];
    partial[warp][g][2 * q + 1] = ((acc[0][1] + acc[1][1]) + acc[2][1]) + acc[3][1];
    __syncthreads();
    if (tid < mcount * BULK_ROWS) {
        int m = tid / BULK_ROWS, r = tid % BULK_ROWS;
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < 8; ++w) v += partial[w][m][r];
        if (r < rows) gemv_store<OUT_ADD>(out, bias, N, row0 + r, m, mcount, v);
    }
#endif
}
#endif

// ---------------------------------------------------------------------------------------------
// Batch-invariant skinny product (`--batch-invariant`, at most 16 rows):
// y[t, n] = x[t, k] · W[n, k]ᵀ with the bits of the unsplit cuBLASLt product that serves every
// other row count (cuda/invariant.rs): each output is one chain of m16n8k16 mma steps over K,
// 16 columns at a time in ascending order, f32 accumulation, rounded once. K is never split (a
// split would change the order of the sums, and so the bits), so a block's time is its chain:
// nothing else may wait in it. A one-warp block owns 8 weight rows (mma's B operand; the tokens
// are A, T16: tokens 8-15 too) and keeps STAGES stages of 256 columns in flight as bulk copies,
// one row per lane, counted on the stage's mbarrier. The weights' copies start before the
// programmatic-launch wait (nothing writes them), so they stream while the previous kernel
// ends. Fragments are double-buffered in registers: stage s + 1's are loaded between stage s's
// mma steps, and a slot is refilled as soon as its fragments are in use. Shared memory: per
// stage the 8 weight rows and the t token rows, each SKINNY_ROW_BYTES (16 bytes of padding put
// ldmatrix's eight rows in distinct banks), then one zero row that stands for the tokens past
// t. K % 64 == 0 (whole 128-byte row pieces); dynamic shared memory: skinny_smem_bytes(t, STAGES).
// With `slices` > 1, K is cut into that many equal slices (each a multiple of 64 columns) and
// grid.y blocks take one each, writing f32 partial products [slice, t, N]: each slice's chain is
// then the unsplit cuBLASLt product of its columns (the strided batch of cuda/invariant.rs), and
// the consumer adds the slices in order (add_rms_norm's `parts`). The slice count is fixed by
// the shape alone, so every row count gets the same sums.
#define SKINNY_COLS 256
#define SKINNY_PIECES (SKINNY_COLS / 32)
#define SKINNY_ROW_BYTES (SKINNY_COLS * 2 + 16)

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// ldmatrix.x4 at this lane's row address: f[j] = (row g, columns 8j + 2q and 8j + 2q + 1).
__device__ __forceinline__ void skinny_frag(u32* f, u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(f[0]), "=r"(f[1]), "=r"(f[2]), "=r"(f[3])
                 : "r"(addr));
}

__device__ __forceinline__ void mbar_arrive_expect(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// Waits for phase `parity` of the barrier at `bar`. The copies always complete (valid addresses
// and sizes); the wait is bounded anyway: past a second something is broken, and the launch
// fails instead of hanging. The clock is read only once the first try has failed.
__device__ __forceinline__ void skinny_wait(u32 bar, u32 parity) {
    if (mbar_try(bar, parity)) return;
    for (u64 t0 = global_ns(); !mbar_try(bar, parity);)
        if (global_ns() - t0 > 1000000000ull) __trap();
}

// Where one stage of the skinny product lives, and how its copies are made; DEPTH (a power of
// two) stages in flight.
template <int DEPTH>
struct SkinnyStages {
    static constexpr int depth = DEPTH;
    const bf16* W;
    const bf16* X;
    // K: the columns this block sums (its slice); ld: the row stride of W and X.
    int K, ld, n0, rows_w, t, stages;
    u32 base, zero_row, bars, lane;

    __device__ __forceinline__ u32 slot(int s) const { return base + (s & (DEPTH - 1)) * (8 + t) * SKINNY_ROW_BYTES; }
    __device__ __forceinline__ u32 bar(int s) const { return bars + (s & (DEPTH - 1)) * 8; }
    __device__ __forceinline__ u32 bytes(int s) const { return (u32)min(SKINNY_COLS, K - s * SKINNY_COLS) * 2; }
    // Lane 0 arms stage s's barrier for all its bytes (before any copy of it is issued).
    __device__ __forceinline__ void expect(int s) const {
        if (s < stages && lane == 0) mbar_arrive_expect(bar(s), bytes(s) * (rows_w + t));
    }
    // Lane r < 8 copies weight row n0 + r (if there is one).
    __device__ __forceinline__ void copy_weights(int s) const {
        if (s < stages && (int)lane < rows_w)
            bulk_copy(slot(s) + lane * SKINNY_ROW_BYTES, W + (u64)(n0 + lane) * ld + s * SKINNY_COLS, bytes(s), bar(s));
    }
    // Lane 8 + m copies token row m < t.
    __device__ __forceinline__ void copy_tokens(int s) const {
        int m = (int)lane - 8;
        if (s < stages && m >= 0 && m < t)
            bulk_copy(slot(s) + lane * SKINNY_ROW_BYTES, X + (u64)m * ld + s * SKINNY_COLS, bytes(s), bar(s));
    }
    // Lane addresses of stage s's fragments in its slot: the weight rows (B), tokens 0-7 and
    // tokens 8-15 (A; the zero row past t).
    __device__ __forceinline__ void frag_addrs(int s, u32& w, u32& x, u32& h) const {
        int row = lane & 7;
        u32 chunk = (lane >> 3) * 16, at = slot(s);
        w = at + row * SKINNY_ROW_BYTES + chunk;
        x = row < t ? at + (8 + row) * SKINNY_ROW_BYTES + chunk : zero_row + chunk;
        h = row + 8 < t ? at + (16 + row) * SKINNY_ROW_BYTES + chunk : zero_row + chunk;
    }
};

// Piece p (32 columns) of a stage's fragments.
template <int T16>
__device__ __forceinline__ void skinny_load(int p, u32 w, u32 x, u32 h, u32 (&fw)[SKINNY_PIECES][4],
                                            u32 (&fx)[SKINNY_PIECES][4], u32 (&fh)[SKINNY_PIECES][4]) {
    skinny_frag(fw[p], w + p * 64);
    skinny_frag(fx[p], x + p * 64);
    if (T16) skinny_frag(fh[p], h + p * 64);
    else fh[p][0] = fh[p][1] = fh[p][2] = fh[p][3] = 0u;
}

// Piece p's two mma steps: columns 32p..32p+15, then 32p+16..32p+31.
__device__ __forceinline__ void skinny_mma(int p, float (&acc)[4], const u32 (&fw)[SKINNY_PIECES][4],
                                           const u32 (&fx)[SKINNY_PIECES][4], const u32 (&fh)[SKINNY_PIECES][4]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        u32 a[4] = {fx[p][2 * h], fh[p][2 * h], fx[p][2 * h + 1], fh[p][2 * h + 1]};
        mma_bf16(acc, a, fw[p][2 * h], fw[p][2 * h + 1]);
    }
}

// Stage s's mma steps on the fragments in (cw, cx, ch), with stage s + 1's loaded into
// (nw, nx, nh) between them (a piece's loads beside the next piece's steps, so that the chain
// never waits on them); then stage s's slot takes stage s + depth. A stage has at least two
// pieces (K % 64 == 0).
template <int T16, int DEPTH>
__device__ __forceinline__ void skinny_stage(const SkinnyStages<DEPTH>& st, int s, float (&acc)[4], u32 (&cw)[SKINNY_PIECES][4],
                                             u32 (&cx)[SKINNY_PIECES][4], u32 (&ch)[SKINNY_PIECES][4],
                                             u32 (&nw)[SKINNY_PIECES][4], u32 (&nx)[SKINNY_PIECES][4],
                                             u32 (&nh)[SKINNY_PIECES][4]) {
    int pieces = min(SKINNY_COLS, st.K - s * SKINNY_COLS) / 32;
    skinny_mma(0, acc, cw, cx, ch);
    // Past the last stage the loads read a stale slot, never used: only the wait is skipped.
    if (s + 1 < st.stages) skinny_wait(st.bar(s + 1), ((s + 1) / DEPTH) & 1);
    u32 w, x, h;
    st.frag_addrs(s + 1, w, x, h);
#pragma unroll
    for (int p = 0; p < SKINNY_PIECES; ++p) {
        skinny_load<T16>(p, w, x, h, nw, nx, nh);
        if (p + 1 < SKINNY_PIECES && p + 1 < pieces) skinny_mma(p + 1, acc, cw, cx, ch);
    }
    // The mma steps above hold stage s's fragments, so every lane's reads of its slot are done.
    __syncwarp();
    st.expect(s + st.depth);
    __syncwarp();
    st.copy_weights(s + st.depth);
    st.copy_tokens(s + st.depth);
}

template <int T16, int STAGES>
__device__ __forceinline__ void gemm_skinny(const bf16* __restrict__ W, const bf16* __restrict__ X, void* Y, int N,
                                            int K, int t, int f32_out, int slices) {
    extern __shared__ __align__(128) unsigned char skinny_smem[];
    __shared__ __align__(8) u64 bars[STAGES];
    int lane = threadIdx.x, n0 = blockIdx.x * 8, rows_w = min(8, N - n0);
    int stage_rows = 8 + t;
    int cols = K / slices, slice = blockIdx.y;
    if (slices > 1) {
        W += slice * cols;
        X += slice * cols;
        Y = reinterpret_cast<float*>(Y) + (u64)slice * t * N;
        f32_out = 1;
    }
    u32 base = (u32)__cvta_generic_to_shared(skinny_smem);
    SkinnyStages<STAGES> st{W,
                            X,
                            cols,
                            K,
                            n0,
                            rows_w,
                            t,
                            (cols + SKINNY_COLS - 1) / SKINNY_COLS,
                            base,
                            base + STAGES * stage_rows * SKINNY_ROW_BYTES,
                            (u32)__cvta_generic_to_shared(&bars[0]),
                            (u32)lane};
    // The zero row, and weight rows past N (never copied; their outputs are not stored).
    for (int i = lane; i < SKINNY_ROW_BYTES / 16; i += 32)
        asm volatile("st.shared.v4.u32 [%0], {%1,%1,%1,%1};\n" ::"r"(st.zero_row + i * 16), "r"(0u) : "memory");
    for (int s = 0; s < STAGES && rows_w < 8; ++s)
        for (int i = lane; i < (8 - rows_w) * SKINNY_ROW_BYTES / 16; i += 32)
            asm volatile("st.shared.v4.u32 [%0], {%1,%1,%1,%1};\n" ::"r"(st.slot(s) + rows_w * SKINNY_ROW_BYTES + i * 16),
                         "r"(0u)
                         : "memory");
    if (lane == 0) {
        for (int s = 0; s < STAGES; ++s)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(st.bar(s)) : "memory");
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    }
    __syncwarp();
    for (int s = 0; s < STAGES; ++s) st.expect(s);
    __syncwarp();
    // Nothing writes the weights: their copies may start while the previous kernel runs.
    for (int s = 0; s < STAGES; ++s) st.copy_weights(s);
    PDL_ENTER();
    for (int s = 0; s < STAGES; ++s) st.copy_tokens(s);
    u32 aw[SKINNY_PIECES][4], ax[SKINNY_PIECES][4], ah[SKINNY_PIECES][4];
    u32 bw[SKINNY_PIECES][4], bx[SKINNY_PIECES][4], bh[SKINNY_PIECES][4];
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    skinny_wait(st.bar(0), 0);
    {
        u32 w, x, h;
        st.frag_addrs(0, w, x, h);
#pragma unroll
        for (int p = 0; p < SKINNY_PIECES; ++p) skinny_load<T16>(p, w, x, h, aw, ax, ah);
    }
    for (int s = 0; s < st.stages; s += 2) {
        skinny_stage<T16, STAGES>(st, s, acc, aw, ax, ah, bw, bx, bh);
        if (s + 1 < st.stages) skinny_stage<T16, STAGES>(st, s + 1, acc, bw, bx, bh, aw, ax, ah);
    }
    // acc: tokens g and g + 8 by weight rows n0 + 2q and n0 + 2q + 1.
    int g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        int n = n0 + 2 * q + (e & 1), m = g + (e / 2) * 8;
        if (n >= N || m >= t) continue;
        u64 i = (u64)m * N + n;
        if (f32_out) reinterpret_cast<float*>(Y)[i] = acc[e];
        else reinterpret_cast<bf16*>(Y)[i] = f2bf(acc[e]);
    }
}
#endif

#define GEMM_SKINNY_KERNEL(NAME, T16, STAGES)                                                            \
    extern "C" __global__ void __launch_bounds__(32) NAME(const bf16* W, const bf16* X, void* Y, int N, int K, \
                                                          int t, int f32_out, int slices) {              \
        GEMM_SKINNY_BODY(T16, STAGES);                                                                   \
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define GEMM_SKINNY_BODY(T16, STAGES) gemm_skinny<T16, STAGES>(W, X, Y, N, K, t, f32_out, slices)
#else
#define GEMM_SKINNY_BODY(T16, STAGES)
#endif
#if KERNEL_GROUP(3)
GEMM_SKINNY_KERNEL(gemm_skinny_b8_s2, 0, 2)
GEMM_SKINNY_KERNEL(gemm_skinny_b16_s2, 1, 2)
GEMM_SKINNY_KERNEL(gemm_skinny_b8_s4, 0, 4)
GEMM_SKINNY_KERNEL(gemm_skinny_b16_s4, 1, 4)
GEMM_SKINNY_KERNEL(gemm_skinny_b8_s8, 0, 8)
GEMM_SKINNY_KERNEL(gemm_skinny_b16_s8, 1, 8)
#endif

// ---------------------------------------------------------------------------------------------
// The residual add + RMSNorm in front of a batch-invariant product of at most 8 rows, in one
// kernel (`--batch-invariant`, invariant_fused_norm): y = rms_norm(x + delta) · Wᵀ with the bits
// of add_rms_norm_b128 followed by the unsplit product that serves every other row count
// (cuBLASLt's), so a decode step of few tokens saves the norm's launch and, with `silu`, silu_mul's.
// A block is GROUPS warpgroups of 64 weight rows each. It first makes the t normed rows in shared
// memory (which its warpgroups share)
// by its first 128 threads (block_add_rms_norm_row: the same code and order as
// add_rms_norm_b128; block 0 also writes
// x + delta to x_out, which must not be x: the other blocks still read x), then sums every output
// in one chain of wgmma m64n8k16 steps over K, 16 columns at a time in ascending order: the
// weights as A, the tokens as B (rows past t zero), both K-major with 128-byte swizzling (chunk c
// of a row's 128-byte piece at c ^ (row % 8), atoms 1024-byte aligned), the order cuBLASLt's
// kernels sum in (verify_skinny_norm checks the bits on each GPU before the model uses it). The
// weights stream through each warpgroup's ring of STAGES stages of 64 columns (8 KB) by 16-byte
// copies, the first ones issued before the programmatic-launch wait (nothing writes the
// weights). `silu`: W's rows are gate/up interleaved (interleave_rows) and y is silu_mul's
// [t, N / 2]; else the bf16 product [t, N]. N % (64 GROUPS) == 0, K % 64 == 0,
// K <= 4 * NORM_THREADS * NORM_PIECES. Grid: N / (64 GROUPS). Block: 128 GROUPS.
// Dynamic shared memory: 1024 + K * 16 + GROUPS * STAGES * 8192.
#define WGN_ROWS 64
#define WGN_STAGE_BYTES (WGN_ROWS * 128)

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// d (64 weight rows x 8 tokens, f32) += A (64 x 16) x B (16 x 8), both K-major in shared memory.
__device__ __forceinline__ void wgn_mma(float (&d)[4], u64 a, u64 b) {
    asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\n"
                 "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, %4, %5, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "l"(a), "l"(b)
                 : "memory");
}

// Stage s's 64 columns of the block's 64 weight rows into the swizzled tile at `slot`: four
// 16-byte copies a thread, eight threads a row.
__device__ __forceinline__ void wgn_copy(u32 slot, const bf16* W, int n0, int K, int s) {
#pragma unroll
    for (int j = threadIdx.x & 127; j < WGN_ROWS * 8; j += 128) {
        int row = j >> 3, chunk = j & 7;
        const bf16* src = W + (u64)(n0 + row) * K + s * 64 + chunk * 8;
        u32 dst = slot + row * 128 + ((chunk ^ (row & 7)) << 4);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
    }
}

// A normed row's destination: token row m of the swizzled B tiles at `tokens` (an atom of 8
// rows x 64 columns every 1024 bytes).
struct NormToSwizzled {
    u32 tokens;
    int m;
    __device__ __forceinline__ void operator()(int i, uint2 v) const {
        u32 at = tokens + (i >> 6) * 1024 + m * 128 + ((((i & 63) >> 3) ^ (m & 7)) << 4) + (i & 7) * 2;
        asm volatile("st.shared.v2.u32 [%0], {%1, %2};\n" ::"r"(at), "r"(v.x), "r"(v.y) : "memory");
    }
};

// Stages of products a wgmma ring leaves queued while it refills slots (its chain is one
// accumulator, so only the tensor core's queue hides the refills and barriers between stages):
// two where the ring is deep enough, one otherwise. The ring then runs STAGES - queue stages
// ahead of the products.
template <int STAGES>
struct WgRing {
    static constexpr int queue = STAGES >= 8 ? 2 : 1;
    static constexpr int ahead = STAGES - queue;
};

template <int STAGES, int GROUPS>
__device__ __forceinline__ void gemm_wg_norm(const bf16* __restrict__ W, const float* x, const bf16* delta,
                                             float* x_out, const bf16* norm_w, float eps, bf16* Y, int N, int K,
                                             int t, int silu) {
    extern __shared__ __align__(1024) unsigned char wgn_smem[];
    __shared__ float scratch[NORM_THREADS / 32];
    u32 tokens = ((u32)__cvta_generic_to_shared(wgn_smem) + 1023) & ~1023u;
    int group = threadIdx.x >> 7, stages = K / 64, n0 = (blockIdx.x * GROUPS + group) * WGN_ROWS;
    u32 ring = tokens + stages * 1024 + group * STAGES * WGN_STAGE_BYTES;
    constexpr int AHEAD = WgRing<STAGES>::ahead, QUEUE = WgRing<STAGES>::queue;
    for (int s = 0; s < AHEAD; ++s) {
        if (s < stages) wgn_copy(ring + s * WGN_STAGE_BYTES, W, n0, K, s);
        asm volatile("cp.async.commit_group;\n" ::: "memory");
    }
    // The token rows past t stay zero.
    for (u32 o = threadIdx.x * 16; o < (u32)stages * 1024; o += GROUPS * 128 * 16)
        asm volatile("st.shared.v4.u32 [%0], {%1,%1,%1,%1};\n" ::"r"(tokens + o), "r"(0u) : "memory");
    PDL_ENTER();
    for (int m = 0; m < t; ++m) {
        u64 row = (u64)m * K;
        block_add_rms_norm_row(x + row, delta ? delta + row : 0, blockIdx.x == 0 && x_out ? x_out + row : 0, norm_w,
                               NormToSwizzled{tokens, m}, K, eps, scratch);
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int s = 0; s < stages; ++s) {
        // Stage s's copies (this thread's, then everyone's) are in, and visible to wgmma.
        asm volatile("cp.async.wait_group %0;\n" ::"n"(AHEAD - 1) : "memory");
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        // The warpgroup's own barrier (1 + group; 0 is __syncthreads').
        asm volatile("bar.sync %0, 128;\n" ::"r"(1 + group) : "memory");
        wg_fence();
        u32 a = ring + (s % STAGES) * WGN_STAGE_BYTES, b = tokens + s * 1024;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wgn_mma(d, wg_desc(a + kk * 32, 16, 1024), wg_desc(b + kk * 32, 16, 1024));
        wg_commit();
        // Stage s - QUEUE's products are done in this warp, and after the barrier in every warp
        // of the warpgroup (each waits for its own): its slot takes stage s + AHEAD.
        asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(QUEUE) : "memory");
        asm volatile("bar.sync %0, 128;\n" ::"r"(1 + group) : "memory");
        int next = s + AHEAD;
        if (next < stages) wgn_copy(ring + (next % STAGES) * WGN_STAGE_BYTES, W, n0, K, next);
        asm volatile("cp.async.commit_group;\n" ::: "memory");
    }
    wg_wait_all();
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+f"(d[i])::"memory");
    // d: weight rows r (d[0], d[1]) and r + 8 (d[2], d[3]) by tokens c and c + 1.
    int lane = threadIdx.x & 31, r = 16 * ((threadIdx.x >> 5) & 3) + (lane >> 2), c = 2 * (lane & 3);
    if (silu) {
        // Gate row 2i and up row 2i + 1 sit in lanes four apart.
        float up[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) up[e] = __shfl_xor_sync(0xffffffffu, d[e], 4);
        if ((lane >> 2) & 1) return;
        int inter = N / 2;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            int m = c + (e & 1), i = (n0 + r + (e >> 1) * 8) / 2;
            if (m < t) Y[(u64)m * inter + i] = f2bf(silu_mul_one(round_bf16(d[e]), round_bf16(up[e])));
        }
    } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            int m = c + (e & 1), n = n0 + r + (e >> 1) * 8;
            if (m < t) Y[(u64)m * N + n] = f2bf(d[e]);
        }
    }
}
#endif

#define GEMM_WG_NORM_KERNEL(NAME, STAGES, GROUPS)                                                            \
    extern "C" __global__ void __launch_bounds__(128 * GROUPS)                                               \
        NAME(const bf16* W, const float* x, const bf16* delta, float* x_out, const bf16* norm_w, float eps,  \
             bf16* Y, int N, int K, int t, int silu) {                                                       \
        GEMM_WG_NORM_BODY(STAGES, GROUPS);                                                                   \
    }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GEMM_WG_NORM_BODY(STAGES, GROUPS) \
    gemm_wg_norm<STAGES, GROUPS>(W, x, delta, x_out, norm_w, eps, Y, N, K, t, silu)
#else
#define GEMM_WG_NORM_BODY(STAGES, GROUPS)
#endif
#if KERNEL_GROUP(3)
GEMM_WG_NORM_KERNEL(gemm_wg_norm_s4, 4, 1)
GEMM_WG_NORM_KERNEL(gemm_wg_norm_s8, 8, 1)
GEMM_WG_NORM_KERNEL(gemm_wg_norm_s4_g2, 4, 2)
GEMM_WG_NORM_KERNEL(gemm_wg_norm_s3_g2, 3, 2)
#endif

// ---------------------------------------------------------------------------------------------
// The batch-invariant product of at most 8 rows without a norm in front (o, down and the head
// of such steps, invariant_fused_norm): y = x · Wᵀ with the bits of the unsplit product that
// serves every other row count, in gemm_wg_norm's chain (the weights as A, the tokens as B, one
// wgmma m64n8k16 step per 16 columns in ascending order). One warpgroup a block, 64 weight
// rows; the o and down products have few such blocks (Qwen3-4B: 40), so each keeps a deep ring
// of STAGES stages in flight, a stage the weights' 64 columns (8 KB) and the tokens' (1 KB; rows
// past t zero), all by 16-byte copies. The weights of the first stages (WgRing) are asked for
// before the programmatic-launch wait (nothing writes them), the tokens of those stages by
// plain loads right after it (the previous kernel wrote them; one round trip), and later
// stages' tokens with their weights. N % 64 == 0, K % 64 == 0. Grid: N / 64. Block: 128.
// Dynamic shared memory: 1024 + STAGES * 9216.
#define WGP_STAGE_BYTES (WGN_STAGE_BYTES + 1024)

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Stage s's 64 columns of token row m (of t) into the swizzled 8-row tile at `tile`.
__device__ __forceinline__ void wgp_copy_tokens(u32 tile, const bf16* X, int K, int t, int s) {
    int j = threadIdx.x;
    if (j < t * 8) {
        int m = j >> 3, chunk = j & 7;
        u32 dst = tile + m * 128 + ((chunk ^ m) << 4);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(X + (u64)m * K + s * 64 + chunk * 8)
                     : "memory");
    }
}

template <int STAGES>
__device__ __forceinline__ void gemm_wg(const bf16* __restrict__ W, const bf16* X, void* Y, int N, int K, int t,
                                        int f32_out) {
    extern __shared__ __align__(1024) unsigned char wgp_smem[];
    u32 ring = ((u32)__cvta_generic_to_shared(wgp_smem) + 1023) & ~1023u;
    int stages = K / 64, n0 = blockIdx.x * WGN_ROWS;
    // A stage's slot: the weights' tile, then the tokens'.
    auto weights = [&](int s) { return ring + (s % STAGES) * WGP_STAGE_BYTES; };
    auto tokens = [&](int s) { return weights(s) + WGN_STAGE_BYTES; };
    constexpr int AHEAD = WgRing<STAGES>::ahead, QUEUE = WgRing<STAGES>::queue;
    for (int s = 0; s < AHEAD; ++s) {
        if (s < stages) wgn_copy(weights(s), W, n0, K, s);
        asm volatile("cp.async.commit_group;\n" ::: "memory");
    }
    // The token rows past t stay zero in every slot.
    for (int i = threadIdx.x; i < STAGES * 64; i += 128) {
        int slot = i >> 6, row = (i >> 3) & 7;
        if (row >= t)
            asm volatile("st.shared.v4.u32 [%0], {%1,%1,%1,%1};\n" ::"r"(tokens(slot) + (i & 63) * 16), "r"(0u)
                         : "memory");
    }
    PDL_ENTER();
    {
        // The first stages' tokens: every load first, then every store (one round trip).
        constexpr int PER_THREAD = (AHEAD * 64 + 127) / 128;
        uint4 v[PER_THREAD];
        int first = min(AHEAD, stages) * 64;
#pragma unroll
        for (int i = 0; i < PER_THREAD; ++i) {
            int j = threadIdx.x + i * 128, s = j >> 6, m = (j >> 3) & 7, chunk = j & 7;
            if (j < first && m < t) v[i] = *reinterpret_cast<const uint4*>(X + (u64)m * K + s * 64 + chunk * 8);
        }
#pragma unroll
        for (int i = 0; i < PER_THREAD; ++i) {
            int j = threadIdx.x + i * 128, s = j >> 6, m = (j >> 3) & 7, chunk = j & 7;
            if (j < first && m < t)
                asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"r"(tokens(s) + m * 128 + ((chunk ^ m) << 4)),
                             "r"(v[i].x), "r"(v[i].y), "r"(v[i].z), "r"(v[i].w)
                             : "memory");
        }
    }
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int s = 0; s < stages; ++s) {
        // Stage s's copies (this thread's, then everyone's) are in, and visible to wgmma.
        asm volatile("cp.async.wait_group %0;\n" ::"n"(AHEAD - 1) : "memory");
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        wg_fence();
        u32 a = weights(s), b = tokens(s);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wgn_mma(d, wg_desc(a + kk * 32, 16, 1024), wg_desc(b + kk * 32, 16, 1024));
        wg_commit();
        // Stage s - QUEUE's products are done in this warp, and after the barrier in every warp
        // (each waits for its own): its slot takes stage s + AHEAD.
        asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(QUEUE) : "memory");
        __syncthreads();
        int next = s + AHEAD;
        if (next < stages) {
            wgn_copy(weights(next), W, n0, K, next);
            wgp_copy_tokens(tokens(next), X, K, t, next);
        }
        asm volatile("cp.async.commit_group;\n" ::: "memory");
    }
    wg_wait_all();
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+f"(d[i])::"memory");
    // d: weight rows r (d[0], d[1]) and r + 8 (d[2], d[3]) by tokens c and c + 1.
    int lane = threadIdx.x & 31, r = 16 * (threadIdx.x >> 5) + (lane >> 2), c = 2 * (lane & 3);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        int m = c + (e & 1);
        u64 i = (u64)m * N + n0 + r + (e >> 1) * 8;
        if (m >= t) continue;
        if (f32_out) reinterpret_cast<float*>(Y)[i] = d[e];
        else reinterpret_cast<bf16*>(Y)[i] = f2bf(d[e]);
    }
}
#endif

#define GEMM_WG_KERNEL(NAME, STAGES)                                                                    \
    extern "C" __global__ void __launch_bounds__(128) NAME(const bf16* W, const bf16* X, void* Y, int N, int K, \
                                                           int t, int f32_out) {                        \
        GEMM_WG_BODY(STAGES);                                                                           \
    }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GEMM_WG_BODY(STAGES) gemm_wg<STAGES>(W, X, Y, N, K, t, f32_out)
#else
#define GEMM_WG_BODY(STAGES)
#endif
#if KERNEL_GROUP(3)
GEMM_WG_KERNEL(gemm_wg_s8, 8)
GEMM_WG_KERNEL(gemm_wg_s16, 16)
GEMM_WG_KERNEL(gemm_wg_s24, 24)
#endif

