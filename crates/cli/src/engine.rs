//! What every subcommand that runs an engine shares: the model and engine flags (`--model`,
//! `--block-size`, `--device`, ...), resolved once into the engine's config, and building the
//! engine itself on the CPU or a GPU.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use tandem_compute::cuda::DeviceSpec;
use tandem_engine::EngineConfig;
use tandem_model::{CudaModel, CudaOptions, LoadedModel, ModelRunner, ModelSource, ModelSpec, Quantization};

/// Which model to load.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Model")]
pub struct ModelArgs {
    /// A Hugging Face model directory (config.json + safetensors [+ tokenizer.json]), a GGUF
    /// file (`*.gguf`: llama, qwen2 or qwen3; F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K,
    /// kept quantized on the CPU, dequantized at load on a GPU), a Hugging Face Hub repository `ORG/NAME` (downloaded into the
    /// shared Hugging Face cache, then used from there; HF_ENDPOINT, HF_TOKEN and HF_HOME as in
    /// the Hugging Face tools) or `preset:NAME` for a built-in shape with seeded random weights
    /// (see `tandem model list`).
    #[arg(long, env = "TANDEM_MODEL", default_value = "preset:tiny-qwen3")]
    pub model: String,
    /// Weight seed for `preset:` models (same seed, same weights as `model init --seed`).
    #[arg(long, env = "TANDEM_MODEL_SEED", default_value_t = 0)]
    pub model_seed: u64,
    /// Longest prompt + output to accept; defaults to the model's max_position_embeddings.
    /// Lower it to shrink the RoPE table and reject long requests early.
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Round the weights at load. `fp8`: each decoder linear weight as FP8 e4m3 in 128 x 128
    /// blocks with one scale each, as the published FP8 checkpoints (Qwen3-32B-FP8 and the like)
    /// hold them, so the model computes what its FP8 checkpoint would. On CPU the rounded
    /// weights are kept as f32; on a GPU as FP8 bytes (half the memory; decode steps of up to 16
    /// tokens read them directly, larger steps through a bf16 copy; not with
    /// --batch-invariant). An FP8 checkpoint is rounded so already (on a GPU its weights are
    /// still held as bf16).
    #[arg(long, value_parser = parse_quantization)]
    pub quantization: Option<Quantization>,
}

fn parse_quantization(s: &str) -> Result<Quantization, String> {
    s.parse()
}

