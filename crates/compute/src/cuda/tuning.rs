//! Kernel choices that trade one kind of speed for another on a given GPU, built once (from
//! `--cuda-tune KEY=VALUE` flags) and fixed for the device's life. The defaults are the fastest
//! measured on an H200 (docs/PERFORMANCE.md); every other value computes the same numbers
//! except where a field says otherwise.

use std::fmt;

/// Tuning of the CUDA backend; see the module docs. [`CudaTuning::KEYS`] lists the keys
/// [`CudaTuning::set`] takes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaTuning {
    /// Launch every kernel with programmatic dependent launch (Hopper or later): each may start
    /// while the previous one finishes and waits in-kernel before touching its data. Off: no
    /// gain measured. Kernels that need it for their own overlap (the bulk o projection, the
    /// fused decode attention) use it either way.
    pub programmatic_launch: bool,
    /// The fused decode attention copies its first cached keys before waiting on the qkv
    /// projection (launched with programmatic dependent launch).
    pub attention_early: bool,
    /// Chunk buffers of the decode attention (1 or 2); `None`: chosen per launch by occupancy.
    pub attention_stages: Option<usize>,
    /// Decode attention over long contexts (split into key ranges, `attention_split_ranges`)
    /// reads each KV head once for its whole GQA group (one block scores every query head of
    /// the group); off: one block per query head, each reading the keys and values again. The
    /// same arithmetic per head either way (the outputs are equal).
    pub attention_split_group: bool,
    /// Key ranges a split decode attention launch may cut its tokens' contexts into, in all
    /// (a power of two from 1 to 128): a batch of `b` sequences cuts each context into at most
    /// this / `b` (rounded up to a power of two) ranges; 1 never splits. More ranges spread a
    /// small batch's long contexts over more blocks. Changes the order of the sums (the
    /// outputs differ in the last bits).
    pub attention_split_ranges: usize,
    /// Keys of a split range before a context gets another (a multiple of 64).
    pub attention_split_keys: usize,
    /// Split decode attention with whole GQA groups a block (head sizes 64 and 128) on tensor
    /// cores (`attention_mma_*`; RoPE then in its own kernel); off: the row kernel. Other bits
    /// (P rounded to bf16, or to f16 over an FP8 cache).
    pub attention_mma: bool,
    /// Weight rows of each bulk o-projection block copied before it waits on the attention
    /// (0 to 8; the rest after).
    pub bulk_early_rows: usize,
    /// Fused decode projections on tensor cores instead of FMA. Changes the order of the sums
    /// (the outputs differ in the last bits).
    pub tensor_core_projections: bool,
    /// The o projection of fused decode steps in the bulk build (its weights stream into
    /// shared memory while the attention runs; Hopper or later, o's input a multiple of 256
    /// wide). Off: the plain build, whose sums come in another order (the outputs differ in the
    /// last bits).
    pub bulk_o_projection: bool,
    /// Batch-invariant products of at most [`crate::cuda::ops::SKINNY_MAX_TOKENS`] rows on the
    /// skinny kernels (our own mma.sync chains, which give cuBLASLt's bits: checked at load on
    /// the model's weights, and by `cuda_kernels`); off: cuBLASLt at every row count. The same
    /// bits either way. Off by default: slower than cuBLASLt on an H200 (docs/PERFORMANCE.md).
    pub invariant_skinny: bool,
    /// Stages of 256 columns each skinny block keeps in flight (2, 4 or 8): more hide more
    /// memory latency, fewer let more blocks share an SM. The same bits either way.
    pub skinny_stages: usize,
    /// Batch-invariant o and down projections (the long-K products) are cut into slices of at
    /// most this many columns (`ops::invariant_slices`), whose partial products the residual
    /// add sums in order: a one-row product then runs several short chains instead of one long
    /// one. 0 (the default): unsliced, faster on an H200 at every batch measured
    /// (docs/PERFORMANCE.md). Changes the outputs' last bits (another order of sums); batch
    /// invariant either way.
    pub invariant_slice_cols: usize,
    /// Groups of layers a prefill step's KV is fenced in (1 to 64, at most one a layer): a
    /// connector moves each group's KV while the later layers compute, so after the last layer
    /// only the last group is left to move; more groups make that smaller, each adding an event
    /// and its copies. 8: on an H200 (Qwen3-4B, tcp) half of 4's wait after the last layer, and
    /// the same over cuda-ipc (docs/PERFORMANCE.md). The same bits either way.
    pub kv_fence_groups: usize,
    /// The last two of those groups are cut into halves, then halves of what is left, down to
    /// one layer (Qwen3-4B, 8 groups: 5 x 6, 3, 2, 1): what is left to move after the last layer
    /// then is what its last few layers wrote, while the first groups still start as early.
    /// On (the default): on an H200 (Qwen3-4B, tcp, 8 streams) the wait after the last layer at
    /// 4k and 8k tokens fell from 4.3 / 4.1 ms to 2.8 / 2.6 (docs/PERFORMANCE.md).
    pub kv_fence_taper: bool,
    /// Which prefill attention runs where Hopper's warpgroup MMAs take the shape (sm_90a, head
    /// size 128, an even number of query heads per KV head, not batch invariant). The builds
    /// sum in other orders (the outputs differ in the last bits).
    pub wgmma_prefill: WgmmaPrefill,
    /// Batch-invariant attention on Hopper's warpgroup MMAs (`flash_prefill_wgmma_packed_*`:
    /// the packed build's key ranges on the ping-pong kernel) where the Hopper prefill runs
    /// (`wgmma_prefill` not 0); off: the mma.sync packed kernel every GPU runs. Other bits than
    /// the mma.sync build's (batch invariant either way).
    pub invariant_wgmma: bool,
    /// With `invariant_wgmma`: a sequence of at most 16 / group tokens in a step (a decode
    /// token) goes to the narrow kernel (`flash_decode_narrow_*`: the Hopper build's bits on
    /// mma.sync, 16 rows an item) instead of a 128-row item of the Hopper kernel. Off: every
    /// item to the Hopper kernel (the same bits, more rows computed for nothing).
    pub invariant_narrow: bool,
    /// With `invariant_wgmma`: the Hopper kernel's folded ranges in global memory (a slot per
    /// SM, L2-resident), so it keeps three K/V stages as the default build does; off: in shared
    /// memory, with two. The same bits either way. On (the default): prefill of 4096 tokens
    /// (qwen3-4b, H100) 61.1 ms against 66.0, the default build's 61.1.
    pub invariant_fold_l2: bool,
    /// Batch-invariant steps of at most 8 tokens add the residual and take the RMSNorm inside
    /// their qkv and gate/up products, and SiLU in the gate/up product's epilogue
    /// (`ops::matmul_t_skinny_norm`, on Hopper's warpgroup MMAs: three launches a layer fewer),
    /// and run their other products wide enough to fill the GPU (the head) on the same chains
    /// without the norm (`ops::matmul_t_skinny_wg`), once verified at load to give the unfused
    /// path's bits;
    /// every norm of the model then sums in that kernel's order (`ops::add_rms_norm_b128`).
    /// Batch invariant either way (the last bits differ between on and off).
    pub invariant_fused_norm: bool,
    /// The build of those fused products, (stages, warpgroups a block) of
    /// `ops::SKINNY_NORM_BUILDS`; None: chosen by shape (`ops::matmul_t_skinny_norm`). The same
    /// bits either way.
    pub fused_norm_build: Option<(usize, usize)>,
    /// The stages in flight of those products without a norm (one of
    /// `ops::SKINNY_WG_STAGES`), which then serve the narrow ones too (o and down); None:
    /// chosen by shape, the wide products only (`ops::skinny_wg_serves`). The same bits either way.
    pub wg_product_stages: Option<usize>,
    /// FP8 weights' products of more than 16 rows (prefill) with the activations quantized to
    /// FP8 too (one scale per row and 128 columns) on cuBLASLt's block-scaled GEMM, at FP8
    /// tensor-core rate; off: through a bf16 copy of the weight and cuBLAS. Changes the outputs
    /// (the activations are rounded to e4m3, as vLLM's block-scaled FP8 path rounds them). On:
    /// on an H200, qwen3-4b's prefill of 8192 tokens 117.0 ms against 140.6 through the copy,
    /// batch 64 3.66 ms against 6.33 (docs/PERFORMANCE.md).
    pub fp8_block_gemm: bool,
    /// FP8 weights' decode steps of up to 8 tokens on the fused decode projections (the
    /// RMSNorm, SiLU and residual add folded into FP8 tensor-core GEMVs, `_fp8` kernels); off:
    /// separate products ([`super::ops::matmul_t_fp8`]) and norm kernels.
    pub fp8_fused_decode: bool,
    /// The build of those fused FP8 products, an index into `ops::FP8_GEMV_BUILDS`
    /// (kernels/fp8.cu): 0 converts each e4m3 pair to a bf16 pair through f32 and multiplies in
    /// bf16, three blocks an SM; 1 converts to f16 pairs in one instruction and multiplies in
    /// f16 (the inputs scaled into f16 by a power of two per row: the same sums, bit for bit),
    /// two blocks an SM; 2 as 1 with two steps of weights in flight a warp (other sums); 3
    /// tiles of 8 weight rows instead of 16 (products of few rows spread evenly). On an H100,
    /// Qwen3-32B's decode step at batch 1: 15.738 / 13.783 / 13.928 / 16.329 ms (3 another call:
    /// its gate/up read at 2051 GB/s against build 1's 2832, its o and down no faster); with
    /// the row groups shared evenly over the blocks (`ops::mma_grid`), 1 / 2: 13.253 / 13.530.
    pub fp8_gemv_build: u8,
    /// Which of cuBLASLt's heuristic candidates (best first, up to 8) the block-scaled FP8
    /// products take: 0, the first, unless measured otherwise (`cuda_kernels`'
    /// `fp8_block_gemm` test times each).
    pub fp8_gemm_algo: u8,
    /// Steps of many rows over FP8 weights round SiLU-and-multiply's output to e4m3 in the
    /// same kernel (`ops::silu_mul_fp8_rows`: the bytes and scales of `silu_mul` then
    /// `fp8_quantize_rows`, without the bf16 rows between them) for down's block-scaled
    /// product. On: Qwen3-32B's prefill of 8192 tokens 663.1 ms against 684.9 (H100).
    pub fp8_fused_act: bool,
    /// Steps of many rows over FP8 weights round the residual add + RMSNorm's output to e4m3
    /// in the same kernel (`ops::add_rms_norm_fp8_rows`: the bytes and scales of
    /// `add_rms_norm` then `fp8_quantize_rows`) for qkv's and gate/up's block-scaled products.
    /// On: Qwen3-32B's prefill of 8192 tokens 656.2 ms against 663.1 with `fp8_fused_act`
    /// alone (H100).
    pub fp8_fused_norm: bool,
    /// Steps of 17 to 64 rows over FP8 weights multiply their FP8-rounded activations on a
    /// hand-written product instead of cuBLASLt's block-scaled GEMM, whose tiles leave most of
    /// the GPU idle on products of few rows (`ops::matmul_t_fp8_skinny`: a block for every
    /// multiprocessor, the residual's products cut in K slices it sums). 0: cuBLASLt. 1:
    /// `gemm_fp8_skinny`, e4m3 `mma.sync`: measured slower on an H100 (Qwen3-32B at 64 rows: qkv
    /// 69.6 us against cuBLASLt's 24.7, down in 3 slices 115.4 against 57.9, gate/up 261.9
    /// against 99.3; the decode step 33.8 ms against 16.1), as Hopper has no e4m3 `mma.sync`:
    /// ptxas lowers each to conversions of both operands to f16 (`F2FP.F16.E4M3.UNPACK_B`) and
    /// two f16 MMAs; kept as the comparison. 2: `gemm_fp8_wg`, Hopper's warpgroup FP8 MMAs
    /// (native `QGMMA`; H100: right, 1.3-1.7x cuBLASLt's time before its weight scales came
    /// through the ring). 3: the same with a step's MMAs running while the previous step's
    /// are scaled, and 32-token tiles up to 32 rows (`gemm_fp8_wg_t32` / `_t64`).
    pub fp8_skinny: u8,
}

