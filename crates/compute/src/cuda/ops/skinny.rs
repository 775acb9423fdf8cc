//! The skinny builds of the batch-invariant product (kernels/projections.cu): `gemm_skinny`,
//! 1-16 rows on our own mma.sync chains, and `gemm_wg_norm`, 1-8 rows with the residual add and
//! RMSNorm in front (and SiLU behind) on wgmma chains; both give cuBLASLt's bits (checked at load
//! by [`verify_skinny`] and [`verify_skinny_norm`]); docs/PERFORMANCE.md has what they cost.

use cudarc::driver::PushKernelArg;

use super::{cfg, launch_programmatic, matmul_t_invariant, matmul_t_invariant_sliced, preset_uniform, RawArg};
use crate::cuda::{CudaDevice, CudaError, DevBuf};

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

/// Most rows [`matmul_t_skinny_norm`] takes (its tokens are the 8 columns of a wgmma tile).
pub const SKINNY_NORM_MAX_TOKENS: usize = 8;

/// Widest K (hidden size) [`matmul_t_skinny_norm`]'s norm takes (NORM_THREADS x NORM_PIECES x 4).
pub const SKINNY_NORM_MAX_K: usize = 8192;

/// The builds of `gemm_wg_norm`: (stages, warpgroups a block), each warpgroup 64 weight rows
/// with a ring of that many 64-column stages (8 KB), the block's warpgroups sharing its normed
/// rows.
pub const SKINNY_NORM_BUILDS: [(usize, usize); 4] = [(4, 1), (8, 1), (4, 2), (3, 2)];

/// Stages a wgmma ring of `stages` slots keeps in flight ahead of its products (`WgRing` in
/// kernels/projections.cu: two stages of products stay queued where the ring has at least 8
/// slots, one otherwise).
fn wg_ring_ahead(stages: usize) -> usize {
    stages - if stages >= 8 { 2 } else { 1 }
}

/// Weight rows of one `gemm_wg_norm` warpgroup.
const SKINNY_NORM_ROWS: usize = 64;

/// The `gemm_wg_norm` kernel of a build (one of [`SKINNY_NORM_BUILDS`]).
pub fn skinny_norm_kernel((stages, groups): (usize, usize)) -> &'static str {
    match (stages, groups) {
        (8, _) => "gemm_wg_norm_s8",
        (3, _) => "gemm_wg_norm_s3_g2",
        (_, 2) => "gemm_wg_norm_s4_g2",
        _ => "gemm_wg_norm_s4",
    }
}

/// Dynamic shared memory of a `gemm_wg_norm` block: room to align to 1024 bytes, the tokens'
/// swizzled tiles (8 rows of `k` bf16) and each warpgroup's ring of weight stages.
pub fn skinny_norm_smem_bytes(k: usize, (stages, groups): (usize, usize)) -> usize {
    1024 + k * 16 + groups * stages * SKINNY_NORM_ROWS * 128
}

/// The build `gemm_wg_norm` runs a product of `n` output rows and `k` columns with: the tuned
/// one, or of those whose blocks all fit the GPU at once (else the fewest waves), the one with
/// the most weight bytes in flight, the fewer warpgroups a block on a tie.
fn skinny_norm_build(dev: &CudaDevice, n: usize, k: usize) -> (usize, usize) {
    if let Some(build) = dev.tuning().fused_norm_build {
        if n.is_multiple_of(SKINNY_NORM_ROWS * build.1) {
            return build;
        }
    }
    let (_, smem_per_sm) = dev.gemv_smem();
    let sms = dev.sm_count() as usize;
    let score = |&(stages, groups): &(usize, usize)| {
        let blocks = n / (SKINNY_NORM_ROWS * groups);
        // 1 KB a block the driver keeps, and the kernel's static scratch.
        let per_sm = (smem_per_sm / (skinny_norm_smem_bytes(k, (stages, groups)) + 2048)).max(1);
        let waves = blocks.div_ceil(per_sm * sms);
        let in_flight = blocks.min(per_sm * sms) * groups * wg_ring_ahead(stages);
        (std::cmp::Reverse(waves), in_flight, std::cmp::Reverse(groups))
    };
    SKINNY_NORM_BUILDS
        .into_iter()
        .filter(|&(_, groups)| n.is_multiple_of(SKINNY_NORM_ROWS * groups))
        .max_by_key(score)
        .unwrap_or((4, 1))
}

