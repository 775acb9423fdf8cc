//! The skinny build of the batch-invariant product (`gemm_skinny` in kernels/projections.cu):
//! 1-16 rows on our own tensor-core chains, which give cuBLASLt's bits (checked at load by
//! [`verify_skinny`]); docs/PERFORMANCE.md has what they cost beside cuBLASLt.

use cudarc::driver::PushKernelArg;

use super::{cfg, launch_programmatic, matmul_t_invariant, matmul_t_invariant_sliced, preset_uniform, RawArg};
use crate::cuda::{CudaDevice, CudaError};

/// Most rows the skinny build of the batch-invariant product takes.
pub const SKINNY_MAX_TOKENS: usize = 16;

/// Whether [`matmul_t_invariant`] takes a product of `t` rows and `k` columns to the skinny
/// kernels. K a multiple of 64: cuBLASLt's kernels then have no partial K tile, whose place in
/// their order of sums is theirs to choose (with one, a K of 520, a few outputs differed).
pub fn skinny_takes(t: usize, k: usize) -> bool {
    (1..=SKINNY_MAX_TOKENS).contains(&t) && k > 0 && k.is_multiple_of(64)
}

/// Builds of the batch-invariant skinny product (`gemm_skinny` in kernels/projections.cu).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SkinnyBuild {
    /// At most 8 rows of `x`.
    B8,
    /// At most 16 rows of `x`.
    B16,
}

impl SkinnyBuild {
    /// The kernel's name for `stages` stages in flight (one of [`SKINNY_STAGES`]).
    pub fn kernel(self, stages: usize) -> &'static str {
        match (self, stages) {
            (Self::B8, 2) => "gemm_skinny_b8_s2",
            (Self::B16, 2) => "gemm_skinny_b16_s2",
            (Self::B8, 4) => "gemm_skinny_b8_s4",
            (Self::B16, 4) => "gemm_skinny_b16_s4",
            (Self::B8, _) => "gemm_skinny_b8_s8",
            (Self::B16, _) => "gemm_skinny_b16_s8",
        }
    }

    /// Most rows of `x` it takes.
    pub fn max_tokens(self) -> usize {
        match self {
            Self::B8 => 8,
            Self::B16 => 16,
        }
    }
}

/// The stage counts the skinny kernels are built for ([`crate::cuda::CudaTuning::skinny_stages`]).
/// Two stages use a quarter of eight's shared memory, so four times the one-warp blocks fit an
/// SM at once: for the many short blocks of a K-sliced product, where the time goes to waves of
/// blocks rather than to memory in flight per block.
pub const SKINNY_STAGES: [usize; 3] = [2, 4, 8];

/// The padded row of the skinny product (SKINNY_ROW_BYTES in the source), and the weight rows
/// of a block.
const SKINNY_ROW_BYTES: usize = 256 * 2 + 16;
const SKINNY_ROWS: usize = 8;

/// Dynamic shared memory of a skinny-product block for `t` rows and `stages` stages: per stage
/// the weight rows and the token rows, and one zero row.
pub fn skinny_smem_bytes(t: usize, stages: usize) -> usize {
    (stages * (SKINNY_ROWS + t) + 1) * SKINNY_ROW_BYTES
}

/// [`matmul_t_invariant`] for `t` up to `build.max_tokens()` rows on the skinny kernels: the
/// same bits as the cuBLASLt product, the weights streamed at the copy rate. With `slices` > 1,
/// the f32 partial products of K cut into that many slices, as
/// [`super::matmul_t_invariant_sliced`] writes them (`f32_out` is then implied).
///
/// # Safety
/// As [`super::matmul_t`]; every address is 16-byte aligned; with slices, `y` holds
/// `[slices, t, n]` f32.
#[allow(clippy::too_many_arguments)]
pub unsafe fn matmul_t_skinny(
    dev: &CudaDevice,
    x: u64,
    w: u64,
    y: u64,
    t: usize,
    n: usize,
    k: usize,
    f32_out: bool,
    slices: usize,
    build: SkinnyBuild,
) -> Result<(), CudaError> {
    if t == 0 || n == 0 {
        return Ok(());
    }
    let slices = slices.max(1);
    if t > build.max_tokens() || !k.is_multiple_of(slices) || !(k / slices).is_multiple_of(64) || !dev.pdl_capable() {
        return Err(CudaError::Unavailable(format!(
            "{build:?} takes at most {} rows of a multiple of 64 columns (a slice) on a Hopper or later GPU, not {t} x \
             {k} in {slices} slices",
            build.max_tokens()
        )));
    }
    let stages = dev.tuning().skinny_stages;
    let blocks = n.div_ceil(SKINNY_ROWS) as u32;
    let mut config = cfg((blocks, slices as u32), 32);
    config.shared_mem_bytes = skinny_smem_bytes(t, stages) as u32;
    // Always with programmatic dependent launch: the weights' copies start before the kernel
    // waits for the previous one (`gemm_skinny` in kernels/projections.cu).
    launch!(@with true; dev, build.kernel(stages), config, w, x, y, n as i32, k as i32, t as i32, f32_out as i32,
        slices as i32)
}