/// How the engine is sized.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Engine sizing")]
pub struct EngineArgs {
    /// Tokens per KV cache block. Smaller blocks waste less memory on partly filled blocks;
    /// larger ones mean fewer, bigger KV transfers.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Memory for the KV cache, e.g. `512MiB`, `2GiB`. Ignored if --num-kv-blocks is given.
    /// Pages are touched only as blocks are used.
    #[arg(long, default_value = "1GiB")]
    pub kv_cache_memory: String,
    /// Exact number of KV blocks (overrides --kv-cache-memory).
    #[arg(long)]
    pub num_kv_blocks: Option<usize>,
    /// Element type of the KV cache. `auto`: the model's compute type (f32 on CPU, bf16 on a
    /// GPU). `fp8` (or `fp8_e4m3`): FP8 e4m3, one byte an element, so --kv-cache-memory holds
    /// four times the tokens of f32 and a KV transfer moves a quarter of the bytes; each key
    /// and value is rounded to e4m3 (scale 1, as vLLM's `fp8` without calibrated scales), which
    /// moves answers a little (`tandem bench fidelity --kv-cache-dtype fp8` measures how much).
    /// A prefill and a decode engine must agree: the KV handshake refuses a pair that differ,
    /// naming the field (the router will not pair them). On a GPU: head sizes 64 and 128, and
    /// not with --batch-invariant yet; half the bytes of bf16.
    #[arg(long, value_enum, default_value_t = KvCacheDtype::Auto)]
    pub kv_cache_dtype: KvCacheDtype,
    /// Most requests running at once; more wait in the queue.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Token budget of one engine step (prefill chunks plus decode tokens). Longer prompts are
    /// prefilled in chunks of at most this many tokens, interleaved with decoding. Lower keeps
    /// decode latency steady under long prompts; higher prefills faster.
    #[arg(long, default_value_t = 2048)]
    pub max_num_batched_tokens: usize,
    /// Seconds a request may wait in the queue without starting (a prompt not begun, a decode
    /// leg whose KV load has not started); past that it ends with a 503 and Retry-After, having
    /// cost nothing, so under overload a client learns in bounded time that it was not served
    /// (the router sends it to another engine of the role if there is one). 0: no bound.
    #[arg(long, default_value_t = 0.0)]
    pub max_queue_secs: f64,
    /// Keep each full block of computed KV (keyed by its tokens and every token before them)
    /// until its memory is needed, so a prompt that begins as an earlier one did (a system
    /// prompt, a chat's history) computes only the rest. Hits are counted in /metrics
    /// (`tandem:prefix_cache_hits_total`).
    #[arg(long, value_enum, default_value_t = Switch::On)]
    pub prefix_caching: Switch,
    /// Where the model runs: `cpu` (f32), `cuda:N` (bf16 on GPU N; needs the NVIDIA driver
    /// and the CUDA 13 cuBLAS and NVRTC libraries on LD_LIBRARY_PATH), or `auto` (GPU 0 if
    /// CUDA works here, else CPU, saying which).
    #[arg(help_heading = "Device", long, env = "TANDEM_DEVICE", default_value = "cpu")]
    pub device: String,
    /// GPU only: fraction of the GPU's memory this engine may use in total (weights,
    /// activations and KV cache); the KV cache gets what is left. Ignored with --num-kv-blocks.
    #[arg(help_heading = "Device", long, default_value_t = 0.9)]
    pub gpu_memory_utilization: f64,
    /// GPU only: launch every kernel on every step instead of replaying decode steps from
    /// CUDA graphs (slower; for debugging and comparison).
    #[arg(help_heading = "Device", long)]
    pub enforce_eager: bool,
    /// Plan and submit each step before the previous step's tokens reach the host, so the GPU
    /// goes from one step to the next without waiting for the engine thread. `auto`: on for
    /// GPUs, off on CPU (where a step cannot overlap the host).
    #[arg(help_heading = "Device", long, value_enum, default_value_t = AsyncScheduling::Auto)]
    pub async_scheduling: AsyncScheduling,
    /// GPU only: one kernel choice, `KEY=VALUE`, repeatable; the defaults are the fastest
    /// measured on an H200. Keys: programmatic_launch=0|1 (0), attention_early=0|1 (1),
    /// attention_stages=auto|1|2 (auto), attention_split_group=0|1 (1: decode attention over
    /// long contexts reads each KV head once for its whole GQA group), attention_split_ranges=
    /// 1..=128 (32: key ranges a batch-1 decode splits its context into, halved per doubling of
    /// the batch), attention_split_keys=N*64 (256: keys of a range), attention_mma=0|1 (1: those
    /// split launches on tensor cores), bulk_early_rows=0..=8 (8), tensor_core_projections=0|1
    /// (0), bulk_o_projection=0|1 (1), invariant_skinny=0|1 (0), skinny_stages=2|4|8 (8),
    /// invariant_slice_cols=0|N*64 (0), kv_fence_groups=1..=64 (8), kv_fence_taper=0|1 (1),
    /// wgmma_prefill=0|1|2|3 (3: the Hopper prefill attention, warp specialised, K/V by the TMA
    /// unit; 2 the same with copies; 1 its lockstep build; 0 the mma.sync kernel),
    /// invariant_wgmma=0|1 (0; 1: --batch-invariant's attention on the Hopper kernel),
    /// invariant_narrow=0|1 (1: with it, decode tokens on a kernel of 16-row items, same bits),
    /// invariant_fold_l2=0|1 (1: with it, its range sums in L2 and three K/V stages),
    /// invariant_fused_norm=0|1 (0; 1: --batch-invariant steps of up to 8 tokens take the
    /// residual add, RMSNorm and SiLU inside their qkv and gate/up products, and their head
    /// product on the same wgmma chains),
    /// fused_norm_build=auto|4x1|8x1|4x2|3x2 (auto: their stages x warpgroups by shape),
    /// wg_product_stages=auto|8|16|24 (auto: the others' stages in flight by shape, the wide
    /// ones only; a number: that ring for o and down too), fp8_block_gemm=0|1 (1: with
    /// --quantization fp8, prefill products with FP8 activations on cuBLASLt's block-scaled
    /// GEMM; 0: through a bf16 copy of the weight), fp8_fused_decode=0|1 (1: FP8 decode steps
    /// on the fused FP8 GEMVs), fp8_gemv_build=0|1|2|3 (1: those GEMVs on f16 MMAs, one e4m3
    /// conversion a pair; 0 on bf16 MMAs, the same bits; 2 with two steps of weights in flight;
    /// 3 in tiles of 8 weight rows),
    /// fp8_gemm_algo=0..=7 (0: cuBLASLt's first candidate for the block-scaled products),
    /// fp8_fused_act=0|1 (1: SiLU x up rounds its output to FP8 for down in the same kernel),
    /// fp8_fused_norm=0|1 (1: the norms before qkv and gate/up round their output to FP8 in
    /// the same kernel), fp8_skinny=0|1|2|3 (steps of 17-64 rows over FP8 weights on a
    /// hand-written product instead of cuBLASLt's: 1 on e4m3 mma.sync, measured slower on
    /// Hopper; 2 on Hopper's warpgroup FP8 MMAs; 3 the same, its MMAs overlapped).
    #[arg(help_heading = "Device", long = "cuda-tune", value_name = "KEY=VALUE", value_parser = parse_cuda_tune)]
    pub cuda_tune: Vec<String>,
    /// Give every request the output it would get alone: run kernels whose arithmetic for one
    /// sequence does not depend on the others in its step (on a GPU: matrix products that
    /// split no reduction, one attention kernel for prompt and generated tokens, no fused
    /// decode projections; slower, see docs/PERFORMANCE.md). The CPU engine is always so.
    #[arg(help_heading = "Device", long)]
    pub batch_invariant: bool,
    /// Split the model over N tensor-parallel ranks (on CPU, threads sharing the machine's
    /// cores), each with its share of the attention heads, KV heads and MLP; their products'
    /// sums go in one fixed order, so any N gives the tokens of 1. N is a power of two up to
    /// the model's `reduction_groups` (`tandem model inspect`); a prefill or decode engine's
    /// ranks hold one KV head each at least, and pair with peers of any rank count. CPU only so
    /// far.
    #[arg(help_heading = "Device", long, default_value_t = 1)]
    pub tensor_parallel_size: usize,
    /// Fault injection (tests): the last tensor-parallel rank fails mid-forward (at its first
    /// all-reduce) in the engine's Nth forward, once, as a rank that dies would.
    #[arg(long, hide = true, value_name = "N")]
    pub fault_rank_fails_at_forward: Option<u64>,
}