/// What [`matmul_t_skinny_norm`] writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SkinnyNormOutput {
    /// The bf16 product `[t, n]`.
    Product,
    /// [`super::silu_mul`] of the product, whose rows are gate/up interleaved: `[t, n / 2]`.
    SiluMul,
}

/// A product [`matmul_t_skinny_norm`] computes: its weight, the residual rows and delta in
/// front of it, the norm, and where the output goes.
#[derive(Clone, Copy, Debug)]
pub struct NormedProduct {
    /// `[n, k]` bf16.
    pub weight: u64,
    /// Output columns (rows of the weight; a multiple of 64).
    pub n: usize,
    /// Input columns (the hidden size).
    pub k: usize,
    /// The residual rows, `[t, k]` f32.
    pub x: u64,
    /// The bf16 delta `[t, k]` added to them first (0: none).
    pub delta: u64,
    /// Where `x + delta` goes, `[t, k]` f32, not `x` (0: nowhere).
    pub x_out: u64,
    /// The norm's weight, `k` bf16.
    pub norm_weight: u64,
    /// The norm's epsilon.
    pub eps: f32,
    /// The output: `[t, n]` bf16, or `[t, n / 2]` with [`SkinnyNormOutput::SiluMul`].
    pub y: u64,
    /// What is written.
    pub output: SkinnyNormOutput,
}

/// The residual add + RMSNorm in front of a batch-invariant product of at most
/// [`SKINNY_NORM_MAX_TOKENS`] rows, in one kernel (`gemm_wg_norm`, Hopper's warpgroup MMAs):
/// `y = rms_norm(x + delta) · wᵀ` (or its [`SkinnyNormOutput::SiluMul`]) with the bits of
/// [`super::add_rms_norm_b128`] followed by [`super::matmul_t_invariant`] (and
/// [`super::silu_mul`]), `x + delta` written to `x_out`. A decode step of few tokens so saves a
/// launch a norm, and SiLU's. The bits rest on the kernel's chain agreeing with cuBLASLt's
/// ([`verify_skinny_norm`] checks the whole on this GPU).
///
/// # Safety
/// Every buffer of `p` holds what [`NormedProduct`] says for `t` rows, 16-byte aligned, all of
/// the device's context.
pub unsafe fn matmul_t_skinny_norm(dev: &CudaDevice, p: &NormedProduct, t: usize) -> Result<(), CudaError> {
    // Safety: the caller's contract.
    unsafe { matmul_t_skinny_norm_built(dev, p, t, skinny_norm_build(dev, p.n, p.k)) }
}

/// [`matmul_t_skinny_norm`] on `build` (one of [`SKINNY_NORM_BUILDS`]).
///
/// # Safety
/// As [`matmul_t_skinny_norm`].
pub unsafe fn matmul_t_skinny_norm_built(
    dev: &CudaDevice,
    p: &NormedProduct,
    t: usize,
    build: (usize, usize),
) -> Result<(), CudaError> {
    let &NormedProduct { weight, n, k, x, delta, x_out, norm_weight, eps, y, output } = p;
    if t == 0 || n == 0 {
        return Ok(());
    }
    if !skinny_norm_takes(dev, t, n, k) || !n.is_multiple_of(SKINNY_NORM_ROWS * build.1) || (x_out != 0 && x_out == x) {
        return Err(CudaError::Unavailable(format!(
            "the fused norm and product takes 1-{SKINNY_NORM_MAX_TOKENS} rows of K a multiple of 64 up to \
             {SKINNY_NORM_MAX_K}, N a multiple of 64, on a Hopper GPU, writing the sum elsewhere: not {t} x {k} by {n}"
        )));
    }
    let mut config = cfg(((n / (SKINNY_NORM_ROWS * build.1)) as u32, 1), 128 * build.1 as u32);
    config.shared_mem_bytes = skinny_norm_smem_bytes(k, build) as u32;
    let silu = (output == SkinnyNormOutput::SiluMul) as i32;
    launch!(@with true; dev, skinny_norm_kernel(build), config, weight, x, delta, x_out, norm_weight, eps, y,
        n as i32, k as i32, t as i32, silu)
}

