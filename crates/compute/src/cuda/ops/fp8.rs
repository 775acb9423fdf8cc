//! FP8 weights on the device (issue 51; kernels/fp8.cu): a `[n, k]` matrix as e4m3 bytes and f32
//! scales, one per row and 128 columns, quantized at load as the FP8 checkpoints are made and
//! multiplied by decode steps at one byte a weight; products of many rows through a bf16 copy,
//! or (`--cuda-tune fp8_block_gemm=1`) with their activations in FP8 too, on cuBLASLt's
//! block-scaled GEMM (`cuda/fp8_gemm.rs`).

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::{cfg, launch_programmatic, matmul_t, RawArg, ResidualDelta};
use crate::cuda::fp8_gemm::fp8_act_scale_ld;
use crate::cuda::{CudaDevice, CudaError};

/// Columns (and rows) a scale covers where a checkpoint's 128 x 128 blocks are quantized.
pub const FP8_BLOCK: usize = 128;

/// Most rows [`matmul_t_fp8`] multiplies without a bf16 copy of the weight.
pub const FP8_GEMV_MAX_TOKENS: usize = 16;

/// An FP8 weight on the device: `q` holds `[n, k]` e4m3 bytes, `scales` `[n, k.div_ceil(128)]`
/// f32 (`w[r, c] = e4m3(q[r, c]) * scales[r, c / 128]`).
#[derive(Clone, Copy, Debug)]
pub struct Fp8Matrix {
    /// The bytes.
    pub q: u64,
    /// The row scales.
    pub scales: u64,
    /// The same scales one per 128 x 128 block, `[n / 128, k / 128]`, where every block's rows
    /// share theirs (the block-scaled GEMM's weight scales); 0: none.
    pub block_scales: u64,
    /// Rows.
    pub n: usize,
    /// Columns.
    pub k: usize,
}

impl Fp8Matrix {
    /// Scales a row has.
    pub fn scale_cols(k: usize) -> usize {
        k.div_ceil(FP8_BLOCK)
    }
}

/// Quantizes the bf16 weight at `w` (`[m.n, m.k]`) into `m` as an FP8 checkpoint holds it: each
/// 128 x 128 block scaled by its largest magnitude over 448, each weight the nearest e4m3 of its
/// quotient (the host's `quantize_fp8`, bit for bit).
///
/// # Safety
/// See the module docs of `ops`; `w` holds `m.n * m.k` bf16, `m` its bytes and scales.
pub unsafe fn quantize_fp8(dev: &CudaDevice, w: u64, m: Fp8Matrix) -> Result<(), CudaError> {
    if m.n == 0 || m.k == 0 {
        return Ok(());
    }
    let grid = (m.n.div_ceil(FP8_BLOCK) as u32, m.k.div_ceil(FP8_BLOCK) as u32);
    launch!(dev, "fp8_quantize", cfg(grid, 256), w, m.q, m.scales, m.n as i32, m.k as i32)
}

/// Writes `m` as bf16 `[m.n, m.k]` at `out` (each weight times its scale, rounded once).
///
/// # Safety
/// See the module docs of `ops`; `out` holds `m.n * m.k` bf16; `m.k % 8 == 0`.
pub unsafe fn dequantize_fp8(dev: &CudaDevice, m: Fp8Matrix, out: u64) -> Result<(), CudaError> {
    if !m.k.is_multiple_of(8) {
        return Err(CudaError::Unavailable(format!("FP8 weights of {} columns (a multiple of 8 is needed)", m.k)));
    }
    let blocks = (m.n * m.k).div_ceil(2048) as u32;
    if blocks == 0 {
        return Ok(());
    }
    launch!(dev, "fp8_dequantize", cfg((blocks, 1), 256), m.q, m.scales, out, m.n as i32, m.k as i32)
}

/// Whether [`matmul_t_fp8`] multiplies `t` rows by a weight of `k` columns straight from its
/// bytes (else through a bf16 copy).
pub fn fp8_gemv_takes(t: usize, k: usize) -> bool {
    (1..=FP8_GEMV_MAX_TOKENS).contains(&t) && k > 0 && k.is_multiple_of(FP8_BLOCK)
}