impl ModelArgs {
    /// The same settings as `serve` arguments (for the processes `up` starts).
    pub fn to_args(&self) -> Vec<String> {
        let mut v = vec!["--model".into(), self.model.clone(), "--model-seed".into(), self.model_seed.to_string()];
        if let Some(n) = self.max_model_len {
            v.extend(["--max-model-len".into(), n.to_string()]);
        }
        if let Some(q) = self.quantization {
            v.extend(["--quantization".into(), q.as_str().into()]);
        }
        v
    }
}

impl EngineArgs {
    /// `--max-queue-secs` as the engine takes it (`None`: no bound), or why it is unusable.
    pub fn max_queue_time(&self) -> Result<Option<std::time::Duration>, String> {
        match self.max_queue_secs {
            0.0 => Ok(None),
            s if s.is_finite() && s > 0.0 => Ok(Some(std::time::Duration::from_secs_f64(s))),
            s => Err(format!("--max-queue-secs must be a positive number of seconds or 0 (no bound), not {s}")),
        }
    }
}

impl EngineArgs {
    /// The same settings as `serve` arguments (for the processes `up` starts).
    pub fn to_args(&self) -> Vec<String> {
        let mut v: Vec<String> = [
            ("--block-size", self.block_size.to_string()),
            ("--kv-cache-memory", self.kv_cache_memory.clone()),
            ("--max-num-seqs", self.max_num_seqs.to_string()),
            ("--max-num-batched-tokens", self.max_num_batched_tokens.to_string()),
            ("--max-queue-secs", self.max_queue_secs.to_string()),
            ("--prefix-caching", if self.prefix_caching == Switch::On { "on" } else { "off" }.to_string()),
            ("--device", self.device.clone()),
            ("--gpu-memory-utilization", self.gpu_memory_utilization.to_string()),
            ("--tensor-parallel-size", self.tensor_parallel_size.to_string()),
        ]
        .into_iter()
        .flat_map(|(k, v)| [k.to_string(), v])
        .collect();
        if let Some(n) = self.num_kv_blocks {
            v.extend(["--num-kv-blocks".into(), n.to_string()]);
        }
        if self.kv_cache_dtype == KvCacheDtype::Fp8 {
            v.extend(["--kv-cache-dtype".into(), "fp8".into()]);
        }
        if self.enforce_eager {
            v.push("--enforce-eager".into());
        }
        if self.batch_invariant {
            v.push("--batch-invariant".into());
        }
        let sched = match self.async_scheduling {
            AsyncScheduling::Auto => "auto",
            AsyncScheduling::On => "on",
            AsyncScheduling::Off => "off",
        };
        v.extend(["--async-scheduling".into(), sched.into()]);
        for t in &self.cuda_tune {
            v.extend(["--cuda-tune".into(), t.clone()]);
        }
        v
    }
}

