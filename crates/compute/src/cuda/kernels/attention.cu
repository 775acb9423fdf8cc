// Part of the kernel source (cuda::KERNEL_SOURCE, after common.cuh): RoPE, KV write, attention.

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

// An FP8 KV cache (`--kv-cache-dtype fp8`): each key and value the e4m3 byte nearest it (scale
// 1, as vLLM's fp8 cache without calibrated scales; the CPU's KvCache::write_token), read back
// exactly. Stores E values' bytes at p and leaves v holding what the cache now holds.
__device__ __forceinline__ void store_e_fp8(unsigned char* p, float* v, int e) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        if (i < e) {
            u32 b = f32_to_e4m3(v[i]);
            p[i] = (unsigned char)b;
            v[i] = e4m3_to_f32(b);
        }
    }
}

// Loads E (1 to 8) consecutive e4m3 values, with one access when E is 2, 4 or 8.
__device__ __forceinline__ void load_e_fp8(const unsigned char* p, float* v, int e) {
    auto two = [](u32 pair, float* out) { e4m3x2_to_f32x2(pair, out); };
    if (e == 8) {
        uint2 u = *reinterpret_cast<const uint2*>(p);
        two(u.x & 0xffffu, v), two(u.x >> 16, v + 2), two(u.y & 0xffffu, v + 4), two(u.y >> 16, v + 6);
    } else if (e == 4) {
        u32 u = *reinterpret_cast<const u32*>(p);
        two(u & 0xffffu, v), two(u >> 16, v + 2);
    } else if (e == 2) {
        two(*reinterpret_cast<const unsigned short*>(p), v);
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i)
            if (i < e) v[i] = e4m3_to_f32(p[i]);
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
                                          int num_layers, int block_size, float eps, int kv_fp8) {
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
        u64 at = kv_offset(slot / block_size, slot % block_size, layer, kv, kh, num_layers, num_kv_heads, block_size,
                           head_dim) + base;
        // (An FP8 cache's offsets count bytes: one a value.)
        if (kv_fp8) store_e_fp8(reinterpret_cast<unsigned char*>(cache) + at, v, E);
        else store_e(cache + at, v, E);
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
// heads of one GQA group (G = the whole group when there are many tokens or the launch splits
// long contexts into ranges, so keys and values are read once per group; G = 1 at small
// batches over short contexts, so more blocks share the work; split launches of head sizes 64
// and 128 without fused RoPE take attention_rows_mma below). Keys go in
// chunks of ATTN_CHUNK with an online softmax. A decode step is latency bound, so the kernel
// keeps its memory round trips few: a chunk's keys and values are copied into shared memory
// together (cp.async; the first chunk's before anything else, so the copy overlaps the query's
// own loads), then thread j scores key j % 64 from shared memory (rows padded by 16 bytes: no
// bank conflicts; with G >= 2, threads 64-127 take the second half of the heads), one warp per
// head keeps that head's softmax state, and for P.V the four warps
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

// The keys [k0, k1) of a context of `ctx` this block (along z) takes: all of them unsplit,
// else its range; false for a block past the token's ranges (it exits).
__device__ __forceinline__ bool attn_block_range(int ctx, bool split, int split_keys, int& k0, int& k1) {
    k0 = 0, k1 = ctx;
    if (!split) return true;
    int splits = attn_splits(ctx, gridDim.z, split_keys), len = (ctx + splits - 1) / splits;
    if ((int)blockIdx.z >= splits) return false;
    k0 = blockIdx.z * len;
    k1 = min(ctx, k0 + len);
    return true;
}

template <int G, int E, bool FP8>
__device__ __forceinline__ void attention_rows(const bf16* q, bf16* cache, bf16* out, const int* positions,
                                               const int* tok_seq, const int* block_tables, const int* meta_stride,
                                               const int* token_list, int num_heads, int num_kv_heads, int layer,
                                               int num_layers, int block_size, float scale, RopeIn rope, float* part,
                                               int split_keys, bool wait_after_first_keys) {
    constexpr int HD = 32 * E;
    // A staged key or value row: HD bf16 (FP8: bytes) and 16 bytes of padding.
    constexpr int ROW_BYTES = FP8 ? HD + 16 : ATTN_STRIDE(HD) * 2;
    // The cache's bytes (an FP8 cache's offsets count bytes, a bf16 one's elements).
    unsigned char* cache_bytes = reinterpret_cast<unsigned char*>(cache);
    constexpr int EB = FP8 ? 1 : 2;
    // The block's listed token, head group and key split.
    const int bx = blockIdx.x, by = blockIdx.y, bz = blockIdx.z;
    const int nthreads = blockDim.x;
    extern __shared__ __align__(16) unsigned char attn_smem[];
    u32 dynamic_smem;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_smem));
    const int stages = HD <= 128 && dynamic_smem >= 2 * ATTN_STAGE_BYTES(HD) ? 2 : 1;
    // Buffer b: keys at kbuf(b), values ATTN_CHUNK rows further.
    auto kbuf = [&](int b) { return attn_smem + b * 2 * ATTN_CHUNK * ROW_BYTES; };
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
    int k0, k1;
    if (!attn_block_range(ctx, part != nullptr, split_keys, k0, k1)) return;
    const int* table = block_tables + (u64)tok_seq[t] * meta_stride[0];
    bool fused = rope.qkv != nullptr;
    // Keys read from the cache: all of the range, but for the new token's when fused (this
    // launch writes it; the block has it in new_kv).
    int cached = fused ? min(k1, ctx - 1) : k1;
    auto stage = [&](int start, int b) {
        unsigned char* ks = kbuf(b);
        unsigned char* vs = ks + ATTN_CHUNK * ROW_BYTES;
        int n = min(ATTN_CHUNK, cached - start);
        // 16-byte copies a row.
        constexpr int PARTS = HD * EB / 16;
        for (int c = tid; c < n * PARTS; c += nthreads) {
            int r = c / PARTS, part = (c % PARTS) * 16;
            int key = start + r;
            int blk = table[key / block_size], slot = key % block_size;
            u64 k_at = kv_offset(blk, slot, layer, 0, kh, num_layers, num_kv_heads, block_size, HD) * EB;
            u64 v_at = kv_offset(blk, slot, layer, 1, kh, num_layers, num_kv_heads, block_size, HD) * EB;
            cp_async16(ks + r * ROW_BYTES + part, cache_bytes + k_at + part);
            cp_async16(vs + r * ROW_BYTES + part, cache_bytes + v_at + part);
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
    stage(k0, 0);
    // Launched with programmatic dependent launch (fused steps): the cached keys (earlier steps'
    // and the metadata the host wrote) are on their way while the qkv projection finishes; only
    // what follows reads its output.
    if (wait_after_first_keys) PDL_ENTER();
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
                // The group's first block writes the cache; every block keeps what it holds.
                bool writer = slot >= 0 && h0 % group == 0 && bz == 0;
                u64 at = writer ? kv_offset(slot / block_size, slot % block_size, layer, kv, kh, num_layers,
                                            num_kv_heads, block_size, HD) + lane * E
                                : 0;
                if (FP8) {
                    if (writer) store_e_fp8(cache_bytes + at, v, E);
                    else
#pragma unroll
                        for (int e = 0; e < E; ++e) v[e] = e4m3_to_f32(f32_to_e4m3(v[e]));
                } else if (writer) {
                    store_e(cache + at, v, E);
                }
                store_e(&new_kv[kv][lane * E], v, E);
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
        const unsigned char* ks = kbuf(b);
        const unsigned char* vs = ks + ATTN_CHUNK * ROW_BYTES;
        asm volatile("cp.async.wait_all;\n" ::: "memory");
        __syncthreads();
        // The other buffer was last read before the barrier that ended the previous chunk.
        if (stages == 2 && start + ATTN_CHUNK < cached) stage(start + ATTN_CHUNK, b ^ 1);
        // Thread tid scores key tid % 64 against SG of the heads: all of them when G is 1 (two
        // warps work), else the first or the second half (all four).
        constexpr int SG = G >= 2 ? G / 2 : 1;
        const int key = tid & (ATTN_CHUNK - 1), g0 = G >= 2 ? (tid / ATTN_CHUNK) * SG : 0;
        if (key < n && (G >= 2 || tid < ATTN_CHUNK)) {
            bool own = fused && start + key == ctx - 1;
            const unsigned char* row = ks + key * ROW_BYTES;
            const bf16* k = own ? new_kv[0] : reinterpret_cast<const bf16*>(row);
            float dot[SG];
#pragma unroll
            for (int g = 0; g < SG; ++g) dot[g] = 0.0f;
#pragma unroll
            for (int c = 0; c < HD / 8; ++c) {
                float kf[8];
                if (FP8 && !own) load_e_fp8(row + c * 8, kf, 8);
                else unpack8(*reinterpret_cast<const uint4*>(k + c * 8), kf);
#pragma unroll
                for (int g = 0; g < SG; ++g)
#pragma unroll
                    for (int j = 0; j < 8; ++j) dot[g] = fmaf(qs[g0 + g][c * 8 + j], kf[j], dot[g]);
            }
#pragma unroll
            for (int g = 0; g < SG; ++g) ps[g0 + g][key] = dot[g];
        }
        __syncthreads();
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
        __syncthreads();
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float alpha = alpha_s[g];
#pragma unroll
            for (int e = 0; e < E; ++e) acc[g][e] *= alpha;
        }
        // P.V: warp w takes keys w, w + 4, ...
#pragma unroll 4
        for (int j = warp; j < n; j += ATTN_WARPS) {
            bool own = fused && start + j == ctx - 1;
            const unsigned char* row = vs + j * ROW_BYTES;
            float vf[8];
            if (FP8 && !own) load_e_fp8(row + lane * E, vf, E);
            else load_e((own ? new_kv[1] : reinterpret_cast<const bf16*>(row)) + lane * E, vf, E);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float p = ps[g][j];
#pragma unroll
                for (int e = 0; e < E; ++e) acc[g][e] = fmaf(p, vf[e], acc[g][e]);
            }
        }
        __syncthreads();
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
        __syncthreads();
    }
    if (part) {
        for (int i = tid; i < G * (HD + 2); i += nthreads) {
            int g = i / (HD + 2), d = i % (HD + 2);
            float* p = part + (((u64)bx * num_heads + h0 + g) * gridDim.z + bz) * (HD + 2);
            p[d] = d == 0 ? m_s[g] : (d == 1 ? l_s[g] : qs[g][d - 2]);
        }
        return;
    }
    for (int i = tid; i < G * HD; i += nthreads) {
        int g = i / HD, d = i % HD;
        float inv = l_s[g] > 0.0f ? 1.0f / l_s[g] : 0.0f;
        bf16 o = f2bf(qs[g][d] * inv);
        out[((u64)t * num_heads + h0 + g) * HD + d] = o;
    }
}

// An FP8 cache's keys and values of layer `layer` that a step's prefill work items read,
// dequantized into `shadow` (the prefill attention kernels read bf16): one layer's bf16 cache
// with the same blocks, [block][k|v][kv_head][slot][head_dim]. Item (sequence s, first query
// q0 of its 64) takes its own queries' tokens, and a sequence's first item (q0 == 0) also the
// context cached before this step, so every key an item attends is in the shadow once the
// launch is done. The values are the cache's exactly (every e4m3 number is a bf16 number).
// Grid: (items, any). Block: 256; eight values a thread.
#if KERNEL_GROUP(0)
extern "C" __global__ void kv_fp8_shadow(const unsigned char* cache, bf16* shadow, const int* work, const int* seq_len,
                                         const int* seq_pos, const int* block_tables, const int* meta_stride,
                                         int layer, int num_layers, int num_kv_heads, int head_dim, int block_size) {
    // The previous kernel writes this step's keys and values into the cache.
    PDL_ENTER();
    int s = work[2 * blockIdx.x], q0 = work[2 * blockIdx.x + 1];
    int pos0 = seq_pos[s];
    int k0 = q0 == 0 ? 0 : pos0 + q0, k1 = pos0 + min(q0 + 64, seq_len[s]);
    const int* table = block_tables + (u64)s * meta_stride[0];
    int vecs = head_dim / 8, planes = 2 * num_kv_heads;
    u64 total = (u64)max(k1 - k0, 0) * planes * vecs;
    for (u64 i = (u64)blockIdx.y * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.y * blockDim.x) {
        int v = (int)(i % vecs);
        u64 r = i / vecs;
        int plane = (int)(r % planes), key = k0 + (int)(r / planes);
        int blk = table[key / block_size], slot = key % block_size;
        int kv = plane / num_kv_heads, kh = plane % num_kv_heads;
        u64 from = kv_offset(blk, slot, layer, kv, kh, num_layers, num_kv_heads, block_size, head_dim) + v * 8;
        uint2 raw = *reinterpret_cast<const uint2*>(cache + from);
        uint4 out = make_uint4(e4m3x2_to_bf16x2(raw.x & 0xffffu), e4m3x2_to_bf16x2(raw.x >> 16),
                               e4m3x2_to_bf16x2(raw.y & 0xffffu), e4m3x2_to_bf16x2(raw.y >> 16));
        *reinterpret_cast<uint4*>(shadow + kv_offset(blk, slot, 0, kv, kh, 1, num_kv_heads, block_size, head_dim) +
                                  v * 8) = out;
    }
}
#endif

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

