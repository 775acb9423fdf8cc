// tandem's CUDA kernels: everything in a forward pass except the large matrix products
// (cuBLAS), plus the decode projections of a few tokens.
//
// Compiled at start-up with NVRTC (no headers needed: bf16 is handled as raw 16-bit values and
// tensor-core instructions are written as inline PTX), then cached on disk by source hash and
// GPU arch. Storage types: weights, activations between kernels and the KV cache are bf16;
// the residual stream is held in f32 buffers but rounded to bf16 values (see "Rounding
// points"); RMSNorm statistics, softmax and logits are f32.
//
// KV cache layout (shared with the CPU backend and the connector): block-major,
// [block][layer][k|v][kv_head][slot][head_dim]. A token's cache slot is given as
// block * block_size + slot_in_block; -1 means "do not write" (padding rows of a CUDA graph).

typedef unsigned short bf16;
typedef unsigned int u32;
typedef unsigned long long u64;

// The kernels compile as KERNEL_GROUPS separate programs, in parallel (cuda::compile_kernels):
// TANDEM_GROUP=n keeps group n's kernels; without it, every kernel compiles.
#define KERNEL_GROUPS 8
#ifdef TANDEM_GROUP
#define KERNEL_GROUP(n) (TANDEM_GROUP == (n))
#else
#define KERNEL_GROUP(n) 1
#endif

#define NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ float bf2f(bf16 x) { return __uint_as_float(((u32)x) << 16); }

// Round to nearest even, NaN kept NaN (same rule as the `half` crate on the host): one
// conversion instruction from Ampere on, the integer sequence before.
__device__ __forceinline__ bf16 f2bf(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned short r;
    asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(r) : "f"(f));
    return r;
#else
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
#endif
}

// lo in the low half, hi in the high half.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return (u32)f2bf(lo) | ((u32)f2bf(hi) << 16);
#endif
}

// x rounded to the nearest bf16, kept as f32.
__device__ __forceinline__ float round_bf16(float x) { return bf2f(f2bf(x)); }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Programmatic dependent launch (Hopper and later; off unless the host launches with it, see
// `CudaDevice::programmatic_launch`). A kernel launched that way may start while the previous
// one is still running: it must wait before touching anything an earlier kernel writes or
// reads, and it lets the next kernel launch early. Every kernel here enters with PDL_ENTER
// before its first such access (the pipelined decode projection first starts fetching its
// weights, which nothing writes). Without the launch attribute both return at once.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_WAIT() asm volatile("griddepcontrol.wait;\n" ::: "memory")
#define PDL_LAUNCH_DEPENDENTS() asm volatile("griddepcontrol.launch_dependents;\n" :::)
#else
#define PDL_WAIT()
#define PDL_LAUNCH_DEPENDENTS()
#endif
#define PDL_ENTER()              \
    do {                         \
        PDL_WAIT();              \
        PDL_LAUNCH_DEPENDENTS(); \
    } while (0)

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
    return t;
}

// Whether phase `parity` of the barrier at `bar` has completed (one try, which may suspend a
// while in hardware).
__device__ __forceinline__ bool mbar_try(u32 bar, u32 parity) {
    u32 done;
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(bar), "r"(parity)
                 : "memory");
    return done;
}

// One thread: the barrier at `bar` set up so that its first phase completes once `bytes` of
// bulk copies (bulk_copy) have landed.
__device__ __forceinline__ void mbar_expect(u32 bar, u32 bytes) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar) : "memory");
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// `bytes` (a multiple of 16, both addresses 16-byte aligned) from global memory to shared
// address `dst` by the copy engine, counted on the barrier at `bar` as they land.
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}
#endif

// TANDEM_PDL_TRACE (a measurement build, TANDEM_KERNEL_DEFINES): thread 0 of every block of one
// layer's decode kernels (qkv, early attention, bulk o, gate/up, down of the PDL_TRACE_AT-th
// layer) records global clock stamps into device memory: entry, phases, exit, and its
// multiprocessor; eight layers later one thread prints them (printing from the traced kernels
// themselves would slow them). The kernels compile as separate programs (KERNEL_GROUP), each
// with its own device variables, so each program has an anchor kernel counting its launches
// (block 0 adds one at exit): the qkv projection, the attention, the bulk o. An anchor is
// traced if its count at entry is PDL_TRACE_AT, and prints its program's stamps at entry when
// the count is PDL_TRACE_AT + 8; gate/up and down (the bulk o's program) are traced if the
// count at their exit is PDL_TRACE_AT + 1 (after the traced o, before the next one).
// scripts/gpu/pdl_trace.py summarises: the attention's phases, the bulk o's, and the layer's
// timeline (gaps between kernels, tails, placement).
#ifdef TANDEM_PDL_TRACE
#define PDL_TRACE_AT 1000
#define TRACE_BLOCKS 1024
// Kinds: 0 qkv, 1 gate/up, 2 down (the plain projections' trace_kind), 4 attention, 5 bulk o.
#define TRACE_ATTN 4
#define TRACE_BULK 5
__device__ unsigned trace_anchor;
__device__ unsigned long long trace_stamps[6][TRACE_BLOCKS][8];
__device__ int trace_sm[6][TRACE_BLOCKS];
__device__ unsigned trace_blocks[6];
__device__ __forceinline__ int trace_smid() {
    int id;
    asm volatile("mov.u32 %0, %%smid;\n" : "=r"(id));
    return id;
}
// Whether a non-anchor kernel exiting now belongs to the traced layer.
__device__ __forceinline__ bool trace_layer_now() {
    return *(volatile unsigned*)&trace_anchor == PDL_TRACE_AT + 1;
}
__device__ __forceinline__ void trace_record(int kind, int block, const unsigned long long* stamps, int n) {
    if (block >= TRACE_BLOCKS) return;
    for (int i = 0; i < n; ++i) trace_stamps[kind][block][i] = stamps[i];
    trace_sm[kind][block] = trace_smid();
    atomicMax(&trace_blocks[kind], (unsigned)block + 1);
}
__device__ void trace_dump() {
    for (int kind = 0; kind < 6; ++kind)
        for (unsigned b = 0; b < trace_blocks[kind]; ++b) {
            const unsigned long long* t = trace_stamps[kind][b];
            int sm = trace_sm[kind][b];
            if (kind == TRACE_ATTN)
                printf("pdl_trace attn %u %d %llu %llu %llu %llu %llu %llu %llu %llu\n", b, sm, t[0], t[1], t[2], t[3],
                       t[4], t[5], t[6], t[7]);
            else if (kind == TRACE_BULK)
                printf("pdl_trace bulk %u %llu %llu %llu %llu %d\n", b, t[0], t[1], t[2], t[3], sm);
            else
                printf("pdl_trace gemv %d %u %llu %llu %llu %d\n", kind, b, t[0], t[1], t[2], sm);
        }
}
// An anchor's tracing at entry: whether this launch is traced; prints the stamps when due.
__device__ __forceinline__ bool trace_anchor_entry(bool first_block) {
    unsigned n = *(volatile unsigned*)&trace_anchor;
    if (first_block && n == PDL_TRACE_AT + 8) trace_dump();
    return n == PDL_TRACE_AT;
}
#endif

// Threads of the ring decode kernel that do the arithmetic (its last warp copies weights).
#define RING_CONSUMERS 256

// A barrier over the block, or (RING) over the ring kernel's consumer threads only (barrier 2).
template <bool RING>
__device__ __forceinline__ void consumer_sync() {
    if (RING) asm volatile("bar.sync 2, %0;\n" ::"n"(RING_CONSUMERS) : "memory");
    else __syncthreads();
}

// Sum over the block (RING: over the ring kernel's consumer threads); every thread gets the
// result. `scratch` holds 32 floats.
template <bool RING = false>
__device__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = ((RING ? RING_CONSUMERS : blockDim.x) + 31) >> 5;
    v = warp_sum(v);
    consumer_sync<RING>();
    if (lane == 0) scratch[warp] = v;
    consumer_sync<RING>();
    float t = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(t);
}

// ---------------------------------------------------------------------------------------------
// Seeded weights for `preset:` models, built on the device. Element i of a tensor is the i-th
// output of a splitmix64 stream started at `stream_seed`, mapped to a uniform value in
// [-amp, amp). The host (presets.rs) computes the very same f32 values, so a preset has the
// same weights on CPU and GPU (up to the bf16 rounding here).

__device__ __forceinline__ u64 splitmix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

#if KERNEL_GROUP(0)
extern "C" __global__ void preset_uniform(bf16* out, u64 n, u64 stream_seed, float amp) {
    PDL_ENTER();
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        u64 z = splitmix64(stream_seed + (i + 1) * 0x9e3779b97f4a7c15ull);
        float u = (float)(z >> 40) * (1.0f / 16777216.0f);
        float v = __fmul_rn(__fsub_rn(__fmul_rn(u, 2.0f), 1.0f), amp);
        out[i] = f2bf(v);
    }
}
#endif

#if KERNEL_GROUP(0)
extern "C" __global__ void fill_bf16(bf16* out, u64 n, float value) {
    PDL_ENTER();
    bf16 v = f2bf(value);
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) out[i] = v;
}
#endif

// ---------------------------------------------------------------------------------------------
// Embedding, norms, activation.

// x[t, :] = table[ids[t], :] (as f32: the residual stream). Grid: tokens. An id with the top
// bit set is a carried token (async scheduling): the token sampled into carried[id & 0x7fffffff]
// by the previous step, which the host has not seen yet.
#if KERNEL_GROUP(0)
extern "C" __global__ void embed_gather(const bf16* table, const int* ids, const int* carried, float* x, int hidden) {
    PDL_ENTER();
    int t = blockIdx.x;
    int id = ids[t];
    if (id < 0) id = carried[id & 0x7fffffff];
    const bf16* row = table + (u64)id * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) x[(u64)t * hidden + i] = bf2f(row[i]);
}
#endif

// Rounding points. The bf16 path rounds where transformers and vLLM do, so greedy output
// follows theirs as far as bf16 allows: the residual stream is bf16 (each residual add rounds
// the delta and the sum), RMSNorm rounds x * rsqrt(mean(x^2) + eps) before the weight multiply
// and again after, SiLU rounds before the multiply by up, and RoPE multiplies and adds in bf16
// with bf16 cos/sin. Sums inside a kernel (dot products, norms, softmax) stay in f32.

// bf16(bf16(x * inv) * w) for two elements, w packed as two bf16 in a u32 (the RMSNorm output).
__device__ __forceinline__ u32 norm_pack(float x0, float x1, float inv, u32 w2) {
    return pack_bf16x2(round_bf16(x0 * inv) * __uint_as_float(w2 << 16),
                       round_bf16(x1 * inv) * __uint_as_float(w2 & 0xffff0000u));
}

// bf16(bf16(silu(g)) * u) for two elements of gate and up, each packed as two bf16 in a u32.
__device__ __forceinline__ u32 silu_mul_pack(u32 g2, u32 u2) {
    float g0 = __uint_as_float(g2 << 16), g1 = __uint_as_float(g2 & 0xffff0000u);
    float u0 = __uint_as_float(u2 << 16), u1 = __uint_as_float(u2 & 0xffff0000u);
    return pack_bf16x2(round_bf16(g0 / (1.0f + expf(-g0))) * u0, round_bf16(g1 / (1.0f + expf(-g1))) * u1);
}

// The residual stream plus a delta, in bf16.
__device__ __forceinline__ float residual_add(float x, float delta) { return round_bf16(x + round_bf16(delta)); }

