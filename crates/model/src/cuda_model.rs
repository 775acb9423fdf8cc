//! The transformer on an NVIDIA GPU: bf16 weights and KV cache in device memory, cuBLAS for
//! the projections, this project's kernels for the rest, sampling on the device, and decode
//! steps replayed from CUDA graphs.
//!
//! The forward mirrors [`crate::Transformer::forward`] step for step (same weights layout with
//! q/k/v and gate/up stacked, same RoPE table, same block-major KV layout); the residual stream
//! and all reductions stay in f32, storage is bf16.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use tandem_compute::cpu::RopeTable;
use tandem_compute::cuda::ops::{
    self, AttnMeta, AttnO, AttnShape, AttnSplit, Gemv, GemvBuild, GemvInput, GemvOutput, PrefillSeqs, QkvRope,
    FLASH_ROWS,
};
use tandem_compute::cuda::{CudaDevice, CudaError, DevBuf, Fence, HostStaging, PinnedRegion};
use tandem_compute::{coalesce, KvDtype, KvLayout, KvRegion};

use crate::config::ModelConfig;
use crate::presets::{tensor_stream, uniform_amplitude};
use crate::runner::{check_carried, ModelRunner, SampleSpec};
use crate::source::{ModelSource, ModelSpec};
use crate::transformer::SeqBatch;
use crate::ModelError;

/// How to size a [`CudaModel`].
#[derive(Clone, Debug)]
pub struct CudaOptions {
    /// GPU index.
    pub ordinal: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Most tokens in one forward (the engine's `max_num_batched_tokens`).
    pub max_tokens: usize,
    /// Most sequences in one forward (the engine's `max_num_seqs`).
    pub max_seqs: usize,
    /// Fraction of the GPU's memory this instance may use in total (weights, activations and
    /// KV cache), like vLLM's `--gpu-memory-utilization`.
    pub memory_utilization: f64,
    /// Use exactly this many KV blocks instead of sizing from memory.
    pub num_blocks: Option<usize>,
    /// Replay decode steps from CUDA graphs, captured at load for every batch bucket (off:
    /// launch every kernel each step).
    pub cuda_graphs: bool,
    /// Run decode steps of up to 8 tokens through the fused decode projections (RMSNorm,
    /// SiLU and the residual add folded into hand-written GEMV kernels) instead of cuBLAS and
    /// separate kernels. Off only to compare the two paths.
    pub fused_decode: bool,
    /// Keep a host copy of the KV cache for the KV connector (prefill and decode roles), of at
    /// most this many bytes (bf16, as on the device): the device cache is capped to the blocks
    /// the copy can hold. `None`: no copy, and no KV transfer.
    pub host_kv_bytes: Option<usize>,
    /// On fused decode steps of one token per sequence, do the o projection inside the
    /// attention kernel ([`ops::attention_o`]): four launches per layer instead of five, the o
    /// weights streaming while the attention runs, at the cost of a head-major copy of every o
    /// weight. Off by default: measured slower on an H200 (docs/PERFORMANCE.md, runs AB-AF).
    /// `TANDEM_ATTN_O=1` (or `0`) overrides it, for measurement.
    pub attention_o: bool,
    /// Run one-token decode steps (batch 1, no split attention) as one launch of the ring
    /// decode kernel ([`ops::decode_ring`]): weights streaming into shared memory through
    /// every stage's wait. Hopper or later. Implies `tensor_core_projections`, so that a
    /// sequence's logits do not depend on whether it decodes alone. `TANDEM_DECODE_RING=1`
    /// (or `0`) overrides it.
    pub decode_ring: bool,
    /// Run the fused decode projections on tensor cores ([`ops::GemvBuild::Mma`]) instead of
    /// the FMA build. `TANDEM_GEMV_MMA=1` turns it on.
    pub tensor_core_projections: bool,
    /// Run the fused decode steps' o projection in the bulk build ([`ops::GemvBuild::Bulk`]):
    /// its weights stream into shared memory while the decode attention runs (Hopper or later,
    /// o's input a multiple of 256 wide; otherwise, and with tensor-core projections, the
    /// model's build). `TANDEM_BULK_O=1` (or `0`) overrides it.
    pub bulk_o_projection: bool,
}

impl Default for CudaOptions {
    fn default() -> Self {
        Self {
            ordinal: 0,
            block_size: 16,
            max_tokens: 2048,
            max_seqs: 64,
            memory_utilization: 0.9,
            num_blocks: None,
            cuda_graphs: true,
            fused_decode: true,
            host_kv_bytes: None,
            attention_o: false,
            decode_ring: false,
            tensor_core_projections: false,
            bulk_o_projection: true,
        }
    }
}

impl From<CudaError> for ModelError {
    fn from(e: CudaError) -> Self {
        ModelError::Device(e.to_string())
    }
}

/// A `[out, in]` bf16 weight with an optional bias.
struct Linear {
    weight: DevBuf<u16>,
    bias: Option<DevBuf<u16>>,
    out_dim: usize,
    in_dim: usize,
}

struct Layer {
    input_norm: DevBuf<u16>,
    qkv: Linear,
    q_norm: Option<DevBuf<u16>>,
    k_norm: Option<DevBuf<u16>>,
    o: Linear,
    /// The o weight head-major, `[heads][hidden][head_dim]`, for [`ops::attention_o`] (each
    /// block's slice one contiguous copy).
    o_heads: Option<DevBuf<u16>>,
    post_norm: DevBuf<u16>,
    /// Gate and up rows interleaved ([`ops::interleave_rows`]).
    gate_up: Linear,
    down: Linear,
}

/// What each of a layer's decode projections computes, in [`CudaModel::decode_projections`] order.
const DECODE_PROJECTIONS: [&str; 4] = [
    "RMSNorm + qkv projection",
    "o projection + residual add",
    "RMSNorm + gate/up projection + SiLU x up",
    "down projection + residual add",
];

/// Per-step activations, sized for `max_tokens` tokens and `max_seqs` sequences.
struct Activations {
    x: DevBuf<f32>,
    normed: DevBuf<u16>,
    qkv: DevBuf<u16>,
    q: DevBuf<u16>,
    attn: DevBuf<u16>,
    /// Attention and MLP outputs (bf16, rounded as transformers rounds its projections).
    proj: DevBuf<u16>,
    gate_up: DevBuf<u16>,
    act: DevBuf<u16>,
    last: DevBuf<u16>,
    logits: DevBuf<f32>,
    tokens: DevBuf<i32>,
    bans: DevBuf<i32>,
    /// Counters and partial bests of greedy rows whose scan several blocks share
    /// ([`ops::sample_rows`]).
    sample_scratch: DevBuf<i32>,
    /// Partials of split row attention (at most 16 token ranges per head in all).
    attn_part: DevBuf<f32>,
}

/// Offsets (in ints) of the step metadata inside one device buffer, so each step uploads it
/// with one copy (the sampling parameters too) and CUDA graphs see fixed addresses.
#[derive(Clone, Copy, Debug)]
struct MetaLayout {
    stride: usize,
    tokens: usize,
    positions: usize,
    slots: usize,
    tok_seq: usize,
    decode_list: usize,
    work: usize,
    rows: usize,
    seq_tok: usize,
    seq_len: usize,
    seq_pos: usize,
    top_k: usize,
    /// Per sequence (temperature, top_p, uniform draw) as f32 bits, read by the sampler as f32.
    params: usize,
    /// End of the fixed part; the block tables follow.
    tables: usize,
}

impl MetaLayout {
    fn new(max_tokens: usize, max_seqs: usize) -> Self {
        let (t, s) = (max_tokens, max_seqs);
        let tokens = 4;
        let positions = tokens + t;
        let slots = positions + t;
        let tok_seq = slots + t;
        let decode_list = tok_seq + t;
        let work = decode_list + t;
        let rows = work + 2 * (t.div_ceil(FLASH_ROWS) + s);
        let seq_tok = rows + s;
        let seq_len = seq_tok + s;
        let seq_pos = seq_len + s;
        let top_k = seq_pos + s;
        let params = top_k + s;
        let tables = params + 3 * s;
        Self {
            stride: 0,
            tokens,
            positions,
            slots,
            tok_seq,
            decode_list,
            work,
            rows,
            seq_tok,
            seq_len,
            seq_pos,
            top_k,
            params,
            tables,
        }
    }