// Decode attention over long contexts on tensor cores (mma.sync m16n8k16), for the launches
// that split contexts into key ranges with a whole GQA group a block (ops::attention_rows
// chooses it; no fused RoPE): one block per (listed token, G query heads, key range), as the
// row kernel's grid. The four warps each take their own 16 keys of every 64-key chunk and keep
// their own online softmax over them, so a chunk costs one barrier (the staging ring's) where
// the row kernel has four, and the warps' states merge at the end in warp order. Scores
// S = Q K^T take the heads as A's rows (rows G..15 zero) and 8 keys a B tile; the outputs are
// computed transposed, O^T = V^T P^T, with head dims as A's rows and the heads as B's
// columns, so S's accumulators are P^T's B fragments as they stand, and a lane's A fragments of
// V come from 4 consecutive dims of four key rows (one load each): in each 32-dim slice, tile
// a holds dims 4g and 4g + 1 in rows g and g + 8, tile b dims 4g + 2 and 4g + 3. Over FP8
// caches QK's reduction dims are permuted likewise (lane t's k pairs are dims 4t..4t+3 of a
// 16-dim step, in Q's fragments and K's alike), so a K fragment is one 4-byte load; bf16 K
// fragments are mma.sync's own pairs (two 4-byte loads, no bank conflicts). bf16 caches multiply
// in bf16 (P rounded to bf16, as the prefill kernels); FP8 caches convert e4m3 pairs to f16
// pairs exactly (one instruction from sm_89) and multiply in f16 (queries and P rounded to
// f16). Grid: (tokens, heads / G, most ranges). Block: 128. Dynamic shared memory:
// ATTN_MMA_SMEM_BYTES (a ring of ATTN_MMA_STAGES chunks; reused for the warps' merge).
#define ATTN_MMA_STAGES(FP8) ((FP8) ? 4 : 2)
#define ATTN_MMA_ROW_BYTES(HD, FP8) ((FP8) ? (HD) + 16 : ((HD) + 8) * 2)
#define ATTN_MMA_SMEM_BYTES(HD, FP8) (ATTN_MMA_STAGES(FP8) * 2 * ATTN_CHUNK * ATTN_MMA_ROW_BYTES(HD, FP8))

template <int G, int HD, bool FP8>
__device__ __forceinline__ void attention_rows_mma(const bf16* q, const bf16* cache, bf16* out,
                                                   const int* positions, const int* tok_seq,
                                                   const int* block_tables, const int* meta_stride,
                                                   const int* token_list, int num_heads, int num_kv_heads, int layer,
                                                   int num_layers, int block_size, float scale, float* part,
                                                   int split_keys) {
    constexpr int EB = FP8 ? 1 : 2;
    constexpr int ROW = ATTN_MMA_ROW_BYTES(HD, FP8);
    constexpr int STAGES = ATTN_MMA_STAGES(FP8);
    constexpr int KSTEPS = HD / 16, SLICES = HD / 32;
    static_assert(G <= 8, "a block's heads are the 8 columns of a B tile");
    extern __shared__ __align__(16) unsigned char attn_smem[];
    const unsigned char* cache_bytes = reinterpret_cast<const unsigned char*>(cache);
    const int bx = blockIdx.x, bz = blockIdx.z;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int tok = token_list ? token_list[bx] : bx;
    const int h0 = blockIdx.y * G, kh = h0 / (num_heads / num_kv_heads);
    const int ctx = positions[tok] + 1;
    int k0, k1;
    if (!attn_block_range(ctx, part != nullptr, split_keys, k0, k1)) return;
    const int* table = block_tables + (u64)tok_seq[tok] * meta_stride[0];
    auto kbuf = [&](int b) { return attn_smem + b * 2 * ATTN_CHUNK * ROW; };
    // Copies keys [start, start + 64) of the range into buffer b (values at rows past the range
    // zeroed: a masked key's P is 0, and 0 x NaN would not be), then commits a group (empty
    // past the range, so the ring's count of groups stays right).
    auto stage = [&](int start, int b) {
        if (start < k1) {
            unsigned char* ks = kbuf(b);
            unsigned char* vs = ks + ATTN_CHUNK * ROW;
            int n = min(ATTN_CHUNK, k1 - start);
            constexpr int PARTS = HD * EB / 16;
            for (int c = tid; c < ATTN_CHUNK * PARTS; c += 128) {
                int r = c / PARTS, off = (c % PARTS) * 16;
                if (r < n) {
                    int key = start + r;
                    int blk = table[key / block_size], slot = key % block_size;
                    u64 k_at = kv_offset(blk, slot, layer, 0, kh, num_layers, num_kv_heads, block_size, HD) * EB;
                    u64 v_at = kv_offset(blk, slot, layer, 1, kh, num_layers, num_kv_heads, block_size, HD) * EB;
                    cp_async16(ks + r * ROW + off, cache_bytes + k_at + off);
                    cp_async16(vs + r * ROW + off, cache_bytes + v_at + off);
                } else {
                    *reinterpret_cast<uint4*>(vs + r * ROW + off) = make_uint4(0u, 0u, 0u, 0u);
                }
            }
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
    for (int s = 0; s < STAGES - 1; ++s) stage(k0 + s * ATTN_CHUNK, s);
    // Q as A fragments: row g is head h0 + g (zero past G); k-step s's pairs (a0, a2) are dims
    // 16 s + 4 t, + 1 and 16 s + 4 t + 2, + 3 over FP8 caches, else 16 s + 2 t, + 1 and
    // 16 s + 2 t + 8, + 9; rows g + 8 (a1, a3) are zero.
    u32 qa[KSTEPS][2];
    const bf16* q_row = q + ((u64)tok * num_heads + h0 + min(g, G - 1)) * HD;
#pragma unroll
    for (int s = 0; s < KSTEPS; ++s) {
        if (FP8) {
            uint2 w = *reinterpret_cast<const uint2*>(q_row + 16 * s + 4 * t);
            qa[s][0] = pack_f16x2(bf2f((bf16)(w.x & 0xffffu)), bf2f((bf16)(w.x >> 16)));
            qa[s][1] = pack_f16x2(bf2f((bf16)(w.y & 0xffffu)), bf2f((bf16)(w.y >> 16)));
        } else {
            qa[s][0] = *reinterpret_cast<const u32*>(q_row + 16 * s + 2 * t);
            qa[s][1] = *reinterpret_cast<const u32*>(q_row + 16 * s + 2 * t + 8);
        }
        if (g >= G) qa[s][0] = qa[s][1] = 0u;
    }
    // Head g's running max (the same in lanes 4g..4g+3) and this lane's part of its sum; the
    // outputs O^T: [slice][tile a|b][fragment], fragments 0 and 2 head 2t, 1 and 3 head 2t + 1.
    float m_run = NEG_INF, l_run = 0.0f;
    float acc[SLICES][2][4];
#pragma unroll
    for (int sl = 0; sl < SLICES; ++sl)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[sl][i / 4][i % 4] = 0.0f;
    const int kb = warp * 16;
    int chunk = 0;
    for (int start = k0; start < k1; start += ATTN_CHUNK, ++chunk) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2) : "memory");
        __syncthreads();
        // The buffer this refills was last read in the previous chunk, before the barrier.
        stage(start + (STAGES - 1) * ATTN_CHUNK, (chunk + STAGES - 1) % STAGES);
        if (start + kb >= k1) continue;  // warp-uniform: none of this warp's keys is in range
        const unsigned char* ks = kbuf(chunk % STAGES);
        const unsigned char* vs = ks + ATTN_CHUNK * ROW;
        float sc[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) sc[nt][i] = 0.0f;
#pragma unroll
        for (int s = 0; s < KSTEPS; ++s) {
            u32 a[4] = {qa[s][0], 0u, qa[s][1], 0u};
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                const unsigned char* row = ks + (kb + nt * 8 + g) * ROW;
                if (FP8) {
                    u32 w = *reinterpret_cast<const u32*>(row + 16 * s + 4 * t);
                    mma_f16(sc[nt], a, e4m3x2_to_f16x2(w), e4m3x2_to_f16x2(w >> 16));
                } else {
                    const u32* k = reinterpret_cast<const u32*>(row) + 8 * s + t;
                    mma_bf16(sc[nt], a, k[0], k[4]);
                }
            }
        }
        // This lane's scores of head g: keys kb + 2t, + 1 (tile 0) and kb + 8 + 2t, + 1 (tile 1).
        float p[4];
        float mx = NEG_INF;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int key = start + kb + (i / 2) * 8 + 2 * t + (i % 2);
            p[i] = key < k1 ? sc[i / 2][i % 2] * scale : NEG_INF;
            mx = fmaxf(mx, p[i]);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        float m_new = fmaxf(m_run, mx);
        float m_use = m_new == NEG_INF ? 0.0f : m_new;
        float alpha = __expf(m_run - m_use);
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            p[i] = __expf(p[i] - m_use);
            sum += p[i];
        }
        l_run = l_run * alpha + sum;
        m_run = m_new;
        // This lane's outputs are heads 2t and 2t + 1: their factors from lanes 8t and 8t + 4.
        float alpha_a = __shfl_sync(0xffffffffu, alpha, 8 * t), alpha_b = __shfl_sync(0xffffffffu, alpha, 8 * t + 4);
#pragma unroll
        for (int sl = 0; sl < SLICES; ++sl)
#pragma unroll
            for (int tile = 0; tile < 2; ++tile) {
                acc[sl][tile][0] *= alpha_a;
                acc[sl][tile][1] *= alpha_b;
                acc[sl][tile][2] *= alpha_a;
                acc[sl][tile][3] *= alpha_b;
            }
        // P^T as B: keys 2t, 2t + 1 and 2t + 8, 2t + 9 of head g.
        u32 pb0 = FP8 ? pack_f16x2(p[0], p[1]) : pack_bf16x2(p[0], p[1]);
        u32 pb1 = FP8 ? pack_f16x2(p[2], p[3]) : pack_bf16x2(p[2], p[3]);
#pragma unroll
        for (int sl = 0; sl < SLICES; ++sl) {
            // Keys 2t, 2t + 1, 2t + 8, 2t + 9 of the warp's 16, dims 32 sl + 4g .. + 3.
            const unsigned char* v = vs + (kb + 2 * t) * ROW + (32 * sl + 4 * g) * EB;
            u32 ta[4], tb[4];
            if (FP8) {
                u32 w0 = *reinterpret_cast<const u32*>(v), w1 = *reinterpret_cast<const u32*>(v + ROW);
                u32 w2 = *reinterpret_cast<const u32*>(v + 8 * ROW), w3 = *reinterpret_cast<const u32*>(v + 9 * ROW);
                // Byte pairs (key 2t, key 2t + 1) of one dim: x = dims 4g, 4g + 1, y = 4g + 2, 4g + 3.
                u32 x01 = __byte_perm(w0, w1, 0x5140), y01 = __byte_perm(w0, w1, 0x7362);
                u32 x23 = __byte_perm(w2, w3, 0x5140), y23 = __byte_perm(w2, w3, 0x7362);
                ta[0] = e4m3x2_to_f16x2(x01), ta[1] = e4m3x2_to_f16x2(x01 >> 16);
                ta[2] = e4m3x2_to_f16x2(x23), ta[3] = e4m3x2_to_f16x2(x23 >> 16);
                tb[0] = e4m3x2_to_f16x2(y01), tb[1] = e4m3x2_to_f16x2(y01 >> 16);
                tb[2] = e4m3x2_to_f16x2(y23), tb[3] = e4m3x2_to_f16x2(y23 >> 16);
                mma_f16(acc[sl][0], ta, pb0, pb1);
                mma_f16(acc[sl][1], tb, pb0, pb1);
            } else {
                uint2 w0 = *reinterpret_cast<const uint2*>(v), w1 = *reinterpret_cast<const uint2*>(v + ROW);
                uint2 w2 = *reinterpret_cast<const uint2*>(v + 8 * ROW);
                uint2 w3 = *reinterpret_cast<const uint2*>(v + 9 * ROW);
                // bf16 pairs (key 2t, key 2t + 1) of one dim.
                ta[0] = __byte_perm(w0.x, w1.x, 0x5410), ta[1] = __byte_perm(w0.x, w1.x, 0x7632);
                ta[2] = __byte_perm(w2.x, w3.x, 0x5410), ta[3] = __byte_perm(w2.x, w3.x, 0x7632);
                tb[0] = __byte_perm(w0.y, w1.y, 0x5410), tb[1] = __byte_perm(w0.y, w1.y, 0x7632);
                tb[2] = __byte_perm(w2.y, w3.y, 0x5410), tb[3] = __byte_perm(w2.y, w3.y, 0x7632);
                mma_bf16(acc[sl][0], ta, pb0, pb1);
                mma_bf16(acc[sl][1], tb, pb0, pb1);
            }
        }
    }
    // Merge the warps: each leaves (m, l) per head and its outputs in shared memory (the ring,
    // idle once every copy has landed), then each thread takes outputs (head, dim) in turn.
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 1);
    l_run += __shfl_xor_sync(0xffffffffu, l_run, 2);
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    __syncthreads();
    float* red = reinterpret_cast<float*>(attn_smem);  // [warp][8 heads][HD]
    float* red_m = red + 4 * 8 * HD;                   // [warp][8 heads]
    float* red_l = red_m + 4 * 8;
    if (t == 0) {
        red_m[warp * 8 + g] = m_run;
        red_l[warp * 8 + g] = l_run;
    }
#pragma unroll
    for (int sl = 0; sl < SLICES; ++sl)