// out[r] = rms_norm(x[rows[r]]) * w, rows == null meaning r itself. If `delta` is given,
// x[row] += delta[row] first (the residual add fused in front of the norm) and written back.
// Deltas (attention and MLP outputs) are bf16, as transformers' projections return them.
// Grid: output rows. Block: 256 (hidden <= 256 * 32), 1024 beyond; hidden % 4 == 0.
#if KERNEL_GROUP(0)
extern "C" __global__ void add_rms_norm(float* x, const bf16* delta, const int* rows, const bf16* w, bf16* out,
                                        int hidden, float eps) {
    PDL_ENTER();
    __shared__ float scratch[32];
    int r = blockIdx.x;
    int row = rows ? rows[r] : r;
    float* xr = x + (u64)row * hidden;
    const bf16* dr = delta ? delta + (u64)row * hidden : 0;
    // Four elements per thread per step (hidden % 4 == 0) with 16-byte accesses; a fixed trip
    // count keeps the row in registers (hidden <= 32 * blockDim).
    float4 vals[8];
    float ss = 0.0f;
#pragma unroll
    for (int n = 0; n < 8; ++n) {
        int i = (threadIdx.x + n * blockDim.x) * 4;
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (i < hidden) {
            v = *reinterpret_cast<const float4*>(xr + i);
            if (dr) {
                uint2 d = *reinterpret_cast<const uint2*>(dr + i);
                v.x = residual_add(v.x, __uint_as_float(d.x << 16));
                v.y = residual_add(v.y, __uint_as_float(d.x & 0xffff0000u));
                v.z = residual_add(v.z, __uint_as_float(d.y << 16));
                v.w = residual_add(v.w, __uint_as_float(d.y & 0xffff0000u));
                *reinterpret_cast<float4*>(xr + i) = v;
            }
        }
        vals[n] = v;
        ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
    ss = block_sum(ss, scratch);
    float inv = rsqrtf(ss / (float)hidden + eps);
#pragma unroll
    for (int n = 0; n < 8; ++n) {
        int i = (threadIdx.x + n * blockDim.x) * 4;
        if (i < hidden) {
            uint2 wv = *reinterpret_cast<const uint2*>(w + i);
            float4 v = vals[n];
            *reinterpret_cast<uint2*>(out + (u64)r * hidden + i) =
                make_uint2(norm_pack(v.x, v.y, inv, wv.x), norm_pack(v.z, v.w, inv, wv.y));
        }
    }
}
#endif

// out[t, i] = silu(gu[t, 2i]) * gu[t, 2i + 1]: the gate/up projection's rows come interleaved
// (gate row i, then up row i; see `interleave_rows`). Two outputs per thread (inter is even).
// Grid: (ceil(inter / 512), tokens). Block: 256.
#if KERNEL_GROUP(0)
extern "C" __global__ void silu_mul(const bf16* gu, bf16* out, int inter) {
    PDL_ENTER();
    // Tokens on grid x: a long prefill chunk has more tokens than grid y allows (65535).
    int t = blockIdx.x;
    int i = (blockIdx.y * blockDim.x + threadIdx.x) * 2;
    if (i >= inter) return;
    // gate i, up i, gate i + 1, up i + 1.
    uint2 v = *reinterpret_cast<const uint2*>(gu + (u64)t * 2 * inter + 2 * i);
    u32 g2 = (v.x & 0xffffu) | (v.y << 16), u2 = (v.x >> 16) | (v.y & 0xffff0000u);
    *reinterpret_cast<u32*>(out + (u64)t * inter + i) = silu_mul_pack(g2, u2);
}
#endif

// dst row 2i = src row i, dst row 2i + 1 = src row half + i (rows of `cols` bf16): the gate/up
// weight (and bias) laid out so that one warp of a decode projection owns a gate row and its up
// row, and SiLU-and-multiply happens in its epilogue. Grid-stride over 16-byte pieces
// (cols % 8 == 0) or elements.
// dst[h][r][d] = src[r][h * hd + d] (16-byte pieces; hd % 8 == 0): the o weight head-major,
// so that attention_o's slices are contiguous. Grid-stride over dst's pieces.
#if KERNEL_GROUP(0)
extern "C" __global__ void head_major(const bf16* src, bf16* dst, u64 rows, u64 heads, u64 hd) {
    PDL_ENTER();
    u64 per_row = hd / 8, total = rows * heads * per_row;
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (u64)gridDim.x * blockDim.x) {
        u64 h = e / (rows * per_row), r = (e / per_row) % rows, piece = e % per_row;
        *reinterpret_cast<uint4*>(dst + e * 8) =
            *reinterpret_cast<const uint4*>(src + (r * heads + h) * hd + piece * 8);
    }
}
#endif

#if KERNEL_GROUP(0)
extern "C" __global__ void interleave_rows(const bf16* src, bf16* dst, u64 half, u64 cols) {
    PDL_ENTER();
    bool wide = cols % 8 == 0;
    u64 unit = wide ? 8 : 1;
    u64 per_row = cols / unit, total = 2 * half * per_row;
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (u64)gridDim.x * blockDim.x) {
        u64 row = e / per_row, piece = e % per_row;
        u64 from = (row % 2 == 0 ? row / 2 : half + row / 2) * cols + piece * unit;
        u64 to = row * cols + piece * unit;
        if (wide) *reinterpret_cast<uint4*>(dst + to) = *reinterpret_cast<const uint4*>(src + from);
        else dst[to] = src[from];
    }
}
#endif

// y[t, j] += bias[j] (projections with a bias); y is bf16, or f32 when `f32_y`. Grid-stride.
#if KERNEL_GROUP(0)
extern "C" __global__ void add_bias(void* y, const bf16* bias, int cols, u64 total, int f32_y) {
    PDL_ENTER();
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < total; e += (u64)gridDim.x * blockDim.x) {
        float b = bf2f(bias[e % cols]);
        if (f32_y) reinterpret_cast<float*>(y)[e] += b;
        else reinterpret_cast<bf16*>(y)[e] = f2bf(bf2f(reinterpret_cast<bf16*>(y)[e]) + b);
    }
}
#endif

// ---------------------------------------------------------------------------------------------
// Eight bf16 values packed in 16 bytes, as f32.
__device__ __forceinline__ void unpack8(uint4 v, float* f) {
    u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        f[2 * j] = __uint_as_float(w[j] << 16);
        f[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
    }
}

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
// TANDEM_STREAM_EVICT_FIRST (a measurement build, TANDEM_KERNEL_DEFINES): also first out of
// L2, so that what is reused across layers (step metadata, RoPE tables, recent KV) stays there.
__device__ __forceinline__ uint4 ld_stream(const bf16* p) {
    uint4 v;
#if defined(TANDEM_STREAM_EVICT_FIRST) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    u64 policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p), "l"(policy));
#else
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
#endif
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

// 16 bytes from L2, for data written earlier in the same launch (the ring kernel's inputs).
__device__ __forceinline__ uint4 ld_cg16(const void* p) {
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// Forms input row m of a decode projection in shared memory (see IN_*). Loads go out in
// batches before any is used: the prologue is a few round trips to L2, not one per element.
// RING: run by the ring kernel's 256 consumer threads (the same sums as a 256-thread block),
// reading inputs that earlier stages of the same launch wrote.
// IN_NORM reads its row in pieces of NORM_PIECE_J * 4 * blockDim elements (3072 for 256
// threads): the first piece stays in registers, so a row that fits (Qwen3-4B's 2560) is read
// once; longer rows sum their other pieces and read them again (from L1) to scale them. A
// bigger piece was measured slower on an H200 (Qwen3-4B decode step 0.5% longer with 8 per
// thread): the kernel's first weight loads sit behind twice the code.
constexpr int NORM_PIECE_J = 3;
template <int IN, bool RING = false>
__device__ __forceinline__ void gemv_prologue(bf16* xm, int K, const void* in, const int* rows, const bf16* norm_w,
                                              float eps, int m, int mcount, float* scratch) {
    int tid = threadIdx.x, nt = RING ? RING_CONSUMERS : blockDim.x;
    auto ld_in = [](const void* p) { return RING ? ld_cg16(p) : ld_nc16(p); };
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
        ss = block_sum<RING>(ss, scratch);
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
#if defined(TANDEM_PDL_TRACE) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // Stamps: entry, prologue done, exit.
    constexpr int trace_kind = OUT == OUT_SILU ? 1 : OUT == OUT_ADD ? 2 : OUT == OUT_F32 ? 3 : 0;
    unsigned long long trace_t[3] = {tid == 0 ? global_ns() : 0, 0, 0};
    bool traced = tid == 0 && trace_kind == 0 && trace_anchor_entry(blockIdx.x == 0);
#endif
    // The pipelined build's first batch of weights goes out before waiting on the previous
    // kernel (weights are never written). (Asking L2 for the plain build's first row group with
    // Hopper's bulk prefetch instead made a Qwen3-4B decode step 12% slower on an H200.)
    if (PIPE) load_batch(wv, row_base + grp * GEMV_ROWS, k_begin + lane * 8);
    // The plain build issues the first slice of its first batch before the prologue too (8
    // registers), so the memory streams while the prologue's round trips run: a Qwen3-4B decode
    // step 1% shorter on an H200. Two slices were 5% slower (the prologue spills, and twice the
    // bytes queue ahead of its reads). TANDEM_KERNEL_DEFINES=TANDEM_GEMV_EARLY_U=n measures others.
#ifndef TANDEM_GEMV_EARLY_U
#define TANDEM_GEMV_EARLY_U 1
#endif
    constexpr int EARLY_U = PIPE ? 0 : TANDEM_GEMV_EARLY_U;
    if (EARLY_U > 0) load_slices(wv, row_base + grp * GEMV_ROWS, k_begin + lane * 8, 0, EARLY_U);
    int early_left = EARLY_U;  // slices of the next batch already in wv
    PDL_ENTER();
    for (int m = 0; m < M; ++m) gemv_prologue<IN>(xs + (u64)m * K, K, in, rows, norm_w, eps, m, mcount, scratch);
    __syncthreads();
#if defined(TANDEM_PDL_TRACE) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (tid == 0) trace_t[1] = global_ns();
#endif
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
#if defined(TANDEM_PDL_TRACE) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (tid == 0) {
        trace_t[2] = global_ns();
        if (trace_kind == 0 ? traced : trace_kind < 3 && trace_layer_now())
            trace_record(trace_kind, blockIdx.x, trace_t, 3);
        if (trace_kind == 0 && blockIdx.x == 0) atomicAdd(&trace_anchor, 1u);
    }
#endif
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

// Element offset of (block, layer, k|v, kv_head, slot) in the block-major cache.
__device__ __forceinline__ u64 kv_offset(int block, int slot, int layer, int kv, int kh, int num_layers,
                                         int num_kv_heads, int block_size, int head_dim) {
    u64 plane = (u64)block_size * head_dim;
    return (((u64)block * num_layers + layer) * 2 + kv) * num_kv_heads * plane + (u64)kh * plane +
           (u64)slot * head_dim;
}

// ---------------------------------------------------------------------------------------------
// q/k RMSNorm (Qwen3), RoPE and the paged KV-cache write, fused: one pass over the qkv
// projection's output. One warp per (token, head); lane l holds elements [l * E, l * E + E)
// with E = head_dim / 32, so the rotate-half partner of lane l's elements sits in lane l ^ 16.
// `cos`/`sin` are the RoPE tables [position][head_dim / 2] (neox convention).
// Grid: (tokens, ceil(all heads / 4)). Block: 128. head_dim: a multiple of 32, at most 256.

// Loads / stores E (1 to 8) consecutive bf16 values, with one access when E is 2, 4 or 8.
__device__ __forceinline__ void load_e(const bf16* p, float* v, int e) {
    if (e == 8) {
        unpack8(*reinterpret_cast<const uint4*>(p), v);
    } else if (e == 4) {
        uint2 u = *reinterpret_cast<const uint2*>(p);
        v[0] = __uint_as_float(u.x << 16); v[1] = __uint_as_float(u.x & 0xffff0000u);
        v[2] = __uint_as_float(u.y << 16); v[3] = __uint_as_float(u.y & 0xffff0000u);
    } else if (e == 2) {
        u32 u = *reinterpret_cast<const u32*>(p);
        v[0] = __uint_as_float(u << 16); v[1] = __uint_as_float(u & 0xffff0000u);
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i)
            if (i < e) v[i] = bf2f(p[i]);
    }
}

__device__ __forceinline__ void store_e(bf16* p, const float* v, int e) {
    if (e == 8) {
        *reinterpret_cast<uint4*>(p) =
            make_uint4(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]), pack_bf16x2(v[4], v[5]), pack_bf16x2(v[6], v[7]));
    } else if (e == 4) {
        *reinterpret_cast<uint2*>(p) = make_uint2(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]));
    } else if (e == 2) {
        *reinterpret_cast<u32*>(p) = pack_bf16x2(v[0], v[1]);
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i)
            if (i < e) p[i] = f2bf(v[i]);
    }
}

// Head h of token t (at position pos) from the qkv projection's output, warp-cooperatively:
// bias added, RMSNorm'd (q and k heads, where the model has q/k norms) and rotated (q and k
// heads); lane l ends with elements [l * E, l * E + E) in v, E = head_dim / 32.
__device__ __forceinline__ void rope_head(const bf16* qkv, const bf16* qkv_bias, const bf16* q_norm,
                                          const bf16* k_norm, const float* cos_t, const float* sin_t, int t, int h,
                                          int pos, int num_heads, int num_kv_heads, int head_dim, float eps,
                                          float* v) {
    int lane = threadIdx.x & 31;
    int E = head_dim / 32, half = head_dim / 2, base = lane * E;
    bool is_q = h < num_heads, is_k = !is_q && h < num_heads + num_kv_heads;
    u64 qkv_dim = (u64)(num_heads + 2 * num_kv_heads) * head_dim;
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = 0.0f;
    load_e(qkv + t * qkv_dim + h * head_dim + base, v, E);
    if (qkv_bias) {
        float b[8];
        load_e(qkv_bias + h * head_dim + base, b, E);
#pragma unroll
        for (int e = 0; e < 8; ++e)
            if (e < E) v[e] = bf2f(f2bf(v[e] + b[e]));
    }
    const bf16* nw = is_q ? q_norm : (is_k ? k_norm : 0);
    if (nw) {
        float ss = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e)
            if (e < E) ss += v[e] * v[e];
        ss = warp_sum(ss);
        float inv = rsqrtf(ss / (float)head_dim + eps);
        float wn[8];
        load_e(nw + base, wn, E);
#pragma unroll
        for (int e = 0; e < 8; ++e)
            if (e < E) v[e] = round_bf16(round_bf16(v[e] * inv) * wn[e]);
    }
    if (is_q || is_k) {
        int j0 = base < half ? base : base - half;
        const float* c = cos_t + (u64)pos * half + j0;
        const float* sn = sin_t + (u64)pos * half + j0;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            float partner = __shfl_xor_sync(0xffffffffu, v[e], 16);
            if (e < E) {
                float a = round_bf16(v[e] * round_bf16(c[e])), b = round_bf16(partner * round_bf16(sn[e]));
                v[e] = round_bf16(base < half ? a - b : a + b);
            }
        }
    }
}

