//! The decoder-only transformer shared by Qwen3, Qwen3-MoE, Qwen2 and Llama, run over a paged KV
//! cache.
//!
//! Follows transformers' `modeling_qwen3.py`, `modeling_qwen3_moe.py`, `modeling_qwen2.py` and
//! `modeling_llama.py` (eager attention, f32): greedy outputs must match them token for token
//! (fixtures/).
//!
//! Weights are immutable (`&self`); all per-sequence state (the KV cache and each sequence's
//! block table) is passed in. The model knows nothing about requests or scheduling.

use std::ops::Range;
use tandem_compute::cpu::{
    add_inplace, apply_rope, matmul_t, matmul_t_quant, matmul_t_segmented, paged_attention, rms_norm, rms_norm_inplace,
    silu_mul, AttnSeq, RopeTable, WeightMemory,
};

use tandem_compute::{KvCache, KvLayout};

use crate::config::ModelConfig;
use crate::weights::{Matrix, WeightMap};
use crate::ModelError;

/// One sequence's slice of a forward batch.
///
/// Tokens `token_start..token_start + num_tokens` of the batch belong to this sequence and sit
/// at positions `first_pos..first_pos + num_tokens`. Keys and values for positions before
/// `first_pos` must already be in the cache; the forward writes the new ones. `block_table`
/// must cover every position up to `first_pos + num_tokens`.
#[derive(Clone, Copy, Debug)]
pub struct SeqBatch<'a> {
    /// First token of this sequence in the batch.
    pub token_start: usize,
    /// Tokens of this sequence in the batch.
    pub num_tokens: usize,
    /// Position of the first token.
    pub first_pos: usize,
    /// Physical blocks, in position order.
    pub block_table: &'a [u32],
    /// Whether to compute logits for the last token.
    pub want_logits: bool,
}

/// `out = x · Wᵀ` for `tokens` rows of `x` and the `rows` x `cols` matrix `w`.
fn matmul(x: &[f32], tokens: usize, w: &Matrix, rows: usize, cols: usize, out: &mut [f32]) {
    match w {
        Matrix::F32(w) => matmul_t(x, tokens, w, rows, cols, out),
        Matrix::Quant(w) => matmul_t_quant(x, tokens, w, out),
    }
}

/// A `[out, in]` weight matrix with an optional bias: stacked projections (q, k, v) as one f32
/// matrix, or as their parts when they are kept in block formats (each may have its own).
struct Linear {
    /// Each part and its rows, in output order.
    parts: Vec<(Matrix, usize)>,
    bias: Option<Vec<f32>>,
    out_dim: usize,
    in_dim: usize,
}

impl Linear {
    /// Takes `{prefix}.{name}.weight` (and `.bias`) for each of `names` (a name and its rows),
    /// stacked in that order.
    fn load(
        w: &mut WeightMap,
        prefix: &str,
        names: &[(&str, usize)],
        in_dim: usize,
        bias: bool,
    ) -> Result<Self, ModelError> {
        let whole: Vec<(&str, usize, Range<usize>)> = names.iter().map(|&(n, rows)| (n, rows, 0..rows)).collect();
        Self::load_rows(w, prefix, &whole, in_dim, bias, None)
    }

    /// As [`Linear::load`], keeping rows `range` of each (a tensor-parallel rank's); `sample`
    /// gets the whole matrices first (the fingerprint's).
    fn load_rows(
        w: &mut WeightMap,
        prefix: &str,
        names: &[(&str, usize, Range<usize>)],
        in_dim: usize,
        bias: bool,
        sample: Option<&mut Vec<f32>>,
    ) -> Result<Self, ModelError> {
        let mut whole = Vec::new();
        let mut b = Vec::new();
        for (n, rows, range) in names {
            whole.push((w.take_matrix(&format!("{prefix}.{n}.weight"), *rows, in_dim)?, *rows));
            if bias {
                b.extend_from_slice(&w.take(&format!("{prefix}.{n}.bias"), &[*rows])?[range.clone()]);
            }
        }
        if let Some(sample) = sample {
            *sample = matrix_sample(&whole.iter().map(|(m, r)| (m, *r)).collect::<Vec<_>>(), in_dim);
        }
        let mut parts = Vec::new();
        for ((m, _), (_, _, range)) in whole.into_iter().zip(names) {
            parts.push((take_rows(m, in_dim, range.clone())?, range.len()));
        }
        Ok(Self::from_parts(parts, bias.then_some(b), in_dim))
    }

