//! Typed launches of the kernels in `kernels/` and the cuBLAS matrix product.
//!
//! Arguments are raw device addresses ([`super::DevBuf::ptr`]); 0 stands for "none" where a
//! kernel takes an optional input. Every function only queues work on the device's stream.
//!
//! # Safety
//!
//! The launch functions are `unsafe`: the kernels read and write through the addresses they
//! are given, and a launch cannot see the buffers behind them. The caller guarantees, for
//! every launch: each address is 0 where the function allows it, or else points into a live
//! allocation on `dev`'s context holding at least the elements the shape arguments imply
//! (stated per function, e.g. `x [t, k]`); every allocation stays alive until the stream has
//! run the launch (it is queued, not run, when the function returns); and nothing outside
//! `dev`'s stream reads or writes what the launch writes until then. The functions check the
//! shape arguments against the kernels' own limits.

use cudarc::cublas::sys as blas;
use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::{CudaDevice, CudaError};

fn cfg(grid: (u32, u32), block: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (grid.0.max(1), grid.1.max(1), 1), block_dim: (block, 1, 1), shared_mem_bytes: 0 }
}

fn grid_stride(dev: &CudaDevice, total: u64) -> LaunchConfig {
    let blocks = total.div_ceil(256).min(dev.sm_count() as u64 * 16).max(1) as u32;
    cfg((blocks, 1), 256)
}

macro_rules! launch {
    (@push $b:ident;) => {};
    (@push $b:ident; $x:expr $(, $rest:expr)*) => {
        // Each argument gets its own binding that lives until the launch below.
        let value = $x;
        $b.arg(&value);
        launch!(@push $b; $($rest),*);
    };
    ($dev:expr, $name:expr, $cfg:expr, $($arg:expr),+ $(,)?) => {
        launch!(@with false; $dev, $name, $cfg, $($arg),+)
    };
    // `pdl`: with programmatic dependent launch even when the device does not launch every
    // kernel so (the kernel must enter with PDL_ENTER before reading earlier kernels' data).
    (@with $pdl:expr; $dev:expr, $name:expr, $cfg:expr, $($arg:expr),+ $(,)?) => {{
        let f = $dev.kernels().get($name);
        if $pdl || $dev.programmatic_launch() {
            let args = [$(RawArg::raw($arg)),+];
            launch_programmatic($dev, f, $cfg, &args)
        } else {
            let mut b = $dev.stream().launch_builder(f);
            launch!(@push b; $($arg),+);
            // Safety: argument types and order match the kernel's signature in kernels/, and
            // every address points into a live allocation sized for the launch (callers'
            // contract, see the module docs of `cuda`).
            unsafe { b.launch($cfg) }.map(|_| ()).map_err(CudaError::from)
        }
    }};
}

/// A kernel argument as the bytes the driver copies (it reads as many as the parameter's size
/// from the start, so 4-byte values sit in the first four).
trait RawArg: Copy {
    fn raw(self) -> [u8; 8];
}
impl RawArg for u64 {
    fn raw(self) -> [u8; 8] {
        self.to_ne_bytes()
    }
}
impl RawArg for i32 {
    fn raw(self) -> [u8; 8] {
        let mut b = [0; 8];
        b[..4].copy_from_slice(&self.to_ne_bytes());
        b
    }
}
impl RawArg for f32 {
    fn raw(self) -> [u8; 8] {
        let mut b = [0; 8];
        b[..4].copy_from_slice(&self.to_ne_bytes());
        b
    }
}

/// Launches `f` with programmatic stream serialization allowed (see
/// [`CudaDevice::programmatic_launch`]).
fn launch_programmatic(
    dev: &CudaDevice,
    f: &cudarc::driver::CudaFunction,
    cfg: LaunchConfig,
    args: &[[u8; 8]],
) -> Result<(), CudaError> {
    let mut values = args.to_vec();
    let mut params: Vec<*mut std::ffi::c_void> = values.iter_mut().map(|v| v.as_mut_ptr().cast()).collect();
    // Safety: one pointer per kernel parameter, in the kernel's order (the launch! macro passes
    // the same arguments the safe path would), each to 8 live bytes whose first bytes are the
    // value.
    unsafe { launch_params(dev, f, cfg, &mut params, true) }
}

/// Launches `f` with `params` (one pointer per kernel parameter, to its bytes), with
/// programmatic stream serialization allowed where `programmatic`.
///
/// # Safety
/// `params` holds one pointer per parameter of `f`, in order, each to as many live bytes as the
/// parameter's size holding its value.
unsafe fn launch_params(
    dev: &CudaDevice,
    f: &cudarc::driver::CudaFunction,
    cfg: LaunchConfig,
    params: &mut [*mut std::ffi::c_void],
    programmatic: bool,
) -> Result<(), CudaError> {
    use cudarc::driver::sys;
    // Safety: all-zero bytes are a valid launch attribute (id 0 is CU_LAUNCH_ATTRIBUTE_IGNORE,
    // the value a plain C union of integers).
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: dev.stream().cu_stream(),
        attrs: &mut attr,
        numAttrs: programmatic as u32,
    };
    dev.stream().context().bind_to_thread()?;
    // Safety: `params` as the caller promises; `config` and `attr` outlive the call, which
    // copies them.
    unsafe { sys::cuLaunchKernelEx(&config, f.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()).result()? };
    Ok(())
}

