//! Prefill attention over the paged cache on tensor cores: the mma.sync builds (default,
//! packed for batch-invariant serving, split for long decode contexts) and the Hopper builds on
//! warpgroup MMAs (default, and packed and split as well); the kernels are in
//! kernels/attention.cu.

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::{cfg, launch_params, launch_programmatic, AttnMeta, AttnShape, QkvRope, RawArg};
use crate::cuda::{CudaDevice, CudaError, WgmmaPrefill};

/// Whether the tensor-core prefill kernel takes this head size.
pub fn flash_supported(head_dim: usize) -> bool {
    matches!(head_dim, 64 | 128)
}

/// Sequence tables for the prefill kernel.
#[derive(Clone, Copy, Debug)]
pub struct PrefillSeqs {
    /// `[2 * items]` (sequence, first query of the 64-query tile).
    pub work: u64,
    /// Work items.
    pub num_items: usize,
    /// `[seq]` first token in the batch.
    pub seq_tok: u64,
    /// `[seq]` tokens in the batch.
    pub seq_len: u64,
    /// `[seq]` position of the first token.
    pub seq_pos: u64,
    /// The packed build (batch-invariant serving): work items of [`flash_packed_tokens`]
    /// tokens, one block per KV head and its group of query heads.
    pub packed: bool,
    /// The last `narrow` work items are narrow ones (each a whole sequence of at most
    /// [`narrow_tokens`] tokens, from its first): the packed Hopper build gives them to its
    /// narrow kernel. 0 where [`narrow_tokens`] is.
    pub narrow: usize,
    /// Device scratch of [`WGMMA_FOLD_SCRATCH_FLOATS`] f32 where the packed Hopper build keeps
    /// its folded ranges' sums (then three K/V stages fit, as in the default build); 0: in shared
    /// memory, with two. The same bits either way.
    pub fold_scratch: u64,
}

/// f32 elements of [`PrefillSeqs::fold_scratch`]: a slot of two warpgroups' 64 x 128 sums for
/// each SM a block may run on (WG_FOLD_SLOTS, more than any Hopper GPU's SM ids).
pub const WGMMA_FOLD_SCRATCH_FLOATS: usize = 256 * 2 * 128 * 64;

/// Keys per range of the packed prefill kernel's softmax (FA_RANGE in kernels/attention.cu):
/// each range's sums start afresh and ranges fold in key order, so a long context's ranges
/// may be worked by separate blocks ([`FlashSplit`]) with the same result.
pub const FLASH_RANGE_KEYS: usize = 256;

/// Keys per range of the packed Hopper build (WG_RANGE: eight 128-key tiles, so that its fold
/// through shared memory comes once in eight tiles).
pub const WGMMA_RANGE_KEYS: usize = 1024;

/// Keys per softmax range of the packed build that serves a model: the Hopper build's
/// ([`wgmma_packed_takes`]) or the mma.sync one's. A split decode step's ranges
/// ([`FlashSplit::max_ranges`]) count in these.
pub fn flash_range_keys(hopper: bool) -> usize {
    if hopper {
        WGMMA_RANGE_KEYS
    } else {
        FLASH_RANGE_KEYS
    }
}

/// Key ranges ([`FLASH_RANGE_KEYS`]) of the packed prefill kernel spread over blocks: for
/// decode steps of a few tokens with long contexts, where one block per KV head walking the
/// whole context leaves the device idle. Only for steps whose work items are one token each.
#[derive(Clone, Copy, Debug)]
pub struct FlashSplit {
    /// `[tokens][heads][max_ranges][head_dim + 2]` f32 scratch ([`flash_split_floats`]).
    pub part: u64,
    /// Blocks per work item and KV head (the launch's grid z); block z takes ranges z, z +
    /// blocks, ...
    pub blocks: usize,
    /// Ranges the scratch holds per token and head: at least every token's context over the
    /// build's range ([`flash_range_keys`]).
    pub max_ranges: usize,
}