#if KERNEL_GROUP(0)
extern "C" __global__ void qkv_rope_cache(const bf16* qkv, const bf16* qkv_bias, const bf16* q_norm,
                                          const bf16* k_norm, const float* cos_t, const float* sin_t,
                                          const int* positions, const int* slots, bf16* q_out, bf16* cache,
                                          int num_heads, int num_kv_heads, int head_dim, int layer,
                                          int num_layers, int block_size, float eps) {
    PDL_ENTER();
    int t = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int h = blockIdx.y * 4 + warp;
    if (h >= num_heads + 2 * num_kv_heads) return;
    int E = head_dim / 32, base = lane * E;
    int slot = slots[t];
    float v[8];
    rope_head(qkv, qkv_bias, q_norm, k_norm, cos_t, sin_t, t, h, positions[t], num_heads, num_kv_heads, head_dim,
              eps, v);
    if (h < num_heads) {
        store_e(q_out + ((u64)t * num_heads + h) * head_dim + base, v, E);
    } else if (slot >= 0) {
        int kv = h < num_heads + num_kv_heads ? 0 : 1;
        int kh = h - num_heads - kv * num_kv_heads;
        store_e(cache + kv_offset(slot / block_size, slot % block_size, layer, kv, kh, num_layers, num_kv_heads,
                                  block_size, head_dim) + base,
                v, E);
    }
}
#endif

// ---------------------------------------------------------------------------------------------
// Attention over the paged cache.
//
// Per-token metadata: positions[t] (the token's position; it attends keys 0..=position),
// tok_seq[t] (its sequence, the row of the block table). block_tables is [seq][stride] with
// the stride in meta_stride[0], so CUDA graphs can replay with tables of any width.


// Decode attention (and the fallback for any shape): one block per query token and G query
// heads of one GQA group (G = the whole group when there are many tokens, so keys and values
// are read once per group; G = 1 at small batches, so more blocks share the work). Keys go in
// chunks of ATTN_CHUNK with an online softmax. A decode step is latency bound, so the kernel
// keeps its memory round trips few: a chunk's keys and values are copied into shared memory
// together (cp.async; the first chunk's before anything else, so the copy overlaps the query's
// own loads), then thread j scores key j from shared memory (rows padded by 16 bytes: no bank
// conflicts), one warp per head keeps that head's softmax state, and for P.V the four warps
// take every fourth key (lane l holds output dimensions [l * E, l * E + E)); their partial
// sums are added in warp order at the end (a fixed order, so results do not vary from run to
// run). Head size and G are template parameters: no predicated-off work. Launched with shared
// memory for two chunks (head size <= 128), the block double-buffers: the next chunk's copy
// goes out as soon as the current one has arrived, so on long contexts it overlaps the current
// chunk's arithmetic. The launch chooses (ops::attention_stages): two buffers halve the blocks
// that fit on a multiprocessor, which costs a second wave on a full grid.
// Grid: (tokens, heads / G). Block: 128. head_dim = 32 * E. Dynamic shared memory: one or two
// times ATTN_STAGE_BYTES(head_dim).
#define ATTN_CHUNK 64
#define ATTN_WARPS 4
#define ATTN_STRIDE(HD) ((HD) + 8)
#define ATTN_STAGE_BYTES(HD) (2 * ATTN_CHUNK * ATTN_STRIDE(HD) * 2)
// With `rope.qkv` set (decode steps where every sequence brings one token), the block also does
// qkv_rope_cache's work for its query heads and their KV head straight from the qkv
// projection: the new token's key and value stay in shared memory for its own (last)
// position, and the group's first block writes them to the cache. Earlier positions come
// from the cache, written by earlier steps, so blocks of one group do not race.
struct RopeIn {
    const bf16 *qkv, *bias, *q_norm, *k_norm;
    const float *cos_t, *sin_t;
    const int* slots;
    float eps;
};

// Split key ranges (`part` set; grid z = the most splits): token t's context is cut into
// attn_splits(ctx) ranges of about equal length, one per block along z (blocks past it exit),
// and each block leaves its unnormalised partial [m, l, acc[head_dim]] per head in `part`
// ([list index][head][z][head_dim + 2] f32); attention_combine merges them in split order. A
// token's splits depend only on its own context (and the grid's z), so its result does not
// depend on its neighbours; with one split the merge gives the unsplit kernel's values.
__device__ __forceinline__ int attn_splits(int ctx, int most, int split_keys) {
    return max(1, min(most, (ctx + split_keys - 1) / split_keys));
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    u32 d = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(gmem));
}

// The attention's barriers: the whole block, or (NAMED) barrier 1 over the first ATTN_WARPS
// warps only, for a kernel whose other warps do other work meanwhile (attention_o).
template <bool NAMED>
__device__ __forceinline__ void attn_sync() {
    if (NAMED) asm volatile("bar.sync 1, %0;\n" ::"n"(ATTN_WARPS * 32) : "memory");
    else __syncthreads();
}

template <int G, int E, bool NAMED = false>
__device__ __forceinline__ void attention_rows(const bf16* q, bf16* cache, bf16* out, const int* positions,
                                               const int* tok_seq, const int* block_tables, const int* meta_stride,
                                               const int* token_list, int num_heads, int num_kv_heads, int layer,
                                               int num_layers, int block_size, float scale, RopeIn rope, float* part,
                                               int split_keys, bool one_stage = false, float* out_s = nullptr,
                                               int head_block = -1, bool wait_after_first_keys = false) {
    constexpr int HD = 32 * E, STRIDE = ATTN_STRIDE(HD);
    // The block's (listed token, head group, key split): its launch coordinates, or with
    // `head_block` (the ring kernel, one token) listed token 0 and that head group.
    const int bx = head_block >= 0 ? 0 : blockIdx.x, by = head_block >= 0 ? head_block : blockIdx.y,
              bz = head_block >= 0 ? 0 : blockIdx.z;
    // NAMED: only the block's first ATTN_WARPS warps run this (see attn_sync).
    const int nthreads = NAMED ? ATTN_WARPS * 32 : blockDim.x;
    extern __shared__ __align__(16) unsigned char attn_smem[];
    u32 dynamic_smem;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_smem));
    const int stages = !one_stage && HD <= 128 && dynamic_smem >= 2 * ATTN_STAGE_BYTES(HD) ? 2 : 1;
    // Buffer b: keys at kbuf(b), values ATTN_CHUNK rows further.
    auto kbuf = [&](int b) { return reinterpret_cast<bf16*>(attn_smem) + b * 2 * ATTN_CHUNK * STRIDE; };
    // Scaled queries; reused at the end to add up the warps' partial outputs.
    __shared__ float qs[G][HD];
    __shared__ float ps[G][ATTN_CHUNK];
    __shared__ __align__(16) bf16 new_kv[2][HD];
    __shared__ float m_s[G], l_s[G], alpha_s[G];
    int t = token_list ? token_list[bx] : bx;
    int h0 = by * G;
    int group = num_heads / num_kv_heads, kh = h0 / group;
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int ctx = positions[t] + 1;
    // This block's keys: [k0, k1).
    int k0 = 0, k1 = ctx;
    if (part) {
        int splits = attn_splits(ctx, gridDim.z, split_keys), len = (ctx + splits - 1) / splits;
        if ((int)bz >= splits) return;
        k0 = bz * len;
        k1 = min(ctx, k0 + len);
    }
    const int* table = block_tables + (u64)tok_seq[t] * meta_stride[0];
    bool fused = rope.qkv != nullptr;
    // Keys read from the cache: all of the range, but for the new token's when fused (this
    // launch writes it; the block has it in new_kv).
    int cached = fused ? min(k1, ctx - 1) : k1;
    auto stage = [&](int start, int b) {
        bf16* ks = kbuf(b);
        bf16* vs = ks + ATTN_CHUNK * STRIDE;
        int n = min(ATTN_CHUNK, cached - start);
        for (int c = tid; c < n * (HD / 8); c += nthreads) {
            int r = c / (HD / 8), part = (c % (HD / 8)) * 8;
            int key = start + r;
            int blk = table[key / block_size], slot = key % block_size;
            cp_async16(ks + r * STRIDE + part,
                       cache + kv_offset(blk, slot, layer, 0, kh, num_layers, num_kv_heads, block_size, HD) + part);
            cp_async16(vs + r * STRIDE + part,
                       cache + kv_offset(blk, slot, layer, 1, kh, num_layers, num_kv_heads, block_size, HD) + part);
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
#if defined(TANDEM_PDL_TRACE) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // Stamps: entry, wait over, inputs ready (RoPE'd query and new key/value, first keys
    // landed), scores, softmax, P.V, partials added, output stored (first chunk's phases).
    bool first_block = bx == 0 && by == 0 && bz == 0;
    bool traced = wait_after_first_keys && tid == 0 && trace_anchor_entry(first_block);
    unsigned long long stamps[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    auto stamp = [&](int i) {
        if (traced) stamps[i] = global_ns();
    };
    auto trace_exit = [&]() {
        stamp(7);
        if (traced) trace_record(TRACE_ATTN, by + gridDim.y * (bx + gridDim.x * bz), stamps, 8);
        if (wait_after_first_keys && tid == 0 && first_block) atomicAdd(&trace_anchor, 1u);
    };
#else
    auto stamp = [](int) {};
    auto trace_exit = []() {};
#endif
    stamp(0);
    stage(k0, 0);
    // Launched with programmatic dependent launch (fused steps): the cached keys (earlier steps'
    // and the metadata the host wrote) are on their way while the qkv projection finishes; only
    // what follows reads its output.
    // (Letting the bulk o projection launch before this wait instead of after it changes
    // nothing: a programmatic launch also waits for the kernel two back, the qkv projection, to
    // complete; run BP.)
    if (wait_after_first_keys) PDL_ENTER();
    stamp(1);
    if (fused) {
        // Warp w < G: query head h0 + w; then the key head and the value head.
        int slot = rope.slots[t];
        for (int task = warp; task < G + 2; task += ATTN_WARPS) {
            int h = task < G ? h0 + task : num_heads + (task - G) * num_kv_heads + kh;
            float v[8];
            rope_head(rope.qkv, rope.bias, rope.q_norm, rope.k_norm, rope.cos_t, rope.sin_t, t, h, ctx - 1, num_heads,
                      num_kv_heads, HD, rope.eps, v);
            if (task < G) {
#pragma unroll
                for (int e = 0; e < E; ++e) qs[task][lane * E + e] = round_bf16(v[e]) * scale;
            } else {
                int kv = task - G;
                store_e(&new_kv[kv][lane * E], v, E);
                if (slot >= 0 && h0 % group == 0 && bz == 0)
                    store_e(cache + kv_offset(slot / block_size, slot % block_size, layer, kv, kh, num_layers,
                                              num_kv_heads, block_size, HD) +
                                lane * E,
                            v, E);
            }
        }
    } else {
        for (int i = tid; i < G * HD; i += nthreads) {
            int g = i / HD, d = i % HD;
            qs[g][d] = bf2f(q[((u64)t * num_heads + h0 + g) * HD + d]) * scale;
        }
    }
    if (tid < G) {
        m_s[tid] = NEG_INF;
        l_s[tid] = 0.0f;
    }
    float acc[G][E];
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
        for (int e = 0; e < E; ++e) acc[g][e] = 0.0f;
    for (int start = k0, chunk = 0; start < k1; start += ATTN_CHUNK, ++chunk) {
        int n = min(ATTN_CHUNK, k1 - start);
        int b = stages == 2 ? chunk & 1 : 0;
        const bf16* ks = kbuf(b);
        const bf16* vs = ks + ATTN_CHUNK * STRIDE;
        asm volatile("cp.async.wait_all;\n" ::: "memory");
        attn_sync<NAMED>();
        if (chunk == 0) stamp(2);
        // The other buffer was last read before the barrier that ended the previous chunk.
        if (stages == 2 && start + ATTN_CHUNK < cached) stage(start + ATTN_CHUNK, b ^ 1);
        if (tid < n) {
            const bf16* k = fused && start + tid == ctx - 1 ? new_kv[0] : ks + tid * STRIDE;
            float dot[G];
#pragma unroll
            for (int g = 0; g < G; ++g) dot[g] = 0.0f;
#pragma unroll
            for (int c = 0; c < HD / 8; ++c) {
                float kf[8];
                unpack8(*reinterpret_cast<const uint4*>(k + c * 8), kf);
#pragma unroll
                for (int g = 0; g < G; ++g)
#pragma unroll
                    for (int j = 0; j < 8; ++j) dot[g] = fmaf(qs[g][c * 8 + j], kf[j], dot[g]);
            }
#pragma unroll
            for (int g = 0; g < G; ++g) ps[g][tid] = dot[g];
        }
        attn_sync<NAMED>();
        if (chunk == 0) stamp(3);
        // Softmax bookkeeping: warp w for heads w, w + 4.
        for (int g = warp; g < G; g += ATTN_WARPS) {
            float mx = NEG_INF;
            for (int j = lane; j < n; j += 32) mx = fmaxf(mx, ps[g][j]);
            mx = warp_max(mx);
            float m_old = m_s[g], m_new = fmaxf(m_old, mx);
            float sum = 0.0f;
            for (int j = lane; j < n; j += 32) {
                float p = __expf(ps[g][j] - m_new);
                ps[g][j] = p;
                sum += p;
            }
            sum = warp_sum(sum);
            if (lane == 0) {
                float alpha = __expf(m_old - m_new);
                alpha_s[g] = alpha;
                l_s[g] = l_s[g] * alpha + sum;
                m_s[g] = m_new;
            }
        }
        attn_sync<NAMED>();
        if (chunk == 0) stamp(4);
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float alpha = alpha_s[g];
#pragma unroll
            for (int e = 0; e < E; ++e) acc[g][e] *= alpha;
        }
        // P.V: warp w takes keys w, w + 4, ...
#pragma unroll 4
        for (int j = warp; j < n; j += ATTN_WARPS) {
            const bf16* v = fused && start + j == ctx - 1 ? new_kv[1] : vs + j * STRIDE;
            float vf[8];
            load_e(v + lane * E, vf, E);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float p = ps[g][j];
#pragma unroll
                for (int e = 0; e < E; ++e) acc[g][e] = fmaf(p, vf[e], acc[g][e]);
            }
        }
        attn_sync<NAMED>();
        if (chunk == 0) stamp(5);
        if (stages == 1 && start + ATTN_CHUNK < cached) stage(start + ATTN_CHUNK, 0);
    }
    // Add the warps' partial outputs in warp order, then normalise.
    for (int w = 0; w < ATTN_WARPS; ++w) {
        if (warp == w) {
#pragma unroll
            for (int g = 0; g < G; ++g)
#pragma unroll
                for (int e = 0; e < E; ++e) qs[g][lane * E + e] = (w == 0 ? 0.0f : qs[g][lane * E + e]) + acc[g][e];
        }
        attn_sync<NAMED>();
    }
    stamp(6);
    if (part) {
        for (int i = tid; i < G * (HD + 2); i += nthreads) {
            int g = i / (HD + 2), d = i % (HD + 2);
            float* p = part + (((u64)bx * num_heads + h0 + g) * gridDim.z + bz) * (HD + 2);
            p[d] = d == 0 ? m_s[g] : (d == 1 ? l_s[g] : qs[g][d - 2]);
        }
        trace_exit();
        return;
    }
    for (int i = tid; i < G * HD; i += nthreads) {
        int g = i / HD, d = i % HD;
        float inv = l_s[g] > 0.0f ? 1.0f / l_s[g] : 0.0f;
        bf16 o = f2bf(qs[g][d] * inv);
        out[((u64)t * num_heads + h0 + g) * HD + d] = o;
        if (out_s) out_s[i] = bf2f(o);
    }
    trace_exit();
}