/// Where FP8 products of many rows work ([`matmul_t_fp8`]); a zero address: none.
#[derive(Clone, Copy, Debug, Default)]
pub struct Fp8Scratch {
    /// Room for the largest weight in bf16, for products through a bf16 copy.
    pub weight: u64,
    /// Room for `tokens x cols` activations as e4m3 bytes, for the block-scaled GEMM.
    pub acts: u64,
    /// Room for their scales: `cols / 128` blocks of [`fp8_act_scale_ld`]`(tokens)` f32.
    pub act_scales: u64,
    /// Rows `acts` holds.
    pub tokens: usize,
    /// Columns `acts` holds.
    pub cols: usize,
}

impl Fp8Scratch {
    /// Bytes of activation scales for `tokens` rows of `cols` columns.
    pub fn act_scale_bytes(tokens: usize, cols: usize) -> usize {
        cols.div_ceil(FP8_BLOCK) * fp8_act_scale_ld(tokens) * 4
    }
}

/// Whether [`matmul_t_fp8`] multiplies `t` rows by `m` on cuBLASLt's block-scaled GEMM: more
/// rows than the bytes' own kernel takes, the GEMM enabled on `dev`
/// ([`CudaDevice::enable_fp8_gemm`]), block scales, a shape it takes and room in `scratch`.
pub fn fp8_block_gemm_takes(dev: &CudaDevice, m: &Fp8Matrix, t: usize, scratch: &Fp8Scratch) -> bool {
    t > FP8_GEMV_MAX_TOKENS
        && dev.fp8_gemm().is_some()
        && m.block_scales != 0
        && m.k.is_multiple_of(FP8_BLOCK)
        && (m.k / FP8_BLOCK).is_multiple_of(4)
        && m.n.is_multiple_of(FP8_BLOCK)
        && scratch.acts != 0
        && t <= scratch.tokens
        && m.k <= scratch.cols
}

/// Quantizes bf16 activations `x` (`[t, k]`, `k % 128 == 0`) to e4m3 bytes `q` (`[t, k]`) and
/// scales (`[k / 128][ld]`), one per row and 128 columns (`fp8_quantize_rows`).
///
/// # Safety
/// See the module docs of `ops`; the buffers hold those shapes; `x` 8-byte aligned.
pub unsafe fn quantize_fp8_rows(
    dev: &CudaDevice,
    x: u64,
    (q, scales, ld): (u64, u64, usize),
    t: usize,
    k: usize,
) -> Result<(), CudaError> {
    let Some(grid) = rounded_rows_grid("FP8 activations", t, k, ld)? else { return Ok(()) };
    launch!(dev, "fp8_quantize_rows", grid, x, q, scales, t as i32, k as i32, ld as i32)
}

/// The launch of a warp a (row, 128-column block) over `t` rows of `k` columns rounded to e4m3
/// with their scales' leading dimension `ld`; None for no rows; an error naming `what` for a
/// shape that is not whole blocks or scales that do not hold the rows.
fn rounded_rows_grid(what: &str, t: usize, k: usize, ld: usize) -> Result<Option<LaunchConfig>, CudaError> {
    if !k.is_multiple_of(FP8_BLOCK) || ld < t {
        return Err(CudaError::Unavailable(format!("{what} of {k} columns, {t} rows in {ld}")));
    }
    Ok((t > 0).then(|| cfg((t as u32, (k / FP8_BLOCK).div_ceil(8) as u32), 256)))
}

/// SiLU-and-multiply of `t` gate/up rows `gu` (`[t, 2 * inter]` bf16 in
/// [`super::silu_mul`]'s layouts) rounded to e4m3 as [`quantize_fp8_rows`] rounds activations:
/// the bytes `q` (`[t, inter]`) and scales (`[inter / 128][ld]`) those two give, without the
/// bf16 rows (`silu_mul_fp8_rows`).
///
/// # Safety
/// See the module docs of `ops`; the buffers hold those shapes; `inter % 128 == 0`.
pub unsafe fn silu_mul_fp8_rows(
    dev: &CudaDevice,
    gu: u64,
    (q, scales, ld): (u64, u64, usize),
    t: usize,
    inter: usize,
    stacked: bool,
) -> Result<(), CudaError> {
    let Some(grid) = rounded_rows_grid("FP8 SiLU rows", t, inter, ld)? else { return Ok(()) };
    launch!(dev, "silu_mul_fp8_rows", grid, gu, q, scales, t as i32, inter as i32, stacked as i32, ld as i32)
}

