//! Command-line arguments as typed, then resolved once into component configs.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// tandem: an LLM serving engine with an OpenAI-compatible API and prefill/decode
/// disaggregation, KV moving from prefill to decode in push or pull mode.
///
/// Start with `tandem up` (prefill, decode and router on this machine) or `tandem serve`
/// (one engine). Logs go to stderr; NO_COLOR=1 turns their colours off.
#[derive(Parser, Debug)]
#[command(name = "tandem", version)]
pub struct Cli {
    /// Log filter (tracing's EnvFilter syntax), e.g. `info` or `tandem_engine=debug`.
    #[arg(long, global = true, env = "TANDEM_LOG", default_value = "info")]
    pub log: String,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Serve a model over the OpenAI API (/v1/completions, /v1/chat/completions, /metrics, ...),
    /// colocated or as the prefill or decode half of a disaggregated pair.
    Serve(ServeArgs),
    /// The proxy in front of prefill and decode engines (push or pull KV transfer).
    Router(RouterArgs),
    /// The whole disaggregated system on this machine: prefill (8100), decode (8200) and the
    /// router (8000), on an embedded default model. Ctrl-C stops all three.
    Up(Box<UpArgs>),
    /// Generate one completion on this machine and print it.
    Generate(GenerateArgs),
    /// Make or look at model directories.
    #[command(subcommand)]
    Model(ModelCommand),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
}

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
    /// attention_stages=auto|1|2 (auto), bulk_early_rows=0..=8 (8), tensor_core_projections=0|1
    /// (0), bulk_o_projection=0|1 (1).
    #[arg(help_heading = "Device", long = "cuda-tune", value_name = "KEY=VALUE", value_parser = parse_cuda_tune)]
    pub cuda_tune: Vec<String>,
    /// Give every request the output it would get alone: run kernels whose arithmetic for one
    /// sequence does not depend on the others in its step (on a GPU: matrix products that
    /// split no reduction, one attention kernel for prompt and generated tokens, no fused
    /// decode projections; slower, see docs/PERFORMANCE.md). The CPU engine is always so.
    #[arg(help_heading = "Device", long)]
    pub batch_invariant: bool,
}

impl ModelArgs {
    /// The same settings as `serve` arguments (for the processes `up` starts).
    pub fn to_args(&self) -> Vec<String> {
        let mut v = vec!["--model".into(), self.model.clone(), "--model-seed".into(), self.model_seed.to_string()];
        if let Some(n) = self.max_model_len {
            v.extend(["--max-model-len".into(), n.to_string()]);
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
        ]
        .into_iter()
        .flat_map(|(k, v)| [k.to_string(), v])
        .collect();
        if let Some(n) = self.num_kv_blocks {
            v.extend(["--num-kv-blocks".into(), n.to_string()]);
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

#[derive(Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (default: 8000 colocated, 8100 prefill, 8200 decode).
    #[arg(long)]
    pub port: Option<u16>,
    /// Name clients use in the `model` field (default: the --model argument).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// On Ctrl-C or SIGTERM, seconds to let requests in flight finish before ending them with
    /// an error (a second signal ends them at once).
    #[arg(long, default_value_t = 5.0)]
    pub shutdown_timeout_secs: f64,
    /// Requests that may wait for a place beside the --max-num-seqs running ones; past that a
    /// request gets a 429 with Retry-After at once (0: no bound).
    #[arg(long, default_value_t = 1024)]
    pub max_queued_requests: usize,
    /// Where a request's unset sampling fields (temperature, top_p, top_k, and the cap on the
    /// default max_tokens) come from: `auto`, the model's generation_config.json as vLLM reads
    /// it; `vllm`, the OpenAI API's defaults whatever the model says (its EOS ids still apply).
    #[arg(long, value_enum, default_value_t = GenerationConfigArg::Auto)]
    pub generation_config: GenerationConfigArg,
    /// The chat template to use instead of the model's: a file, or the template itself on one
    /// line (Jinja, as in tokenizer_config.json).
    #[arg(long, value_name = "FILE_OR_TEMPLATE")]
    pub chat_template: Option<String>,
    #[command(flatten)]
    pub kv: KvArgs,
}

/// `--generation-config`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum GenerationConfigArg {
    /// The model's generation_config.json.
    Auto,
    /// The API's defaults.
    Vllm,
}

/// An engine's part in disaggregated serving.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum RoleArg {
    /// Prefill and decode in one engine (no KV transfer).
    Both,
    /// Prefill only: hands each prompt's KV to a decode engine.
    Prefill,
    /// Decode only: receives each prompt's KV from a prefill engine.
    Decode,
}