    /// Tokens its per-token regions hold.
    fn token_capacity(&self) -> usize {
        self.positions - self.tokens
    }
}

/// The transformer on one GPU, with its KV cache.
pub struct CudaModel {
    dev: CudaDevice,
    cfg: ModelConfig,
    embed: DevBuf<u16>,
    layers: Vec<Layer>,
    norm: DevBuf<u16>,
    lm_head: Option<DevBuf<u16>>,
    rope_cos: DevBuf<f32>,
    rope_sin: DevBuf<f32>,
    max_positions: usize,
    kv: DevBuf<u16>,
    layout: KvLayout,
    /// The KV connector's host copy of the cache (P/D roles): the same bf16 bytes.
    host_kv: Option<Arc<KvRegion>>,
    /// `host_kv` page-locked while the model lives.
    _host_kv_pinned: Option<PinnedRegion>,
    act: Activations,
    meta: DevBuf<i32>,
    /// The layout the current step (or graph capture) uses: `full_meta_layout`, or a decode
    /// graph's own (see [`CudaModel::graph_meta_layout`]).
    meta_layout: MetaLayout,
    /// Sized for `max_tokens` tokens: any step.
    full_meta_layout: MetaLayout,
    meta_host: Vec<i32>,
    /// Page-locked copies of the header, alternating, so its upload returns at once even while
    /// the previous step runs.
    meta_staging: [HostStaging<i32>; 2],
    /// Page-locked landing places of the sampled tokens, alternating between pipelined steps.
    token_staging: [HostStaging<i32>; 2],
    /// Which header copy the next upload uses.
    meta_turn: usize,
    /// Submitted steps whose tokens are not collected yet: (token staging slot, rows).
    pending: VecDeque<(usize, usize)>,
    /// Rows the last step sampled (what a carried token may name).
    last_rows: usize,
    /// Copies to the host KV region queued by `kv_to_host_queue`, not yet waited on, by
    /// ticket (the last one given out in `kv_tickets`).
    kv_fences: VecDeque<(u64, Fence)>,
    kv_tickets: u64,
    table_width: usize,
    max_tokens: usize,
    max_seqs: usize,
    /// Decode graphs by (batch bucket, split row attention).
    graphs: HashMap<(usize, bool), tandem_compute::cuda::Graph>,
    use_graphs: bool,
    /// Most tokens a step may have to take the fused decode path (0: never).
    fused_tokens: usize,
    /// Attention with the o projection on fused one-token-per-sequence steps.
    attention_o: Option<AttentionO>,
    /// The ring decode kernel for one-token steps.
    ring: Option<DecodeRing>,
    /// The fused decode projections' build.
    gemv_build: GemvBuild,
    /// The o projection's build in fused decode steps (see [`CudaOptions::bulk_o_projection`]).
    o_build: GemvBuild,
    /// Measurement only: decode-step kernels left out or run twice.
    variant: StepVariant,
    weight_bytes: usize,
    fingerprint: String,
    counts: StepCounts,
}

/// The ring decode kernel's argument block and shared memory ([`ops::decode_ring_plan`]) and
/// the layers' projections in its order (qkv, o, gate/up, down); its two sync words are the
/// last two ints of `Activations::tokens`, read back with every step's sampled tokens.
struct DecodeRing {
    args: DevBuf<u64>,
    smem: u32,
    _tiles: Vec<[DevBuf<u16>; 4]>,
    /// Per-stage clock stamps (`TANDEM_RING_TRACE`; [`ops::decode_ring_trace_len`]).
    trace: Option<DevBuf<u64>>,
    /// Steps sampled since load, while tracing.
    sampled: usize,
}

/// The sampled step whose ring stamps `TANDEM_RING_TRACE` logs (past warm-up).
const RING_TRACE_AT: usize = 24;

/// Where a ring decode step's time goes, from its stamps (`[block][stage][begin, end]`, ns;
/// five stages a layer): per stage kind summed over the layers, the critical path's share (the
/// last block's end minus the previous stage's last end), the grid barrier (the first block's
/// begin minus the previous stage's last end), and the median and slowest block's time in the
/// stage.
fn ring_trace_summary(stamps: &[u64], blocks: usize, layers: usize) -> Vec<String> {
    const KINDS: [&str; 5] = ["qkv", "attention", "o", "gate/up", "down"];
    let stages = 5 * layers;
    if blocks == 0 || stamps.len() < blocks * stages * 2 {
        return vec!["ring trace: no stamps".into()];
    }
    let at = |b: usize, s: usize, k: usize| stamps[(b * stages + s) * 2 + k] as i64;
    let mut sums = [[0i64; 4]; 5];
    let first_begin = (0..blocks).map(|b| at(b, 0, 0)).min().unwrap_or(0);
    let mut last_end = first_begin;
    for s in 0..stages {
        let begin = (0..blocks).map(|b| at(b, s, 0)).min().unwrap_or(0);
        let end = (0..blocks).map(|b| at(b, s, 1)).max().unwrap_or(0);
        let mut work: Vec<i64> = (0..blocks).map(|b| at(b, s, 1) - at(b, s, 0)).collect();
        work.sort_unstable();
        let sum = &mut sums[s % 5];
        sum[0] += end - last_end;
        sum[1] += if s == 0 { 0 } else { begin - last_end };
        sum[2] += work[blocks / 2];
        sum[3] += work[blocks - 1];
        last_end = end;
    }
    let us = |ns: i64| ns as f64 / 1000.0;
    let mut lines = vec![format!(
        "ring trace: step {:.1} us over {layers} layers; per stage kind, summed over the layers: critical path / \
         grid barrier / median block / slowest block (us)",
        us(last_end - first_begin)
    )];
    for (kind, sum) in KINDS.iter().zip(sums) {
        lines.push(format!(
            "ring trace: {kind:>9} {:8.1} {:8.1} {:8.1} {:8.1}",
            us(sum[0]),
            us(sum[1]),
            us(sum[2]),
            us(sum[3])
        ));
    }
    lines
}

/// Scratch and split of [`ops::attention_o`] (for up to `fused_tokens` tokens).
struct AttentionO {
    chunks: (usize, usize),
    partial: DevBuf<f32>,
    counters: DevBuf<i32>,
}

/// A measurement switch: `name=1` turns it on, `name=0` off, anything else leaves `default`.
fn env_switch(name: &str, default: bool) -> bool {
    match std::env::var(name).as_deref() {
        Ok("1") => true,
        Ok("0") => false,
        _ => default,
    }
}

/// `l` (gate rows, then up rows) with its rows (and bias) interleaved: gate row i, up row i, ...
/// so that a decode projection's warp holds both and applies SiLU-and-multiply itself.
fn interleave_gate_up(dev: &CudaDevice, l: Linear) -> Result<Linear, ModelError> {
    let half = l.out_dim / 2;
    let weight = dev.zeros::<u16>(l.out_dim * l.in_dim)?;
    ops::interleave_rows(dev, l.weight.ptr(), weight.ptr(), half, l.in_dim)?;
    let bias = match &l.bias {
        Some(b) => {
            let out = dev.zeros::<u16>(l.out_dim)?;
            ops::interleave_rows(dev, b.ptr(), out.ptr(), half, 1)?;
            Some(out)
        }
        None => None,
    };
    // The copies are queued on the device's stream; finish them before `l`'s buffers go.
    dev.synchronize()?;
    Ok(Linear { weight, bias, out_dim: l.out_dim, in_dim: l.in_dim })
}

/// Measurement only: kernels of the fused decode step (`qkv`, `attn`, `o`, `gate_up`, `down`)
/// left out (`TANDEM_DECODE_OMIT`) or run twice (`TANDEM_DECODE_TWICE`), comma-separated, so
/// that differences of graph step times give each kernel's share of a step (docs/PERFORMANCE.md).
/// Either makes the model's output wrong; a warning says so at load.
#[derive(Clone, Debug, Default)]
struct StepVariant {
    omit: Vec<String>,
    twice: Vec<String>,
}

impl StepVariant {
    fn from_env() -> Self {
        let list = |name: &str| -> Vec<String> {
            std::env::var(name).map(|v| v.split(',').map(|s| s.trim().to_string()).collect()).unwrap_or_default()
        };
        let v = StepVariant { omit: list("TANDEM_DECODE_OMIT"), twice: list("TANDEM_DECODE_TWICE") };
        if !v.omit.is_empty() || !v.twice.is_empty() {
            tracing::warn!(omit = ?v.omit, twice = ?v.twice, "decode steps altered for measurement: outputs are wrong");
        }
        v
    }

    /// How many times the step runs kernel `name` (0, 1 or 2).
    fn runs(&self, name: &str) -> usize {
        if self.omit.iter().any(|n| n == name) {
            0
        } else if self.twice.iter().any(|n| n == name) {
            2
        } else {
            1
        }
    }
}

/// Batch sizes decode graphs are captured for (a step pads up to the next one).
fn graph_buckets(max_seqs: usize) -> Vec<usize> {
    let mut b: Vec<usize> =
        [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512].into_iter().filter(|&n| n < max_seqs).collect();
    b.push(max_seqs);
    b
}

fn to_bf16_bits(xs: &[f32]) -> Vec<u16> {
    xs.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect()
}

impl CudaModel {
    /// Builds the model on GPU `opts.ordinal`: a `preset:` model's seeded weights are generated
    /// on the device; a checkpoint is read on the host, converted to bf16 and uploaded. Then
    /// activations are allocated and the KV cache takes what `memory_utilization` leaves.
    pub fn load(spec: &ModelSpec, opts: &CudaOptions) -> Result<Self, ModelError> {
        let dev = CudaDevice::open(opts.ordinal)?;
        let cfg = spec.config.clone();
        if !cfg.hidden_size.is_multiple_of(4) {
            return Err(ModelError::UnsupportedConfig(format!(
                "hidden size {} on CUDA (must be a multiple of 4)",
                cfg.hidden_size
            )));
        }
        if cfg.head_dim > 256 || !cfg.head_dim.is_multiple_of(32) {
            return Err(ModelError::UnsupportedConfig(format!(
                "head_dim {} on CUDA (supported: multiples of 32 up to 256)",
                cfg.head_dim
            )));
        }
        if !cfg.num_heads.is_multiple_of(cfg.num_kv_heads) {
            return Err(ModelError::UnsupportedConfig(format!(
                "{} query heads over {} KV heads on CUDA (must divide evenly)",
                cfg.num_heads, cfg.num_kv_heads
            )));
        }
        let started = std::time::Instant::now();
        let mut builder = WeightBuilder::new(&dev, spec)?;
        let (h, hd, i) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
        let (q_dim, kv_dim) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
        let embed = builder.tensor(&["model.embed_tokens.weight"], &[cfg.vocab_size], h)?;
        // The fused decode projections load 8 input elements at a time and stage up to 8 input
        // rows in shared memory.
        let fused_tokens = if opts.fused_decode && [h, q_dim, i].iter().all(|d| d.is_multiple_of(8)) {
            ops::gemv_max_tokens(&dev, h.max(q_dim).max(i))
        } else {
            0
        };
        // Attention with the o projection (see `AttentionO`), where its weight slices fit.
        let attention_o_chunks = ops::attention_o_chunks(&dev, cfg.num_heads, hd, h)
            .filter(|_| fused_tokens > 0 && env_switch("TANDEM_ATTN_O", opts.attention_o));
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            let p = format!("model.layers.{l}");
            let n = |s: &str| format!("{p}.{s}");
            let linear = |b: &mut WeightBuilder<'_>, names: &[(&str, usize)], in_dim: usize, bias: bool| {
                let ws: Vec<String> = names.iter().map(|(s, _)| n(&format!("{s}.weight"))).collect();
                let rows: Vec<usize> = names.iter().map(|(_, r)| *r).collect();
                let wrefs: Vec<&str> = ws.iter().map(String::as_str).collect();
                let weight = b.tensor(&wrefs, &rows, in_dim)?;
                let bias = if bias {
                    let bs: Vec<String> = names.iter().map(|(s, _)| n(&format!("{s}.bias"))).collect();
                    let brefs: Vec<&str> = bs.iter().map(String::as_str).collect();
                    Some(b.tensor(&brefs, &rows, 1)?)
                } else {
                    None
                };
                Ok::<_, ModelError>(Linear { weight, bias, out_dim: rows.iter().sum(), in_dim })
            };
            let qkv = linear(
                &mut builder,
                &[("self_attn.q_proj", q_dim), ("self_attn.k_proj", kv_dim), ("self_attn.v_proj", kv_dim)],
                h,
                cfg.qkv_bias,
            )?;
            let o = linear(&mut builder, &[("self_attn.o_proj", h)], q_dim, cfg.o_bias)?;
            let o_heads = match attention_o_chunks {
                Some(_) => {
                    let heads = dev.zeros::<u16>(h * q_dim)?;
                    ops::head_major(&dev, o.weight.ptr(), heads.ptr(), h, cfg.num_heads, hd)?;
                    Some(heads)
                }
                None => None,
            };
            let gate_up = interleave_gate_up(
                &dev,
                linear(&mut builder, &[("mlp.gate_proj", i), ("mlp.up_proj", i)], h, cfg.mlp_bias)?,
            )?;
            let down = linear(&mut builder, &[("mlp.down_proj", h)], i, cfg.mlp_bias)?;
            let (q_norm, k_norm) = if cfg.qk_norm {
                (
                    Some(builder.tensor(&[&n("self_attn.q_norm.weight")], &[hd], 1)?),
                    Some(builder.tensor(&[&n("self_attn.k_norm.weight")], &[hd], 1)?),
                )
            } else {
                (None, None)
            };
            layers.push(Layer {
                input_norm: builder.tensor(&[&n("input_layernorm.weight")], &[h], 1)?,
                qkv,
                q_norm,
                k_norm,
                o,
                o_heads,
                post_norm: builder.tensor(&[&n("post_attention_layernorm.weight")], &[h], 1)?,
                gate_up,
                down,
            });
        }
        let norm = builder.tensor(&["model.norm.weight"], &[h], 1)?;
        let lm_head = if cfg.tie_word_embeddings && !builder.has("lm_head.weight") {
            None
        } else {
            Some(builder.tensor(&["lm_head.weight"], &[cfg.vocab_size], h)?)
        };
        let weight_bytes = builder.bytes;
        drop(builder);
        tracing::info!(
            device = %dev.describe(),
            weights_gib = format!("{:.2}", weight_bytes as f64 / (1u64 << 30) as f64),
            secs = format!("{:.1}", started.elapsed().as_secs_f64()),
            "weights on the GPU"
        );
        // The ring decode kernel streams a second copy of the layers' projections, in its order.
        let ring_wanted = env_switch("TANDEM_DECODE_RING", opts.decode_ring);
        let ring_tiles = match ring_wanted && fused_tokens > 0 {
            true => match Self::ring_tiles(&dev, &cfg, &layers, opts.block_size) {
                Ok(tiles) => Some(tiles),
                Err(e) => {
                    tracing::warn!(error = %e, "ring decode kernel not available; decode steps use five kernels per layer");
                    None
                }
            },
            false => None,
        };

        let rope = RopeTable::new(hd, cfg.rope_theta, cfg.rope_scaling, spec.max_model_len);
        let rope_cos = dev.upload(rope.cos())?;
        let rope_sin = dev.upload(rope.sin())?;