/// [`super::add_rms_norm`] of rows `0..t` (`x += delta`, then `rms_norm(x) * w`) with each
/// output row rounded to e4m3 as [`quantize_fp8_rows`] rounds activations: the bytes `q`
/// (`[t, hidden]`) and scales (`[hidden / 128][ld]`) those two give, without the bf16 rows
/// (`add_rms_norm_fp8_rows`): the input of a block-scaled FP8 product.
///
/// # Safety
/// As [`super::add_rms_norm`] (rows `0..t`); the buffers hold those shapes.
#[allow(clippy::too_many_arguments)]
pub unsafe fn add_rms_norm_fp8_rows(
    dev: &CudaDevice,
    x: u64,
    delta: ResidualDelta,
    w: u64,
    (q, scales, ld): (u64, u64, usize),
    t: usize,
    hidden: usize,
    eps: f32,
) -> Result<(), CudaError> {
    if rounded_rows_grid("FP8 normed rows", t, hidden, ld)?.is_none() {
        return Ok(());
    }
    if hidden > 1024 * 32 {
        return Err(CudaError::Unavailable(format!("hidden size {hidden} is not supported by the norm kernel")));
    }
    // Each thread keeps up to 32 values of its row in registers (as add_rms_norm).
    let block = if hidden <= 256 * 32 { 256 } else { 1024 };
    let (bf16, (parts, slices, stride)) = delta.kernel_args();
    let grid = cfg((t as u32, 1), block);
    launch!(
        dev,
        "add_rms_norm_fp8_rows",
        grid,
        x,
        bf16,
        parts,
        slices,
        stride,
        w,
        q,
        scales,
        ld as i32,
        hidden as i32,
        eps
    )
}

/// `y = x · wᵀ` on cuBLASLt's block-scaled GEMM for activations already rounded to e4m3 in
/// `scratch` ([`quantize_fp8_rows`]' or [`silu_mul_fp8_rows`]' bytes and scales, leading
/// dimension [`fp8_act_scale_ld`]`(t)`); an error where [`fp8_block_gemm_takes`] does not or
/// cuBLASLt has no kernel for the shape (nothing is queued then).
///
/// # Safety
/// As [`matmul_t`]; `y` (f32 with `f32_out`, else bf16) 16-byte aligned; `scratch` holds `t`
/// rounded rows of `m.k`.
pub unsafe fn matmul_t_fp8_rounded(
    dev: &CudaDevice,
    scratch: &Fp8Scratch,
    m: Fp8Matrix,
    (y, f32_out): (u64, bool),
    t: usize,
) -> Result<(), CudaError> {
    if fp8_skinny_takes(dev, &m, t) && fp8_block_gemm_takes(dev, &m, t, scratch) {
        // Safety: the caller's contract, as below.
        return unsafe { matmul_t_fp8_skinny(dev, scratch, m, (y, f32_out), t, 1) };
    }
    let (true, Some(gemm)) = (fp8_block_gemm_takes(dev, &m, t, scratch), dev.fp8_gemm()) else {
        return Err(CudaError::Unavailable(format!("no block-scaled FP8 product of {t} rows by {} columns here", m.k)));
    };
    // Safety: the caller's contract covers `y` and the scratch, which holds t x k (checked
    // above); the device's stream and context are current for cuBLASLt.
    unsafe {
        dev.stream().context().bind_to_thread()?;
        let stream = dev.stream().cu_stream() as cudarc::cublaslt::sys::cudaStream_t;
        gemm.matmul(stream, (m.q, m.block_scales), (scratch.acts, scratch.act_scales), y, (t, m.n, m.k), f32_out)
    }
}

/// Most rows [`matmul_t_fp8_skinny`] takes.
pub const FP8_SKINNY_MAX_TOKENS: usize = 64;

/// Most K slices [`fp8_skinny_slices`] cuts a product into.
pub const FP8_SKINNY_MAX_SLICES: usize = 8;

