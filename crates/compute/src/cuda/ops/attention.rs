//! Decode attention over the paged cache (the row kernel, and on tensor cores for split long
//! contexts), the RoPE + cache write that feeds it, and the FP8 cache's bf16 shadow for the
//! prefill kernels; the kernels are in kernels/attention.cu.

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::{cfg, launch_programmatic, PrefillSeqs, RawArg};
use crate::cuda::{CudaDevice, CudaError};

/// Shapes of one attention layer over the paged cache.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// This layer.
    pub layer: usize,
    /// Layers in the cache.
    pub num_layers: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks in the cache (the bounds of the TMA unit's view of it).
    pub num_blocks: usize,
    /// The cache holds e4m3 bytes (`--kv-cache-dtype fp8`; offsets count bytes), which the RoPE
    /// write and the row kernel take; the prefill kernels read bf16 only ([`kv_fp8_shadow`]).
    pub kv_fp8: bool,
}

/// Split key ranges for [`attention_rows`] (see `attn_splits` in kernels/attention.cu): a token with a
/// context of `ctx` keys is cut into `min(most, ceil(ctx / split_keys))` ranges worked by
/// separate blocks, whose partials in `part` a second kernel merges. For long contexts at small
/// batches, where one block per head walking the whole context leaves the device idle.
#[derive(Clone, Copy, Debug)]
pub struct AttnSplit {
    /// `[listed tokens][heads][most][head_dim + 2]` f32 scratch ([`attention_split_floats`]).
    pub part: u64,
    /// Most ranges per token (the launch's grid z).
    pub most: usize,
    /// Keys per range before a token gets another.
    pub split_keys: usize,
}

/// f32 elements of [`AttnSplit::part`] for `tokens` listed tokens.
pub fn attention_split_floats(tokens: usize, num_heads: usize, head_dim: usize, most: usize) -> usize {
    tokens * num_heads * most * (head_dim + 2)
}

/// Inputs of the fused q/k-norm + RoPE + cache-write kernel (all zero: none, where a kernel
/// takes it optionally).
#[derive(Clone, Copy, Debug, Default)]
pub struct QkvRope {
    /// `[t, (heads + 2 kv_heads) * head_dim]` bf16.
    pub qkv: u64,
    /// Optional qkv bias.
    pub bias: u64,
    /// Optional q and k RMSNorm weights (Qwen3).
    pub q_norm: u64,
    /// See `q_norm`.
    pub k_norm: u64,
    /// RoPE cos table `[position][head_dim / 2]`.
    pub cos: u64,
    /// RoPE sin table.
    pub sin: u64,
    /// `[t]` positions.
    pub positions: u64,
    /// `[t]` cache slots (block * block_size + slot, -1 to skip).
    pub slots: u64,
    /// `[t, heads, head_dim]` output queries.
    pub q_out: u64,
    /// The KV cache.
    pub cache: u64,
    /// RMSNorm epsilon.
    pub eps: f32,
}

/// Normalises (Qwen3), rotates and stores one layer's keys and values into the paged cache,
/// and writes the rotated queries to `q_out`.
///
/// # Safety
/// See the module docs; `a`'s buffers hold `tokens` rows of qkv and queries, the norm
/// weights `head_dim`, the RoPE tables every position named, `positions` and `slots` `tokens`
/// entries, and every slot lies in the cache `s` describes (or is -1).
pub unsafe fn qkv_rope_cache(dev: &CudaDevice, a: &QkvRope, s: &AttnShape, tokens: usize) -> Result<(), CudaError> {
    if tokens == 0 {
        return Ok(());
    }
    assert!(s.head_dim <= 256 && s.head_dim.is_multiple_of(32), "head_dim {} not supported", s.head_dim);
    launch!(
        dev,
        "qkv_rope_cache",
        cfg((tokens as u32, (s.num_heads + 2 * s.num_kv_heads).div_ceil(4) as u32), 128),
        a.qkv,
        a.bias,
        a.q_norm,
        a.k_norm,
        a.cos,
        a.sin,
        a.positions,
        a.slots,
        a.q_out,
        a.cache,
        s.num_heads as i32,
        s.num_kv_heads as i32,
        s.head_dim as i32,
        s.layer as i32,
        s.num_layers as i32,
        s.block_size as i32,
        a.eps,
        s.kv_fp8 as i32
    )
}

/// Per-token metadata the attention kernels read.
#[derive(Clone, Copy, Debug)]
pub struct AttnMeta {
    /// `[t]` positions.
    pub positions: u64,
    /// `[t]` sequence index of each token (its block-table row).
    pub tok_seq: u64,
    /// `[seq][stride]` block tables.
    pub block_tables: u64,
    /// One int: the block tables' row stride.
    pub stride: u64,
}