/// Matrix product `y[t, n] = x[t, k] · w[n, k]ᵀ`, bf16 inputs, f32 accumulation, output bf16
/// (or f32 when `f32_out`).
///
/// # Safety
/// See the module docs; `x` holds `[t, k]` bf16, `w` `[n, k]` bf16, `y` `[t, n]` (bf16, or
/// f32 with `f32_out`).
#[allow(clippy::too_many_arguments)]
pub unsafe fn matmul_t(
    dev: &CudaDevice,
    x: u64,
    w: u64,
    y: u64,
    t: usize,
    n: usize,
    k: usize,
    f32_out: bool,
) -> Result<(), CudaError> {
    if t == 0 {
        return Ok(());
    }
    let (alpha, beta) = (1.0f32, 0.0f32);
    let out_type = if f32_out { blas::cudaDataType::CUDA_R_32F } else { blas::cudaDataType::CUDA_R_16BF };
    // Column-major view: y^T (n x t) = w (as k x n, transposed) times x^T (k x t).
    // Safety: the addresses are live device allocations of the stated shapes (caller), alpha
    // and beta are host scalars that outlive the call.
    unsafe {
        cudarc::cublas::result::gemm_ex(
            *dev.blas().handle(),
            blas::cublasOperation_t::CUBLAS_OP_T,
            blas::cublasOperation_t::CUBLAS_OP_N,
            n as i32,
            t as i32,
            k as i32,
            (&alpha as *const f32).cast(),
            w as *const _,
            blas::cudaDataType::CUDA_R_16BF,
            k as i32,
            x as *const _,
            blas::cudaDataType::CUDA_R_16BF,
            k as i32,
            (&beta as *const f32).cast(),
            y as *mut _,
            out_type,
            n as i32,
            blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )?;
    }
    Ok(())
}

mod invariant;
pub use invariant::{invariant_slices, matmul_t_invariant, matmul_t_invariant_sliced, MAX_INVARIANT_SLICES};

mod prefill;
pub use prefill::{
    flash_packed_tokens, flash_prefill, flash_prefill_narrow_rope, flash_prefill_wgmma, flash_prefill_wgmma_packed,
    flash_range_keys, flash_smem_bytes, flash_split_floats, flash_supported, narrow_smem_bytes, narrow_tokens,
    wgmma_packed_takes, wgmma_prefill_takes, FlashSplit, PrefillSeqs, FLASH_RANGE_KEYS, FLASH_ROWS, NARROW_ROWS,
    WGMMA_FOLD_SCRATCH_FLOATS, WGMMA_PACKED_PREFILL_SMEM_BYTES, WGMMA_PREFILL_SMEM_BYTES, WGMMA_RANGE_KEYS,
    WGMMA_WS_PREFILL_SMEM_BYTES,
};
mod fp8;
pub use fp8::{
    add_rms_norm_fp8_rows, dequantize_fp8, fp8_block_gemm_takes, fp8_gemv_takes, fp8_skinny_slices, fp8_skinny_takes,
    matmul_t_fp8, matmul_t_fp8_rounded, matmul_t_fp8_skinny, quantize_fp8, quantize_fp8_rows, silu_mul_fp8_rows,
    Fp8Matrix, Fp8Scratch, FP8_BLOCK, FP8_GEMV_MAX_TOKENS, FP8_SKINNY_MAX_SLICES, FP8_SKINNY_MAX_TOKENS,
    FP8_WG_SMEM_BYTES,
};
mod skinny;
pub use skinny::{
    matmul_t_skinny, matmul_t_skinny_norm, matmul_t_skinny_norm_built, matmul_t_skinny_wg, matmul_t_skinny_wg_built,
    skinny_norm_kernel, skinny_norm_smem_bytes, skinny_norm_takes, skinny_smem_bytes, skinny_takes, skinny_wg_kernel,
    skinny_wg_serves, skinny_wg_smem_bytes, skinny_wg_takes, verify_skinny, verify_skinny_norm, NormedProduct,
    SkinnyBuild, SkinnyNormOutput, SkinnyNormShape, SkinnyShape, SKINNY_MAX_TOKENS, SKINNY_NORM_BUILDS,
    SKINNY_NORM_MAX_K, SKINNY_NORM_MAX_TOKENS, SKINNY_STAGES, SKINNY_WG_STAGES,
};
mod moe;
pub use moe::{moe_combine, moe_expert_rows, moe_group, moe_route, MoeRows, MOE_MAX_EXPERTS, MOE_MAX_TOP_K};
mod attention;
pub use attention::{
    attention_max_stages, attention_mma_smem_bytes, attention_mma_takes, attention_rows, attention_rows_smem_bytes,
    attention_split_floats, kv_fp8_shadow, qkv_rope_cache, AttnMeta, AttnShape, AttnSplit, QkvRope,
};

/// Fills `n` bf16 elements at `out` with the seeded uniform values of `preset_uniform`.
///
/// # Safety
/// See the module docs; `out` holds `n` bf16.
pub unsafe fn preset_uniform(dev: &CudaDevice, out: u64, n: u64, stream_seed: u64, amp: f32) -> Result<(), CudaError> {
    launch!(dev, "preset_uniform", grid_stride(dev, n), out, n, stream_seed, amp)
}

/// Fills `n` bf16 elements with `value`.
///
/// # Safety
/// See the module docs; `out` holds `n` bf16.
pub unsafe fn fill_bf16(dev: &CudaDevice, out: u64, n: u64, value: f32) -> Result<(), CudaError> {
    launch!(dev, "fill_bf16", grid_stride(dev, n), out, n, value)
}