/// f32 elements of [`FlashSplit::part`] for `tokens` tokens with contexts up to `max_positions`.
pub fn flash_split_floats(tokens: usize, num_heads: usize, head_dim: usize, max_positions: usize) -> usize {
    tokens * num_heads * max_positions.div_ceil(FLASH_RANGE_KEYS) * (head_dim + 2)
}

/// Tokens one work item of the packed prefill kernel covers: its rows (64, or 128 in the Hopper
/// build, `hopper`: [`wgmma_packed_takes`]) hold that many tokens' worth of a KV head's query
/// heads (`group` = query heads per KV head, at most the rows).
pub fn flash_packed_tokens(group: usize, hopper: bool) -> usize {
    let rows = if hopper { 2 * FLASH_ROWS } else { FLASH_ROWS };
    (rows / group.max(1)).max(1)
}

/// Whether the packed prefill attention (batch-invariant serving) runs on Hopper's warpgroup
/// MMAs for this model on `dev` ([`flash_prefill_wgmma_packed`]): an sm_90a GPU tuned so
/// (`invariant_wgmma`, with the Hopper prefill not tuned off), head size 128, at most 128 query
/// heads per KV head. Its work items then hold [`flash_packed_tokens`]`(group, true)` tokens.
pub fn wgmma_packed_takes(dev: &CudaDevice, num_heads: usize, num_kv_heads: usize, head_dim: usize) -> bool {
    let group = num_heads / num_kv_heads.max(1);
    dev.wgmma_capable()
        && dev.tuning().invariant_wgmma
        && dev.tuning().wgmma_prefill != WgmmaPrefill::Off
        && head_dim == 128
        && num_kv_heads > 0
        && num_heads == group * num_kv_heads
        && group <= 2 * FLASH_ROWS
}

/// Rows of a narrow work item of the packed Hopper build ([`narrow_tokens`]).
pub const NARROW_ROWS: usize = 16;

/// Tokens a sequence may bring to a step and still be one narrow work item of the packed Hopper
/// build (`16 / group`: a decode token's query heads, and a few tokens' with small groups): its
/// narrow kernel gives them the 128-row kernel's bits on mma.sync with a sixteenth of the rows,
/// where a decode token would fill a few of the 128. Where [`wgmma_packed_takes`], the group is at
/// most 16 and `invariant_narrow` is tuned on; else 0 (no item is narrow).
pub fn narrow_tokens(dev: &CudaDevice, num_heads: usize, num_kv_heads: usize, head_dim: usize) -> usize {
    let group = num_heads / num_kv_heads.max(1);
    if wgmma_packed_takes(dev, num_heads, num_kv_heads, head_dim) && dev.tuning().invariant_narrow {
        NARROW_ROWS / group.max(1)
    } else {
        0
    }
}

/// Dynamic shared memory of the narrow kernel with `stages` stages (WN_FIXED_BYTES + stages x
/// WN_STAGE_BYTES in kernels/attention.cu): P of a tile's 16 rows, the warps' row maxima and the
/// pairs' sums, then per stage a 128-key K and V tile (rows padded to 136).
pub fn narrow_smem_bytes(stages: u32) -> u32 {
    16 * 136 * 2 + 8 * 16 * 4 + 16 * 4 * 16 * 4 + stages * 2 * 128 * 136 * 2
}

/// Dynamic shared memory of the prefill kernel for `head_dim` (FLASH_SMEM_BYTES in kernels/attention.cu).
pub fn flash_smem_bytes(head_dim: usize) -> u32 {
    (2 * 2 * 64 * (head_dim + 8) * 2) as u32
}

/// Dynamic shared memory of the Hopper prefill kernel (WG_SMEM_BYTES in kernels/attention.cu):
/// Q of two heads' 64 rows, two stages of 128-key K and V tiles, 1024 bytes to align them.
pub const WGMMA_PREFILL_SMEM_BYTES: u32 = 2 * 128 * 128 + 2 * 4 * 128 * 128 + 1024;