// Merges split attention partials (see attn_splits) in split order: out = sum_s acc_s w_s /
// sum_s l_s w_s with w_s = exp(m_s - max m). With one split, w = 1 and this is the unsplit
// kernel's out = acc * (1 / l), bit for bit. Grid: (listed tokens, heads). Block: head_dim.
#if KERNEL_GROUP(0)
extern "C" __global__ void attention_combine(const float* part, bf16* out, const int* positions,
                                             const int* token_list, int num_heads, int head_dim, int most,
                                             int split_keys) {
    PDL_ENTER();
    int t = token_list ? token_list[blockIdx.x] : blockIdx.x;
    int h = blockIdx.y, d = threadIdx.x;
    int splits = attn_splits(positions[t] + 1, most, split_keys);
    const float* p = part + ((u64)blockIdx.x * num_heads + h) * most * (head_dim + 2);
    float m = NEG_INF;
    for (int s = 0; s < splits; ++s) m = fmaxf(m, p[s * (head_dim + 2)]);
    float sum = 0.0f, l = 0.0f;
    for (int s = 0; s < splits; ++s) {
        const float* ps = p + s * (head_dim + 2);
        float w = __expf(ps[0] - m);
        sum += ps[2 + d] * w;
        l += ps[1] * w;
    }
    float inv = l > 0.0f ? 1.0f / l : 0.0f;
    out[((u64)t * num_heads + h) * head_dim + d] = f2bf(sum * inv);
}
#endif

#define ATTENTION_ROWS(G, E)                                                                                     \
    extern "C" __global__ void __launch_bounds__(128) attention_rows_g##G##_e##E(                                \
        const bf16* q, bf16* cache, bf16* out, const int* positions, const int* tok_seq, const int* block_tables, \
        const int* meta_stride, const int* token_list, int num_heads, int num_kv_heads, int layer, int num_layers, \
        int block_size, float scale, const bf16* qkv, const bf16* qkv_bias, const bf16* q_norm, const bf16* k_norm, \
        const float* cos_t, const float* sin_t, const int* slots, float eps, float* part, int split_keys) {       \
        /* Fused steps wait on the previous kernel inside, after the first cached keys. */                      \
        if (!qkv) PDL_ENTER();                                                                                   \
        RopeIn rope = {qkv, qkv_bias, q_norm, k_norm, cos_t, sin_t, slots, eps};                                 \
        attention_rows<G, E>(q, cache, out, positions, tok_seq, block_tables, meta_stride, token_list, num_heads, \
                             num_kv_heads, layer, num_layers, block_size, scale, rope, part, split_keys, false,  \
                             nullptr, -1, qkv != nullptr);                                                       \
    }
#define ATTENTION_ROWS_ALL_E(G)                                                                                \
    ATTENTION_ROWS(G, 1) ATTENTION_ROWS(G, 2) ATTENTION_ROWS(G, 3) ATTENTION_ROWS(G, 4) ATTENTION_ROWS(G, 5) \
    ATTENTION_ROWS(G, 6) ATTENTION_ROWS(G, 7) ATTENTION_ROWS(G, 8)
// One head per block for every head size; whole groups for the common sizes 64 and 128.
#if KERNEL_GROUP(3)
ATTENTION_ROWS_ALL_E(1)
ATTENTION_ROWS(2, 2) ATTENTION_ROWS(2, 4) ATTENTION_ROWS(4, 2) ATTENTION_ROWS(4, 4) ATTENTION_ROWS(8, 2)
ATTENTION_ROWS(8, 4)
#endif

// Decode attention and the o projection in one launch, for steps of one token per sequence
// (fused RoPE, no key split). Block (token, head h, row chunk c) first asks for its slice of
// the o weights, rows [c * chunk_rows, +chunk_rows) of head h (one contiguous piece of the
// head-major weight, see head_major), as bulk copies into shared memory that stream while the
// attention runs (weights never depend on an earlier kernel); then does the head's attention
// (attention_rows, so the same output bits), multiplies the slice by it and writes one f32
// partial per row. The last of a chunk's head blocks to finish adds the partials in head
// order, the bias, and the sum into the residual stream, as the o projection's epilogue would.
// What the o projection's own launch cost (its prologue and first round trips to memory) is
// gone. Dynamic shared memory: one K/V stage, then the slice. `counters` [tokens][chunks] start
// at 0 and are left at 0. `chunk_rows` is a multiple of 4.
#define AO_PIECE 16384
// Threads of an attention_o block: ATTN_WARPS warps do the attention, all multiply.
#define AO_THREADS 384
template <int E>
__device__ __forceinline__ void attention_o(bf16* cache, bf16* out, const int* positions, const int* tok_seq,
                                            const int* block_tables, const int* meta_stride, const int* token_list,
                                            int num_heads, int num_kv_heads, int layer, int num_layers,
                                            int block_size, float scale, RopeIn rope, const bf16* wo, int hidden,
                                            int chunk_rows, const bf16* o_bias, float* x, float* partial,
                                            int* counters) {
    constexpr int HD = 32 * E;
    // Lanes per row: 16-byte pieces of a row go to consecutive lanes, so that a quarter warp's
    // loads cover 128 contiguous bytes (no bank conflicts); PER_LANE pieces each.
    constexpr int LPR = E % 2 == 0 ? 8 : 4, PER_LANE = 4 * E / LPR, ROWS_PER_PASS = 32 / LPR;
    extern __shared__ __align__(16) unsigned char attn_smem[];
    __shared__ float att[HD];
    __shared__ __align__(8) u64 wbar;
    __shared__ int last;
    int t = token_list ? token_list[blockIdx.x] : blockIdx.x;
    int h = blockIdx.y, c = blockIdx.z, tid = threadIdx.x;
    int r0 = c * chunk_rows, nrows = min(chunk_rows, hidden - r0);
    bf16* ws = reinterpret_cast<bf16*>(attn_smem + ATTN_STAGE_BYTES(HD));
    const unsigned char* src = reinterpret_cast<const unsigned char*>(wo + ((u64)h * hidden + r0) * HD);
    u32 bytes = (u32)nrows * HD * 2;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    u32 bar = (u32)__cvta_generic_to_shared(&wbar);
    if (tid == 0) mbar_expect(bar, bytes);
    __syncthreads();
    for (u32 off = tid * AO_PIECE; off < bytes; off += blockDim.x * AO_PIECE)
        bulk_copy((u32)__cvta_generic_to_shared(reinterpret_cast<unsigned char*>(ws) + off), src + off,
                  min((u32)AO_PIECE, bytes - off), bar);
#else
    for (u32 off = tid * 16; off < bytes; off += blockDim.x * 16)
        cp_async16(reinterpret_cast<unsigned char*>(ws) + off, src + off);
    asm volatile("cp.async.commit_group;\n" ::);
#endif
    // Launched with programmatic dependent launch, the block gets here while the qkv
    // projection still runs; everything below reads what it writes.
    PDL_ENTER();
    // Four warps do the attention; the others wait for it (and the weights) at the barrier.
    if (tid < ATTN_WARPS * 32)
        attention_rows<1, E, true>(nullptr, cache, out, positions, tok_seq, block_tables, meta_stride, token_list,
                                   num_heads, num_kv_heads, layer, num_layers, block_size, scale, rope, nullptr, 0,
                                   true, att);
    __syncthreads();
    int lane = tid & 31, warp = tid >> 5, q = lane % LPR, rl = lane / LPR;
    // Lane q's inputs: the pieces q, q + LPR, ... of the head's output.
    float xv[PER_LANE * 8];
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) xv[i * 8 + j] = att[(q + i * LPR) * 8 + j];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    u32 arrived = 0;
    while (!arrived)
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(arrived)
            : "r"(bar)
            : "memory");
#else
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    __syncthreads();
#endif
    float* part_t = partial + (u64)t * num_heads * hidden;
    for (int base = warp * ROWS_PER_PASS; base < nrows; base += (blockDim.x / 32) * ROWS_PER_PASS) {
        int r = base + rl;
        float acc = 0.0f;
        if (r < nrows) {
            // One sum per 16 bytes (independent chains), added in order.
            const bf16* wr = ws + r * HD + q * 8;
            float sums[PER_LANE];
#pragma unroll
            for (int i = 0; i < PER_LANE; ++i) {
                float wf[8];
                unpack8(*reinterpret_cast<const uint4*>(wr + i * LPR * 8), wf);
                sums[i] = 0.0f;
#pragma unroll
                for (int j = 0; j < 8; ++j) sums[i] = fmaf(wf[j], xv[i * 8 + j], sums[i]);
            }
#pragma unroll
            for (int i = 0; i < PER_LANE; ++i) acc += sums[i];
        }
#pragma unroll
        for (int m = 1; m < LPR; m *= 2) acc += __shfl_xor_sync(0xffffffffu, acc, m);
        if (q == 0 && r < nrows) part_t[(u64)h * hidden + r0 + r] = acc;
    }
    // Release the partials, count this head in; the chunk's last head block sums them.
    __threadfence();
    __syncthreads();
    int* counter = counters + t * gridDim.z + c;
    if (tid == 0) last = atomicAdd(counter, 1) == num_heads - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    // Four rows per thread (chunks start at multiples of 4 rows), sixteen heads' partials in
    // flight at a time: a few round trips to L2, not one per head.
    for (int f = tid * 4; f < nrows; f += blockDim.x * 4) {
        int n = min(4, nrows - f);
        float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int h0 = 0; h0 < num_heads; h0 += 16) {
            float4 p[16];
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                const float* src_p = part_t + (u64)(h0 + j) * hidden + r0 + f;
                if (h0 + j >= num_heads) p[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                else if (n == 4 && (hidden & 3) == 0) p[j] = __ldcg(reinterpret_cast<const float4*>(src_p));
                else
                    p[j] = make_float4(__ldcg(src_p), n > 1 ? __ldcg(src_p + 1) : 0.0f, n > 2 ? __ldcg(src_p + 2) : 0.0f,
                                       n > 3 ? __ldcg(src_p + 3) : 0.0f);
            }
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                if (h0 + j < num_heads) {
                    v[0] += p[j].x;
                    v[1] += p[j].y;
                    v[2] += p[j].z;
                    v[3] += p[j].w;
                }
            }
        }
        for (int i = 0; i < n; ++i) {
            float sum = o_bias ? v[i] + bf2f(o_bias[r0 + f + i]) : v[i];
            float* xr = x + (u64)t * hidden + r0 + f + i;
            *xr = residual_add(*xr, sum);
        }
    }
    if (tid == 0) *counter = 0;
}