#pragma unroll
        for (int tile = 0; tile < 2; ++tile)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                int dim = 32 * sl + 4 * g + 2 * tile + i / 2, head = 2 * t + i % 2;
                red[(warp * 8 + head) * HD + dim] = acc[sl][tile][i];
            }
    __syncthreads();
    for (int i = tid; i < G * HD; i += 128) {
        int h = i / HD, d = i % HD;
        float m = NEG_INF;
#pragma unroll
        for (int w = 0; w < 4; ++w) m = fmaxf(m, red_m[w * 8 + h]);
        float o = 0.0f, l = 0.0f;
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            float mw = red_m[w * 8 + h];
            float f = mw == NEG_INF ? 0.0f : __expf(mw - m);
            o += red[(w * 8 + h) * HD + d] * f;
            l += red_l[w * 8 + h] * f;
        }
        if (part) {
            float* pp = part + (((u64)bx * num_heads + h0 + h) * gridDim.z + bz) * (HD + 2);
            if (d == 0) {
                pp[0] = m;
                pp[1] = l;
            }
            pp[2 + d] = o;
        } else {
            float inv = l > 0.0f ? 1.0f / l : 0.0f;
            out[((u64)tok * num_heads + h0 + h) * HD + d] = f2bf(o * inv);
        }
    }
}

// The row kernel's parameters (one launch site): the RoPE inputs are null (not fused).
#define ATTENTION_MMA_BUILD(NAME, G, HD, FP8)                                                                     \
    extern "C" __global__ void __launch_bounds__(128) NAME(                                                       \
        const bf16* q, const bf16* cache, bf16* out, const int* positions, const int* tok_seq, const int* block_tables, \
        const int* meta_stride, const int* token_list, int num_heads, int num_kv_heads, int layer, int num_layers, \
        int block_size, float scale, const bf16*, const bf16*, const bf16*, const bf16*, const float*, const float*, \
        const int*, float, float* part, int split_keys) {                                                        \
        PDL_ENTER();                                                                                              \
        attention_rows_mma<G, HD, FP8>(q, cache, out, positions, tok_seq, block_tables, meta_stride, token_list, \
                                       num_heads, num_kv_heads, layer, num_layers, block_size, scale, part,     \
                                       split_keys);                                                              \
    }