/// Whether [`matmul_t_skinny_norm`] takes `t` rows of a `[n, k]` product on `dev`.
pub fn skinny_norm_takes(dev: &CudaDevice, t: usize, n: usize, k: usize) -> bool {
    // The same chain as the plain product's, and a norm of at most SKINNY_NORM_MAX_K in front.
    skinny_wg_takes(dev, t, n, k) && k <= SKINNY_NORM_MAX_K
}

/// The stage counts `gemm_wg` is built for: each stage 64 columns of a block's 64 weight rows
/// (8 KB) and of the tokens (1 KB).
pub const SKINNY_WG_STAGES: [usize; 3] = [8, 16, 24];

/// The `gemm_wg` kernel of `stages` (one of [`SKINNY_WG_STAGES`]).
pub fn skinny_wg_kernel(stages: usize) -> &'static str {
    match stages {
        24 => "gemm_wg_s24",
        16 => "gemm_wg_s16",
        _ => "gemm_wg_s8",
    }
}

/// Dynamic shared memory of a `gemm_wg` block: room to align to 1024 bytes, and the ring.
pub fn skinny_wg_smem_bytes(stages: usize) -> usize {
    1024 + stages * (SKINNY_NORM_ROWS * 128 + 1024)
}

/// The stages `gemm_wg` runs a product of `n` output rows with: the tuned count, or of those
/// whose blocks all fit the GPU at once (else the fewest waves), the one with the most weight
/// bytes in flight. A product of few blocks (o and down: 40 for Qwen3-4B) so gets the deepest
/// ring, one block an SM; a wide one (the head) the shallow ring, three blocks an SM.
fn skinny_wg_stages(dev: &CudaDevice, n: usize) -> usize {
    if let Some(stages) = dev.tuning().wg_product_stages {
        return stages;
    }
    let (_, smem_per_sm) = dev.gemv_smem();
    let (sms, blocks) = (dev.sm_count() as usize, n / SKINNY_NORM_ROWS);
    let score = |&stages: &usize| {
        // 1 KB a block the driver keeps.
        let per_sm = (smem_per_sm / (skinny_wg_smem_bytes(stages) + 1024)).max(1);
        let waves = blocks.div_ceil(per_sm * sms);
        (std::cmp::Reverse(waves), blocks.min(per_sm * sms) * wg_ring_ahead(stages))
    };
    SKINNY_WG_STAGES.into_iter().max_by_key(score).unwrap_or(8)
}

/// Whether the batch-invariant products of `t` rows of a `[n, k]` weight go to
/// [`matmul_t_skinny_wg`] (once verified): where it takes them and its 64-row blocks fill every
/// SM at least once. A narrower product (Qwen3-4B's o and down: 40 blocks) is one long chain of
/// dependent steps a block, each slower than in cuBLASLt's kernel (H200: o 0.464 against 0.367
/// ms a step, down 1.077 against 0.654; docs/PERFORMANCE.md), so cuBLASLt keeps those, unless
/// `--cuda-tune wg_product_stages` names a ring (to measure the narrow products).
pub fn skinny_wg_serves(dev: &CudaDevice, t: usize, n: usize, k: usize) -> bool {
    skinny_wg_takes(dev, t, n, k)
        && (dev.tuning().wg_product_stages.is_some() || n / SKINNY_NORM_ROWS >= dev.sm_count() as usize)
}