/// Dynamic shared memory of the warp-specialised Hopper prefill kernels (WG_WS_SMEM_BYTES):
/// Q, three stages, 1024 bytes to align them, their six barriers.
pub const WGMMA_WS_PREFILL_SMEM_BYTES: u32 = 2 * 128 * 128 + 3 * 4 * 128 * 128 + 1024 + 64;

/// Dynamic shared memory of the packed Hopper prefill kernel (WG_INV_SMEM_BYTES): Q, two stages,
/// the folded ranges' f32 sums of both warpgroups' rows, 1024 bytes to align them, the barriers.
pub const WGMMA_PACKED_PREFILL_SMEM_BYTES: u32 = 2 * 128 * 128 + 2 * 4 * 128 * 128 + 2 * 128 * 64 * 4 + 1024 + 64;

/// Whether the Hopper prefill kernel ([`flash_prefill_wgmma`]) takes shape `s` on `dev`: an
/// sm_90a GPU, head size 128, an even number of query heads per KV head (a block takes two).
pub fn wgmma_prefill_takes(dev: &CudaDevice, s: &AttnShape) -> bool {
    let group = s.num_heads / s.num_kv_heads.max(1);
    dev.wgmma_capable() && s.head_dim == 128 && s.num_heads == group * s.num_kv_heads && group.is_multiple_of(2)
}

/// Rows of queries one prefill work item covers.
pub const FLASH_ROWS: usize = 64;

