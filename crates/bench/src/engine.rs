//! `tandem bench engine`: decode and prefill throughput of one engine against its floor.
//!
//! Requests are driven through [`EngineCore`] directly (no HTTP, no threads besides the
//! compute pool), so the numbers are the engine step itself: scheduling, forward, sampling.

use std::time::Instant;

use serde::Serialize;
use tandem_core::{RequestId, SamplingParams};
use tandem_engine::{EngineConfig, EngineCore, EngineEvent, EngineModel, EngineRequest};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// What to measure.
#[derive(Clone, Debug)]
pub struct EngineBenchConfig {
    /// Decode batch sizes to measure.
    pub decode_batches: Vec<usize>,
    /// Decode steps timed per batch size (after warm-up).
    pub decode_steps: usize,
    /// Prompt length of each decode sequence (the context its decode steps attend over).
    pub decode_prompt_tokens: usize,
    /// Prompt lengths for the prefill measurement (one request, one step, each length in
    /// turn).
    pub prefill_tokens: Vec<usize>,
    /// Prefill repetitions; the best is reported.
    pub prefill_repeats: usize,
    /// Bytes streamed to measure read bandwidth.
    pub bandwidth_bytes: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Async scheduling (see `tandem_engine::EngineConfig::async_scheduling`).
    pub async_scheduling: bool,
}

impl Default for EngineBenchConfig {
    fn default() -> Self {
        Self {
            decode_batches: vec![1, 16],
            decode_steps: 32,
            decode_prompt_tokens: 16,
            prefill_tokens: vec![512],
            prefill_repeats: 3,
            bandwidth_bytes: 1 << 30,
            block_size: 16,
            async_scheduling: false,
        }
    }
}

/// One decode measurement.
#[derive(Clone, Debug, Serialize)]
pub struct DecodeResult {
    /// Sequences per step.
    pub batch: usize,
    /// Median step time, milliseconds.
    pub median_step_ms: f64,
    /// Output tokens per second at the median step time.
    pub tokens_per_s: f64,
    /// Bytes of weights a step read (the median step's).
    pub weight_bytes: usize,
    /// Bytes of cached keys and values a step read (every sequence's context, at the middle
    /// of the timed steps).
    pub kv_bytes: usize,
    /// Floor step time ((weights + KV) / bandwidth), milliseconds.
    pub floor_step_ms: f64,
    /// floor / measured step time.
    pub fraction_of_floor: f64,
}

/// A model built for the benchmark's engine config, with the floors to compare it against.
pub struct BenchModel {
    /// The model.
    pub model: EngineModel,
    /// Its context limit.
    pub max_model_len: usize,
    /// Bytes of weights one decode step of one sequence reads.
    pub weight_bytes: usize,
    /// Where the model leaves the bytes of weights each forward read, when they depend on the
    /// batch (a mixture of experts reads the experts its tokens chose): each decode batch's
    /// floor is then the median step's bytes, not `weight_bytes`.
    pub weights_read: Option<std::sync::Arc<std::sync::atomic::AtomicUsize>>,
    /// Bytes of keys and values one cached token holds over every layer, as the cache stores
    /// them (what attention reads per token of context).
    pub kv_bytes_per_token: usize,
    /// Parameters.
    pub params: usize,
    /// Parameters in matrix products per token (everything but the embedding gather).
    pub matmul_params: usize,
    /// Attention FLOPs per (query, key) pair: 4 x layers x heads x head_dim (QK and PV).
    pub attn_flops_per_pair: f64,
    /// Where it runs.
    pub device: String,
    /// Memory bandwidth the decode floor divides by, bytes/s.
    pub bandwidth: f64,
    /// What `bandwidth` is (streaming read on CPU; device copy, read + write, on GPU).
    pub bandwidth_basis: String,
    /// Matrix-product rate the prefill floor divides by, FLOP/s (measured cuBLAS bf16 GEMM on
    /// GPU; none on CPU).
    pub gemm_flops: Option<f64>,
}

/// One prefill length's measurement.
#[derive(Clone, Debug, Serialize)]
pub struct PrefillResult {
    /// Prompt tokens.
    pub tokens: usize,
    /// Best time, milliseconds.
    pub ms: f64,
    /// Tokens per second.
    pub tokens_per_s: f64,
    /// FLOPs counting matrix-product params and causal attention.
    pub flops: f64,
    /// The causal attention's share of `flops`.
    pub attention_flops: f64,
    /// Time at the GEMM rate, milliseconds (GPU).
    pub floor_ms: Option<f64>,
}