/// What KV bytes may travel over between prefill and decode engines.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvTransportArg {
    /// The fastest both ends offer: cuda-ipc between GPU engines of one host, else tcp (the
    /// log says why cuda-ipc was not possible).
    Auto,
    /// Bytes over the TCP side channel, through a host copy of the KV cache on GPU engines.
    Tcp,
    /// Device-to-device copies between GPU engines of one host (one GPU, or two with peer
    /// access). No host copy of the KV cache is kept (--kv-host-gib is not used); a peer that
    /// cannot use cuda-ipc is refused at handshake, saying why.
    CudaIpc,
    /// NIXL one-sided WRITEs into the peer's registered KV memory, with a notification per
    /// transfer (UCX: RDMA, EFA, shared memory or TCP, whichever it finds). Needs a tandem built
    /// with `--features nixl` and libnixl_capi.so on LD_LIBRARY_PATH. A GPU engine registers
    /// its device cache (no host copy of it).
    Nixl,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum NixlPullArg {
    Auto,
    Read,
    Write,
}

impl NixlPullArg {
    pub fn to_kv(self) -> tandem_kv::NixlPull {
        match self {
            NixlPullArg::Auto => tandem_kv::NixlPull::Auto,
            NixlPullArg::Read => tandem_kv::NixlPull::Read,
            NixlPullArg::Write => tandem_kv::NixlPull::Write,
        }
    }
}

impl KvTransportArg {
    pub fn name(self) -> &'static str {
        self.to_kv().name()
    }

    pub fn to_kv(self) -> tandem_kv::KvTransport {
        match self {
            KvTransportArg::Auto => tandem_kv::KvTransport::Auto,
            KvTransportArg::Tcp => tandem_kv::KvTransport::Tcp,
            KvTransportArg::CudaIpc => tandem_kv::KvTransport::CudaIpc,
            KvTransportArg::Nixl => tandem_kv::KvTransport::Nixl,
        }
    }
}

/// How KV moves between prefill and decode.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvModeArg {
    /// Decode registers its blocks when it allocates them; prefill writes into them as soon as
    /// the prompt is done (the router sends both legs at once). Lower TTFT under load.
    Push,
    /// Prefill holds its blocks under a lease; decode reads them after prefill answers (the
    /// router sends the legs one after the other, and may pick decode late).
    Pull,
}

/// What a decode engine does when a prompt's KV cannot be loaded.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvLoadFailureArg {
    /// Compute the prompt locally instead (same tokens, later).
    Recompute,
    /// Answer the request with an error.
    Fail,
}