/// [`flash_prefill`]'s default build (not packed, not split) on Hopper's warpgroup MMAs, for the
/// shapes [`wgmma_prefill_takes`]; the same work items; `build` one of the Hopper builds
/// ([`WgmmaPrefill::Lockstep`], [`WgmmaPrefill::PingPong`] or [`WgmmaPrefill::PingPongTma`]). [`flash_prefill`] takes it
/// as tuned ([`crate::cuda::CudaTuning::wgmma_prefill`]).
///
/// # Safety
/// As [`flash_prefill`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn flash_prefill_wgmma(
    dev: &CudaDevice,
    q: u64,
    cache: u64,
    out: u64,
    p: &PrefillSeqs,
    m: &AttnMeta,
    s: &AttnShape,
    build: WgmmaPrefill,
) -> Result<(), CudaError> {
    if build == WgmmaPrefill::Off {
        return Err(CudaError::Unavailable("wgmma_prefill=0 names no Hopper prefill build".into()));
    }
    if p.packed || !wgmma_prefill_takes(dev, s) {
        return Err(CudaError::Unavailable(format!(
            "the Hopper prefill kernel takes sm_90a GPUs, head size 128, an even number of query heads per \
             KV head and the unpacked build: not {} heads over {} KV heads of {} on {}{}",
            s.num_heads,
            s.num_kv_heads,
            s.head_dim,
            dev.describe(),
            if p.packed { ", packed" } else { "" }
        )));
    }
    if p.num_items == 0 {
        return Ok(());
    }
    // The TMA unit's boxes are whole blocks (or 128 keys of one) at 1024-byte aligned places.
    let tma = build == WgmmaPrefill::PingPongTma && s.block_size.is_power_of_two() && s.block_size >= 8;
    let (name, threads, smem) = match build {
        WgmmaPrefill::PingPongTma if tma => ("flash_prefill_wgmma_tma_hd128", 384, WGMMA_WS_PREFILL_SMEM_BYTES),
        WgmmaPrefill::PingPong | WgmmaPrefill::PingPongTma => {
            ("flash_prefill_wgmma_pp_hd128", 384, WGMMA_WS_PREFILL_SMEM_BYTES)
        }
        WgmmaPrefill::Lockstep | WgmmaPrefill::Off => ("flash_prefill_wgmma_hd128", 256, WGMMA_PREFILL_SMEM_BYTES),
    };
    let config = LaunchConfig {
        grid_dim: (s.num_heads as u32 / 2, p.num_items as u32, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem,
    };
    launch_prefill(dev, name, config, (q, cache, out), p, m, s, (0, 0), tma)
}

/// The packed prefill attention (batch-invariant serving) on Hopper's warpgroup MMAs, for the
/// models [`wgmma_packed_takes`]: work items of [`flash_packed_tokens`]`(group, true)` tokens,
/// one block per KV head and item (and per `split.blocks`, with a split); the same results as
/// however the tokens are batched, not the mma.sync packed build's bits. [`flash_prefill`] takes
/// it where it applies.
///
/// # Safety
/// As [`flash_prefill`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn flash_prefill_wgmma_packed(
    dev: &CudaDevice,
    q: u64,
    cache: u64,
    out: u64,
    p: &PrefillSeqs,
    m: &AttnMeta,
    s: &AttnShape,
    split: Option<FlashSplit>,
) -> Result<(), CudaError> {
    if !p.packed || !dev.wgmma_capable() || s.head_dim != 128 || s.num_kv_heads == 0 {
        return Err(CudaError::Unavailable(format!(
            "the packed Hopper prefill kernel takes sm_90a GPUs, head size 128 and packed work items: not head size \
             {} on {}{}",
            s.head_dim,
            dev.describe(),
            if p.packed { "" } else { ", unpacked" }
        )));
    }
    let group = s.num_heads / s.num_kv_heads;
    if s.num_heads != group * s.num_kv_heads || group > 2 * FLASH_ROWS {
        return Err(CudaError::Unavailable(format!(
            "the packed Hopper prefill kernel takes at most {} query heads per KV head, not {} over {}",
            2 * FLASH_ROWS,
            s.num_heads,
            s.num_kv_heads
        )));
    }
    if p.num_items == 0 {
        return Ok(());
    }
    let narrow = p.narrow.min(p.num_items);
    let wide = p.num_items - narrow;
    if narrow > 0 && group > NARROW_ROWS {
        return Err(CudaError::Unavailable(format!(
            "narrow work items take at most {NARROW_ROWS} query heads per KV head, not {group}"
        )));
    }
    let (part, blocks_z, max_ranges) = split.map_or((0, 1, 0), |f| (f.part, f.blocks.max(1), f.max_ranges));
    if wide > 0 {
        let tma = s.block_size.is_power_of_two() && s.block_size >= 8;
        let fold_l2 = split.is_none() && p.fold_scratch != 0;
        let (name, smem) = match (split.is_some(), fold_l2, tma) {
            (false, false, false) => ("flash_prefill_wgmma_packed_hd128", WGMMA_PACKED_PREFILL_SMEM_BYTES),
            (false, false, true) => ("flash_prefill_wgmma_packed_tma_hd128", WGMMA_PACKED_PREFILL_SMEM_BYTES),
            (false, true, false) => ("flash_prefill_wgmma_packed3_hd128", WGMMA_WS_PREFILL_SMEM_BYTES),
            (false, true, true) => ("flash_prefill_wgmma_packed3_tma_hd128", WGMMA_WS_PREFILL_SMEM_BYTES),
            (true, _, false) => ("flash_prefill_wgmma_split_hd128", WGMMA_WS_PREFILL_SMEM_BYTES),
            (true, _, true) => ("flash_prefill_wgmma_split_tma_hd128", WGMMA_WS_PREFILL_SMEM_BYTES),
        };
        // The build that folds in global memory takes its scratch where the split one takes part.
        let part_arg = if fold_l2 { (p.fold_scratch, 0) } else { (part, max_ranges) };
        let config = LaunchConfig {
            grid_dim: (s.num_kv_heads as u32, wide as u32, blocks_z as u32),
            block_dim: (384, 1, 1),
            shared_mem_bytes: smem,
        };
        let wide_items = PrefillSeqs { num_items: wide, narrow: 0, ..*p };
        launch_prefill(dev, name, config, (q, cache, out), &wide_items, m, s, part_arg, tma)?;
    }
    if narrow > 0 {
        // Each work item is two i32s.
        let narrow_items = PrefillSeqs { work: p.work + 8 * wide as u64, num_items: narrow, ..*p };
        launch_narrow(dev, (q, cache, out), &narrow_items, m, s, split, None)?;
    }
    if split.is_some() {
        combine_ranges(dev, part, out, p, m, s, (max_ranges, WGMMA_RANGE_KEYS))?;
    }
    Ok(())
}