/// The KV cache's element type (`--kv-cache-dtype`, vLLM's names).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvCacheDtype {
    /// The model's compute type: f32 on CPU, bf16 on a GPU.
    Auto,
    /// FP8 e4m3.
    #[value(alias = "fp8_e4m3")]
    Fp8,
}

impl KvCacheDtype {
    /// The element type of a CPU engine's cache.
    pub fn on_cpu(self) -> tandem_compute::KvDtype {
        match self {
            Self::Auto => tandem_compute::KvDtype::F32,
            Self::Fp8 => tandem_compute::KvDtype::Fp8E4m3,
        }
    }

    /// The element type of a GPU engine's cache.
    pub fn on_gpu(self) -> tandem_compute::KvDtype {
        match self {
            Self::Auto => tandem_compute::KvDtype::Bf16,
            Self::Fp8 => tandem_compute::KvDtype::Fp8E4m3,
        }
    }
}

/// A feature on or off.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Switch {
    On,
    Off,
}

/// Whether the engine pipelines its steps (`--async-scheduling`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum AsyncScheduling {
    /// On for GPUs, off on CPU.
    Auto,
    /// Always (on CPU it only reorders the work; for tests).
    On,
    /// Never: each step waits for its tokens before the next is planned.
    Off,
}

impl AsyncScheduling {
    /// Whether to pipeline on a GPU (`gpu`) or the CPU.
    pub fn enabled(self, gpu: bool) -> bool {
        match self {
            Self::Auto => gpu,
            Self::On => true,
            Self::Off => false,
        }
    }
}

/// One `--cuda-tune` setting, checked (the key known, the value in range).
pub(crate) fn parse_cuda_tune(s: &str) -> Result<String, String> {
    tandem_compute::cuda::CudaTuning::from_settings(&[s])?;
    Ok(s.to_string())
}

/// Parses sizes like `512MiB`, `2GiB`, `1.5G`, `1000000` (bytes).
pub fn parse_bytes(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let split = s.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let value: f64 = num.trim().parse().map_err(|_| format!("`{s}` is not a size (try 512MiB or 2GiB)"))?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "kib" => 1024.0,
        "m" | "mb" => 1e6,
        "mib" => 1024.0 * 1024.0,
        "g" | "gb" => 1e9,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        other => return Err(format!("unknown size unit `{other}` in `{s}`")),
    };
    if value.is_nan() || value < 0.0 {
        return Err(format!("`{s}` is not a size"));
    }
    Ok((value * mult) as usize)
}

pub(crate) fn load_model(m: &ModelArgs) -> Result<LoadedModel> {
    let source = model_source(&m.model, m.model_seed)?;
    let t = Instant::now();
    let spec = ModelSpec::load(&source, m.max_model_len)
        .and_then(|s| s.with_quantization(m.quantization))
        .with_context(|| format!("loading model `{}`", m.model))?;
    let model = LoadedModel::from_spec(spec).with_context(|| format!("loading model `{}`", m.model))?;
    let cfg = model.transformer.config();
    tracing::info!(
        model = %m.model,
        architecture = cfg.architecture.hf_name(),
        params_m = cfg.num_params() as f64 / 1e6,
        tokenizer = model.tokenizer.is_some(),
        max_model_len = model.max_model_len,
        secs = t.elapsed().as_secs_f64(),
        "model loaded"
    );
    if model.tokenizer.is_none() {
        tracing::info!("no tokenizer.json: token-ids mode (prompts must be token id lists)");
    }
    Ok(model)
}

