//! What one step needs besides the weights and the cache: the activations, the step metadata
//! (token ids, positions, cache slots, block tables, work lists and sampling parameters, laid
//! out in one device buffer and uploaded with one copy), and the page-locked copies that let a
//! step's upload and its sampled tokens' download overlap the previous step.

use std::collections::VecDeque;

use tandem_compute::cuda::ops::{self, AttnMeta, PrefillSeqs, FLASH_ROWS};
use tandem_compute::cuda::{CudaDevice, DevBuf, HostStaging};

use crate::config::ModelConfig;
use crate::runner::{token_logprobs, RowLogprobs, SampleSpec};
use crate::transformer::SeqBatch;
use crate::ModelError;

/// Per-step buffers, sized at load for the engine's largest step.
pub(super) struct StepBuffers {
    pub act: Activations,
    pub meta: DevBuf<i32>,
    /// The layout the current step (or graph capture) uses: `full_layout`, or a decode graph's
    /// own ([`StepBuffers::graph_layout`]).
    pub layout: MetaLayout,
    /// Sized for `max_tokens` tokens: any step.
    full_layout: MetaLayout,
    host: Vec<i32>,
    /// Page-locked copies of the header, alternating, so its upload returns at once even while
    /// the previous step runs.
    staging: [HostStaging<i32>; 2],
    /// Which header copy the next upload uses.
    turn: usize,
    /// Page-locked landing places of the sampled tokens, alternating between pipelined steps.
    token_staging: [HostStaging<i32>; 2],
    /// Beside each token slot, the raw logits of the rows that want log-probabilities (made
    /// when first needed, grown by powers of two rows).
    logit_staging: [Option<HostStaging<f32>>; 2],
    /// The prepared step's rows that want log-probabilities, with their top counts; their
    /// logits went to the next slot's `logit_staging`.
    logprob_rows: Vec<(usize, u32)>,
    /// Submitted steps whose tokens are not collected yet, oldest first.
    pending: VecDeque<PendingStep>,
    /// Rows the last step sampled (what a carried token may name).
    pub last_rows: usize,
    /// The prepared step's work counts.
    pub counts: StepCounts,
    limits: MetaLimits,
    pub max_tokens: usize,
    pub max_seqs: usize,
    /// The packed Hopper build keeps its folded sums in `act.attn_part`
    /// ([`ops::PrefillSeqs::fold_scratch`]).
    fold_l2: bool,
}

