//! `tandem bench fidelity`: how close a model's answers stay to a reference's (the same
//! checkpoint with FP8-rounded weights, or over an FP8 KV cache, against full precision, say).
//! Each prompt is answered
//! greedily by the reference; the candidate is fed the reference's tokens (teacher forcing) and
//! at every position the two are compared: whether the candidate's greedy choice is the
//! reference's token, where a prompt first diverges (the first such miss: greedy decoding of the
//! candidate follows the reference up to there), and the absolute difference of the log
//! probability each gives the reference's token.

use std::fmt;

use tandem_compute::{KvCache, KvDtype};
use tandem_model::{SeqBatch, Transformer};

/// What to run.
#[derive(Clone, Debug)]
pub struct FidelityConfig {
    /// Prompts, each answered separately (all in one batch).
    pub num_prompts: usize,
    /// Tokens of each prompt (random ids from `seed`).
    pub prompt_len: usize,
    /// Tokens the reference generates after each prompt; the positions compared.
    pub output_len: usize,
    /// Seeds the prompts.
    pub seed: u64,
    /// The candidate's KV cache (the reference's is f32): f32, or FP8 e4m3.
    pub candidate_kv: KvDtype,
}

/// What it found.
#[derive(Clone, Debug, serde::Serialize)]
pub struct FidelityReport {
    /// Positions compared (prompts x output tokens).
    pub positions: usize,
    /// Positions where the candidate's greedy token is the reference's.
    pub same_greedy: usize,
    /// Each prompt's first position (0-based, among its output tokens) where the candidate
    /// would pick another token; `None`: none did.
    pub first_divergence: Vec<Option<usize>>,
    /// Mean over positions of |log p_reference(t) - log p_candidate(t)|, t the reference's token.
    pub mean_abs_logprob_diff: f64,
    /// The largest such difference.
    pub max_abs_logprob_diff: f64,
}

impl fmt::Display for FidelityReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let pct = 100.0 * self.same_greedy as f64 / self.positions.max(1) as f64;
        writeln!(f, "greedy tokens equal at {} of {} positions ({pct:.1}%)", self.same_greedy, self.positions)?;
        let firsts: Vec<String> =
            self.first_divergence.iter().map(|d| d.map_or("-".to_string(), |p| p.to_string())).collect();
        writeln!(f, "first divergence per prompt (output position; - none): {}", firsts.join(" "))?;
        write!(
            f,
            "log-probability of the reference's token: mean |difference| {:.4}, largest {:.4}",
            self.mean_abs_logprob_diff, self.max_abs_logprob_diff
        )
    }
}

/// One model's step over every prompt at once: its KV cache and block tables.
struct Runner<'a> {
    model: &'a Transformer,
    kv: KvCache,
    tables: Vec<Vec<u32>>,
}

impl<'a> Runner<'a> {
    fn new(model: &'a Transformer, prompts: usize, tokens: usize, kv: KvDtype) -> Self {
        const BLOCK: usize = 16;
        let per_seq = tokens.div_ceil(BLOCK);
        let kv = KvCache::of(model.kv_layout(BLOCK, prompts * per_seq), kv);
        let tables = (0..prompts).map(|p| ((p * per_seq) as u32..((p + 1) * per_seq) as u32).collect()).collect();
        Self { model, kv, tables }
    }

    /// Runs `chunks[p]` after the `at` tokens each sequence already has; the log-softmax of
    /// each sequence's next-token logits.
    fn step(&mut self, chunks: &[Vec<u32>], at: usize) -> Vec<Vec<f64>> {
        let mut ids = Vec::new();
        let mut seqs = Vec::new();
        for (p, chunk) in chunks.iter().enumerate() {
            seqs.push(SeqBatch {
                token_start: ids.len(),
                num_tokens: chunk.len(),
                first_pos: at,
                block_table: &self.tables[p],
                want_logits: true,
            });
            ids.extend_from_slice(chunk);
        }
        let logits = self.model.forward(&ids, &seqs, &mut self.kv);
        let vocab = logits.len() / chunks.len().max(1);
        logits.chunks_exact(vocab.max(1)).map(log_softmax).collect()
    }
}

fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
    let log_sum = max + sum.ln();
    row.iter().map(|&v| v as f64 - log_sum).collect()
}

fn argmax(row: &[f64]) -> u32 {
    (0..row.len()).max_by(|&a, &b| row[a].total_cmp(&row[b]).then(b.cmp(&a))).unwrap_or(0) as u32
}

