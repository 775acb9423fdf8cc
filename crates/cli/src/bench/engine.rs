//! `tandem bench engine`: the engine's steps alone, against their floors.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use tandem_compute::cuda::DeviceSpec;
use tandem_model::{CudaModel, CudaOptions, ModelRunner, ModelSpec};

use crate::engine::{
    kernel_cache_dir, load_model, model_source, parse_cuda_tune, resolve_device, tuning, AsyncScheduling, ModelArgs,
};

#[derive(Args, Debug)]
pub struct BenchEngineArgs {
    /// Model to measure.
    #[arg(long, default_value = "preset:smollm2-135m")]
    pub model: String,
    /// Weight seed for presets.
    #[arg(long, default_value_t = 0)]
    pub model_seed: u64,
    /// Round the weights at load (`fp8`: as `serve --quantization fp8`).
    #[arg(long, value_parser = |s: &str| s.parse::<tandem_model::Quantization>())]
    pub quantization: Option<tandem_model::Quantization>,
    /// Decode batch sizes.
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    pub batch: Vec<usize>,
    /// Timed decode steps per batch size.
    #[arg(long, default_value_t = 32)]
    pub decode_steps: usize,
    /// Prompt length of each decode sequence: the context its decode steps attend over (vLLM's
    /// random dataset uses 1024).
    #[arg(long, default_value_t = 16)]
    pub decode_prompt_tokens: usize,
    /// Prompt lengths for the prefill measurement, each in turn (e.g. 4096,16384,32768).
    #[arg(long, value_delimiter = ',', default_value = "512")]
    pub prefill_tokens: Vec<usize>,
    /// Write the report as JSON here too.
    #[arg(long)]
    pub json_out: Option<PathBuf>,
    /// `cpu` or `cuda:N` (see `tandem serve --help`).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// GPU only: launch every kernel instead of replaying CUDA graphs.
    #[arg(long)]
    pub enforce_eager: bool,
    /// Pipelined engine steps (see `tandem serve --help`).
    #[arg(long, value_enum, default_value_t = AsyncScheduling::Auto)]
    pub async_scheduling: AsyncScheduling,
    /// GPU only: also print device time per op for decode (batch 1 and the largest batch) and
    /// for the prefill.
    #[arg(long)]
    pub profile: bool,
    /// GPU only, with --profile: also time every decode projection under other launch plans
    /// (to tune the plan choice on a new GPU).
    #[arg(long, requires = "profile")]
    pub sweep_gemv_plans: bool,
    /// GPU only: one kernel choice, `KEY=VALUE`, repeatable; the defaults are the fastest
    /// measured on an H200. Keys: programmatic_launch=0|1 (0), attention_early=0|1 (1),
    /// attention_stages=auto|1|2 (auto), bulk_early_rows=0..=8 (8), tensor_core_projections=0|1
    /// (0), bulk_o_projection=0|1 (1).
    #[arg(long = "cuda-tune", value_name = "KEY=VALUE", value_parser = parse_cuda_tune)]
    pub cuda_tune: Vec<String>,
    /// Batch-invariant kernels (see `tandem serve --help`), to measure what they cost.
    #[arg(long)]
    pub batch_invariant: bool,
    /// GPU only: the KV cache's element type (`fp8`: as `serve --kv-cache-dtype fp8`; decode
    /// at a long --decode-prompt-tokens shows what reading half the bytes gives).
    #[arg(long, value_enum, default_value_t = crate::engine::KvCacheDtype::Auto)]
    pub kv_cache_dtype: crate::engine::KvCacheDtype,
}

/// The context --profile's decode cases run at, for sequences of `decode_prompt_tokens`.
fn profile_ctx(decode_prompt_tokens: usize) -> usize {
    decode_prompt_tokens.max(64)
}