/// The prefill attention builds on Hopper's warpgroup MMAs (`--cuda-tune wgmma_prefill=0|1|2|3`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WgmmaPrefill {
    /// 0: the mma.sync kernel every GPU runs.
    Off,
    /// 1: `flash_prefill_wgmma_hd128`, two warpgroups (two query heads of one KV head) that copy
    /// each K/V tile together and then multiply it: on an H100, 1.8-1.9x the mma.sync kernel's
    /// rate at 4k-32k tokens (docs/PERFORMANCE.md).
    Lockstep,
    /// 2: `flash_prefill_wgmma_pp_hd128`, FlashAttention-3's layout: a producer warpgroup fills
    /// a ring of three K/V stages with its copies; the two consumer warpgroups take turns
    /// issuing both products of a step (S of tile k, P V of tile k - 1), each one's softmax
    /// under its own P V and the other's products; longest items first. On an H100 1.3-1.7x the
    /// lockstep build's rate at 4k-32k tokens.
    PingPong,
    /// 3 (default): `flash_prefill_wgmma_tma_hd128`, the ping-pong build whose K/V tiles the
    /// TMA unit brings (four boxes a cache block, issued by one warp) instead of the producers'
    /// copies, but for each item's tile reaching past its context. On an H100 1.1-1.2x build
    /// 2's rate at 16k-32k tokens (506 TFLOP/s at 16k). Block sizes that are not a power of two
    /// of at least 8 get build 2.
    PingPongTma,
}