/// The packed Hopper build's attention for a step whose every work item is narrow (`p.narrow ==
/// p.num_items`: a decode step) with `rope`'s work ([`super::qkv_rope_cache`] for the items'
/// tokens) done in the same kernel: one launch a layer instead of two, the same bits. The
/// queries go to `rope.q_out` and the keys and values to `rope.cache` as qkv_rope_cache would
/// write them, then attention reads them from there.
///
/// # Safety
/// As [`flash_prefill`] (with `rope.q_out` and `rope.cache` as its `q` and `cache`) and
/// [`super::qkv_rope_cache`] for the step's tokens.
#[allow(clippy::too_many_arguments)]
pub unsafe fn flash_prefill_narrow_rope(
    dev: &CudaDevice,
    rope: &QkvRope,
    out: u64,
    p: &PrefillSeqs,
    m: &AttnMeta,
    s: &AttnShape,
    split: Option<FlashSplit>,
) -> Result<(), CudaError> {
    let group = s.num_heads / s.num_kv_heads.max(1);
    if s.kv_fp8 {
        return Err(CudaError::Unavailable("the narrow kernel reads and writes a bf16 cache, not FP8".into()));
    }
    if !p.packed || p.narrow != p.num_items || narrow_tokens(dev, s.num_heads, s.num_kv_heads, s.head_dim) == 0 {
        return Err(CudaError::Unavailable(format!(
            "the narrow kernel with RoPE takes steps of narrow work items only (the packed Hopper build, at most \
             {NARROW_ROWS} query heads per KV head: not {group}, head size {}), not {} of {} items",
            s.head_dim, p.narrow, p.num_items
        )));
    }
    if p.num_items == 0 {
        return Ok(());
    }
    launch_narrow(dev, (rope.q_out, rope.cache, out), p, m, s, split, Some(rope))?;
    if let Some(f) = split {
        combine_ranges(dev, f.part, out, p, m, s, (f.max_ranges, WGMMA_RANGE_KEYS))?;
    }
    Ok(())
}

/// Launches the narrow kernel over `p`'s items (all narrow), its ranges split as `split` says
/// (their combine is the caller's), with `rope`'s work first where given.
#[allow(clippy::too_many_arguments)]
unsafe fn launch_narrow(
    dev: &CudaDevice,
    qco: (u64, u64, u64),
    p: &PrefillSeqs,
    m: &AttnMeta,
    s: &AttnShape,
    split: Option<FlashSplit>,
    rope: Option<&QkvRope>,
) -> Result<(), CudaError> {
    let name = if split.is_some() { "flash_decode_narrow_split_hd128" } else { "flash_decode_narrow_hd128" };
    let (part, blocks_z, max_ranges) = split.map_or((0, 1, 0), |f| (f.part, f.blocks.max(1), f.max_ranges));
    // A grid of no more blocks than SMs (a decode step of few tokens) gives each block two
    // stages, so it copies the next tile while it works; a larger one fits two blocks an SM
    // with one stage each.
    let blocks = s.num_kv_heads * p.num_items * blocks_z;
    let stages = if blocks <= dev.sm_count() as usize { 2 } else { 1 };
    let config = LaunchConfig {
        grid_dim: (s.num_kv_heads as u32, p.num_items as u32, blocks_z as u32),
        block_dim: (256, 1, 1),
        shared_mem_bytes: narrow_smem_bytes(stages),
    };
    let r = rope.copied().unwrap_or_default();
    let mut args = flash_args(qco, p, m, s, (part, max_ranges));
    args.extend([r.qkv.raw(), r.bias.raw(), r.q_norm.raw(), r.k_norm.raw(), r.cos.raw(), r.sin.raw(), r.slots.raw()]);
    args.push(r.eps.raw());
    launch_args(dev, name, config, args, None)
}

