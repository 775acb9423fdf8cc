//! What the engine drives: a model plus its KV cache on one device, running a batched forward
//! and picking each sequence's next token.
//!
//! Sampling happens where the logits are (on the GPU for the CUDA backend, so a step returns
//! token ids, not a `batch x vocab` matrix). Randomness stays with the request: the engine
//! draws one uniform number per sampled token from the request's own seeded stream and passes
//! it in [`SampleSpec::uniform`], so a seed means the same thing on every backend.

use std::collections::VecDeque;
use std::sync::Arc;

use tandem_compute::cuda::{kv_fence_ends, HostFence, HostSignal, KvFences};
use tandem_compute::{KvCache, KvDtype, KvLayout, KvRegion};
use tandem_core::TokenLogprobs;

use crate::config::ModelConfig;
use crate::transformer::{SeqBatch, Transformer};
use crate::ModelError;

/// How to pick one sequence's next token.
#[derive(Clone, Debug, PartialEq)]
pub struct SampleSpec {
    /// 0 is greedy (highest logit, ties to the lowest id).
    pub temperature: f32,
    /// Keep only the `top_k` highest logits (0 = no limit).
    pub top_k: u32,
    /// Then keep the smallest set of highest-probability tokens whose mass reaches `top_p`.
    pub top_p: f32,
    /// A draw in `[0, 1)` from the request's own stream (ignored when greedy).
    pub uniform: f32,
    /// Ids that must not be chosen (end-of-sequence while `min_tokens` is not met).
    pub banned: Vec<u32>,
    /// Also report the chosen token's log-probability and this many alternatives'
    /// ([`ModelRunner::take_logprobs`]).
    pub logprobs: Option<u32>,
}

impl SampleSpec {
    /// Greedy, nothing banned.
    pub fn greedy() -> Self {
        Self { temperature: 0.0, top_k: 0, top_p: 1.0, uniform: 0.0, banned: Vec::new(), logprobs: None }
    }
}

/// Token ids with this bit set stand for a token the runner sampled but the host has not seen
/// yet: `CARRIED_TOKEN | r` is the token the previously submitted step sampled for its row `r`
/// (see [`ModelRunner::submit`]). Vocabularies stay far below 2^31, so no real id has it.
pub const CARRIED_TOKEN: u32 = 1 << 31;

/// The token id standing for row `row` of the previous step's samples.
pub fn carried_token(row: usize) -> u32 {
    CARRIED_TOKEN | row as u32
}

/// The sample row a token id stands for, if it is a carried token.
pub fn carried_row(token: u32) -> Option<usize> {
    (token & CARRIED_TOKEN != 0).then_some((token & !CARRIED_TOKEN) as usize)
}