impl WgmmaPrefill {
    const ALL: [WgmmaPrefill; 4] =
        [WgmmaPrefill::Off, WgmmaPrefill::Lockstep, WgmmaPrefill::PingPong, WgmmaPrefill::PingPongTma];

    /// Its `--cuda-tune wgmma_prefill` value.
    pub fn value(self) -> &'static str {
        match self {
            WgmmaPrefill::Off => "0",
            WgmmaPrefill::Lockstep => "1",
            WgmmaPrefill::PingPong => "2",
            WgmmaPrefill::PingPongTma => "3",
        }
    }
}

/// Where the KV fences of a forward over `layers` layers fall: each group's end (exclusive),
/// in layer order (see [`CudaTuning::kv_fence_groups`] and [`CudaTuning::kv_fence_taper`]).
pub fn kv_fence_ends(layers: usize, groups: usize, taper: bool) -> Vec<usize> {
    let per_group = layers.div_ceil(groups.max(1)).max(1);
    let mut ends: Vec<usize> = (1..=layers).filter(|&l| l % per_group == 0 || l == layers).collect();
    if taper && ends.len() > 1 {
        ends.truncate(ends.len() - 2);
        let mut at = ends.last().copied().unwrap_or(0);
        while at < layers {
            at += (layers - at).div_ceil(2);
            ends.push(at);
        }
    }
    ends
}