#define ATTENTION_O(E)                                                                                            \
    extern "C" __global__ void __launch_bounds__(AO_THREADS) attention_o_e##E(                                           \
        bf16* cache, bf16* out, const int* positions, const int* tok_seq, const int* block_tables,                 \
        const int* meta_stride, const int* token_list, int num_heads, int num_kv_heads, int layer, int num_layers, \
        int block_size, float scale, const bf16* qkv, const bf16* qkv_bias, const bf16* q_norm, const bf16* k_norm, \
        const float* cos_t, const float* sin_t, const int* slots, float eps, const bf16* wo, int hidden,            \
        int chunk_rows, const bf16* o_bias, float* x, float* partial, int* counters) {                             \
        RopeIn rope = {qkv, qkv_bias, q_norm, k_norm, cos_t, sin_t, slots, eps};                                  \
        attention_o<E>(cache, out, positions, tok_seq, block_tables, meta_stride, token_list, num_heads,          \
                       num_kv_heads, layer, num_layers, block_size, scale, rope, wo, hidden, chunk_rows, o_bias,   \
                       x, partial, counters);                                                                     \
    }
#if KERNEL_GROUP(4)
ATTENTION_O(1) ATTENTION_O(2) ATTENTION_O(3) ATTENTION_O(4) ATTENTION_O(5) ATTENTION_O(6) ATTENTION_O(7) ATTENTION_O(8)
#endif

// Prefill attention with tensor cores (mma.sync m16n8k16, bf16 in, f32 accumulate), flash
// style: a block of 4 warps takes 64 consecutive query tokens of one sequence and one head;
// each warp owns 16 query rows and keeps its scores, softmax state and output in registers.
// K and V tiles of 64 keys are gathered from the paged cache into shared memory.
//
// Work items: work[2 * i] = sequence, work[2 * i + 1] = first query of the tile (relative to
// the sequence). Sequences: seq_tok[s] (first token in the batch), seq_len[s] (its tokens in
// the batch), seq_pos[s] (position of that first token). Grid: (heads, work items).
#define FA_ROWS 64
#define FA_KEYS 64
// Dynamic shared memory of flash_prefill_hd<HD>: two stages of a K and a V tile.
#define FLASH_SMEM_BYTES(HD) (2 * 2 * FA_KEYS * ((HD) + 8) * 2)