    /// Parts (each a matrix and its rows) stacked into one product; f32 parts as one matrix,
    /// so that the input is read once.
    fn from_parts(mut parts: Vec<(Matrix, usize)>, bias: Option<Vec<f32>>, in_dim: usize) -> Self {
        let out_dim = parts.iter().map(|(_, r)| r).sum();
        let f32_parts: Vec<&[f32]> = parts
            .iter()
            .filter_map(|(m, _)| match m {
                Matrix::F32(v) => Some(&v[..]),
                Matrix::Quant(_) => None,
            })
            .collect();
        if parts.len() > 1 && f32_parts.len() == parts.len() {
            let weight = WeightMemory::concat(&f32_parts);
            parts = vec![(Matrix::F32(weight), out_dim)];
        }
        Linear { parts, bias, out_dim, in_dim }
    }

    /// `y = x · Wᵀ (+ bias)` for `tokens` rows of `x`, into `y` (resized; `part` is scratch
    /// for matrices kept in parts).
    fn forward_into(&self, x: &[f32], tokens: usize, y: &mut Vec<f32>, part: &mut Vec<f32>) {
        resize(y, tokens * self.out_dim);
        if let [(w, rows)] = &self.parts[..] {
            matmul(x, tokens, w, *rows, self.in_dim, y);
        } else {
            let mut col = 0;
            for (w, rows) in &self.parts {
                resize(part, tokens * rows);
                matmul(x, tokens, w, *rows, self.in_dim, part);
                for (dst, src) in y.chunks_exact_mut(self.out_dim).zip(part.chunks_exact(*rows)) {
                    dst[col..col + rows].copy_from_slice(src);
                }
                col += rows;
            }
        }
        if let Some(b) = &self.bias {
            for row in y.chunks_exact_mut(self.out_dim) {
                add_inplace(row, b);
            }
        }
    }

    fn bytes(&self) -> usize {
        self.parts.iter().map(|(w, _)| matrix_bytes(w)).sum::<usize>() + self.bias.as_ref().map_or(0, |b| b.len() * 4)
    }
}

fn matrix_bytes(w: &Matrix) -> usize {
    match w {
        Matrix::F32(w) => w.len() * 4,
        Matrix::Quant(w) => w.bytes(),
    }
}

/// Row `r` of `w` (`cols` wide) into `out`.
fn matrix_row(w: &Matrix, r: usize, cols: usize, out: &mut [f32]) {
    match w {
        Matrix::F32(w) => out.copy_from_slice(&w[r * cols..(r + 1) * cols]),
        Matrix::Quant(w) => w.dequantize_row(r, out),
    }
}

/// About 4096 evenly spaced values of the matrix stacked from `parts` (each a matrix and its
/// rows, `cols` wide), as f32: a fingerprint's sample, the same values whether the parts are
/// kept quantized or were dequantized at load.
fn matrix_sample(parts: &[(&Matrix, usize)], cols: usize) -> Vec<f32> {
    let len = parts.iter().map(|(_, r)| r).sum::<usize>() * cols;
    let mut row = vec![0.0; cols];
    let mut at = usize::MAX;
    (0..len)
        .step_by((len / 4096).max(1))
        .map(|i| {
            if i / cols != at {
                at = i / cols;
                let (mut part, mut r) = (0, at);
                while r >= parts[part].1 {
                    r -= parts[part].1;
                    part += 1;
                }
                matrix_row(parts[part].0, r, cols, &mut row);
            }
            row[i % cols]
        })
        .collect()
}

/// A matrix's rows `range`, of `cols` columns (a block-format matrix only whole).
fn take_rows(m: Matrix, cols: usize, range: Range<usize>) -> Result<Matrix, ModelError> {
    match m {
        Matrix::F32(w) if range.start == 0 && range.end * cols == w.len() => Ok(Matrix::F32(w)),
        Matrix::F32(w) => Ok(Matrix::F32(WeightMemory::concat(&[&w[range.start * cols..range.end * cols]]))),
        Matrix::Quant(q) if range.start == 0 && range.end == q.rows() => Ok(Matrix::Quant(q)),
        Matrix::Quant(_) => Err(kept_whole()),
    }
}

fn kept_whole() -> ModelError {
    ModelError::UnsupportedConfig(
        "tensor parallelism over weights kept in a GGUF block format (they are kept whole)".into(),
    )
}

/// A row-parallel product (attention's output projection, the MLP's down projection): each dot
/// product taken in the model's reduction groups along its input (`ModelConfig::
/// reduction_groups`), the groups' parts summed pairwise, a balanced tree
/// (`matmul_t_segmented`). A tensor-parallel rank holds a contiguous run of the groups' columns
/// and sums its parts the same way; the ranks' sums are then added in the tree's upper levels
/// (the all-reduce of `crate::tp`), so that any rank count gives the bits of one rank. The
/// bias is added once, after the sum.
struct SplitK {
    /// This rank's columns, `[out_dim, in_dim]`.
    w: Matrix,
    /// Reduction groups among them.
    segments: usize,
    in_dim: usize,
    out_dim: usize,
    bias: Option<Vec<f32>>,
}