/// `x[t] = table[ids[t]]` as f32, for `tokens` rows of `hidden`; an id with the top bit set
/// stands for `carried[id & 0x7fffffff]` (a token sampled on the device by the previous step).
///
/// # Safety
/// See the module docs; `table` holds `[vocab, hidden]` bf16, `ids` `tokens` ids below the
/// vocabulary (or carried rows of `carried`, which holds the previous step's samples), `x`
/// `[tokens, hidden]` f32.
pub unsafe fn embed_gather(
    dev: &CudaDevice,
    table: u64,
    ids: u64,
    carried: u64,
    x: u64,
    tokens: usize,
    hidden: usize,
) -> Result<(), CudaError> {
    launch!(dev, "embed_gather", cfg((tokens as u32, 1), 256), table, ids, carried, x, hidden as i32)
}

/// What [`add_rms_norm`] adds to the residual stream before the norm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResidualDelta {
    /// Nothing: the norm of the residual as it is.
    None,
    /// bf16 rows (a projection's output, as transformers rounds it).
    Bf16(u64),
    /// The f32 partial products of a K-sliced batch-invariant projection
    /// ([`matmul_t_invariant_sliced`]): `slices` blocks of `[rows of the product, hidden]`,
    /// `stride` floats apart, added in slice order and then rounded to bf16.
    Parts {
        /// Slice 0's first float.
        ptr: u64,
        /// How many slices.
        slices: usize,
        /// Floats from one slice to the next.
        stride: usize,
    },
}

impl ResidualDelta {
    /// The norm kernels' arguments for it: the bf16 rows (0 for none), and the partial
    /// products, their count and stride (0, 1, 0 for none).
    fn kernel_args(self) -> (u64, (u64, i32, u64)) {
        match self {
            ResidualDelta::None => (0, (0, 1, 0)),
            ResidualDelta::Bf16(ptr) => (ptr, (0, 1, 0)),
            ResidualDelta::Parts { ptr, slices, stride } => (0, (ptr, slices as i32, stride as u64)),
        }
    }
}

/// `out[r] = rms_norm(x[rows[r]]) * w` for `num_rows` rows (rows = 0: row r itself), after
/// `x += delta` (rounded to bf16 like the residual stream).
///
/// # Safety
/// See the module docs; `x` holds the residual rows `rows` names (or `num_rows`), `delta` as
/// many rows of its kind, `rows` (if non-zero) `num_rows` indices, `w` `hidden` bf16, `out`
/// `[num_rows, hidden]` bf16.
#[allow(clippy::too_many_arguments)]
pub unsafe fn add_rms_norm(
    dev: &CudaDevice,
    x: u64,
    delta: ResidualDelta,
    rows: u64,
    w: u64,
    out: u64,
    num_rows: usize,
    hidden: usize,
    eps: f32,
) -> Result<(), CudaError> {
    if num_rows == 0 {
        return Ok(());
    }
    // Each thread keeps up to 32 values of its row in registers.
    let block = if hidden <= 256 * 32 { 256 } else { 1024 };
    assert!(
        hidden <= 1024 * 32 && hidden.is_multiple_of(4),
        "hidden size {hidden} is not supported by the norm kernel"
    );
    let (bf16, (parts, slices, stride)) = delta.kernel_args();
    launch!(
        dev,
        "add_rms_norm",
        cfg((num_rows as u32, 1), block),
        x,
        bf16,
        parts,
        slices,
        stride,
        rows,
        w,
        out,
        hidden as i32,
        eps
    )
}

/// [`add_rms_norm`] in the order of sums [`matmul_t_skinny_norm`] repeats in its prologue (no
/// K-sliced deltas): the norms of a batch-invariant model whose steps of few tokens fold them
/// into their products ([`CudaDevice::invariant_fused_norm`]), so both give the same bits.
///
/// # Safety
/// As [`add_rms_norm`]; `hidden` at most [`SKINNY_NORM_MAX_K`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn add_rms_norm_b128(
    dev: &CudaDevice,
    x: u64,
    delta: ResidualDelta,
    rows: u64,
    w: u64,
    out: u64,
    num_rows: usize,
    hidden: usize,
    eps: f32,
) -> Result<(), CudaError> {
    let delta = match delta {
        ResidualDelta::None => 0,
        ResidualDelta::Bf16(ptr) => ptr,
        ResidualDelta::Parts { .. } => {
            return Err(CudaError::Unavailable("the batch-invariant norm does not take K-sliced products".into()))
        }
    };
    if hidden > SKINNY_NORM_MAX_K || !hidden.is_multiple_of(4) {
        return Err(CudaError::Unavailable(format!(
            "the batch-invariant norm takes hidden sizes up to {SKINNY_NORM_MAX_K} (a multiple of 4), not {hidden}"
        )));
    }
    if num_rows == 0 {
        return Ok(());
    }
    launch!(dev, "add_rms_norm_b128", cfg((num_rows as u32, 1), 128), x, delta, rows, w, out, hidden as i32, eps)
}