/// Dynamic shared memory of `gemm_fp8_wg` and `gemm_fp8_wg_t32` / `_t64` (`fp8_skinny=2`, `3`): its 1024-byte alignment and a ring
/// of 6 stages of 25600 bytes (two warpgroups' 64 weight rows, 64 token rows, their scales, 128
/// columns each).
pub const FP8_WG_SMEM_BYTES: usize = 1024 + 6 * 25600;

/// Weight rows a block of `gemm_fp8_skinny` owns (8 warps of 16).
const FP8_SKINNY_ROWS: usize = 128;

/// Whether [`matmul_t_fp8_skinny`] multiplies `t` rows by `m` here: `fp8_skinny` tuned to a
/// build this GPU runs (1: tensor cores that multiply e4m3 bytes, Ada and later; 2: Hopper's
/// warpgroup MMAs), more rows than the decode products take and at most
/// [`FP8_SKINNY_MAX_TOKENS`], whole 128-column blocks.
pub fn fp8_skinny_takes(dev: &CudaDevice, m: &Fp8Matrix, t: usize) -> bool {
    let built_here = match dev.tuning().fp8_skinny {
        1 => dev.fp8_mma_capable(),
        2 | 3 => dev.wgmma_capable(),
        _ => false,
    };
    built_here
        && (FP8_GEMV_MAX_TOKENS + 1..=FP8_SKINNY_MAX_TOKENS).contains(&t)
        && m.n > 0
        && m.k > 0
        && m.k.is_multiple_of(FP8_BLOCK)
}

/// The K slices [`matmul_t_fp8_skinny`] cuts `m`'s product into where its caller sums f32 parts
/// (a residual's projection): as many as keep a block (128 rows by one slice) for every
/// multiprocessor, at most 8 and one 128-column block a slice; 1 where the rows alone fill the
/// GPU. Qwen3-32B's o and down on an H100: 40 row groups by 3 slices.
pub fn fp8_skinny_slices(dev: &CudaDevice, m: &Fp8Matrix) -> usize {
    let groups = m.n.div_ceil(FP8_SKINNY_ROWS).max(1);
    (dev.sm_count() as usize / groups).clamp(1, FP8_SKINNY_MAX_SLICES).min((m.k / FP8_BLOCK).max(1))
}

/// `y = x · wᵀ` on `gemm_fp8_skinny` for `t` rows already rounded to e4m3 in `scratch` (as
/// [`matmul_t_fp8_rounded`] takes them) by `m`: the block-scaled GEMM's sums on e4m3
/// tensor-core MMAs, a block of 128 weight rows by one K slice for every multiprocessor
/// (`rounds` items each where there are more). One slice: `y` is `[t, m.n]`, bf16 or f32 with
/// `f32_out`; more: `y` holds `slices` f32 `[t, m.n]` parts, `t * m.n` floats apart, whose sum
/// in slice order is the product (a [`super::ResidualDelta::Parts`]). An error, nothing queued,
/// where [`fp8_skinny_takes`] does not or `scratch` does not hold the rows.
///
/// # Safety
/// As [`matmul_t_fp8_rounded`]; `y` holds `slices * t * m.n` f32 with more than one slice.
pub unsafe fn matmul_t_fp8_skinny(
    dev: &CudaDevice,
    scratch: &Fp8Scratch,
    m: Fp8Matrix,
    (y, f32_out): (u64, bool),
    t: usize,
    slices: usize,
) -> Result<(), CudaError> {
    if !fp8_skinny_takes(dev, &m, t) || scratch.acts == 0 || t > scratch.tokens || m.k > scratch.cols || slices == 0 {
        return Err(CudaError::Unavailable(format!("no skinny FP8 product of {t} rows by {} columns here", m.k)));
    }
    let (name, smem) = match (dev.tuning().fp8_skinny, t) {
        (2, _) => ("gemm_fp8_wg", FP8_WG_SMEM_BYTES),
        (3, ..=32) => ("gemm_fp8_wg_t32", FP8_WG_SMEM_BYTES),
        (3, _) => ("gemm_fp8_wg_t64", FP8_WG_SMEM_BYTES),
        (_, ..=32) => ("gemm_fp8_skinny_t32", 0),
        (_, 33..=48) => ("gemm_fp8_skinny_t48", 0),
        _ => ("gemm_fp8_skinny_t64", 0),
    };
    // One block a multiprocessor (the launch bounds: 223 registers a thread), the items
    // shared evenly: as many rounds as that wave needs, then as few blocks as give each that
    // many.
    let items = m.n.div_ceil(FP8_SKINNY_ROWS) * slices;
    let rounds = items.div_ceil(dev.sm_count().max(1) as usize);
    let blocks = items.div_ceil(rounds) as u32;
    let mut config = cfg((blocks, 1), 256);
    config.shared_mem_bytes = smem as u32;
    launch!(
        dev,
        name,
        config,
        m.q,
        m.scales,
        scratch.acts,
        scratch.act_scales,
        fp8_act_scale_ld(t) as i32,
        y,
        m.n as i32,
        m.k as i32,
        t as i32,
        slices as i32,
        rounds as i32,
        f32_out as i32
    )
}