        let max_tokens = opts.max_tokens.max(opts.max_seqs).max(1);
        let max_seqs = opts.max_seqs.max(1);
        let t = max_tokens;
        let qkv_dim = q_dim + 2 * kv_dim;
        let act = Activations {
            x: dev.zeros(t * h)?,
            normed: dev.zeros(t * h)?,
            qkv: dev.zeros(t * qkv_dim)?,
            q: dev.zeros(t * q_dim)?,
            attn: dev.zeros(t * q_dim)?,
            proj: dev.zeros(t * h)?,
            gate_up: dev.zeros(t * 2 * i)?,
            act: dev.zeros(t * i)?,
            last: dev.zeros(max_seqs * h)?,
            logits: dev.zeros(max_seqs * cfg.vocab_size)?,
            // Sampled tokens, then the ring decode kernel's two sync words.
            tokens: dev.zeros(max_seqs + 2)?,
            bans: dev.zeros(1024)?,
            sample_scratch: dev.zeros(ops::sample_scratch_len(max_seqs))?,
            attn_part: dev.zeros(ops::attention_split_floats(16, cfg.num_heads, cfg.head_dim, 1))?,
        };
        let table_width = spec.max_model_len.div_ceil(opts.block_size).max(1);
        let meta_layout = MetaLayout::new(max_tokens, max_seqs);
        let meta = dev.zeros(meta_layout.tables + max_seqs * table_width)?;
        let meta_staging = [dev.host_staging(meta.len())?, dev.host_staging(meta.len())?];
        let token_staging = [dev.host_staging(max_seqs)?, dev.host_staging(max_seqs)?];