/// `--model`: a preset, a directory, a GGUF file, or a Hub repository fetched as the Hugging
/// Face tools would: `HF_ENDPOINT` names a mirror, `HF_TOKEN` opens gated models (`HF_HOME`,
/// the cache, hf-hub reads itself).
pub(crate) fn model_source(spec: &str, seed: u64) -> anyhow::Result<ModelSource> {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let hub = tandem_model::hub::HubConfig {
        endpoint: var("HF_ENDPOINT"),
        token: var("HF_TOKEN"),
        cache_dir: None,
        progress: true,
    };
    Ok(ModelSource::parse_or_fetch(spec, seed, &hub)?)
}

/// A model ready for an engine on the chosen device, with what the engine and server need.
pub(crate) struct EngineParts {
    pub model: tandem_engine::EngineModel,
    pub tokenizer: Option<tandem_model::TextTokenizer>,
    pub eos_token_ids: Vec<u32>,
    pub max_model_len: usize,
    pub generation_defaults: tandem_model::GenerationDefaults,
    pub config: EngineConfig,
    pub fingerprint: String,
}

/// `cpu`, `cuda:N`, or `auto` (GPU 0 when CUDA works here, else CPU, saying why).
pub(crate) fn resolve_device(spec: &str) -> Result<DeviceSpec> {
    if spec == "auto" {
        return Ok(match tandem_compute::cuda::libraries_present() {
            Ok(()) => DeviceSpec::Cuda(0),
            Err(e) => {
                tracing::warn!("--device auto: {e}; running on CPU");
                DeviceSpec::Cpu
            }
        });
    }
    spec.parse().map_err(anyhow::Error::msg)
}

/// Loads the model onto `--device` and sizes the engine around it. `host_kv_bytes`: a GPU
/// engine keeps a host copy of its KV cache of at most this size, for the KV connector.
pub(crate) fn build_engine(m: &ModelArgs, e: &EngineArgs, host_kv_bytes: Option<usize>) -> Result<EngineParts> {
    let device = resolve_device(&e.device)?;
    if e.tensor_parallel_size > 1 {
        return match device {
            DeviceSpec::Cpu => build_tensor_parallel(m, e),
            DeviceSpec::Cuda(_) => bail!("--tensor-parallel-size {} runs on CPU only so far", e.tensor_parallel_size),
        };
    }
    if e.fault_rank_fails_at_forward.is_some() {
        bail!("--fault-rank-fails-at-forward needs --tensor-parallel-size 2 or more");
    }
    match device {
        DeviceSpec::Cpu => {
            let model = load_model(m)?;
            let config = engine_config(e, model.transformer.config())?;
            let fingerprint = model.transformer.fingerprint();
            let runner: Box<dyn ModelRunner> = Box::new(tandem_model::CpuRunner::with_kv_dtype(
                model.transformer,
                config.block_size,
                config.num_blocks,
                e.kv_cache_dtype.on_cpu(),
            ));
            Ok(EngineParts {
                model: runner.into(),
                tokenizer: model.tokenizer,
                eos_token_ids: model.eos_token_ids,
                max_model_len: model.max_model_len,
                generation_defaults: model.generation_defaults.clone(),
                config,
                fingerprint,
            })
        }
        DeviceSpec::Cuda(ordinal) => {
            if m.quantization.is_some() && e.batch_invariant {
                bail!("--batch-invariant with --quantization on a GPU is not built yet");
            }
            if e.kv_cache_dtype == KvCacheDtype::Fp8 && e.batch_invariant {
                bail!("--kv-cache-dtype fp8 with --batch-invariant on a GPU is not built yet (its attention kernels read bf16 KV)");
            }
            let source = model_source(&m.model, m.model_seed)?;
            let spec = ModelSpec::load(&source, m.max_model_len)
                .and_then(|s| s.with_quantization(m.quantization))
                .with_context(|| format!("loading model `{}`", m.model))?;
            if !(e.gpu_memory_utilization > 0.0 && e.gpu_memory_utilization <= 1.0) {
                bail!("--gpu-memory-utilization must be in (0, 1]");
            }
            let opts = CudaOptions {
                ordinal,
                block_size: e.block_size,
                max_tokens: e.max_num_batched_tokens,
                max_seqs: e.max_num_seqs,
                memory_utilization: e.gpu_memory_utilization,
                num_blocks: e.num_kv_blocks,
                cuda_graphs: !e.enforce_eager,
                host_kv_bytes,
                tuning: tuning(&e.cuda_tune)?,
                batch_invariant: e.batch_invariant,
                kernel_cache: kernel_cache_dir(),
                kv_dtype: e.kv_cache_dtype.on_gpu(),
                ..CudaOptions::default()
            };
            let t = Instant::now();
            let model =
                CudaModel::load(&spec, &opts).with_context(|| format!("loading `{}` onto cuda:{ordinal}", m.model))?;
            let config = EngineConfig {
                block_size: e.block_size,
                num_blocks: model.kv_layout().num_blocks,
                max_num_seqs: e.max_num_seqs,
                max_num_batched_tokens: e.max_num_batched_tokens,
                async_scheduling: e.async_scheduling.enabled(true),
                max_queue_time: e.max_queue_time().map_err(anyhow::Error::msg)?,
                prefix_caching: e.prefix_caching == Switch::On,
            };
            config.validate().map_err(anyhow::Error::msg)?;
            tracing::info!(
                model = %m.model,
                device = %model.describe(),
                num_blocks = config.num_blocks,
                kv_tokens = config.num_blocks * config.block_size,
                secs = t.elapsed().as_secs_f64(),
                "model ready on the GPU"
            );
            let fingerprint = model.fingerprint();
            let runner: Box<dyn ModelRunner> = Box::new(model);
            Ok(EngineParts {
                model: runner.into(),
                tokenizer: spec.tokenizer,
                eos_token_ids: spec.eos_token_ids,
                max_model_len: spec.max_model_len,
                generation_defaults: spec.generation_defaults.clone(),
                config,
                fingerprint,
            })
        }
    }
}

