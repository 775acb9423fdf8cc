// ---------------------------------------------------------------------------------------------
// Mixture of experts (Qwen3-MoE), as transformers computes it and in an order that does not
// depend on what else is in the step: route (softmax, top-k, renormalised), group the chosen
// (token, slot) entries by expert in entry order, each expert's products over its entries
// only (an expert no token chose reads none of its weights), then each token's outputs summed
// in ascending expert order. Work in progress: not yet used by the model nor run on a GPU.

#define MOE_MAX_EXPERTS 256

#if KERNEL_GROUP(4)
// logits [t, E] f32 -> ids [t, K], weights [t, K]: a warp a token (E <= 256, 8 a lane). The
// most probable first, the lower index among equals (the CPU engine's order).
extern "C" __global__ void moe_route(const float* logits, int* ids, float* weights, int t, int E, int K, int norm) {
    PDL_ENTER();
    int token = (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5), lane = threadIdx.x & 31;
    if (token >= t) return;
    const float* l = logits + (u64)token * E;
    float p[8], most = NEG_INF;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        int e = lane + 32 * i;
        p[i] = e < E ? l[e] : NEG_INF;
        most = fmaxf(most, p[i]);
    }
    most = warp_max(most);
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        p[i] = lane + 32 * i < E ? expf(p[i] - most) : 0.0f;
        sum += p[i];
    }
    sum = warp_sum(sum);
#pragma unroll
    for (int i = 0; i < 8; ++i) p[i] = lane + 32 * i < E ? p[i] / sum : -1.0f;
    float total = 0.0f, chosen_p = 0.0f;
    int chosen_e = 0;
    for (int j = 0; j < K; ++j) {
        // This lane's best, then the warp's: (probability, lower index).
        float v = -2.0f;
        int e = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < 8; ++i)
            if (p[i] > v) v = p[i], e = lane + 32 * i;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, v, off);
            int oe = __shfl_xor_sync(0xffffffffu, e, off);
            if (ov > v || (ov == v && oe < e)) v = ov, e = oe;
        }
        if (lane == e % 32) p[e / 32] = -1.0f;
        total += v;
        if (lane == j) chosen_p = v, chosen_e = e;
    }
    if (lane < K) {
        ids[(u64)token * K + lane] = chosen_e;
        weights[(u64)token * K + lane] = norm ? chosen_p / total : chosen_p;
    }
}

// ids [n] (n = t * K entries) -> offsets [E + 1], order [n] (entry indices by expert, each
// expert's in entry order), where [n] (each entry's place in order). One block of 256 threads:
// counts first, then expert e's cursor walks the entries chunk by chunk (no atomics decide an
// order, so the grouping is the same whatever the timing).
extern "C" __global__ void moe_group(const int* ids, int* offsets, int* order, int* where_at, int n, int E) {
    PDL_ENTER();
    __shared__ int cursor[MOE_MAX_EXPERTS];
    __shared__ int chunk[1024];
    int tid = threadIdx.x;
    if (tid < E) cursor[tid] = 0;
    __syncthreads();
    for (int i = tid; i < n; i += blockDim.x) {
        int e = ids[i];
        if ((unsigned)e < (unsigned)E) atomicAdd(&cursor[e], 1);
    }
    __syncthreads();
    if (tid == 0) {
        int s = 0;
        for (int e = 0; e < E; ++e) {
            int c = cursor[e];
            offsets[e] = cursor[e] = s;
            s += c;
        }
        offsets[E] = s;
    }
    __syncthreads();
    for (int c0 = 0; c0 < n; c0 += 1024) {
        int len = min(1024, n - c0);
        for (int i = tid; i < len; i += blockDim.x) chunk[i] = ids[c0 + i];
        __syncthreads();
        if (tid < E) {
            int at = cursor[tid];
            for (int i = 0; i < len; ++i)
                if (chunk[i] == tid) order[at] = c0 + i, where_at[c0 + i] = at, ++at;
            cursor[tid] = at;
        }
        __syncthreads();
    }
}

// Each expert's rows over its entries: y[p, r] = W[e][r, :] . x[row(p), :] for p in
// [offsets[e], offsets[e + 1]), where row(p) = order[p] / slots (the entry's token) when slots
// > 0, else p (inputs already in grouped order). W: [E][N][Kd] bf16, x bf16 with Kd columns,
// y [n, N] bf16 or f32. Grid (E, N / 8 rounded up); block 256: a warp a weight row, its lanes
// 8 columns at a time in a fixed order, then the warp's sum (one order whatever the batch).
// A block whose expert has no entries exits before reading a byte of its weights. Kd % 8 == 0.
extern "C" __global__ void moe_expert_rows(const bf16* W, const bf16* x, const int* offsets, const int* order,
                                           void* y, int N, int Kd, int slots, int f32_out) {
    PDL_ENTER();
    int e = blockIdx.x, lane = threadIdx.x & 31;
    int r = blockIdx.y * 8 + (threadIdx.x >> 5);
    int p0 = offsets[e], p1 = offsets[e + 1];
    if (p0 == p1 || r >= N) return;
    const bf16* w = W + ((u64)e * N + r) * Kd;
    for (int p = p0; p < p1; ++p) {
        int row = slots > 0 ? order[p] / slots : p;
        const bf16* xr = x + (u64)row * Kd;
        float acc = 0.0f;
        for (int k = lane * 8; k < Kd; k += 256) {
            uint4 wv = *reinterpret_cast<const uint4*>(w + k), xv = *reinterpret_cast<const uint4*>(xr + k);
            const u32 wa[4] = {wv.x, wv.y, wv.z, wv.w}, xa[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                acc = fmaf(bf2f((bf16)(wa[q] & 0xffffu)), bf2f((bf16)(xa[q] & 0xffffu)), acc);
                acc = fmaf(bf2f((bf16)(wa[q] >> 16)), bf2f((bf16)(xa[q] >> 16)), acc);
            }
        }
        acc = warp_sum(acc);
        if (lane == 0) {
            if (f32_out) reinterpret_cast<float*>(y)[(u64)p * N + r] = acc;
            else reinterpret_cast<bf16*>(y)[(u64)p * N + r] = f2bf(acc);
        }
    }
}

// out[t, :] (f32, h wide) = each token's K expert outputs (y [n, h] f32 in grouped order, entry
// i at where[i]) times their weights, summed into zeros in ascending expert order. Grid t;
// block 256.
extern "C" __global__ void moe_combine(const float* y, const int* where_at, const int* ids, const float* weights,
                                       float* out, int K, int h) {
    PDL_ENTER();
    __shared__ int place[16];
    __shared__ float weight[16];
    int token = blockIdx.x;
    if (threadIdx.x == 0) {
        // The token's entries by ascending expert (K <= 16: insertion sort).
        int e_of[16];
        for (int j = 0; j < K; ++j) {
            int i = token * K + j, e = ids[i], at = j;
            while (at > 0 && e_of[at - 1] > e) {
                e_of[at] = e_of[at - 1], place[at] = place[at - 1], weight[at] = weight[at - 1];
                --at;
            }
            e_of[at] = e, place[at] = where_at[i], weight[at] = weights[i];
        }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < h; c += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < K; ++j) acc += y[(u64)place[j] * h + c] * weight[j];
        out[(u64)token * h + c] = acc;
    }
}
#endif