impl StepBuffers {
    /// Buffers for steps of up to `max_tokens` tokens over `max_seqs` sequences, positions up
    /// to `max_positions`.
    pub fn new(
        dev: &CudaDevice,
        cfg: &ModelConfig,
        max_tokens: usize,
        max_seqs: usize,
        block_size: usize,
        max_positions: usize,
        batch_invariant: bool,
    ) -> Result<Self, ModelError> {
        let max_tokens = max_tokens.max(max_seqs).max(1);
        let max_seqs = max_seqs.max(1);
        let flash = ops::flash_supported(cfg.head_dim);
        if batch_invariant && !flash {
            return Err(ModelError::Device(format!(
                "--batch-invariant needs the tensor-core attention, which takes head sizes 64 and 128, not {}",
                cfg.head_dim
            )));
        }
        let hopper = ops::wgmma_packed_takes(dev, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim);
        let packed = batch_invariant.then(|| ops::flash_packed_tokens(cfg.num_heads / cfg.num_kv_heads.max(1), hopper));
        let narrow =
            if batch_invariant { ops::narrow_tokens(dev, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) } else { 0 };
        // The Hopper build's folded sums in attn_part (tuned so): it is sized for them too.
        let fold_l2 = batch_invariant && hopper && dev.tuning().invariant_fold_l2;
        let tokens_per_item = packed.unwrap_or(FLASH_ROWS);
        let (t, h, i) = (max_tokens, cfg.hidden_size, cfg.intermediate_size);
        let (q_dim, kv_dim) = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim);
        let act = Activations {
            x: dev.zeros(t * h)?,
            x_alt: dev.zeros(if batch_invariant { ops::SKINNY_NORM_MAX_TOKENS.min(t) * h } else { 1 })?,
            normed: dev.zeros(t * h)?,
            qkv: dev.zeros(t * (q_dim + 2 * kv_dim))?,
            q: dev.zeros(t * q_dim)?,
            attn: dev.zeros(t * q_dim)?,
            proj: dev.zeros(t * h)?,
            gate_up: dev.zeros(t * 2 * i)?,
            act: dev.zeros(t * i)?,
            last: dev.zeros(max_seqs * h)?,
            logits: dev.zeros(max_seqs * cfg.vocab_size)?,
            tokens: dev.zeros(max_seqs)?,
            bans: dev.zeros(1024)?,
            sample_scratch: dev.zeros(ops::sample_scratch_len(max_seqs))?,
            parts: dev.zeros(if batch_invariant {
                let max_cols = dev.tuning().invariant_slice_cols;
                let slices = ops::invariant_slices(q_dim, max_cols).max(ops::invariant_slices(i, max_cols));
                if slices > 1 {
                    t * h * slices
                } else {
                    1
                }
            } else if dev.tuning().fp8_skinny != 0 {
                // Steps of up to 64 rows over FP8 weights: o's and down's K slices.
                ops::FP8_SKINNY_MAX_TOKENS.min(t) * h * ops::FP8_SKINNY_MAX_SLICES
            } else {
                1
            })?,
            attn_part: dev.zeros(if batch_invariant {
                // Split steps have at most 8 tokens (see `attention_split_most`).
                let split = ops::flash_split_floats(8, cfg.num_heads, cfg.head_dim, max_positions);
                split.max(if fold_l2 { ops::WGMMA_FOLD_SCRATCH_FLOATS } else { 0 })
            } else {
                ops::attention_split_floats(RowSplit::of(dev).ranges, cfg.num_heads, cfg.head_dim, 1)
            })?,
        };
        let table_width = max_positions.div_ceil(block_size).max(1);
        let layout = MetaLayout::new(max_tokens, max_seqs, tokens_per_item);
        let meta = dev.zeros(layout.tables + max_seqs * table_width)?;
        Ok(Self {
            staging: [dev.host_staging(meta.len())?, dev.host_staging(meta.len())?],
            token_staging: [dev.host_staging(max_seqs)?, dev.host_staging(max_seqs)?],
            logit_staging: [None, None],
            logprob_rows: Vec::new(),
            act,
            meta,
            layout,
            full_layout: layout,
            host: vec![0; layout.tables],
            turn: 0,
            pending: VecDeque::new(),
            last_rows: 0,
            counts: StepCounts::default(),
            limits: MetaLimits {
                block_size,
                max_positions,
                table_width,
                flash,
                packed,
                narrow,
                range_keys: ops::flash_range_keys(hopper),
                row_split: RowSplit::of(dev),
            },
            max_tokens,
            max_seqs,
            fold_l2,
        })
    }

    /// The number of logit rows of a batch, after checking it fits these buffers.
    pub fn check_batch(&self, token_ids: &[u32], seqs: &[SeqBatch<'_>]) -> Result<usize, ModelError> {
        if token_ids.len() > self.max_tokens || seqs.len() > self.max_seqs {
            return Err(ModelError::Device(format!(
                "batch of {} tokens / {} sequences exceeds this GPU instance's {} / {}",
                token_ids.len(),
                seqs.len(),
                self.max_tokens,
                self.max_seqs
            )));
        }
        Ok(seqs.iter().filter(|s| s.want_logits && s.num_tokens > 0).count())
    }

    /// The metadata layout of the decode graph for `bucket`: sized for `bucket` tokens, so a
    /// decode step uploads a few KB of header instead of one sized for the largest prefill
    /// (85 KB at a 4096-token limit) every step. Its steps define every entry the graph reads
    /// (padding rows included).
    pub fn graph_layout(&self, bucket: usize) -> MetaLayout {
        MetaLayout::new(bucket, self.max_seqs, self.limits.packed.unwrap_or(FLASH_ROWS))
    }

    /// Writes the metadata for the real batch, with the sampling parameters of `samples` (one
    /// per logit row, or none), all in one upload, in the layout the step runs with: for the
    /// decode graph of `graph_bucket`, its own layout, tokens and sequences padded to the bucket
    /// with rows that write nothing and read block 0; otherwise the full layout.
    pub fn fill(
        &mut self,
        dev: &CudaDevice,
        token_ids: &[u32],
        seqs: &[SeqBatch<'_>],
        graph_bucket: Option<usize>,
        samples: &[SampleSpec],
    ) -> Result<(), ModelError> {
        let (padded_tokens, padded_seqs) = graph_bucket.map_or((token_ids.len(), seqs.len()), |b| (b, b));
        self.layout = graph_bucket.map_or(self.full_layout, |b| self.graph_layout(b));
        let m = self.layout;
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
        self.host.resize(m.tables, 0);
        let (tables, counts) =
            build_meta(&m, &mut self.host, &self.limits, token_ids, seqs, padded_tokens, padded_seqs)?;
        self.counts = counts;
        put_sampling(&m, &mut self.host, samples);
        // The block tables follow the fixed part: one copy for both (each copy costs the engine
        // thread a driver call and the stream a transfer).
        self.host.extend_from_slice(&tables);
        let written = self.upload(dev);
        self.host.truncate(m.tables);
        written
    }

    /// Queues the upload of `host` through the next page-locked copy (waiting only if the
    /// upload two steps back has not run yet).
    fn upload(&mut self, dev: &CudaDevice) -> Result<(), ModelError> {
        let n = self.host.len();
        let staging = &mut self.staging[self.turn];
        if n > staging.len() || n > self.meta.len() {
            return Err(ModelError::Device(format!("{n} metadata entries for a buffer of {}", self.meta.len())));
        }
        staging.host_mut()?[..n].copy_from_slice(&self.host);
        dev.upload_async(&self.meta, 0, staging, n)?;
        self.turn = (self.turn + 1) % self.staging.len();
        Ok(())
    }

    /// The address of metadata entry `offset` (an offset of [`StepBuffers::layout`]).
    pub fn at(&self, offset: usize) -> u64 {
        self.meta.ptr_at(offset)
    }

    pub fn attn_meta(&self) -> AttnMeta {
        let m = self.layout;
        AttnMeta {
            positions: self.at(m.positions),
            tok_seq: self.at(m.tok_seq),
            block_tables: self.at(m.tables),
            stride: self.at(m.stride),
        }
    }

    pub fn prefill_seqs(&self, counts: StepCounts) -> PrefillSeqs {
        let m = self.layout;
        PrefillSeqs {
            work: self.at(m.work),
            num_items: counts.work,
            seq_tok: self.at(m.seq_tok),
            seq_len: self.at(m.seq_len),
            seq_pos: self.at(m.seq_pos),
            packed: self.limits.packed.is_some(),
            narrow: counts.narrow,
            fold_scratch: if self.fold_l2 { self.act.attn_part.ptr() } else { 0 },
        }
    }

    /// Whether a decode step's tokens are narrow work items ([`ops::narrow_tokens`]).
    pub fn narrow_decode(&self) -> bool {
        self.limits.narrow > 0
    }

    /// Whether every token's attention runs in the packed prefill kernel (batch-invariant
    /// serving: one kernel, so a token's result does not depend on how it was batched).
    pub fn batch_invariant(&self) -> bool {
        self.limits.packed.is_some()
    }

    /// The row kernel's key ranges spread over blocks, on steps `counts` marks split.
    pub fn row_split(&self, counts: StepCounts) -> Option<ops::AttnSplit> {
        (!self.batch_invariant() && counts.split).then(|| ops::AttnSplit {
            part: self.act.attn_part.ptr(),
            most: self.limits.row_split.most(counts.decode),
            split_keys: self.limits.row_split.keys,
        })
    }

    /// Whether a decode step of `bucket` sequences may split its contexts (and so has a split
    /// CUDA graph beside the plain one).
    pub fn splits_at(&self, bucket: usize) -> bool {
        if self.batch_invariant() {
            attention_split_most(bucket) > 1
        } else {
            self.limits.row_split.most(bucket) > 1
        }
    }

    /// The packed kernel's key ranges spread over blocks, on steps `counts` marks split.
    pub fn flash_split(&self, counts: StepCounts) -> Option<ops::FlashSplit> {
        (self.batch_invariant() && counts.split).then(|| ops::FlashSplit {
            part: self.act.attn_part.ptr(),
            blocks: attention_split_most(counts.work),
            max_ranges: self.limits.max_positions.div_ceil(self.limits.range_keys),
        })
    }

    /// Queues the sampling of `specs.len()` rows of logits into `act.tokens`. Their parameters
    /// went up with the step's metadata ([`StepBuffers::fill`]); banned ids go up here.
    pub fn launch_sampling(&mut self, dev: &CudaDevice, vocab: usize, specs: &[SampleSpec]) -> Result<(), ModelError> {
        if specs.len() > self.max_seqs {
            return Err(ModelError::Device(format!("{} sample specs for {} rows", specs.len(), self.max_seqs)));
        }
        self.stage_raw_logits(dev, vocab, specs)?;
        let mut ban_rows = Vec::new();
        let mut ban_toks = Vec::new();
        for (r, s) in specs.iter().enumerate() {
            for &b in &s.banned {
                ban_rows.push(r as i32);
                ban_toks.push(b as i32);
            }
        }
        let nb = ban_rows.len();
        let a = &mut self.act;
        if nb > 0 {
            if 2 * nb > a.bans.len() {
                a.bans = dev.zeros(4 * nb)?;
            }
            ban_rows.extend(ban_toks);
            dev.write(&mut a.bans, 0, &ban_rows)?;
            // Safety: `bans` holds the 2 x nb ids just written, `logits` max_seqs x vocab rows
            // (specs.len() <= max_seqs, checked by `fill`); both are the model's for its life.
            unsafe { ops::ban_tokens(dev, a.logits.ptr(), vocab, a.bans.ptr(), a.bans.ptr_at(nb), nb)? };
        }
        // Safety: logits, tokens and the sampler's scratch are sized for max_seqs rows, the
        // metadata's parameters for max_seqs sequences; all are the model's for its life.
        unsafe {
            ops::sample_rows(
                dev,
                a.logits.ptr(),
                vocab,
                self.meta.ptr_at(self.layout.params),
                self.meta.ptr_at(self.layout.top_k),
                a.tokens.ptr(),
                specs.len(),
                Some((a.sample_scratch.ptr(), self.max_seqs)),
            )?
        };
        Ok(())
    }

    /// Queues the copy of the raw logits (before bans, temperature or filtering touch them) of
    /// the rows whose spec wants log-probabilities into the next token slot's logit staging.
    /// Log-probabilities are then taken on the host from exactly the logits the sampler saw.
    fn stage_raw_logits(&mut self, dev: &CudaDevice, vocab: usize, specs: &[SampleSpec]) -> Result<(), ModelError> {
        self.logprob_rows = specs.iter().enumerate().filter_map(|(r, s)| s.logprobs.map(|top| (r, top))).collect();
        if self.logprob_rows.is_empty() {
            return Ok(());
        }
        let slot = self.next_slot();
        let need = self.logprob_rows.len() * vocab;
        if self.logit_staging[slot].as_ref().is_none_or(|s| s.len() < need) {
            // Dropping the old one waits for the last copy into it.
            self.logit_staging[slot] = Some(dev.host_staging(self.logprob_rows.len().next_power_of_two() * vocab)?);
        }
        let ranges: Vec<(usize, usize)> = self.logprob_rows.iter().map(|&(r, _)| (r * vocab, vocab)).collect();
        if let Some(staging) = self.logit_staging[slot].as_mut() {
            dev.download_ranges_async(&self.act.logits, &ranges, staging)?;
        }
        Ok(())
    }

    /// The token slot the next queued step uses (the one after the newest outstanding).
    fn next_slot(&self) -> usize {
        self.pending.back().map_or(0, |p| (p.slot + 1) % self.token_staging.len())
    }

    /// Each sampled row's log-probabilities where its spec asked (else `None`; empty when no
    /// row asked), from the raw logits staged in `slot`.
    fn logprobs(
        &self,
        slot: usize,
        wanted: &[(usize, u32)],
        tokens: &[u32],
        vocab: usize,
    ) -> Result<RowLogprobs, ModelError> {
        if wanted.is_empty() {
            return Ok(Vec::new());
        }
        let staging = self.logit_staging[slot]
            .as_ref()
            .ok_or_else(|| ModelError::Device("log-probabilities asked of a step that staged no logits".into()))?;
        let raw = staging.host()?;
        let mut out = vec![None; tokens.len()];
        for (i, &(row, top)) in wanted.iter().enumerate() {
            if let (Some(entry), Some(&token)) = (out.get_mut(row), tokens.get(row)) {
                *entry = Some(token_logprobs(&raw[i * vocab..(i + 1) * vocab], token, top));
            }
        }
        Ok(out)
    }

    /// Reads back the `rows` tokens the last step sampled (waits for the step), with their
    /// log-probabilities where asked.
    pub fn read_tokens(
        &self,
        dev: &CudaDevice,
        vocab: usize,
        rows: usize,
    ) -> Result<(Vec<u32>, RowLogprobs), ModelError> {
        let tokens = dev.read(&self.act.tokens, rows)?;
        let tokens: Vec<u32> = tokens.into_iter().map(|t| t.clamp(0, vocab as i32 - 1) as u32).collect();
        let logprobs = self.logprobs(self.next_slot(), &self.logprob_rows, &tokens, vocab)?;
        Ok((tokens, logprobs))
    }

    /// Whether a submitted step's tokens are still to be collected.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Whether another step's tokens can be queued (two may be outstanding).
    pub fn can_queue(&self) -> bool {
        self.pending.len() < self.token_staging.len()
    }

    /// Queues the download of the last step's `rows` sampled tokens into the next free
    /// page-locked landing place.
    pub fn queue_tokens(&mut self, dev: &CudaDevice, rows: usize) -> Result<(), ModelError> {
        if !self.can_queue() {
            return Err(ModelError::Pipeline("two steps are already outstanding".into()));
        }
        let slot = self.next_slot();
        dev.download_async(&self.act.tokens, rows, &mut self.token_staging[slot])?;
        self.pending.push_back(PendingStep { slot, rows, logprob_rows: std::mem::take(&mut self.logprob_rows) });
        Ok(())
    }

    /// The tokens of the oldest submitted step (waits for its download), with their
    /// log-probabilities where asked.
    pub fn collect_tokens(&mut self, vocab: usize) -> Result<(Vec<u32>, RowLogprobs), ModelError> {
        let step = self.pending.pop_front().ok_or_else(|| ModelError::Pipeline("no step was submitted".into()))?;
        let tokens = self.token_staging[step.slot].host()?;
        let tokens: Vec<u32> = tokens[..step.rows].iter().map(|&t| t.clamp(0, vocab as i32 - 1) as u32).collect();
        let logprobs = self.logprobs(step.slot, &step.logprob_rows, &tokens, vocab)?;
        Ok((tokens, logprobs))
    }
}

/// A submitted step whose tokens are still to be collected.
struct PendingStep {
    /// Its token (and logit) staging slot.
    slot: usize,
    rows: usize,
    /// Its rows that want log-probabilities, with their top counts.
    logprob_rows: Vec<(usize, u32)>,
}

/// Per-step activations, sized for `max_tokens` tokens and `max_seqs` sequences.
pub(super) struct Activations {
    pub x: DevBuf<f32>,
    /// The residual stream's other buffer for a batch-invariant step whose products take the
    /// norms in (`ops::matmul_t_skinny_norm` writes the sum elsewhere than it reads):
    /// [`ops::SKINNY_NORM_MAX_TOKENS`] rows.
    pub x_alt: DevBuf<f32>,
    pub normed: DevBuf<u16>,
    pub qkv: DevBuf<u16>,
    pub q: DevBuf<u16>,
    pub attn: DevBuf<u16>,
    /// Attention and MLP outputs (bf16, rounded as transformers rounds its projections).
    pub proj: DevBuf<u16>,
    pub gate_up: DevBuf<u16>,
    pub act: DevBuf<u16>,
    pub last: DevBuf<u16>,
    pub logits: DevBuf<f32>,
    pub tokens: DevBuf<i32>,
    pub bans: DevBuf<i32>,
    /// Counters and partial bests of greedy rows whose scan several blocks share
    /// ([`ops::sample_rows`]).
    pub sample_scratch: DevBuf<i32>,
    /// The K slices' partial products of batch-invariant o and down projections
    /// ([`super::forward::Pass::residual_projection`]).
    pub parts: DevBuf<f32>,
    /// Partials of split row attention (at most 16 token ranges per head in all), or when
    /// batch invariant, of the packed prefill kernel's key ranges ([`ops::FlashSplit`]).
    pub attn_part: DevBuf<f32>,
}

/// Offsets (in ints) of the step metadata inside one device buffer, so each step uploads it
/// with one copy (the sampling parameters too) and CUDA graphs see fixed addresses.
#[derive(Clone, Copy, Debug)]
pub(super) struct MetaLayout {
    pub stride: usize,
    pub tokens: usize,
    pub positions: usize,
    pub slots: usize,
    pub tok_seq: usize,
    pub decode_list: usize,
    pub work: usize,
    pub rows: usize,
    pub seq_tok: usize,
    pub seq_len: usize,
    pub seq_pos: usize,
    pub top_k: usize,
    /// Per sequence (temperature, top_p, uniform draw) as f32 bits, read by the sampler as f32.
    pub params: usize,
    /// End of the fixed part; the block tables follow.
    pub tables: usize,
}

impl MetaLayout {
    /// Room for `max_tokens` tokens of `max_seqs` sequences, prefill work items covering
    /// `tokens_per_item` tokens.
    pub fn new(max_tokens: usize, max_seqs: usize, tokens_per_item: usize) -> Self {
        let (t, s) = (max_tokens, max_seqs);
        let tokens = 4;
        let positions = tokens + t;
        let slots = positions + t;
        let tok_seq = slots + t;
        let decode_list = tok_seq + t;
        let work = decode_list + t;
        let rows = work + 2 * (t.div_ceil(tokens_per_item.max(1)) + s);
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

/// What the step metadata is checked against.
#[derive(Clone, Copy, Debug)]
struct MetaLimits {
    block_size: usize,
    max_positions: usize,
    table_width: usize,
    /// Whether multi-token chunks go to the tensor-core prefill kernel (else the row kernel).
    flash: bool,
    /// Batch-invariant serving: every token goes to the packed prefill kernel (the Hopper build
    /// where it applies, [`ops::wgmma_packed_takes`]), in work items of this many tokens
    /// ([`ops::flash_packed_tokens`]); none to the row kernel.
    packed: Option<usize>,
    /// With `packed`: a sequence of at most this many tokens (at least one) is one narrow work
    /// item ([`ops::narrow_tokens`]), listed after the others; 0: none is.
    narrow: usize,
    /// Keys per softmax range of that packed kernel ([`ops::flash_range_keys`]): a decode step
    /// splits a context of more.
    range_keys: usize,
    /// How the row kernel splits long contexts (not batch invariant).
    row_split: RowSplit,
}

/// How the row attention kernel cuts long decode contexts into key ranges worked by separate
/// blocks (`--cuda-tune attention_split_ranges`, `attention_split_keys`): for long contexts at
/// small batches, where a block per head walking the whole context leaves the device idle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct RowSplit {
    /// Ranges a launch may cut its tokens' contexts into, in all.
    pub ranges: usize,
    /// Keys per range before a context gets another; a step splits once a context is longer.
    pub keys: usize,
}

impl RowSplit {
    /// The device's tuning of it.
    pub fn of(dev: &CudaDevice) -> Self {
        let t = dev.tuning();
        Self { ranges: t.attention_split_ranges.max(1), keys: t.attention_split_keys.max(1) }
    }

    /// Most key ranges per token for a launch over `decode` tokens: `ranges` over the power of
    /// two at or above `decode`, so a CUDA-graph step (padded to its bucket) and the same step
    /// launched kernel by kernel agree; at least one.
    pub fn most(&self, decode: usize) -> usize {
        (self.ranges / decode.max(1).next_power_of_two()).max(1)
    }
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
    // Narrow work items (sequences), listed after the others.
    let mut narrow_items = Vec::new();
    let is_narrow = |tokens: usize| (1..=limits.narrow).contains(&tokens);
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
        if limits.packed.is_some() && is_narrow(s.num_tokens) {
            narrow_items.push(si);
        } else if let Some(per_item) = limits.packed {
            for q0 in (0..s.num_tokens).step_by(per_item).rev() {
                hm[m.work + 2 * n_work] = si as i32;
                hm[m.work + 2 * n_work + 1] = q0 as i32;
                n_work += 1;
            }
        } else if limits.flash && s.num_tokens > 1 {
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
        if limits.packed.is_some() {
            // A one-token sequence of its own (graph padding is for pure decode steps, where
            // sequence t holds token t), reading block 0.
            hm[m.seq_tok + t] = t as i32;
            hm[m.seq_len + t] = 1;
            hm[m.seq_pos + t] = 0;
            if is_narrow(1) {
                narrow_items.push(t);
            } else {
                hm[m.work + 2 * n_work] = t as i32;
                hm[m.work + 2 * n_work + 1] = 0;
                n_work += 1;
            }
        } else {
            hm[m.decode_list + n_decode] = t as i32;
            n_decode += 1;
        }
        hm[m.rows + n_rows] = t as i32;
        n_rows += 1;
    }
    let narrow = narrow_items.len();
    for seq in narrow_items {
        hm[m.work + 2 * n_work] = seq as i32;
        hm[m.work + 2 * n_work + 1] = 0;
        n_work += 1;
    }
    let one_token_each = seqs.iter().all(|s| s.num_tokens <= 1);
    let split = if limits.packed.is_some() {
        // Spread the packed kernel's key ranges over blocks on a decode step of a few tokens
        // when a context has two ranges or more (the same result either way).
        let longest = (0..padded_tokens.max(token_ids.len())).map(|t| hm[m.positions + t] as usize + 1).max();
        one_token_each && attention_split_most(n_work) > 1 && longest.is_some_and(|ctx| ctx > limits.range_keys)
    } else {
        // Split the row attention when a listed token's context is long enough to take two ranges.
        let longest = (0..n_decode).map(|i| hm[m.positions + hm[m.decode_list + i] as usize] as usize + 1).max();
        limits.row_split.most(n_decode) > 1 && longest.is_some_and(|ctx| ctx > limits.row_split.keys)
    };
    // A split step (a few tokens with long contexts) gives its items to the Hopper kernel's split
    // build, the same bits: the narrow kernel walks a range's eight tiles in one block, which
    // measured slower there (H100, batch 1 at a 1024-token context: 5.50 ms a step, against
    // 4.60 with 128-row items).
    let narrow = if split { 0 } else { narrow };
    Ok((tables, StepCounts { decode: n_decode, work: n_work, narrow, one_token_each, split }))
}

/// Counts of the last prepared step.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct StepCounts {
    /// Tokens for the row-wise attention kernel.
    pub decode: usize,
    /// Work items for the tensor-core prefill kernel.
    pub work: usize,
    /// Of those, the narrow ones at the end of the list ([`ops::narrow_tokens`]); none on a
    /// split step.
    pub narrow: usize,
    /// Every sequence brings at most one token (a pure decode step).
    pub one_token_each: bool,
    /// The row-wise attention splits long contexts over several blocks ([`RowSplit`]; batch
    /// invariant: the packed kernel, [`attention_split_most`]).
    pub split: bool,
}

/// Most key ranges per token for a batch-invariant (packed kernel) launch over `decode`
/// tokens: enough blocks for about 16 ranges' worth per head in all, so batch 1 splits up to 16
/// ways and batches of 16 or more not at all. Taken on the power of two at or above `decode`,
/// so a CUDA-graph step (padded to its bucket) and the same step launched kernel by kernel agree.
pub(super) fn attention_split_most(decode: usize) -> usize {
    (16 / decode.max(1).next_power_of_two()).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(flash: bool) -> MetaLimits {
        MetaLimits {
            block_size: 4,
            max_positions: 1000,
            table_width: 64,
            flash,
            packed: None,
            narrow: 0,
            range_keys: ops::FLASH_RANGE_KEYS,
            row_split: RowSplit { ranges: 32, keys: 256 },
        }
    }

    #[test]
    fn meta_maps_positions_to_slots_and_splits_prefill_from_decode() {
        let m = MetaLayout::new(256, 8, FLASH_ROWS);
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
        let m = MetaLayout::new(64, 3, FLASH_ROWS);
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
        let top = SampleSpec { temperature: 0.7, top_k: 40, top_p: 0.9, uniform: 1.5, banned: vec![2], logprobs: None };
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
    fn batch_invariant_steps_send_every_token_to_the_packed_prefill_kernel() {
        // Four query heads per KV head: 16 tokens a work item (32 in the Hopper build's 128 rows).
        assert_eq!(ops::flash_packed_tokens(4, true), 32);
        assert_eq!(ops::flash_packed_tokens(64, true), 2);
        let per_item = ops::flash_packed_tokens(4, false);
        assert_eq!(per_item, 16);
        let packed = MetaLimits { packed: Some(per_item), ..limits(true) };
        let m = MetaLayout::new(256, 8, per_item);
        let mut header = vec![0; m.tables];
        let (t0, t1) = (vec![7u32, 3], (0..19).collect::<Vec<u32>>());
        let ids: Vec<u32> = std::iter::once(42).chain(0..70).collect();
        let seqs = [
            SeqBatch { token_start: 0, num_tokens: 1, first_pos: 5, block_table: &t0, want_logits: true },
            SeqBatch { token_start: 1, num_tokens: 70, first_pos: 6, block_table: &t1, want_logits: true },
        ];
        let (_, counts) = build_meta(&m, &mut header, &packed, &ids, &seqs, ids.len(), 2).unwrap();
        assert_eq!((counts.decode, counts.work, counts.split), (0, 6, false), "no token for the row kernel");
        let items: Vec<(i32, i32)> =
            (0..counts.work).map(|i| (header[m.work + 2 * i], header[m.work + 2 * i + 1])).collect();
        assert_eq!(items, [(0, 0), (1, 64), (1, 48), (1, 32), (1, 16), (1, 0)]);
        // A decode graph's padding: each padding token a one-token sequence of its own, reading
        // block 0 and writing nothing, so the captured grid (one item per bucket row) is full.
        let g = MetaLayout::new(4, 8, per_item);
        let mut header = vec![i32::MIN; g.tables];
        let seqs = [SeqBatch { token_start: 0, num_tokens: 1, first_pos: 6, block_table: &t0, want_logits: true }];
        let (tables, counts) = build_meta(&g, &mut header, &packed, &[3], &seqs, 4, 4).unwrap();
        assert_eq!((counts.decode, counts.work), (0, 4));
        for t in 1..4 {
            assert_eq!((header[g.work + 2 * t], header[g.work + 2 * t + 1]), (t as i32, 0));
            assert_eq!([header[g.seq_tok + t], header[g.seq_len + t], header[g.seq_pos + t]], [t as i32, 1, 0]);
            assert_eq!(header[g.slots + t], -1);
            assert!(tables[t * 2..t * 2 + 2].iter().all(|&b| b == 0));
        }
    }

    #[test]
    fn short_sequences_are_narrow_work_items_listed_after_the_others() {
        // The Hopper build's 32 tokens an item; sequences of at most 4 tokens (16 rows of a
        // group of 4) go to the narrow kernel, after the 128-row items.
        let hopper = MetaLimits { packed: Some(32), narrow: 4, ..limits(true) };
        let m = MetaLayout::new(256, 8, 32);
        let mut header = vec![0; m.tables];
        let (t0, t1) = (vec![7u32, 3], (0..19).collect::<Vec<u32>>());
        let ids: Vec<u32> = (0..80).collect();
        let seqs = [
            SeqBatch { token_start: 0, num_tokens: 1, first_pos: 5, block_table: &t0, want_logits: true },
            SeqBatch { token_start: 1, num_tokens: 70, first_pos: 6, block_table: &t1, want_logits: true },
            SeqBatch { token_start: 71, num_tokens: 4, first_pos: 2, block_table: &t0, want_logits: true },
            SeqBatch { token_start: 75, num_tokens: 5, first_pos: 0, block_table: &t0, want_logits: true },
        ];
        let (_, counts) = build_meta(&m, &mut header, &hopper, &ids, &seqs, ids.len(), 4).unwrap();
        let items: Vec<(i32, i32)> =
            (0..counts.work).map(|i| (header[m.work + 2 * i], header[m.work + 2 * i + 1])).collect();
        assert_eq!(items, [(1, 64), (1, 32), (1, 0), (3, 0), (0, 0), (2, 0)]);
        assert_eq!((counts.work, counts.narrow, counts.decode), (6, 2, 0));
        // A decode graph's step: every row (padding too) a narrow item.
        let g = MetaLayout::new(4, 8, 32);
        let mut header = vec![i32::MIN; g.tables];
        let (_, counts) = build_meta(&g, &mut header, &hopper, &[3], &seqs[..1], 4, 4).unwrap();
        assert_eq!((counts.work, counts.narrow), (4, 4));
        let items: Vec<(i32, i32)> = (0..4).map(|i| (header[g.work + 2 * i], header[g.work + 2 * i + 1])).collect();
        assert_eq!(items, [(0, 0), (1, 0), (2, 0), (3, 0)]);
        // A split step (a decode token past the first range) gives them to the 128-row kernel.
        let g = MetaLayout::new(4, 8, 32);
        let mut header = vec![0; g.tables];
        let long: Vec<u32> = (0..60).collect();
        let decode =
            [SeqBatch { token_start: 0, num_tokens: 1, first_pos: 200, block_table: &long, want_logits: true }];
        let short_ranges = MetaLimits { range_keys: 128, ..hopper };
        let (_, counts) = build_meta(&g, &mut header, &short_ranges, &[3], &decode, 1, 1).unwrap();
        assert_eq!((counts.work, counts.narrow, counts.split), (1, 0, true));
        // Without the narrow kernel, none is narrow.
        let wide = MetaLimits { narrow: 0, ..hopper };
        let mut header = vec![0; m.tables];
        let (_, counts) = build_meta(&m, &mut header, &wide, &ids, &seqs, ids.len(), 4).unwrap();
        assert_eq!((counts.work, counts.narrow), (6, 0));
    }

    #[test]
    fn a_decode_graph_step_defines_everything_its_graph_reads() {
        // A bucket's layout is shared with other steps' leftovers (other layouts write other
        // offsets of the same buffer): a graph step must set every entry its kernels read.
        let m = MetaLayout::new(4, 8, FLASH_ROWS);
        assert!(m.tables < MetaLayout::new(4096, 8, FLASH_ROWS).tables / 100, "the bucket's header is small");
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
        let m = MetaLayout::new(16, 8, FLASH_ROWS);
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
        let m = MetaLayout::new(64, 32, FLASH_ROWS);
        let mut header = vec![0; m.tables];
        let table: Vec<u32> = (0..100).collect();
        let limits = MetaLimits {
            block_size: 4,
            max_positions: 1000,
            table_width: 100,
            flash: true,
            packed: None,
            narrow: 0,
            range_keys: ops::FLASH_RANGE_KEYS,
            row_split: RowSplit { ranges: 32, keys: 256 },
        };
        let keys = limits.row_split.keys;
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
        // A context of `keys` (position keys - 1) fits one range; one more key takes two.
        assert!(!step(&mut header, keys - 1, 1).split);
        assert!(step(&mut header, keys, 1).split);
        assert!(step(&mut header, keys, 16).split);
        // From 32 sequences on (32 ranges in all), one range per context.
        assert!(!step(&mut header, keys, 32).split);
        assert_eq!(
            [1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 64].map(|b| limits.row_split.most(b)),
            [32, 16, 8, 8, 4, 4, 2, 2, 1, 1, 1]
        );
        // The batch-invariant kernel's own count.
        assert_eq!(
            (1..=16).map(attention_split_most).collect::<Vec<_>>(),
            [16, 8, 4, 4, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1]
        );
    }

    #[test]
    fn meta_refuses_positions_outside_the_tables() {
        let m = MetaLayout::new(16, 8, FLASH_ROWS);
        let mut header = vec![0; m.tables];
        let table = [1u32];
        let seqs = [SeqBatch { token_start: 0, num_tokens: 1, first_pos: 4, block_table: &table, want_logits: true }];
        assert!(build_meta(&m, &mut header, &limits(true), &[1], &seqs, 1, 1).is_err());
        let short = [SeqBatch { token_start: 0, num_tokens: 3, first_pos: 0, block_table: &table, want_logits: true }];
        assert!(build_meta(&m, &mut header, &limits(true), &[1], &short, 1, 1).is_err());
    }
}
