// Part of the kernel source (cuda::KERNEL_SOURCE, after common.cuh): weights, norms, activations.

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
// KV between two caches of different block sizes (cuda-ipc writes into a peer's mapped cache).
// Both are block-major: a block is `planes` rows (layer, K|V, KV head), each `block_size` tokens
// of `token_vecs` 16-byte vectors. Tokens 0..num_tokens move from the blocks `src_table` names
// into those `dst_table` names, for the rows `first_plane..first_plane + num_planes` (a group of
// layers). One launch replaces a pitched copy per token segment (which the
// copy engine runs at a quarter of its linear rate). Grid: x over one plane's tokens and
// vectors, y over the group's planes; consecutive threads walk a plane's tokens, so both sides'
// accesses stay contiguous along each block row.
#if KERNEL_GROUP(0)
extern "C" __global__ void kv_scatter(const uint4* src, uint4* dst, const u32* src_table, const u32* dst_table,
                                      u32 num_tokens, u32 planes, u32 token_vecs, u32 src_bs, u32 dst_bs,
                                      u32 first_plane, u32 num_planes) {
    u32 per_plane = num_tokens * token_vecs;
    for (u32 q = blockIdx.y; q < num_planes; q += gridDim.y) {
        u32 p = first_plane + q;
        for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < per_plane; i += gridDim.x * blockDim.x) {
            u32 t = i / token_vecs, v = i - t * token_vecs;
            u64 s = (((u64)src_table[t / src_bs] * planes + p) * src_bs + t % src_bs) * token_vecs + v;
            u64 d = (((u64)dst_table[t / dst_bs] * planes + p) * dst_bs + t % dst_bs) * token_vecs + v;
            dst[d] = src[s];
        }
    }
}
#endif

// The `--kv-verify` digest of tokens 0..num_tokens in the blocks `table` names (kv_digest.rs
// defines it): the wrapping sum over every element of mix(index * GOLDEN ^ bits), index in the
// canonical order (row p, token, element). Grid as kv_scatter's: x over one row's tokens and
// elements, y over the rows; each warp adds its terms into *out (a sum, so in any order).
#if KERNEL_GROUP(0)
__device__ __forceinline__ u64 kv_digest_mix(u64 z) {
    z ^= z >> 30;
    z *= 0xBF58476D1CE4E5B9ull;
    z ^= z >> 27;
    z *= 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

extern "C" __global__ void kv_digest(const void* cache, const u32* table, u32 num_tokens, u32 planes,
                                     u32 head_dim, u32 block_size, u32 elem_bytes, unsigned long long* out) {
    u32 per_plane = num_tokens * head_dim;
    u64 acc = 0;
    for (u32 p = blockIdx.y; p < planes; p += gridDim.y) {
        for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < per_plane; i += gridDim.x * blockDim.x) {
            u32 t = i / head_dim, e = i - t * head_dim;
            u64 at = (((u64)table[t / block_size] * planes + p) * block_size + t % block_size) * head_dim + e;
            u64 index = (u64)p * per_plane + i;
            // An element's bits: bf16 (2 bytes) or FP8 (1).
            u64 bits = elem_bytes == 1 ? (u64) reinterpret_cast<const unsigned char*>(cache)[at]
                                       : (u64) reinterpret_cast<const unsigned short*>(cache)[at];
            acc += kv_digest_mix(index * 0x9E3779B97F4A7C15ull ^ bits);
        }
    }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0 && acc != 0) atomicAdd(out, (unsigned long long)acc);
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

// bf16(silu(g)) * u, before its rounding, for a gate and an up value (each a bf16 value): the
// one definition silu_mul and the fused batch-invariant gate/up product (gemm_skinny_norm) share.
__device__ __forceinline__ float silu_mul_one(float g, float u) { return round_bf16(g / (1.0f + expf(-g))) * u; }

// bf16(bf16(silu(g)) * u) for two elements of gate and up, each packed as two bf16 in a u32.
__device__ __forceinline__ u32 silu_mul_pack(u32 g2, u32 u2) {
    float g0 = __uint_as_float(g2 << 16), g1 = __uint_as_float(g2 & 0xffff0000u);
    float u0 = __uint_as_float(u2 << 16), u1 = __uint_as_float(u2 & 0xffff0000u);
    return pack_bf16x2(silu_mul_one(g0, u0), silu_mul_one(g1, u1));
}

// The residual stream plus a delta, in bf16.
__device__ __forceinline__ float residual_add(float x, float delta) { return round_bf16(x + round_bf16(delta)); }