/// Launches prefill kernel `name` over `qco` (q, cache, out) with the arguments every build
/// takes ([`flash_args`]; `split`: part, max_ranges) and, with `tma` (Hopper builds), the
/// cache's tensor map after them.
#[allow(clippy::too_many_arguments)]
unsafe fn launch_prefill(
    dev: &CudaDevice,
    name: &str,
    config: LaunchConfig,
    qco: (u64, u64, u64),
    p: &PrefillSeqs,
    m: &AttnMeta,
    s: &AttnShape,
    split: (u64, usize),
    tma: bool,
) -> Result<(), CudaError> {
    let mut map = if tma { Some(cache_tensor_map(qco.1, s)?) } else { None };
    launch_args(dev, name, config, flash_args(qco, p, m, s, split), map.as_mut())
}

/// Folds the key ranges (`ranges`: the most a token has, and keys a range) a split prefill
/// launch left in `part` (one token per work item: the step's tokens are 0..items) into `out`.
unsafe fn combine_ranges(
    dev: &CudaDevice,
    part: u64,
    out: u64,
    p: &PrefillSeqs,
    m: &AttnMeta,
    s: &AttnShape,
    ranges: (usize, usize),
) -> Result<(), CudaError> {
    let (max_ranges, range_keys) = ranges;
    launch!(
        dev,
        "flash_range_combine",
        cfg((p.num_items as u32, s.num_heads as u32), s.head_dim as u32),
        part,
        out,
        m.positions,
        s.num_heads as i32,
        s.head_dim as i32,
        max_ranges as i32,
        range_keys as i32
    )
}

/// The TMA unit's view of layer-major paged cache `cache` (`s` describes it): a 5-D bf16 tensor
/// (head dim, slot, kv * KV heads + KV head, layer, block), read in boxes of 64 head dims (128
/// bytes, swizzled as the Hopper kernels lay tiles out) by `min(block size, 128)` slots.
fn cache_tensor_map(cache: u64, s: &AttnShape) -> Result<cudarc::driver::sys::CUtensorMap, CudaError> {
    use cudarc::driver::sys;
    let (dims, strides, boxes) = cache_tensor_shape(s);
    let element_strides = [1u32; 5];
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    // Safety: every array holds the rank's (5) entries, strides rank - 1; the map is written in
    // place; `cache` is the device address of the cache these dimensions describe.
    unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            5,
            cache as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
        .result()?
    };
    Ok(map)
}

/// [`cache_tensor_map`]'s dimensions (head dim, slot, kv * KV heads + KV head, layer, block),
/// the byte strides of dimensions 1-4 (dimension 0 is contiguous) and the box.
fn cache_tensor_shape(s: &AttnShape) -> ([u64; 5], [u64; 4], [u32; 5]) {
    let (hd, bs, kvh, layers) = (s.head_dim as u64, s.block_size as u64, s.num_kv_heads as u64, s.num_layers as u64);
    let dims = [hd, bs, 2 * kvh, layers, s.num_blocks as u64];
    let strides = [hd * 2, bs * hd * 2, 2 * kvh * bs * hd * 2, layers * 2 * kvh * bs * hd * 2];
    (dims, strides, [64, s.block_size.min(128) as u32, 1, 1, 1])
}