__device__ __forceinline__ void mma_bf16(float* d, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ldmatrix_x4(u32* r, const bf16* p) {
    u32 addr = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(u32* r, const bf16* p) {
    u32 addr = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

template <int HD>
__device__ void flash_prefill(const bf16* q, const bf16* cache, bf16* out, const int* work, const int* seq_tok,
                              const int* seq_len, const int* seq_pos, const int* block_tables,
                              const int* meta_stride, int num_heads, int num_kv_heads, int layer, int num_layers,
                              int block_size, float scale_log2) {
    constexpr int STRIDE = HD + 8;  // padded rows: ldmatrix rows fall in different banks
    constexpr int TILE = FA_KEYS * STRIDE;
    // Two stages of K and V tiles (dynamic shared memory, FLASH_SMEM_BYTES(HD)): the next
    // tile's copy runs while this one is multiplied.
    extern __shared__ __align__(16) unsigned char fa_smem[];
    bf16* tiles = reinterpret_cast<bf16*>(fa_smem);
    // Heads vary fastest across blocks, so the query heads sharing a KV head run together and
    // its tiles come from L2.
    int h = blockIdx.x, kh = h / (num_heads / num_kv_heads);
    int seq = work[2 * blockIdx.y], q0 = work[2 * blockIdx.y + 1];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    int n_q = seq_len[seq], first_pos = seq_pos[seq], tok0 = seq_tok[seq];
    const int* table = block_tables + (u64)seq * meta_stride[0];

    // This warp's rows: queries q0 + warp*16 + {g, g+8}.
    int row_a = q0 + warp * 16 + g, row_b = row_a + 8;
    int pos_a = first_pos + row_a, pos_b = first_pos + row_b;
    bool valid_a = row_a < n_q, valid_b = row_b < n_q;

    // Q fragments for all HD/16 k-steps, straight from global memory.
    u32 qf[HD / 16][4];
#pragma unroll
    for (int ks_i = 0; ks_i < HD / 16; ++ks_i) {
        int c = ks_i * 16 + tq * 2;
        const bf16* qa = q + ((u64)(tok0 + row_a) * num_heads + h) * HD;
        const bf16* qb = q + ((u64)(tok0 + row_b) * num_heads + h) * HD;
        qf[ks_i][0] = valid_a ? *reinterpret_cast<const u32*>(qa + c) : 0u;
        qf[ks_i][1] = valid_b ? *reinterpret_cast<const u32*>(qb + c) : 0u;
        qf[ks_i][2] = valid_a ? *reinterpret_cast<const u32*>(qa + c + 8) : 0u;
        qf[ks_i][3] = valid_b ? *reinterpret_cast<const u32*>(qb + c + 8) : 0u;
    }

    float o[HD / 8][4];
#pragma unroll
    for (int i = 0; i < HD / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m_a = NEG_INF, m_b = NEG_INF, l_a = 0.0f, l_b = 0.0f;

    int last_row = min(q0 + FA_ROWS, n_q) - 1;
    int ctx = first_pos + last_row + 1;  // keys this tile needs
    auto load_tile = [&](int stage, int k0) {
        bf16* ks = tiles + stage * 2 * TILE;
        bf16* vs = ks + TILE;
        for (int c = threadIdx.x; c < FA_KEYS * (HD / 8); c += blockDim.x) {
            int r = c / (HD / 8), part = (c % (HD / 8)) * 8;
            int key = k0 + r;
            const bf16* ksrc = cache;
            const bf16* vsrc = cache;
            int bytes = 0;
            if (key < ctx) {
                int blk = table[key / block_size], slot = key % block_size;
                ksrc = cache + kv_offset(blk, slot, layer, 0, kh, num_layers, num_kv_heads, block_size, HD) + part;
                vsrc = cache + kv_offset(blk, slot, layer, 1, kh, num_layers, num_kv_heads, block_size, HD) + part;
                bytes = 16;
            }
            // Past the context: zero-fill (src-size 0 reads nothing).
            u32 kd = (u32)__cvta_generic_to_shared(&ks[r * STRIDE + part]);
            u32 vd = (u32)__cvta_generic_to_shared(&vs[r * STRIDE + part]);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(kd), "l"(ksrc), "r"(bytes));
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(vd), "l"(vsrc), "r"(bytes));
        }
    };
    load_tile(0, 0);
    asm volatile("cp.async.commit_group;\n" ::);
    for (int kt = 0, k0 = 0; k0 < ctx; ++kt, k0 += FA_KEYS) {
        if (k0 + FA_KEYS < ctx) load_tile((kt + 1) & 1, k0 + FA_KEYS);
        asm volatile("cp.async.commit_group;\n" ::);
        asm volatile("cp.async.wait_group 1;\n" ::);
        __syncthreads();
        const bf16* ks = tiles + (kt & 1) * 2 * TILE;
        const bf16* vs = ks + TILE;
        // Every key here is after this warp's rows: nothing to add (the barrier below is
        // still reached by all warps).
        if (k0 <= first_pos + q0 + warp * 16 + 15) {

        // S = Q K^T for 16 rows x 64 keys: 8 n-tiles of 8 keys.
        float s[FA_KEYS / 8][4];
#pragma unroll
        for (int nt = 0; nt < FA_KEYS / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
        for (int ks_i = 0; ks_i < HD / 16; ++ks_i) {
#pragma unroll
            for (int nt = 0; nt < FA_KEYS / 8; nt += 2) {
                int mi = lane >> 3, r = lane & 7;
                u32 b[4];
                ldmatrix_x4(b, &ks[((nt + (mi >> 1)) * 8 + r) * STRIDE + ks_i * 16 + (mi & 1) * 8]);
                mma_bf16(s[nt], qf[ks_i], b[0], b[1]);
                mma_bf16(s[nt + 1], qf[ks_i], b[2], b[3]);
            }
        }
        // Mask (causal and past-the-end) and online softmax, in log2 units.
        float mx_a = NEG_INF, mx_b = NEG_INF;
#pragma unroll
        for (int nt = 0; nt < FA_KEYS / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                int key = k0 + nt * 8 + tq * 2 + e;
                s[nt][e] = (valid_a && key <= pos_a) ? s[nt][e] * scale_log2 : NEG_INF;
                s[nt][2 + e] = (valid_b && key <= pos_b) ? s[nt][2 + e] * scale_log2 : NEG_INF;
                mx_a = fmaxf(mx_a, s[nt][e]);
                mx_b = fmaxf(mx_b, s[nt][2 + e]);
            }
        }
        mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
        mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
        float mn_a = fmaxf(m_a, mx_a), mn_b = fmaxf(m_b, mx_b);
        // A row with no visible key yet keeps m = -inf; use 0 as the base so exp2 gives 0, not NaN.
        float base_a = mn_a == NEG_INF ? 0.0f : mn_a, base_b = mn_b == NEG_INF ? 0.0f : mn_b;
        float alpha_a = exp2f(m_a - base_a), alpha_b = exp2f(m_b - base_b);
        m_a = mn_a;
        m_b = mn_b;
        l_a *= alpha_a;
        l_b *= alpha_b;
#pragma unroll
        for (int i = 0; i < HD / 8; ++i) {
            o[i][0] *= alpha_a;
            o[i][1] *= alpha_a;
            o[i][2] *= alpha_b;
            o[i][3] *= alpha_b;
        }
        u32 pf[FA_KEYS / 16][4];
#pragma unroll
        for (int nt = 0; nt < FA_KEYS / 8; ++nt) {
            float p0 = exp2f(s[nt][0] - base_a), p1 = exp2f(s[nt][1] - base_a);
            float p2 = exp2f(s[nt][2] - base_b), p3 = exp2f(s[nt][3] - base_b);
            l_a += p0 + p1;
            l_b += p2 + p3;
            // C-fragment of S tile nt -> A-fragment of P for k-step nt/2.
            pf[nt / 2][(nt & 1) * 2 + 0] = pack_bf16x2(p0, p1);
            pf[nt / 2][(nt & 1) * 2 + 1] = pack_bf16x2(p2, p3);
        }
        // O += P V: k = keys (4 steps of 16), n = head dims (HD/8 tiles).
#pragma unroll
        for (int kk = 0; kk < FA_KEYS / 16; ++kk) {
#pragma unroll
            for (int nd = 0; nd < HD / 8; nd += 2) {
                int mi = lane >> 3, r = lane & 7;
                u32 b[4];
                ldmatrix_x4_trans(b, &vs[(kk * 16 + (mi & 1) * 8 + r) * STRIDE + (nd + (mi >> 1)) * 8]);
                mma_bf16(o[nd], pf[kk], b[0], b[1]);
                mma_bf16(o[nd + 1], pf[kk], b[2], b[3]);
            }
        }
        }
        // All warps are done with this stage before the next iteration refills it.
        __syncthreads();
    }
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
    l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
    float inv_a = l_a > 0.0f ? 1.0f / l_a : 0.0f, inv_b = l_b > 0.0f ? 1.0f / l_b : 0.0f;
#pragma unroll
    for (int nd = 0; nd < HD / 8; ++nd) {
        int c = nd * 8 + tq * 2;
        if (valid_a)
            *reinterpret_cast<u32*>(out + ((u64)(tok0 + row_a) * num_heads + h) * HD + c) =
                pack_bf16x2(o[nd][0] * inv_a, o[nd][1] * inv_a);
        if (valid_b)
            *reinterpret_cast<u32*>(out + ((u64)(tok0 + row_b) * num_heads + h) * HD + c) =
                pack_bf16x2(o[nd][2] * inv_b, o[nd][3] * inv_b);
    }
}

#define FLASH_PREFILL(HD)                                                                                       \
    extern "C" __global__ void __launch_bounds__(128) flash_prefill_hd##HD(                                     \
        const bf16* q, const bf16* cache, bf16* out, const int* work, const int* seq_tok, const int* seq_len,     \
        const int* seq_pos, const int* block_tables, const int* meta_stride, int num_heads, int num_kv_heads,     \
        int layer, int num_layers, int block_size, float scale_log2) {                                          \
        PDL_ENTER();                                                                                            \
        flash_prefill<HD>(q, cache, out, work, seq_tok, seq_len, seq_pos, block_tables, meta_stride, num_heads, \
                          num_kv_heads, layer, num_layers, block_size, scale_log2);                             \
    }
#if KERNEL_GROUP(5)
FLASH_PREFILL(64)
FLASH_PREFILL(128)
#endif

// ---------------------------------------------------------------------------------------------
// Sampling. One block (1024 threads) per row of f32 logits.
//
// params[r] = {temperature, top_p, uniform} as floats and top_k in ints[r] (0 = all).
// temperature 0 is greedy: the highest logit, ties to the lowest id. Otherwise: logits /
// temperature, keep the top_k largest, then the smallest set of largest whose probability
// mass reaches top_p, and draw `uniform` (in [0, 1), from the request's own seeded stream)
// over what is kept, in id order.

// Monotone map from float to unsigned (larger float -> larger key).
__device__ __forceinline__ u32 fkey(float f) {
    u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Decode projection on tensor cores (a measurement build, `GemvBuild::Mma`): a warp owns 16
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
#if KERNEL_GROUP(6)
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
#ifdef TANDEM_PDL_TRACE
    bool traced = tid == 0 && trace_anchor_entry(blockIdx.x == 0);
    u64 t_entry = traced ? global_ns() : 0, t_wait = 0, t_landed = 0;
#endif
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
#ifdef TANDEM_PDL_TRACE
    if (traced) t_wait = global_ns();
#endif
    for (int i = tid * 8; i < mcount * K; i += 256 * 8)
        *reinterpret_cast<uint4*>(xs + (i / K) * stride + (i % K) * 2) = ld_nc16(in + i);
    __syncthreads();
    // The copies always complete (valid addresses, sizes within the row); the wait is bounded
    // anyway: past a second something is broken, and the launch fails instead of hanging.
    for (u64 t0 = global_ns(); !mbar_try(bar_s, 0);)
        if (global_ns() - t0 > 1000000000ull) __trap();
#ifdef TANDEM_PDL_TRACE
    if (traced) t_landed = global_ns();
#endif
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
#ifdef TANDEM_PDL_TRACE
    if (traced) {
        unsigned long long t[4] = {t_entry, t_wait, t_landed, global_ns()};
        trace_record(TRACE_BULK, blockIdx.x, t, 4);
    }
    if (tid == 0 && blockIdx.x == 0) atomicAdd(&trace_anchor, 1u);
#endif
#endif
}
#endif

// ---------------------------------------------------------------------------------------------
// The ring decode kernel: every layer of a one-token decode step in one launch, one block per
// multiprocessor. Weights never depend on an earlier stage, only inputs do, so a producer warp
// streams the block's share of every projection (qkv, o, gate/up, down, next layer's qkv, ...)
// into a ring of shared memory with large bulk copies, as far ahead as the ring allows, while
// the consumer warps wait for a stage's input (grid-wide counters), form it (the projections'
// prologues) and multiply what has arrived on tensor cores. Attention runs on the first four
// consumer warps of blocks 0..heads-1 while the ring keeps filling. So HBM streams through the
// waits, launch boundaries and attention that cost the five-kernel step ~0.6 ms.
//
// The weights are streamed from a copy in ring order (ring_tile). For each projection, block
// b's units (16 rows x one K slice of the tensor-core plan; rows past N and columns past K
// zero) form one contiguous region, so the producer copies the concatenation of its regions in
// chunks of RA_CHUNK bytes (the ring is a whole number of chunks; chunk i completes
// full[i % chunks]). Within a region the block's units go in rounds of 8, unit 8 j + w being
// consumer warp w's in round j (a round: 8 / ksplit row groups, as gemv_mma's warps split a
// block's rows), and a round is stored piece by piece: 16 rows x 256 columns (two trips of
// gemv_mma's loop) of each of its units in warp order, then the next 256 columns. So the
// eight warps read adjacent bytes at any moment and the ring need only hold a round of pieces
// (64 KiB) ahead of the slowest warp. Each warp multiplies its pieces exactly as a gemv_mma
// warp multiplies its slice (same fragments, same accumulators, same order); at the end of a
// round the consumers meet and add each group's slices in slice order: results equal the
// tensor-core build of the five-kernel step bit for bit. progress[w] is the stream position of
// warp w's next piece; the producer reuses a chunk's bytes only once every warp is past it.
//
// Stages end with the block's consumers meeting, then one release-add to sync[0]; a stage
// waits until sync[0] counts every block through the previous one. Every wait is bounded:
// after RING_WAIT_NS the waiter sets sync[1] (the host reports the step as failed) and all
// waits stop, so the launch ends. The block arriving last at the final stage puts sync[0]
// back to 0.
#define RING_WARPS (RING_CONSUMERS / 32)
#define RING_THREADS (RING_CONSUMERS + 32)
#define RING_MAX_CHUNKS 32
#define RING_WAIT_NS 2000000000ull

// Word offsets into the kernel's argument block (u64 words; ops::decode_ring_plan writes them).
// Pointers, then integers, then f32 bits; each layer has RL_WORDS words from RA_LAYER0.
#define RA_X 0
#define RA_QKV 1
#define RA_ATTN 2
#define RA_ACT 3
#define RA_CACHE 4
#define RA_POSITIONS 5
#define RA_TOK_SEQ 6
#define RA_TABLES 7
#define RA_STRIDE 8
#define RA_LIST 9
#define RA_COS 10
#define RA_SIN 11
#define RA_SLOTS 12
#define RA_SYNC 13
#define RA_LAYERS 14
#define RA_HIDDEN 15
#define RA_QKV_N 16
#define RA_GU_N 17
#define RA_INTER 18
#define RA_O_K 19
#define RA_HEADS 20
#define RA_KV_HEADS 21
#define RA_BLOCK_SIZE 22
#define RA_EPS 23
#define RA_SCALE 24
#define RA_RING_BYTES 25
#define RA_X_BYTES 26
#define RA_DEBUG 27
#define RA_CHUNK 28
#define RA_TRACE 29
#define RA_PREFETCH 30
#define RA_LAYER0 32
// Per layer: the four projections in ring order (ring_tile), then norms and biases.
#define RL_QKV 0
#define RL_O 1
#define RL_GU 2
#define RL_DOWN 3
#define RL_IN_NORM 4
#define RL_POST_NORM 5
#define RL_Q_NORM 6
#define RL_K_NORM 7
#define RL_QKV_BIAS 8
#define RL_O_BIAS 9
#define RL_GU_BIAS 10
#define RL_DOWN_BIAS 11
#define RL_WORDS 16

// The tensor-core plan's K split for input length k (as ops::mma_grid chooses it) and its
// slice length (whole 32-column pieces).
__device__ __host__ __forceinline__ int mma_ksplit(int k) {
    return k / 8 >= 256 ? 8 : (k / 4 >= 256 ? 4 : (k / 2 >= 256 ? 2 : 1));
}
__device__ __host__ __forceinline__ int mma_slice_len(int k, int ksplit) {
    return ((k + 31) / 32 + ksplit - 1) / ksplit * 32;
}

// Units (row group x slice) before block b's in ring order, for `groups` row groups dealt
// b, b + blocks, ... over `blocks` blocks.
__device__ __forceinline__ u64 ring_units_before(int b, int groups, int blocks, int ksplit) {
    int q = groups / blocks, r = groups % blocks;
    return (u64)ksplit * ((u64)b * q + min(b, r));
}

// Columns per piece: two trips of gemv_mma's loop (MMA_UNROLL pieces of 32 columns each).
#define RING_TRIP_COLS (32 * MMA_UNROLL)
#define RING_PIECE_COLS (2 * RING_TRIP_COLS)

// Columns of piece t of a unit `slice_len` columns wide.
__device__ __forceinline__ int ring_piece_cols(int slice_len, int t) {
    return min(RING_PIECE_COLS, slice_len - RING_PIECE_COLS * t);
}

// Byte offset of piece t of unit u in a block's region of `units` units (see the ring order
// above): round u / 8, then piece, then warp u % 8.
__device__ __forceinline__ u32 ring_piece_offset(int u, int t, int units, int slice_len) {
    int round = u / RING_WARPS, w = u % RING_WARPS, nw = min(RING_WARPS, units - round * RING_WARPS);
    return (u32)round * RING_WARPS * 32 * slice_len + (u32)nw * 32 * RING_PIECE_COLS * t +
           (u32)w * 32 * ring_piece_cols(slice_len, t);
}

// Where a piece `cols` wide keeps 16-byte vector j of row r: rows of 8 or 16 vectors swap
// halves on odd rows, so the 8 lanes of a quarter warp (rows g, g + 1) hit distinct banks.
__device__ __forceinline__ int ring_vec(int j, int r, int cols) {
    return (cols / 8) % 8 == 0 ? j ^ ((r & 1) << 2) : j;
}

// dst = src [n][k] in ring order (see above), for `blocks` ring blocks. Grid: row groups x
// slices (one unit each); block 256.
#if KERNEL_GROUP(0)
extern "C" __global__ void ring_tile(const bf16* src, bf16* dst, int n, int k, int blocks) {
    int ksplit = mma_ksplit(k), slice_len = mma_slice_len(k, ksplit);
    int groups = (n + 15) / 16, rg = blockIdx.x / ksplit, s = blockIdx.x % ksplit;
    int b = rg % blocks, i = rg / blocks;
    int units = ksplit * ((groups - 1 - b) / blocks + 1), u = i * ksplit + s;
    bf16* region = dst + ring_units_before(b, groups, blocks, ksplit) * 16 * slice_len;
    int vecs = slice_len / 8;
    for (int p = threadIdx.x; p < 16 * vecs; p += blockDim.x) {
        int r = p / vecs, t = (p % vecs) / (RING_PIECE_COLS / 8), j = (p % vecs) % (RING_PIECE_COLS / 8);
        int cols = ring_piece_cols(slice_len, t), row = rg * 16 + r;
        int col = s * slice_len + t * RING_PIECE_COLS + j * 8;
        uint4 v = row < n && col < k ? *reinterpret_cast<const uint4*>(src + (u64)row * k + col) : make_uint4(0, 0, 0, 0);
        bf16* piece = region + ring_piece_offset(u, t, units, slice_len) / 2;
        *reinterpret_cast<uint4*>(piece + r * cols + ring_vec(j, r, cols) * 8) = v;
    }
}
#endif

// One projection stage as block b sees it: its region of the ring-order copy and its units.
// Regions are in rank order: rank r takes row groups r, r + blocks, ... (ring_tile's b).
struct RingProj {
    const unsigned char* region;
    int n, k, ksplit, slice_len, groups;  // groups: this block's row groups
    int rank;
    u32 unit_bytes;
};

__device__ __forceinline__ RingProj ring_proj(u64 tiled, int n, int k, int rank) {
    RingProj p;
    p.n = n;
    p.k = k;
    p.rank = rank;
    p.ksplit = mma_ksplit(k);
    p.slice_len = mma_slice_len(k, p.ksplit);
    p.unit_bytes = 16 * p.slice_len * 2;
    int all = (n + 15) / 16;
    p.groups = all > rank ? (all - 1 - rank) / (int)gridDim.x + 1 : 0;
    p.region = reinterpret_cast<const unsigned char*>(tiled) +
               ring_units_before(rank, all, gridDim.x, p.ksplit) * p.unit_bytes;
    return p;
}

// Stage p (0 qkv, 1 o, 2 gate/up, 3 down) of layer l. A stage's leftover row groups (groups
// % blocks: one more for the first ranks) would otherwise fall to the same blocks in every
// stage, which would then be the slowest in all of them; rank 0 is instead the block after
// the previous stage's last leftover, so a block with an extra group in one stage is light in
// the next few and has their weights in its ring before their grid waits end.
__device__ __forceinline__ RingProj ring_stage(const u64* a, int l, int p) {
    const u64* la = a + RA_LAYER0 + l * RL_WORDS;
    int blocks = gridDim.x, hidden = (int)a[RA_HIDDEN];
    int left[4] = {(int)((a[RA_QKV_N] + 15) / 16) % blocks, (hidden + 15) / 16 % blocks,
                   (int)((a[RA_GU_N] + 15) / 16) % blocks, (hidden + 15) / 16 % blocks};
    u32 first = (u32)l * (left[0] + left[1] + left[2] + left[3]);
    for (int i = 0; i < p; ++i) first += left[i];
    int rank = (int)((blockIdx.x + blocks - first % blocks) % blocks);
    switch (p) {
    case 0: return ring_proj(la[RL_QKV], (int)a[RA_QKV_N], hidden, rank);
    case 1: return ring_proj(la[RL_O], hidden, (int)a[RA_O_K], rank);
    case 2: return ring_proj(la[RL_GU], (int)a[RA_GU_N], hidden, rank);
    default: return ring_proj(la[RL_DOWN], hidden, (int)a[RA_INTER], rank);
    }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Marks the step failed (sync[1]): a wait ran past RING_WAIT_NS. Every wait then stops
// waiting, so the launch ends (with wrong results, which the host discards).
__device__ __forceinline__ bool ring_failed(u32* sync, u64 t0) {
    u32 failed;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];\n" : "=r"(failed) : "l"(sync + 1) : "memory");
    if (failed) return true;
    if (global_ns() - t0 <= RING_WAIT_NS) return false;
    atomicExch(sync + 1, 1u);
    return true;
}

// Waits for phase `parity` of the barrier at `bar`, within the ring's time bound.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity, u32* sync) {
    u64 t0 = 0;
    for (u32 tries = 0;; ++tries) {
        if (mbar_try(bar, parity)) return;
        // try_wait itself suspends a while: look at the clock only now and then.
        if (tries % 64 == 0) {
            if (tries == 0) t0 = global_ns();
            else if (ring_failed(sync, t0)) return;
        }
    }
}

// Waits for the copies into a chunk to land, whether or not the step failed (a block must not
// end with copies into its shared memory in flight), within RING_DRAIN_NS.
#define RING_DRAIN_NS 100000000ull
__device__ __forceinline__ bool mbar_drain(u32 bar, u32 parity) {
    if (mbar_try(bar, parity)) return true;
    u64 t0 = global_ns();
    while (!mbar_try(bar, parity))
        if (global_ns() - t0 > RING_DRAIN_NS) return false;
    return true;
}