// The residual add and RMSNorm of one row (xr: the row's residual, updated in place where a
// delta is given; dr / pr its bf16 delta or f32 partial products) by a block of up to 1024
// threads, weighted by w: hands out(i, pair) each thread's next four outputs, columns i .. i + 3
// as two packed bf16 pairs, for i < hidden. A warp's threads hold 128 consecutive columns a
// step (from a multiple of 128, lane l columns 4l .. 4l + 3), so with hidden % 128 == 0 every
// lane of a warp calls `out` at the same steps. add_rms_norm's code and order of sums, which its
// FP8 twin shares.
template <class Out>
__device__ __forceinline__ void add_rms_norm_row(float* xr, const bf16* dr, const float* pr, int slices,
                                                 u64 part_stride, const bf16* w, int hidden, float eps, Out out) {
    __shared__ float scratch[32];
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
            } else if (pr) {
                float4 d = *reinterpret_cast<const float4*>(pr + i);
                for (int s = 1; s < slices; ++s) {
                    float4 e = *reinterpret_cast<const float4*>(pr + s * part_stride + i);
                    d.x += e.x;
                    d.y += e.y;
                    d.z += e.z;
                    d.w += e.w;
                }
                v.x = residual_add(v.x, d.x);
                v.y = residual_add(v.y, d.y);
                v.z = residual_add(v.z, d.z);
                v.w = residual_add(v.w, d.w);
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
            out(i, make_uint2(norm_pack(v.x, v.y, inv, wv.x), norm_pack(v.z, v.w, inv, wv.y)));
        }
    }
}

// out[r] = rms_norm(x[rows[r]]) * w, rows == null meaning r itself. If `delta` is given,
// x[row] += delta[row] first (the residual add fused in front of the norm) and written back.
// Deltas (attention and MLP outputs) are bf16, as transformers' projections return them.
// Grid: output rows. Block: 256 (hidden <= 256 * 32), 1024 beyond (launch bounds of 1024: left
// free, ptxas gave it 70 registers, too many for a block of 1024); hidden % 4 == 0.
// Or, with `parts` (and no `delta`), the delta is the sum of `slices` f32 partial products
// [slice, rows of the product, hidden] `part_stride` floats apart, added in slice order and
// then rounded to bf16: the K-sliced batch-invariant projections (gemm_skinny's `slices`).
#if KERNEL_GROUP(0)
extern "C" __global__ void __launch_bounds__(1024) add_rms_norm(float* x, const bf16* delta, const float* parts, int slices, u64 part_stride,
                                        const int* rows, const bf16* w, bf16* out, int hidden, float eps) {
    PDL_ENTER();
    int r = blockIdx.x;
    int row = rows ? rows[r] : r;
    bf16* out_row = out + (u64)r * hidden;
    add_rms_norm_row(x + (u64)row * hidden, delta ? delta + (u64)row * hidden : 0, parts ? parts + (u64)row * hidden : 0,
                     slices, part_stride, w, hidden, eps,
                     [&](int i, uint2 pair) { *reinterpret_cast<uint2*>(out_row + i) = pair; });
}
#endif

// The batch-invariant residual add + RMSNorm of one row by a block of NORM_THREADS threads, in
// one order of sums that add_rms_norm_b128 and the fused prologue of gemm_wg_norm share (so
// their bits agree whichever serves a row): h = x + delta rounded as the residual stream (no
// delta: h = x), written to x_out if given; thread i takes the 4-element pieces i, i + 128, ...
// and adds their squares one by one (pinned: no contraction choice may differ between the two
// kernels), then the xor butterfly in each warp, then the warps' sums in warp order; out(i, v)
// takes elements i..i+3 of bf16(bf16(h * inv) * w) as four packed bf16. Every thread of the
// block calls it (threads past NORM_THREADS only meet its barriers); hidden % 4 == 0,
// hidden <= 4 * NORM_THREADS * NORM_PIECES. `scratch`: NORM_THREADS / 32 floats.
#define NORM_THREADS 128
#define NORM_PIECES 16
template <class Out>
__device__ __forceinline__ void block_add_rms_norm_row(const float* x, const bf16* delta, float* x_out, const bf16* w,
                                                       Out out, int hidden, float eps, float* scratch) {
    int tid = threadIdx.x;
    bool active = tid < NORM_THREADS;
    float4 v[NORM_PIECES];
    uint2 d[NORM_PIECES];
    // Every load first, then the stores: x_out may be x, so a store between two loads would
    // keep the next load from starting before it (one memory round trip a piece).
#pragma unroll
    for (int p = 0; p < NORM_PIECES; ++p) {
        int i = (tid + p * NORM_THREADS) * 4;
        v[p] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        d[p] = make_uint2(0u, 0u);
        if (active && i < hidden) {
            v[p] = *reinterpret_cast<const float4*>(x + i);
            if (delta) d[p] = *reinterpret_cast<const uint2*>(delta + i);
        }
    }
    float ss = 0.0f;
#pragma unroll
    for (int p = 0; p < NORM_PIECES; ++p) {
        int i = (tid + p * NORM_THREADS) * 4;
        if (active && i < hidden) {
            if (delta) {
                v[p].x = residual_add(v[p].x, __uint_as_float(d[p].x << 16));
                v[p].y = residual_add(v[p].y, __uint_as_float(d[p].x & 0xffff0000u));
                v[p].z = residual_add(v[p].z, __uint_as_float(d[p].y << 16));
                v[p].w = residual_add(v[p].w, __uint_as_float(d[p].y & 0xffff0000u));
            }
            if (x_out) *reinterpret_cast<float4*>(x_out + i) = v[p];
        }
        ss = __fmaf_rn(v[p].x, v[p].x, ss);
        ss = __fmaf_rn(v[p].y, v[p].y, ss);
        ss = __fmaf_rn(v[p].z, v[p].z, ss);
        ss = __fmaf_rn(v[p].w, v[p].w, ss);
    }
    ss = warp_sum(ss);
    __syncthreads();
    if (active && (tid & 31) == 0) scratch[tid >> 5] = ss;
    __syncthreads();
    float total = scratch[0];
#pragma unroll
    for (int j = 1; j < NORM_THREADS / 32; ++j) total = __fadd_rn(total, scratch[j]);
    float inv = rsqrtf(total / (float)hidden + eps);
#pragma unroll
    for (int p = 0; p < NORM_PIECES; ++p) {
        int i = (tid + p * NORM_THREADS) * 4;
        if (active && i < hidden) {
            uint2 wv = *reinterpret_cast<const uint2*>(w + i);
            out(i, make_uint2(norm_pack(v[p].x, v[p].y, inv, wv.x), norm_pack(v[p].z, v[p].w, inv, wv.y)));
        }
    }
}