/// Whether [`matmul_t_skinny_wg`] takes `t` rows of a `[n, k]` product on `dev`.
pub fn skinny_wg_takes(dev: &CudaDevice, t: usize, n: usize, k: usize) -> bool {
    dev.wgmma_capable()
        && (1..=SKINNY_NORM_MAX_TOKENS).contains(&t)
        && k > 0
        && k.is_multiple_of(64)
        && n.is_multiple_of(SKINNY_NORM_ROWS)
}

/// [`super::matmul_t_invariant`] for at most [`SKINNY_NORM_MAX_TOKENS`] rows on
/// [`matmul_t_skinny_norm`]'s chains without its norm (`gemm_wg`): the bits of cuBLASLt's
/// product (as [`verify_skinny_norm`] checks on this GPU), launched after the previous kernel's
/// start with the weights already streaming, where cuBLASLt's launch waits for its end.
///
/// # Safety
/// As [`super::matmul_t`]; every address is 16-byte aligned.
#[allow(clippy::too_many_arguments)]
pub unsafe fn matmul_t_skinny_wg(
    dev: &CudaDevice,
    x: u64,
    w: u64,
    y: u64,
    t: usize,
    n: usize,
    k: usize,
    f32_out: bool,
) -> Result<(), CudaError> {
    // Safety: the caller's contract.
    unsafe { matmul_t_skinny_wg_built(dev, x, w, y, t, n, k, f32_out, skinny_wg_stages(dev, n)) }
}