impl SplitK {
    /// Matrix `m` (`[rows, cols]`) in `groups` column groups, keeping groups `keep`.
    fn new(
        m: Matrix,
        rows: usize,
        cols: usize,
        groups: usize,
        keep: Range<usize>,
        bias: Option<Vec<f32>>,
    ) -> Result<Self, ModelError> {
        let group_in = cols / groups;
        let (start, end) = (keep.start * group_in, keep.end * group_in);
        let w = match m {
            m if keep.len() == groups => m,
            Matrix::F32(w) => {
                let kept: Vec<&[f32]> = (0..rows).map(|r| &w[r * cols + start..r * cols + end]).collect();
                Matrix::F32(WeightMemory::concat(&kept))
            }
            Matrix::Quant(_) => return Err(kept_whole()),
        };
        Ok(Self { w, segments: keep.len(), in_dim: end - start, out_dim: rows, bias })
    }

    /// This rank's sum of its groups' parts for `t` rows of `x` (`[t, in_dim]`), into `out`,
    /// without the bias.
    fn forward_partial(&self, x: &[f32], t: usize, out: &mut Vec<f32>) {
        resize(out, t * self.out_dim);
        match &self.w {
            Matrix::F32(w) => matmul_t_segmented(x, t, w, self.out_dim, self.in_dim, self.segments, out),
            // Block formats run whole (one group: see `kept_whole`).
            Matrix::Quant(w) => matmul_t_quant(x, t, w, out),
        }
    }

    fn add_bias(&self, y: &mut [f32]) {
        if let Some(b) = &self.bias {
            for row in y.chunks_exact_mut(self.out_dim) {
                add_inplace(row, b);
            }
        }
    }

    fn bytes(&self) -> usize {
        matrix_bytes(&self.w) + self.bias.as_ref().map_or(0, |b| b.len() * 4)
    }
}

/// The part of a model one instance holds: rank `rank` of `size` tensor-parallel ranks, each
/// with its share of the attention heads (KV heads shared out, or repeated where there are
/// fewer than ranks), of the MLP's inner width, and of the row-parallel products' groups.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    /// This rank, from 0.
    pub rank: usize,
    /// Ranks in all.
    pub size: usize,
}

impl Shard {
    /// The whole model, one rank.
    pub const WHOLE: Shard = Shard { rank: 0, size: 1 };

    /// Whether `cfg` splits over `size` ranks, saying why not.
    pub fn check(size: usize, cfg: &ModelConfig) -> Result<(), ModelError> {
        let bad = |why: String| Err(ModelError::UnsupportedConfig(format!("--tensor-parallel-size {size}: {why}")));
        let g = cfg.reduction_groups;
        match size {
            0 => bad("at least 1".into()),
            1 => Ok(()),
            _ if cfg.moe.is_some() => bad("a mixture of experts does not split over ranks yet".into()),
            _ if !size.is_power_of_two() || !g.is_multiple_of(size) => bad(format!(
                "this model's sums split into {g} parts (its {} attention heads and MLP width {}; 1 for a GGUF file), so it runs on a power of two up to {g} ranks",
                cfg.num_heads, cfg.intermediate_size
            )),
            _ if !(cfg.num_kv_heads.is_multiple_of(size) || size.is_multiple_of(cfg.num_kv_heads)) => bad(format!(
                "its {} KV heads neither divide among the ranks nor repeat evenly over them",
                cfg.num_kv_heads
            )),
            _ => Ok(()),
        }
    }

    /// This rank's query heads.
    fn heads(&self, cfg: &ModelConfig) -> Range<usize> {
        let per = cfg.num_heads / self.size;
        self.rank * per..(self.rank + 1) * per
    }

    /// This rank's KV heads (one repeated on several ranks when there are fewer than ranks).
    fn kv_heads(&self, cfg: &ModelConfig) -> Range<usize> {
        let n = cfg.num_kv_heads;
        if n >= self.size {
            let per = n / self.size;
            self.rank * per..(self.rank + 1) * per
        } else {
            let head = self.rank / (self.size / n);
            head..head + 1
        }
    }

    /// This rank's share of `len` (the MLP's inner width, the row-parallel groups).
    fn share(&self, len: usize) -> Range<usize> {
        let per = len / self.size;
        self.rank * per..(self.rank + 1) * per
    }
}