/// A weight matrix the skinny kernels must agree on with cuBLASLt before they serve it
/// ([`verify_skinny`]).
#[derive(Clone, Copy, Debug)]
pub struct SkinnyShape {
    /// `[n, k]` bf16 on the device, 256-byte aligned.
    pub weight: u64,
    /// Output columns (rows of the weight).
    pub n: usize,
    /// Input columns.
    pub k: usize,
    /// Whether the product is written as f32 (bf16 otherwise; sliced products are f32).
    pub f32_out: bool,
    /// K slices ([`super::matmul_t_invariant_sliced`]; 1: unsliced).
    pub slices: usize,
}

/// Checks on this GPU that the skinny kernels give the bits of cuBLASLt's product for each
/// weight matrix (seeded inputs; 1, 8, 9 and 16 rows against the same rows of a 64-row
/// product, sliced as the shape says) and lets them serve the batch-invariant products of few
/// rows if every one agrees. Returns why not, if not (then the skinny kernels stay off: the
/// bits rest on cuBLASLt's kernels summing each output in ascending 16-column mma steps, which
/// a GPU or library other than the ones measured need not do). Needs
/// [`CudaDevice::enable_batch_invariant`].
///
/// # Safety
/// Each shape's weight holds `[n, k]` bf16 on this device, 256-byte aligned.
pub unsafe fn verify_skinny(dev: &CudaDevice, shapes: &[SkinnyShape]) -> Result<Option<String>, CudaError> {
    const MANY: usize = 64;
    dev.set_skinny_verified(false);
    if !dev.pdl_capable() {
        return Ok(Some("they need a Hopper or later GPU (bulk copies)".into()));
    }
    for &SkinnyShape { weight: w, n, k, f32_out, slices } in shapes {
        let slices = slices.max(1);
        if !k.is_multiple_of(slices) || !skinny_takes(1, k / slices) {
            continue;
        }
        let f32_out = f32_out || slices > 1;
        let elem = if f32_out { 4 } else { 2 };
        let x = dev.zeros::<u16>(MANY * k)?;
        let many = dev.zeros::<u8>(slices * MANY * n * elem)?;
        let few = dev.zeros::<u8>(slices * SKINNY_MAX_TOKENS * n * elem)?;
        // Safety: the buffers were sized above for these shapes; `w` per the contract.
        unsafe {
            preset_uniform(dev, x.ptr(), (MANY * k) as u64, 0x5eed ^ (n * 31 + k) as u64, 1.0)?;
            if slices > 1 {
                matmul_t_invariant_sliced(dev, x.ptr(), w, many.ptr(), MANY, n, k, slices)?;
            } else {
                matmul_t_invariant(dev, x.ptr(), w, many.ptr(), MANY, n, k, f32_out)?;
            }
        }
        let reference = dev.read(&many, slices * MANY * n * elem)?;
        for t in [1, 8, 9, 16] {
            let build = if t <= 8 { SkinnyBuild::B8 } else { SkinnyBuild::B16 };
            // Safety: as above.
            unsafe { matmul_t_skinny(dev, x.ptr(), w, few.ptr(), t, n, k, f32_out, slices, build)? };
            let got = dev.read(&few, slices * t * n * elem)?;
            let (row_bytes, want_stride) = (t * n * elem, MANY * n * elem);
            for s in 0..slices {
                if got[s * row_bytes..(s + 1) * row_bytes] != reference[s * want_stride..s * want_stride + row_bytes] {
                    return Ok(Some(format!(
                        "they differ from cuBLASLt's bits at {t} rows x {k} by {n} (slice {s} of {slices})"
                    )));
                }
            }
        }
    }
    dev.set_skinny_verified(true);
    Ok(None)
}