impl Default for CudaTuning {
    fn default() -> Self {
        Self {
            programmatic_launch: false,
            attention_early: true,
            attention_stages: None,
            attention_split_group: true,
            attention_split_ranges: 32,
            attention_split_keys: 256,
            attention_mma: true,
            bulk_early_rows: 8,
            tensor_core_projections: false,
            bulk_o_projection: true,
            invariant_skinny: false,
            skinny_stages: 8,
            invariant_slice_cols: 0,
            kv_fence_groups: 8,
            kv_fence_taper: true,
            wgmma_prefill: WgmmaPrefill::PingPongTma,
            invariant_wgmma: false,
            invariant_narrow: true,
            invariant_fold_l2: true,
            invariant_fused_norm: false,
            fused_norm_build: None,
            wg_product_stages: None,
            fp8_block_gemm: true,
            fp8_fused_decode: true,
            fp8_gemv_build: 1,
            fp8_gemm_algo: 0,
            fp8_fused_act: true,
            fp8_fused_norm: true,
            fp8_skinny: 0,
        }
    }
}

impl CudaTuning {
    /// The keys [`CudaTuning::set`] takes, with what values they take.
    pub const KEYS: &'static [(&'static str, &'static str)] = &[
        ("programmatic_launch", "0|1 (default 0)"),
        ("attention_early", "0|1 (default 1)"),
        ("attention_stages", "auto|1|2 (default auto)"),
        ("attention_split_group", "0|1 (default 1)"),
        ("attention_split_ranges", "1|2|4|..|128 (default 32)"),
        ("attention_split_keys", "a multiple of 64 (default 256)"),
        ("attention_mma", "0|1 (default 1)"),
        ("bulk_early_rows", "0..=8 (default 8)"),
        ("tensor_core_projections", "0|1 (default 0)"),
        ("bulk_o_projection", "0|1 (default 1)"),
        ("invariant_skinny", "0|1 (default 0)"),
        ("skinny_stages", "2|4|8 (default 8)"),
        ("invariant_slice_cols", "0 or a multiple of 64 (default 0)"),
        ("kv_fence_groups", "1..=64 (default 8)"),
        ("kv_fence_taper", "0|1 (default 1)"),
        ("wgmma_prefill", "0|1|2|3 (default 3)"),
        ("invariant_wgmma", "0|1 (default 0)"),
        ("invariant_narrow", "0|1 (default 1)"),
        ("invariant_fold_l2", "0|1 (default 1)"),
        ("invariant_fused_norm", "0|1 (default 0)"),
        ("fused_norm_build", "auto|4x1|8x1|4x2|3x2 (default auto)"),
        ("wg_product_stages", "auto|8|16|24 (default auto)"),
        ("fp8_block_gemm", "0|1 (default 1)"),
        ("fp8_fused_decode", "0|1 (default 1)"),
        ("fp8_gemv_build", "0|1|2|3 (default 1)"),
        ("fp8_gemm_algo", "0..=7 (default 0)"),
        ("fp8_fused_act", "0|1 (default 1)"),
        ("fp8_fused_norm", "0|1 (default 1)"),
        ("fp8_skinny", "0|1|2|3 (default 0)"),
    ];

    /// Sets `key` to `value`; the error names the key and what it takes.
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), String> {
        let takes = || Self::KEYS.iter().find(|(k, _)| *k == key).map(|(_, v)| *v).unwrap_or("a known key");
        let bad = || format!("--cuda-tune {key}={value}: {key} takes {}", takes());
        let flag = || match value {
            "1" | "true" | "on" => Ok(true),
            "0" | "false" | "off" => Ok(false),
            _ => Err(bad()),
        };
        match key {
            "programmatic_launch" => self.programmatic_launch = flag()?,
            "attention_early" => self.attention_early = flag()?,
            "attention_stages" => {
                self.attention_stages = match value {
                    "auto" => None,
                    "1" => Some(1),
                    "2" => Some(2),
                    _ => return Err(bad()),
                }
            }
            "attention_split_group" => self.attention_split_group = flag()?,
            "attention_mma" => self.attention_mma = flag()?,
            "attention_split_ranges" => {
                self.attention_split_ranges =
                    value.parse().ok().filter(|n: &usize| n.is_power_of_two() && *n <= 128).ok_or_else(bad)?;
            }
            "attention_split_keys" => {
                self.attention_split_keys =
                    value.parse().ok().filter(|n: &usize| *n > 0 && n.is_multiple_of(64)).ok_or_else(bad)?;
            }
            "bulk_early_rows" => {
                self.bulk_early_rows = value.parse().ok().filter(|&n| n <= 8).ok_or_else(bad)?;
            }
            "tensor_core_projections" => self.tensor_core_projections = flag()?,
            "bulk_o_projection" => self.bulk_o_projection = flag()?,
            "invariant_skinny" => self.invariant_skinny = flag()?,
            "skinny_stages" => {
                self.skinny_stages = value.parse().ok().filter(|n| [2, 4, 8].contains(n)).ok_or_else(bad)?;
            }
            "invariant_slice_cols" => {
                self.invariant_slice_cols =
                    value.parse().ok().filter(|n: &usize| n.is_multiple_of(64)).ok_or_else(bad)?;
            }
            "kv_fence_groups" => {
                self.kv_fence_groups = value.parse().ok().filter(|n| (1..=64).contains(n)).ok_or_else(bad)?;
            }
            "kv_fence_taper" => self.kv_fence_taper = flag()?,
            "invariant_wgmma" => self.invariant_wgmma = flag()?,
            "invariant_narrow" => self.invariant_narrow = flag()?,
            "invariant_fold_l2" => self.invariant_fold_l2 = flag()?,
            "invariant_fused_norm" => self.invariant_fused_norm = flag()?,
            "fused_norm_build" => {
                self.fused_norm_build = match value {
                    "auto" => None,
                    "4x1" => Some((4, 1)),
                    "8x1" => Some((8, 1)),
                    "4x2" => Some((4, 2)),
                    "3x2" => Some((3, 2)),
                    _ => return Err(bad()),
                }
            }
            "wg_product_stages" => {
                self.wg_product_stages = match value {
                    "auto" => None,
                    _ => Some(value.parse().ok().filter(|n| [8, 16, 24].contains(n)).ok_or_else(bad)?),
                }
            }
            "fp8_block_gemm" => self.fp8_block_gemm = flag()?,
            "fp8_fused_decode" => self.fp8_fused_decode = flag()?,
            "fp8_fused_act" => self.fp8_fused_act = flag()?,
            "fp8_fused_norm" => self.fp8_fused_norm = flag()?,
            "fp8_skinny" => {
                self.fp8_skinny = value.parse().ok().filter(|b| *b <= 3).ok_or_else(bad)?;
            }
            "fp8_gemm_algo" => {
                self.fp8_gemm_algo = value.parse().ok().filter(|b| *b <= 7).ok_or_else(bad)?;
            }
            "fp8_gemv_build" => {
                self.fp8_gemv_build = value.parse().ok().filter(|b| *b <= 3).ok_or_else(bad)?;
            }
            "wgmma_prefill" => {
                self.wgmma_prefill = WgmmaPrefill::ALL.into_iter().find(|b| b.value() == value).ok_or_else(bad)?
            }
            _ => {
                let keys: Vec<&str> = Self::KEYS.iter().map(|(k, _)| *k).collect();
                return Err(format!("--cuda-tune {key}={value}: unknown key (known: {})", keys.join(", ")));
            }
        }
        Ok(())
    }

    /// Applies `KEY=VALUE` settings in order.
    pub fn from_settings<S: AsRef<str>>(settings: &[S]) -> Result<Self, String> {
        let mut tuning = Self::default();
        for s in settings {
            let s = s.as_ref();
            let (key, value) = s.split_once('=').ok_or_else(|| format!("--cuda-tune {s}: expected KEY=VALUE"))?;
            tuning.set(key.trim(), value.trim())?;
        }
        Ok(tuning)
    }
}