/// The fingerprint of a model whose embedding is `embed` and whose first layer's stacked q, k
/// and v sample to `qkv_sample` ([`matrix_sample`]).
fn fingerprint(c: &ModelConfig, embed: &Matrix, qkv_sample: &[f32]) -> String {
    let mut h = 0xcbf29ce484222325u64;
    let mut feed = |xs: &[f32]| {
        for x in xs.iter().step_by((xs.len() / 4096).max(1)) {
            h = (h ^ x.to_bits() as u64).wrapping_mul(0x100000001b3);
        }
    };
    feed(&matrix_sample(&[(embed, c.vocab_size)], c.hidden_size));
    feed(qkv_sample);
    format!(
        "{}/l{}h{}kv{}d{}v{}/{h:016x}",
        c.architecture.hf_name(),
        c.num_layers,
        c.hidden_size,
        c.num_kv_heads,
        c.head_dim,
        c.vocab_size
    )
}

/// One decoder layer's weights.
struct Layer {
    input_norm: Vec<f32>,
    /// q, k and v projections stacked into one matrix: one pass over the input.
    qkv: Linear,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    o: SplitK,
    post_norm: Vec<f32>,
    mlp: Mlp,
}

/// A layer's MLP.
enum Mlp {
    /// gate and up projections stacked (`[gate; up]`), then down.
    Dense { gate_up: Linear, down: SplitK },
    /// A mixture of experts.
    Experts(Experts),
}

/// A sparse layer's router and experts (Qwen3-MoE).
struct Experts {
    /// `[num_experts, hidden]`: each expert's logit for a token.
    router: Matrix,
    /// Each expert's gate and up projections stacked (`[gate; up]`) and its down projection.
    experts: Vec<(Linear, Linear)>,
    /// Experts each token goes through.
    top_k: usize,
    /// The chosen experts' probabilities scaled to sum to one.
    norm_topk_prob: bool,
    /// Each expert's inner width.
    inter: usize,
}

impl Experts {
    /// Layer `prefix`'s router and experts: one tensor each per expert (the Hub's layout), or
    /// all experts stacked in one tensor each (transformers 5's in-memory layout).
    fn load(w: &mut WeightMap, prefix: &str, moe: &crate::config::MoeConfig, h: usize) -> Result<Self, ModelError> {
        let (n, inter) = (moe.num_experts, moe.moe_intermediate_size);
        let router = w.take_matrix(&format!("{prefix}.mlp.gate.weight"), n, h)?;
        let stacked_gate_up = format!("{prefix}.mlp.experts.gate_up_proj");
        let experts = if w.contains(&stacked_gate_up) {
            let gate_up = w.take_stacked(&stacked_gate_up, n, 2 * inter, h)?;
            let down = w.take_stacked(&format!("{prefix}.mlp.experts.down_proj"), n, h, inter)?;
            let linear = |m: Vec<f32>, rows: usize, in_dim: usize| {
                Linear::from_parts(vec![(Matrix::F32(WeightMemory::concat(&[&m])), rows)], None, in_dim)
            };
            gate_up.into_iter().zip(down).map(|(gu, d)| (linear(gu, 2 * inter, h), linear(d, h, inter))).collect()
        } else {
            (0..n)
                .map(|e| {
                    let x = format!("mlp.experts.{e}");
                    let gate_up = Linear::load(
                        w,
                        prefix,
                        &[(&format!("{x}.gate_proj"), inter), (&format!("{x}.up_proj"), inter)],
                        h,
                        false,
                    )?;
                    Ok((gate_up, Linear::load(w, prefix, &[(&format!("{x}.down_proj"), h)], inter, false)?))
                })
                .collect::<Result<Vec<_>, ModelError>>()?
        };
        Ok(Experts { router, experts, top_k: moe.num_experts_per_tok, norm_topk_prob: moe.norm_topk_prob, inter })
    }