/// [`matmul_t_skinny_wg`] with `stages` in flight (one of [`SKINNY_WG_STAGES`]).
///
/// # Safety
/// As [`matmul_t_skinny_wg`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn matmul_t_skinny_wg_built(
    dev: &CudaDevice,
    x: u64,
    w: u64,
    y: u64,
    t: usize,
    n: usize,
    k: usize,
    f32_out: bool,
    stages: usize,
) -> Result<(), CudaError> {
    if t == 0 || n == 0 {
        return Ok(());
    }
    if !skinny_wg_takes(dev, t, n, k) || !SKINNY_WG_STAGES.contains(&stages) {
        return Err(CudaError::Unavailable(format!(
            "the wgmma skinny product takes 1-{SKINNY_NORM_MAX_TOKENS} rows of K a multiple of 64, N a multiple of \
             64, on a Hopper GPU: not {t} x {k} by {n}"
        )));
    }
    let mut config = cfg(((n / SKINNY_NORM_ROWS) as u32, 1), 128);
    config.shared_mem_bytes = skinny_wg_smem_bytes(stages) as u32;
    launch!(@with true; dev, skinny_wg_kernel(stages), config, w, x, y, n as i32, k as i32, t as i32, f32_out as i32)
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
    dev.set_skinny_verified(false);
    if !dev.pdl_capable() {
        return Ok(Some("they need a Hopper or later GPU (bulk copies)".into()));
    }
    for &shape in shapes {
        let SkinnyShape { weight: w, n, k, slices, .. } = shape;
        let slices = slices.max(1);
        if !k.is_multiple_of(slices) || !skinny_takes(1, k / slices) {
            continue;
        }
        // Safety: the shape's weight per the contract.
        let (x, reference) = unsafe { cublaslt_reference(dev, shape)? };
        let f32_out = shape.f32_out || slices > 1;
        let elem = if f32_out { 4 } else { 2 };
        let few = dev.zeros::<u8>(slices * SKINNY_MAX_TOKENS * n * elem)?;
        for t in [1, 8, 9, 16] {
            let build = if t <= 8 { SkinnyBuild::B8 } else { SkinnyBuild::B16 };
            // Safety: `x` holds REFERENCE_ROWS rows of k and `few` was sized for 16 rows.
            unsafe { matmul_t_skinny(dev, x.ptr(), w, few.ptr(), t, n, k, f32_out, slices, build)? };
            let got = dev.read(&few, slices * t * n * elem)?;
            let (row_bytes, want_stride) = (t * n * elem, REFERENCE_ROWS * n * elem);
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

/// Rows of the cuBLASLt products the skinny kernels are checked against.
const REFERENCE_ROWS: usize = 64;

/// A seeded input of [`REFERENCE_ROWS`] rows for `shape` and cuBLASLt's batch-invariant product
/// of it (sliced as the shape says; f32 where it says or when sliced), as bytes.
///
/// # Safety
/// The shape's weight holds `[n, k]` bf16 on this device, 256-byte aligned.
unsafe fn cublaslt_reference(dev: &CudaDevice, shape: SkinnyShape) -> Result<(DevBuf<u16>, Vec<u8>), CudaError> {
    let SkinnyShape { weight: w, n, k, f32_out, slices } = shape;
    let slices = slices.max(1);
    let elem = if f32_out || slices > 1 { 4 } else { 2 };
    let x = dev.zeros::<u16>(REFERENCE_ROWS * k)?;
    let product = dev.zeros::<u8>(slices * REFERENCE_ROWS * n * elem)?;
    // Safety: the buffers were sized above for this shape; `w` per the contract.
    unsafe {
        preset_uniform(dev, x.ptr(), (REFERENCE_ROWS * k) as u64, 0x5eed ^ (n * 31 + k) as u64, 1.0)?;
        if slices > 1 {
            matmul_t_invariant_sliced(dev, x.ptr(), w, product.ptr(), REFERENCE_ROWS, n, k, slices)?;
        } else {
            matmul_t_invariant(dev, x.ptr(), w, product.ptr(), REFERENCE_ROWS, n, k, f32_out)?;
        }
    }
    let bytes = dev.read(&product, slices * REFERENCE_ROWS * n * elem)?;
    Ok((x, bytes))
}

/// A product [`matmul_t_skinny_norm`] serves, checked by [`verify_skinny_norm`].
#[derive(Clone, Copy, Debug)]
pub struct SkinnyNormShape {
    /// `[n, k]` bf16 on the device, 256-byte aligned.
    pub weight: u64,
    /// Output columns (rows of the weight).
    pub n: usize,
    /// Input columns (the hidden size).
    pub k: usize,
    /// The norm's weight: `k` bf16.
    pub norm_weight: u64,
    /// The model's RMSNorm epsilon.
    pub eps: f32,
    /// What is written.
    pub output: SkinnyNormOutput,
}

/// Checks on this GPU that [`matmul_t_skinny_norm`] gives the unfused path's bits for each
/// shape (seeded residual rows and deltas: [`super::add_rms_norm_b128`], then cuBLASLt's product
/// of 64 rows, then [`super::silu_mul`] where asked, against the fused kernel at 1, 2 and 8 rows,
/// both the output and the residual sum), and [`matmul_t_skinny_wg`] cuBLASLt's for each of
/// `plain` (unsliced) at 1, 2 and 8 rows, and lets batch-invariant steps of few tokens use them
/// if every one agrees ([`CudaDevice::invariant_fused_norm`]). Returns why not, if not. Needs
/// [`CudaDevice::enable_batch_invariant`].
///
/// # Safety
/// Each shape's weight holds `[n, k]` bf16 and its norm weight `k` bf16 on this device, 256-byte
/// aligned.
pub unsafe fn verify_skinny_norm(
    dev: &CudaDevice,
    shapes: &[SkinnyNormShape],
    plain: &[SkinnyShape],
) -> Result<Option<String>, CudaError> {
    const MANY: usize = REFERENCE_ROWS;
    dev.set_skinny_norm_verified(false);
    for &shape in plain {
        let SkinnyShape { weight, n, k, f32_out, .. } = shape;
        if !skinny_wg_serves(dev, 1, n, k) {
            // cuBLASLt keeps it.
            continue;
        }
        // Safety: the shape's weight per the contract.
        let (x, reference) = unsafe { cublaslt_reference(dev, SkinnyShape { slices: 1, ..shape })? };
        let elem = if f32_out { 4 } else { 2 };
        let few = dev.zeros::<u8>(SKINNY_NORM_MAX_TOKENS * n * elem)?;
        for t in [1, 2, SKINNY_NORM_MAX_TOKENS] {
            // Safety: `x` holds REFERENCE_ROWS rows of k; `few` was sized for 8 rows.
            unsafe { matmul_t_skinny_wg(dev, x.ptr(), weight, few.ptr(), t, n, k, f32_out)? };
            if dev.read(&few, t * n * elem)?[..] != reference[..t * n * elem] {
                return Ok(Some(format!("the wgmma product differs from cuBLASLt's bits at {t} rows x {k} by {n}")));
            }
        }
    }
    for &SkinnyNormShape { weight, n, k, norm_weight, eps, output } in shapes {
        if !skinny_norm_takes(dev, 1, n, k) {
            return Ok(Some(format!("it does not take a {k} by {n} product on this GPU")));
        }
        let out_cols = if output == SkinnyNormOutput::SiluMul { n / 2 } else { n };
        // Residual rows and deltas: seeded values, each a bf16 value (as the residual stream is).
        let mut seed = 0x9e37_79b9_7f4a_7c15u64 ^ (n * 131 + k) as u64;
        let mut next = move || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            f32::from_bits(((((seed >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0).to_bits()) & 0xffff_0000)
        };
        let x_host: Vec<f32> = (0..MANY * k).map(|_| next()).collect();
        let delta_host: Vec<u16> = (0..MANY * k).map(|_| (next().to_bits() >> 16) as u16).collect();
        let x = dev.upload(&x_host)?;
        let delta = dev.upload(&delta_host)?;
        let summed = dev.upload(&x_host)?;
        let normed = dev.zeros::<u16>(MANY * k)?;
        let product = dev.zeros::<u16>(MANY * n)?;
        let act = dev.zeros::<u16>(MANY * out_cols)?;
        let fused = dev.zeros::<u16>(SKINNY_NORM_MAX_TOKENS * out_cols)?;
        let fused_sum = dev.zeros::<f32>(SKINNY_NORM_MAX_TOKENS * k)?;
        // Safety: every buffer was sized above for these shapes; the weights per the contract.
        unsafe {
            let delta = super::ResidualDelta::Bf16(delta.ptr());
            super::add_rms_norm_b128(dev, summed.ptr(), delta, 0, norm_weight, normed.ptr(), MANY, k, eps)?;
            super::matmul_t_invariant(dev, normed.ptr(), weight, product.ptr(), MANY, n, k, false)?;
            if output == SkinnyNormOutput::SiluMul {
                super::silu_mul(dev, product.ptr(), act.ptr(), MANY, n / 2, false)?;
            }
        }
        let want = dev.read(if output == SkinnyNormOutput::SiluMul { &act } else { &product }, MANY * out_cols)?;
        let want_sum = dev.read(&summed, MANY * k)?;
        for t in [1, 2, SKINNY_NORM_MAX_TOKENS] {
            let product = NormedProduct {
                weight,
                n,
                k,
                x: x.ptr(),
                delta: delta.ptr(),
                x_out: fused_sum.ptr(),
                norm_weight,
                eps,
                y: fused.ptr(),
                output,
            };
            // Safety: as above.
            unsafe { matmul_t_skinny_norm(dev, &product, t)? };
            let got = dev.read(&fused, t * out_cols)?;
            let got_sum = dev.read(&fused_sum, t * k)?;
            if got[..] != want[..t * out_cols] {
                return Ok(Some(format!("it differs from the unfused path at {t} rows x {k} by {n} ({output:?})")));
            }
            if got_sum.iter().zip(&want_sum[..t * k]).any(|(a, b)| a.to_bits() != b.to_bits()) {
                return Ok(Some(format!("its residual sum differs from add_rms_norm_b128's at {t} rows x {k}")));
            }
        }
    }
    dev.set_skinny_norm_verified(true);
    Ok(None)
}