/// A model with its KV cache, ready to run engine steps.
pub trait ModelRunner: Send {
    /// Where it runs, for logs: `cpu (f32)` or `cuda:0 (NVIDIA H200, sm_90, bf16)`.
    fn describe(&self) -> String;
    /// The model's shape.
    fn config(&self) -> &ModelConfig;
    /// Positions the model can run (its RoPE table).
    fn max_positions(&self) -> usize;
    /// The KV cache's shape (including its number of blocks).
    fn kv_layout(&self) -> KvLayout;
    /// The KV memory as the connector sees it: the cache itself when it lives in host memory,
    /// or a host copy of a device cache (which the connector copies to and from the device
    /// through [`ModelRunner::kv_device`]). `None`: this runner offers none (a device cache
    /// set up without a host copy).
    fn kv_region(&self) -> Option<Arc<KvRegion>>;
    /// The device KV cache as the connector's direct transports use it (a GPU runner's; `None`
    /// for a cache in host memory).
    fn kv_device(&self) -> Option<Arc<tandem_compute::cuda::DeviceKvMemory>> {
        None
    }
    /// Identifies the weights for KV compatibility checks.
    fn fingerprint(&self) -> String;
    /// Runs one batched forward over `token_ids` (all sequences' tokens, concatenated) and
    /// returns one sampled token per sequence with `want_logits`, in order; `samples` has one
    /// entry per such sequence.
    fn execute(
        &mut self,
        token_ids: &[u32],
        seqs: &[SeqBatch<'_>],
        samples: &[SampleSpec],
    ) -> Result<Vec<u32>, ModelError>;

    /// Whether this runner implements [`ModelRunner::submit`] and [`ModelRunner::collect`]:
    /// one step queued while the previous one still runs, its decode tokens named by
    /// [`carried_token`] instead of waiting for them to reach the host (async scheduling).
    fn can_pipeline(&self) -> bool {
        false
    }

    /// Queues the step [`ModelRunner::execute`] would run, without waiting for its tokens
    /// ([`ModelRunner::collect`] returns them, oldest step first). A token id
    /// `carried_token(r)` is the token the previously submitted step sampled for its row `r`.
    /// At most two steps are outstanding.
    fn submit(
        &mut self,
        _token_ids: &[u32],
        _seqs: &[SeqBatch<'_>],
        _samples: &[SampleSpec],
    ) -> Result<(), ModelError> {
        Err(ModelError::Pipeline(format!("{} runs one step at a time", self.describe())))
    }

    /// The sampled tokens of the oldest submitted step not yet collected (waits for it).
    fn collect(&mut self) -> Result<Vec<u32>, ModelError> {
        Err(ModelError::Pipeline(format!("{} runs one step at a time", self.describe())))
    }

    /// Tensor-parallel ranks the model runs on.
    fn tensor_parallel_size(&self) -> usize {
        1
    }

    /// Whether this runner reports log-probabilities ([`SampleSpec::logprobs`]).
    fn supports_logprobs(&self) -> bool {
        false
    }

    /// The log-probabilities of the step last executed or collected, one entry per sample
    /// row (`Some` where its spec asked); empty when no row asked or the runner cannot.
    fn take_logprobs(&mut self) -> Vec<Option<TokenLogprobs>> {
        Vec::new()
    }

    /// From now on, say of every submitted step that writes prompt KV when that KV is in the
    /// cache ([`ModelRunner::take_kv_fences`]), so a KV connector can copy it out while the
    /// step still runs. Returns whether this runner can.
    fn fence_kv_writes(&mut self) -> bool {
        false
    }

    /// The fences of the step last submitted (once), after [`ModelRunner::fence_kv_writes`];
    /// `None` for a step that recorded none (a decode step replayed from a graph).
    fn take_kv_fences(&mut self) -> Option<KvFences> {
        None
    }

    /// From now on, have the fences of each forward ready before it runs
    /// ([`ModelRunner::kv_fences_ahead`]), for a runner whose forward runs inside `execute` or
    /// `submit` (a CPU engine's, on the engine's thread): a KV connector told of them first sends
    /// the step's KV layer group by layer group while the forward still computes. Returns
    /// whether this runner can.
    fn fence_kv_ahead(&mut self) -> bool {
        false
    }

    /// After [`ModelRunner::fence_kv_ahead`]: the fences the next forward sets, layer group by
    /// layer group in order, as it writes its KV (a forward that fails gives the rest up: their
    /// waiters fail). `None` when this runner does not fence ahead.
    fn kv_fences_ahead(&mut self) -> Option<KvFences> {
        None
    }
}

/// Checks that every carried token in `token_ids` names one of the previous step's
/// `previous_rows` sample rows.
pub(crate) fn check_carried(token_ids: &[u32], previous_rows: usize) -> Result<(), ModelError> {
    match token_ids.iter().filter_map(|&t| carried_row(t)).find(|&r| r >= previous_rows) {
        Some(r) => Err(ModelError::Pipeline(format!(
            "a carried token names sample row {r}, but the previous step sampled {previous_rows} rows"
        ))),
        None => Ok(()),
    }
}

/// Replaces each carried token in `token_ids` with the sampled token it names; `previous`
/// holds the previous step's samples.
fn resolve_carried(token_ids: &[u32], previous: &[u32]) -> Result<Vec<u32>, ModelError> {
    check_carried(token_ids, previous.len())?;
    Ok(token_ids.iter().map(|&t| carried_row(t).map_or(t, |r| previous[r])).collect())
}

/// One step's log-probabilities, one entry per sample row (empty when no row asked).
pub(crate) type RowLogprobs = Vec<Option<TokenLogprobs>>;

/// The CPU backend: the f32 [`Transformer`] over a host [`KvCache`], or its tensor-parallel
/// ranks, each over a cache of its KV heads.
pub struct CpuRunner {
    model: CpuModel,
    /// Submitted steps' results, oldest first (a CPU step runs inside `submit`), with their
    /// rows' log-probabilities.
    pending: VecDeque<(Result<Vec<u32>, ModelError>, RowLogprobs)>,
    /// The log-probabilities of the step last executed (then collected).
    step_logprobs: RowLogprobs,
    /// The last submitted step's samples, which carried tokens name.
    last_sampled: Vec<u32>,
    /// Report submitted steps' KV as final ([`ModelRunner::fence_kv_writes`]).
    fence_kv: bool,
    /// Hand out each forward's layer-group fences before it runs ([`ModelRunner::fence_kv_ahead`]).
    fence_ahead: bool,
    /// The next forward's signals: each group's last layer (exclusive end) and its signal.
    ahead: Vec<(usize, HostSignal)>,
}

enum CpuModel {
    Whole { model: Box<Transformer>, kv: KvCache },
    Ranks(crate::tp::TpModel),
}

impl CpuModel {
    fn transformer(&self) -> &Transformer {
        match self {
            CpuModel::Whole { model, .. } => model,
            CpuModel::Ranks(tp) => tp.rank0(),
        }
    }
}

impl CpuRunner {
    /// Allocates an f32 KV cache of `num_blocks` blocks of `block_size` tokens for `model`.
    pub fn new(model: Transformer, block_size: usize, num_blocks: usize) -> Self {
        Self::with_kv_dtype(model, block_size, num_blocks, KvDtype::F32)
    }

    /// [`CpuRunner::new`] with a KV cache of `dtype`: f32, or FP8 e4m3 (`--kv-cache-dtype fp8`:
    /// a quarter of the bytes a block, every key and value rounded so; [`KvCache::of`]).
    ///
    /// # Panics
    /// If `dtype` is bf16 (a GPU cache's type).
    pub fn with_kv_dtype(model: Transformer, block_size: usize, num_blocks: usize, dtype: KvDtype) -> Self {
        let kv = KvCache::of(model.kv_layout(block_size, num_blocks), dtype);
        Self::with(CpuModel::Whole { model: Box::new(model), kv })
    }

    /// Runs `tp`'s ranks (their KV caches sized as [`crate::TpModel::load`] made them).
    pub fn tensor_parallel(tp: crate::tp::TpModel) -> Self {
        Self::with(CpuModel::Ranks(tp))
    }

    fn with(model: CpuModel) -> Self {
        Self {
            model,
            pending: VecDeque::new(),
            step_logprobs: Vec::new(),
            last_sampled: Vec::new(),
            fence_kv: false,
            fence_ahead: false,
            ahead: Vec::new(),
        }
    }
}

impl ModelRunner for CpuRunner {
    fn describe(&self) -> String {
        match &self.model {
            CpuModel::Whole { .. } => "cpu (f32)".into(),
            CpuModel::Ranks(tp) => format!("cpu (f32), {} tensor-parallel ranks", tp.size()),
        }
    }

    fn config(&self) -> &ModelConfig {
        self.model.transformer().config()
    }

    fn max_positions(&self) -> usize {
        self.model.transformer().max_positions()
    }

    fn kv_layout(&self) -> KvLayout {
        match &self.model {
            CpuModel::Whole { kv, .. } => *kv.layout(),
            CpuModel::Ranks(tp) => tp.kv_layout(),
        }
    }

    // Tensor-parallel ranks whose heads share one region offer it whole (a one-rank engine's
    // layout, so peers of any rank count pair with it); ranks that repeat heads offer none.
    fn kv_region(&self) -> Option<Arc<KvRegion>> {
        match &self.model {
            CpuModel::Whole { kv, .. } => Some(kv.region()),
            CpuModel::Ranks(tp) => tp.region(),
        }
    }

    fn fingerprint(&self) -> String {
        self.model.transformer().fingerprint()
    }

    fn tensor_parallel_size(&self) -> usize {
        match &self.model {
            CpuModel::Whole { .. } => 1,
            CpuModel::Ranks(tp) => tp.size(),
        }
    }

    fn execute(
        &mut self,
        token_ids: &[u32],
        seqs: &[SeqBatch<'_>],
        samples: &[SampleSpec],
    ) -> Result<Vec<u32>, ModelError> {
        // Each group's fence is set as the forward passes the group's last layer; those of a
        // forward that fails are dropped unset, failing their waiters.
        let mut signals = std::mem::take(&mut self.ahead).into_iter().peekable();
        let mut mark = |layer: usize| {
            while let Some((_, signal)) = signals.next_if(|(end, _)| layer + 1 >= *end) {
                signal.signal();
            }
        };
        let mut logits = match &mut self.model {
            CpuModel::Whole { model, kv } => model.forward_with_kv_marks(token_ids, seqs, kv, &mut mark),
            CpuModel::Ranks(tp) => tp.forward_with_kv_marks(token_ids, seqs, &mut mark)?,
        };
        let vocab = self.config().vocab_size;
        let mut logprobs = Vec::new();
        let wanted = samples.iter().any(|s| s.logprobs.is_some());
        let tokens = logits
            .chunks_exact_mut(vocab)
            .zip(samples)
            .map(|(row, spec)| {
                // From the raw logits: `sample` bans and scales them in place.
                let raw = spec.logprobs.map(|top| (row.to_vec(), top));
                let token = sample(row, spec);
                if wanted {
                    logprobs.push(raw.map(|(raw, top)| token_logprobs(&raw, token, top)));
                }
                token
            })
            .collect();
        self.step_logprobs = logprobs;
        Ok(tokens)
    }

    fn supports_logprobs(&self) -> bool {
        true
    }

    fn take_logprobs(&mut self) -> Vec<Option<TokenLogprobs>> {
        std::mem::take(&mut self.step_logprobs)
    }

    // The CPU forward runs inside `submit`, so nothing overlaps; the engine enables async
    // scheduling here only when asked (its tests drive the pipelined path through this).
    fn can_pipeline(&self) -> bool {
        true
    }

    fn submit(&mut self, token_ids: &[u32], seqs: &[SeqBatch<'_>], samples: &[SampleSpec]) -> Result<(), ModelError> {
        if self.pending.len() >= 2 {
            return Err(ModelError::Pipeline("two steps are already outstanding".into()));
        }
        let result = resolve_carried(token_ids, &self.last_sampled).and_then(|ids| self.execute(&ids, seqs, samples));
        self.last_sampled = result.as_ref().map_or_else(|_| Vec::new(), Clone::clone);
        self.pending.push_back((result, std::mem::take(&mut self.step_logprobs)));
        Ok(())
    }

    fn collect(&mut self) -> Result<Vec<u32>, ModelError> {
        let (result, logprobs) = self
            .pending
            .pop_front()
            .unwrap_or_else(|| (Err(ModelError::Pipeline("no step was submitted".into())), Vec::new()));
        self.step_logprobs = logprobs;
        result
    }

    fn fence_kv_writes(&mut self) -> bool {
        self.fence_kv = true;
        true
    }

    // A CPU step has written its KV when `submit` returns.
    fn take_kv_fences(&mut self) -> Option<KvFences> {
        self.fence_kv.then(KvFences::complete)
    }

    fn fence_kv_ahead(&mut self) -> bool {
        self.fence_ahead = true;
        true
    }

    // Groups as a GPU engine's (eight, of equal layers): the forward signals each as it passes
    // the group's last layer.
    fn kv_fences_ahead(&mut self) -> Option<KvFences> {
        if !self.fence_ahead {
            return None;
        }
        let mut groups = Vec::new();
        let mut start = 0;
        self.ahead.clear();
        for end in kv_fence_ends(self.config().num_layers, 8, false) {
            let (fence, signal) = HostFence::pair();
            groups.push((start..end, fence));
            self.ahead.push((end, signal));
            start = end;
        }
        Some(KvFences::host(groups))
    }
}

/// Picks a token from one row of logits (modified in place). Greedy picks the highest logit,
/// ties to the lowest id; otherwise temperature, then top-k, then top-p, then `uniform` walks
/// the kept tokens from the most likely down.
pub fn sample(logits: &mut [f32], spec: &SampleSpec) -> u32 {
    for &id in &spec.banned {
        if let Some(l) = logits.get_mut(id as usize) {
            *l = f32::NEG_INFINITY;
        }
    }
    if spec.temperature <= 0.0 {
        return argmax(logits);
    }
    let inv_t = 1.0 / spec.temperature;
    // Candidates sorted by logit, descending; ties by id so the order is deterministic.
    let mut cand: Vec<(u32, f32)> =
        logits.iter().enumerate().filter(|(_, l)| l.is_finite()).map(|(i, l)| (i as u32, l * inv_t)).collect();
    if cand.is_empty() {
        return argmax(logits);
    }
    let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if spec.top_k > 0 {
        let k = (spec.top_k as usize).min(cand.len());
        if k < cand.len() {
            cand.select_nth_unstable_by(k - 1, by_logit);
            cand.truncate(k);
        }
    }
    cand.sort_unstable_by(by_logit);
    let max = cand[0].1;
    let mut probs: Vec<f32> = cand.iter().map(|(_, l)| (l - max).exp()).collect();
    let total: f32 = probs.iter().sum();
    for p in probs.iter_mut() {
        *p /= total;
    }
    if spec.top_p < 1.0 {
        let mut mass = 0.0;
        let mut keep = probs.len();
        for (i, p) in probs.iter().enumerate() {
            mass += p;
            if mass >= spec.top_p {
                keep = i + 1;
                break;
            }
        }
        probs.truncate(keep);
    }
    let total: f32 = probs.iter().sum();
    let mut r = spec.uniform * total;
    for (i, p) in probs.iter().enumerate() {
        r -= p;
        if r <= 0.0 {
            return cand[i].0;
        }
    }
    cand[probs.len() - 1].0
}

/// `token`'s log-probability under the raw `logits` (their log-softmax, summed in f64) and the
/// `top` most likely tokens', most likely first, ties to the lower id.
pub fn token_logprobs(logits: &[f32], token: u32, top: u32) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let log_sum = (logits.iter().map(|&l| f64::from(l - max).exp()).sum::<f64>()).ln();
    let logprob_of = |l: f32| (f64::from(l - max) - log_sum) as f32;
    let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let mut ranked: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
    let k = (top as usize).min(ranked.len());
    if k > 0 && k < ranked.len() {
        ranked.select_nth_unstable_by(k - 1, by_logit);
    }
    ranked.truncate(k);
    ranked.sort_unstable_by(by_logit);
    TokenLogprobs {
        logprob: logits.get(token as usize).map_or(f32::NEG_INFINITY, |&l| logprob_of(l)),
        top: ranked.into_iter().map(|(id, l)| (id, logprob_of(l))).collect(),
    }
}

fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in logits.iter().enumerate() {
        if *v > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    #[test]
    fn token_logprobs_are_the_log_softmax_with_the_most_likely_first() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, f32::NEG_INFINITY];
        let lp = token_logprobs(&logits, 2, 3);
        let log_sum = logits.iter().map(|&l| f64::from(l).exp()).sum::<f64>().ln();
        let want = |i: usize| (f64::from(logits[i]) - log_sum) as f32;
        assert!((lp.logprob - want(2)).abs() < 1e-6);
        // Ties go to the lower id; an impossible token has -inf.
        assert_eq!(lp.top, vec![(1, want(1)), (3, want(3)), (2, want(2))]);
        assert_eq!(token_logprobs(&logits, 4, 0), TokenLogprobs { logprob: f32::NEG_INFINITY, top: Vec::new() });
        let all = token_logprobs(&logits, 0, 9);
        assert_eq!(all.top.len(), 5, "no more alternatives than the vocabulary");
        let mass: f64 = all.top.iter().map(|&(_, l)| f64::from(l).exp()).sum();
        assert!((mass - 1.0).abs() < 1e-6, "{mass}");
    }

    use super::*;

    fn spec(t: f32, top_k: u32, top_p: f32, uniform: f32) -> SampleSpec {
        SampleSpec { temperature: t, top_k, top_p, uniform, banned: Vec::new(), logprobs: None }
    }

    #[test]
    fn greedy_ties_to_lowest_id_and_respects_bans() {
        assert_eq!(sample(&mut [1.0, 3.0, 3.0, 0.0], &spec(0.0, 0, 1.0, 0.5)), 1);
        let banned = SampleSpec { banned: vec![1], ..spec(0.0, 0, 1.0, 0.5) };
        assert_eq!(sample(&mut [1.0, 3.0, 3.0, 0.0], &banned), 2);
    }

    #[test]
    fn top_k_and_top_p_limit_the_support() {
        let logits = [0.0, 1.0, 2.0, 3.0, 4.0];
        for i in 0..200 {
            let u = i as f32 / 200.0;
            let t = sample(&mut logits.clone(), &spec(1.0, 2, 1.0, u));
            assert!(t == 3 || t == 4);
            // p(4) ~ 0.64, p(3) ~ 0.24: top_p 0.5 keeps only token 4.
            assert_eq!(sample(&mut logits.clone(), &spec(1.0, 0, 0.5, u)), 4);
        }
    }

    /// Pipelined CPU steps: a carried token is the previous step's sample, so a decode step
    /// fed `carried_token(0)` gives what feeding the sampled id gives; misuse is an error.
    #[test]
    fn carried_tokens_stand_for_the_previous_steps_samples() {
        let source = crate::ModelSource::Preset { preset: crate::Preset::find("tiny-qwen3").unwrap(), seed: 3 };
        let runner = || {
            let m = crate::LoadedModel::load(&source, None).unwrap();
            CpuRunner::new(m.transformer, 16, 8)
        };
        let prompt: Vec<u32> = (5..17).collect();
        let table = [0u32];
        let seq = |start: usize, n: usize, pos: usize| SeqBatch {
            token_start: start,
            num_tokens: n,
            first_pos: pos,
            block_table: &table,
            want_logits: true,
        };
        let greedy = [SampleSpec::greedy()];
        // One step at a time, the host feeding back each token.
        let mut alone = runner();
        let first = alone.execute(&prompt, &[seq(0, prompt.len(), 0)], &greedy).unwrap();
        let second = alone.execute(&first, &[seq(0, 1, prompt.len())], &greedy).unwrap();
        // Pipelined: the second step is submitted before the first one's token is known.
        let mut piped = runner();
        assert!(piped.can_pipeline());
        piped.submit(&prompt, &[seq(0, prompt.len(), 0)], &greedy).unwrap();
        piped.submit(&[carried_token(0)], &[seq(0, 1, prompt.len())], &greedy).unwrap();
        assert_eq!(piped.collect().unwrap(), first);
        assert_eq!(piped.collect().unwrap(), second);
        // Misuse: nothing to collect; a carried row the previous step did not sample; a third
        // outstanding step.
        assert!(matches!(piped.collect(), Err(ModelError::Pipeline(_))));
        piped.submit(&[carried_token(1)], &[seq(0, 1, prompt.len() + 1)], &greedy).unwrap();
        assert!(matches!(piped.collect(), Err(ModelError::Pipeline(_))));
        let step = [seq(0, 1, 0)];
        piped.submit(&[7], &step, &greedy).unwrap();
        piped.submit(&[7], &step, &greedy).unwrap();
        assert!(matches!(piped.submit(&[7], &step, &greedy), Err(ModelError::Pipeline(_))));
        assert_eq!(carried_row(carried_token(5)), Some(5));
        assert_eq!(carried_row(151_935), None);
    }

    #[test]
    fn the_draw_walks_from_the_most_likely_token() {
        let logits = [0.0, 1.0, 2.0, 3.0, 4.0];
        // Small draws land on the most likely token, draws near 1 on the least likely.
        assert_eq!(sample(&mut logits.clone(), &spec(1.0, 0, 1.0, 0.01)), 4);
        assert_eq!(sample(&mut logits.clone(), &spec(1.0, 0, 1.0, 0.9999)), 0);
    }
}