/// Disaggregation settings (ignored with --role both).
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Disaggregation (prefill and decode roles)")]
pub struct KvArgs {
    /// both, prefill or decode.
    #[arg(long, value_enum, default_value = "both")]
    pub role: RoleArg,
    /// push or pull; prefill and decode must agree (they refuse to pair otherwise).
    #[arg(long, value_enum, default_value = "push")]
    pub kv_mode: KvModeArg,
    /// What the KV bytes travel over: auto, tcp, cuda-ipc or nixl.
    #[arg(long, value_enum, default_value = "auto")]
    pub kv_transport: KvTransportArg,
    /// nixl: the writing engine probes each new link with a 16 MiB write before any KV moves and
    /// refuses the peer, naming the rate, when it runs slower than this many GB/s (UCX falls
    /// back to a software path silently when it finds no fast one). 0 accepts any rate. A pull
    /// prefill engine probes a READ too (see --kv-nixl-pull).
    #[arg(long, default_value_t = 1.0)]
    pub kv_nixl_min_gb_s: f64,
    /// nixl, pull: who moves the KV. auto: decode READs where the prefill engine's probe READ
    /// from it runs at --kv-nixl-min-gb-s or more, else prefill WRITEs (UCX can serve READs of
    /// GPU memory through TCP while WRITEs take NVLink); read or write forces one. Set on the
    /// prefill engine, which decides per link.
    #[arg(long, value_enum, default_value = "auto")]
    pub kv_nixl_pull: NixlPullArg,
    /// This engine's id on the KV side channel (default: role and port).
    #[arg(long)]
    pub engine_id: Option<String>,
    /// Host the KV side channel binds (0.0.0.0: every interface, for peers on other hosts).
    #[arg(long, default_value = "127.0.0.1")]
    pub kv_host: String,
    /// Host peers are told to reach the KV side channel at (it travels in kv_transfer_params
    /// and the handshake). Default: --kv-host, or, when that is 0.0.0.0 or ::, this host's
    /// address on its default route (logged at start); name it where that is not the address
    /// the peers reach (several interfaces, NAT).
    #[arg(long)]
    pub kv_advertise_host: Option<String>,
    /// Port of the KV side channel (default: 5600 prefill, 5601 decode; 0 picks a free one).
    #[arg(long)]
    pub kv_port: Option<u16>,
    /// Decode: recompute locally or fail when a prompt's KV cannot be loaded.
    #[arg(long, value_enum, default_value = "recompute")]
    pub kv_load_failure: KvLoadFailureArg,
    /// Pull: seconds prefill holds a finished prompt's blocks without a decode heartbeat.
    #[arg(long, default_value_t = 30.0)]
    pub kv_lease_secs: f64,
    /// Longest wait for a transfer (decode waiting for KV; push prefill waiting for a
    /// registration), seconds.
    #[arg(long, default_value_t = 30.0)]
    pub kv_transfer_timeout_secs: f64,
    /// Seconds of silence after which a KV peer counts as dead (frozen or gone): its connection
    /// closes and the transfers on it fail (and recompute, by --kv-load-failure) instead of
    /// waiting out their timeout. Both ends send a heartbeat every third of it.
    #[arg(long, default_value_t = 10.0)]
    pub kv_liveness_secs: f64,
    /// On a GPU (prefill and decode roles, --kv-transport auto or tcp): host memory for the KV
    /// connector's copy of the KV cache, GiB (the GPU's bf16 bytes). tcp transfers go through
    /// it, and the GPU's KV cache is capped to the blocks it holds. Page-locked at start-up (about 0.4 s per GiB) so that
    /// copies to and from the GPU run at PCIe speed.
    #[arg(long, default_value_t = 16.0)]
    pub kv_host_gib: f64,
    /// Every KV transfer is checked where it lands: over tcp by a CRC-32 of its bytes, over a
    /// direct copy (cuda-ipc) by the writer's digest of the KV against the reader's digest of
    /// its blocks. KV corrupted on the way fails the transfer (counted as checksum_failures;
    /// decode recomputes or fails by --kv-load-failure) instead of decoding garbage. Both
    /// engines need it (a pair that differs is refused at handshake).
    #[arg(long)]
    pub kv_verify: bool,
    /// Test only: prefill drops push completion notifications (exercises the timeout path).
    #[arg(long, hide = true)]
    pub fault_drop_done: bool,
    /// Test only: prefill waits this long before each push write and pull read it answers
    /// (late writes into blocks decode gave up, reads past the lease).
    #[arg(long, hide = true, default_value_t = 0)]
    pub fault_slow_write_ms: u64,
    /// Test only: every KV send is corrupted by one flipped bit after it is checksummed (with
    /// --kv-verify, each transfer fails as a checksum failure and is recomputed).
    #[arg(long, hide = true)]
    pub fault_corrupt_sends: bool,
}

