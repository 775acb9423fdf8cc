// Part of the kernel source (cuda::KERNEL_SOURCE, after common.cuh): sampling.

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