/// The settings that differ from the defaults, as `key=value` (for logs); empty for defaults.
impl fmt::Display for CudaTuning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = Self::default();
        let b = |v: bool| if v { "1" } else { "0" };
        let mut parts = Vec::new();
        if self.programmatic_launch != d.programmatic_launch {
            parts.push(format!("programmatic_launch={}", b(self.programmatic_launch)));
        }
        if self.attention_early != d.attention_early {
            parts.push(format!("attention_early={}", b(self.attention_early)));
        }
        if let Some(n) = self.attention_stages {
            parts.push(format!("attention_stages={n}"));
        }
        if self.attention_split_group != d.attention_split_group {
            parts.push(format!("attention_split_group={}", b(self.attention_split_group)));
        }
        if self.attention_split_ranges != d.attention_split_ranges {
            parts.push(format!("attention_split_ranges={}", self.attention_split_ranges));
        }
        if self.attention_split_keys != d.attention_split_keys {
            parts.push(format!("attention_split_keys={}", self.attention_split_keys));
        }
        if self.attention_mma != d.attention_mma {
            parts.push(format!("attention_mma={}", b(self.attention_mma)));
        }
        if self.bulk_early_rows != d.bulk_early_rows {
            parts.push(format!("bulk_early_rows={}", self.bulk_early_rows));
        }
        if self.tensor_core_projections != d.tensor_core_projections {
            parts.push(format!("tensor_core_projections={}", b(self.tensor_core_projections)));
        }
        if self.bulk_o_projection != d.bulk_o_projection {
            parts.push(format!("bulk_o_projection={}", b(self.bulk_o_projection)));
        }
        if self.invariant_skinny != d.invariant_skinny {
            parts.push(format!("invariant_skinny={}", b(self.invariant_skinny)));
        }
        if self.skinny_stages != d.skinny_stages {
            parts.push(format!("skinny_stages={}", self.skinny_stages));
        }
        if self.invariant_slice_cols != d.invariant_slice_cols {
            parts.push(format!("invariant_slice_cols={}", self.invariant_slice_cols));
        }
        if self.kv_fence_groups != d.kv_fence_groups {
            parts.push(format!("kv_fence_groups={}", self.kv_fence_groups));
        }
        if self.kv_fence_taper != d.kv_fence_taper {
            parts.push(format!("kv_fence_taper={}", b(self.kv_fence_taper)));
        }
        if self.wgmma_prefill != d.wgmma_prefill {
            parts.push(format!("wgmma_prefill={}", self.wgmma_prefill.value()));
        }
        for (key, on, default) in [
            ("invariant_wgmma", self.invariant_wgmma, d.invariant_wgmma),
            ("invariant_narrow", self.invariant_narrow, d.invariant_narrow),
            ("invariant_fold_l2", self.invariant_fold_l2, d.invariant_fold_l2),
            ("invariant_fused_norm", self.invariant_fused_norm, d.invariant_fused_norm),
        ] {
            if on != default {
                parts.push(format!("{key}={}", b(on)));
            }
        }
        if let Some((stages, groups)) = self.fused_norm_build {
            parts.push(format!("fused_norm_build={stages}x{groups}"));
        }
        if let Some(stages) = self.wg_product_stages {
            parts.push(format!("wg_product_stages={stages}"));
        }
        for (key, on, default) in [
            ("fp8_block_gemm", self.fp8_block_gemm, d.fp8_block_gemm),
            ("fp8_fused_decode", self.fp8_fused_decode, d.fp8_fused_decode),
            ("fp8_fused_act", self.fp8_fused_act, d.fp8_fused_act),
            ("fp8_fused_norm", self.fp8_fused_norm, d.fp8_fused_norm),
        ] {
            if on != default {
                parts.push(format!("{key}={}", b(on)));
            }
        }
        if self.fp8_gemm_algo != d.fp8_gemm_algo {
            parts.push(format!("fp8_gemm_algo={}", self.fp8_gemm_algo));
        }
        if self.fp8_skinny != d.fp8_skinny {
            parts.push(format!("fp8_skinny={}", self.fp8_skinny));
        }
        if self.fp8_gemv_build != d.fp8_gemv_build {
            parts.push(format!("fp8_gemv_build={}", self.fp8_gemv_build));
        }
        write!(f, "{}", parts.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_parse_and_print_back_and_bad_ones_name_the_key() {
        let t =
            CudaTuning::from_settings(&["attention_stages=2", "bulk_early_rows = 4", "programmatic_launch=1"]).unwrap();
        assert_eq!(t.attention_stages, Some(2));
        assert_eq!(t.bulk_early_rows, 4);
        assert!(t.programmatic_launch);
        assert_eq!(t.to_string(), "programmatic_launch=1,attention_stages=2,bulk_early_rows=4");
        assert_eq!(CudaTuning::from_settings(&t.to_string().split(',').collect::<Vec<_>>()).unwrap(), t);
        assert_eq!(CudaTuning::default().to_string(), "");
        let unknown = CudaTuning::from_settings(&["ring=1"]).unwrap_err();
        assert!(unknown.contains("unknown key") && unknown.contains("bulk_o_projection"), "{unknown}");
        let range = CudaTuning::from_settings(&["bulk_early_rows=9"]).unwrap_err();
        assert!(range.contains("0..=8"), "{range}");
        assert!(CudaTuning::from_settings(&["attention_early"]).unwrap_err().contains("KEY=VALUE"));
        assert!(CudaTuning::from_settings(&["attention_stages=3"]).is_err());
        assert!(CudaTuning::from_settings(&["skinny_stages=6"]).unwrap_err().contains("2|4|8"));
        let fused = CudaTuning::from_settings(&["invariant_wgmma=1", "invariant_fused_norm=1", "fused_norm_build=4x2"])
            .unwrap();
        assert_eq!(fused.to_string(), "invariant_wgmma=1,invariant_fused_norm=1,fused_norm_build=4x2");
        assert!(CudaTuning::from_settings(&["fused_norm_build=5x1"]).unwrap_err().contains("4x1|8x1"));
        let wg = CudaTuning::from_settings(&["wg_product_stages=16"]).unwrap();
        assert_eq!(wg.wg_product_stages, Some(16));
        assert_eq!(wg.to_string(), "wg_product_stages=16");
        assert!(CudaTuning::from_settings(&["wg_product_stages=12"]).unwrap_err().contains("8|16|24"));
        assert_eq!(CudaTuning::from_settings(&fused.to_string().split(',').collect::<Vec<_>>()).unwrap(), fused);
        let act = CudaTuning::from_settings(&["fp8_fused_act=0"]).unwrap();
        assert_eq!((act.fp8_fused_act, act.to_string().as_str()), (false, "fp8_fused_act=0"));
        let norm = CudaTuning::from_settings(&["fp8_fused_norm=0"]).unwrap();
        assert_eq!((norm.fp8_fused_norm, norm.to_string().as_str()), (false, "fp8_fused_norm=0"));
        let fp8 = CudaTuning::from_settings(&["fp8_gemv_build=2"]).unwrap();
        assert_eq!((fp8.fp8_gemv_build, fp8.to_string().as_str()), (2, "fp8_gemv_build=2"));
        assert!(CudaTuning::from_settings(&["fp8_gemv_build=4"]).unwrap_err().contains("0|1|2|3"));
        let groups = CudaTuning::from_settings(&["kv_fence_groups=12"]).unwrap();
        assert_eq!((groups.kv_fence_groups, groups.to_string().as_str()), (12, "kv_fence_groups=12"));
        assert!(CudaTuning::from_settings(&["kv_fence_groups=0"]).unwrap_err().contains("1..=64"));
        // Every prefill build by its value, printed back (the bench's record of what ran).
        for (value, build) in [("0", WgmmaPrefill::Off), ("1", WgmmaPrefill::Lockstep), ("2", WgmmaPrefill::PingPong)] {
            let t = CudaTuning::from_settings(&[&format!("wgmma_prefill={value}")]).unwrap();
            assert_eq!((t.wgmma_prefill, t.to_string()), (build, format!("wgmma_prefill={value}")));
        }
        assert_eq!(CudaTuning::from_settings(&["wgmma_prefill=3"]).unwrap(), CudaTuning::default());
        assert!(CudaTuning::from_settings(&["wgmma_prefill=4"]).unwrap_err().contains("0|1|2|3"));
    }

    #[test]
    fn fences_fall_every_group_and_taper_toward_the_last_layer() {
        assert_eq!(kv_fence_ends(36, 8, false), [5, 10, 15, 20, 25, 30, 35, 36]);
        assert_eq!(kv_fence_ends(36, 8, true), [5, 10, 15, 20, 25, 30, 33, 35, 36]);
        assert_eq!(kv_fence_ends(28, 8, true), [4, 8, 12, 16, 20, 24, 26, 27, 28]);
        assert_eq!(kv_fence_ends(28, 8, false), [4, 8, 12, 16, 20, 24, 28]);
        assert_eq!(kv_fence_ends(4, 1, false), [4]);
        assert_eq!(kv_fence_ends(4, 1, true), [4]);
        assert_eq!(kv_fence_ends(4, 64, true), [1, 2, 3, 4]);
    }
}