#[derive(Args, Debug)]
pub struct UpArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Given to both engines.
    #[command(flatten)]
    pub engine: EngineArgs,
    /// push or pull.
    #[arg(long, value_enum, default_value = "push")]
    pub kv_mode: KvModeArg,
    /// What the KV bytes travel over between the two engines: auto, tcp, cuda-ipc or nixl.
    #[arg(long, value_enum, default_value = "auto")]
    pub kv_transport: KvTransportArg,
    /// Check every KV transfer where it lands (see `tandem serve --help`).
    #[arg(long)]
    pub kv_verify: bool,
    /// Conditional disaggregation: prompts decode would compute at most this many tokens of
    /// (short ones, or a turn over a history decode holds) run on decode alone (see `tandem
    /// router --help`).
    #[arg(long)]
    pub local_prefill_max_tokens: Option<usize>,
    /// Router port (the OpenAI endpoint).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Prefill engine port.
    #[arg(long, default_value_t = 8100)]
    pub prefill_port: u16,
    /// Decode engine port.
    #[arg(long, default_value_t = 8200)]
    pub decode_port: u16,
    /// KV side-channel port of prefill (decode uses the next one).
    #[arg(long, default_value_t = 5600)]
    pub kv_port: u16,
    /// Model name clients use.
    #[arg(long, default_value = "tandem")]
    pub served_model_name: String,
    /// Seconds to wait for all three to become healthy.
    #[arg(long, default_value_t = 120)]
    pub ready_timeout_secs: u64,
    /// Log filter for the three processes.
    #[arg(long = "child-log", default_value = "info")]
    pub log: String,
    /// Once up, run a short sweep against the router (this mode; 2 request rates x 2 input
    /// lengths), print the table and the figure paths, then stop.
    #[arg(long)]
    pub bench: bool,
    /// Where `--bench` writes its results and figures.
    #[arg(long, default_value = "results-up")]
    pub bench_dir: PathBuf,
}

#[derive(Args, Debug)]
pub struct RouterArgs {
    /// push or pull (must match the engines).
    #[arg(long, value_enum, default_value = "push")]
    pub mode: KvModeArg,
    /// Prefill engine base URLs, e.g. http://127.0.0.1:8100 (repeat or comma-separate).
    #[arg(long, value_delimiter = ',', required = true)]
    pub prefill: Vec<String>,
    /// Decode engine base URLs, e.g. http://127.0.0.1:8200 (repeat or comma-separate).
    #[arg(long, value_delimiter = ',', required = true)]
    pub decode: Vec<String>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on.
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Seconds to wait for every engine to report healthy at start.
    #[arg(long, default_value_t = 120)]
    pub ready_timeout_secs: u64,
    /// Seconds a prefill leg may take.
    #[arg(long, default_value_t = 300)]
    pub prefill_timeout_secs: u64,
    /// Seconds between checks of every engine's health, mode and model while serving.
    #[arg(long, default_value_t = 2.0)]
    pub check_interval_secs: f64,
    /// Conditional disaggregation: run a request entirely on the decode engine when it would
    /// compute at most this many of its prompt's tokens there (the prompt less what that
    /// engine's prefix cache holds): a short prompt, or a chat turn over a history decode has
    /// seen, skips the prefill leg and the transfer. Unset: every request is disaggregated. A
    /// request's `kv_transfer_params: {"disaggregate": true|false}` overrides it. With several
    /// prefill engines the router also sends each prompt to the one whose prefix cache holds
    /// the most of it (load permitting).
    #[arg(long)]
    pub local_prefill_max_tokens: Option<usize>,
    /// With several engines of a role, send each prompt to the one whose prefix cache holds
    /// the most of it, unless it is 8 requests busier than the least busy (`on`), or always to
    /// the least busy, round-robin among ties (`off`).
    #[arg(long, value_enum, default_value_t = Switch::On)]
    pub kv_aware_routing: Switch,
    /// On Ctrl-C or SIGTERM, seconds to let requests in flight finish before ending them with
    /// an error (a second signal ends them at once).
    #[arg(long, default_value_t = 5.0)]
    pub shutdown_timeout_secs: f64,
}

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Prompt text (needs a tokenizer).
    #[arg(long, conflicts_with = "prompt_ids", required_unless_present = "prompt_ids")]
    pub prompt: Option<String>,
    /// Prompt as comma-separated token ids, e.g. `1,2,3` (works without a tokenizer).
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 (the default here) is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling mass.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Keep only the k most likely tokens (0 disables).
    #[arg(long, default_value_t = 0)]
    pub top_k: u32,
    /// Sampling seed (same seed, same output).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print a JSON object (token_ids, text, finish_reason, timings) instead of the text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Subcommand, Debug)]
