//! The batch-invariant matrix products (`--batch-invariant`): cuBLASLt's unsplit products
//! (`cuda/invariant.rs`) or, for few rows, the skinny kernels ([`super::skinny`]), unsliced or
//! with K cut into slices fixed by the shape.

use super::skinny::{matmul_t_skinny, matmul_t_skinny_wg, skinny_takes, skinny_wg_serves, SkinnyBuild};
use crate::cuda::{CudaDevice, CudaError};

/// [`super::matmul_t`] whose every row is the same whatever `t` is (see `cuda/invariant.rs`):
/// cuBLASLt algorithms that split no reduction over blocks, or for few rows our own chains that
/// give their bits (verified at load: [`super::verify_skinny_norm`], [`super::verify_skinny`]). Needs
/// [`CudaDevice::enable_batch_invariant`].
///
/// # Safety
/// As [`super::matmul_t`]; every address is also 256-byte aligned (the start of a buffer).
#[allow(clippy::too_many_arguments)]
pub unsafe fn matmul_t_invariant(
    dev: &CudaDevice,
    x: u64,
    w: u64,
    y: u64,
    t: usize,
    n: usize,
    k: usize,
    f32_out: bool,
) -> Result<(), CudaError> {
    if dev.invariant_fused_norm() && skinny_wg_serves(dev, t, n, k) {
        // Safety: the caller's contract (256-byte alignment implies the kernel's 16).
        return unsafe { matmul_t_skinny_wg(dev, x, w, y, t, n, k, f32_out) };
    }
    let skinny = dev.invariant_skinny() && skinny_takes(t, k);
    // Safety: the caller's contract.
    unsafe { invariant_product(dev, x, w, y, t, n, k, f32_out, 1, skinny) }
}

/// How many slices a batch-invariant product of `k` columns is cut into
/// ([`matmul_t_invariant_sliced`]), fixed by `k` and the tuning alone: the fewest (a power of
/// two, at most [`MAX_INVARIANT_SLICES`]) of at most `max_cols` columns each, every slice a
/// multiple of 64 columns; 1 when `max_cols` is 0 or `k` does not split so.
pub fn invariant_slices(k: usize, max_cols: usize) -> usize {
    if max_cols == 0 {
        return 1;
    }
    let mut slices = 1;
    while k.div_ceil(slices) > max_cols && slices < MAX_INVARIANT_SLICES && k.is_multiple_of(slices * 2 * 64) {
        slices *= 2;
    }
    slices
}

/// Most slices [`invariant_slices`] cuts a product into.
pub const MAX_INVARIANT_SLICES: usize = 8;

/// [`matmul_t_invariant`] with K cut into `slices` equal slices (each a multiple of 64 columns
/// when `slices` > 1): writes the f32 partial products `parts[slice, t, n]` (slice `s` over
/// columns `s k / slices ..`), which [`super::add_rms_norm`] adds in slice order
/// ([`super::ResidualDelta::Parts`]). Every row count gets the same slices, so the sums are the
/// same whatever `t` is; a long K's one-row product then runs `slices` times as many blocks,
/// each a shorter chain (cuBLASLt's strided batch above [`super::SKINNY_MAX_TOKENS`] rows, the
/// skinny kernels at or below it once [`super::verify_skinny`] has checked they agree).
///
/// # Safety
/// As [`matmul_t_invariant`]; `parts` holds `[slices, t, n]` f32.
#[allow(clippy::too_many_arguments)]
pub unsafe fn matmul_t_invariant_sliced(
    dev: &CudaDevice,
    x: u64,
    w: u64,
    parts: u64,
    t: usize,
    n: usize,
    k: usize,
    slices: usize,
) -> Result<(), CudaError> {
    if slices <= 1 {
        // Safety: the caller's contract.
        return unsafe { matmul_t_invariant(dev, x, w, parts, t, n, k, true) };
    }
    let cols = k / slices;
    if !k.is_multiple_of(slices) || !cols.is_multiple_of(64) {
        return Err(CudaError::Unavailable(format!("{k} columns do not cut into {slices} slices of a multiple of 64")));
    }
    let skinny = dev.skinny_verified() && skinny_takes(t, cols);
    // Safety: the caller's contract.
    unsafe { invariant_product(dev, x, w, parts, t, n, k, true, slices, skinny) }
}

/// The batch-invariant product on the skinny kernels or cuBLASLt.
///
/// # Safety
/// As [`matmul_t_invariant_sliced`].
#[allow(clippy::too_many_arguments)]
unsafe fn invariant_product(
    dev: &CudaDevice,
    x: u64,
    w: u64,
    y: u64,
    t: usize,
    n: usize,
    k: usize,
    f32_out: bool,
    slices: usize,
    skinny: bool,
) -> Result<(), CudaError> {
    let gemm = dev
        .invariant_gemm()
        .ok_or_else(|| CudaError::Unavailable("batch-invariant matmul used before it was enabled".into()))?;
    if skinny && dev.pdl_capable() {
        let build = if t <= 8 { SkinnyBuild::B8 } else { SkinnyBuild::B16 };
        // Safety: the caller's contract covers the buffers.
        return unsafe { matmul_t_skinny(dev, x, w, y, t, n, k, f32_out, slices, build) };
    }
    dev.stream().context().bind_to_thread()?;
    let stream = dev.stream().cu_stream() as cudarc::cublaslt::sys::cudaStream_t;
    // Safety: the caller's contract is the one `InvariantGemm::matmul` states; the stream is
    // the device's, whose context was made current above.
    unsafe { gemm.matmul(stream, x, w, y, t, n, k, f32_out, slices) }
}