/// Compares `candidate` with `reference` (the same vocabulary) as the module docs say.
pub fn compare(reference: &Transformer, candidate: &Transformer, cfg: &FidelityConfig) -> FidelityReport {
    let vocab = reference.config().vocab_size.min(candidate.config().vocab_size) as u64;
    let mut state = cfg.seed ^ 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((state >> 33) % vocab.max(1)) as u32
    };
    let prompts: Vec<Vec<u32>> =
        (0..cfg.num_prompts).map(|_| (0..cfg.prompt_len.max(1)).map(|_| next()).collect()).collect();
    let total = cfg.prompt_len.max(1) + cfg.output_len;
    let n = prompts.len();
    let (mut r, mut c) =
        (Runner::new(reference, n, total, KvDtype::F32), Runner::new(candidate, n, total, cfg.candidate_kv));
    let (mut r_rows, mut c_rows) = (r.step(&prompts, 0), c.step(&prompts, 0));
    let mut report = FidelityReport {
        positions: 0,
        same_greedy: 0,
        first_divergence: vec![None; prompts.len()],
        mean_abs_logprob_diff: 0.0,
        max_abs_logprob_diff: 0.0,
    };
    let mut diff_sum = 0.0;
    for pos in 0..cfg.output_len {
        let tokens: Vec<u32> = r_rows.iter().map(|row| argmax(row)).collect();
        for (p, &t) in tokens.iter().enumerate() {
            let (rl, cl) = (&r_rows[p], &c_rows[p]);
            if argmax(cl) == t {
                report.same_greedy += 1;
            } else if report.first_divergence[p].is_none() {
                report.first_divergence[p] = Some(pos);
            }
            let diff = (rl[t as usize] - cl[t as usize]).abs();
            diff_sum += diff;
            report.max_abs_logprob_diff = report.max_abs_logprob_diff.max(diff);
            report.positions += 1;
        }
        if pos + 1 < cfg.output_len {
            let chunks: Vec<Vec<u32>> = tokens.iter().map(|&t| vec![t]).collect();
            let at = cfg.prompt_len.max(1) + pos;
            (r_rows, c_rows) = (r.step(&chunks, at), c.step(&chunks, at));
        }
    }
    report.mean_abs_logprob_diff = diff_sum / report.positions.max(1) as f64;
    report
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_model::{LoadedModel, ModelSource};

    fn preset(seed: u64) -> LoadedModel {
        LoadedModel::load(&ModelSource::parse("preset:tiny-qwen3", seed).unwrap(), Some(256)).unwrap()
    }

    /// A model against itself agrees everywhere with no difference; against other weights it
    /// diverges at once at some prompts and its log-probabilities differ.
    #[test]
    fn a_model_agrees_with_itself_and_not_with_another() {
        let cfg =
            FidelityConfig { num_prompts: 3, prompt_len: 20, output_len: 12, seed: 5, candidate_kv: KvDtype::F32 };
        let (a, b) = (preset(1), preset(2));
        let same = compare(&a.transformer, &a.transformer, &cfg);
        assert_eq!((same.positions, same.same_greedy), (36, 36));
        assert_eq!(same.first_divergence, vec![None; 3]);
        assert_eq!(same.max_abs_logprob_diff, 0.0);
        let other = compare(&a.transformer, &b.transformer, &cfg);
        assert!(other.same_greedy < other.positions, "{other:?}");
        assert!(other.first_divergence.iter().any(Option::is_some));
        assert!(other.mean_abs_logprob_diff > 0.0);
    }

    /// The same weights over an FP8 KV cache: the log-probabilities move (every key and value
    /// is rounded), but by far less than other weights move them.
    #[test]
    fn an_fp8_kv_cache_moves_the_answers_a_little() {
        let cfg =
            FidelityConfig { num_prompts: 3, prompt_len: 20, output_len: 12, seed: 5, candidate_kv: KvDtype::F32 };
        let (a, b) = (preset(1), preset(2));
        let other = compare(&a.transformer, &b.transformer, &cfg);
        let fp8 = compare(&a.transformer, &a.transformer, &FidelityConfig { candidate_kv: KvDtype::Fp8E4m3, ..cfg });
        assert!(fp8.max_abs_logprob_diff > 0.0, "{fp8:?}");
        assert!(fp8.mean_abs_logprob_diff < other.mean_abs_logprob_diff / 10.0, "{fp8:?} against {other:?}");
    }
}