pub enum ModelCommand {
    /// Write a preset as a Hugging Face model directory with seeded random weights.
    Init {
        /// Preset name (see `tandem model list`).
        #[arg(long)]
        preset: String,
        /// Directory to write.
        #[arg(long)]
        out: PathBuf,
        /// Weight seed (same seed, same bytes).
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Print a model's shape, parameter count and KV bytes per token.
    Inspect {
        #[command(flatten)]
        model: ModelArgs,
    },
    /// List the built-in presets.
    List,
}

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Decode and prefill throughput of one engine, against the memory-bandwidth floor
    /// measured in the same run.
    Engine(BenchEngineArgs),
    /// Load-test an OpenAI-compatible server (ours or vLLM's) and report vLLM's serving
    /// metrics (TTFT, TPOT, ITL, E2EL, throughput, goodput).
    Serve(Box<BenchServeArgs>),
    /// The P/D experiment: modes x request rates x input lengths, one vLLM-style JSON per point
    /// plus summary.csv, against given URLs or servers it launches itself (--launch).
    Sweep(SweepArgs),
    /// Figures from a sweep: the four-panel metric-vs-rate figure and the TTFT breakdown.
    Plot(PlotArgs),
    /// Throughput of a KV transport moving a KV set to another process: tcp against raw
    /// loopback TCP, cuda-ipc against device copies inside one GPU, each measured in the same
    /// run.
    Kv(BenchKvArgs),
    /// The peer process `bench kv` starts (internal).
    #[command(hide = true)]
    KvPeer(BenchKvArgs),
    /// Minutes of load past capacity through router + prefill + decode (each mode), with
    /// client cancellations and engines frozen now and then (SIGSTOP): every answer is checked
    /// against a colocated engine's, and the run fails if one is wrong, one is lost, or a KV
    /// block leaks.
    Soak(SoakArgs),
}

#[derive(Args, Debug, Clone)]
pub struct SoakArgs {
    /// Modes to soak, one after the other: push, pull.
    #[arg(long, value_delimiter = ',', default_value = "push,pull")]
    pub modes: Vec<String>,
    /// Seconds of load per mode.
    #[arg(long, default_value_t = 120.0)]
    pub secs: f64,
    /// Requests per second; by default --overload times the capacity measured first.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Load as a multiple of the measured capacity (without --rate).
    #[arg(long, default_value_t = 2.0)]
    pub overload: f64,
    /// Fraction of requests the client abandons after up to 300 ms.
    #[arg(long, default_value_t = 0.15)]
    pub cancel_fraction: f64,
    /// Every this many seconds, freeze the prefill or the decode engine (in turn) with SIGSTOP
    /// for --freeze-secs, then let it go on (0: no freezes).
    #[arg(long, default_value_t = 20.0)]
    pub freeze_every_secs: f64,
    /// How long a freeze lasts (longer than the engines' --kv-liveness-secs 1).
    #[arg(long, default_value_t = 3.0)]
    pub freeze_secs: f64,
    /// A request with no answer after this many seconds counts as lost.
    #[arg(long, default_value_t = 60.0)]
    pub request_timeout_secs: f64,
    /// The model.
    #[arg(long, default_value = "preset:tiny-qwen3")]
    pub model: String,
    /// Router port; prefill +100, decode +200, KV +300/+301, the reference engine +400.
    #[arg(long, default_value_t = 19000)]
    pub base_port: u16,
    /// KV cache blocks per engine (small, so that requests are preempted and recomputed).
    #[arg(long, default_value_t = 512)]
    pub num_kv_blocks: usize,
    /// Token ids are drawn below this.
    #[arg(long, default_value_t = 500)]
    pub vocab_size: u32,
    /// Write the reports as JSON here too.
    #[arg(long)]
    pub json_out: Option<PathBuf>,
    /// Seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Where every engine runs (the reference too): `cpu` or `cuda:N`. Answers are compared
    /// with the reference's bit for bit, so a GPU soak needs --batch-invariant.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Every engine with --batch-invariant (see `tandem serve --help`).
    #[arg(long)]
    pub batch_invariant: bool,
    /// The engines' and router's log filter (their output joins this command's), e.g. `warn`
    /// to see why a request went wrong.
    #[arg(long, default_value = "error")]
    pub engine_log: String,
    /// One more argument for the prefill and decode engines' `serve` (not the reference's),
    /// e.g. --engine-arg=--kv-transport=tcp or --engine-arg=--async-scheduling=off to narrow
    /// down where a wrong answer comes from (repeatable).
    #[arg(long = "engine-arg", allow_hyphen_values = true)]
    pub engine_args: Vec<String>,
}