#define ATTENTION_MMA(G)                                             \
    ATTENTION_MMA_BUILD(attention_mma_g##G##_hd64, G, 64, false)     \
    ATTENTION_MMA_BUILD(attention_mma_g##G##_hd128, G, 128, false)
#define ATTENTION_MMA_FP8(G)                                            \
    ATTENTION_MMA_BUILD(attention_mma_g##G##_hd64_fp8, G, 64, true)     \
    ATTENTION_MMA_BUILD(attention_mma_g##G##_hd128_fp8, G, 128, true)
#if KERNEL_GROUP(3)
ATTENTION_MMA(1) ATTENTION_MMA(2) ATTENTION_MMA(4) ATTENTION_MMA(8)
#endif
#if KERNEL_GROUP(4)
ATTENTION_MMA_FP8(1) ATTENTION_MMA_FP8(2) ATTENTION_MMA_FP8(4) ATTENTION_MMA_FP8(8)
#endif

#define ATTENTION_ROWS_BUILD(NAME, G, E, FP8)                                                                    \
    extern "C" __global__ void __launch_bounds__(128) NAME(                                                       \
        const bf16* q, bf16* cache, bf16* out, const int* positions, const int* tok_seq, const int* block_tables, \
        const int* meta_stride, const int* token_list, int num_heads, int num_kv_heads, int layer, int num_layers, \
        int block_size, float scale, const bf16* qkv, const bf16* qkv_bias, const bf16* q_norm, const bf16* k_norm, \
        const float* cos_t, const float* sin_t, const int* slots, float eps, float* part, int split_keys) {       \
        /* Fused steps wait on the previous kernel inside, after the first cached keys. */                      \
        if (!qkv) PDL_ENTER();                                                                                   \
        RopeIn rope = {qkv, qkv_bias, q_norm, k_norm, cos_t, sin_t, slots, eps};                                 \
        attention_rows<G, E, FP8>(q, cache, out, positions, tok_seq, block_tables, meta_stride, token_list,     \
                                  num_heads, num_kv_heads, layer, num_layers, block_size, scale, rope, part,    \
                                  split_keys, qkv != nullptr);                                                  \
    }
#define ATTENTION_ROWS(G, E) ATTENTION_ROWS_BUILD(attention_rows_g##G##_e##E, G, E, false)
// Over an FP8 cache (`--kv-cache-dtype fp8`): head sizes 64 and 128.
#define ATTENTION_ROWS_FP8(G, E) ATTENTION_ROWS_BUILD(attention_rows_g##G##_e##E##_fp8, G, E, true)
#define ATTENTION_ROWS_ALL_E(G)                                                                                \
    ATTENTION_ROWS(G, 1) ATTENTION_ROWS(G, 2) ATTENTION_ROWS(G, 3) ATTENTION_ROWS(G, 4) ATTENTION_ROWS(G, 5) \
    ATTENTION_ROWS(G, 6) ATTENTION_ROWS(G, 7) ATTENTION_ROWS(G, 8)
// One head per block for every head size; whole groups for the common sizes 64 and 128.
#if KERNEL_GROUP(3)
ATTENTION_ROWS_ALL_E(1)
ATTENTION_ROWS(2, 2) ATTENTION_ROWS(2, 4) ATTENTION_ROWS(4, 2) ATTENTION_ROWS(4, 4) ATTENTION_ROWS(8, 2)
ATTENTION_ROWS(8, 4)
#endif
#if KERNEL_GROUP(4)
ATTENTION_ROWS_FP8(1, 2) ATTENTION_ROWS_FP8(1, 4) ATTENTION_ROWS_FP8(2, 2) ATTENTION_ROWS_FP8(2, 4)
ATTENTION_ROWS_FP8(4, 2) ATTENTION_ROWS_FP8(4, 4) ATTENTION_ROWS_FP8(8, 2) ATTENTION_ROWS_FP8(8, 4)
#endif

// Prefill attention with tensor cores (mma.sync m16n8k16, bf16 in, f32 accumulate), flash
// style: a block of 4 warps takes 64 consecutive query tokens of one sequence and one head;
// each warp owns 16 query rows and keeps its scores, softmax state and output in registers.
// K and V tiles of 64 keys are gathered from the paged cache into shared memory.
//
// Work items: work[2 * i] = sequence, work[2 * i + 1] = first query of the tile (relative to
// the sequence). Sequences: seq_tok[s] (first token in the batch), seq_len[s] (its tokens in
// the batch), seq_pos[s] (position of that first token). Grid: (heads, work items).
//
// PACKED (the batch-invariant build, flash_prefill_packed_hd*): a block takes one KV head and
// its group's G query heads for 64 / G consecutive tokens, row r being token q0 + r / G, head
// kv_head * G + r % G; grid (kv heads, work items). A group's heads share every K/V tile, and
// a decode token (one row per head) costs one block per KV head instead of 64 rows per query
// head. A row's arithmetic is the same in both builds and whatever the other rows are: key
// tiles start at key 0 and every tile past a row's position changes nothing of it, so a
// query's result depends only on its own position, query and keys (not on the chunk it came
// in, nor on the tokens beside it).
//
// The packed build's softmax goes by ranges of FA_RANGE keys: each range's (max, sum, P.V)
// starts afresh, and the ranges are folded into the result in key order (range_fold). That
// order is fixed by the keys alone, so a decode step may instead give the ranges of a long
// context to separate blocks (SPLIT: block z takes ranges z, z + gridDim.z, ..., leaving each
// range's state in `part`) and fold them in flash_range_combine with the same arithmetic: the
// same bits as one block walking every range.
#define FA_RANGE 256

// Folds one key range's softmax state (m in log2 units, l its whole sum) into a row's running
// (M, L): returns the factors (a for the running P.V sum, b for the range's). The rounding is
// pinned (no contraction left to the compiler), so the fold in registers and the fold from
// memory give the same bits. A range without a visible key (m = -inf) must not be folded.
__device__ __forceinline__ void range_fold(float& M, float& L, float m, float l, float& a, float& b) {
    float mn = fmaxf(M, m);
    a = exp2f(M - mn);
    b = exp2f(m - mn);
    L = __fmaf_rn(L, a, __fmul_rn(l, b));
    M = mn;
}
__device__ __forceinline__ float range_scale(float acc, float a, float o, float b) {
    return __fmaf_rn(acc, a, __fmul_rn(o, b));
}
#define FA_ROWS 64
#define FA_KEYS 64
// Dynamic shared memory of flash_prefill_hd<HD>: two stages of a K and a V tile.
#define FLASH_SMEM_BYTES(HD) (2 * 2 * FA_KEYS * ((HD) + 8) * 2)

__device__ __forceinline__ void ldmatrix_x4_trans(u32* r, const bf16* p) {
    u32 addr = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

template <int HD, bool PACKED, bool SPLIT>
__device__ void flash_prefill(const bf16* q, const bf16* cache, bf16* out, const int* work, const int* seq_tok,
                              const int* seq_len, const int* seq_pos, const int* block_tables,
                              const int* meta_stride, int num_heads, int num_kv_heads, int layer, int num_layers,
                              int block_size, float scale_log2, float* part, int max_ranges) {
    constexpr int STRIDE = HD + 8;  // padded rows: ldmatrix rows fall in different banks
    constexpr int TILE = FA_KEYS * STRIDE;
    // Two stages of K and V tiles (dynamic shared memory, FLASH_SMEM_BYTES(HD)): the next
    // tile's copy runs while this one is multiplied.
    extern __shared__ __align__(16) unsigned char fa_smem[];
    bf16* tiles = reinterpret_cast<bf16*>(fa_smem);
    // Heads vary fastest across blocks, so the query heads sharing a KV head run together and
    // its tiles come from L2.
    int group = num_heads / num_kv_heads;
    int kh = PACKED ? blockIdx.x : blockIdx.x / group;
    int seq = work[2 * blockIdx.y], q0 = work[2 * blockIdx.y + 1];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    int n_q = seq_len[seq], first_pos = seq_pos[seq], tok0 = seq_tok[seq];
    const int* table = block_tables + (u64)seq * meta_stride[0];
    // Tokens of the block's tile, and (rows past them unused when packed) its rows.
    int tile_tokens = PACKED ? FA_ROWS / group : FA_ROWS;
    int tile_rows = PACKED ? tile_tokens * group : FA_ROWS;

    // This warp's rows r = warp*16 + {g, g+8}: (token, head) of the sequence's queries.
    int r_a = warp * 16 + g, r_b = r_a + 8;
    int row_a = q0 + (PACKED ? r_a / group : r_a), row_b = q0 + (PACKED ? r_b / group : r_b);
    int h_a = PACKED ? kh * group + r_a % group : blockIdx.x, h_b = PACKED ? kh * group + r_b % group : blockIdx.x;
    int pos_a = first_pos + row_a, pos_b = first_pos + row_b;
    bool valid_a = r_a < tile_rows && row_a < n_q, valid_b = r_b < tile_rows && row_b < n_q;
    // The warp's last position with a query (-1: none; the warp only helps load tiles).
    int r_first = warp * 16, r_last = min(warp * 16 + 15, tile_rows - 1);
    int t_first = q0 + (PACKED ? r_first / group : r_first);
    int t_last = min(q0 + (PACKED ? r_last / group : r_last), n_q - 1);
    int warp_last = r_first < tile_rows && t_first < n_q ? first_pos + t_last : -1;

    // Q fragments for all HD/16 k-steps, straight from global memory.
    u32 qf[HD / 16][4];
#pragma unroll
    for (int ks_i = 0; ks_i < HD / 16; ++ks_i) {
        int c = ks_i * 16 + tq * 2;
        const bf16* qa = q + ((u64)(tok0 + row_a) * num_heads + h_a) * HD;
        const bf16* qb = q + ((u64)(tok0 + row_b) * num_heads + h_b) * HD;
        qf[ks_i][0] = valid_a ? *reinterpret_cast<const u32*>(qa + c) : 0u;
        qf[ks_i][1] = valid_b ? *reinterpret_cast<const u32*>(qb + c) : 0u;
        qf[ks_i][2] = valid_a ? *reinterpret_cast<const u32*>(qa + c + 8) : 0u;
        qf[ks_i][3] = valid_b ? *reinterpret_cast<const u32*>(qb + c + 8) : 0u;
    }

    float o[HD / 8][4];
#pragma unroll
    for (int i = 0; i < HD / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m_a = NEG_INF, m_b = NEG_INF, l_a = 0.0f, l_b = 0.0f;
    // PACKED: the folded ranges so far (see FA_RANGE).
    float acc[HD / 8][4];
#pragma unroll
    for (int i = 0; i < HD / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    float M_a = NEG_INF, M_b = NEG_INF, L_a = 0.0f, L_b = 0.0f;
    // Each lane sums its own keys' weights; a row's whole sum is over its quad.
    auto sum_l_over_quad = [&]() {
        l_a += __shfl_xor_sync(0xffffffffu, l_a, 1);
        l_a += __shfl_xor_sync(0xffffffffu, l_a, 2);
        l_b += __shfl_xor_sync(0xffffffffu, l_b, 1);
        l_b += __shfl_xor_sync(0xffffffffu, l_b, 2);
    };
    // A fresh range's softmax state.
    auto reset_range = [&]() {
#pragma unroll
        for (int i = 0; i < HD / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
        m_a = m_b = NEG_INF;
        l_a = l_b = 0.0f;
    };
    // Ends the current range: its sums whole over the quad, folded in, the state reset.
    auto end_range = [&]() {
        sum_l_over_quad();
        float a_a = 1.0f, b_a = 0.0f, a_b = 1.0f, b_b = 0.0f;
        if (m_a != NEG_INF) range_fold(M_a, L_a, m_a, l_a, a_a, b_a);
        if (m_b != NEG_INF) range_fold(M_b, L_b, m_b, l_b, a_b, b_b);
#pragma unroll
        for (int i = 0; i < HD / 8; ++i) {
            if (m_a != NEG_INF) {
                acc[i][0] = range_scale(acc[i][0], a_a, o[i][0], b_a);
                acc[i][1] = range_scale(acc[i][1], a_a, o[i][1], b_a);
            }
            if (m_b != NEG_INF) {
                acc[i][2] = range_scale(acc[i][2], a_b, o[i][2], b_b);
                acc[i][3] = range_scale(acc[i][3], a_b, o[i][3], b_b);
            }
        }
        reset_range();
    };

    int last_row = min(q0 + tile_tokens, n_q) - 1;
    int ctx = first_pos + last_row + 1;  // keys this tile needs
    // SPLIT: this block's ranges are z, z + gridDim.z, ...; each is stored, not folded.
    int range = SPLIT ? blockIdx.z : 0;
    int k_first = SPLIT ? range * FA_RANGE : 0;
    if (k_first >= ctx) return;  // the whole block: no barrier is reached
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
    // The next tile's first key after k0: the next in this range, else (SPLIT) the first of
    // this block's next range.
    auto next_key = [&](int k0) {
        int k = k0 + FA_KEYS;
        if (SPLIT && k % FA_RANGE == 0) k += (gridDim.z - 1) * FA_RANGE;
        return k;
    };
    // SPLIT: stores the ended range's state of this warp's valid rows.
    auto store_range = [&](int rg) {
        if (!SPLIT) return;
#pragma unroll
        for (int nd = 0; nd < HD / 8; ++nd) {
            int c = nd * 8 + tq * 2;
            if (valid_a) {
                float* pa = part + (((u64)(tok0 + row_a) * num_heads + h_a) * max_ranges + rg) * (HD + 2);
                pa[2 + c] = o[nd][0];
                pa[3 + c] = o[nd][1];
                if (nd == 0 && tq == 0) {
                    pa[0] = m_a;
                    pa[1] = l_a;
                }
            }
            if (valid_b) {
                float* pb = part + (((u64)(tok0 + row_b) * num_heads + h_b) * max_ranges + rg) * (HD + 2);
                pb[2 + c] = o[nd][2];
                pb[3 + c] = o[nd][3];
                if (nd == 0 && tq == 0) {
                    pb[0] = m_b;
                    pb[1] = l_b;
                }
            }
        }
    };
    load_tile(0, k_first);
    asm volatile("cp.async.commit_group;\n" ::);
    for (int kt = 0, k0 = k_first; k0 < ctx; ++kt, k0 = next_key(k0)) {
        if (next_key(k0) < ctx) load_tile((kt + 1) & 1, next_key(k0));
        asm volatile("cp.async.commit_group;\n" ::);
        asm volatile("cp.async.wait_group 1;\n" ::);
        __syncthreads();
        const bf16* ks = tiles + (kt & 1) * 2 * TILE;
        const bf16* vs = ks + TILE;
        // A new range (packed build): the last one is stored (SPLIT) or folded in.
        if (PACKED && k0 != k_first && k0 % FA_RANGE == 0 && k0 <= warp_last) {
            if (SPLIT) {
                sum_l_over_quad();
                store_range(range);
                range += gridDim.z;
                reset_range();
            } else {
                end_range();
            }
        }
        // Every key here is after this warp's rows (or it has none): nothing to add (the
        // barrier below is still reached by all warps).
        if (k0 <= warp_last) {

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
    if constexpr (SPLIT) {
        // The last range this block took (the warps without rows store nothing).
        sum_l_over_quad();
        store_range(range);
        return;
    }
    if constexpr (PACKED) {
        end_range();
#pragma unroll
        for (int i = 0; i < HD / 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[i][e] = acc[i][e];
        l_a = L_a;
        l_b = L_b;
    } else {
        sum_l_over_quad();
    }
    float inv_a = l_a > 0.0f ? 1.0f / l_a : 0.0f, inv_b = l_b > 0.0f ? 1.0f / l_b : 0.0f;
#pragma unroll
    for (int nd = 0; nd < HD / 8; ++nd) {
        int c = nd * 8 + tq * 2;
        if (valid_a)
            *reinterpret_cast<u32*>(out + ((u64)(tok0 + row_a) * num_heads + h_a) * HD + c) =
                pack_bf16x2(o[nd][0] * inv_a, o[nd][1] * inv_a);
        if (valid_b)
            *reinterpret_cast<u32*>(out + ((u64)(tok0 + row_b) * num_heads + h_b) * HD + c) =
                pack_bf16x2(o[nd][2] * inv_b, o[nd][3] * inv_b);
    }
}

#define FLASH_PREFILL(NAME, HD, PACKED, SPLIT)                                                                   \
    extern "C" __global__ void __launch_bounds__(128) NAME(                                                        \
        const bf16* q, const bf16* cache, bf16* out, const int* work, const int* seq_tok, const int* seq_len,      \
        const int* seq_pos, const int* block_tables, const int* meta_stride, int num_heads, int num_kv_heads,      \
        int layer, int num_layers, int block_size, float scale_log2, float* part, int max_ranges) {              \
        PDL_ENTER();                                                                                             \
        flash_prefill<HD, PACKED, SPLIT>(q, cache, out, work, seq_tok, seq_len, seq_pos, block_tables,           \
                                         meta_stride, num_heads, num_kv_heads, layer, num_layers, block_size,    \
                                         scale_log2, part, max_ranges);                                          \
    }
#if KERNEL_GROUP(4)
FLASH_PREFILL(flash_prefill_hd64, 64, false, false)
FLASH_PREFILL(flash_prefill_hd128, 128, false, false)
FLASH_PREFILL(flash_prefill_packed_hd64, 64, true, false)
FLASH_PREFILL(flash_prefill_packed_hd128, 128, true, false)
FLASH_PREFILL(flash_prefill_split_hd64, 64, true, true)
FLASH_PREFILL(flash_prefill_split_hd128, 128, true, true)

// ---------------------------------------------------------------------------------------------
// Prefill attention on Hopper's warpgroup MMAs (wgmma; sm_90a, head_dim 128, the default build:
// not packed, not split). A block of two warpgroups takes one work item of flash_prefill's (64
// consecutive queries of one sequence) for two query heads of one KV head, warpgroup w the head
// 2 * blockIdx.x + w. Both read every K/V tile the block copies into shared memory, so a tile
// serves 128 rows: half the tile traffic from L2 per product of a block of one head, which the
// tensor cores would otherwise outrun.
//
// Q (both heads' rows) and two stages of 128-key K and V tiles sit in shared memory in the
// layout wgmma reads with 128-byte swizzling: 64 bf16 of a row make 128 bytes, whose 16-byte
// chunk c is stored at chunk c ^ (row % 8); a row's 128 head dims are two such atoms, each atom
// all of the tile's rows (1024-byte aligned). S = Q K^T takes both from shared memory (K-major:
// a key's dims are contiguous, as Q's are). P goes from S's accumulators straight into wgmma's
// A registers (the accumulator and the A fragment layouts line up as mma.sync's do), and
// O += P V reads V as an N-major operand (a key's dims contiguous along N), so nothing is
// transposed. The softmax is flash_prefill's: log2 units, online, the diagonal tile masked.
// Grid: (num_heads / 2, work items); the group size must be even. Block: 256.
// Dynamic shared memory: WG_SMEM_BYTES.
#define WG_KEYS 128
// The packed Hopper builds' softmax ranges (see wg_pp): eight tiles, so that the fold through
// shared memory comes once in eight tiles.
#define WG_RANGE_TILES 8
#define WG_RANGE (WG_RANGE_TILES * WG_KEYS)
// An atom: 128 rows of 128 bytes (Q: both heads' 64 rows; K and V: the tile's 128 keys).
#define WG_ATOM_BYTES (128 * 128)
#define WG_Q_BYTES (2 * WG_ATOM_BYTES)
#define WG_STAGE_BYTES (4 * WG_ATOM_BYTES)
// Q, two stages of K and V, and room to align the start to 1024 bytes.
#define WG_SMEM_BYTES (WG_Q_BYTES + 2 * WG_STAGE_BYTES + 1024)

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The compiler knows nothing of wgmma's asynchrony: this pins the 64 accumulators in place
// around a batch (nothing reads or moves them across the fence).
__device__ __forceinline__ void wg_pin(float* d) {
#pragma unroll
    for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// d (64 x 128, f32) = or += A (64 x 16, bf16, shared memory, K-major) x B (16 x 128, bf16, shared
// memory, K-major).
__device__ __forceinline__ void wg_mma_ss(float* d, u64 a, u64 b, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(a), "l"(b), "r"(accumulate)
                 : "memory");
}
// d (64 x 128, f32) += A (64 x 16, bf16, registers: a0..a3 as mma.sync's A fragment, per warp)
// x B (16 x 128, bf16, shared memory, N-major).
__device__ __forceinline__ void wg_mma_rs(float* d, const u32* a, u64 b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1)
                 : "memory");
}
// 16 bytes from `src` (none past the context: src_bytes 0 zero-fills) to chunk `chunk` of row
// `row` of the swizzled atom at shared address `atom`.
__device__ __forceinline__ void wg_copy_chunk(u32 atom, int row, int chunk, const bf16* src, int src_bytes) {
    u32 dst = atom + row * 128 + ((chunk ^ (row & 7)) << 4);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
// This warpgroup's rows of a 64-query work item: r0 = 16 warp + lane / 4 and r0 + 8 (the
// accumulators' layout), their positions, and their online softmax's running max and sum.
struct WgRows {
    int pos0, pos1;
    float m0, m1, l0, l1;
};
// S (64 x 128 keys) = Q K^T, issued as 8 steps of 16 head dims, 4 in each atom (32 bytes apart);
// wg_scores_wait waits for it.
__device__ __forceinline__ void wg_scores_issue(float* s, u32 q_rows, u32 k_tile) {
    wg_pin(s);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
        u32 off = (kk >> 2) * WG_ATOM_BYTES + (kk & 3) * 32;
        wg_mma_ss(s, wg_desc(q_rows + off, 16, 1024), wg_desc(k_tile + off, 16, 1024), kk > 0);
    }
    wg_commit();
}
__device__ __forceinline__ void wg_scores_wait(float* s) {
    wg_wait_all();
    wg_pin(s);
}
// The mask (keys past a row's position: only tiles reaching past the item's first query, at
// min_pos) and the online softmax of S (64 x 128 keys at k0) in log2 units: S's entries become
// their exponentials, the rows' running max and sum move on, alpha0/1 come back (what O's rows
// are to be scaled by). The maxima are taken of the raw scores (scaling by a positive factor
// keeps them where they are) so that each exponent is one FFMA, s * scale - max.
// s[4i + e]: row r0, key k0 + 8i + 2tq + e; s[4i + 2 + e]: row r1.
__device__ __forceinline__ void wg_softmax(float* s, WgRows& r, int k0, int min_pos, float scale_log2, int tq,
                                           float& alpha0, float& alpha1) {
    if (k0 + WG_KEYS - 1 > min_pos) {
#pragma unroll
        for (int i = 0; i < 16; ++i) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                int key = k0 + i * 8 + tq * 2 + e;
                if (key > r.pos0) s[4 * i + e] = NEG_INF;
                if (key > r.pos1) s[4 * i + 2 + e] = NEG_INF;
            }
        }
    }
    float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        mx0 = fmaxf(mx0, fmaxf(s[4 * i], s[4 * i + 1]));
        mx1 = fmaxf(mx1, fmaxf(s[4 * i + 2], s[4 * i + 3]));
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    float mn0 = fmaxf(r.m0, mx0 * scale_log2), mn1 = fmaxf(r.m1, mx1 * scale_log2);
    // A row with no visible key yet keeps m = -inf; 0 as the base keeps exp2 at 0, not NaN.
    float base0 = mn0 == NEG_INF ? 0.0f : mn0, base1 = mn1 == NEG_INF ? 0.0f : mn1;
    alpha0 = exp2f(r.m0 - base0);
    alpha1 = exp2f(r.m1 - base1);
    r.m0 = mn0;
    r.m1 = mn1;
    // The sums' rounding is pinned (no FMA left to the compiler), as wn_decode repeats it.
    r.l0 = __fmul_rn(r.l0, alpha0);
    r.l1 = __fmul_rn(r.l1, alpha1);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        float p0 = exp2f(fmaf(s[4 * i], scale_log2, -base0)), p1 = exp2f(fmaf(s[4 * i + 1], scale_log2, -base0));
        float p2 = exp2f(fmaf(s[4 * i + 2], scale_log2, -base1)), p3 = exp2f(fmaf(s[4 * i + 3], scale_log2, -base1));
        r.l0 = __fadd_rn(r.l0, __fadd_rn(p0, p1));
        r.l1 = __fadd_rn(r.l1, __fadd_rn(p2, p3));
        s[4 * i] = p0;
        s[4 * i + 1] = p1;
        s[4 * i + 2] = p2;
        s[4 * i + 3] = p3;
    }
}
// O's rows scaled by alpha, and P (wg_softmax's exponentials) as bf16 in wgmma's A fragments:
// key chunk i's C fragment is the A fragment of k-step i / 2 (the layouts line up).
__device__ __forceinline__ void wg_rescale_pack(const float* s, float* o, u32 (*p)[4], float alpha0, float alpha1) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        p[i / 2][(i & 1) * 2 + 0] = pack_bf16x2(s[4 * i], s[4 * i + 1]);
        p[i / 2][(i & 1) * 2 + 1] = pack_bf16x2(s[4 * i + 2], s[4 * i + 3]);
        o[4 * i] *= alpha0;
        o[4 * i + 1] *= alpha0;
        o[4 * i + 2] *= alpha1;
        o[4 * i + 3] *= alpha1;
    }
}
// O += P V issued (one commit group): 8 steps of 16 keys (2048 bytes apart in each atom); the
// N-major operand's leading offset is the atom stride (head dims 64-127), its stride offset 8
// keys. P's registers are read while the products run: they stay as they are until waited for.
__device__ __forceinline__ void wg_pv_issue(float* o, u32 (*p)[4], u32 v_tile) {
    wg_pin(o);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < WG_KEYS / 16; ++kk) wg_mma_rs(o, p[kk], wg_desc(v_tile + kk * 2048, WG_ATOM_BYTES, 1024));
    wg_commit();
}
// P's registers held until here (wgmma read them after the instructions that named them).
__device__ __forceinline__ void wg_pin_p(u32 (*p)[4]) {
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(p[i][j])::"memory");
}
// The softmax of S then O += P V over the tile's 128 keys at k0 (V at v_tile), waited for.
__device__ __forceinline__ void wg_softmax_pv(float* s, float* o, WgRows& r, int k0, int min_pos, float scale_log2,
                                              u32 v_tile, int tq) {
    float alpha0, alpha1;
    wg_softmax(s, r, k0, min_pos, scale_log2, tq, alpha0, alpha1);
    u32 p[8][4];
    wg_rescale_pack(s, o, p, alpha0, alpha1);
    wg_pv_issue(o, p, v_tile);
    wg_wait_all();
    wg_pin(o);
    wg_pin_p(p);
}
// O's rows normalised, as bf16, to head h of the item's tokens (those of the sequence's n_q).
__device__ __forceinline__ void wg_store(bf16* out, const float* o, WgRows& r, int tok0, int q0, int n_q, int r0,
                                         int h, int num_heads, int tq) {
    float l0 = r.l0, l1 = r.l1;
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    float inv0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, inv1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
    int r1 = r0 + 8;
    bool valid0 = q0 + r0 < n_q, valid1 = q0 + r1 < n_q;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        int c = i * 8 + tq * 2;
        if (valid0)
            *reinterpret_cast<u32*>(out + ((u64)(tok0 + q0 + r0) * num_heads + h) * 128 + c) =
                pack_bf16x2(o[4 * i] * inv0, o[4 * i + 1] * inv0);
        if (valid1)
            *reinterpret_cast<u32*>(out + ((u64)(tok0 + q0 + r1) * num_heads + h) * 128 + c) =
                pack_bf16x2(o[4 * i + 2] * inv1, o[4 * i + 3] * inv1);
    }
}
// mbarriers (shared memory, this block): init, arrive, the wait for a phase's parity, and the
// arrive that cp.async fires once this thread's earlier copies landed (noinc: counted in init).
__device__ __forceinline__ void mbar_init(u32 bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile("{\n.reg .pred done;\nWAIT:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra WAIT;\n}\n" ::"r"(bar),
                 "r"(parity)
                 : "memory");
}
__device__ __forceinline__ void mbar_arrive_copies(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Named barriers among the two consumer warpgroups (256 threads): wait for ours, arrive on the other's.
__device__ __forceinline__ void named_sync(int id) { asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory"); }
__device__ __forceinline__ void named_arrive(int id) { asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory"); }
#endif

extern "C" __global__ void __launch_bounds__(256, 1)
    flash_prefill_wgmma_hd128(const bf16* q, const bf16* cache, bf16* out, const int* work, const int* seq_tok,
                              const int* seq_len, const int* seq_pos, const int* block_tables, const int* meta_stride,
                              int num_heads, int num_kv_heads, int layer, int num_layers, int block_size,
                              float scale_log2, float* part, int max_ranges) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int HD = 128;
    PDL_ENTER();
    extern __shared__ __align__(16) unsigned char wg_smem[];
    u32 base = ((u32)__cvta_generic_to_shared(wg_smem) + 1023u) & ~1023u;
    u32 q_smem = base, stages = base + WG_Q_BYTES;
    int group = num_heads / num_kv_heads;
    int head0 = 2 * blockIdx.x, kh = head0 / group;
    int seq = work[2 * blockIdx.y], q0 = work[2 * blockIdx.y + 1];
    int n_q = seq_len[seq], first_pos = seq_pos[seq], tok0 = seq_tok[seq];
    const int* table = block_tables + (u64)seq * meta_stride[0];
    int last_row = min(q0 + 64, n_q) - 1;
    int ctx = first_pos + last_row + 1;  // keys the item needs
    int min_pos = first_pos + q0;        // the item's first query's position

    // Copies: thread t takes row t / 2 of a tile, its head dims [64 (t % 2), 64 (t % 2) + 64)
    // (one atom's row: 8 chunks).
    int copy_row = threadIdx.x >> 1, copy_atom = threadIdx.x & 1;
    {
        int w = copy_row >> 6, r = copy_row & 63;
        bool valid = q0 + r < n_q;
        const bf16* src = valid ? q + ((u64)(tok0 + q0 + r) * num_heads + head0 + w) * HD + copy_atom * 64 : q;
        for (int c = 0; c < 8; ++c)
            wg_copy_chunk(q_smem + copy_atom * WG_ATOM_BYTES, copy_row, c, src + c * 8, valid ? 16 : 0);
    }
    auto load_tile = [&](int stage, int k0) {
        int key = k0 + copy_row;
        u32 k_atom = stages + stage * WG_STAGE_BYTES + copy_atom * WG_ATOM_BYTES;
        u32 v_atom = k_atom + 2 * WG_ATOM_BYTES;
        const bf16* ksrc = cache;
        const bf16* vsrc = cache;
        int bytes = 0;
        if (key < ctx) {
            int blk = table[key / block_size], slot = key % block_size;
            ksrc = cache + kv_offset(blk, slot, layer, 0, kh, num_layers, num_kv_heads, block_size, HD) + copy_atom * 64;
            vsrc = cache + kv_offset(blk, slot, layer, 1, kh, num_layers, num_kv_heads, block_size, HD) + copy_atom * 64;
            bytes = 16;
        }
        for (int c = 0; c < 8; ++c) {
            wg_copy_chunk(k_atom, copy_row, c, ksrc + (bytes ? c * 8 : 0), bytes);
            wg_copy_chunk(v_atom, copy_row, c, vsrc + (bytes ? c * 8 : 0), bytes);
        }
    };
    load_tile(0, 0);
    asm volatile("cp.async.commit_group;\n" ::);

    int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, tq = lane & 3;
    int r0 = warp * 16 + (lane >> 2);
    WgRows rows{first_pos + q0 + r0, first_pos + q0 + r0 + 8, NEG_INF, NEG_INF, 0.0f, 0.0f};
    float s[64], o[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.0f;
    u32 q_rows = q_smem + wg * 64 * 128;

    for (int kt = 0, k0 = 0; k0 < ctx; ++kt, k0 += WG_KEYS) {
        // This tile (and Q, the first time) landed; visible to the async proxy wgmma reads.
        asm volatile("cp.async.wait_group 0;\n" ::);
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads();
        // The other stage was last read by the previous tile's products, which every
        // warpgroup waited for before the barrier above.
        if (k0 + WG_KEYS < ctx) load_tile((kt + 1) & 1, k0 + WG_KEYS);
        asm volatile("cp.async.commit_group;\n" ::);
        u32 k_tile = stages + (kt & 1) * WG_STAGE_BYTES;
        wg_scores_issue(s, q_rows, k_tile);
        wg_scores_wait(s);
        wg_softmax_pv(s, o, rows, k0, min_pos, scale_log2, k_tile + 2 * WG_ATOM_BYTES, tq);
    }
    wg_store(out, o, rows, tok0, q0, n_q, r0, head0 + wg, num_heads, tq);
#endif
}

// The warp-specialised build keeps a ring of three K/V stages (WG_WS_SMEM_BYTES: Q, the
// stages, room to align them, their six barriers).
#define WG_WS_STAGES 3
#define WG_WS_SMEM_BYTES (WG_Q_BYTES + WG_WS_STAGES * WG_STAGE_BYTES + 1024 + 64)
// A TMA tensor map (the driver's CUtensorMap, cuTensorMapEncodeTiled) of the paged cache: a
// 5-D tensor (head dim, slot, kv * KV heads + KV head, layer, block) of bf16, boxes of 64 head
// dims (one 128-byte swizzled atom row) by min(block size, 128) slots.
struct __align__(64) TmaMap {
    unsigned long long opaque[16];
};
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// A work item of the warp-specialised builds: its sequence's queries q0.. (n_q of them from
// token tok0, the first at position first_pos), the keys it needs (ctx, in tiles of WG_KEYS:
// `tiles` of them for this block), its first query's position, the sequence's block table, and
// KV head kh with its query heads from head0. The default build takes 64 queries of the block's
// two query heads head0, head0 + 1; the packed builds (batch-invariant) 128 / group tokens of
// every query head of the KV head, row R the token q0 + R / group and head head0 + R % group
// (rows from `rows` on hold none). The split build takes key ranges z, z + gridDim.z, ... of
// WG_RANGE keys: `tiles` counts those of its ranges' tiles that reach into the context.
struct WgItem {
    int q0, n_q, tok0, ctx, tiles, min_pos, head0, kh, first_pos, group, rows;
    const int* table;
};
template <bool PACKED, bool SPLIT>
__device__ __forceinline__ WgItem wg_item(const int* work, int item, const int* seq_tok, const int* seq_len,
                                          const int* seq_pos, const int* block_tables, const int* meta_stride,
                                          int num_heads, int num_kv_heads) {
    WgItem it;
    int seq = work[2 * item];
    it.q0 = work[2 * item + 1];
    it.n_q = seq_len[seq];
    it.tok0 = seq_tok[seq];
    it.first_pos = seq_pos[seq];
    it.min_pos = it.first_pos + it.q0;
    it.group = num_heads / num_kv_heads;
    if constexpr (PACKED) {
        int tokens = max(128 / it.group, 1);
        it.rows = min(tokens * it.group, 128);
        it.kh = blockIdx.x;
        it.head0 = it.kh * it.group;
        it.ctx = it.first_pos + min(it.q0 + tokens, it.n_q);
    } else {
        it.rows = 128;
        it.head0 = 2 * blockIdx.x;
        it.kh = it.head0 / it.group;
        it.ctx = it.first_pos + min(it.q0 + 64, it.n_q);
    }
    it.tiles = (it.ctx + WG_KEYS - 1) / WG_KEYS;
    if constexpr (SPLIT) {
        int ranges = (it.ctx + WG_RANGE - 1) / WG_RANGE, z = blockIdx.z;
        if (z >= ranges) {
            it.tiles = 0;
        } else {
            // Whole ranges, then the last of this block's: the context's last (partial) range,
            // or a whole one.
            int mine = (ranges - 1 - z) / gridDim.z + 1, last = z + (mine - 1) * gridDim.z;
            it.tiles = WG_RANGE_TILES * (mine - 1) +
                       min(WG_RANGE_TILES, (it.ctx - last * WG_RANGE + WG_KEYS - 1) / WG_KEYS);
        }
    }
    it.table = block_tables + (u64)seq * meta_stride[0];
    return it;
}
// The first key of this block's tile kt: tiles from key 0, or (SPLIT) the tiles of each of its
// ranges in turn.
template <bool SPLIT>
__device__ __forceinline__ int wg_tile_key(int kt) {
    if constexpr (SPLIT)
        return (blockIdx.z + (kt / WG_RANGE_TILES) * gridDim.z) * WG_RANGE + (kt % WG_RANGE_TILES) * WG_KEYS;
    return kt * WG_KEYS;
}
// Row R (0-127) of the block's item: its token in the sequence and its query head; whether it
// holds a query.
template <bool PACKED>
__device__ __forceinline__ bool wg_row(const WgItem& it, int R, int& tok, int& head) {
    if constexpr (PACKED) {
        tok = it.q0 + R / it.group;
        head = it.head0 + R % it.group;
        return R < it.rows && tok < it.n_q;
    }
    tok = it.q0 + (R & 63);
    head = it.head0 + (R >> 6);
    return tok < it.n_q;
}
// The ring's barriers: a stage's full barrier counts one cp.async arrival per producer thread,
// its empty barrier one arrival per consumer warp.
template <int STAGES>
__device__ __forceinline__ void wg_ring_init(u32 full_bar, u32 empty_bar, int producers) {
    if (threadIdx.x == 0) {
        for (int st = 0; st < STAGES; ++st) {
            mbar_init(full_bar + 8 * st, producers);
            mbar_init(empty_bar + 8 * st, 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
}
// Registers a transfer of `bytes` more on the barrier (its phase completes once they landed).
__device__ __forceinline__ void mbar_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// One box of the cache's tensor map at coordinates (dim, slot, kv * KV heads + KV head, layer,
// block) to shared address dst by the TMA unit, its bytes counted on bar.
__device__ __forceinline__ void tma_load_kv(u32 dst, const TmaMap* map, int dim, int slot, int plane, int layer,
                                            int block, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
        "%5, %6}], [%7];\n" ::"r"(dst),
        "l"(map), "r"(dim), "r"(slot), "r"(plane), "r"(layer), "r"(block), "r"(bar)
        : "memory");
}
// The producers (P threads, p = 0..P-1): Q, then every K/V tile into the ring, each stage once
// its previous tile was released. Thread p copies 16-byte chunk p % 16 (head dims 8 (p % 16) ...)
// of rows p / 16, p / 16 + P / 16, ...: a warp's copy is two whole 256-byte rows. Keys map to
// blocks by shifts where the block size is a power of two (every default; a division costs
// some twenty instructions a row, which kept the consumers waiting).
// With TMA (a power-of-two block size of at least 8, the map of `map`), a tile whose keys are
// all in the context is instead 4 boxes a block (K and V, two atoms each), lane j of the first
// warp issuing block j's; the tile that reaches past the context stays with the copies, which
// fill keys past it with zeros (the boxes would bring the block's stale slots, and a NaN there
// times P's 0 is NaN).
template <int P, bool TMA, bool PACKED, bool SPLIT, int STAGES>
__device__ __forceinline__ void wg_produce(int p, const WgItem& it, const bf16* q, const bf16* cache, u32 q_smem,
                                           u32 stages, u32 full_bar, u32 empty_bar, int num_heads, int num_kv_heads,
                                           int layer, int num_layers, int block_size, const TmaMap* map) {
    constexpr int HD = 128, STEP = P / 16, ROWS = WG_KEYS / STEP;
    int chunk = p & 15, atom = chunk >> 3, c = chunk & 7, row0 = p >> 4;
    for (int row = row0; row < 128; row += STEP) {
        int tok, head;
        bool valid;
        if constexpr (PACKED) {
            valid = wg_row<true>(it, row, tok, head);
        } else {
            int w = row >> 6, r = row & 63;
            valid = it.q0 + r < it.n_q;
            tok = it.q0 + r;
            head = it.head0 + w;
        }
        const bf16* src = valid ? q + ((u64)(it.tok0 + tok) * num_heads + head) * HD + chunk * 8 : q;
        wg_copy_chunk(q_smem + atom * WG_ATOM_BYTES, row, c, src, valid ? 16 : 0);
    }
    // A key's K at block_stride * block + slot * HD + first, its V v_past_k further.
    const u64 block_stride = kv_offset(1, 0, 0, 0, 0, num_layers, num_kv_heads, block_size, HD);
    const u64 first = kv_offset(0, 0, layer, 0, it.kh, num_layers, num_kv_heads, block_size, HD) + chunk * 8;
    const u64 v_past_k = (u64)num_kv_heads * block_size * HD;
    const bool pow2 = (block_size & (block_size - 1)) == 0;
    const int shift = __ffs(block_size) - 1;
    // TMA: keys a box (and lane) takes, and boxes a tile.
    const int box_rows = min(block_size, WG_KEYS), boxes = WG_KEYS / box_rows;
    for (int kt = 0; kt < it.tiles; ++kt) {
        int st = kt % STAGES, k0 = wg_tile_key<SPLIT>(kt);
        bool bulk = TMA && k0 + WG_KEYS <= it.ctx;
        // This thread's rows' blocks first, unconditionally (keys clamped to the context) so
        // that the loads go out together, while the stage may still be read: loads under
        // branches would be waited for one by one.
        int blk[ROWS];
        if (bulk) {
            blk[0] = p < boxes ? it.table[(k0 + p * box_rows) >> shift] : 0;
        } else {
#pragma unroll
            for (int j = 0; j < ROWS; ++j) {
                int key = min(k0 + row0 + STEP * j, it.ctx - 1);
                blk[j] = it.table[pow2 ? key >> shift : key / block_size];
            }
        }
        // The stage's previous tile (kt - STAGES) was released by every consumer warp.
        if (kt >= STAGES) mbar_wait(empty_bar + 8 * st, (kt / STAGES - 1) & 1);
        u32 stage = stages + st * WG_STAGE_BYTES;
        if (bulk) {
            if (p < 32) {
                if (p == 0) mbar_expect_tx(full_bar + 8 * st, WG_STAGE_BYTES);
                __syncwarp();
                if (p < boxes) {
                    int slot = (k0 + p * box_rows) & (block_size - 1);
                    u32 dst = stage + p * box_rows * 128;
#pragma unroll
                    for (int kv = 0; kv < 2; ++kv)
#pragma unroll
                        for (int a = 0; a < 2; ++a)
                            tma_load_kv(dst + (2 * kv + a) * WG_ATOM_BYTES, map, 64 * a, slot, kv * num_kv_heads + it.kh,
                                        layer, blk[0], full_bar + 8 * st);
                }
            }
        } else {
            u32 k_atom = stage + atom * WG_ATOM_BYTES, v_atom = k_atom + 2 * WG_ATOM_BYTES;
#pragma unroll
            for (int j = 0; j < ROWS; ++j) {
                int key = k0 + row0 + STEP * j;
                bool valid = key < it.ctx;
                int slot = pow2 ? key & (block_size - 1) : key % block_size;
                const bf16* ksrc = cache + (valid ? block_stride * blk[j] + (u64)slot * HD + first : 0);
                wg_copy_chunk(k_atom, row0 + STEP * j, c, ksrc, valid ? 16 : 0);
                wg_copy_chunk(v_atom, row0 + STEP * j, c, ksrc + (valid ? v_past_k : 0), valid ? 16 : 0);
            }
        }
        // Every producer thread arrives, once its copies (Q's too, the first time) landed; a
        // TMA tile's phase also waits for the boxes' bytes.
        mbar_arrive_copies(full_bar + 8 * st);
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
}
#endif

// The warp-specialised build as FlashAttention-3 lays it out: a producer warpgroup (its
// registers handed to the consumers: setmaxnreg) and two consumer warpgroups whose turn at the
// tensor cores issues both products of a step, S = Q K^T of tile kt and O += P V of tile kt - 1,
// so the other warpgroup's softmax runs under them; within a warpgroup the softmax of tile kt
// runs while its P V of tile kt - 1 is still in the tensor cores (O is rescaled once that is
// done). A stage is released after its P V. The work items run longest first (the grid's last
// row first), so that the shortest ones fill the tail. Grid: as above. Block: 384 (consumers
// 0-255, producers 256-383). Dynamic shared memory: WG_WS_SMEM_BYTES.
//
// KIND 1 and 2 are the packed builds of batch-invariant serving (see WgItem; grid (KV heads,
// work items[, blocks a split item])): the packed mma.sync build's scheme on these tensor
// cores. The softmax goes by ranges of WG_RANGE keys, each started afresh (O, max and sum) and
// folded in key order with range_fold's arithmetic: KIND 1 into a running sum that, the
// registers being full, is kept in shared memory (WG_ACC_BYTES, in place of a third stage);
// KIND 2 (split) leaves each range's state in `part` for flash_range_combine, which folds them
// the same way. A row's result then depends only on its query, position and keys,
// so a token gives the same bits in a prefill chunk, as a decode token, split or not.
// KIND 3 is KIND 1 with the running sum in global memory (`part`: WG_FOLD_SLOTS slots of
// WG_ACC_BYTES, the block's the one of the SM it runs on: one such block fits an SM), so that
// three stages fit as in the default build; the fold's reads and writes go to L2 once in eight
// tiles. The same arithmetic, the same bits.
#define WG_FOLD_SLOTS 256
#define WG_INV_STAGES 2
#define WG_ACC_BYTES (2 * 128 * 64 * 4)
#define WG_INV_SMEM_BYTES (WG_Q_BYTES + WG_INV_STAGES * WG_STAGE_BYTES + WG_ACC_BYTES + 1024 + 64)
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
template <bool TMA, int KIND>
__device__ __forceinline__ void wg_pp(const bf16* q, const bf16* cache, bf16* out, const int* work, const int* seq_tok,
                                      const int* seq_len, const int* seq_pos, const int* block_tables,
                                      const int* meta_stride, int num_heads, int num_kv_heads, int layer,
                                      int num_layers, int block_size, float scale_log2, float* part, int max_ranges,
                                      const TmaMap* map) {
    constexpr bool PACKED = KIND != 0, SPLIT = KIND == 2, RANGED = KIND == 1 || KIND == 3;
    constexpr bool SHARED_ACC = KIND == 1;
    constexpr int STAGES = SHARED_ACC ? WG_INV_STAGES : WG_WS_STAGES;
    PDL_ENTER();
    extern __shared__ __align__(16) unsigned char wg_smem[];
    u32 base = ((u32)__cvta_generic_to_shared(wg_smem) + 1023u) & ~1023u;
    u32 q_smem = base, stages = base + WG_Q_BYTES;
    u32 acc_smem = stages + STAGES * WG_STAGE_BYTES;
    u32 full_bar = acc_smem + (SHARED_ACC ? WG_ACC_BYTES : 0), empty_bar = full_bar + 8 * STAGES;
    WgItem it = wg_item<PACKED, SPLIT>(work, gridDim.y - 1 - blockIdx.y, seq_tok, seq_len, seq_pos, block_tables,
                                       meta_stride, num_heads, num_kv_heads);
    // A split block whose ranges all lie past the context: nothing to do (the whole block).
    if (SPLIT && it.tiles == 0) return;
    wg_ring_init<STAGES>(full_bar, empty_bar, 128);

    // 384 threads start with 168 registers each; the producers keep 56, the consumers take 224.
    if (threadIdx.x >= 256) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n" ::: "memory");
        wg_produce<128, TMA, PACKED, SPLIT, STAGES>(threadIdx.x - 256, it, q, cache, q_smem, stages, full_bar,
                                                    empty_bar, num_heads, num_kv_heads, layer, num_layers,
                                                    block_size, map);
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n" ::: "memory");

    int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, tq = lane & 3;
    int r0 = warp * 16 + (lane >> 2);
    // This thread's two rows (the accumulators' rows r0 and r0 + 8 of its warpgroup's 64).
    int tok0 = 0, head0 = 0, tok1 = 0, head1 = 0;
    bool valid0 = false, valid1 = false;
    if constexpr (PACKED) {
        valid0 = wg_row<true>(it, 64 * wg + r0, tok0, head0);
        valid1 = wg_row<true>(it, 64 * wg + r0 + 8, tok1, head1);
    }
    WgRows rows{PACKED ? it.first_pos + tok0 : it.min_pos + r0, PACKED ? it.first_pos + tok1 : it.min_pos + r0 + 8,
                NEG_INF, NEG_INF, 0.0f, 0.0f};
    float s[64], o[64], alpha0, alpha1;
    u32 p[8][4];
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.0f;
    // RANGED: the folded ranges: per row the max and sum, and O's entries 4j..4j + 3 at acc[128 j]
    // (this thread's own 16-byte column of its warpgroup's 64 x 128 floats: no bank conflicts,
    // no barrier).
    float M0 = NEG_INF, M1 = NEG_INF, L0 = 0.0f, L1 = 0.0f;
    float4* acc = reinterpret_cast<float4*>(wg_smem + (acc_smem - (u32)__cvta_generic_to_shared(wg_smem)));
    if constexpr (RANGED && !SHARED_ACC) {
        u32 smid;
        asm("mov.u32 %0, %%smid;" : "=r"(smid));
        acc = reinterpret_cast<float4*>(part) + (u64)(smid % WG_FOLD_SLOTS) * (WG_ACC_BYTES / 16);
    }
    acc += wg * 128 * 16 + (threadIdx.x & 127);
    if constexpr (RANGED) {
#pragma unroll
        for (int j = 0; j < 16; ++j) acc[128 * j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    // The range that ended with tile kt (its state m, l, O in o): its sums whole over the quad,
    // then folded (RANGED) or stored (SPLIT).
    auto end_range = [&](float m0, float l0, float m1, float l1, int kt) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
        l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
        l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
        l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
        if constexpr (SPLIT) {
            int rg = wg_tile_key<true>(kt) / WG_RANGE;
            float* p0 = part + (((u64)(it.tok0 + tok0) * num_heads + head0) * max_ranges + rg) * (128 + 2);
            float* p1 = part + (((u64)(it.tok0 + tok1) * num_heads + head1) * max_ranges + rg) * (128 + 2);
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                int c = i * 8 + tq * 2;
                if (valid0) *reinterpret_cast<float2*>(p0 + 2 + c) = make_float2(o[4 * i], o[4 * i + 1]);
                if (valid1) *reinterpret_cast<float2*>(p1 + 2 + c) = make_float2(o[4 * i + 2], o[4 * i + 3]);
            }
            if (tq == 0) {
                if (valid0) *reinterpret_cast<float2*>(p0) = make_float2(m0, l0);
                if (valid1) *reinterpret_cast<float2*>(p1) = make_float2(m1, l1);
            }
        } else if constexpr (RANGED) {
            // A range without a visible key for a row leaves the row as it was.
            float a0 = 1.0f, b0 = 0.0f, a1 = 1.0f, b1 = 0.0f;
            bool fold0 = m0 != NEG_INF, fold1 = m1 != NEG_INF;
            if (fold0) range_fold(M0, L0, m0, l0, a0, b0);
            if (fold1) range_fold(M1, L1, m1, l1, a1, b1);
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                float4 v = acc[128 * j];
                if (fold0) {
                    v.x = range_scale(v.x, a0, o[4 * j], b0);
                    v.y = range_scale(v.y, a0, o[4 * j + 1], b0);
                }
                if (fold1) {
                    v.z = range_scale(v.z, a1, o[4 * j + 2], b1);
                    v.w = range_scale(v.w, a1, o[4 * j + 3], b1);
                }
                acc[128 * j] = v;
            }
        }
    };
    u32 q_rows = q_smem + wg * 64 * 128;
    auto k_tile = [&](int kt) { return stages + (kt % STAGES) * WG_STAGE_BYTES; };
    auto v_tile = [&](int kt) { return k_tile(kt) + 2 * WG_ATOM_BYTES; };
    auto landed = [&](int kt) {
        mbar_wait(full_bar + 8 * (kt % STAGES), (kt / STAGES) & 1);
        // The copies landed (generic proxy); wgmma reads through the async proxy.
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    };
    // Turns: warpgroup w waits on barrier 1 + w, issues, then lets the other go. Each takes
    // tiles + 1 turns (S of tile 0; S of kt with P V of kt - 1; the last P V); warpgroup 0 goes
    // first, and warpgroup 1 skips its last arrival, which nobody would wait for.
    if (wg == 1) named_arrive(1);
    landed(0);
    named_sync(1 + wg);
    wg_scores_issue(s, q_rows, k_tile(0));
    named_arrive(2 - wg);
    wg_scores_wait(s);
    wg_softmax(s, rows, wg_tile_key<SPLIT>(0), it.min_pos, scale_log2, tq, alpha0, alpha1);
    wg_rescale_pack(s, o, p, alpha0, alpha1);
    for (int kt = 1; kt < it.tiles; ++kt) {
        landed(kt);
        named_sync(1 + wg);
        wg_scores_issue(s, q_rows, k_tile(kt));
        wg_pv_issue(o, p, v_tile(kt - 1));
        named_arrive(2 - wg);
        // S of tile kt is the older of the two groups in flight.
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
        wg_pin(s);
        // Packed: every WG_RANGE_TILES-th tile starts a range, its softmax afresh (alpha is then 0).
        bool fresh = PACKED && kt % WG_RANGE_TILES == 0;
        float m0 = rows.m0, l0 = rows.l0, m1 = rows.m1, l1 = rows.l1;
        if (fresh) {
            rows.m0 = rows.m1 = NEG_INF;
            rows.l0 = rows.l1 = 0.0f;
        }
        wg_softmax(s, rows, wg_tile_key<SPLIT>(kt), it.min_pos, scale_log2, tq, alpha0, alpha1);
        wg_wait_all();
        wg_pin(o);
        wg_pin_p(p);
        if (lane == 0) mbar_arrive(empty_bar + 8 * ((kt - 1) % STAGES));
        if (fresh) {
            // O holds the ended range whole (its last P V was just waited for).
            end_range(m0, l0, m1, l1, kt - 1);
#pragma unroll
            for (int i = 0; i < 64; ++i) o[i] = 0.0f;
        }
        wg_rescale_pack(s, o, p, alpha0, alpha1);
    }
    named_sync(1 + wg);
    wg_pv_issue(o, p, v_tile(it.tiles - 1));
    if (wg == 0) named_arrive(2);
    wg_wait_all();
    wg_pin(o);
    wg_pin_p(p);
    if constexpr (!PACKED) {
        wg_store(out, o, rows, it.tok0, it.q0, it.n_q, r0, it.head0 + wg, num_heads, tq);
    } else {
        end_range(rows.m0, rows.l0, rows.m1, rows.l1, it.tiles - 1);
        if constexpr (RANGED) {
            // The normalised rows, as flash_range_combine writes them.
            float inv0 = L0 > 0.0f ? 1.0f / L0 : 0.0f, inv1 = L1 > 0.0f ? 1.0f / L1 : 0.0f;
            bf16* out0 = out + ((u64)(it.tok0 + tok0) * num_heads + head0) * 128;
            bf16* out1 = out + ((u64)(it.tok0 + tok1) * num_heads + head1) * 128;
#pragma unroll
            for (int j = 0; j < 16; ++j) {
                int c = j * 8 + tq * 2;
                float4 v = acc[128 * j];
                if (valid0) *reinterpret_cast<u32*>(out0 + c) = pack_bf16x2(v.x * inv0, v.y * inv0);
                if (valid1) *reinterpret_cast<u32*>(out1 + c) = pack_bf16x2(v.z * inv1, v.w * inv1);
            }
        }
    }
}
#endif
#define WG_PP_ARGS                                                                                              \
    const bf16 *q, const bf16 *cache, bf16 *out, const int *work, const int *seq_tok, const int *seq_len,      \
        const int *seq_pos, const int *block_tables, const int *meta_stride, int num_heads, int num_kv_heads,  \
        int layer, int num_layers, int block_size, float scale_log2, float *part, int max_ranges
#define WG_PP_CALL(TMA, KIND, MAP)                                                                              \
    wg_pp<TMA, KIND>(q, cache, out, work, seq_tok, seq_len, seq_pos, block_tables, meta_stride, num_heads,      \
                     num_kv_heads, layer, num_layers, block_size, scale_log2, part, max_ranges, MAP)
// Each build twice: NAME with the producers' copies, TMA_NAME with the K/V tiles brought by the
// TMA unit (see wg_produce; kv_map describes the cache, a kernel parameter so that the TMA unit
// reads it from the parameter space).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WG_PP_BODY(TMA, KIND, MAP) WG_PP_CALL(TMA, KIND, MAP)
#else
#define WG_PP_BODY(TMA, KIND, MAP)
#endif
#define WG_PP_KERNELS(NAME, TMA_NAME, KIND)                                                                    \
    extern "C" __global__ void __launch_bounds__(384, 1) NAME(WG_PP_ARGS) { WG_PP_BODY(false, KIND, nullptr); } \
    extern "C" __global__ void __launch_bounds__(384, 1)                                                       \
        TMA_NAME(WG_PP_ARGS, const __grid_constant__ TmaMap kv_map) {                                          \
        WG_PP_BODY(true, KIND, &kv_map);                                                                       \
    }
// KIND 0: the default build. The packed builds (batch-invariant serving): 1, ranges folded in
// the block; 3, folded with their sums in L2; 2 (split), stored for flash_range_combine.
WG_PP_KERNELS(flash_prefill_wgmma_pp_hd128, flash_prefill_wgmma_tma_hd128, 0)
WG_PP_KERNELS(flash_prefill_wgmma_packed_hd128, flash_prefill_wgmma_packed_tma_hd128, 1)
WG_PP_KERNELS(flash_prefill_wgmma_packed3_hd128, flash_prefill_wgmma_packed3_tma_hd128, 3)
WG_PP_KERNELS(flash_prefill_wgmma_split_hd128, flash_prefill_wgmma_split_tma_hd128, 2)

// ---------------------------------------------------------------------------------------------
// Narrow work items of the packed Hopper build (batch-invariant decode): the bits of
// flash_prefill_wgmma_packed_* (and _split_*) for items of at most 16 rows (16 / group tokens of
// every query head of a KV head: a decode token's), on mma.sync, where the Hopper kernel's 128-row
// items would leave most of its rows empty. Its arithmetic is the Hopper build's step by step:
// 128-key tiles, S's k16 chains over the head dims in ascending order, the tile's max of the raw
// scores, each exponent one FFMA, every lane's sum over the keys the accumulator layout gives it
// (keys 8i + 2tq + e of the tile, added pair by pair in ascending i) kept per lane until a range
// ends, P as bf16 and O's k16 chains over the keys in ascending order, ranges of WG_RANGE keys
// folded with range_fold (or left in `part`, SPLIT, for flash_range_combine). mma.sync's k16
// products give wgmma's bits (the skinny products rest on the same), and k16 chunks whose keys
// are all masked add exact zeros, so they are skipped.
//
// A block of WN_WARPS warps takes one item and KV head: warp w computes S for keys 16w..16w + 15
// of the tile and O for head dims 16w..16w + 15; the tile's row maxima, P and the pairs' sums go
// through shared memory, and every warp runs each row's sum chain itself (the same bits in all).
// K and V of a tile land in one stage (K first: S starts while V is still coming). Launched with
// shared memory for two stages (a grid of few blocks: a decode step of few tokens), the block
// copies the next tile while it works on this one; with one, two blocks fit an SM and take
// turns. With `rope.qkv` set (a step whose every item is narrow), the block first does
// qkv_rope_cache's work for its item's tokens, its query heads and its KV head (rope_head, the
// same arithmetic): the queries to `q`, the keys and values to the cache (every split block writes
// the same bytes, each before it reads them). Grid: (KV heads, items, split blocks). Block: 256.
#define WN_WARPS 8
#define WN_STRIDE (128 + 8)
#define WN_TILE (WG_KEYS * WN_STRIDE)
// P (16 rows of the tile's keys), the warps' row maxima, the pairs' sums; then the stages' K and V.
#define WN_FIXED_BYTES (16 * WN_STRIDE * 2 + WN_WARPS * 16 * 4 + 16 * 4 * 16 * 4)
#define WN_STAGE_BYTES (2 * WN_TILE * 2)
template <bool SPLIT>
__device__ __forceinline__ void wn_decode(bf16* q, bf16* cache, bf16* out, const int* work, const int* seq_tok,
                                          const int* seq_len, const int* seq_pos, const int* block_tables,
                                          const int* meta_stride, int num_heads, int num_kv_heads, int layer,
                                          int num_layers, int block_size, float scale_log2, float* part,
                                          int max_ranges, RopeIn rope) {
    extern __shared__ __align__(16) unsigned char wn_smem[];
    bf16* p_tile = reinterpret_cast<bf16*>(wn_smem);
    float* row_max = reinterpret_cast<float*>(p_tile + 16 * WN_STRIDE);  // [warp][row]
    float* pair_sums = row_max + WN_WARPS * 16;                          // [row][tq][i]
    bf16* stages = reinterpret_cast<bf16*>(wn_smem + WN_FIXED_BYTES);    // [stage][K, V][key][dim]
    u32 dynamic_smem;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dynamic_smem));
    const bool two = dynamic_smem >= WN_FIXED_BYTES + 2 * WN_STAGE_BYTES;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    int mi = lane >> 3, lr = lane & 7;
    int seq = work[2 * blockIdx.y], q0 = work[2 * blockIdx.y + 1];
    int n_q = seq_len[seq], first_pos = seq_pos[seq], tok_base = seq_tok[seq];
    int group = num_heads / num_kv_heads, kh = blockIdx.x;
    int tokens = max(16 / group, 1);
    int rows = min(tokens * group, 16);
    int ctx = first_pos + min(q0 + tokens, n_q);
    const int* table = block_tables + (u64)seq * meta_stride[0];
    // This lane's rows g and g + 8 (as the Hopper build's row R: token q0 + R / group, head
    // kh * group + R % group).
    int tok_a = q0 + g / group, head_a = kh * group + g % group;
    int tok_b = q0 + (g + 8) / group, head_b = kh * group + (g + 8) % group;
    bool valid_a = g < rows && tok_a < n_q, valid_b = g + 8 < rows && tok_b < n_q;
    int pos_a = first_pos + tok_a, pos_b = first_pos + tok_b;
    int range = SPLIT ? blockIdx.z : 0;
    int k_first = range * WG_RANGE;
    if (k_first >= ctx) return;  // the whole block: no barrier is reached
    if (rope.qkv) {
        // Task i: token q0 + i / (group + 2) of the item, its query head, key head or value head.
        int n_tok = min(tokens, n_q - q0);
        for (int task = warp; task < n_tok * (group + 2); task += WN_WARPS) {
            int j = task / (group + 2), r = task % (group + 2), t = tok_base + q0 + j;
            int h = r < group ? kh * group + r : num_heads + (r - group) * num_kv_heads + kh;
            float v[8];
            rope_head(rope.qkv, rope.bias, rope.q_norm, rope.k_norm, rope.cos_t, rope.sin_t, t, h,
                      first_pos + q0 + j, num_heads, num_kv_heads, 128, rope.eps, v);
            int slot = rope.slots[t];
            if (r < group)
                store_e(q + ((u64)t * num_heads + h) * 128 + lane * 4, v, 4);
            else if (slot >= 0)
                store_e(cache + kv_offset(slot / block_size, slot % block_size, layer, r - group, kh, num_layers,
                                          num_kv_heads, block_size, 128) +
                            lane * 4,
                        v, 4);
        }
        // The block's own writes, seen by all its threads (the copies below read through L2).
        __threadfence_block();
        __syncthreads();
    }

    u32 qf[8][4];
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
        int c = kk * 16 + tq * 2;
        const bf16* qa = q + ((u64)(tok_base + tok_a) * num_heads + head_a) * 128;
        const bf16* qb = q + ((u64)(tok_base + tok_b) * num_heads + head_b) * 128;
        qf[kk][0] = valid_a ? *reinterpret_cast<const u32*>(qa + c) : 0u;
        qf[kk][1] = valid_b ? *reinterpret_cast<const u32*>(qb + c) : 0u;
        qf[kk][2] = valid_a ? *reinterpret_cast<const u32*>(qa + c + 8) : 0u;
        qf[kk][3] = valid_b ? *reinterpret_cast<const u32*>(qb + c + 8) : 0u;
    }
    // This warp's O (head dims 16 warp + 8j + 2tq + e: o[j][e] row a, o[j][2 + e] row b) and the
    // range's softmax state; acc, M, L: the folded ranges.
    float o[2][4], acc[2][4];
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[j][e] = acc[j][e] = 0.0f;
    float m_a = NEG_INF, m_b = NEG_INF, l_a = 0.0f, l_b = 0.0f;
    float M_a = NEG_INF, M_b = NEG_INF, L_a = 0.0f, L_b = 0.0f;

    // K, then V, of the tile at k0 into `stage` (keys up to the context rounded up to 16, those
    // past it zero): two commit groups.
    auto load_tile = [&](int stage, int k0) {
        int n = min(WG_KEYS, (ctx - k0 + 15) & ~15);
#pragma unroll
        for (int kv = 0; kv < 2; ++kv) {
            bf16* dst = stages + (2 * stage + kv) * WN_TILE;
            for (int c = threadIdx.x; c < n * 16; c += blockDim.x) {
                int r = c >> 4, chunk = (c & 15) * 8, key = k0 + r;
                const bf16* src = cache;
                int bytes = 0;
                if (key < ctx) {
                    int blk = table[key / block_size], slot = key % block_size;
                    src = cache + kv_offset(blk, slot, layer, kv, kh, num_layers, num_kv_heads, block_size, 128) + chunk;
                    bytes = 16;
                }
                u32 d = (u32)__cvta_generic_to_shared(&dst[r * WN_STRIDE + chunk]);
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(bytes));
            }
            asm volatile("cp.async.commit_group;\n" ::);
        }
    };
    // The range that just ended (its m, l per lane, O in o): sums whole over the quad, then
    // folded (or, SPLIT, stored as range rg), and the state reset.
    auto end_range = [&](int rg) {
        float la = l_a, lb = l_b;
        la += __shfl_xor_sync(0xffffffffu, la, 1);
        la += __shfl_xor_sync(0xffffffffu, la, 2);
        lb += __shfl_xor_sync(0xffffffffu, lb, 1);
        lb += __shfl_xor_sync(0xffffffffu, lb, 2);
        if constexpr (SPLIT) {
            float* pa = part + (((u64)(tok_base + tok_a) * num_heads + head_a) * max_ranges + rg) * (128 + 2);
            float* pb = part + (((u64)(tok_base + tok_b) * num_heads + head_b) * max_ranges + rg) * (128 + 2);
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                int c = warp * 16 + j * 8 + tq * 2;
                if (valid_a) *reinterpret_cast<float2*>(pa + 2 + c) = make_float2(o[j][0], o[j][1]);
                if (valid_b) *reinterpret_cast<float2*>(pb + 2 + c) = make_float2(o[j][2], o[j][3]);
            }
            if (warp == 0 && tq == 0) {
                if (valid_a) *reinterpret_cast<float2*>(pa) = make_float2(m_a, la);
                if (valid_b) *reinterpret_cast<float2*>(pb) = make_float2(m_b, lb);
            }
        } else {
            float aa = 1.0f, ba = 0.0f, ab = 1.0f, bb = 0.0f;
            bool fold_a = m_a != NEG_INF, fold_b = m_b != NEG_INF;
            if (fold_a) range_fold(M_a, L_a, m_a, la, aa, ba);
            if (fold_b) range_fold(M_b, L_b, m_b, lb, ab, bb);
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                if (fold_a) {
                    acc[j][0] = range_scale(acc[j][0], aa, o[j][0], ba);
                    acc[j][1] = range_scale(acc[j][1], aa, o[j][1], ba);
                }
                if (fold_b) {
                    acc[j][2] = range_scale(acc[j][2], ab, o[j][2], bb);
                    acc[j][3] = range_scale(acc[j][3], ab, o[j][3], bb);
                }
            }
        }
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[j][e] = 0.0f;
        m_a = m_b = NEG_INF;
        l_a = l_b = 0.0f;
    };

    // The tile after k0: the next of its range, else (SPLIT) the first of this block's next range.
    auto next_key = [&](int k0) {
        int k = k0 + WG_KEYS;
        if (SPLIT && k % WG_RANGE == 0) k += (gridDim.z - 1) * WG_RANGE;
        return k;
    };
    if (two) load_tile(0, k_first);
    for (int kt = 0, k0 = k_first; k0 < ctx; ++kt) {
        int next = next_key(k0), stage = two ? kt & 1 : 0;
        const bf16* ks = stages + 2 * stage * WN_TILE;
        const bf16* vs = ks + WN_TILE;
        // With two stages the next tile's copy goes out now (two more groups in flight).
        bool ahead = two && next < ctx;
        if (ahead) load_tile(stage ^ 1, next);
        if (!two) load_tile(0, k0);
        int keys = min(WG_KEYS, ctx - k0);
        // K landed (V may still be coming).
        if (ahead)
            asm volatile("cp.async.wait_group 3;\n" ::);
        else
            asm volatile("cp.async.wait_group 1;\n" ::);
        __syncthreads();
        // S for this warp's 16 keys (none past the context: all masked, not computed).
        float s[2][4];
#pragma unroll
        for (int j = 0; j < 2; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
        if (warp * 16 < keys) {
#pragma unroll
            for (int kk = 0; kk < 8; ++kk) {
                u32 b[4];
                ldmatrix_x4(b, &ks[(warp * 16 + (mi >> 1) * 8 + lr) * WN_STRIDE + kk * 16 + (mi & 1) * 8]);
                mma_bf16(s[0], qf[kk], b[0], b[1]);
                mma_bf16(s[1], qf[kk], b[2], b[3]);
            }
        }
        float mx_a = NEG_INF, mx_b = NEG_INF;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                int key = k0 + warp * 16 + j * 8 + tq * 2 + e;
                if (key > pos_a) s[j][e] = NEG_INF;
                if (key > pos_b) s[j][2 + e] = NEG_INF;
                mx_a = fmaxf(mx_a, s[j][e]);
                mx_b = fmaxf(mx_b, s[j][2 + e]);
            }
        }
        mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
        mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
        mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
        if (tq == 0) {
            row_max[warp * 16 + g] = mx_a;
            row_max[warp * 16 + g + 8] = mx_b;
        }
        __syncthreads();
        mx_a = row_max[g];
        mx_b = row_max[g + 8];
#pragma unroll
        for (int w = 1; w < WN_WARPS; ++w) {
            mx_a = fmaxf(mx_a, row_max[w * 16 + g]);
            mx_b = fmaxf(mx_b, row_max[w * 16 + g + 8]);
        }
        // wg_softmax's arithmetic.
        float mn_a = fmaxf(m_a, mx_a * scale_log2), mn_b = fmaxf(m_b, mx_b * scale_log2);
        float base_a = mn_a == NEG_INF ? 0.0f : mn_a, base_b = mn_b == NEG_INF ? 0.0f : mn_b;
        float alpha_a = exp2f(m_a - base_a), alpha_b = exp2f(m_b - base_b);
        m_a = mn_a;
        m_b = mn_b;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            float p0 = exp2f(fmaf(s[j][0], scale_log2, -base_a)), p1 = exp2f(fmaf(s[j][1], scale_log2, -base_a));
            float p2 = exp2f(fmaf(s[j][2], scale_log2, -base_b)), p3 = exp2f(fmaf(s[j][3], scale_log2, -base_b));
            int i = warp * 2 + j;  // the Hopper build's key chunk of 8
            pair_sums[(g * 4 + tq) * 16 + i] = __fadd_rn(p0, p1);
            pair_sums[((g + 8) * 4 + tq) * 16 + i] = __fadd_rn(p2, p3);
            int c = warp * 16 + j * 8 + tq * 2;
            *reinterpret_cast<u32*>(&p_tile[g * WN_STRIDE + c]) = pack_bf16x2(p0, p1);
            *reinterpret_cast<u32*>(&p_tile[(g + 8) * WN_STRIDE + c]) = pack_bf16x2(p2, p3);
        }
        if (ahead)
            asm volatile("cp.async.wait_group 2;\n" ::);
        else
            asm volatile("cp.async.wait_group 0;\n" ::);
        __syncthreads();
        // Every warp's copy of each row's sum chain, in the Hopper build's order.
        l_a = __fmul_rn(l_a, alpha_a);
        l_b = __fmul_rn(l_b, alpha_b);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            l_a = __fadd_rn(l_a, pair_sums[(g * 4 + tq) * 16 + i]);
            l_b = __fadd_rn(l_b, pair_sums[((g + 8) * 4 + tq) * 16 + i]);
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            o[j][0] *= alpha_a;
            o[j][1] *= alpha_a;
            o[j][2] *= alpha_b;
            o[j][3] *= alpha_b;
        }
        // O += P V over the tile's key chunks of 16 that hold a visible key, for this warp's dims.
        for (int kk = 0; kk < (keys + 15) / 16; ++kk) {
            u32 a[4], b[4];
            ldmatrix_x4(a, &p_tile[((mi & 1) * 8 + lr) * WN_STRIDE + kk * 16 + (mi >> 1) * 8]);
            ldmatrix_x4_trans(b, &vs[(kk * 16 + (mi & 1) * 8 + lr) * WN_STRIDE + (warp * 2 + (mi >> 1)) * 8]);
            mma_bf16(o[0], a, b[0], b[1]);
            mma_bf16(o[1], a, b[2], b[3]);
        }
        // A range ends here if another of this block's follows (the last ends after the loop).
        if ((k0 + WG_KEYS) % WG_RANGE == 0 && next < ctx) {
            end_range(range);
            range += SPLIT ? gridDim.z : 1;
        }
        k0 = next;
        // Every warp is done with the tile and P before the next overwrites them.
        __syncthreads();
    }
    end_range(range);
    if constexpr (!SPLIT) {
        float inv_a = L_a > 0.0f ? 1.0f / L_a : 0.0f, inv_b = L_b > 0.0f ? 1.0f / L_b : 0.0f;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            int c = warp * 16 + j * 8 + tq * 2;
            if (valid_a)
                *reinterpret_cast<u32*>(out + ((u64)(tok_base + tok_a) * num_heads + head_a) * 128 + c) =
                    pack_bf16x2(acc[j][0] * inv_a, acc[j][1] * inv_a);
            if (valid_b)
                *reinterpret_cast<u32*>(out + ((u64)(tok_base + tok_b) * num_heads + head_b) * 128 + c) =
                    pack_bf16x2(acc[j][2] * inv_b, acc[j][3] * inv_b);
        }
    }
}
// The prefill builds' arguments (q and cache writable: the fused RoPE writes them), then RopeIn's.
#define WN_ARGS                                                                                                  \
    bf16 *q, bf16 *cache, bf16 *out, const int *work, const int *seq_tok, const int *seq_len, const int *seq_pos, \
        const int *block_tables, const int *meta_stride, int num_heads, int num_kv_heads, int layer,             \
        int num_layers, int block_size, float scale_log2, float *part, int max_ranges, const bf16 *qkv,           \
        const bf16 *qkv_bias, const bf16 *q_norm, const bf16 *k_norm, const float *cos_t, const float *sin_t,    \
        const int *slots, float eps