    /// The mixture's output for `t` rows of `x` (`hidden` wide) into `out`, as transformers
    /// computes it: softmax over the router's logits, the `top_k` most probable experts
    /// (renormalised when `norm_topk_prob`), each expert's MLP on the tokens that chose it times
    /// the token's weight, summed into zeros in ascending expert order.
    /// Returns how many experts ran.
    fn forward_into(&self, x: &[f32], t: usize, hidden: usize, out: &mut Vec<f32>, s: &mut ExpertScratch) -> usize {
        let n = self.experts.len();
        resize(&mut s.logits, t * n);
        matmul(x, t, &self.router, n, hidden, &mut s.logits);
        for routes in s.routes.iter_mut() {
            routes.clear();
        }
        s.routes.resize_with(n, Vec::new);
        let mut order: Vec<usize> = Vec::with_capacity(n);
        let mut probs = vec![0f32; n];
        for (token, logits) in s.logits.chunks_exact(n).enumerate() {
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0;
            for (p, &l) in probs.iter_mut().zip(logits) {
                *p = (l - max).exp();
                sum += *p;
            }
            for p in probs.iter_mut() {
                *p /= sum;
            }
            order.clear();
            order.extend(0..n);
            // Most probable first; the lower index first among equals.
            order.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]).then(a.cmp(&b)));
            let chosen = &order[..self.top_k];
            let total: f32 = if self.norm_topk_prob { chosen.iter().map(|&e| probs[e]).sum() } else { 1.0 };
            for &e in chosen {
                let weight = if self.norm_topk_prob { probs[e] / total } else { probs[e] };
                s.routes[e].push((token, weight));
            }
        }
        resize(out, t * hidden);
        out.fill(0.0);
        let mut ran = 0;
        for ((gate_up, down), routes) in self.experts.iter().zip(&s.routes) {
            if routes.is_empty() {
                continue;
            }
            ran += 1;
            let rows = routes.len();
            resize(&mut s.input, rows * hidden);
            for (dst, &(token, _)) in s.input.chunks_exact_mut(hidden).zip(routes) {
                dst.copy_from_slice(&x[token * hidden..(token + 1) * hidden]);
            }
            gate_up.forward_into(&s.input, rows, &mut s.gate_up, &mut s.part);
            resize(&mut s.act, rows * self.inter);
            silu_mul(&s.gate_up, self.inter, &mut s.act);
            down.forward_into(&s.act, rows, &mut s.output, &mut s.part);
            for (y, &(token, weight)) in s.output.chunks_exact(hidden).zip(routes) {
                for (o, &v) in out[token * hidden..(token + 1) * hidden].iter_mut().zip(y) {
                    *o += v * weight;
                }
            }
        }
        ran
    }

    /// Bytes of one expert's weights.
    fn expert_bytes(&self) -> usize {
        self.experts.first().map_or(0, |(g, d)| g.bytes() + d.bytes())
    }
}

/// A mixture's working buffers.
#[derive(Default)]
struct ExpertScratch {
    logits: Vec<f32>,
    /// Per expert, the (token, weight) pairs routed to it.
    routes: Vec<Vec<(usize, f32)>>,
    input: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
    output: Vec<f32>,
    part: Vec<f32>,
}

/// `v` with exactly `len` elements, keeping its allocation (the values are overwritten by
/// whoever resizes).
fn resize(v: &mut Vec<f32>, len: usize) {
    v.resize(len, 0.0);
}

/// A forward's working buffers, kept between forwards: a prefill's are megabytes, which a fresh
/// allocation would page-fault in again on every step.
#[derive(Default)]
struct Scratch {
    x: Vec<f32>,
    normed: Vec<f32>,
    qkv: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
    part: Vec<f32>,
    experts: ExpertScratch,
}

/// A loaded model, ready to run forwards.
pub struct Transformer {
    cfg: ModelConfig,
    embed: Matrix,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    /// `None` when tied to `embed`.
    lm_head: Option<Matrix>,
    rope: RopeTable,
    /// Taken by one forward at a time (an engine runs one step at a time; a second caller
    /// waits for the first).
    scratch: std::sync::Mutex<Scratch>,
    /// Bytes of weights the last forward read (a mixture of experts reads those its tokens
    /// chose): the decode floor's numerator, which `bench engine` reads after each step.
    weights_read: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    /// The whole model's (every rank's is the same).
    fingerprint: String,
    /// This rank's query heads, KV heads and MLP inner width.
    local: LocalDims,
    /// Only rank 0 computes logits.
    computes_logits: bool,
}

/// What one tensor-parallel rank computes of a layer.
#[derive(Clone, Copy, Debug)]
struct LocalDims {
    heads: usize,
    kv_heads: usize,
    inter: usize,
}

impl Transformer {
    /// Builds the model from HF-named tensors, checking every shape against `cfg`. `max_positions`
    /// bounds the RoPE table (the engine's max model length).
    pub fn from_weights(cfg: ModelConfig, w: WeightMap, max_positions: usize) -> Result<Self, ModelError> {
        Self::from_weights_shard(cfg, w, max_positions, Shard::WHOLE)
    }

