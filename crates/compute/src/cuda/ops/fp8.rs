//! FP8 weights on the device (issue 51; kernels/fp8.cu): a `[n, k]` matrix as e4m3 bytes and f32
//! scales, one per row and 128 columns, quantized at load as the FP8 checkpoints are made and
//! multiplied by decode steps at one byte a weight.

use cudarc::driver::PushKernelArg;

use super::{cfg, launch_programmatic, matmul_t, RawArg};
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

/// `y = x · wᵀ` for bf16 rows `x` (`[t, m.k]`) and the FP8 weight `m`, into bf16 or f32 `y`
/// (`[t, m.n]`): up to [`FP8_GEMV_MAX_TOKENS`] rows on `gemv_fp8` (one byte read a weight, each
/// 128-column block's sum scaled once), more through a bf16 copy of the weight in `scratch`
/// (`m.n * m.k` bf16; 0 where the caller knows `t` is few) and cuBLAS.
///
/// # Safety
/// As [`matmul_t`]; `x` and `y` 16-byte aligned.
#[allow(clippy::too_many_arguments)]
pub unsafe fn matmul_t_fp8(
    dev: &CudaDevice,
    x: u64,
    m: Fp8Matrix,
    y: u64,
    t: usize,
    f32_out: bool,
    scratch: u64,
) -> Result<(), CudaError> {
    if t == 0 || m.n == 0 {
        return Ok(());
    }
    if fp8_gemv_takes(t, m.k) {
        let name = if t <= 8 { "gemv_fp8_t8" } else { "gemv_fp8_t16" };
        let blocks = m.n.div_ceil(64) as u32;
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
    if scratch == 0 {
        return Err(CudaError::Unavailable(format!(
            "an FP8 product of {t} rows by {} columns needs a bf16 copy of its weight, and none was given",
            m.k
        )));
    }
    // Safety: the caller's contract covers `scratch` and the product's buffers.
    unsafe {
        dequantize_fp8(dev, m, scratch)?;
        matmul_t(dev, x, scratch, y, t, m.n, m.k, f32_out)
    }
}