/// The whole report.
#[derive(Clone, Debug, Serialize)]
pub struct EngineBenchReport {
    /// The `--model` argument.
    pub model: String,
    /// Weight bytes a forward reads.
    pub weight_bytes: usize,
    /// Parameters.
    pub params: usize,
    /// Where it ran.
    pub device: String,
    /// Measured bandwidth of the decode floor, GB/s.
    pub read_bandwidth_gb_s: f64,
    /// What that bandwidth is.
    pub bandwidth_basis: String,
    /// Compute threads.
    pub threads: usize,
    /// Prompt length of each decode sequence.
    pub decode_prompt_tokens: usize,
    /// Decode results by batch size.
    pub decode: Vec<DecodeResult>,
    /// Every prefill length's measurement, in the order asked; the fields below are the
    /// first's.
    pub prefills: Vec<PrefillResult>,
    /// Prefill prompt length.
    pub prefill_tokens: usize,
    /// Best prefill time, milliseconds.
    pub prefill_ms: f64,
    /// Prefill tokens per second.
    pub prefill_tokens_per_s: f64,
    /// Achieved GFLOP/s in prefill, counting 2 x params x tokens (attention excluded).
    pub prefill_gflop_s: f64,
    /// Prefill FLOPs counting matrix-product params and causal attention.
    pub prefill_flops: f64,
    /// Prefill FLOPs counting every parameter (embeddings too) and causal attention: the
    /// looser count (2 x params x tokens + attention), reported beside the strict one.
    pub prefill_flops_all_params: f64,
    /// Measured GEMM rate (GPU), TFLOP/s.
    pub gemm_tflop_s: Option<f64>,
    /// Prefill time at the GEMM rate, milliseconds (GPU).
    pub prefill_floor_ms: Option<f64>,
}