#define WN_CALL(SPLIT)                                                                                          \
    PDL_ENTER();                                                                                                \
    RopeIn rope = {qkv, qkv_bias, q_norm, k_norm, cos_t, sin_t, slots, eps};                                    \
    wn_decode<SPLIT>(q, cache, out, work, seq_tok, seq_len, seq_pos, block_tables, meta_stride, num_heads,      \
                     num_kv_heads, layer, num_layers, block_size, scale_log2, part, max_ranges, rope)
extern "C" __global__ void __launch_bounds__(256) flash_decode_narrow_hd128(WN_ARGS) { WN_CALL(false); }
extern "C" __global__ void __launch_bounds__(256) flash_decode_narrow_split_hd128(WN_ARGS) { WN_CALL(true); }

// Folds the key ranges (of range_keys keys: FA_RANGE, or WG_RANGE for the Hopper build) a split
// build left in `part` for every listed token t (all of the step's: a split step is pure
// decode) and head, in range order, with range_fold's arithmetic, and writes the normalised
// output as the unsplit packed build would.
// Grid: (tokens, heads). Block: head_dim.
extern "C" __global__ void flash_range_combine(const float* part, bf16* out, const int* positions, int num_heads,
                                               int head_dim, int max_ranges, int range_keys) {
    PDL_ENTER();
    int t = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
    int ranges = (positions[t] + range_keys) / range_keys;
    const float* p = part + ((u64)t * num_heads + h) * max_ranges * (head_dim + 2);
    float M = NEG_INF, L = 0.0f, acc = 0.0f;
    for (int r = 0; r < ranges; ++r, p += head_dim + 2) {
        float m = p[0];
        if (m == NEG_INF) continue;
        float a, b;
        range_fold(M, L, m, p[1], a, b);
        acc = range_scale(acc, a, p[2 + d], b);
    }
    float inv = L > 0.0f ? 1.0f / L : 0.0f;
    out[((u64)t * num_heads + h) * head_dim + d] = f2bf(acc * inv);
}
#endif