    /// As [`Transformer::from_weights`], keeping `shard`'s part of each layer (tensor
    /// parallelism: the ranks' forwards, their row-parallel sums added by a reduce, give the
    /// whole model's bits; see [`Transformer::forward_rank`]).
    pub fn from_weights_shard(
        cfg: ModelConfig,
        mut w: WeightMap,
        max_positions: usize,
        shard: Shard,
    ) -> Result<Self, ModelError> {
        Shard::check(shard.size, &cfg)?;
        let (h, hd) = (cfg.hidden_size, cfg.head_dim);
        let q_dim = cfg.num_heads * hd;
        let kv_dim = cfg.num_kv_heads * hd;
        let (heads, kv_heads, inter) = (shard.heads(&cfg), shard.kv_heads(&cfg), shard.share(cfg.intermediate_size));
        let rows = |heads: &Range<usize>| heads.start * hd..heads.end * hd;
        let groups = cfg.reduction_groups;
        let kept_groups = shard.share(groups);
        let embed = w.take_matrix("model.embed_tokens.weight", cfg.vocab_size, h)?;
        let mut qkv_sample = Vec::new();
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let p = format!("model.layers.{i}");
            let qkv = Linear::load_rows(
                &mut w,
                &p,
                &[
                    ("self_attn.q_proj", q_dim, rows(&heads)),
                    ("self_attn.k_proj", kv_dim, rows(&kv_heads)),
                    ("self_attn.v_proj", kv_dim, rows(&kv_heads)),
                ],
                h,
                cfg.qkv_bias,
                (i == 0).then_some(&mut qkv_sample),
            )?;
            let o_bias = if cfg.o_bias { Some(w.take(&format!("{p}.self_attn.o_proj.bias"), &[h])?) } else { None };
            let o = w.take_matrix(&format!("{p}.self_attn.o_proj.weight"), h, q_dim)?;
            let o = SplitK::new(o, h, q_dim, groups, kept_groups.clone(), o_bias)?;
            let mlp = match &cfg.moe {
                Some(moe) if moe.is_sparse(i) => Mlp::Experts(Experts::load(&mut w, &p, moe, h)?),
                _ => {
                    let i_dim = cfg.intermediate_size;
                    let gate_up = Linear::load_rows(
                        &mut w,
                        &p,
                        &[("mlp.gate_proj", i_dim, inter.clone()), ("mlp.up_proj", i_dim, inter.clone())],
                        h,
                        cfg.mlp_bias,
                        None,
                    )?;
                    let bias =
                        if cfg.mlp_bias { Some(w.take(&format!("{p}.mlp.down_proj.bias"), &[h])?) } else { None };
                    let down = w.take_matrix(&format!("{p}.mlp.down_proj.weight"), h, i_dim)?;
                    Mlp::Dense { gate_up, down: SplitK::new(down, h, i_dim, groups, kept_groups.clone(), bias)? }
                }
            };
            let (q_norm, k_norm) = if cfg.qk_norm {
                (
                    Some(w.take(&format!("{p}.self_attn.q_norm.weight"), &[hd])?),
                    Some(w.take(&format!("{p}.self_attn.k_norm.weight"), &[hd])?),
                )
            } else {
                (None, None)
            };
            layers.push(Layer {
                input_norm: w.take(&format!("{p}.input_layernorm.weight"), &[h])?,
                qkv,
                q_norm,
                k_norm,
                o,
                post_norm: w.take(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
                mlp,
            });
        }
        let norm = w.take("model.norm.weight", &[h])?;
        let lm_head = if cfg.tie_word_embeddings && !w.contains("lm_head.weight") {
            None
        } else {
            Some(w.take_matrix("lm_head.weight", cfg.vocab_size, h)?)
        };
        let rope = RopeTable::new(hd, cfg.rope_theta, cfg.rope_scaling, max_positions);
        let fingerprint = fingerprint(&cfg, &embed, &qkv_sample);
        let local = LocalDims { heads: heads.len(), kv_heads: kv_heads.len(), inter: inter.len() };
        Ok(Self {
            cfg,
            embed,
            layers,
            norm,
            lm_head,
            rope,
            scratch: Default::default(),
            weights_read: Default::default(),
            fingerprint,
            local,
            computes_logits: shard.rank == 0,
        })
    }

    /// The model's shape.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Positions the RoPE table covers (the longest sequence this instance can run).
    pub fn max_positions(&self) -> usize {
        self.rope.max_positions()
    }

    /// The KV cache shape this model needs for `num_blocks` blocks of `block_size` tokens.
    pub fn kv_layout(&self, block_size: usize, num_blocks: usize) -> KvLayout {
        KvLayout {
            num_layers: self.cfg.num_layers,
            num_kv_heads: self.local.kv_heads,
            head_dim: self.cfg.head_dim,
            block_size,
            num_blocks,
        }
    }

    /// Identifies these weights for KV compatibility checks: the architecture, the shape and a
    /// hash of a sample of the embedding and first layer. Engines whose KV would mean different
    /// things get different fingerprints; every tensor-parallel rank's is the whole model's.
    pub fn fingerprint(&self) -> String {
        self.fingerprint.clone()
    }