pub(crate) fn bench_engine(a: BenchEngineArgs) -> Result<()> {
    let cfg = tandem_bench::engine::EngineBenchConfig {
        decode_batches: a.batch,
        decode_steps: a.decode_steps,
        decode_prompt_tokens: a.decode_prompt_tokens,
        prefill_tokens: a.prefill_tokens,
        ..Default::default()
    };
    let device = resolve_device(&a.device)?;
    let cfg = tandem_bench::engine::EngineBenchConfig {
        async_scheduling: a.async_scheduling.enabled(matches!(device, DeviceSpec::Cuda(_))),
        ..cfg
    };
    let mut engine_cfg = tandem_bench::engine::engine_config(&cfg);
    // --profile's decode cases run every sequence at a context of at least 64 (`profile_ctx`),
    // longer than a short benchmark's own sequences: their blocks too.
    if a.profile {
        let per_seq = (profile_ctx(a.decode_prompt_tokens) + 1).div_ceil(engine_cfg.block_size);
        engine_cfg.num_blocks = engine_cfg.num_blocks.max(engine_cfg.max_num_seqs * per_seq + 4);
    }
    let margs = ModelArgs {
        model: a.model.clone(),
        model_seed: a.model_seed,
        max_model_len: None,
        quantization: a.quantization,
    };
    let bench_model = match device {
        DeviceSpec::Cpu => {
            if a.kv_cache_dtype != crate::engine::KvCacheDtype::Auto {
                anyhow::bail!(
                    "bench engine --kv-cache-dtype is for GPU engines (a CPU engine's fp8 cache: bench fidelity)"
                );
            }
            let model = load_model(&margs)?;
            let c = model.transformer.config();
            let (params, matmul_params, pair) = (c.num_params(), matmul_params(c), attn_flops_per_pair(c));
            let (weight_bytes, weights_read) = (model.transformer.weight_bytes(), model.transformer.weights_read());
            eprintln!("... measuring read bandwidth");
            let kv_bytes_per_token = kv_bytes_per_token(c, crate::engine::KvCacheDtype::Auto.on_cpu().bytes());
            tandem_bench::engine::BenchModel {
                model: model.transformer.into(),
                max_model_len: model.max_model_len,
                weight_bytes,
                kv_bytes_per_token,
                weights_read: Some(weights_read),
                params,
                matmul_params,
                attn_flops_per_pair: pair,
                device: "cpu (f32)".into(),
                bandwidth: tandem_compute::measure_read_bandwidth(cfg.bandwidth_bytes, 5),
                bandwidth_basis: "streaming read".into(),
                gemm_flops: None,
            }
        }
        DeviceSpec::Cuda(ordinal) => {
            let source = model_source(&a.model, a.model_seed)?;
            let spec = ModelSpec::load(&source, None)?.with_quantization(a.quantization)?;
            let opts = CudaOptions {
                ordinal,
                block_size: engine_cfg.block_size,
                max_tokens: engine_cfg.max_num_batched_tokens,
                max_seqs: engine_cfg.max_num_seqs,
                num_blocks: Some(engine_cfg.num_blocks),
                cuda_graphs: !a.enforce_eager,
                tuning: tuning(&a.cuda_tune)?,
                batch_invariant: a.batch_invariant,
                kernel_cache: kernel_cache_dir(),
                kv_dtype: a.kv_cache_dtype.on_gpu(),
                ..CudaOptions::default()
            };
            eprintln!("... building {} on cuda:{ordinal}", a.model);
            let model =
                CudaModel::load(&spec, &opts).with_context(|| format!("loading `{}` onto cuda:{ordinal}", a.model))?;
            eprintln!("... measuring device copy bandwidth and the cuBLAS bf16 GEMM rate");
            let bandwidth = tandem_compute::cuda::measure_copy_bandwidth(model.device(), 2 << 30, 10)?;
            let gemm = tandem_compute::cuda::measure_gemm_rate(model.device(), 8192, 8192, 8192, 10)?;
            let mut model = model;
            if a.profile {
                let max_batch = engine_cfg.max_num_seqs;
                let ctx = profile_ctx(a.decode_prompt_tokens);
                let mut cases = vec![
                    (format!("decode, batch 1, context {ctx}"), 1, 1, ctx),
                    (format!("decode, batch {max_batch}, context {ctx}"), max_batch, 1, ctx),
                ];
                cases.extend(cfg.prefill_tokens.iter().map(|&n| (format!("prefill of {n} tokens"), 1, n, 0)));
                let pair = attn_flops_per_pair(&spec.config);
                for (label, seqs, tokens, ctx) in cases {
                    println!("device time per forward by op: {label}");
                    let ops = model.profile_ops(seqs, tokens, ctx, a.sweep_gemv_plans)?;
                    // The prefill's attention is the attention kernel that takes the longest (a
                    // row kernel listed beside it does next to nothing of a prefill).
                    let prefill_attention = ops
                        .iter()
                        .filter(|(op, _)| op.starts_with("attention"))
                        .max_by(|x, y| x.1.total_cmp(&y.1))
                        .map(|(op, _)| op.clone());
                    for (op, ms) in ops {
                        println!("  {op:<40} {ms:>10.3} ms");
                        if seqs == 1 && tokens > 1 && prefill_attention.as_ref() == Some(&op) {
                            // A prefill's causal attention: its rate beside the GEMM's.
                            let n = tokens as f64;
                            let rate = pair * n * (n + 1.0) / 2.0 / (ms / 1e3);
                            println!(
                                "  {:<40} {:>10.1} TFLOP/s ({:.1}% of the GEMM rate)",
                                "  attention's rate",
                                rate / 1e12,
                                rate / gemm * 100.0
                            );
                        }
                    }
                }
            }
            let c = &spec.config;
            tandem_bench::engine::BenchModel {
                max_model_len: spec.max_model_len,
                weight_bytes: model.weight_bytes(),
                kv_bytes_per_token: kv_bytes_per_token(c, a.kv_cache_dtype.on_gpu().bytes()),
                weights_read: None,
                params: c.num_params(),
                matmul_params: matmul_params(c),
                attn_flops_per_pair: attn_flops_per_pair(c),
                device: model.describe(),
                bandwidth,
                bandwidth_basis: "device copy bandwidth (read + write)".into(),
                gemm_flops: Some(gemm),
                model: (Box::new(model) as Box<dyn ModelRunner>).into(),
            }
        }
    };
    let report = tandem_bench::engine::run(&a.model, bench_model, &cfg, |phase| eprintln!("... {phase}"))
        .map_err(|e| anyhow::anyhow!("engine benchmark: {e}"))?;
    print!("{report}");
    if let Some(path) = a.json_out {
        std::fs::write(&path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Parameters in the matrix products every prompt token goes through: the decoder layers (the
/// embedding is a gather, and the output projection runs for the last token only).
/// Parameters a token multiplies by (a mixture of experts: the experts it chose), less the
/// embedding gather.
fn matmul_params(c: &tandem_model::ModelConfig) -> usize {
    let embedding_matrices = if c.tie_word_embeddings { 1 } else { 2 };
    c.active_params() - embedding_matrices * c.vocab_size * c.hidden_size
}

/// Attention FLOPs per (query, key) pair: QK and PV, 2 each, per head and layer.
fn attn_flops_per_pair(c: &tandem_model::ModelConfig) -> f64 {
    4.0 * (c.num_layers * c.num_heads * c.head_dim) as f64
}

/// Bytes of keys and values one cached token holds over every layer, `elem_bytes` each.
fn kv_bytes_per_token(c: &tandem_model::ModelConfig, elem_bytes: usize) -> usize {
    2 * c.num_layers * c.num_kv_heads * c.head_dim * elem_bytes
}