/// The arguments every prefill build takes, in order (WG_PP_ARGS in kernels/attention.cu), as
/// the driver copies them: q, cache, out, the work items and sequences, the tables, the shape,
/// the softmax scale (log2 units) and `split` (part, max_ranges).
fn flash_args(qco: (u64, u64, u64), p: &PrefillSeqs, m: &AttnMeta, s: &AttnShape, split: (u64, usize)) -> Vec<[u8; 8]> {
    let (q, cache, out) = qco;
    let scale_log2 = std::f32::consts::LOG2_E / (s.head_dim as f32).sqrt();
    vec![
        q.raw(),
        cache.raw(),
        out.raw(),
        p.work.raw(),
        p.seq_tok.raw(),
        p.seq_len.raw(),
        p.seq_pos.raw(),
        m.block_tables.raw(),
        m.stride.raw(),
        (s.num_heads as i32).raw(),
        (s.num_kv_heads as i32).raw(),
        (s.layer as i32).raw(),
        (s.num_layers as i32).raw(),
        (s.block_size as i32).raw(),
        scale_log2.raw(),
        split.0.raw(),
        (split.1 as i32).raw(),
    ]
}

/// Launches kernel `name` with `args` (one per parameter, in its order) and, with `map`, a TMA
/// tensor map passed by value after them; with programmatic dependent launch where the device
/// launches so.
///
/// # Safety
/// `args` (and `map`) are the kernel's parameters in its order and sizes, every address in them
/// valid for the launch (the prefill entry points' contract).
unsafe fn launch_args(
    dev: &CudaDevice,
    name: &str,
    config: LaunchConfig,
    mut args: Vec<[u8; 8]>,
    map: Option<&mut cudarc::driver::sys::CUtensorMap>,
) -> Result<(), CudaError> {
    let mut params: Vec<*mut std::ffi::c_void> = args.iter_mut().map(|v| v.as_mut_ptr().cast()).collect();
    if let Some(map) = map {
        params.push((map as *mut cudarc::driver::sys::CUtensorMap).cast());
    }
    let f = dev.kernels().get(name);
    // Safety: one pointer per kernel parameter, in order: 8 live bytes whose first bytes are the
    // value (4-byte parameters read the first four), then the tensor map (128 bytes, by value).
    unsafe { launch_params(dev, f, config, &mut params, dev.programmatic_launch()) }
}