    /// The bytes of weights each forward read, as it ends (shared: it stays readable after the
    /// model is moved into an engine).
    pub fn weights_read(&self) -> std::sync::Arc<std::sync::atomic::AtomicUsize> {
        self.weights_read.clone()
    }

    /// Bytes of the weights every forward reads whatever its tokens: all but the experts.
    fn fixed_weight_bytes(&self) -> usize {
        let layer_bytes: usize = self
            .layers
            .iter()
            .map(|l| {
                let mlp = match &l.mlp {
                    Mlp::Dense { gate_up, down } => gate_up.bytes() + down.bytes(),
                    Mlp::Experts(e) => matrix_bytes(&e.router),
                };
                l.qkv.bytes() + l.o.bytes() + mlp + (l.input_norm.len() + l.post_norm.len()) * 4
            })
            .sum();
        let head = matrix_bytes(self.lm_head.as_ref().unwrap_or(&self.embed));
        layer_bytes + head + self.norm.len() * 4
    }

    /// Bytes of weights one token's forward reads (as held: f32, or a block format), the
    /// numerator of the batch-1 decode floor: every weight of a dense model; of a mixture of
    /// experts, the router and the `num_experts_per_tok` experts a token goes through.
    pub fn weight_bytes(&self) -> usize {
        let experts: usize = self
            .layers
            .iter()
            .map(|l| match &l.mlp {
                Mlp::Experts(e) => e.top_k * e.expert_bytes(),
                Mlp::Dense { .. } => 0,
            })
            .sum();
        self.fixed_weight_bytes() + experts
    }