/// `out[t, i] = silu(gu[t, 2i]) * gu[t, 2i + 1]` (`inter` even): gate/up rows interleaved, as
/// [`interleave_rows`] lays out the weight; or with `stacked`, `silu(gu[t, i]) * gu[t, inter +
/// i]` (the gate rows, then the up rows).
///
/// # Safety
/// See the module docs; `gu` holds `[tokens, 2 * inter]` bf16, `out` `[tokens, inter]`.
pub unsafe fn silu_mul(
    dev: &CudaDevice,
    gu: u64,
    out: u64,
    tokens: usize,
    inter: usize,
    stacked: bool,
) -> Result<(), CudaError> {
    if tokens == 0 {
        return Ok(());
    }
    assert!(inter.is_multiple_of(2), "intermediate size {inter} must be even");
    let grid = (tokens as u32, inter.div_ceil(512) as u32);
    launch!(dev, "silu_mul", cfg(grid, 256), gu, out, inter as i32, stacked as i32)
}

/// `dst` row `2i` = `src` row `i`, row `2i + 1` = `src` row `half + i` (`2 * half` rows of `cols`
/// bf16; distinct buffers): a gate/up weight or bias made of the gate rows then the up rows,
/// laid out for [`GemvOutput::SiluMul`] and [`silu_mul`].
///
/// # Safety
/// See the module docs; `src` and `dst` each hold `[2 * half, cols]` bf16 and do not overlap.
pub unsafe fn interleave_rows(dev: &CudaDevice, src: u64, dst: u64, half: usize, cols: usize) -> Result<(), CudaError> {
    let units = if cols.is_multiple_of(8) { 2 * half * cols / 8 } else { 2 * half * cols };
    launch!(dev, "interleave_rows", grid_stride(dev, units as u64), src, dst, half as u64, cols as u64)
}

/// `y[t, j] += bias[j]`, y bf16 or f32.
///
/// # Safety
/// See the module docs; `y` holds `[tokens, cols]` (f32 with `f32_y`, else bf16), `bias`
/// `cols` bf16.
pub unsafe fn add_bias(
    dev: &CudaDevice,
    y: u64,
    bias: u64,
    tokens: usize,
    cols: usize,
    f32_y: bool,
) -> Result<(), CudaError> {
    let total = (tokens * cols) as u64;
    launch!(dev, "add_bias", grid_stride(dev, total), y, bias, cols as i32, total, f32_y as i32)
}

/// Static shared memory of the decode-projection kernels (norm scratch and K-slice partials).
pub const GEMV_STATIC_SMEM: usize = 32 * 4 + 8 * 2 * GEMV_MAX_TOKENS * 4;

/// Static shared memory of the tensor-core decode projection (norm scratch and the K slices'
/// 16-row partials).
pub const GEMV_MMA_STATIC_SMEM: usize = 32 * 4 + 8 * 16 * GEMV_MAX_TOKENS * 4;

/// Weight rows per block of the bulk-build decode projection.
pub const GEMV_BULK_ROWS: usize = 8;

/// Dynamic shared memory of a bulk-build decode projection block: its weight rows and the
/// input rows, each `2k + 16` bytes.
pub fn gemv_bulk_smem_bytes(k: usize, tokens: usize) -> usize {
    (GEMV_BULK_ROWS + tokens) * (2 * k + 16)
}

/// Whether the bulk build ([`GemvBuild::Bulk`]) takes a bf16 -> residual-add projection of `k`
/// columns for up to `tokens` tokens on this device: Hopper or later (bulk copies and
/// programmatic dependent launch), `k % 256 == 0`, the block's rows in shared memory.
pub fn gemv_bulk_supported(dev: &CudaDevice, k: usize, tokens: usize) -> bool {
    dev.pdl_capable()
        && k > 0
        && k.is_multiple_of(256)
        && (1..=GEMV_MAX_TOKENS).contains(&tokens)
        && gemv_bulk_smem_bytes(k, tokens) <= dev.gemv_bulk_smem()
}

/// Most tokens the decode-projection kernels take in one launch.
pub const GEMV_MAX_TOKENS: usize = 8;

/// The builds of the FP8 weights' fused decode projection (`--cuda-tune fp8_gemv_build`,
/// kernels/fp8.cu): each one's kernel-name suffix, the blocks an SM its launch bounds allow and
/// the weight rows of a warp's tile.
pub const FP8_GEMV_BUILDS: [(&str, usize, usize); 4] =
    [("_fp8", 3, 16), ("_h_fp8", 2, 16), ("_p_fp8", 2, 16), ("_n_fp8", 2, 8)];

/// The FP8 fused decode projection build `dev` is tuned to.
fn fp8_gemv_build(dev: &CudaDevice) -> (&'static str, usize, usize) {
    FP8_GEMV_BUILDS[usize::from(dev.tuning().fp8_gemv_build).min(FP8_GEMV_BUILDS.len() - 1)]
}

/// Where a decode projection's input rows come from.
#[derive(Clone, Copy, Debug)]
pub enum GemvInput {
    /// `[tokens, K]` bf16 rows.
    Bf16(u64),
    /// `bf16(rms_norm(residual[r]) * weight)`, residual `[.., K]` f32, `r = rows[m]` (or `m`
    /// when `rows` is 0): the RMSNorm in front of a projection.
    Norm {
        /// The f32 residual stream.
        residual: u64,
        /// Optional `[tokens]` i32 row indices into the residual.
        rows: u64,
        /// `[K]` bf16 norm weight.
        weight: u64,
        /// RMSNorm epsilon.
        eps: f32,
    },
}

/// Where a decode projection's result goes.
#[derive(Clone, Copy, Debug)]
pub enum GemvOutput {
    /// `[tokens, N]` bf16.
    Bf16(u64),
    /// `[tokens, N]` f32.
    F32(u64),
    /// Added into the `[tokens, N]` f32 residual stream.
    AddTo(u64),
    /// SiLU-and-multiply of row pairs: the weight's rows are (gate, up) pairs (see
    /// [`interleave_rows`]) and `[tokens, N / 2]` bf16 gets `bf16(silu(bf16(gate)) * bf16(up))`.
    SiluMul(u64),
}