        // The KV cache takes what the memory budget leaves, keeping room for cuBLAS and graphs.
        let block_bytes = cfg.num_layers * 2 * cfg.num_kv_heads * hd * opts.block_size * 2;
        let host_cap = opts.host_kv_bytes.map(|bytes| bytes / block_bytes.max(1));
        let num_blocks = match opts.num_blocks {
            Some(n) => n,
            None => {
                let (free, total) = dev.memory()?;
                let used = total - free;
                let budget = (total as f64 * opts.memory_utilization) as usize;
                let reserve = 512 << 20;
                let kv_bytes = budget.saturating_sub(used + reserve);
                kv_bytes / block_bytes.max(1)
            }
        };
        if num_blocks == 0 {
            return Err(ModelError::Device(format!(
                "no memory left for the KV cache on {} (raise --gpu-memory-utilization or lower --max-num-batched-tokens)",
                dev.describe()
            )));
        }
        // The host copy bounds the device cache.
        let num_blocks = match host_cap {
            Some(0) => {
                return Err(ModelError::Device(format!(
                    "the host KV copy holds no block of {} bytes (raise --kv-host-gib)",
                    block_bytes
                )))
            }
            Some(cap) if cap < num_blocks => {
                tracing::info!(num_blocks, cap, "KV cache capped to what its host copy holds");
                cap
            }
            _ => num_blocks,
        };
        let layout = KvLayout {
            num_layers: cfg.num_layers,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: hd,
            block_size: opts.block_size,
            num_blocks,
        };
        let kv = dev.zeros::<u16>(num_blocks * layout.block_elems())?;
        let host_kv = opts.host_kv_bytes.map(|_| KvRegion::host_copy(layout, KvDtype::Bf16));
        // Page-locked, device <-> host copies run at PCIe speed: pageable, a copy to a fresh
        // region ran at about 1.3 GB/s on an H200 machine (docs/PERFORMANCE.md). Without it
        // (the OS refuses), copies still work, slower.
        let host_kv_pinned = match &host_kv {
            Some(region) => {
                let t = std::time::Instant::now();
                match dev.pin_region(region) {
                    Ok(pinned) => {
                        tracing::info!(
                            gib = format!(
                                "{:.2}",
                                (region.block_bytes() * layout.num_blocks) as f64 / (1u64 << 30) as f64
                            ),
                            secs = format!("{:.1}", t.elapsed().as_secs_f64()),
                            "host KV copy page-locked"
                        );
                        Some(pinned)
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "could not page-lock the host KV copy; its copies will be slower");
                        None
                    }
                }
            }
            None => None,
        };
        tracing::info!(
            num_blocks,
            kv_tokens = num_blocks * opts.block_size,
            kv_gib = format!("{:.2}", (num_blocks * block_bytes) as f64 / (1u64 << 30) as f64),
            "KV cache on the GPU"
        );
        let fingerprint = {
            let sample = dev.read(&embed, embed.len().min(1 << 16))?;
            let mut hsh = 0xcbf29ce484222325u64;
            for x in sample.iter().step_by(16) {
                hsh = (hsh ^ *x as u64).wrapping_mul(0x100000001b3);
            }
            format!(
                "{}/l{}h{}kv{}d{}v{}/bf16-{hsh:016x}",
                cfg.architecture.hf_name(),
                cfg.num_layers,
                cfg.hidden_size,
                cfg.num_kv_heads,
                cfg.head_dim,
                cfg.vocab_size
            )
        };
        let attention_o = match attention_o_chunks {
            Some(chunks) => {
                let (floats, ints) = ops::attention_o_scratch(fused_tokens, cfg.num_heads, h, chunks.0);
                Some(AttentionO { chunks, partial: dev.zeros(floats)?, counters: dev.zeros(ints)? })
            }
            _ => None,
        };
        let tensor_cores = ring_tiles.is_some() || env_switch("TANDEM_GEMV_MMA", opts.tensor_core_projections);
        let gemv_build = if tensor_cores { GemvBuild::Mma } else { GemvBuild::Plain };
        // The same build for every token count, so a sequence's o sums do not depend on its batch.
        let o_in = layers.first().map_or(0, |l| l.o.in_dim);
        let o_build = if gemv_build == GemvBuild::Plain
            && env_switch("TANDEM_BULK_O", opts.bulk_o_projection)
            && ops::gemv_bulk_supported(&dev, o_in, fused_tokens)
        {
            GemvBuild::Bulk
        } else {
            gemv_build
        };
        let mut model = Self {
            dev,
            cfg,
            embed,
            layers,
            norm,
            lm_head,
            rope_cos,
            rope_sin,
            max_positions: spec.max_model_len,
            kv,
            layout,
            host_kv,
            _host_kv_pinned: host_kv_pinned,
            act,
            meta,
            meta_layout,
            full_meta_layout: meta_layout,
            meta_host: vec![0; meta_layout.tables],
            meta_staging,
            token_staging,
            meta_turn: 0,
            pending: VecDeque::new(),
            last_rows: 0,
            kv_fences: VecDeque::new(),
            kv_tickets: 0,
            table_width,
            max_tokens,
            max_seqs,
            graphs: HashMap::new(),
            use_graphs: opts.cuda_graphs,
            fused_tokens,
            attention_o,
            ring: None,
            gemv_build,
            o_build,
            variant: StepVariant::from_env(),
            weight_bytes,
            fingerprint,
            counts: StepCounts::default(),
        };
        if let Some(tiles) = ring_tiles {
            model.ring = Some(model.plan_ring(tiles)?);
        }
        model.capture_decode_graphs()?;
        Ok(model)
    }

    /// The ring decode kernel's plan for this model over `tiles` ([`Self::ring_tiles`]),
    /// uploaded ([`ops::decode_ring_plan`]).
    fn plan_ring(&self, tiles: Vec<[DevBuf<u16>; 4]>) -> Result<DecodeRing, ModelError> {
        let opt = |b: &Option<DevBuf<u16>>| b.as_ref().map_or(0, DevBuf::ptr);
        let ring_layers: Vec<ops::RingLayer> = self
            .layers
            .iter()
            .zip(&tiles)
            .map(|(l, [qkv, o, gate_up, down])| ops::RingLayer {
                qkv: qkv.ptr(),
                o: o.ptr(),
                gate_up: gate_up.ptr(),
                down: down.ptr(),
                input_norm: l.input_norm.ptr(),
                post_norm: l.post_norm.ptr(),
                q_norm: opt(&l.q_norm),
                k_norm: opt(&l.k_norm),
                qkv_bias: opt(&l.qkv.bias),
                o_bias: opt(&l.o.bias),
                gate_up_bias: opt(&l.gate_up.bias),
                down_bias: opt(&l.down.bias),
            })
            .collect();
        let trace = std::env::var_os("TANDEM_RING_TRACE")
            .map(|_| self.dev.zeros::<u64>(ops::decode_ring_trace_len(&self.dev, self.layers.len())))
            .transpose()?;
        let (a, m) = (&self.act, self.meta_layout);
        let step = ops::RingStep {
            residual: a.x.ptr(),
            qkv: a.qkv.ptr(),
            attn: a.attn.ptr(),
            act: a.act.ptr(),
            cache: self.kv.ptr(),
            meta: self.attn_meta(),
            token_list: self.meta.ptr_at(m.decode_list),
            cos: self.rope_cos.ptr(),
            sin: self.rope_sin.ptr(),
            slots: self.meta.ptr_at(m.slots),
            sync: a.tokens.ptr_at(a.tokens.len() - 2),
            trace: trace.as_ref().map_or(0, DevBuf::ptr),
            ..Self::ring_shape(&self.cfg, self.layout.block_size)
        };
        let (words, smem) = ops::decode_ring_plan(&self.dev, &step, &ring_layers)?;
        tracing::info!(smem_kib = smem / 1024, "ring decode kernel for one-token steps");
        Ok(DecodeRing { args: self.dev.upload(&words)?, smem, _tiles: tiles, trace, sampled: 0 })
    }

    /// The model's shapes for the ring decode kernel (no buffers yet).
    fn ring_shape(cfg: &ModelConfig, block_size: usize) -> ops::RingStep {
        ops::RingStep {
            residual: 0,
            qkv: 0,
            attn: 0,
            act: 0,
            cache: 0,
            meta: AttnMeta { positions: 0, tok_seq: 0, block_tables: 0, stride: 0 },
            token_list: 0,
            cos: 0,
            sin: 0,
            slots: 0,
            sync: 0,
            trace: 0,
            hidden: cfg.hidden_size,
            intermediate: cfg.intermediate_size,
            num_heads: cfg.num_heads,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            block_size,
            eps: cfg.rms_norm_eps,
        }
    }

    /// The layers' projections copied in the ring decode kernel's order, after checking that
    /// this device and model can run it (an error says why not).
    fn ring_tiles(
        dev: &CudaDevice,
        cfg: &ModelConfig,
        layers: &[Layer],
        block_size: usize,
    ) -> Result<Vec<[DevBuf<u16>; 4]>, ModelError> {
        ops::decode_ring_plan(dev, &Self::ring_shape(cfg, block_size), &[])?;

        let started = std::time::Instant::now();
        let mut bytes = 0;
        let mut tiles = Vec::with_capacity(layers.len());
        for l in layers {
            let mut tile = |w: &Linear| -> Result<DevBuf<u16>, ModelError> {
                let dst = dev.zeros::<u16>(ops::ring_tile_elems(w.out_dim, w.in_dim))?;
                ops::ring_tile(dev, w.weight.ptr(), dst.ptr(), w.out_dim, w.in_dim)?;
                bytes += dst.len() * 2;
                Ok(dst)
            };
            tiles.push([tile(&l.qkv)?, tile(&l.o)?, tile(&l.gate_up)?, tile(&l.down)?]);
        }
        tracing::info!(
            gib = format!("{:.2}", bytes as f64 / (1u64 << 30) as f64),
            secs = format!("{:.1}", started.elapsed().as_secs_f64()),
            "projections copied in ring order"
        );
        Ok(tiles)
    }

    /// Captures the decode graph of every batch bucket now, so that no request pays for a
    /// capture on the first step at a new batch size (a TPOT spike under changing load).
    /// Capturing records launches without running them: nothing is read or written.
    fn capture_decode_graphs(&mut self) -> Result<(), ModelError> {
        if !self.use_graphs {
            return Ok(());
        }
        // Weight generation and cache set-up finish first; captures then start on an idle stream.
        self.dev.synchronize()?;
        let started = std::time::Instant::now();
        let buckets: Vec<usize> = graph_buckets(self.max_seqs).into_iter().filter(|&b| b <= self.max_tokens).collect();
        for &bucket in &buckets {
            self.capture_graph(bucket, false)?;
            if attention_split_most(bucket) > 1 {
                self.capture_graph(bucket, true)?;
            }
        }
        tracing::info!(
            buckets = ?buckets,
            ms = started.elapsed().as_millis() as u64,
            "captured the decode CUDA graphs"
        );
        Ok(())
    }

    /// `y = x · wᵀ` through cuBLAS. (A hand-written skinny GEMV for decode batches was tried
    /// and measured: it beat cuBLAS on 2 to 4 of 40 decode shapes, by less than the run-to-run
    /// spread, and choosing kernels by timing made greedy output depend on the run.)
    #[allow(clippy::too_many_arguments)]
    fn matmul(&self, x: u64, w: u64, y: u64, t: usize, n: usize, k: usize, f32_out: bool) -> Result<(), CudaError> {
        ops::matmul_t(&self.dev, x, w, y, t, n, k, f32_out)
    }

    fn linear(&self, l: &Linear, x: u64, y: u64, t: usize, f32_out: bool) -> Result<(), ModelError> {
        self.matmul(x, l.weight.ptr(), y, t, l.out_dim, l.in_dim, f32_out)?;
        if let Some(b) = &l.bias {
            ops::add_bias(&self.dev, y, b.ptr(), t, l.out_dim, f32_out)?;
        }
        Ok(())
    }

    /// The device.
    pub fn device(&self) -> &CudaDevice {
        &self.dev
    }

    /// Bytes of weights one forward reads (bf16), the numerator of the decode floor.
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    /// Runs a forward and returns the f32 logits of the sequences with `want_logits` (for
    /// tests and comparisons with the CPU backend; serving uses [`ModelRunner::execute`]).
    pub fn forward_logits(&mut self, token_ids: &[u32], seqs: &[SeqBatch<'_>]) -> Result<Vec<f32>, ModelError> {
        let rows = self.prepare(token_ids, seqs)?;
        self.run_forward(token_ids.len(), rows, None)?;
        Ok(self.dev.read(&self.act.logits, rows * self.cfg.vocab_size)?)
    }

    fn check_batch(&self, token_ids: &[u32], seqs: &[SeqBatch<'_>]) -> Result<usize, ModelError> {
        let rows = seqs.iter().filter(|s| s.want_logits && s.num_tokens > 0).count();
        if token_ids.len() > self.max_tokens || seqs.len() > self.max_seqs {
            return Err(ModelError::Device(format!(
                "batch of {} tokens / {} sequences exceeds this GPU instance's {} / {}",
                token_ids.len(),
                seqs.len(),
                self.max_tokens,
                self.max_seqs
            )));
        }
        Ok(rows)
    }

    /// Fills and uploads the step metadata. Returns the number of logit rows.
    fn prepare(&mut self, token_ids: &[u32], seqs: &[SeqBatch<'_>]) -> Result<usize, ModelError> {
        let rows = self.check_batch(token_ids, seqs)?;
        self.fill_meta(token_ids, seqs, None, &[])?;
        Ok(rows)
    }

    /// Writes the metadata for the real batch, with the sampling parameters of `samples` (one
    /// per logit row, or none), all in one upload, in the layout the step runs with: for the
    /// decode graph of `graph_bucket`, its own layout, tokens and sequences padded to the bucket
    /// with rows that write nothing and read block 0; otherwise the full layout.
    fn fill_meta(
        &mut self,
        token_ids: &[u32],
        seqs: &[SeqBatch<'_>],
        graph_bucket: Option<usize>,
        samples: &[SampleSpec],
    ) -> Result<(), ModelError> {
        let (padded_tokens, padded_seqs) = graph_bucket.map_or((token_ids.len(), seqs.len()), |b| (b, b));
        self.meta_layout = graph_bucket.map_or(self.full_meta_layout, |b| self.graph_meta_layout(b));
        let limits = MetaLimits {
            block_size: self.layout.block_size,
            max_positions: self.max_positions,
            table_width: self.table_width,
            flash: ops::flash_supported(self.cfg.head_dim),
        };
        let m = self.meta_layout;
        if padded_tokens.max(token_ids.len()) > m.token_capacity() {
            return Err(ModelError::Device(format!(
                "{} tokens for a metadata layout of {}",
                padded_tokens.max(token_ids.len()),
                m.token_capacity()
            )));
        }
        if samples.len() > self.max_seqs {
            return Err(ModelError::Device(format!("{} sample specs for {} sequences", samples.len(), self.max_seqs)));
        }
        self.meta_host.resize(m.tables, 0);
        let (tables, counts) =
            build_meta(&m, &mut self.meta_host, &limits, token_ids, seqs, padded_tokens, padded_seqs)?;
        self.counts = counts;
        put_sampling(&m, &mut self.meta_host, samples);
        // The block tables follow the fixed part: one copy for both (each copy costs the engine
        // thread a driver call and the stream a transfer).
        self.meta_host.extend_from_slice(&tables);
        let written = self.upload_meta();
        self.meta_host.truncate(m.tables);
        written
    }

    /// Queues the upload of `meta_host` through the next page-locked copy (waiting only if
    /// the upload two steps back has not run yet).
    fn upload_meta(&mut self) -> Result<(), ModelError> {
        let n = self.meta_host.len();
        let staging = &mut self.meta_staging[self.meta_turn];
        if n > staging.len() || n > self.meta.len() {
            return Err(ModelError::Device(format!("{n} metadata entries for a buffer of {}", self.meta.len())));
        }
        staging.host_mut()?[..n].copy_from_slice(&self.meta_host);
        self.dev.upload_async(&self.meta, 0, staging, n)?;
        self.meta_turn = (self.meta_turn + 1) % self.meta_staging.len();
        Ok(())
    }

    fn attn_shape(&self, layer: usize) -> AttnShape {
        AttnShape {
            num_heads: self.cfg.num_heads,
            num_kv_heads: self.cfg.num_kv_heads,
            head_dim: self.cfg.head_dim,
            layer,
            num_layers: self.cfg.num_layers,
            block_size: self.layout.block_size,
        }
    }

    /// Arguments of the fused q/k-norm + RoPE + cache-write kernel for `layer`.
    fn rope_args(&self, layer: &Layer) -> QkvRope {
        QkvRope {
            qkv: self.act.qkv.ptr(),
            bias: layer.qkv.bias.as_ref().map_or(0, DevBuf::ptr),
            q_norm: layer.q_norm.as_ref().map_or(0, DevBuf::ptr),
            k_norm: layer.k_norm.as_ref().map_or(0, DevBuf::ptr),
            cos: self.rope_cos.ptr(),
            sin: self.rope_sin.ptr(),
            positions: self.meta.ptr_at(self.meta_layout.positions),
            slots: self.meta.ptr_at(self.meta_layout.slots),
            q_out: self.act.q.ptr(),
            cache: self.kv.ptr(),
            eps: self.cfg.rms_norm_eps,
        }
    }

    fn prefill_seqs(&self, counts: StepCounts) -> PrefillSeqs {
        let m = self.meta_layout;
        PrefillSeqs {
            work: self.meta.ptr_at(m.work),
            num_items: counts.work,
            seq_tok: self.meta.ptr_at(m.seq_tok),
            seq_len: self.meta.ptr_at(m.seq_len),
            seq_pos: self.meta.ptr_at(m.seq_pos),
        }
    }

    fn attn_meta(&self) -> AttnMeta {
        let m = self.meta_layout;
        AttnMeta {
            positions: self.meta.ptr_at(m.positions),
            tok_seq: self.meta.ptr_at(m.tok_seq),
            block_tables: self.meta.ptr_at(m.tables),
            stride: self.meta.ptr_at(m.stride),
        }
    }

    /// Queues the forward for `t` tokens (metadata already uploaded) up to the logits of
    /// `rows` rows. Everything it launches depends only on `t`, `rows` and the step counts, so
    /// a decode step of a given size can be captured once and replayed.
    fn run_forward(&self, t: usize, rows: usize, counts: Option<StepCounts>) -> Result<(), ModelError> {
        self.run_forward_path(t, rows, counts, true)
    }

    /// [`Self::run_forward`], optionally kept off the fused decode path (to compare the two).
    fn run_forward_path(
        &self,
        t: usize,
        rows: usize,
        counts: Option<StepCounts>,
        allow_fused: bool,
    ) -> Result<(), ModelError> {
        let dev = &self.dev;
        let cfg = &self.cfg;
        let a = &self.act;
        let m = self.meta_layout;
        let counts = counts.unwrap_or(self.counts);
        let h = cfg.hidden_size;
        let eps = cfg.rms_norm_eps;
        let meta = self.attn_meta();
        ops::embed_gather(dev, self.embed.ptr(), self.meta.ptr_at(m.tokens), a.tokens.ptr(), a.x.ptr(), t, h)?;
        if allow_fused && counts.work == 0 && t <= self.fused_tokens {
            return self.run_decode_layers(t, rows, counts);
        }
        ops::add_rms_norm(dev, a.x.ptr(), 0, 0, self.layers[0].input_norm.ptr(), a.normed.ptr(), t, h, eps)?;
        let prefill = self.prefill_seqs(counts);
        for (li, layer) in self.layers.iter().enumerate() {
            // The qkv bias is added by the RoPE kernel.
            self.matmul(a.normed.ptr(), layer.qkv.weight.ptr(), a.qkv.ptr(), t, layer.qkv.out_dim, h, false)?;
            let shape = self.rope_and_row_attention(li, layer, t, counts, false)?;
            ops::flash_prefill(dev, a.q.ptr(), self.kv.ptr(), a.attn.ptr(), &prefill, &meta, &shape)?;
            self.linear(&layer.o, a.attn.ptr(), a.proj.ptr(), t, false)?;
            ops::add_rms_norm(dev, a.x.ptr(), a.proj.ptr(), 0, layer.post_norm.ptr(), a.normed.ptr(), t, h, eps)?;
            self.linear(&layer.gate_up, a.normed.ptr(), a.gate_up.ptr(), t, false)?;
            ops::silu_mul(dev, a.gate_up.ptr(), a.act.ptr(), t, cfg.intermediate_size)?;
            self.linear(&layer.down, a.act.ptr(), a.proj.ptr(), t, false)?;
            match self.layers.get(li + 1) {
                Some(next) => ops::add_rms_norm(
                    dev,
                    a.x.ptr(),
                    a.proj.ptr(),
                    0,
                    next.input_norm.ptr(),
                    a.normed.ptr(),
                    t,
                    h,
                    eps,
                )?,
                // Only the rows that sample need the last residual add, the final norm and
                // the (large) output projection.
                None => ops::add_rms_norm(
                    dev,
                    a.x.ptr(),
                    a.proj.ptr(),
                    self.meta.ptr_at(m.rows),
                    self.norm.ptr(),
                    a.last.ptr(),
                    rows,
                    h,
                    eps,
                )?,
            }
        }
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        self.matmul(a.last.ptr(), head.ptr(), a.logits.ptr(), rows, cfg.vocab_size, h, true)?;
        Ok(())
    }

    /// A decode projection's input: the RMSNorm (weight `weight`) of the residual stream's rows
    /// (`rows`: an index list, or 0 for rows 0..).
    fn residual_norm(&self, weight: &DevBuf<u16>, rows: u64) -> GemvInput {
        GemvInput::Norm { residual: self.act.x.ptr(), rows, weight: weight.ptr(), eps: self.cfg.rms_norm_eps }
    }

    /// Layer `li`'s q/k norm, RoPE and cache write for all `t` tokens, then attention for the
    /// tokens on the decode list (the row kernel). With `fuse_rope` (decode steps of one token
    /// per sequence only), the attention kernel does the first part itself: one launch, and
    /// the queries never go through memory. Returns the layer's attention shape.
    fn rope_and_row_attention(
        &self,
        li: usize,
        layer: &Layer,
        t: usize,
        counts: StepCounts,
        fuse_rope: bool,
    ) -> Result<AttnShape, ModelError> {
        let a = &self.act;
        let shape = self.attn_shape(li);
        let rope = self.rope_args(layer);
        let fuse_rope = fuse_rope && counts.one_token_each && counts.work == 0;
        if !fuse_rope {
            ops::qkv_rope_cache(&self.dev, &rope, &shape, t)?;
        }
        let decode_list = self.meta.ptr_at(self.meta_layout.decode_list);
        let meta = self.attn_meta();
        let split = counts.split.then(|| AttnSplit {
            part: a.attn_part.ptr(),
            most: attention_split_most(counts.decode),
            split_keys: SPLIT_KEYS,
        });
        ops::attention_rows(
            &self.dev,
            a.q.ptr(),
            self.kv.ptr(),
            a.attn.ptr(),
            &meta,
            decode_list,
            counts.decode,
            &shape,
            fuse_rope.then_some(&rope),
            split,
        )?;
        Ok(shape)
    }

    /// Layer `li`'s attention (RoPE and the cache write included) and o projection, adding into
    /// the residual stream, in one launch ([`ops::attention_o`]): fused steps of one token per
    /// sequence without split attention.
    fn attention_with_o(
        &self,
        li: usize,
        layer: &Layer,
        counts: StepCounts,
        plan: &AttentionO,
    ) -> Result<(), ModelError> {
        let a = &self.act;
        let Some(o_heads) = &layer.o_heads else {
            return Err(ModelError::UnsupportedConfig("attention with the o projection without its weights".into()));
        };
        let o = AttnO {
            weight: o_heads.ptr(),
            bias: layer.o.bias.as_ref().map_or(0, DevBuf::ptr),
            hidden: self.cfg.hidden_size,
            residual: a.x.ptr(),
            partial: plan.partial.ptr(),
            counters: plan.counters.ptr(),
        };
        ops::attention_o(
            &self.dev,
            self.kv.ptr(),
            a.attn.ptr(),
            &self.attn_meta(),
            self.meta.ptr_at(self.meta_layout.decode_list),
            counts.decode,
            &self.attn_shape(li),
            &self.rope_args(layer),
            &o,
            plan.chunks,
        )?;
        Ok(())
    }

    /// The layers and output head of a decode step of at most `fused_tokens` tokens (the
    /// embedding already in the residual stream): per layer, qkv (with the input RMSNorm),
    /// attention (with RoPE and the cache write on one-token-per-sequence steps), o (adding
    /// into the residual), gate/up (with the post-attention RMSNorm and SiLU-and-multiply) and
    /// down (adding into the residual). Five or six launches per layer instead of nine, and no
    /// deltas through memory.
    fn run_decode_layers(&self, t: usize, rows: usize, counts: StepCounts) -> Result<(), ModelError> {
        let v = &self.variant;
        if let Some(ring) = self.ring.as_ref().filter(|_| t == 1 && counts.one_token_each && !counts.split) {
            ops::decode_ring(&self.dev, ring.args.ptr(), self.cfg.head_dim, ring.smem)?;
            self.project(&self.head_projection(), rows)?;
            return Ok(());
        }
        let attention_o = self.attention_o.as_ref().filter(|_| counts.one_token_each && !counts.split);
        for (li, layer) in self.layers.iter().enumerate() {
            let [qkv, o, gate_up, down] = self.decode_projections(layer);
            for _ in 0..v.runs("qkv") {
                self.project(&qkv, t)?;
            }
            for _ in 0..v.runs("attn") {
                match attention_o {
                    Some(plan) => self.attention_with_o(li, layer, counts, plan)?,
                    None => drop(self.rope_and_row_attention(li, layer, t, counts, true)?),
                }
            }
            // With attention_o the o projection ran in the attention launch.
            let o = attention_o.is_none().then_some(("o", o, self.o_build));
            let rest = [("gate_up", gate_up, self.gemv_build), ("down", down, self.gemv_build)];
            for (name, p, build) in o.into_iter().chain(rest) {
                for _ in 0..v.runs(name) {
                    self.project_in(&p, t, build)?;
                }
            }
        }
        self.project(&self.head_projection(), rows)?;
        Ok(())
    }

    /// Whether one-token decode steps run as the ring decode kernel ([`CudaOptions::decode_ring`]).
    pub fn decode_ring_active(&self) -> bool {
        self.ring.is_some()
    }

    /// Runs a fused decode projection for `t` tokens in the model's build.
    fn project(&self, g: &Gemv, t: usize) -> Result<(), ModelError> {
        self.project_in(g, t, self.gemv_build)
    }

    /// Runs a fused decode projection for `t` tokens in `build`.
    fn project_in(&self, g: &Gemv, t: usize, build: GemvBuild) -> Result<(), ModelError> {
        g.launch_with(&self.dev, t, ops::gemv_plan(&self.dev, g.n, g.k, t, build))?;
        Ok(())
    }

    /// A layer's qkv (with the input RMSNorm), o (adding into the residual), gate/up (with the
    /// post-attention RMSNorm, SiLU-and-multiply in its epilogue) and down (adding into the
    /// residual) projections of a decode step. The qkv bias is added by the RoPE kernel, as on the
    /// unfused path.
    fn decode_projections(&self, layer: &Layer) -> [Gemv; 4] {
        let a = &self.act;
        let h = self.cfg.hidden_size;
        let bias = |l: &Linear| l.bias.as_ref().map_or(0, DevBuf::ptr);
        let residual = GemvOutput::AddTo(a.x.ptr());
        let (qkv, o, gate_up, down) = (&layer.qkv, &layer.o, &layer.gate_up, &layer.down);
        [
            Gemv {
                weight: qkv.weight.ptr(),
                n: qkv.out_dim,
                k: h,
                input: self.residual_norm(&layer.input_norm, 0),
                output: GemvOutput::Bf16(a.qkv.ptr()),
                bias: 0,
            },
            Gemv {
                weight: o.weight.ptr(),
                n: h,
                k: o.in_dim,
                input: GemvInput::Bf16(a.attn.ptr()),
                output: residual,
                bias: bias(o),
            },
            Gemv {
                weight: gate_up.weight.ptr(),
                n: gate_up.out_dim,
                k: h,
                input: self.residual_norm(&layer.post_norm, 0),
                output: GemvOutput::SiluMul(a.act.ptr()),
                bias: bias(gate_up),
            },
            Gemv {
                weight: down.weight.ptr(),
                n: h,
                k: down.in_dim,
                input: GemvInput::Bf16(a.act.ptr()),
                output: residual,
                bias: bias(down),
            },
        ]
    }

    /// The output head of a decode step, with the final RMSNorm of the rows that want logits.
    fn head_projection(&self) -> Gemv {
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        Gemv {
            weight: head.ptr(),
            n: self.cfg.vocab_size,
            k: self.cfg.hidden_size,
            input: self.residual_norm(&self.norm, self.meta.ptr_at(self.meta_layout.rows)),
            output: GemvOutput::F32(self.act.logits.ptr()),
            bias: 0,
        }
    }

    /// Queues the sampling of `specs.len()` rows of logits into `act.tokens`. Their parameters
    /// went up with the step's metadata (`fill_meta`); banned ids go up here.
    fn launch_sampling(&mut self, specs: &[SampleSpec]) -> Result<(), ModelError> {
        let n = specs.len();
        let vocab = self.cfg.vocab_size;
        let mut ban_rows = Vec::new();
        let mut ban_toks = Vec::new();
        for (r, s) in specs.iter().enumerate() {
            for &b in &s.banned {
                ban_rows.push(r as i32);
                ban_toks.push(b as i32);
            }
        }
        let nb = ban_rows.len();
        if nb > 0 {
            if 2 * nb > self.act.bans.len() {
                self.act.bans = self.dev.zeros(4 * nb)?;
            }
            ban_rows.extend(ban_toks);
            self.dev.write(&mut self.act.bans, 0, &ban_rows)?;
            ops::ban_tokens(
                &self.dev,
                self.act.logits.ptr(),
                vocab,
                self.act.bans.ptr(),
                self.act.bans.ptr_at(nb),
                nb,
            )?;
        }
        ops::sample_rows(
            &self.dev,
            self.act.logits.ptr(),
            vocab,
            self.meta.ptr_at(self.meta_layout.params),
            self.meta.ptr_at(self.meta_layout.top_k),
            self.act.tokens.ptr(),
            n,
            Some((self.act.sample_scratch.ptr(), self.max_seqs)),
        )?;
        Ok(())
    }

    /// Reads back the tokens `launch_sampling` queued for `specs` (waits for the step).
    fn sample(&mut self, specs: &[SampleSpec]) -> Result<Vec<u32>, ModelError> {
        let n = specs.len();
        let vocab = self.cfg.vocab_size;
        // With the ring decode kernel, its failure word comes back in the same copy.
        let read = if self.ring.is_some() { self.act.tokens.len() } else { n };
        let tokens = self.dev.read(&self.act.tokens, read)?;
        if self.ring.is_some() && tokens[read - 1] != 0 {
            self.dev.write(&mut self.act.tokens, read - 2, &[0, 0])?;
            return Err(ModelError::Device(
                "ring decode kernel: a wait ran past 2 s (its blocks must all be resident: is another process using \
                 this GPU?); the step's tokens are lost"
                    .into(),
            ));
        }
        self.log_ring_trace()?;
        Ok(tokens.into_iter().take(n).map(|t| t.clamp(0, vocab as i32 - 1) as u32).collect())
    }

    /// With `TANDEM_RING_TRACE`, logs once where the ring decode kernel's time goes, from the
    /// stamps of the latest ring step by the [`RING_TRACE_AT`]-th sampled step (a steady one).
    fn log_ring_trace(&mut self) -> Result<(), ModelError> {
        let Some(ring) = self.ring.as_mut() else { return Ok(()) };
        let Some(trace) = ring.trace.as_ref() else { return Ok(()) };
        ring.sampled += 1;
        if ring.sampled != RING_TRACE_AT {
            return Ok(());
        }
        let stamps = self.dev.read(trace, trace.len())?;
        for line in ring_trace_summary(&stamps, self.dev.sm_count() as usize, self.layers.len()) {
            tracing::info!("{line}");
        }
        Ok(())
    }

    /// Device time per op of one forward over `seqs` sequences of `tokens_per_seq` tokens each,
    /// the first at position `ctx` (decode: `tokens_per_seq` 1), in milliseconds. Each op is
    /// timed alone, repeated between CUDA events, and per-layer ops are counted once per layer;
    /// the last rows time the whole forward launched op by op and, for decode, replayed from its
    /// CUDA graph. The difference between the sum and the whole is launch gaps. Overwrites KV
    /// blocks from 0 up: only for benchmarks, with no requests running.
    pub fn profile_ops(
        &mut self,
        seqs: usize,
        tokens_per_seq: usize,
        ctx: usize,
    ) -> Result<Vec<(String, f64)>, ModelError> {
        let bs = self.layout.block_size;
        let per_seq = (ctx + tokens_per_seq).div_ceil(bs);
        if per_seq * seqs > self.layout.num_blocks || seqs * tokens_per_seq > self.max_tokens || seqs > self.max_seqs {
            return Err(ModelError::Device("profile shape does not fit this instance".into()));
        }
        let tables: Vec<Vec<u32>> =
            (0..seqs).map(|s| (0..per_seq).map(|b| (s * per_seq + b) as u32).collect()).collect();
        let token_ids: Vec<u32> = (0..seqs * tokens_per_seq).map(|i| (i * 7919 % self.cfg.vocab_size) as u32).collect();
        let batch: Vec<SeqBatch<'_>> = tables
            .iter()
            .enumerate()
            .map(|(i, table)| SeqBatch {
                token_start: i * tokens_per_seq,
                num_tokens: tokens_per_seq,
                first_pos: ctx,
                block_table: table,
                want_logits: true,
            })
            .collect();
        let t = token_ids.len();
        self.fill_meta(&token_ids, &batch, None, &[])?;
        let rows = seqs;
        let reps = if t > 256 { 3 } else { 20 };
        let layers = self.cfg.num_layers as f64;
        let (h, inter) = (self.cfg.hidden_size, self.cfg.intermediate_size);
        let eps = self.cfg.rms_norm_eps;
        let m = self.meta_layout;
        let meta = self.attn_meta();
        let counts = self.counts;
        let dev = &self.dev;
        let a = &self.act;
        let l0 = &self.layers[0];
        let shape = self.attn_shape(0);
        let rope = self.rope_args(l0);
        let prefill = self.prefill_seqs(counts);
        let time = |f: &dyn Fn() -> Result<(), CudaError>| -> Result<f64, ModelError> {
            f()?;
            Ok(dev.time_ms(|| (0..reps).try_for_each(|_| f()))? / reps as f64)
        };
        // Projections run over every layer's weights in turn, as in a step: one layer's alone
        // could be served from L2 on repeats.
        let time_layers = |f: &dyn Fn(&Layer) -> Result<(), CudaError>| time(&|| self.layers.iter().try_for_each(f));
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        let mut out: Vec<(String, f64)> = vec![
            (
                "embedding gather".into(),
                time(&|| {
                    ops::embed_gather(
                        dev,
                        self.embed.ptr(),
                        self.meta.ptr_at(m.tokens),
                        a.tokens.ptr(),
                        a.x.ptr(),
                        t,
                        h,
                    )
                })?,
            ),
            (
                "qkv projection".into(),
                time_layers(&|l| {
                    self.matmul(a.normed.ptr(), l.qkv.weight.ptr(), a.qkv.ptr(), t, l.qkv.out_dim, h, false)
                })?,
            ),
            ("q/k norm + RoPE + KV write".into(), layers * time(&|| ops::qkv_rope_cache(dev, &rope, &shape, t))?),
            (
                "attention (row kernel)".into(),
                layers
                    * time(&|| {
                        ops::attention_rows(
                            dev,
                            a.q.ptr(),
                            self.kv.ptr(),
                            a.attn.ptr(),
                            &meta,
                            self.meta.ptr_at(m.decode_list),
                            counts.decode,
                            &shape,
                            None,
                            None,
                        )
                    })?,
            ),
            (
                "attention (tensor-core prefill)".into(),
                layers
                    * time(&|| {
                        ops::flash_prefill(dev, a.q.ptr(), self.kv.ptr(), a.attn.ptr(), &prefill, &meta, &shape)
                    })?,
            ),
            (
                "o projection".into(),
                time_layers(&|l| self.matmul(a.attn.ptr(), l.o.weight.ptr(), a.proj.ptr(), t, h, l.o.in_dim, false))?,
            ),
            (
                "residual add + RMSNorm (x2)".into(),
                2.0 * layers
                    * time(&|| {
                        ops::add_rms_norm(
                            dev,
                            a.x.ptr(),
                            a.proj.ptr(),
                            0,
                            l0.post_norm.ptr(),
                            a.normed.ptr(),
                            t,
                            h,
                            eps,
                        )
                    })?,
            ),
            (
                "gate/up projection".into(),
                time_layers(&|l| {
                    self.matmul(a.normed.ptr(), l.gate_up.weight.ptr(), a.gate_up.ptr(), t, 2 * inter, h, false)
                })?,
            ),
            ("SiLU x up".into(), layers * time(&|| ops::silu_mul(dev, a.gate_up.ptr(), a.act.ptr(), t, inter))?),
            (
                "down projection".into(),
                time_layers(&|l| self.matmul(a.act.ptr(), l.down.weight.ptr(), a.proj.ptr(), t, h, inter, false))?,
            ),
            (
                "output projection".into(),
                time(&|| self.matmul(a.last.ptr(), head.ptr(), a.logits.ptr(), rows, self.cfg.vocab_size, h, true))?,
            ),
        ];
        let fused = counts.work == 0 && t <= self.fused_tokens;
        if fused {
            // The decode path this step takes: cuBLAS and the separate norm / SiLU kernels above
            // are replaced by the fused projections below (and, on one-token-per-sequence steps,
            // RoPE + attention by the fused attention row). Each
            // runs over every layer's weights in turn, as in a step (one layer's would sit in L2).
            let layer_plans = |i: usize, plan: &dyn Fn(&Gemv) -> ops::GemvPlan| {
                time_layers(&|l| {
                    let p = self.decode_projections(l)[i];
                    p.launch_with(dev, t, plan(&p))
                })
            };
            if counts.one_token_each {
                let fused_rope = || {
                    let (list, n) = (self.meta.ptr_at(m.decode_list), counts.decode);
                    ops::attention_rows(dev, 0, self.kv.ptr(), a.attn.ptr(), &meta, list, n, &shape, Some(&rope), None)
                };
                out.push(("fused: q/k norm + RoPE + KV write + attention".into(), layers * time(&fused_rope)?));
                if let Some(plan) = self.attention_o.as_ref().filter(|_| !counts.split) {
                    let with_o = || -> Result<(), CudaError> {
                        self.layers.iter().enumerate().try_for_each(|(li, l)| {
                            self.attention_with_o(li, l, counts, plan)
                                .map_err(|e| CudaError::Unavailable(e.to_string()))
                        })
                    };
                    out.push(("fused: attention + o projection (one launch)".into(), time(&with_o)?));
                }
            }
            let head_p = self.head_projection();
            // The plan the step uses, then the pipelined and tensor-core builds for comparison.
            type PlanFn<'a> = &'a dyn Fn(usize, usize, usize) -> ops::GemvPlan;
            let builds: [(&str, PlanFn<'_>); 3] = [
                ("fused", &|n, k, t| ops::gemv_plan(dev, n, k, t, ops::GemvBuild::Plain)),
                ("fused, pipelined build (comparison)", &|n, k, t| {
                    ops::gemv_plan(dev, n, k, t, ops::GemvBuild::Pipelined)
                }),
                ("fused, tensor-core build (comparison)", &|n, k, t| ops::gemv_plan(dev, n, k, t, ops::GemvBuild::Mma)),
            ];
            for (j, (build, plan_of)) in builds.into_iter().enumerate() {
                for (i, name) in DECODE_PROJECTIONS.iter().enumerate() {
                    // The step's o projection may run in its own build (timed alone here, so
                    // without the overlap with attention it gets in a step).
                    let own = (j == 0 && i == 1 && self.o_build == ops::GemvBuild::Bulk).then_some(self.o_build);
                    let ms = layer_plans(i, &|p| match own {
                        Some(b) => ops::gemv_plan(dev, p.n, p.k, t, b),
                        None => plan_of(p.n, p.k, t),
                    })?;
                    out.push((format!("{build}: {name}"), ms));
                }
                let plan = plan_of(head_p.n, head_p.k, rows);
                out.push((
                    format!("{build}: RMSNorm + output projection"),
                    time(&|| head_p.launch_with(dev, rows, plan))?,
                ));
            }
            // TANDEM_GEMV_SWEEP=1: every projection under other plans, to tune `ops::gemv_plan`
            // on a new device.
            if std::env::var_os("TANDEM_GEMV_SWEEP").is_some() {
                let sms = dev.sm_count() as usize;
                let p0 = self.decode_projections(l0);
                for (i, name) in DECODE_PROJECTIONS.iter().enumerate() {
                    let mut plans = vec![];
                    for ksplit in [1, 2, 4, 8] {
                        let needed = p0[i].n.div_ceil(16 / ksplit);
                        let mut counts: Vec<usize> =
                            [needed, sms, 2 * sms, 4 * sms].into_iter().filter(|&b| b <= needed).collect();
                        counts.dedup();
                        plans.extend(counts.into_iter().map(|blocks| ops::GemvPlan {
                            build: ops::GemvBuild::Plain,
                            ksplit,
                            blocks,
                        }));
                    }
                    for plan in plans {
                        let ms = layer_plans(i, &|_| plan)?;
                        out.push((format!("plan sweep: {name}, {plan:?}"), ms));
                    }
                }
            }
        }
        let path_ops = |(name, _): &&(String, f64)| {
            let unfused_only = [
                "qkv projection",
                "o projection",
                "residual add",
                "gate/up projection",
                "SiLU x up",
                "down projection",
                "output projection",
            ];
            let rope_fused = fused && counts.one_token_each;
            let other_path = (fused && unfused_only.iter().any(|u| name.starts_with(u)))
                || (rope_fused && (name.starts_with("q/k norm") || name.starts_with("attention (row")));
            !other_path && !name.contains("(comparison)") && !name.starts_with("plan sweep")
        };
        let sum: f64 = out.iter().filter(path_ops).map(|(_, v)| v).sum();
        out.push(("sum of ops on this path".into(), sum));
        out.push((
            "whole forward, launched op by op".into(),
            time(&|| self.run_forward(t, rows, None).map_err(|e| CudaError::Unavailable(e.to_string())))?,
        ));
        if fused {
            out.push((
                "whole forward, unfused path (cuBLAS), op by op".into(),
                time(&|| {
                    self.run_forward_path(t, rows, None, false).map_err(|e| CudaError::Unavailable(e.to_string()))
                })?,
            ));
        }
        if tokens_per_seq == 1 && self.use_graphs {
            if let Some(bucket) = graph_buckets(self.max_seqs).into_iter().find(|&b| b >= seqs) {
                self.fill_meta(&token_ids, &batch, Some(bucket), &[])?;
                self.run_graph(bucket)?;
                let g = &self.graphs[&(bucket, self.counts.split)];
                let dev = &self.dev;
                out.push((format!("whole forward, CUDA graph (bucket {bucket})"), {
                    dev.time_ms(|| (0..reps).try_for_each(|_| g.launch()))? / reps as f64
                }));
            }
        }
        Ok(out)
    }

    /// The decode-graph bucket for a step, if it is a pure decode step graphs can serve.
    fn graph_bucket(&self, token_ids: &[u32], seqs: &[SeqBatch<'_>]) -> Option<usize> {
        if !self.use_graphs || seqs.len() != token_ids.len() || seqs.iter().any(|s| s.num_tokens != 1 || !s.want_logits)
        {
            return None;
        }
        graph_buckets(self.max_seqs).into_iter().find(|&b| b >= seqs.len() && b <= self.max_tokens)
    }

    /// Captures the decode graph for `bucket` sequences, unless it exists.
    fn capture_graph(&mut self, bucket: usize, split: bool) -> Result<(), ModelError> {
        if self.graphs.contains_key(&(bucket, split)) {
            return Ok(());
        }
        let counts = StepCounts { decode: bucket, work: 0, one_token_each: true, split };
        let graph_layout = self.graph_meta_layout(bucket);
        let step_layout = std::mem::replace(&mut self.meta_layout, graph_layout);
        self.dev.begin_capture()?;
        let captured = self.run_forward(bucket, bucket, Some(counts));
        // End the capture even if a launch failed, so the stream is usable again.
        let graph = self.dev.end_capture();
        self.meta_layout = step_layout;
        captured?;
        self.graphs.insert((bucket, split), graph?);
        Ok(())
    }

    /// The metadata layout of the decode graph for `bucket`: sized for `bucket` tokens, so a
    /// decode step uploads a few KB of header instead of one sized for the largest prefill
    /// (85 KB at a 4096-token limit) every step. Its steps define every
    /// entry the graph reads (padding rows included). The ring decode kernel keeps the full
    /// layout: its argument table holds metadata addresses from load time.
    fn graph_meta_layout(&self, bucket: usize) -> MetaLayout {
        if self.ring.is_some() {
            self.full_meta_layout
        } else {
            MetaLayout::new(bucket, self.max_seqs)
        }
    }

    /// Replays the decode graph for `bucket` and the prepared step's attention split.
    fn run_graph(&mut self, bucket: usize) -> Result<(), ModelError> {
        let split = self.counts.split;
        self.capture_graph(bucket, split)?;
        if let Some(g) = self.graphs.get(&(bucket, split)) {
            g.launch()?;
        }
        Ok(())
    }
}

impl ModelRunner for CudaModel {
    fn describe(&self) -> String {
        format!("{} bf16", self.dev.describe())
    }

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn max_positions(&self) -> usize {
        self.max_positions
    }

    fn kv_layout(&self) -> KvLayout {
        self.layout
    }

    fn kv_region(&self) -> Option<Arc<KvRegion>> {
        self.host_kv.clone()
    }

    fn kv_to_host(&mut self, blocks: &[u32]) -> Result<(), ModelError> {
        let started = std::time::Instant::now();
        // The copy queued behind everything on the stream (the forwards that wrote these blocks
        // included), then waited for: the engine loop waits here.
        if let Some(ticket) = self.kv_to_host_queue(blocks)? {
            self.kv_to_host_wait(ticket)?;
        }
        tracing::debug!(
            blocks = blocks.len(),
            ms = started.elapsed().as_secs_f64() * 1e3,
            "KV copied to the host copy"
        );
        Ok(())
    }

    fn kv_to_host_queue(&mut self, blocks: &[u32]) -> Result<Option<u64>, ModelError> {
        self.kv_tickets += 1;
        let ticket = self.kv_tickets;
        // Copies nobody waited for (their request was aborted) are long done; keep few.
        while self.kv_fences.len() >= 64 {
            if let Some((_, fence)) = self.kv_fences.pop_front() {
                fence.wait()?;
            }
        }
        let Some(region) = &self.host_kv else { return Ok(Some(ticket)) };
        let n = self.layout.block_elems();
        for run in coalesce(blocks) {
            let (first, count) = (run.start as usize, run.len as usize);
            check_run(&self.layout, first, count)?;
            // Safety: the engine owns these blocks (the trait's contract) and hands them to the
            // connector only after `kv_to_host_wait`; the region is page-locked for the model's
            // life (`_host_kv_pinned`), and the fence below is waited on before anyone reads it.
            unsafe {
                let dst: &mut [u16] = bytemuck::cast_slice_mut(region.bytes_mut(first, count));
                self.dev.download_into_async(&self.kv, first * n, dst)?;
            }
        }
        self.kv_fences.push_back((ticket, self.dev.fence()?));
        tracing::debug!(blocks = blocks.len(), ticket, "KV copy to the host copy queued behind the step");
        Ok(Some(ticket))
    }

    fn kv_to_host_wait(&mut self, ticket: u64) -> Result<(), ModelError> {
        while let Some((_, fence)) = self.kv_fences.pop_front_if(|(t, _)| *t <= ticket) {
            fence.wait()?;
        }
        Ok(())
    }

    fn kv_from_host(&mut self, blocks: &[u32]) -> Result<(), ModelError> {
        let Some(region) = self.host_kv.clone() else { return Ok(()) };
        let started = std::time::Instant::now();
        let n = self.layout.block_elems();
        for run in coalesce(blocks) {
            let (first, count) = (run.start as usize, run.len as usize);
            check_run(&self.layout, first, count)?;
            // Safety: the connector reported these blocks ready, so its writes are done and the
            // engine owns them again (the trait's contract).
            let src: &[u16] = bytemuck::cast_slice(unsafe { region.bytes(first, count) });
            // Stream-ordered before the next forward that reads these blocks.
            self.dev.write(&mut self.kv, first * n, src)?;
        }
        tracing::debug!(
            blocks = blocks.len(),
            ms = started.elapsed().as_secs_f64() * 1e3,
            "KV loaded from the host copy"
        );
        Ok(())
    }

    fn fingerprint(&self) -> String {
        self.fingerprint.clone()
    }

    fn execute(
        &mut self,
        token_ids: &[u32],
        seqs: &[SeqBatch<'_>],
        samples: &[SampleSpec],
    ) -> Result<Vec<u32>, ModelError> {
        if !self.pending.is_empty() {
            return Err(ModelError::Pipeline("a step runs alone while submitted steps await collection".into()));
        }
        self.launch_step(token_ids, seqs, samples)?;
        self.sample(samples)
    }

    // The ring decode kernel reports a stuck wait in the token copy; it runs one step at a time.
    fn can_pipeline(&self) -> bool {
        self.ring.is_none()
    }

    fn submit(&mut self, token_ids: &[u32], seqs: &[SeqBatch<'_>], samples: &[SampleSpec]) -> Result<(), ModelError> {
        if !self.can_pipeline() {
            return Err(ModelError::Pipeline("the ring decode kernel runs one step at a time".into()));
        }
        if self.pending.len() >= self.token_staging.len() {
            return Err(ModelError::Pipeline("two steps are already outstanding".into()));
        }
        self.launch_step(token_ids, seqs, samples)?;
        let slot = self.pending.back().map_or(0, |&(s, _)| (s + 1) % self.token_staging.len());
        self.dev.download_async(&self.act.tokens, samples.len(), &mut self.token_staging[slot])?;
        self.pending.push_back((slot, samples.len()));
        Ok(())
    }

    fn collect(&mut self) -> Result<Vec<u32>, ModelError> {
        let (slot, rows) =
            self.pending.pop_front().ok_or_else(|| ModelError::Pipeline("no step was submitted".into()))?;
        let vocab = self.cfg.vocab_size as i32;
        let tokens = self.token_staging[slot].host()?;
        Ok(tokens[..rows].iter().map(|&t| t.clamp(0, vocab - 1) as u32).collect())
    }
}

impl CudaModel {
    /// Queues one step up to its sampling kernels: metadata upload, the forward (a decode
    /// graph where one fits) and the sampler writing `act.tokens`. A carried token (see
    /// `crate::runner::CARRIED_TOKEN`) must name a row the previous step sampled.
    fn launch_step(
        &mut self,
        token_ids: &[u32],
        seqs: &[SeqBatch<'_>],
        samples: &[SampleSpec],
    ) -> Result<(), ModelError> {
        let rows = self.check_batch(token_ids, seqs)?;
        if rows != samples.len() {
            return Err(ModelError::Device(format!("{rows} sequences sample but {} sample specs", samples.len())));
        }
        check_carried(token_ids, self.last_rows)?;
        match self.graph_bucket(token_ids, seqs) {
            Some(bucket) => {
                self.fill_meta(token_ids, seqs, Some(bucket), samples)?;
                self.run_graph(bucket)?;
            }
            None => {
                self.fill_meta(token_ids, seqs, None, samples)?;
                self.run_forward(token_ids.len(), rows, None)?;
            }
        }
        self.launch_sampling(samples)?;
        self.last_rows = rows;
        Ok(())
    }
}

/// Puts weights on the device: generated there for a preset, uploaded from the host for a
/// checkpoint. Tensors named together are stacked row-wise into one buffer.
struct WeightBuilder<'a> {
    dev: &'a CudaDevice,
    preset: Option<(u64, HashMap<String, f32>)>,
    host: Option<crate::WeightMap>,
    bytes: usize,
}

impl<'a> WeightBuilder<'a> {
    fn new(dev: &'a CudaDevice, spec: &ModelSpec) -> Result<Self, ModelError> {
        match &spec.source {
            ModelSource::Preset { preset, seed } => {
                let stds = preset.tensor_specs().into_iter().map(|(n, _, std)| (n, std)).collect();
                Ok(Self { dev, preset: Some((*seed, stds)), host: None, bytes: 0 })
            }
            ModelSource::Dir(_) => Ok(Self { dev, preset: None, host: Some(spec.host_weights()?), bytes: 0 }),
        }
    }

    fn has(&self, name: &str) -> bool {
        match (&self.preset, &self.host) {
            (Some((_, stds)), _) => stds.contains_key(name),
            (_, Some(w)) => w.contains(name),
            _ => false,
        }
    }

    /// Stacks tensors `names` (with `rows[i]` rows of `cols` each) into one bf16 buffer.
    fn tensor(&mut self, names: &[&str], rows: &[usize], cols: usize) -> Result<DevBuf<u16>, ModelError> {
        let total: usize = rows.iter().sum::<usize>() * cols;
        let mut buf = self.dev.zeros::<u16>(total)?;
        let mut offset = 0;
        for (name, &r) in names.iter().zip(rows) {
            let n = r * cols;
            match (&self.preset, &mut self.host) {
                (Some((seed, stds)), _) => {
                    let std =
                        *stds.get(*name).ok_or_else(|| ModelError::MissingTensor { name: (*name).to_string() })?;
                    let ptr = buf.ptr_at(offset);
                    if std == 0.0 {
                        ops::fill_bf16(self.dev, ptr, n as u64, 1.0)?;
                    } else {
                        ops::preset_uniform(
                            self.dev,
                            ptr,
                            n as u64,
                            tensor_stream(*seed, name),
                            uniform_amplitude(std),
                        )?;
                    }
                }
                (_, Some(w)) => {
                    let shape: Vec<usize> = if cols == 1 { vec![r] } else { vec![r, cols] };
                    let data = w.take(name, &shape)?;
                    self.dev.write(&mut buf, offset, &to_bf16_bits(&data))?;
                }
                _ => unreachable!("a builder has a preset or host weights"),
            }
            offset += n;
        }
        self.bytes += total * 2;
        Ok(buf)
    }
}

/// What the step metadata is checked against.
#[derive(Clone, Copy, Debug)]
struct MetaLimits {
    block_size: usize,
    max_positions: usize,
    table_width: usize,
    /// Whether multi-token chunks go to the tensor-core prefill kernel (else the row kernel).
    flash: bool,
}

/// Puts the sampling parameters of `samples` (row r: top-k, then temperature, top-p and the
/// uniform draw as f32 bits) into the metadata header.
fn put_sampling(m: &MetaLayout, header: &mut [i32], samples: &[SampleSpec]) {
    for (r, s) in samples.iter().enumerate() {
        header[m.top_k + r] = s.top_k.min(i32::MAX as u32) as i32;
        let params = [s.temperature, s.top_p, s.uniform.clamp(0.0, 0.999_999_9)];
        for (i, p) in params.into_iter().enumerate() {
            header[m.params + 3 * r + i] = p.to_bits() as i32;
        }
    }
}

/// Fills the fixed part of the step metadata (`header`, laid out by `m`) for a batch, padded
/// with rows that write no KV and read block 0 up to `padded_tokens` tokens and
/// `padded_seqs` sequences, and returns the block tables (`padded_seqs` rows of the batch's
/// widest table) and the kernels' work counts. Host-side only, so it is tested without a GPU.
fn build_meta(
    m: &MetaLayout,
    header: &mut [i32],
    limits: &MetaLimits,
    token_ids: &[u32],
    seqs: &[SeqBatch<'_>],
    padded_tokens: usize,
    padded_seqs: usize,
) -> Result<(Vec<i32>, StepCounts), ModelError> {
    let bs = limits.block_size;
    let width = seqs.iter().map(|s| s.block_table.len()).max().unwrap_or(1).max(1);
    if width > limits.table_width {
        return Err(ModelError::Device(format!("block table of {width} blocks exceeds {}", limits.table_width)));
    }
    let hm = header;
    hm[m.stride] = width as i32;
    let mut tables = vec![0i32; padded_seqs.max(seqs.len()).max(1) * width];
    let mut n_decode = 0;
    let mut n_work = 0;
    let mut n_rows = 0;
    for (si, s) in seqs.iter().enumerate() {
        if s.token_start + s.num_tokens > token_ids.len() {
            return Err(ModelError::Device(format!("sequence {si} runs past the batch's {} tokens", token_ids.len())));
        }
        for (j, &b) in s.block_table.iter().enumerate() {
            tables[si * width + j] = b as i32;
        }
        hm[m.seq_tok + si] = s.token_start as i32;
        hm[m.seq_len + si] = s.num_tokens as i32;
        hm[m.seq_pos + si] = s.first_pos as i32;
        for k in 0..s.num_tokens {
            let t = s.token_start + k;
            let pos = s.first_pos + k;
            if pos >= limits.max_positions || pos / bs >= s.block_table.len() {
                return Err(ModelError::Device(format!("position {pos} outside the block table or RoPE table")));
            }
            hm[m.tokens + t] = token_ids[t] as i32;
            hm[m.positions + t] = pos as i32;
            hm[m.slots + t] = (s.block_table[pos / bs] as usize * bs + pos % bs) as i32;
            hm[m.tok_seq + t] = si as i32;
        }
        if limits.flash && s.num_tokens > 1 {
            // Latest tiles first: they see the most keys, and starting the longest work first
            // keeps the last wave short.
            for q0 in (0..s.num_tokens).step_by(FLASH_ROWS).rev() {
                hm[m.work + 2 * n_work] = si as i32;
                hm[m.work + 2 * n_work + 1] = q0 as i32;
                n_work += 1;
            }
        } else {
            for k in 0..s.num_tokens {
                hm[m.decode_list + n_decode] = (s.token_start + k) as i32;
                n_decode += 1;
            }
        }
        if s.want_logits && s.num_tokens > 0 {
            hm[m.rows + n_rows] = (s.token_start + s.num_tokens - 1) as i32;
            n_rows += 1;
        }
    }
    for t in token_ids.len()..padded_tokens {
        hm[m.tokens + t] = 0;
        hm[m.positions + t] = 0;
        hm[m.slots + t] = -1;
        hm[m.tok_seq + t] = t as i32;
        hm[m.decode_list + n_decode] = t as i32;
        n_decode += 1;
        hm[m.rows + n_rows] = t as i32;
        n_rows += 1;
    }
    let one_token_each = seqs.iter().all(|s| s.num_tokens <= 1);
    // Split the row attention when a listed token's context is long enough to take two ranges.
    let longest = (0..n_decode).map(|i| hm[m.positions + hm[m.decode_list + i] as usize] as usize + 1).max();
    let split = attention_split_most(n_decode) > 1 && longest.is_some_and(|ctx| ctx > SPLIT_KEYS);
    Ok((tables, StepCounts { decode: n_decode, work: n_work, one_token_each, split }))
}

/// Counts of the last prepared step.
#[derive(Clone, Copy, Debug, Default)]
struct StepCounts {
    /// Tokens for the row-wise attention kernel.
    decode: usize,
    /// Work items for the tensor-core prefill kernel.
    work: usize,
    /// Every sequence brings at most one token (a pure decode step).
    one_token_each: bool,
    /// The row-wise attention splits long contexts over several blocks ([`attention_split_most`]).
    split: bool,
}

/// Keys per range of a split decode attention before a token's context gets another range.
const SPLIT_KEYS: usize = 256;

/// Most key ranges per token for a row-attention launch over `decode` tokens: enough blocks
/// for about 16 ranges' worth per head in all, so batch 1 splits up to 16 ways and batches of
/// 16 or more not at all. Taken on the power of two at or above `decode`, so a CUDA-graph
/// step (padded to its bucket) and the same step launched kernel by kernel agree.
fn attention_split_most(decode: usize) -> usize {
    (16 / decode.max(1).next_power_of_two()).max(1)
}

/// A run outside the cache is an engine bug; say so instead of panicking in the region.
fn check_run(layout: &KvLayout, first: usize, count: usize) -> Result<(), ModelError> {
    if first + count > layout.num_blocks {
        return Err(ModelError::Device(format!(
            "KV blocks {first}..{} are outside the cache of {} blocks",
            first + count,
            layout.num_blocks
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_trace_summary_splits_each_stage_into_barrier_and_work() {
        // Two blocks, one layer: block 0 begins stage s at 10 s us and works 4 us, block 1
        // begins 0.5 us later and works 6 us.
        let mut stamps = vec![0u64; 2 * 5 * 2];
        for s in 0..5u64 {
            let at = |b: usize, k: usize| (b * 5 + s as usize) * 2 + k;
            stamps[at(0, 0)] = 10_000 * s;
            stamps[at(0, 1)] = 10_000 * s + 4_000;
            stamps[at(1, 0)] = 10_000 * s + 500;
            stamps[at(1, 1)] = 10_000 * s + 6_500;
        }
        let lines = ring_trace_summary(&stamps, 2, 1);
        assert!(lines[0].contains("step 46.5 us over 1 layers"), "{}", lines[0]);
        let cols = |l: &str| l.split_whitespace().skip(3).map(|v| v.parse::<f64>().unwrap()).collect::<Vec<_>>();
        assert_eq!(cols(&lines[1]), [6.5, 0.0, 6.0, 6.0], "qkv: {}", lines[1]);
        assert_eq!(cols(&lines[2]), [10.0, 3.5, 6.0, 6.0], "attention: {}", lines[2]);
        assert_eq!(lines.len(), 6);
        assert_eq!(ring_trace_summary(&stamps[..10], 2, 1), ["ring trace: no stamps"]);
    }

    fn limits(flash: bool) -> MetaLimits {
        MetaLimits { block_size: 4, max_positions: 1000, table_width: 64, flash }
    }

    #[test]
    fn meta_maps_positions_to_slots_and_splits_prefill_from_decode() {
        let m = MetaLayout::new(256, 8);
        let mut header = vec![0; m.tables];
        let (t0, t1) = (vec![7u32, 3], vec![2u32, 9, 5, 1, 6, 8, 4, 0, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]);
        // A decode token at position 5 and a 70-token chunk continuing at position 6.
        let ids: Vec<u32> = std::iter::once(42).chain(0..70).collect();
        let seqs = [
            SeqBatch { token_start: 0, num_tokens: 1, first_pos: 5, block_table: &t0, want_logits: true },
            SeqBatch { token_start: 1, num_tokens: 70, first_pos: 6, block_table: &t1, want_logits: true },
        ];
        let (tables, counts) = build_meta(&m, &mut header, &limits(true), &ids, &seqs, ids.len(), 2).unwrap();
        assert_eq!(header[m.stride], t1.len() as i32);
        assert_eq!(&tables[..2], &[7, 3]);
        assert_eq!(tables[t1.len()], 2);
        // Position 5 of sequence 0 is block t0[1] = 3, slot 1.
        assert_eq!(header[m.slots], 3 * 4 + 1);
        // Token 1 is position 6 of sequence 1: block t1[1] = 9, slot 2; token 70 is position 75.
        assert_eq!(header[m.slots + 1], 9 * 4 + 2);
        assert_eq!(header[m.positions + 70], 75);
        assert_eq!(header[m.slots + 70], t1[75 / 4] as i32 * 4 + 3);
        // The decode token goes to the row kernel, the chunk to two tensor-core tiles, latest first.
        assert_eq!(counts.decode, 1);
        assert_eq!(header[m.decode_list], 0);
        assert_eq!(counts.work, 2);
        assert_eq!(&header[m.work..m.work + 4], &[1, 64, 1, 0]);
        // Logits come from each sequence's last token.
        assert_eq!(&header[m.rows..m.rows + 2], &[0, 70]);
        // Without the tensor-core kernel every token goes to the row kernel.
        let (_, counts) = build_meta(&m, &mut header, &limits(false), &ids, &seqs, ids.len(), 2).unwrap();
        assert_eq!((counts.decode, counts.work), (71, 0));
    }

    #[test]
    fn sampling_parameters_ride_in_the_metadata_header() {
        let m = MetaLayout::new(64, 3);
        // Every region lies inside the header, none overlapping the next.
        let regions = [
            (m.stride, 1),
            (m.tokens, 64),
            (m.positions, 64),
            (m.slots, 64),
            (m.tok_seq, 64),
            (m.decode_list, 64),
            (m.work, 2 * (64usize.div_ceil(FLASH_ROWS) + 3)),
            (m.rows, 3),
            (m.seq_tok, 3),
            (m.seq_len, 3),
            (m.seq_pos, 3),
            (m.top_k, 3),
            (m.params, 9),
        ];
        for w in regions.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "{:?} runs into {:?}", w[0], w[1]);
        }
        assert_eq!(m.params + 9, m.tables);
        let mut header = vec![-7; m.tables];
        let top = SampleSpec { temperature: 0.7, top_k: 40, top_p: 0.9, uniform: 1.5, banned: vec![2] };
        let huge = SampleSpec { top_k: u32::MAX, ..SampleSpec::greedy() };
        put_sampling(&m, &mut header, &[top, huge]);
        assert_eq!(&header[m.top_k..m.top_k + 3], &[40, i32::MAX, -7]);
        let param = |i: usize| f32::from_bits(header[m.params + i] as u32);
        // The draw stays below 1 (the kernel's walk needs a target inside the mass).
        assert_eq!([param(0), param(1), param(2)], [0.7, 0.9, 0.999_999_9]);
        assert_eq!([param(3), param(4), param(5)], [0.0, 1.0, 0.0]);
        assert_eq!(header[m.params + 6], -7, "a row without a spec is left alone");
    }

    #[test]
    fn a_decode_graph_step_defines_everything_its_graph_reads() {
        // A bucket's layout is shared with other steps' leftovers (other layouts write other
        // offsets of the same buffer): a graph step must set every entry its kernels read.
        let m = MetaLayout::new(4, 8);
        assert!(m.tables < MetaLayout::new(4096, 8).tables / 100, "the bucket's header is small");
        let stale = i32::MIN;
        let mut header = vec![stale; m.tables];
        let (ta, tb) = ([5u32, 6], [9u32]);
        let seqs = [
            SeqBatch { token_start: 0, num_tokens: 1, first_pos: 6, block_table: &ta, want_logits: true },
            SeqBatch { token_start: 1, num_tokens: 1, first_pos: 2, block_table: &tb, want_logits: true },
        ];
        let (tables, counts) = build_meta(&m, &mut header, &limits(true), &[3, 4], &seqs, 4, 4).unwrap();
        assert_eq!((counts.decode, counts.work), (4, 0));
        assert_ne!(header[m.stride], stale);
        for region in [m.tokens, m.positions, m.slots, m.tok_seq, m.decode_list, m.rows] {
            assert!(header[region..region + 4].iter().all(|&v| v != stale), "region at {region}: {header:?}");
        }
        assert_eq!(tables.len(), 4 * 2, "a table row for every padded sequence");
    }

    #[test]
    fn graph_padding_writes_nothing_and_reads_block_zero() {
        let m = MetaLayout::new(16, 8);
        let mut header = vec![0; m.tables];
        let table = [5u32, 6];
        let seqs = [SeqBatch { token_start: 0, num_tokens: 1, first_pos: 6, block_table: &table, want_logits: true }];
        let (tables, counts) = build_meta(&m, &mut header, &limits(true), &[9], &seqs, 4, 4).unwrap();
        assert_eq!(counts.decode, 4);
        for t in 1..4 {
            assert_eq!(header[m.slots + t], -1, "padding row {t} must not write KV");
            assert_eq!(header[m.positions + t], 0);
            assert_eq!(header[m.tok_seq + t], t as i32);
            assert_eq!(&tables[t * 2..t * 2 + 2], &[0, 0]);
        }
        assert_eq!(&header[m.rows..m.rows + 4], &[0, 1, 2, 3]);
    }

    #[test]
    fn long_decode_contexts_split_the_row_attention_at_small_batches() {
        let m = MetaLayout::new(64, 32);
        let mut header = vec![0; m.tables];
        let table: Vec<u32> = (0..100).collect();
        let limits = MetaLimits { block_size: 4, max_positions: 1000, table_width: 100, flash: true };
        let step = |header: &mut Vec<i32>, pos: usize, seqs_n: usize| {
            let seqs: Vec<SeqBatch<'_>> = (0..seqs_n)
                .map(|i| SeqBatch {
                    token_start: i,
                    num_tokens: 1,
                    first_pos: pos,
                    block_table: &table,
                    want_logits: true,
                })
                .collect();
            let ids = vec![1u32; seqs_n];
            build_meta(&m, header, &limits, &ids, &seqs, seqs_n, seqs_n).unwrap().1
        };
        // Context SPLIT_KEYS (position SPLIT_KEYS - 1) fits one range; one more key takes two.
        assert!(!step(&mut header, SPLIT_KEYS - 1, 1).split);
        assert!(step(&mut header, SPLIT_KEYS, 1).split);
        assert!(step(&mut header, SPLIT_KEYS, 8).split);
        // From 16 sequences on, one block per head is already plenty.
        assert!(!step(&mut header, SPLIT_KEYS, 16).split);
        assert_eq!(
            (1..=16).map(attention_split_most).collect::<Vec<_>>(),
            [16, 8, 4, 4, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1]
        );
    }

    #[test]
    fn meta_refuses_positions_outside_the_tables() {
        let m = MetaLayout::new(16, 8);
        let mut header = vec![0; m.tables];
        let table = [1u32];
        let seqs = [SeqBatch { token_start: 0, num_tokens: 1, first_pos: 4, block_table: &table, want_logits: true }];
        assert!(build_meta(&m, &mut header, &limits(true), &[1], &seqs, 1, 1).is_err());
        let short = [SeqBatch { token_start: 0, num_tokens: 3, first_pos: 0, block_table: &table, want_logits: true }];
        assert!(build_meta(&m, &mut header, &limits(true), &[1], &short, 1, 1).is_err());
    }
}