    /// Runs one batched forward over `token_ids` (all sequences' tokens, concatenated) and
    /// returns logits (`vocab_size` each) for the sequences with `want_logits`, in order.
    ///
    /// Token ids must be `< vocab_size` and positions `< max_positions()`; the engine checks
    /// both when it admits a request.
    pub fn forward(&self, token_ids: &[u32], seqs: &[SeqBatch<'_>], kv: &mut KvCache) -> Vec<f32> {
        self.forward_rank(token_ids, seqs, kv, &mut |_| {}, &mut |_| {})
    }

    /// [`Transformer::forward`], calling `kv_written(layer)` as each layer's keys and values
    /// for the step's tokens are in `kv` (so a KV connector can send them while the later
    /// layers compute).
    pub fn forward_with_kv_marks(
        &self,
        token_ids: &[u32],
        seqs: &[SeqBatch<'_>],
        kv: &mut KvCache,
        kv_written: &mut (dyn FnMut(usize) + Send),
    ) -> Vec<f32> {
        self.forward_rank(token_ids, seqs, kv, &mut |_| {}, kv_written)
    }

    /// One tensor-parallel rank's forward over its KV cache: `reduce` turns this rank's sum of
    /// each row-parallel product (twice a layer, `[tokens, hidden]`) into the ranks' total, in
    /// the order of a balanced tree over the ranks. Rank 0 returns the logits, the others nothing.
    /// `kv_written(layer)` is called once the layer's attention output has been reduced: by
    /// then every rank has written that layer's keys and values.
    pub fn forward_rank(
        &self,
        token_ids: &[u32],
        seqs: &[SeqBatch<'_>],
        kv: &mut KvCache,
        reduce: &mut (dyn FnMut(&mut [f32]) + Send),
        kv_written: &mut (dyn FnMut(usize) + Send),
    ) -> Vec<f32> {
        // On a thread of the compute pool, so that each of the step's parallel loops (some 150
        // at batch 1) is forked from inside the pool instead of waking it from outside and
        // sleeping until it is done: at batch 1 that cost 2-3 ms of a 12 ms step.
        rayon::scope(|_| self.forward_on_pool(token_ids, seqs, kv, reduce, kv_written))
    }

    fn forward_on_pool(
        &self,
        token_ids: &[u32],
        seqs: &[SeqBatch<'_>],
        kv: &mut KvCache,
        reduce: &mut (dyn FnMut(&mut [f32]) + Send),
        kv_written: &mut (dyn FnMut(usize) + Send),
    ) -> Vec<f32> {
        let cfg = &self.cfg;
        let (h, hd, nh, nkv) = (cfg.hidden_size, cfg.head_dim, self.local.heads, self.local.kv_heads);
        let (q_dim, kv_dim) = (nh * hd, nkv * hd);
        let t = token_ids.len();
        let block_size = kv.layout().block_size;

        let mut positions = vec![0usize; t];
        let mut slots = vec![(0usize, 0usize); t];
        for s in seqs {
            for i in 0..s.num_tokens {
                let pos = s.first_pos + i;
                positions[s.token_start + i] = pos;
                slots[s.token_start + i] = (s.block_table[pos / block_size] as usize, pos % block_size);
            }
        }
        let attn_seqs: Vec<AttnSeq<'_>> = seqs
            .iter()
            .map(|s| AttnSeq {
                query_start: s.token_start,
                num_queries: s.num_tokens,
                first_pos: s.first_pos,
                block_table: s.block_table,
            })
            .collect();

        // Never wait for the lock: a thread of the pool waiting inside one forward's parallel
        // loop may pick up another forward of this model (two engines' tests, say), which would
        // then wait for itself. Whoever finds the buffers taken uses fresh ones. A poisoned lock
        // only means an earlier forward panicked mid-way: the buffers are overwritten before
        // they are read.
        let mut fresh = Scratch::default();
        let mut guard = match self.scratch.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        };
        let Scratch { x, normed, qkv, q, k, v, attn, proj, gate_up, act, part, experts } = match guard.as_deref_mut() {
            Some(s) => s,
            None => &mut fresh,
        };
        resize(x, t * h);
        for (row, &id) in x.chunks_exact_mut(h).zip(token_ids) {
            matrix_row(&self.embed, id as usize, h, row);
        }
        let scale = 1.0 / (hd as f32).sqrt();
        resize(normed, t * h);
        resize(q, t * q_dim);
        resize(k, t * kv_dim);
        resize(v, t * kv_dim);
        resize(attn, t * q_dim);
        let mut expert_bytes_read = 0;
        for (li, layer) in self.layers.iter().enumerate() {
            rms_norm(x, &layer.input_norm, cfg.rms_norm_eps, normed);
            layer.qkv.forward_into(normed, t, qkv, part);
            for (r, row) in qkv.chunks_exact(q_dim + 2 * kv_dim).enumerate() {
                q[r * q_dim..(r + 1) * q_dim].copy_from_slice(&row[..q_dim]);
                k[r * kv_dim..(r + 1) * kv_dim].copy_from_slice(&row[q_dim..q_dim + kv_dim]);
                v[r * kv_dim..(r + 1) * kv_dim].copy_from_slice(&row[q_dim + kv_dim..]);
            }
            if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
                rms_norm_inplace(q, qn, cfg.rms_norm_eps);
                rms_norm_inplace(k, kn, cfg.rms_norm_eps);
            }
            apply_rope(q, nh, hd, &positions, &self.rope);
            apply_rope(k, nkv, hd, &positions, &self.rope);
            for (r, &(block, slot)) in slots.iter().enumerate() {
                kv.write_token(li, block, slot, &k[r * kv_dim..(r + 1) * kv_dim], &v[r * kv_dim..(r + 1) * kv_dim]);
            }
            paged_attention(q, nh, kv, li, &attn_seqs, scale, attn);
            layer.o.forward_partial(attn, t, proj);
            reduce(proj);
            kv_written(li);
            layer.o.add_bias(proj);
            add_inplace(x, proj);

            rms_norm(x, &layer.post_norm, cfg.rms_norm_eps, normed);
            match &layer.mlp {
                Mlp::Dense { gate_up: w_gate_up, down } => {
                    let inter = self.local.inter;
                    w_gate_up.forward_into(normed, t, gate_up, part);
                    resize(act, t * inter);
                    silu_mul(gate_up, inter, act);
                    down.forward_partial(act, t, proj);
                    reduce(proj);
                    down.add_bias(proj);
                }
                Mlp::Experts(e) => expert_bytes_read += e.forward_into(normed, t, h, proj, experts) * e.expert_bytes(),
            }
            add_inplace(x, proj);
        }

        if !self.computes_logits {
            return Vec::new();
        }
        // Only the last token of sequences that sample needs the (large) output projection.
        let picked: Vec<usize> = seqs
            .iter()
            .filter(|s| s.want_logits && s.num_tokens > 0)
            .map(|s| s.token_start + s.num_tokens - 1)
            .collect();
        let mut last = vec![0.0f32; picked.len() * h];
        for (dst, &row) in last.chunks_exact_mut(h).zip(&picked) {
            dst.copy_from_slice(&x[row * h..(row + 1) * h]);
        }
        let mut last_normed = vec![0.0f32; last.len()];
        rms_norm(&last, &self.norm, cfg.rms_norm_eps, &mut last_normed);
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        let mut logits = vec![0.0f32; picked.len() * cfg.vocab_size];
        matmul(&last_normed, picked.len(), head, cfg.vocab_size, h, &mut logits);
        self.weights_read.store(self.fixed_weight_bytes() + expert_bytes_read, std::sync::atomic::Ordering::Relaxed);
        logits
    }
}