/// Resolves the engine's size: KV blocks from memory unless given exactly.
/// A prefill or decode engine moves its KV cache as one region laid out as a one-rank
/// engine's: its tensor-parallel ranks must hold a KV head each at least (no head repeated over
/// ranks). Checked on the model's shape alone, before its weights load.
pub(crate) fn check_tensor_parallel_kv(m: &ModelArgs, e: &EngineArgs) -> Result<()> {
    let size = e.tensor_parallel_size;
    if size <= 1 {
        return Ok(());
    }
    let source = model_source(&m.model, m.model_seed)?;
    let shape =
        ModelSpec::load_shape(&source, m.max_model_len).with_context(|| format!("reading model `{}`", m.model))?;
    let kv_heads = shape.config.num_kv_heads;
    if kv_heads < size {
        bail!(
            "--tensor-parallel-size {size} for a prefill or decode engine: `{}` has {kv_heads} KV heads, which would repeat over {size} ranks, and the KV connector moves each head from one rank; use at most {kv_heads} ranks (more serve colocated)",
            m.model
        );
    }
    Ok(())
}

/// A CPU engine's model split over `--tensor-parallel-size` ranks.
fn build_tensor_parallel(m: &ModelArgs, e: &EngineArgs) -> Result<EngineParts> {
    let source = model_source(&m.model, m.model_seed)?;
    let t = Instant::now();
    let spec = ModelSpec::load(&source, m.max_model_len)
        .and_then(|s| s.with_quantization(m.quantization))
        .with_context(|| format!("loading model `{}`", m.model))?;
    let config = engine_config(e, &spec.config)?;
    let weights = spec.cpu_weights().with_context(|| format!("loading model `{}`", m.model))?;
    let size = e.tensor_parallel_size;
    let mut tp = tandem_model::TpModel::load(
        &spec.config,
        weights,
        spec.max_model_len,
        size,
        (config.block_size, config.num_blocks),
        e.kv_cache_dtype.on_cpu(),
    )
    .with_context(|| format!("splitting `{}` over {size} ranks", m.model))?;
    if let Some(forward) = e.fault_rank_fails_at_forward {
        tp.fail_rank_at(forward, size - 1, 1);
    }
    tracing::info!(
        model = %m.model,
        architecture = spec.config.architecture.hf_name(),
        ranks = size,
        tokenizer = spec.tokenizer.is_some(),
        max_model_len = spec.max_model_len,
        secs = t.elapsed().as_secs_f64(),
        "model loaded, tensor parallel"
    );
    let fingerprint = tp.rank0().fingerprint();
    let runner: Box<dyn tandem_model::ModelRunner> = Box::new(tandem_model::CpuRunner::tensor_parallel(tp));
    Ok(EngineParts {
        model: runner.into(),
        tokenizer: spec.tokenizer,
        eos_token_ids: spec.eos_token_ids,
        max_model_len: spec.max_model_len,
        generation_defaults: spec.generation_defaults,
        config,
        fingerprint,
    })
}