/// Largest token count (1, 2, 4 or 8) the decode-projection kernels take for inputs of up to
/// `max_k` elements on this device; 0 when even one row does not fit in shared memory.
pub fn gemv_max_tokens(dev: &CudaDevice, max_k: usize) -> usize {
    let (limit, _) = dev.gemv_smem();
    [8, 4, 2, 1].into_iter().find(|m| m * max_k * 2 <= limit).unwrap_or(0)
}

/// Which build of the decode projection runs (see kernels/projections.cu).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemvBuild {
    /// One batch of weight loads in flight per warp at a time; more warps.
    Plain,
    /// Double-buffered weight loads; fewer warps (a comparison build).
    Pipelined,
    /// Tensor cores (`mma.sync`), 16 rows per warp: used for every decode projection with
    /// `--cuda-tune tensor_core_projections=1`.
    Mma,
    /// Bf16 input -> residual add only (the o projection; see [`gemv_bulk_supported`]): each
    /// block bulk-copies its [`GEMV_BULK_ROWS`] weight rows into shared memory as it starts,
    /// before waiting on the previous kernel, and is launched with programmatic dependent
    /// launch, so the weights stream while the previous kernel (the decode attention) runs;
    /// tensor cores multiply. K is split over the block's 8 warps (`ksplit` 8).
    Bulk,
}

/// How a decode projection spreads over the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemvPlan {
    /// The kernel build.
    pub build: GemvBuild,
    /// Warps sharing each pair of rows, each one slice of K (1, 2, 4 or 8).
    pub ksplit: usize,
    /// Blocks of 256 threads; they loop over row groups, so any count covers every row.
    pub blocks: usize,
}

/// One decode projection: `y[m] = x[m] · wᵀ` for up to [`GEMV_MAX_TOKENS`] rows, with the input
/// formed by `input` and the result stored by `output`, plus an optional bf16 bias. `weight`
/// is `[n, k]` bf16, `k % 8 == 0`, or with `scales` an FP8 weight ([`Fp8Matrix`]'s bytes and
/// row scales, `k % 64 == 0`; always the tensor-core build, whatever the plan's). Supported
/// pairs: norm -> bf16, norm -> f32, norm -> SiLU of row pairs (`n` even: bf16 gate/up rows
/// interleaved, FP8 ones stacked), bf16 -> residual add.
#[derive(Clone, Copy, Debug)]
pub struct Gemv {
    /// `[n, k]` bf16 weight, or FP8 bytes with `scales`.
    pub weight: u64,
    /// An FP8 weight's row scales `[n, ceil(k / 128)]` f32; 0 for a bf16 weight.
    pub scales: u64,
    /// Output rows.
    pub n: usize,
    /// Input length.
    pub k: usize,
    /// How the input rows are formed.
    pub input: GemvInput,
    /// Where the result goes.
    pub output: GemvOutput,
    /// Optional `[n]` bf16 bias (0 for none).
    pub bias: u64,
}