/// Query heads one block of the row kernel scores together: the whole GQA group (keys and
/// values read once per group) when there are blocks enough to fill the device or the launch
/// splits long contexts into ranges (`group_split`: `CudaTuning::attention_split_group`; the
/// ranges then make the blocks), else one (more, lighter blocks: a small decode batch over
/// short contexts is latency bound). Always divides the group, at most 8.
/// (Compiled for head sizes 64 and 128; other sizes always take one head per block.)
fn attention_heads_per_block(
    sm_count: usize,
    tokens: usize,
    num_heads: usize,
    num_kv_heads: usize,
    group_split: bool,
) -> usize {
    let group = num_heads / num_kv_heads.max(1);
    if !group_split && tokens * num_kv_heads < 2 * sm_count {
        return 1;
    }
    [8, 4, 2, 1].into_iter().find(|g| group.is_multiple_of(*g)).unwrap_or(1)
}

/// Attention for the tokens listed in `token_list` (or tokens `0..count` when 0), one block per
/// (token, KV head): decode, and any shape the tensor-core kernel does not take.
///
/// With `rope`, the kernel also does [`qkv_rope_cache`]'s work for the listed tokens (their
/// queries are not written to `rope.q_out`): only for steps where every sequence brings exactly
/// one token, that token being its last position, so no block reads a key another block of the
/// same launch writes.
///
/// # Safety
/// See the module docs; `q`, `out` hold the listed tokens' rows (`[t, heads, head_dim]`),
/// `token_list` (if non-zero) `count` indices, `m`'s tables a row per sequence whose blocks lie
/// in `cache` (as `s` describes it) up to each token's position, `rope` as for
/// [`qkv_rope_cache`], and `split.part` [`attention_split_floats`] floats.
#[allow(clippy::too_many_arguments)]
pub unsafe fn attention_rows(
    dev: &CudaDevice,
    q: u64,
    cache: u64,
    out: u64,
    m: &AttnMeta,
    token_list: u64,
    count: usize,
    s: &AttnShape,
    rope: Option<&QkvRope>,
    split: Option<AttnSplit>,
) -> Result<(), CudaError> {
    if count == 0 {
        return Ok(());
    }
    let e = s.head_dim / 32;
    assert!(s.head_dim.is_multiple_of(32) && (1..=8).contains(&e), "head_dim {} not supported", s.head_dim);
    let group_split = split.is_some() && dev.tuning().attention_split_group;
    let g = match e {
        2 | 4 if rope.is_none() || group_split => {
            attention_heads_per_block(dev.sm_count() as usize, count, s.num_heads, s.num_kv_heads, group_split)
        }
        _ => 1,
    };
    let scale = 1.0 / (s.head_dim as f32).sqrt();
    if s.kv_fp8 && ![2, 4].contains(&e) {
        return Err(CudaError::Unavailable(format!("attention over an FP8 KV cache of head size {}", s.head_dim)));
    }
    let (part, most, split_keys) = split.map_or((0, 1, 0), |sp| (sp.part, sp.most.max(1), sp.split_keys.max(1)));
    let fp8 = if s.kv_fp8 { "_fp8" } else { "" };
    // The tensor-core build takes the row kernel's arguments (its RoPE inputs null).
    let (name, shared_mem_bytes) = if rope.is_none() && attention_mma_takes(dev, s, split.is_some()) {
        (format!("attention_mma_g{g}_hd{}{fp8}", s.head_dim), attention_mma_smem_bytes(s.head_dim, s.kv_fp8))
    } else {
        let (_, smem_per_sm) = dev.gemv_smem();
        let blocks = count * (s.num_heads / g);
        let stages =
            attention_stages(dev.sm_count() as usize, smem_per_sm, blocks, s.head_dim, dev.tuning().attention_stages);
        (format!("attention_rows_g{g}_e{e}{fp8}"), attention_rows_smem_bytes(s.head_dim, stages))
    };
    let config = LaunchConfig {
        grid_dim: (count as u32, (s.num_heads / g) as u32, most as u32),
        block_dim: (128, 1, 1),
        shared_mem_bytes,
    };
    let r = rope.copied().unwrap_or_default();
    // With `rope` the kernel copies its first cached keys before waiting on the qkv projection:
    // launched with programmatic dependent launch, that happens while the projection runs.
    launch!(@with rope.is_some() && dev.pdl_capable() && dev.tuning().attention_early;
        dev,
        name.as_str(),
        config,
        q,
        cache,
        out,
        m.positions,
        m.tok_seq,
        m.block_tables,
        m.stride,
        token_list,
        s.num_heads as i32,
        s.num_kv_heads as i32,
        s.layer as i32,
        s.num_layers as i32,
        s.block_size as i32,
        scale,
        r.qkv,
        r.bias,
        r.q_norm,
        r.k_norm,
        r.cos,
        r.sin,
        r.slots,
        r.eps,
        part,
        split_keys as i32
    )?;
    if part == 0 {
        return Ok(());
    }
    launch!(
        dev,
        "attention_combine",
        cfg((count as u32, s.num_heads as u32), s.head_dim as u32),
        part,
        out,
        m.positions,
        token_list,
        s.num_heads as i32,
        s.head_dim as i32,
        most as i32,
        split_keys as i32
    )
}