/// Causal attention of prefill chunks over the paged cache with tensor cores.
///
/// # Safety
/// See the module docs; `q` and `out` hold every token of the work items' sequences
/// (`[t, heads, head_dim]`), `seqs`' arrays `num_items` work items and their sequences, and `m`'s
/// tables blocks in `cache` (as `s` describes it) up to each query's position. With `split`
/// (packed, one token per work item, the step's tokens `0..items`), `split.part` holds
/// [`flash_split_floats`] for those tokens and every context fits `split.max_ranges` ranges.
#[allow(clippy::too_many_arguments)]
pub unsafe fn flash_prefill(
    dev: &CudaDevice,
    q: u64,
    cache: u64,
    out: u64,
    p: &PrefillSeqs,
    m: &AttnMeta,
    s: &AttnShape,
    split: Option<FlashSplit>,
) -> Result<(), CudaError> {
    if p.num_items == 0 {
        return Ok(());
    }
    if s.kv_fp8 {
        return Err(CudaError::Unavailable("the prefill attention reads a bf16 cache (FP8: kv_fp8_shadow's)".into()));
    }
    if split.is_some() && !p.packed {
        return Err(CudaError::Unavailable("split prefill attention is only built packed".into()));
    }
    let build = dev.tuning().wgmma_prefill;
    if !p.packed && split.is_none() && build != WgmmaPrefill::Off && wgmma_prefill_takes(dev, s) {
        return flash_prefill_wgmma(dev, q, cache, out, p, m, s, build);
    }
    if p.packed && wgmma_packed_takes(dev, s.num_heads, s.num_kv_heads, s.head_dim) {
        return flash_prefill_wgmma_packed(dev, q, cache, out, p, m, s, split);
    }
    let name = match (s.head_dim, p.packed, split.is_some()) {
        (64, false, _) => "flash_prefill_hd64",
        (128, false, _) => "flash_prefill_hd128",
        (64, true, false) => "flash_prefill_packed_hd64",
        (128, true, false) => "flash_prefill_packed_hd128",
        (64, true, true) => "flash_prefill_split_hd64",
        (128, true, true) => "flash_prefill_split_hd128",
        (d, ..) => panic!("flash_prefill called for head_dim {d}; check flash_supported first"),
    };
    if p.packed && s.num_heads / s.num_kv_heads.max(1) > FLASH_ROWS {
        return Err(CudaError::Unavailable(format!(
            "packed prefill attention takes at most {FLASH_ROWS} query heads per KV head, not {}",
            s.num_heads / s.num_kv_heads.max(1)
        )));
    }
    let blocks_x = if p.packed { s.num_kv_heads } else { s.num_heads };
    let (part, blocks_z, max_ranges) = split.map_or((0, 1, 0), |f| (f.part, f.blocks.max(1), f.max_ranges));
    let config = LaunchConfig {
        grid_dim: (blocks_x as u32, p.num_items as u32, blocks_z as u32),
        block_dim: (128, 1, 1),
        shared_mem_bytes: flash_smem_bytes(s.head_dim),
    };
    launch_prefill(dev, name, config, (q, cache, out), p, m, s, (part, max_ranges), false)?;
    if split.is_some() {
        combine_ranges(dev, part, out, p, m, s, (max_ranges, FLASH_RANGE_KEYS))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::KvLayout;

    #[test]
    fn the_tma_view_of_the_cache_addresses_the_elements_the_layout_puts_there() {
        for (layers, kvh, bs, blocks) in [(36, 8, 16, 40), (2, 2, 256, 5), (28, 4, 8, 9)] {
            let s = AttnShape {
                num_heads: 4 * kvh,
                num_kv_heads: kvh,
                head_dim: 128,
                layer: 0,
                num_layers: layers,
                block_size: bs,
                num_blocks: blocks,
                kv_fp8: false,
            };
            let layout =
                KvLayout { num_layers: layers, num_kv_heads: kvh, head_dim: 128, block_size: bs, num_blocks: blocks };
            let (dims, strides, boxes) = cache_tensor_shape(&s);
            // The last element of the whole cache, and a spread of others.
            for (block, layer, kv, head, slot, d) in [
                (blocks - 1, layers - 1, 1, kvh - 1, bs - 1, 127),
                (3 % blocks, 1, 0, kvh / 2, bs / 2, 64),
                (0, 0, 1, 0, 0, 5),
            ] {
                let coords = [d, slot, kv * kvh + head, layer, block].map(|c| c as u64);
                assert!(coords.iter().zip(dims).all(|(c, n)| *c < n), "{coords:?} within {dims:?}");
                let bytes = coords[0] * 2 + coords[1..].iter().zip(strides).map(|(c, st)| c * st).sum::<u64>();
                let elem = layout.plane_offset(block, layer, kv, head) + slot * 128 + d;
                assert_eq!(
                    bytes,
                    2 * elem as u64,
                    "block {block} layer {layer} kv {kv} head {head} slot {slot} dim {d}"
                );
            }
            // A box is one 128-byte swizzle row of head dims by a whole block (or 128 keys of one).
            assert_eq!((boxes[0] * 2, boxes[1]), (128, bs.min(128) as u32));
            assert_eq!(dims.iter().product::<u64>() * 2, (layout.num_blocks * layout.block_elems() * 2) as u64);
        }
    }
}