// The producer (lane 0 of the last warp): the block's regions of every stage, in the
// consumers' order, chunk by chunk. It stops at a chunk boundary when the step fails, and
// before returning waits for every chunk it started.
__device__ __forceinline__ void ring_producer(const u64* a, u32 ring, u32 ring_bytes, u32 chunk, u32 full0,
                                              const volatile u32* progress, u32* sync) {
    int layers = (int)a[RA_LAYERS];
    bool copy = !(a[RA_DEBUG] & 4);
    u32 chunks = ring_bytes / chunk;
    u32 total = 0;
    for (int l = 0; l < layers; ++l)
        for (int p = 0; p < 4; ++p) {
            RingProj pr = ring_stage(a, l, p);
            total += pr.groups * pr.ksplit * pr.unit_bytes;
        }
    // v: stream position; chunk i = v / chunk in ring slot i % chunks, `in_chunk` bytes filled.
    // `least` caches the least warp position last read (positions only grow).
    u32 v = 0, i = 0, slot = 0, in_chunk = 0, least = 0;
    bool failed = false;
    // With RA_PREFETCH bytes (TANDEM_RING_PREFETCH, measurement), a full ring asks L2 for the
    // stream up to that far past v, so DRAM keeps streaming through grid waits and attention and
    // the ring refills from L2. pf: the stream position prefetched to, at (pl, pp, po).
    u32 ahead = (u32)a[RA_PREFETCH], pf = 0, po = 0;
    int pl = 0, pp = 0;
    auto prefetch_to = [&](u32 target) {
        while (pf < target && pl < layers) {
            RingProj pr = ring_stage(a, pl, pp);
            u32 len = pr.groups * pr.ksplit * pr.unit_bytes, n = min(min(len - po, target - pf), chunk);
            // Bytes before v are in the ring already: skip them.
            if (n > 0 && pf >= v)
                asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(pr.region + po), "r"(n) : "memory");
            if (pf < v) n = min(n, v - pf);
            pf += n;
            po += n;
            if (po == len) {
                po = 0;
                if (++pp == 4) {
                    pp = 0;
                    ++pl;
                }
            }
        }
    };
    for (int l = 0; l < layers && !failed; ++l) {
        for (int p = 0; p < 4 && !failed; ++p) {
            RingProj pr = ring_stage(a, l, p);
            u32 len = pr.groups * pr.ksplit * pr.unit_bytes;
            for (u32 done = 0; done < len;) {
                if (in_chunk == 0) {
                    if (i >= chunks) {
                        // Chunk i overwrites chunk i - chunks: wait until every warp is past it.
                        u32 need = (i - chunks + 1) * chunk;
                        if (least < need) {
                            if (ahead) prefetch_to(v + ahead);
                            u64 t0 = global_ns();
                            for (u32 tries = 0;; ++tries) {
                                least = 0xffffffffu;
#pragma unroll
                                for (int w = 0; w < RING_WARPS; ++w) least = min(least, progress[w]);
                                if (least >= need) break;
                                if (tries % 64 == 63 && ring_failed(sync, t0)) {
                                    failed = true;
                                    break;
                                }
                                __nanosleep(64);
                            }
                        }
                        // A warp waited for it, so it has landed; after a failure the warps
                        // stop waiting, and a barrier must not be re-armed mid-phase.
                        if (failed || !mbar_drain(full0 + 8 * slot, (i / chunks - 1) & 1)) {
                            failed = true;
                            break;
                        }
                        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                    }
                    u32 bytes = copy ? min(chunk, total - v) : 0;
                    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(full0 + 8 * slot),
                                 "r"(bytes)
                                 : "memory");
                }
                u32 n = min(len - done, chunk - in_chunk);
                if (copy) bulk_copy(ring + slot * chunk + in_chunk, pr.region + done, n, full0 + 8 * slot);
                v += n;
                done += n;
                in_chunk += n;
                if (in_chunk == chunk) {
                    in_chunk = 0;
                    ++i;
                    slot = slot + 1 == chunks ? 0 : slot + 1;
                }
            }
        }
    }
    // Chunks started: i, and the last one if partly filled (it is the stream's end, or the
    // loop stopped at a chunk boundary).
    u32 started = i + (in_chunk > 0 ? 1 : 0);
    for (u32 c = started > chunks ? started - chunks : 0; c < started; ++c)
        if (!mbar_drain(full0 + 8 * (c % chunks), (c / chunks) & 1)) atomicExch(sync + 1, 1u);
}

// Waits (thread 0 polling, the consumers meeting after) until sync[0] reaches `target`.
__device__ __forceinline__ void ring_grid_wait(u32* sync, u32 target, bool skip) {
    if (threadIdx.x == 0 && target > 0 && !skip) {
        u64 t0 = global_ns();
        for (;;) {
            u32 seen;
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(seen) : "l"(sync) : "memory");
            if (seen >= target || ring_failed(sync, t0)) break;
        }
        __threadfence();
    }
    consumer_sync<true>();
}

// After the consumers met: this block is through a stage. The last block through the last
// stage (`total` arrivals) resets the counter.
__device__ __forceinline__ void ring_arrive(u32* sync, u32 total) {
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(sync, 1u) == total - 1) atomicExch(sync, 0u);
    }
}

// The ring's size and its chunk size, in bytes (stream position v lives at v % ring_bytes).
struct RingPos {
    u32 ring_bytes, chunk;
};

// One projection stage on the consumer side (see gemv_mma for the arithmetic and IN_/OUT_).
// `v` is the stream position of the stage's region. Round j: warp w takes unit 8 j + w (row
// group (8 j + w) / ksplit, slice (8 j + w) % ksplit, as gemv_mma's warps split a block's
// rows), its pieces in order; then the consumers meet and add each group's slices in slice
// order from `partial` (double-buffered by round, so one meeting per round suffices).
// Chunk c of the stream as a consumer warp walks it (forward only): its ring slot and the
// parity of the barrier phase it completes.
struct RingCursor {
    u32 c, slot, parity;
    __device__ __forceinline__ void advance(u32 to, u32 chunks) {
        for (; c < to; ++c)
            if (++slot == chunks) {
                slot = 0;
                parity ^= 1;
            }
    }
};

template <int IN, int OUT>
__device__ __forceinline__ void ring_consume(const RingProj& pr, const void* in, const bf16* norm_w, float eps,
                                             void* out, const bf16* bias, bf16* xs, const unsigned char* ring,
                                             RingPos rp, u32 full0, volatile u32* progress, float* scratch,
                                             float (*partial)[RING_WARPS][16], RingCursor& cur, u32& v, bool arith,
                                             u32* sync) {
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, q = lane & 3;
    int ksplit = pr.ksplit, slice_len = pr.slice_len, units = pr.groups * ksplit;
    int rounds = (units + RING_WARPS - 1) / RING_WARPS, pieces = (slice_len + RING_PIECE_COLS - 1) / RING_PIECE_COLS;
    u32 chunks = rp.ring_bytes / rp.chunk, shift = __ffs(rp.chunk) - 1, stage_end = v + units * pr.unit_bytes;
    // Stream position of this warp's piece t in round j (or the stage's end if it has none):
    // what it publishes in progress[warp] as the next bytes it needs.
    auto piece_at = [&](int j, int t) -> u32 {
        int u = j * RING_WARPS + warp;
        return j < rounds && u < units ? v + ring_piece_offset(u, t, units, slice_len) : stage_end;
    };
    if (lane == 0) progress[warp] = piece_at(0, 0);
    gemv_prologue<IN, true>(xs, pr.k, in, nullptr, norm_w, eps, 0, 1, scratch);
    consumer_sync<true>();
    for (int j = 0; j < rounds; ++j) {
        int u = j * RING_WARPS + warp;
        if (u < units) {
            int col0 = (u % ksplit) * slice_len, cols = min(pr.k - col0, slice_len);
            // gemv_mma's accumulators: 32-column piece p of the slice into acc[p % MMA_UNROLL].
            float acc[MMA_UNROLL][4];
#pragma unroll
            for (int a_ = 0; a_ < MMA_UNROLL; ++a_)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[a_][e] = 0.0f;
            u32 at = piece_at(j, 0);
            for (int t = 0; t < pieces; ++t) {
                int pc = ring_piece_cols(slice_len, t), c0 = t * RING_PIECE_COLS;
                // Wait for the chunks the piece lies in; `base`: its first byte in the ring.
                cur.advance(at >> shift, chunks);
                u32 base = cur.slot * rp.chunk + (at & (rp.chunk - 1));
                mbar_wait(full0 + 8 * cur.slot, cur.parity, sync);
                for (u32 last = (at + 32 * pc - 1) >> shift; cur.c < last;) {
                    cur.advance(cur.c + 1, chunks);
                    mbar_wait(full0 + 8 * cur.slot, cur.parity, sync);
                }
                if (arith) {
                    u32 row_bytes = 2 * pc;
#pragma unroll
                    for (int trip = 0; trip < 2; ++trip) {
                        int k0 = trip * RING_TRIP_COLS;
                        // A trip past the piece or past K adds nothing, as in gemv_mma.
                        if (k0 >= pc || c0 + k0 >= cols) break;
#pragma unroll
                        for (int u_ = 0; u_ < MMA_UNROLL; ++u_) {
                            int c = k0 + u_ * 32 + q * 8;
                            uint4 lo = make_uint4(0, 0, 0, 0), hi = lo, xv = lo;
                            if (c < pc && c0 + c < cols) {
                                u32 p_lo = base + g * row_bytes + ring_vec(c / 8, g, pc) * 16,
                                    p_hi = p_lo + 8 * row_bytes;
                                if (p_lo >= rp.ring_bytes) p_lo -= rp.ring_bytes;
                                if (p_hi >= rp.ring_bytes) p_hi -= rp.ring_bytes;
                                lo = *reinterpret_cast<const uint4*>(ring + p_lo);
                                hi = *reinterpret_cast<const uint4*>(ring + p_hi);
                                if (g == 0) xv = *reinterpret_cast<const uint4*>(xs + col0 + c0 + c);
                            }
                            u32 a0[4] = {lo.x, hi.x, lo.y, hi.y};
                            mma_bf16(acc[u_], a0, xv.x, xv.y);
                            u32 a1[4] = {lo.z, hi.z, lo.w, hi.w};
                            mma_bf16(acc[u_], a1, xv.z, xv.w);
                        }
                    }
                }
                // This warp is done with the piece's bytes.
                u32 next = t + 1 < pieces ? piece_at(j, t + 1) : piece_at(j + 1, 0);
                __syncwarp();
                if (lane == 0) {
                    __threadfence_block();
                    progress[warp] = next;
                }
                at = next;
            }
            // Token 0's sums (lanes q == 0: rows g and g + 8) for the round's reduction.
            if (q == 0) {
                float d0 = acc[0][0], d2 = acc[0][2];
#pragma unroll
                for (int a_ = 1; a_ < MMA_UNROLL; ++a_) {
                    d0 += acc[a_][0];
                    d2 += acc[a_][2];
                }
                partial[j & 1][warp][g] = d0;
                partial[j & 1][warp][g + 8] = d2;
            }
        }
        consumer_sync<true>();
        // The round's whole groups (ksplit divides 8), a thread per row: slices added in order
        // to 0 as gemv_mma adds them (one slice stored as it is). OUT_SILU: the thread of each
        // even row stores the (gate, up) pair.
        int in_round = min(RING_WARPS, units - j * RING_WARPS);
        if (arith && tid < in_round * 16 / ksplit && (OUT != OUT_SILU || tid % 2 == 0)) {
            int gi = tid / 16, r = tid % 16, w0 = gi * ksplit;
            float val = partial[j & 1][w0][r], up = OUT == OUT_SILU ? partial[j & 1][w0][r + 1] : 0.0f;
            if (ksplit > 1) {
                val = 0.0f;
                up = 0.0f;
                for (int s = 0; s < ksplit; ++s) {
                    val += partial[j & 1][w0 + s][r];
                    if (OUT == OUT_SILU) up += partial[j & 1][w0 + s][r + 1];
                }
            }
            int group = (j * RING_WARPS) / ksplit + gi;
            gemv_store<OUT>(out, bias, pr.n, (pr.rank + group * gridDim.x) * 16 + r, 0, 1, val, up);
        }
    }
    if (lane == 0) progress[warp] = stage_end;
    v = stage_end;
    consumer_sync<true>();
}
#endif