#[derive(Args, Debug, Clone)]
pub struct SweepArgs {
    /// Modes to run: push, pull, colocated.
    #[arg(long, value_delimiter = ',', default_value = "push,pull,colocated")]
    pub modes: Vec<String>,
    /// Request rates (req/s).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub qps: Vec<f64>,
    /// Prompt lengths (one figure panel each).
    #[arg(long, value_delimiter = ',', default_value = "64,128,256,512")]
    pub input_lens: Vec<usize>,
    /// Output length.
    #[arg(long, default_value_t = 32)]
    pub output_len: usize,
    /// Repetitions of each point.
    #[arg(long, default_value_t = 1)]
    pub iterations: usize,
    /// Requests per point.
    #[arg(long, default_value_t = 20)]
    pub num_prompts: usize,
    /// Token ids are drawn below this (keep within the model's vocabulary).
    #[arg(long, default_value_t = 256)]
    pub vocab_size: u32,
    /// Where results go.
    #[arg(long, default_value = "results")]
    pub result_dir: PathBuf,
    /// Start the servers for each mode on this machine (and stop them after).
    #[arg(long)]
    pub launch: bool,
    /// With --launch: the model.
    #[arg(long, default_value = "preset:tiny-qwen3")]
    pub model: String,
    /// With --launch: router (or colocated server) port; prefill +100, decode +200, KV +300/+301.
    #[arg(long, default_value_t = 18000)]
    pub base_port: u16,
    /// With --launch: the prefill engine's device (cpu, cuda:N).
    #[arg(long, default_value = "cpu")]
    pub prefill_device: String,
    /// With --launch: the decode engine's device.
    #[arg(long, default_value = "cpu")]
    pub decode_device: String,
    /// With --launch: the colocated engine's device.
    #[arg(long, default_value = "cpu")]
    pub colocated_device: String,
    /// With --launch: KV cache blocks per engine (engines sharing a GPU each size their cache
    /// from what is free otherwise).
    #[arg(long)]
    pub num_kv_blocks: Option<usize>,
    /// With --launch: one more argument for every engine's `serve`, e.g.
    /// --engine-arg=--kv-transport=cuda-ipc (repeatable).
    #[arg(long = "engine-arg", allow_hyphen_values = true)]
    pub engine_args: Vec<String>,
    /// Without --launch: URL for each mode, e.g. push=http://127.0.0.1:8000 (repeatable).
    #[arg(long = "url", value_parser = parse_mode_url)]
    pub urls: Vec<(String, String)>,
    /// Seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Also draw the figures into the result directory at the end.
    #[arg(long)]
    pub plot: bool,
}

fn parse_mode_url(s: &str) -> Result<(String, String), String> {
    s.split_once('=').map(|(m, u)| (m.to_string(), u.to_string())).ok_or_else(|| format!("`{s}` is not MODE=URL"))
}

