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
#define KERNEL_GROUPS 6
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

// 16 bytes from global memory to shared memory by cp.async (L2 only), landing when this
// thread's groups are waited for (cp.async.commit_group / wait_group).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    u32 d = (u32)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(gmem));
}

// Sum over the block; every thread gets the result. `scratch` holds 32 floats.
__device__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(t);
}

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

// Tensor-core primitives (decode projections and prefill attention): d += a * b on a
// m16n8k16 bf16 tile with f32 accumulators, and 8x8 tile loads from shared memory.
__device__ __forceinline__ void mma_bf16(float* d, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The same on f16 tiles.
__device__ __forceinline__ void mma_f16(float* d, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// lo in the low half, hi in the high half, each rounded to the nearest f16.
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ void ldmatrix_x4(u32* r, const bf16* p) {
    u32 addr = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// Warpgroup-MMA (wgmma, sm_90a) primitives: the Hopper prefill attention and the fused
// batch-invariant products (gemm_wg_norm).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// A shared-memory matrix descriptor with 128-byte swizzling: start address, leading and
// stride byte offsets (PTX ISA, "Matrix Descriptor Format"), each encoded as (x & 0x3FFFF) >> 4.
__device__ __forceinline__ u64 wg_desc(u32 addr, u32 leading, u32 stride) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)((leading & 0x3FFFF) >> 4) << 16) |
           ((u64)((stride & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
#endif