/// A CPU engine's size: its KV blocks of `--kv-cache-dtype` from `--kv-cache-memory` unless
/// given exactly.
fn engine_config(e: &EngineArgs, model: &tandem_model::ModelConfig) -> Result<EngineConfig> {
    let per_token = model.kv_bytes_per_token_f32() / 4 * e.kv_cache_dtype.on_cpu().bytes();
    let num_blocks = match e.num_kv_blocks {
        Some(n) => n,
        None => {
            let bytes = parse_bytes(&e.kv_cache_memory).map_err(anyhow::Error::msg)?;
            EngineConfig::blocks_for_memory(bytes, e.block_size.max(1), per_token)
        }
    };
    let cfg = EngineConfig {
        block_size: e.block_size,
        num_blocks,
        max_num_seqs: e.max_num_seqs,
        max_num_batched_tokens: e.max_num_batched_tokens,
        async_scheduling: e.async_scheduling.enabled(false),
        max_queue_time: e.max_queue_time().map_err(anyhow::Error::msg)?,
        prefix_caching: e.prefix_caching == Switch::On,
    };
    cfg.validate().map_err(anyhow::Error::msg)?;
    tracing::info!(
        block_size = cfg.block_size,
        num_blocks = cfg.num_blocks,
        kv_tokens = cfg.num_blocks * cfg.block_size,
        kv_dtype = e.kv_cache_dtype.on_cpu().name(),
        kv_mib = (cfg.num_blocks * cfg.block_size * per_token) as f64 / (1 << 20) as f64,
        "KV cache sized"
    );
    Ok(cfg)
}

/// The CUDA tuning of `--cuda-tune` settings (each checked when parsed).
/// Where GPU engines keep their compiled kernels between starts: `$TANDEM_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/tandem`, else `~/.cache/tandem` (none: compiled at every start).
pub(crate) fn kernel_cache_dir() -> Option<std::path::PathBuf> {
    use std::path::PathBuf;
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    var("TANDEM_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| var("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("tandem")))
        .or_else(|| var("HOME").map(|d| PathBuf::from(d).join(".cache/tandem")))
}

pub(crate) fn tuning(settings: &[String]) -> Result<tandem_compute::cuda::CudaTuning> {
    tandem_compute::cuda::CudaTuning::from_settings(settings).map_err(anyhow::Error::msg)
}

/// A finite number of seconds, 0 or more.
pub(crate) fn seconds(s: f64, name: &str) -> Result<std::time::Duration> {
    if s.is_finite() && s >= 0.0 {
        Ok(std::time::Duration::from_secs_f64(s))
    } else {
        bail!("{name} must be a number of seconds >= 0")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--help` names every key `--cuda-tune` takes (the list is written by hand).
    #[test]
    fn cuda_tune_help_names_every_key() {
        use clap::CommandFactory;
        #[derive(clap::Parser)]
        struct Flags {
            #[command(flatten)]
            engine: EngineArgs,
        }
        let help = Flags::command().render_long_help().to_string();
        for (key, _) in tandem_compute::cuda::CudaTuning::KEYS {
            assert!(help.contains(&format!("{key}=")), "--cuda-tune's help does not name {key}");
        }
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("2GiB"), Ok(2 << 30));
        assert_eq!(parse_bytes("1.5G"), Ok(1_500_000_000));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("3 parsecs").is_err());
    }
}
