//! The skinny build of the batch-invariant product (`gemm_skinny` in kernels/projections.cu):
//! 1-16 rows on our own tensor-core chains, which give cuBLASLt's bits (checked at load by
//! [`verify_skinny`]); docs/PERFORMANCE.md has what they cost beside cuBLASLt.

use cudarc::driver::PushKernelArg;

use super::{cfg, launch_programmatic, matmul_t_invariant, preset_uniform, RawArg};
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
pub const SKINNY_STAGES: [usize; 2] = [4, 8];

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
/// same bits as the cuBLASLt product, the weights streamed at the copy rate.
///
/// # Safety
/// As [`super::matmul_t`]; every address is 16-byte aligned.
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
    build: SkinnyBuild,
) -> Result<(), CudaError> {
    if t == 0 || n == 0 {
        return Ok(());
    }
    if t > build.max_tokens() || !k.is_multiple_of(64) || !dev.pdl_capable() {
        return Err(CudaError::Unavailable(format!(
            "{build:?} takes at most {} rows of a multiple of 64 columns on a Hopper or later GPU, not {t} x {k}",
            build.max_tokens()
        )));
    }
    let stages = dev.tuning().skinny_stages;
    let blocks = n.div_ceil(SKINNY_ROWS) as u32;
    let mut config = cfg((blocks, 1), 32);
    config.shared_mem_bytes = skinny_smem_bytes(t, stages) as u32;
    // Always with programmatic dependent launch: the weights' copies start before the kernel
    // waits for the previous one (`gemm_skinny` in kernels/projections.cu).
    launch!(@with true; dev, build.kernel(stages), config, w, x, y, n as i32, k as i32, t as i32, f32_out as i32)
}

/// Checks on this GPU that the skinny kernels give the bits of cuBLASLt's product for each
/// weight matrix `(address, n, k, f32 output)` (seeded inputs; 1, 8, 9 and 16 rows against
/// the same rows of a 64-row product) and turns them on for [`matmul_t_invariant`] if every
/// one agrees. Returns why not, if not (then the skinny kernels stay off: the
/// bits rest on cuBLASLt's kernels summing each output in ascending 16-column mma steps, which
/// a GPU or library other than the ones measured need not do). Needs
/// [`CudaDevice::enable_batch_invariant`].
///
/// # Safety
/// Each address holds `[n, k]` bf16 on this device, 256-byte aligned.
pub unsafe fn verify_skinny(
    dev: &CudaDevice,
    weights: &[(u64, usize, usize, bool)],
) -> Result<Option<String>, CudaError> {
    const MANY: usize = 64;
    dev.set_skinny_verified(false);
    if !dev.pdl_capable() {
        return Ok(Some("they need a Hopper or later GPU (bulk copies)".into()));
    }
    for &(w, n, k, f32_out) in weights {
        if !skinny_takes(1, k) {
            continue;
        }
        let elem = if f32_out { 4 } else { 2 };
        let x = dev.zeros::<u16>(MANY * k)?;
        let many = dev.zeros::<u8>(MANY * n * elem)?;
        let few = dev.zeros::<u8>(SKINNY_MAX_TOKENS * n * elem)?;
        // Safety: the buffers were sized above for these shapes; `w` per the contract.
        unsafe {
            preset_uniform(dev, x.ptr(), (MANY * k) as u64, 0x5eed ^ (n * 31 + k) as u64, 1.0)?;
            matmul_t_invariant(dev, x.ptr(), w, many.ptr(), MANY, n, k, f32_out)?;
        }
        let reference = dev.read(&many, SKINNY_MAX_TOKENS * n * elem)?;
        for t in [1, 8, 9, 16] {
            let build = if t <= 8 { SkinnyBuild::B8 } else { SkinnyBuild::B16 };
            // Safety: as above.
            unsafe { matmul_t_skinny(dev, x.ptr(), w, few.ptr(), t, n, k, f32_out, build)? };
            let rows = t * n * elem;
            if dev.read(&few, rows)?[..] != reference[..rows] {
                return Ok(Some(format!("they differ from cuBLASLt's bits at {t} rows x {k} by {n}")));
            }
        }
    }
    dev.set_skinny_verified(true);
    Ok(None)
}