fn request(id: String, prompt: Vec<u32>, max_tokens: usize) -> EngineRequest {
    EngineRequest::new(
        RequestId::new(id),
        prompt,
        SamplingParams { ignore_eos: true, ..SamplingParams::greedy(max_tokens) },
    )
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The engine config the benchmark needs: blocks for every decode sequence and the prefill.
pub fn engine_config(cfg: &EngineBenchConfig) -> EngineConfig {
    let max_batch = cfg.decode_batches.iter().copied().max().unwrap_or(1);
    let decode_len = cfg.decode_steps + 4;
    let prompt = cfg.decode_prompt_tokens.max(1);
    let longest = cfg.prefill_tokens.iter().copied().max().unwrap_or(1);
    let num_blocks = max_batch * (prompt + decode_len).div_ceil(cfg.block_size) + longest.div_ceil(cfg.block_size) + 4;
    EngineConfig {
        block_size: cfg.block_size,
        num_blocks,
        max_num_seqs: max_batch.max(1),
        max_num_batched_tokens: longest.max(max_batch * prompt),
        async_scheduling: cfg.async_scheduling,
        max_queue_time: None,
        prefix_caching: false,
    }
}

/// Runs the benchmark on a model built for [`engine_config`]. `progress` receives one line
/// per phase.
pub fn run(
    model_name: &str,
    model: BenchModel,
    cfg: &EngineBenchConfig,
    mut progress: impl FnMut(&str),
) -> Result<EngineBenchReport, String> {
    let weight_bytes = model.weight_bytes;
    let kv_per_token = model.kv_bytes_per_token;
    let params = model.params;
    let bw = model.bandwidth;
    let engine_cfg = engine_config(cfg);
    let prompt_len = cfg.decode_prompt_tokens.max(1);
    let decode_len = cfg.decode_steps + 4;
    let max_model_len = model.max_model_len;
    let (device, basis, gemm) = (model.device.clone(), model.bandwidth_basis.clone(), model.gemm_flops);
    let (matmul_params, attn_pair) = (model.matmul_params, model.attn_flops_per_pair);
    let weights_read = model.weights_read.clone();
    let mut core = EngineCore::new(model.model, Vec::new(), max_model_len, &engine_cfg);
    let vocab = core.limits().vocab_size as u32;
    let prompt =
        |seed: u32, len: usize| -> Vec<u32> { (0..len as u32).map(|i| (i * 7919 + seed * 104_729) % vocab).collect() };

    let mut decode = Vec::new();
    for &batch in &cfg.decode_batches {
        progress(&format!("decode, batch {batch}"));
        let mut rxs = Vec::new();
        for b in 0..batch {
            let (tx, rx) = unbounded_channel();
            let req = request(format!("d{batch}-{b}"), prompt(b as u32, prompt_len), decode_len);
            if let Err(e) = core.add_request(req, tx) {
                return Err(format!("decode at batch {batch}: the engine refused a {prompt_len}-token prompt: {e}"));
            }
            rxs.push(rx);
        }
        // First step prefills all prompts; then two warm-up decode steps.
        for _ in 0..3 {
            core.step();
        }
        let (mut times, mut bytes) = (Vec::new(), Vec::new());
        for _ in 0..cfg.decode_steps {
            let t = Instant::now();
            let r = core.step();
            if r.num_seqs == batch && r.num_tokens == batch {
                times.push(t.elapsed().as_secs_f64());
                let read = weights_read.as_ref().map(|w| w.load(std::sync::atomic::Ordering::Relaxed));
                bytes.push(read.unwrap_or(weight_bytes) as f64);
            }
        }
        while core.has_work() {
            core.step();
        }
        if let Some(reason) = rxs.iter_mut().find_map(first_failure) {
            return Err(format!(
                "decode at batch {batch} ({prompt_len}-token prompts): the engine failed it: {reason}"
            ));
        }
        if times.is_empty() {
            return Err(format!("decode at batch {batch}: no step ran the whole batch (too few KV blocks?)"));
        }
        let step = median(times);
        let read = median(bytes);
        // The timed steps' contexts: the prompt, the warm-up tokens, half the timed ones.
        let kv_read = batch * (prompt_len + 3 + cfg.decode_steps / 2) * kv_per_token;
        let floor_s = (read + kv_read as f64) / bw;
        decode.push(DecodeResult {
            batch,
            median_step_ms: step * 1e3,
            tokens_per_s: batch as f64 / step,
            weight_bytes: read as usize,
            kv_bytes: kv_read,
            floor_step_ms: floor_s * 1e3,
            fraction_of_floor: floor_s / step,
        });
    }

    let mut prefills = Vec::new();
    for (i, &tokens) in cfg.prefill_tokens.iter().enumerate() {
        progress(&format!("prefill, {tokens} tokens"));
        let mut best = f64::INFINITY;
        for r in 0..cfg.prefill_repeats.max(1) {
            let (tx, mut rx) = unbounded_channel();
            let req = request(format!("p{i}-{r}"), prompt(1000 + (i * 100 + r) as u32, tokens), 1);
            if let Err(e) = core.add_request(req, tx) {
                return Err(format!("prefill: the engine refused a {tokens}-token prompt: {e}"));
            }
            // Until the step that reports the prompt computed (pipelined, the first step only
            // submits it).
            let t = Instant::now();
            while core.step().num_tokens == 0 && core.has_work() {}
            best = best.min(t.elapsed().as_secs_f64());
            while core.has_work() {
                core.step();
            }
            if let Some(reason) = first_failure(&mut rx) {
                return Err(format!("prefill of {tokens} tokens: the engine failed it: {reason}"));
            }
        }
        let n = tokens as f64;
        let attention_flops = attn_pair * n * (n + 1.0) / 2.0;
        let flops = 2.0 * matmul_params as f64 * n + attention_flops;
        prefills.push(PrefillResult {
            tokens,
            ms: best * 1e3,
            tokens_per_s: n / best,
            flops,
            attention_flops,
            floor_ms: gemm.map(|g| flops / g * 1e3),
        });
    }
    let first = prefills.first().cloned().ok_or("no prefill length to measure")?;
    let (n, best) = (first.tokens as f64, first.ms / 1e3);
    let attention_flops = first.attention_flops;
    let prefill_flops = first.flops;
    Ok(EngineBenchReport {
        model: model_name.to_string(),
        weight_bytes,
        params,
        device,
        read_bandwidth_gb_s: bw / 1e9,
        bandwidth_basis: basis,
        threads: rayon_threads(),
        decode_prompt_tokens: prompt_len,
        decode,
        prefills,
        prefill_tokens: first.tokens,
        prefill_ms: first.ms,
        prefill_tokens_per_s: first.tokens_per_s,
        prefill_gflop_s: 2.0 * params as f64 * n / best / 1e9,
        prefill_flops,
        prefill_flops_all_params: 2.0 * params as f64 * n + attention_flops,
        gemm_tflop_s: gemm.map(|g| g / 1e12),
        prefill_floor_ms: gemm.map(|g| prefill_flops / g * 1e3),
    })
}

/// The reason of the first `Failed` event already sent on `rx`, if any.
fn first_failure(rx: &mut UnboundedReceiver<EngineEvent>) -> Option<String> {
    std::iter::from_fn(|| rx.try_recv().ok()).find_map(|event| match event {
        EngineEvent::Failed(reason) => Some(reason),
        _ => None,
    })
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

impl std::fmt::Display for EngineBenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "model {} on {}: {:.1} M params, {:.1} MB of weights read per step",
            self.model,
            self.device,
            self.params as f64 / 1e6,
            self.weight_bytes as f64 / 1e6
        )?;
        writeln!(
            f,
            "{} (floor basis): {:.2} GB/s; {} host threads",
            self.bandwidth_basis, self.read_bandwidth_gb_s, self.threads
        )?;
        writeln!(f, "decode sequences: {}-token prompts", self.decode_prompt_tokens)?;
        writeln!(
            f,
            "{:<14} {:>12} {:>12} {:>10} {:>14} {:>10}",
            "decode batch", "step ms", "tokens/s", "MB read", "floor step ms", "of floor"
        )?;
        for d in &self.decode {
            writeln!(
                f,
                "{:<14} {:>12.3} {:>12.1} {:>10.1} {:>14.3} {:>9.1}%",
                d.batch,
                d.median_step_ms,
                d.tokens_per_s,
                (d.weight_bytes + d.kv_bytes) as f64 / 1e6,
                d.floor_step_ms,
                d.fraction_of_floor * 100.0
            )?;
        }
        writeln!(
            f,
            "prefill {} tokens: {:.1} ms, {:.0} tokens/s, {:.1} GFLOP/s (2 x params x tokens)",
            self.prefill_tokens, self.prefill_ms, self.prefill_tokens_per_s, self.prefill_gflop_s
        )?;
        if let (Some(g), Some(floor)) = (self.gemm_tflop_s, self.prefill_floor_ms) {
            writeln!(
                f,
                "prefill {:.1} TFLOP (matmul params + causal attention): {:.1} TFLOP/s achieved, cuBLAS GEMM {:.1} TFLOP/s, floor {:.1} ms, {:.1}% of floor",
                self.prefill_flops / 1e12,
                self.prefill_flops / (self.prefill_ms / 1e3) / 1e12,
                g,
                floor,
                floor / self.prefill_ms * 100.0
            )?;
            let loose_floor = self.prefill_flops_all_params / (g * 1e12) * 1e3;
            writeln!(
                f,
                "  counting all params (2 x params x tokens + attention, {:.1} TFLOP): floor {:.1} ms, {:.1}% of floor",
                self.prefill_flops_all_params / 1e12,
                loose_floor,
                loose_floor / self.prefill_ms * 100.0
            )?;
        }
        if self.prefills.len() > 1 {
            writeln!(
                f,
                "{:<16} {:>10} {:>12} {:>10} {:>10} {:>10} {:>9}",
                "prefill tokens", "ms", "tokens/s", "TFLOP/s", "attention", "floor ms", "of floor"
            )?;
            for p in &self.prefills {
                let floor = p.floor_ms.map_or(("-".to_string(), "-".to_string()), |fl| {
                    (format!("{fl:.1}"), format!("{:.1}%", fl / p.ms * 100.0))
                });
                writeln!(
                    f,
                    "{:<16} {:>10.1} {:>12.0} {:>10.1} {:>9.0}% {:>10} {:>9}",
                    p.tokens,
                    p.ms,
                    p.tokens_per_s,
                    p.flops / (p.ms / 1e3) / 1e12,
                    p.attention_flops / p.flops * 100.0,
                    floor.0,
                    floor.1
                )?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_model::{LoadedModel, ModelSource};

    /// A decode batch's floor counts the weights and every sequence's cached keys and values
    /// (at the middle of the timed steps), over the bandwidth given.
    #[test]
    fn the_decode_floor_counts_the_kv_each_step_reads() {
        let loaded = LoadedModel::load(&ModelSource::parse("preset:tiny-qwen3", 1).unwrap(), Some(256)).unwrap();
        let c = loaded.transformer.config().clone();
        let kv_per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4;
        let weight_bytes = loaded.transformer.weight_bytes();
        let model = BenchModel {
            model: loaded.transformer.into(),
            max_model_len: loaded.max_model_len,
            weight_bytes,
            weights_read: None,
            kv_bytes_per_token: kv_per_token,
            params: c.num_params(),
            matmul_params: c.num_params(),
            attn_flops_per_pair: 1.0,
            device: "cpu".into(),
            bandwidth: 1e9,
            bandwidth_basis: "given".into(),
            gemm_flops: None,
        };
        let cfg = EngineBenchConfig {
            decode_batches: vec![2],
            decode_steps: 4,
            decode_prompt_tokens: 40,
            prefill_tokens: vec![8],
            prefill_repeats: 1,
            ..EngineBenchConfig::default()
        };
        let report = run("tiny", model, &cfg, |_| {}).unwrap();
        let d = &report.decode[0];
        assert_eq!(d.kv_bytes, 2 * (40 + 3 + 2) * kv_per_token);
        let floor_ms = (weight_bytes + d.kv_bytes) as f64 / 1e9 * 1e3;
        assert!((d.floor_step_ms - floor_ms).abs() < 1e-9, "{} against {floor_ms}", d.floor_step_ms);
    }
}