impl Gemv {
    /// Runs the projection for `tokens` rows under `plan` ([`gemv_plan`] for a build).
    ///
    /// # Safety
    /// See the module docs; `weight` holds `[n, k]` bf16, the input and output
    /// `tokens` rows of their kinds (a norm's residual rows as its row list names them), `bias` (if
    /// non-zero) `n` bf16.
    pub unsafe fn launch_with(&self, dev: &CudaDevice, tokens: usize, plan: GemvPlan) -> Result<(), CudaError> {
        let Gemv { weight: w, scales, n, k, input, output, bias } = *self;
        if tokens == 0 {
            return Ok(());
        }
        let fp8 = scales != 0;
        if fp8 && !k.is_multiple_of(64) {
            return Err(CudaError::Unavailable(format!("FP8 decode projection of {k} columns (needs k % 64 == 0)")));
        }
        // An FP8 weight has one build, the tensor-core one (its grid unless one is given), with no
        // more blocks than its launch bounds keep resident at once.
        let plan = if fp8 {
            let (sms, (_, per_sm)) = (dev.sm_count() as usize, dev.gemv_smem());
            let (_, most, tile_rows) = fp8_gemv_build(dev);
            let (ksplit, blocks) = match plan.build {
                GemvBuild::Mma => (plan.ksplit, plan.blocks),
                _ => mma_grid(sms, per_sm, n, k, tokens, (most, tile_rows)),
            };
            GemvPlan { build: GemvBuild::Mma, ksplit, blocks: blocks.min(sms * most) }
        } else {
            plan
        };
        if plan.build == GemvBuild::Bulk {
            return self.launch_bulk(dev, tokens);
        }
        let m = tokens.next_power_of_two();
        let smem = m * k * 2;
        let (limit, _) = dev.gemv_smem();
        let limit = if plan.build == GemvBuild::Mma { limit.min(dev.gemv_mma_smem()) } else { limit };
        if m > GEMV_MAX_TOKENS || smem > limit || !k.is_multiple_of(8) {
            return Err(CudaError::Unavailable(format!("decode projection of {tokens} rows x {k} is not supported")));
        }
        if ![1, 2, 4, 8].contains(&plan.ksplit) || plan.blocks == 0 {
            return Err(CudaError::Unavailable(format!("bad decode projection plan {plan:?}")));
        }
        let (kind, x, rows, weight, eps, y) = match (input, output) {
            (GemvInput::Norm { residual, rows, weight, eps }, GemvOutput::Bf16(y)) => {
                ("gemv_norm_bf16", residual, rows, weight, eps, y)
            }
            (GemvInput::Norm { residual, rows, weight, eps }, GemvOutput::F32(y)) => {
                ("gemv_norm_f32", residual, rows, weight, eps, y)
            }
            (GemvInput::Norm { residual, rows, weight, eps }, GemvOutput::SiluMul(y)) if n % 2 == 0 => {
                ("gemv_norm_silu", residual, rows, weight, eps, y)
            }
            (GemvInput::Bf16(x), GemvOutput::AddTo(y)) => ("gemv_bf16_add", x, 0, 0, 0.0, y),
            (i, o) => return Err(CudaError::Unavailable(format!("no decode projection kernel for {i:?} -> {o:?}"))),
        };
        let config = LaunchConfig {
            grid_dim: (plan.blocks as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let suffix = match plan.build {
            _ if fp8 => fp8_gemv_build(dev).0,
            GemvBuild::Plain | GemvBuild::Bulk => "",
            GemvBuild::Pipelined => "_pipe",
            GemvBuild::Mma => "_mma",
        };
        let name = format!("{kind}_m{m}{suffix}");
        if fp8 {
            return launch!(
                dev,
                name.as_str(),
                config,
                w,
                scales,
                n as i32,
                k as i32,
                plan.ksplit as i32,
                x,
                rows,
                weight,
                eps,
                y,
                bias,
                tokens as i32
            );
        }
        launch!(
            dev,
            name.as_str(),
            config,
            w,
            n as i32,
            k as i32,
            plan.ksplit as i32,
            x,
            rows,
            weight,
            eps,
            y,
            bias,
            tokens as i32
        )
    }

    /// [`GemvBuild::Bulk`]: one block per [`GEMV_BULK_ROWS`] rows, launched with programmatic
    /// dependent launch.
    fn launch_bulk(&self, dev: &CudaDevice, tokens: usize) -> Result<(), CudaError> {
        let Gemv { weight: w, n, k, input, output, bias, .. } = *self;
        let (GemvInput::Bf16(x), GemvOutput::AddTo(y)) = (input, output) else {
            return Err(CudaError::Unavailable(format!("no bulk decode projection for {input:?} -> {output:?}")));
        };
        if !gemv_bulk_supported(dev, k, tokens) {
            return Err(CudaError::Unavailable(format!(
                "bulk decode projection of {tokens} rows x {k} is not supported"
            )));
        }
        let config = LaunchConfig {
            grid_dim: (n.div_ceil(GEMV_BULK_ROWS) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: gemv_bulk_smem_bytes(k, tokens) as u32,
        };
        launch!(@with true;
            dev, "gemv_bulk_add", config, w, n as i32, k as i32, x, y, bias, tokens as i32, dev.tuning().bulk_early_rows.min(GEMV_BULK_ROWS) as i32)
    }
}

/// The plan for `n` rows by `k` at `tokens` in `build` (models use the plain build unless they
/// run tensor-core projections: on an H200 it was as fast or faster on every Qwen3-4B
/// projection, docs/PERFORMANCE.md; the pipelined one stays for `bench engine --profile`).
///
/// Plain: one wave of blocks (as many as fit at once by registers, the kernels' launch
/// bounds, and by shared memory), looping over row groups. K is split over the fewest warps
/// that give between half and all of one token's resident-block slots one row group each (so
/// every multiprocessor streams, with no second round); a matrix too tall for that splits K
/// four ways (slices of at least 512 elements). Measured on an H200 over Qwen3-4B's projections
/// with `tandem bench engine --profile --sweep-gemv-plans` (docs/PERFORMANCE.md).
pub fn gemv_plan(dev: &CudaDevice, n: usize, k: usize, tokens: usize, build: GemvBuild) -> GemvPlan {
    let (_, per_sm) = dev.gemv_smem();
    let sms = dev.sm_count() as usize;
    let (ksplit, blocks) = match build {
        GemvBuild::Plain => plain_grid(sms, per_sm, n, k, tokens),
        GemvBuild::Pipelined => gemv_grid(sms, per_sm, tokens.max(1).next_power_of_two() * k * 2, n, k),
        GemvBuild::Mma => mma_grid(sms, per_sm, n, k, tokens, (3, 16)),
        GemvBuild::Bulk => (8, n.div_ceil(GEMV_BULK_ROWS)),
    };
    GemvPlan { build, ksplit, blocks }
}

/// (K split, blocks) of the tensor-core build: warps own 16 rows, K split over the most warps
/// (up to 8) that leave each at least 256 columns (chosen as for one token, like the plain
/// build), blocks up to one wave (`most` per multiprocessor by the launch bounds, fewer if the
/// input rows fill shared memory), looping over row groups of `tile_rows` a warp, the groups
/// shared evenly: as many rounds as that wave needs, then as few blocks as give every block that
/// many (a ragged last round ran on a fraction of the device: Qwen3-32B's o and down, 320 groups
/// over 264 blocks, ran their second round on 56).
fn mma_grid(
    sms: usize,
    per_sm: usize,
    n: usize,
    k: usize,
    tokens: usize,
    (most, tile_rows): (usize, usize),
) -> (usize, usize) {
    let ksplit = [8, 4, 2, 1].into_iter().find(|s| k / s >= 256).unwrap_or(1);
    let row_groups = n.div_ceil(8 / ksplit * tile_rows);
    let smem = tokens.max(1).next_power_of_two() * k * 2;
    let slots = sms * (per_sm / (smem + GEMV_MMA_STATIC_SMEM + 1024)).clamp(1, most);
    let rounds = row_groups.div_ceil(slots).max(1);
    (ksplit, row_groups.div_ceil(rounds).max(1))
}

/// (K split, blocks) of the plain build; see [`gemv_plan`].
fn plain_grid(sms: usize, per_sm: usize, n: usize, k: usize, tokens: usize) -> (usize, usize) {
    let by_registers = match tokens.next_power_of_two() {
        1 => 4,
        2 => 3,
        _ => 2,
    };
    let slots_for = |m: usize, regs: usize| sms * (per_sm / (m * k * 2 + GEMV_STATIC_SMEM + 1024)).clamp(1, regs);
    // The split is chosen as for one token, so a row's sums (and result) do not depend on how
    // many tokens ride along.
    let one_token_slots = slots_for(1, 4);
    let mut splits = [1, 2, 4].into_iter().filter(|s| *s == 1 || k / s >= 512);
    let groups = |s: usize| n.div_ceil(8 / s * 2);
    let ksplit = splits
        .clone()
        .find(|&s| (one_token_slots / 2..=one_token_slots).contains(&groups(s)))
        .unwrap_or_else(|| splits.next_back().unwrap_or(1));
    let slots = slots_for(tokens.max(1).next_power_of_two(), by_registers);
    (ksplit, groups(ksplit).min(slots).max(1))
}

/// How the pipelined decode projection of `n` rows by `k` spreads over the device: warps per
/// row pair (K split into that many slices) and blocks.
fn gemv_grid(sm_count: usize, smem_per_sm: usize, smem: usize, n: usize, k: usize) -> (usize, usize) {
    // A warp's slice of K should be one batch of loads (GEMV_UNROLL x 256 elements), so that
    // its next batch is the next row group's and streaming never waits on a reduction; and
    // there should be enough warps to fill every multiprocessor.
    let pairs = n.div_ceil(2);
    let resident = (smem_per_sm / (smem + GEMV_STATIC_SMEM + 1024)).clamp(1, 2);
    let ksplit = [1, 2, 4, 8]
        .into_iter()
        .find(|&s| k.div_ceil(8 * s) * 8 <= 1024 && pairs * s >= sm_count * resident * 8)
        .unwrap_or(8);
    let rows_per_block = 8 / ksplit * 2;
    let needed = n.div_ceil(rows_per_block);
    // No more blocks than fit at once (two of 256 threads by registers, fewer if shared memory
    // says so): each block repeats the input prologue, so extra waves would repeat it. Equal
    // row-group counts per block avoid a ragged last round.
    let rounds = needed.div_ceil(sm_count * resident);
    (ksplit, needed.div_ceil(rounds).max(1))
}

/// Sets `logits[ban_row[i], ban_tok[i]] = -inf` for `n` pairs.
///
/// # Safety
/// See the module docs; `logits` holds every row `ban_row` names (`vocab` f32 each),
/// `ban_row` and `ban_tok` `n` ints.
pub unsafe fn ban_tokens(
    dev: &CudaDevice,
    logits: u64,
    vocab: usize,
    ban_row: u64,
    ban_tok: u64,
    n: usize,
) -> Result<(), CudaError> {
    if n == 0 {
        return Ok(());
    }
    launch!(dev, "ban_tokens", cfg((n.div_ceil(256) as u32, 1), 256), logits, vocab as i32, ban_row, ban_tok, n as i32)
}

/// Most blocks that share one greedy row's scan in [`sample_rows`] (a warp reduces their bests).
pub const SAMPLE_MAX_PARTS: usize = 16;

/// Ints of the scratch [`sample_rows`] needs to split greedy rows, for up to `rows` rows.
pub fn sample_scratch_len(rows: usize) -> usize {
    rows * (1 + 2 * SAMPLE_MAX_PARTS)
}

/// Picks one token per row of f32 logits: `params` holds `[temperature, top_p, uniform]` per
/// row and `top_ks` one int per row (0 = no limit); temperature 0 is greedy. With `scratch`
/// (a zeroed buffer of [`sample_scratch_len`]`(capacity)` ints, kept for later calls, and
/// `rows <= capacity`), a greedy row's scan is shared by several blocks when few rows leave
/// multiprocessors idle; the result is the same.
///
/// # Safety
/// See the module docs; `logits` holds `[rows, vocab]` f32, `params` `3 * rows` floats,
/// `top_ks` and `tokens` `rows` ints, the scratch as described above.
#[allow(clippy::too_many_arguments)]
pub unsafe fn sample_rows(
    dev: &CudaDevice,
    logits: u64,
    vocab: usize,
    params: u64,
    top_ks: u64,
    tokens: u64,
    rows: usize,
    scratch: Option<(u64, usize)>,
) -> Result<(), CudaError> {
    if rows == 0 {
        return Ok(());
    }
    let (parts, counters, partials) = match scratch {
        Some((ptr, capacity)) if rows <= capacity => {
            let parts = (dev.sm_count() as usize / rows).clamp(1, SAMPLE_MAX_PARTS);
            (parts, ptr, ptr + 4 * capacity as u64)
        }
        _ => (1, 0, 0),
    };
    launch!(
        dev,
        "sample_rows",
        cfg((rows as u32, parts as u32), 1024),
        logits,
        vocab as i32,
        params,
        top_ks,
        tokens,
        counters,
        partials
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_decode_projection_plans_fill_one_wave_and_keep_the_split_for_any_token_count() {
        let (sms, smem_sm) = (132, 233_472);
        // Qwen3-4B on an H200: the plans the sweep found fastest (docs/PERFORMANCE.md).
        assert_eq!(plain_grid(sms, smem_sm, 6144, 2560, 1), (1, 384), "qkv");
        assert_eq!(plain_grid(sms, smem_sm, 2560, 4096, 1), (2, 320), "o");
        assert_eq!(plain_grid(sms, smem_sm, 19456, 2560, 1), (4, 528), "gate/up");
        assert_eq!(plain_grid(sms, smem_sm, 2560, 9728, 1), (2, 320), "down");
        for &(n, k) in &[(6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728), (151_936, 2560), (37, 64), (512, 128)]
        {
            let (split1, _) = plain_grid(sms, smem_sm, n, k, 1);
            for tokens in 1..=8 {
                let (split, blocks) = plain_grid(sms, smem_sm, n, k, tokens);
                assert_eq!(split, split1, "{n}x{k}: the split changed at {tokens} tokens");
                let regs = [4, 3, 2, 2][tokens.next_power_of_two().trailing_zeros() as usize];
                assert!(
                    blocks >= 1 && blocks <= sms * regs,
                    "{n}x{k} at {tokens}: {blocks} blocks, more than one wave"
                );
                assert!(k / split >= 512 || split == 1, "{n}x{k}: slices of {} elements", k / split);
            }
        }
    }

    #[test]
    fn decode_projection_grids_cover_every_row_and_split_short_matrices() {
        let (sms, smem_sm) = (132, 233_472);
        // (n, k) of Qwen3-4B's qkv, o, gate/up, down and output projections, and tiny ones.
        for &(n, k) in &[(6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728), (151_936, 2560), (37, 64), (512, 128)]
        {
            for m in [1, 2, 4, 8] {
                let smem = m * k * 2;
                let (ksplit, blocks) = gemv_grid(sms, smem_sm, smem, n, k);
                let rows_per_round = blocks * (8 / ksplit) * 2;
                assert!(blocks >= 1 && [1, 2, 4, 8].contains(&ksplit), "{n}x{k}: {ksplit} {blocks}");
                assert!(k.div_ceil(ksplit) <= 1024 || ksplit == 8, "{n}x{k}: slices of {} elements", k / ksplit);
                // Blocks loop over row groups, so any count covers the rows; no block idles.
                assert!(blocks <= n.div_ceil(8 / ksplit * 2), "{n}x{k}: {blocks} blocks, some without rows");
                assert!(rows_per_round > 0);
            }
        }
        // Slices of one batch (1024 elements) where K allows; the longest split eight ways.
        assert_eq!(gemv_grid(sms, smem_sm, 8192, 2560, 4096).0, 4);
        assert_eq!(gemv_grid(sms, smem_sm, 19456, 2560, 9728).0, 8);
        assert_eq!(gemv_grid(sms, smem_sm, 5120, 19456, 2560).0, 4);
        assert_eq!(gemv_grid(sms, smem_sm, 2048, 151_936, 1024).0, 1);
    }

    #[test]
    fn tensor_core_plans_keep_their_split_and_one_wave() {
        let (sms, smem_sm) = (132, 233_472);
        for &(n, k) in &[(6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728), (151_936, 2560), (37, 64), (40, 2048)]
        {
            for (most, rows) in [(2, 16), (3, 16), (2, 8)] {
                let (split1, _) = mma_grid(sms, smem_sm, n, k, 1, (most, rows));
                for tokens in 1..=8 {
                    let (split, blocks) = mma_grid(sms, smem_sm, n, k, tokens, (most, rows));
                    assert_eq!(split, split1, "{n}x{k}: the split changed at {tokens} tokens");
                    assert!(k / split >= 256 || split == 1, "{n}x{k}: slices of {} columns", k / split);
                    assert!(blocks >= 1 && blocks <= sms * most, "{n}x{k} at {tokens}: {blocks} blocks");
                    let groups = n.div_ceil(8 / split * rows);
                    assert!(blocks <= groups, "{n}x{k}: {blocks} blocks, some without rows");
                    // Every block the same number of rounds, or one fewer.
                    let rounds = groups.div_ceil(blocks);
                    assert!(groups > (rounds - 1) * blocks, "{n}x{k}: a block without a last round's group");
                }
            }
        }
        // Qwen3-4B's o projection: 4096 columns over 8 warps, 16 rows each; 160 blocks.
        assert_eq!(mma_grid(sms, smem_sm, 2560, 4096, 1, (3, 16)), (8, 160));
        // Qwen3-32B under two blocks an SM (264 slots): gate/up's 3200 row groups in 13 rounds
        // of 247 blocks; o and down, 320 groups, in 2 of 160; down in 8-row tiles, 640, in 3
        // of 214.
        assert_eq!(mma_grid(sms, smem_sm, 51200, 5120, 1, (2, 16)), (8, 247));
        assert_eq!(mma_grid(sms, smem_sm, 5120, 25600, 1, (2, 16)), (8, 160));
        assert_eq!(mma_grid(sms, smem_sm, 5120, 25600, 1, (2, 8)), (8, 214));
    }
}