template <int E>
__device__ __forceinline__ void decode_ring(const u64* a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) unsigned char ring_smem[];
    __shared__ __align__(8) u64 full_bar[RING_MAX_CHUNKS];
    __shared__ u32 progress[RING_WARPS];
    __shared__ float scratch[32];
    __shared__ float partial[2][RING_WARPS][16];
    int tid = threadIdx.x;
    RingPos rp = {(u32)a[RA_RING_BYTES], (u32)a[RA_CHUNK]};
    u32 x_bytes = (u32)a[RA_X_BYTES];
    u32 full0 = (u32)__cvta_generic_to_shared(full_bar);
    if (tid < RING_MAX_CHUNKS) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(full0 + 8 * tid) : "memory");
    if (tid < RING_WARPS) progress[tid] = 0;
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    if (tid >= RING_CONSUMERS) {
        if (tid == RING_CONSUMERS)
            ring_producer(a, (u32)__cvta_generic_to_shared(ring_smem + x_bytes), rp.ring_bytes, rp.chunk, full0,
                          progress, reinterpret_cast<u32*>(a[RA_SYNC]));
        return;
    }
    bf16* xs = reinterpret_cast<bf16*>(ring_smem);
    const unsigned char* ring = ring_smem + x_bytes;
    float* x = reinterpret_cast<float*>(a[RA_X]);
    bf16 *qkv = reinterpret_cast<bf16*>(a[RA_QKV]), *attn = reinterpret_cast<bf16*>(a[RA_ATTN]);
    bf16* act = reinterpret_cast<bf16*>(a[RA_ACT]);
    u32* sync = reinterpret_cast<u32*>(a[RA_SYNC]);
    int layers = (int)a[RA_LAYERS], heads = (int)a[RA_HEADS];
    float eps = __uint_as_float((u32)a[RA_EPS]), scale = __uint_as_float((u32)a[RA_SCALE]);
    u32 blocks = gridDim.x, total = blocks * 5 * layers, stage = 0, v = 0;
    RingCursor cur = {0, 0, 0};
    // Measurement switches (wrong results): 1 skips the grid waits, 2 the consumers' arithmetic
    // and the attention, 4 the producer's copies, 8 the attention (TANDEM_RING_DEBUG).
    u64 debug = a[RA_DEBUG];
    bool nowait = debug & 1, arith = !(debug & 2);
    volatile u32* prog = progress;
    auto bias = [](u64 p) { return reinterpret_cast<const bf16*>(p); };
    // Optional per-stage clock stamps (RA_TRACE, `TANDEM_RING_TRACE`): [block][stage][2], the
    // global time when the block began the stage (its grid wait over) and when it arrived at
    // the end of it.
    u64* trace = reinterpret_cast<u64*>(a[RA_TRACE]);
    auto stamp = [&](int k) {
        if (trace && tid == 0) trace[((u64)blockIdx.x * (5 * layers) + stage) * 2 + k] = global_ns();
    };
    for (int l = 0; l < layers; ++l) {
        const u64* la = a + RA_LAYER0 + l * RL_WORDS;
        ring_grid_wait(sync, stage * blocks, nowait);
        stamp(0);
        ring_consume<IN_NORM, OUT_BF16>(ring_stage(a, l, 0), x, bias(la[RL_IN_NORM]), eps, qkv, nullptr, xs, ring,
                                        rp, full0, prog, scratch, partial, cur, v, arith, sync);
        stamp(1);
        ring_arrive(sync, total);
        ++stage;
        ring_grid_wait(sync, stage * blocks, nowait);
        stamp(0);
        if (arith && !(debug & 8) && (int)blockIdx.x < heads && tid < ATTN_WARPS * 32) {
            RopeIn rope = {qkv,
                           bias(la[RL_QKV_BIAS]),
                           bias(la[RL_Q_NORM]),
                           bias(la[RL_K_NORM]),
                           reinterpret_cast<const float*>(a[RA_COS]),
                           reinterpret_cast<const float*>(a[RA_SIN]),
                           reinterpret_cast<const int*>(a[RA_SLOTS]),
                           eps};
            attention_rows<1, E, true>(nullptr, reinterpret_cast<bf16*>(a[RA_CACHE]), attn,
                                       reinterpret_cast<const int*>(a[RA_POSITIONS]),
                                       reinterpret_cast<const int*>(a[RA_TOK_SEQ]),
                                       reinterpret_cast<const int*>(a[RA_TABLES]),
                                       reinterpret_cast<const int*>(a[RA_STRIDE]),
                                       reinterpret_cast<const int*>(a[RA_LIST]), heads, (int)a[RA_KV_HEADS], l,
                                       layers, (int)a[RA_BLOCK_SIZE], scale, rope, nullptr, 0, true, nullptr,
                                       blockIdx.x);
        }
        consumer_sync<true>();
        stamp(1);
        ring_arrive(sync, total);
        ++stage;
        ring_grid_wait(sync, stage * blocks, nowait);
        stamp(0);
        ring_consume<IN_BF16, OUT_ADD>(ring_stage(a, l, 1), attn, nullptr, eps, x, bias(la[RL_O_BIAS]), xs, ring, rp,
                                       full0, prog, scratch, partial, cur, v, arith, sync);
        stamp(1);
        ring_arrive(sync, total);
        ++stage;
        ring_grid_wait(sync, stage * blocks, nowait);
        stamp(0);
        ring_consume<IN_NORM, OUT_SILU>(ring_stage(a, l, 2), x, bias(la[RL_POST_NORM]), eps, act,
                                        bias(la[RL_GU_BIAS]), xs, ring, rp, full0, prog, scratch, partial, cur, v, arith, sync);
        stamp(1);
        ring_arrive(sync, total);
        ++stage;
        ring_grid_wait(sync, stage * blocks, nowait);
        stamp(0);
        ring_consume<IN_BF16, OUT_ADD>(ring_stage(a, l, 3), act, nullptr, eps, x, bias(la[RL_DOWN_BIAS]), xs, ring,
                                       rp, full0, prog, scratch, partial, cur, v, arith, sync);
        stamp(1);
        ring_arrive(sync, total);
        ++stage;
    }
#endif
}

#define DECODE_RING(E)                                                                                           \
    extern "C" __global__ void __launch_bounds__(RING_THREADS, 1) decode_ring_e##E(const u64* args) {            \
        decode_ring<E>(args);                                                                                    \
    }
#if KERNEL_GROUP(7)
DECODE_RING(1) DECODE_RING(2) DECODE_RING(4)
#endif

#if KERNEL_GROUP(0)
extern "C" __global__ void ban_tokens(float* logits, int vocab, const int* ban_row, const int* ban_tok, int n) {
    PDL_ENTER();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && ban_tok[i] >= 0 && ban_tok[i] < vocab) logits[(u64)ban_row[i] * vocab + ban_tok[i]] = NEG_INF;
}
#endif

#if KERNEL_GROUP(0)
// Grid (rows, parts). A greedy row's scan is shared by `parts` blocks (grid y), each taking one
// slice; each writes its best (value, index) to `partials` (rows * parts floats, then as many
// ints), and the last to finish, counted in `counters[row]` (zero at rest: that block resets
// it), reduces them and writes the token. One block per row would read a 150k vocabulary's
// 600 KB of logits through a single multiprocessor on every decode step's critical path.
// Sampled rows run whole in block y == 0 (the others leave at once).
extern "C" __global__ void __launch_bounds__(1024) sample_rows(const float* logits, int vocab, const float* params,
                                                                const int* top_ks, int* tokens, unsigned* counters,
                                                                int* partials) {
    PDL_ENTER();
    __shared__ float fscratch[32];
    __shared__ float prefix[1024];
    __shared__ bool last_block;
    int r = blockIdx.x, part = blockIdx.y, parts = gridDim.y;
    const float* row = logits + (u64)r * vocab;
    float temperature = params[3 * r], top_p = params[3 * r + 1], uniform = params[3 * r + 2];
    int top_k = top_ks[r];
    int tid = threadIdx.x, nt = blockDim.x;
    bool split = parts > 1 && temperature <= 0.0f;
    if (parts > 1 && !split && part != 0) return;
    // This block's slice, on multiples of 4 so 16-byte loads stay aligned.
    int lo = 0, hi = vocab;
    if (split) {
        int per = (((vocab + 3) >> 2) + parts - 1) / parts * 4;
        lo = min(part * per, vocab);
        hi = min(lo + per, vocab);
    }

    // Greedy / the row maximum: best value, lowest index on ties. Each thread visits its
    // indices in increasing order. A 16-byte-aligned row goes in batches of four 16-byte
    // loads per thread, so the scan is a few round trips to L2 instead of one per element.
    float best = NEG_INF;
    int best_i = 0x7fffffff;
    auto take = [&](float v, int i) {
        if (v > best) { best = v; best_i = i; }
    };
    if ((vocab & 3) == 0) {
        const float4* row4 = reinterpret_cast<const float4*>(row);
        int b4 = lo >> 2, e4 = hi >> 2;
        for (int i0 = b4 + tid; i0 < e4; i0 += 4 * nt) {
            float4 v[4];
#pragma unroll
            for (int j = 0; j < 4; ++j)
                v[j] = i0 + j * nt < e4 ? row4[i0 + j * nt] : make_float4(NEG_INF, NEG_INF, NEG_INF, NEG_INF);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                int i = (i0 + j * nt) * 4;
                take(v[j].x, i);
                take(v[j].y, i + 1);
                take(v[j].z, i + 2);
                take(v[j].w, i + 3);
            }
        }
    } else {
        for (int i = lo + tid; i < hi; i += nt) take(row[i], i);
    }
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
        if (ov > best || (ov == best && oi < best_i)) { best = ov; best_i = oi; }
    }
    __shared__ float wbest[32];
    __shared__ int wbest_i[32];
    if ((tid & 31) == 0) { wbest[tid >> 5] = best; wbest_i[tid >> 5] = best_i; }
    __syncthreads();
    if (tid < 32) {
        best = tid < nt / 32 ? wbest[tid] : NEG_INF;
        best_i = tid < nt / 32 ? wbest_i[tid] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
            if (ov > best || (ov == best && oi < best_i)) { best = ov; best_i = oi; }
        }
        if (tid == 0) { wbest[0] = best; wbest_i[0] = best_i; }
    }
    __syncthreads();
    float row_max = wbest[0];
    int argmax = wbest_i[0];
    if (split) {
        volatile float* part_v = reinterpret_cast<volatile float*>(partials);
        volatile int* part_i = partials + gridDim.x * parts;
        if (tid == 0) {
            part_v[r * parts + part] = row_max;
            part_i[r * parts + part] = argmax;
            __threadfence();  // the partial is visible before the count says so
            last_block = atomicAdd(&counters[r], 1u) == (unsigned)parts - 1;
        }
        __syncthreads();
        if (!last_block || tid >= 32) return;
        __threadfence();
        best = tid < parts ? part_v[r * parts + tid] : NEG_INF;
        best_i = tid < parts ? part_i[r * parts + tid] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
            if (ov > best || (ov == best && oi < best_i)) { best = ov; best_i = oi; }
        }
        if (tid == 0) {
            tokens[r] = best_i == 0x7fffffff ? 0 : best_i;
            counters[r] = 0;
        }
        return;
    }
    if (temperature <= 0.0f || row_max == NEG_INF) {
        if (tid == 0) tokens[r] = argmax == 0x7fffffff ? 0 : argmax;
        return;
    }
    float inv_t = 1.0f / temperature;

    // Top-k threshold: the largest key K with count(key >= K) >= top_k, bit by bit.
    u32 kth = 0;
    if (top_k > 0 && top_k < vocab) {
        for (int bit = 31; bit >= 0; --bit) {
            u32 cand = kth | (1u << bit);
            float c = 0.0f;
            for (int i = tid; i < vocab; i += nt) c += fkey(row[i]) >= cand ? 1.0f : 0.0f;
            c = block_sum(c, fscratch);
            if (c >= (float)top_k) kth = cand;
        }
    }
    // Probability mass (unnormalised) of what top-k keeps.
    float z = 0.0f;
    for (int i = tid; i < vocab; i += nt) {
        float v = row[i];
        if (fkey(v) >= kth) z += __expf((v - row_max) * inv_t);
    }
    z = block_sum(z, fscratch);
    // Top-p threshold: the largest key P with mass(key >= max(P, kth)) >= top_p * z.
    u32 pth = kth;
    if (top_p < 1.0f) {
        u32 p = 0;
        for (int bit = 31; bit >= 0; --bit) {
            u32 cand = p | (1u << bit);
            u32 floor_key = cand > kth ? cand : kth;
            float mass = 0.0f;
            for (int i = tid; i < vocab; i += nt) {
                float v = row[i];
                if (fkey(v) >= floor_key) mass += __expf((v - row_max) * inv_t);
            }
            mass = block_sum(mass, fscratch);
            if (mass >= top_p * z) p = cand;
        }
        pth = p > kth ? p : kth;
    }
    // Draw over the kept tokens in id order: each thread owns a contiguous range of ids, thread
    // 0 finds the range the draw falls in, its owner walks it.
    int per = (vocab + nt - 1) / nt;
    int begin = min(vocab, tid * per), end = min(vocab, begin + per);
    float mine = 0.0f;
    for (int i = begin; i < end; ++i) {
        float v = row[i];
        if (fkey(v) >= pth) mine += __expf((v - row_max) * inv_t);
    }
    prefix[tid] = mine;
    __shared__ int owner;
    __shared__ float owner_start, target;
    __syncthreads();
    if (tid == 0) {
        float total = 0.0f;
        for (int i = 0; i < nt; ++i) total += prefix[i];
        target = uniform * total;
        float run = 0.0f;
        owner = -1;
        owner_start = 0.0f;
        for (int i = 0; i < nt; ++i) {
            // The last non-empty range starting at or before the target owns it (so rounding
            // past the end still lands on a kept token).
            if (prefix[i] > 0.0f && run <= target) {
                owner = i;
                owner_start = run;
            }
            run += prefix[i];
        }
        if (owner < 0) tokens[r] = argmax;
    }
    __syncthreads();
    if (tid == owner) {
        float run = owner_start;
        int pick = -1;
        for (int i = begin; i < end; ++i) {
            float v = row[i];
            if (fkey(v) >= pth) {
                pick = i;
                run += __expf((v - row_max) * inv_t);
                if (run > target) break;
            }
        }
        tokens[r] = pick;
    }
}
#endif