#[derive(Args, Debug, Clone)]
pub struct PlotArgs {
    /// A sweep's result directory.
    #[arg(long, default_value = "results")]
    pub results_dir: PathBuf,
    /// ttft, tpot, itl or e2el (repeat or comma-separate for several figures).
    #[arg(long, value_delimiter = ',', default_value = "ttft,tpot")]
    pub metric: Vec<String>,
    /// Where the figures go (default: the results directory).
    #[arg(long)]
    pub out_dir: Option<PathBuf>,
    /// Only the multi-turn figure (median TTFT by turn, one line per `bench serve
    /// --dataset-name multi-turn` result file in the directory); no sweep figures.
    #[arg(long)]
    pub turns_only: bool,
}

/// Datasets for `bench serve`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DatasetName {
    /// Random prompts of fixed length (see --random-*).
    Random,
    /// A local ShareGPT-format JSON file (--dataset-path).
    Sharegpt,
    /// ShareGPT conversations, turn by turn through the chat endpoint, each turn resending the
    /// conversation with the server's answers (--dataset-path; --multi-turn-turns at most).
    SharegptMultiTurn,
    /// Synthetic conversations sharing one system prompt, each turn resending the history
    /// (see --multi-turn-*; --num-prompts counts conversations; --random-output-len and
    /// --random-vocab-size apply).
    MultiTurn,
}

#[derive(Args, Debug, Clone)]
pub struct BenchServeArgs {
    /// Server base URL.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub base_url: String,
    /// API path.
    #[arg(long, default_value = "/v1/completions")]
    pub endpoint: String,
    /// Model name (default: the first one /v1/models lists).
    #[arg(long)]
    pub model: Option<String>,
    /// Label stored as `backend` in the result.
    #[arg(long, default_value = "tandem")]
    pub backend: String,
    /// Where prompts come from.
    #[arg(long, value_enum, default_value = "random")]
    pub dataset_name: DatasetName,
    /// ShareGPT JSON file.
    #[arg(long)]
    pub dataset_path: Option<PathBuf>,
    /// Random dataset: prompt tokens.
    #[arg(long, default_value_t = 1024)]
    pub random_input_len: usize,
    /// Random dataset: output tokens (also the ShareGPT output length when given).
    #[arg(long, default_value_t = 128)]
    pub random_output_len: usize,
    /// Random dataset: lengths drawn from [len*(1-r), len*(1+r)].
    #[arg(long, default_value_t = 0.0)]
    pub random_range_ratio: f64,
    /// Random dataset: token ids are drawn below this (keep it within the model's vocabulary).
    #[arg(long, default_value_t = 256)]
    pub random_vocab_size: u32,
    /// Random dataset: send prompts as text (random words) instead of token ids.
    #[arg(long)]
    pub random_prompt_text: bool,
    /// Multi-turn dataset: tokens of the system prompt every conversation shares.
    #[arg(long, default_value_t = 4096)]
    pub multi_turn_shared_len: usize,
    /// Multi-turn dataset: each conversation opens with its own --multi-turn-shared-len tokens
    /// instead of one system prompt they all share (so only a conversation's own history
    /// repeats between its turns).
    #[arg(long)]
    pub multi_turn_distinct_openings: bool,
    /// Multi-turn dataset: new user tokens per turn.
    #[arg(long, default_value_t = 128)]
    pub multi_turn_user_len: usize,
    /// Multi-turn dataset: turns per conversation.
    #[arg(long, default_value_t = 4)]
    pub multi_turn_turns: usize,
    /// Requests to send.
    #[arg(long, default_value_t = 1000)]
    pub num_prompts: usize,
    /// Requests per second; `inf` sends all at once.
    #[arg(long, default_value = "inf")]
    pub request_rate: f64,
    /// Gamma shape of arrival gaps: 1 is Poisson, lower is burstier.
    #[arg(long, default_value_t = 1.0)]
    pub burstiness: f64,
    /// Seed for prompts and arrivals.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Most requests in flight.
    #[arg(long)]
    pub max_concurrency: Option<usize>,
    /// Unmeasured requests first.
    #[arg(long, default_value_t = 0)]
    pub num_warmups: usize,
    /// Do not ask the server to ignore end-of-sequence tokens (on by default, as vLLM's random
    /// dataset does, so outputs have the requested length).
    #[arg(long)]
    pub no_ignore_eos: bool,
    /// Percentiles to report, e.g. 50,90,99.
    #[arg(long, alias = "metric-percentiles", value_delimiter = ',', default_value = "99")]
    pub percentiles: Vec<f64>,
    /// SLOs for goodput, e.g. `--goodput ttft:500 tpot:50`.
    #[arg(long, num_args = 1..)]
    pub goodput: Vec<String>,
    /// Write the result JSON.
    #[arg(long)]
    pub save_result: bool,
    /// Add per-request arrays (input_lens, output_lens, ttfts, itls, errors) to the JSON.
    #[arg(long)]
    pub save_detailed: bool,
    /// Directory for the result JSON.
    #[arg(long, default_value = ".")]
    pub result_dir: PathBuf,
    /// File name for the result JSON (default: BACKEND-RATEqps-MODEL-DATE.json).
    #[arg(long)]
    pub result_filename: Option<String>,
    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,
}