/// `y = x · wᵀ` for bf16 rows `x` (`[t, m.k]`) and the FP8 weight `m`, into bf16 or f32 `y`
/// (`[t, m.n]`): up to [`FP8_GEMV_MAX_TOKENS`] rows on `gemv_fp8` (one byte read a weight, each
/// 128-column block's sum scaled once); more with the activations quantized to FP8 (per row and
/// 128 columns) on cuBLASLt's block-scaled GEMM where [`fp8_block_gemm_takes`], else through a
/// bf16 copy of the weight in `scratch.weight` and cuBLAS.
///
/// # Safety
/// As [`matmul_t`]; `x` and `y` 16-byte aligned; `scratch`'s buffers hold what it says.
#[allow(clippy::too_many_arguments)]
pub unsafe fn matmul_t_fp8(
    dev: &CudaDevice,
    x: u64,
    m: Fp8Matrix,
    y: u64,
    t: usize,
    f32_out: bool,
    scratch: &Fp8Scratch,
) -> Result<(), CudaError> {
    if t == 0 || m.n == 0 {
        return Ok(());
    }
    if fp8_gemv_takes(t, m.k) {
        // A warp each 16 rows where that fills the GPU twice; else four warps share them, each
        // a quarter of K.
        let split = m.n.div_ceil(64) < 2 * dev.sm_count() as usize;
        let (name, rows) = match (t <= 8, split) {
            (true, false) => ("gemv_fp8_t8", 64),
            (false, false) => ("gemv_fp8_t16", 64),
            (true, true) => ("gemv_fp8_t8_k4", 16),
            (false, true) => ("gemv_fp8_t16_k4", 16),
        };
        let blocks = m.n.div_ceil(rows) as u32;
        return launch!(
            dev,
            name,
            cfg((blocks, 1), 128),
            m.q,
            m.scales,
            x,
            y,
            m.n as i32,
            m.k as i32,
            t as i32,
            f32_out as i32
        );
    }
    if fp8_block_gemm_takes(dev, &m, t, scratch) && dev.fp8_gemm().is_some() {
        let ld = fp8_act_scale_ld(t);
        // Safety: the caller's contract covers `x`, `y` and the scratch, which holds t x k
        // (checked by fp8_block_gemm_takes).
        let queued = unsafe {
            quantize_fp8_rows(dev, x, (scratch.acts, scratch.act_scales, ld), t, m.k)?;
            matmul_t_fp8_rounded(dev, scratch, m, (y, f32_out), t)
        };
        // A shape cuBLASLt has no kernel for goes through the bf16 copy.
        if queued.is_ok() || scratch.weight == 0 {
            return queued;
        }
    }
    if scratch.weight == 0 {
        return Err(CudaError::Unavailable(format!(
            "an FP8 product of {t} rows by {} columns needs a bf16 copy of its weight, and none was given",
            m.k
        )));
    }
    // Safety: the caller's contract covers `scratch` and the product's buffers.
    unsafe {
        dequantize_fp8(dev, m, scratch.weight)?;
        matmul_t(dev, x, scratch.weight, y, t, m.n, m.k, f32_out)
    }
}