/// Whether [`attention_rows`] takes the tensor-core build (`attention_mma_*` in
/// kernels/attention.cu) for a launch over `s` without fused RoPE: launches that split long
/// contexts (`split`) with whole GQA groups a block, head sizes 64 and 128, unless tuned off
/// (`CudaTuning::attention_mma`). A decode step that would take it leaves RoPE to its own kernel.
pub fn attention_mma_takes(dev: &CudaDevice, s: &AttnShape, split: bool) -> bool {
    let t = dev.tuning();
    split && t.attention_split_group && t.attention_mma && matches!(s.head_dim, 64 | 128)
}

/// Dynamic shared memory of the tensor-core decode attention (ATTN_MMA_SMEM_BYTES in
/// kernels/attention.cu: a ring of 64-key chunks, four for FP8 caches and two for bf16).
pub fn attention_mma_smem_bytes(head_dim: usize, fp8: bool) -> u32 {
    let (stages, row_bytes) = if fp8 { (4, head_dim + 16) } else { (2, (head_dim + 8) * 2) };
    (stages * 2 * 64 * row_bytes) as u32
}

/// Dequantizes the keys and values of layer `s.layer` that the prefill work items of `p` read
/// from the FP8 cache `cache` into `shadow`, one layer's bf16 cache over the same blocks (the
/// shape of `s` with one layer), for the prefill attention kernels, which read bf16: each
/// item's own tokens and each sequence's context cached before the step (see
/// kernels/attention.cu). The values are the cache's, exactly.
///
/// # Safety
/// See the module docs; `cache` is the FP8 cache `s` describes, `shadow` holds
/// `s.num_blocks * 2 * s.num_kv_heads * s.block_size * s.head_dim` bf16, and `m`'s tables hold
/// every listed sequence's blocks up to its last token.
pub unsafe fn kv_fp8_shadow(
    dev: &CudaDevice,
    cache: u64,
    shadow: u64,
    p: &PrefillSeqs,
    m: &AttnMeta,
    s: &AttnShape,
) -> Result<(), CudaError> {
    if p.num_items == 0 {
        return Ok(());
    }
    if p.packed || !s.head_dim.is_multiple_of(8) {
        return Err(CudaError::Unavailable(
            "an FP8 KV cache's prefill copy takes unpacked items, head_dim % 8 == 0".into(),
        ));
    }
    launch!(
        dev,
        "kv_fp8_shadow",
        cfg((p.num_items as u32, 64), 256),
        cache,
        shadow,
        p.work,
        p.seq_len,
        p.seq_pos,
        m.block_tables,
        m.stride,
        s.layer as i32,
        s.num_layers as i32,
        s.num_kv_heads as i32,
        s.head_dim as i32,
        s.block_size as i32
    )
}

/// Dynamic shared memory of the decode attention kernel for `head_dim` with `stages` chunk
/// buffers (ATTN_STAGE_BYTES in kernels/attention.cu: 64 keys and values, rows padded by 8 elements).
pub fn attention_rows_smem_bytes(head_dim: usize, stages: usize) -> u32 {
    (stages * 2 * 64 * (head_dim + 8) * 2) as u32
}

/// The most chunk buffers the decode attention kernel uses for `head_dim` (two up to 128).
pub fn attention_max_stages(head_dim: usize) -> usize {
    if head_dim <= 128 {
        2
    } else {
        1
    }
}

/// Chunk buffers for a decode attention launch of `blocks` (token, head group) blocks: two
/// (copies overlap arithmetic) when every block still fits on the device at once with them,
/// else one (twice the blocks per multiprocessor: a full grid runs in one wave). Split ranges
/// are not counted: the splits a context needs are not known at capture, and the blocks past
/// them exit at once. `forced` ([`super::CudaTuning::attention_stages`]) overrides the choice.
fn attention_stages(
    sm_count: usize,
    smem_per_sm: usize,
    blocks: usize,
    head_dim: usize,
    forced: Option<usize>,
) -> usize {
    let max = attention_max_stages(head_dim);
    if let Some(forced) = forced {
        return forced.clamp(1, max);
    }
    // Static shared memory (queries, scores, the new key and value) stays under 4 KiB per block.
    let per_sm = smem_per_sm / (attention_rows_smem_bytes(head_dim, 2) as usize + 4096);
    if max == 2 && blocks <= per_sm * sm_count {
        2
    } else {
        1
    }
}