#[derive(Args, Debug, Clone)]
pub struct BenchKvArgs {
    /// tcp: the TCP transport against raw loopback TCP (host memory, or with --device a GPU
    /// engine's cache and its host copy on each side); cuda-ipc: device copies into a peer
    /// process's GPU cache against the same copies inside one GPU; nixl: NIXL WRITEs into a
    /// peer process's host KV memory against a host memcpy of the same copies, or with
    /// --device between two processes' GPU caches beside cuda-ipc (the cuda-ipc table plus a
    /// nixl column).
    #[arg(long, value_enum, default_value = "tcp")]
    pub transport: BenchKvTransport,
    /// Size of the KV set moved per transfer (tcp, nixl), e.g. 256MiB.
    #[arg(long, default_value = "256MiB")]
    pub size: String,
    /// cuda-ipc, and nixl with --device: sizes moved, one row each.
    #[arg(long, value_delimiter = ',', default_value = "1MiB,16MiB,64MiB,256MiB,1GiB")]
    pub sizes: Vec<String>,
    /// The GPU of this (the writing) process. cuda-ipc: default cuda:0. tcp: both sides' KV
    /// in this GPU's memory, moved as a GPU engine's connector moves it (copies to and from the
    /// page-locked host copy overlapping the socket, piece by piece); default: host memory.
    #[arg(long)]
    pub device: Option<String>,
    /// cuda-ipc, nixl: the GPU of the peer process (default: the same as --device).
    #[arg(long)]
    pub peer_device: Option<String>,
    /// cuda-ipc: tokens per block in the peer's cache (ours is 16; another size makes every
    /// copy a pitched one, as between engines with different --block-size).
    #[arg(long, default_value_t = 16)]
    pub peer_block_size: usize,
    /// Transfers of each kind (raw and KV); median and best are reported.
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// tcp: every transfer carries a CRC-32 of its bytes, checked where they land
    /// (`--kv-verify`), to measure what verifying costs.
    #[arg(long)]
    pub verify: bool,
    /// Write the report as JSON here too.
    #[arg(long)]
    pub json_out: Option<PathBuf>,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BenchKvTransport {
    Tcp,
    CudaIpc,
    /// NIXL WRITEs with a notification into a peer process's KV memory: host memory against
    /// a host memcpy of the same copies, or with --device GPU memory beside cuda-ipc (a tandem
    /// built with `--features nixl`).
    Nixl,
}

#[derive(Args, Debug)]
pub struct BenchEngineArgs {
    /// Model to measure.
    #[arg(long, default_value = "preset:smollm2-135m")]
    pub model: String,
    /// Weight seed for presets.
    #[arg(long, default_value_t = 0)]
    pub model_seed: u64,
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
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 512)]
    pub prefill_tokens: usize,
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
}

/// One `--cuda-tune` setting, checked (the key known, the value in range).
fn parse_cuda_tune(s: &str) -> Result<String, String> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("2GiB"), Ok(2 << 30));
        assert_eq!(parse_bytes("1.5G"), Ok(1_500_000_000));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("3 parsecs").is_err());
    }

    #[test]
    fn cli_definition_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