// A normed row's destination in global memory: contiguous bf16.
struct NormToGlobal {
    bf16* row;
    __device__ __forceinline__ void operator()(int i, uint2 v) const { *reinterpret_cast<uint2*>(row + i) = v; }
};

// add_rms_norm (bf16 deltas or none) in the batch-invariant order of block_add_rms_norm_row:
// the norms of a batch-invariant model whose few-row steps fold them into gemm_wg_norm.
// Grid: output rows. Block: NORM_THREADS.
#if KERNEL_GROUP(0)
extern "C" __global__ void __launch_bounds__(NORM_THREADS)
    add_rms_norm_b128(float* x, const bf16* delta, const int* rows, const bf16* w, bf16* out, int hidden, float eps) {
    PDL_ENTER();
    __shared__ float scratch[NORM_THREADS / 32];
    int r = blockIdx.x;
    u64 row = (u64)(rows ? rows[r] : r) * hidden;
    block_add_rms_norm_row(x + row, delta ? delta + row : 0, delta ? x + row : 0, w, NormToGlobal{out + (u64)r * hidden},
                           hidden, eps, scratch);
}
#endif

// out[t, i] = silu(gu[t, 2i]) * gu[t, 2i + 1]: the gate/up projection's rows come interleaved
// (gate row i, then up row i; see `interleave_rows`), or with `stacked`
// silu(gu[t, i]) * gu[t, inter + i] (the gate rows, then the up rows: FP8 weights). Two
// outputs per thread (inter is even). Grid: (tokens, ceil(inter / 512)). Block: 256.
#if KERNEL_GROUP(0)
extern "C" __global__ void silu_mul(const bf16* gu, bf16* out, int inter, int stacked) {
    PDL_ENTER();
    // Tokens on grid x: a long prefill chunk has more tokens than grid y allows (65535).
    int t = blockIdx.x;
    int i = (blockIdx.y * blockDim.x + threadIdx.x) * 2;
    if (i >= inter) return;
    const bf16* row = gu + (u64)t * 2 * inter;
    u32 g2, u2;
    if (stacked) {
        g2 = *reinterpret_cast<const u32*>(row + i);
        u2 = *reinterpret_cast<const u32*>(row + inter + i);
    } else {
        // gate i, up i, gate i + 1, up i + 1.
        uint2 v = *reinterpret_cast<const uint2*>(row + 2 * i);
        g2 = (v.x & 0xffffu) | (v.y << 16), u2 = (v.x >> 16) | (v.y & 0xffff0000u);
    }
    *reinterpret_cast<u32*>(out + (u64)t * inter + i) = silu_mul_pack(g2, u2);
}
#endif

// dst row 2i = src row i, dst row 2i + 1 = src row half + i (rows of `cols` bf16): the gate/up
// weight (and bias) laid out so that one warp of a decode projection owns a gate row and its up
// row, and SiLU-and-multiply happens in its epilogue. Grid-stride over 16-byte pieces
// (cols % 8 == 0) or elements.
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
