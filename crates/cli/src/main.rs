//! The `tandem` binary: parses arguments, builds components from the library crates, and maps
//! errors to exit codes. No logic of its own beyond wiring.

mod args;
mod soak;
mod up;

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use tandem_compute::cuda::DeviceSpec;
use tandem_core::{RequestId, SamplingParams};
use tandem_engine::{EngineConfig, EngineEvent, EngineRequest};
use tandem_model::{CudaModel, CudaOptions, LoadedModel, ModelRunner, ModelSource, ModelSpec, Preset, PRESETS};

use args::{BenchCommand, Cli, Command, EngineArgs, GenerateArgs, ModelArgs, ModelCommand, ServeArgs};

fn main() -> ExitCode {
    let cli = Cli::parse();
    // While this is the only thread: an engine moving KV over NIXL has UCX log into a file the
    // connector reads back (the transports UCX chose; its warnings, through tracing).
    let ucx_log = match &cli.command {
        Command::Serve(a) if matches!(a.kv.kv_transport, args::KvTransportArg::Nixl) => redirect_ucx_log(),
        _ => None,
    };
    let filter =
        tracing_subscriber::EnvFilter::try_new(&cli.log).unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colours only on a terminal, and never with NO_COLOR set (the no-color.org convention).
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr()) && std::env::var_os("NO_COLOR").is_none();
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi).init();
    let result = match cli.command {
        Command::Serve(a) => serve(a, ucx_log.clone()),
        Command::Router(a) => router(a),
        Command::Up(a) => up::up(*a),
        Command::Generate(a) => generate(a),
        Command::Model(c) => model_command(c),
        Command::Bench(BenchCommand::Engine(a)) => bench_engine(a),
        Command::Bench(BenchCommand::Kv(a)) => bench_kv(a),
        Command::Bench(BenchCommand::Serve(a)) => bench_serve(*a),
        Command::Bench(BenchCommand::Sweep(a)) => bench_sweep(a),
        Command::Bench(BenchCommand::Plot(a)) => bench_plot(a),
        Command::Bench(BenchCommand::KvPeer(a)) => bench_kv_peer(a),
        Command::Bench(BenchCommand::Soak(a)) => soak::bench_soak(a),
    };
    if let Some(path) = ucx_log {
        let _ = std::fs::remove_file(path);
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Points UCX's log at a file of this process's own, at INFO level, unless the user chose
/// either (`UCX_LOG_LEVEL`, `UCX_LOG_FILE`: UCX's own settings); the path for the connector to
/// read it back from (`tandem_kv::ucx_log`). Called while `main` is the only thread, since it
/// sets the environment UCX reads when NIXL creates its backend.
fn redirect_ucx_log() -> Option<std::path::PathBuf> {
    if std::env::var_os("UCX_LOG_LEVEL").is_some() || std::env::var_os("UCX_LOG_FILE").is_some() {
        return None;
    }
    let path = std::env::temp_dir().join(format!("tandem-ucx-{}.log", std::process::id()));
    std::env::set_var("UCX_LOG_LEVEL", "info");
    std::env::set_var("UCX_LOG_FILE", &path);
    Some(path)
}

fn load_model(m: &ModelArgs) -> Result<LoadedModel> {
    let source = model_source(&m.model, m.model_seed)?;
    let t = Instant::now();
    let model = LoadedModel::load(&source, m.max_model_len).with_context(|| format!("loading model `{}`", m.model))?;
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

/// A model ready for an engine on the chosen device, with what the engine and server need.
struct EngineParts {
    model: tandem_engine::EngineModel,
    tokenizer: Option<tandem_model::TextTokenizer>,
    eos_token_ids: Vec<u32>,
    max_model_len: usize,
    generation_defaults: tandem_model::GenerationDefaults,
    config: EngineConfig,
    fingerprint: String,
}

/// `cpu`, `cuda:N`, or `auto` (GPU 0 when CUDA works here, else CPU, saying why).
fn resolve_device(spec: &str) -> Result<DeviceSpec> {
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
fn build_engine(m: &ModelArgs, e: &EngineArgs, host_kv_bytes: Option<usize>) -> Result<EngineParts> {
    match resolve_device(&e.device)? {
        DeviceSpec::Cpu => {
            let model = load_model(m)?;
            let config = engine_config(e, &model)?;
            let fingerprint = model.transformer.fingerprint();
            Ok(EngineParts {
                model: model.transformer.into(),
                tokenizer: model.tokenizer,
                eos_token_ids: model.eos_token_ids,
                max_model_len: model.max_model_len,
                generation_defaults: model.generation_defaults.clone(),
                config,
                fingerprint,
            })
        }
        DeviceSpec::Cuda(ordinal) => {
            let source = model_source(&m.model, m.model_seed)?;
            let spec =
                ModelSpec::load(&source, m.max_model_len).with_context(|| format!("loading model `{}`", m.model))?;
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
                prefix_caching: e.prefix_caching == args::Switch::On,
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
fn engine_config(e: &EngineArgs, model: &LoadedModel) -> Result<EngineConfig> {
    let per_token = model.transformer.config().kv_bytes_per_token_f32();
    let num_blocks = match e.num_kv_blocks {
        Some(n) => n,
        None => {
            let bytes = args::parse_bytes(&e.kv_cache_memory).map_err(anyhow::Error::msg)?;
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
        prefix_caching: e.prefix_caching == args::Switch::On,
    };
    cfg.validate().map_err(anyhow::Error::msg)?;
    tracing::info!(
        block_size = cfg.block_size,
        num_blocks = cfg.num_blocks,
        kv_tokens = cfg.num_blocks * cfg.block_size,
        kv_mib = (cfg.num_blocks * cfg.block_size * per_token) as f64 / (1 << 20) as f64,
        "KV cache sized"
    );
    Ok(cfg)
}

/// The connector setup for `--role prefill|decode`, or `None` for colocated serving.
fn kv_setup(
    k: &args::KvArgs,
    port: u16,
    fingerprint: &str,
    ucx_log: Option<std::path::PathBuf>,
) -> Result<Option<tandem_engine::KvSetup>> {
    use args::{KvLoadFailureArg, KvModeArg, RoleArg};
    let role = match k.role {
        RoleArg::Both => return Ok(None),
        RoleArg::Prefill => tandem_kv::Role::Prefill,
        RoleArg::Decode => tandem_kv::Role::Decode,
    };
    let kv_port = k.kv_port.unwrap_or(if role == tandem_kv::Role::Prefill { 5600 } else { 5601 });
    let secs = |s: f64, name: &str| {
        if s.is_finite() && s > 0.0 {
            Ok(std::time::Duration::from_secs_f64(s))
        } else {
            Err(anyhow::anyhow!("{name} must be a positive number of seconds"))
        }
    };
    if !(k.kv_nixl_min_gb_s >= 0.0 && k.kv_nixl_min_gb_s.is_finite()) {
        bail!("--kv-nixl-min-gb-s must be a number of GB/s, 0 or more");
    }
    Ok(Some(tandem_engine::KvSetup {
        connector: tandem_kv::ConnectorConfig {
            engine_id: tandem_core::EngineId(
                k.engine_id.clone().unwrap_or_else(|| format!("{}-{port}", format!("{role:?}").to_lowercase())),
            ),
            role,
            mode: match k.kv_mode {
                KvModeArg::Push => tandem_kv::KvMode::Push,
                KvModeArg::Pull => tandem_kv::KvMode::Pull,
            },
            listen: tandem_kv::channel::host_port(&k.kv_host, kv_port),
            advertise_host: match &k.kv_advertise_host {
                Some(host) => host.clone(),
                None => tandem_kv::channel::advertised_host(&k.kv_host).map_err(|e| {
                    anyhow::anyhow!("--kv-host {e}: name the address peers reach with --kv-advertise-host")
                })?,
            },
            model_fingerprint: fingerprint.to_string(),
            timeouts: tandem_kv::channel::Timeouts::default(),
            lease: secs(k.kv_lease_secs, "--kv-lease-secs")?,
            transfer_timeout: secs(k.kv_transfer_timeout_secs, "--kv-transfer-timeout-secs")?,
            liveness: secs(k.kv_liveness_secs, "--kv-liveness-secs")?,
            faults: tandem_kv::FaultInjection {
                drop_done: k.fault_drop_done,
                slow_write: std::time::Duration::from_millis(k.fault_slow_write_ms),
                corrupt_sends: k.fault_corrupt_sends,
                ..Default::default()
            },
            // Separate processes: the local transport only applies within one process.
            local_transport: false,
            transport: k.kv_transport.to_kv(),
            verify: k.kv_verify,
            nixl_min_gb_s: k.kv_nixl_min_gb_s,
            nixl_pull: k.kv_nixl_pull.to_kv(),
            ucx_log,
        },
        load_failure: match k.kv_load_failure {
            KvLoadFailureArg::Recompute => tandem_engine::KvLoadFailure::Recompute,
            KvLoadFailureArg::Fail => tandem_engine::KvLoadFailure::Fail,
        },
    }))
}

fn serve(a: ServeArgs, ucx_log: Option<std::path::PathBuf>) -> Result<()> {
    let port = a.port.unwrap_or(match a.kv.role {
        args::RoleArg::Both => 8000,
        args::RoleArg::Prefill => 8100,
        args::RoleArg::Decode => 8200,
    });
    // Prefill and decode on a GPU: tcp transfers go through a host copy of the KV cache;
    // cuda-ipc and nixl move the device caches directly.
    let direct = matches!(a.kv.kv_transport, args::KvTransportArg::CudaIpc | args::KvTransportArg::Nixl);
    let host_kv_bytes = if a.kv.role == args::RoleArg::Both || direct {
        None
    } else {
        if !(a.kv.kv_host_gib.is_finite() && a.kv.kv_host_gib > 0.0) {
            bail!("--kv-host-gib must be a positive number of GiB");
        }
        Some((a.kv.kv_host_gib * (1u64 << 30) as f64) as usize)
    };
    let parts = build_engine(&a.model, &a.engine, host_kv_bytes)?;
    let kv = kv_setup(&a.kv, port, &parts.fingerprint, ucx_log)?;
    let mut tokenizer = parts.tokenizer;
    if let Some(t) = &a.chat_template {
        let tok = tokenizer
            .as_mut()
            .ok_or_else(|| anyhow::anyhow!("--chat-template needs a model with a tokenizer (tokenizer.json)"))?;
        let path = std::path::Path::new(t);
        let source = if path.is_file() {
            std::fs::read_to_string(path).with_context(|| format!("reading --chat-template {t}"))?
        } else if t.contains("{{") || t.contains("{%") {
            t.clone()
        } else {
            bail!("--chat-template {t}: no such file, and not a template (no {{{{ or {{% in it)");
        };
        tok.set_chat_template(source).context("--chat-template")?;
    }
    let tokenizer = tokenizer.map(Arc::new);
    let engine = tandem_engine::spawn_with(parts.model, parts.eos_token_ids, parts.max_model_len, parts.config, kv)
        .context("starting the engine (and its KV side channel)")?;
    if let Some(info) = engine.kv_info() {
        tracing::info!(role = ?info.role, mode = ?info.kv_mode, engine_id = %info.engine_id, epoch = info.epoch.0, transports = ?info.transports, "KV side channel up");
    }
    let name = a.served_model_name.unwrap_or_else(|| a.model.model.clone());
    let max_in_flight = match a.max_queued_requests {
        0 => 0,
        n => n + a.engine.max_num_seqs,
    };
    let defaults = match a.generation_config {
        args::GenerationConfigArg::Auto => parts.generation_defaults,
        args::GenerationConfigArg::Vllm => Default::default(),
    };
    if !defaults.is_empty() {
        tracing::info!(
            temperature = ?defaults.temperature,
            top_p = ?defaults.top_p,
            top_k = ?defaults.top_k,
            max_tokens = ?defaults.max_tokens,
            "requests that leave these out get the model's generation_config.json values (--generation-config vllm: the API's defaults)"
        );
    }
    if !defaults.unsupported.is_empty() {
        tracing::warn!(fields = %defaults.unsupported.join(", "), "generation_config.json sets sampling fields tandem does not apply");
    }
    let state = Arc::new(
        tandem_server::AppState::new(engine, tokenizer, name.clone())
            .with_max_in_flight(max_in_flight)
            .with_sampling_defaults(defaults),
    );
    let drain = seconds(a.shutdown_timeout_secs, "--shutdown-timeout-secs")?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the async runtime")?;
    let result = rt.block_on(async move {
        let addr = format!("{}:{port}", a.host);
        let listener = tokio::net::TcpListener::bind(&addr).await.with_context(|| format!("binding {addr}"))?;
        tracing::info!(%addr, model = %name, "serving the OpenAI API (Ctrl-C to stop)");
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(tandem_server::serve(listener, state.clone(), async {
            let _ = stop_rx.await;
        }));
        let (s1, s2) = (state.clone(), state.clone());
        serve_until_signalled(server, stop_tx, drain, move || s1.in_flight(), move || s2.abort_all()).await
    });
    // Threads still blocked in the runtime (none expected) must not hold the exit.
    rt.shutdown_timeout(std::time::Duration::from_millis(100));
    result
}

/// The CUDA tuning of `--cuda-tune` settings (each checked when parsed).
/// Where GPU engines keep their compiled kernels between starts: `$TANDEM_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/tandem`, else `~/.cache/tandem` (none: compiled at every start).
fn kernel_cache_dir() -> Option<std::path::PathBuf> {
    use std::path::PathBuf;
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    var("TANDEM_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| var("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("tandem")))
        .or_else(|| var("HOME").map(|d| PathBuf::from(d).join(".cache/tandem")))
}

fn tuning(settings: &[String]) -> Result<tandem_compute::cuda::CudaTuning> {
    tandem_compute::cuda::CudaTuning::from_settings(settings).map_err(anyhow::Error::msg)
}

/// A finite number of seconds, 0 or more.
fn seconds(s: f64, name: &str) -> Result<std::time::Duration> {
    if s.is_finite() && s >= 0.0 {
        Ok(std::time::Duration::from_secs_f64(s))
    } else {
        bail!("{name} must be a number of seconds >= 0")
    }
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM (a process manager's stop).
async fn stop_signal() {
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// Runs `server` until a stop signal, then shuts down within a bound: no new connections;
/// requests in flight get up to `drain` to finish; then (or at a second signal) the rest are
/// ended with an error (`abort_all`) and the server gets one more second to send those.
async fn serve_until_signalled(
    mut server: tokio::task::JoinHandle<std::io::Result<()>>,
    stop: tokio::sync::oneshot::Sender<()>,
    drain: std::time::Duration,
    in_flight: impl Fn() -> usize,
    abort_all: impl FnOnce(),
) -> Result<()> {
    tokio::select! {
        r = &mut server => return r.context("the server task failed")?.context("serving"),
        _ = stop_signal() => {}
    }
    let _ = stop.send(());
    let n = in_flight();
    if n == 0 {
        tracing::info!("shutting down");
    } else {
        tracing::info!(
            "shutting down: waiting up to {:.1} s for {n} request(s) in flight (Ctrl-C again to end them now)",
            drain.as_secs_f64()
        );
    }
    let ended = tokio::select! {
        r = &mut server => Some(r),
        _ = tokio::time::sleep(drain) => None,
        _ = stop_signal() => None,
    };
    let r = match ended {
        Some(r) => r,
        None => {
            tracing::warn!("ending {} request(s) still in flight", in_flight());
            abort_all();
            match tokio::time::timeout(std::time::Duration::from_secs(1), &mut server).await {
                Ok(r) => r,
                Err(_) => {
                    tracing::warn!("connections still open after ending every request; exiting anyway");
                    server.abort();
                    return Ok(());
                }
            }
        }
    };
    r.context("the server task failed")?.context("serving")?;
    tracing::info!("stopped");
    Ok(())
}

fn router(a: args::RouterArgs) -> Result<()> {
    let mode = match a.mode {
        args::KvModeArg::Push => tandem_core::TransferMode::Push,
        args::KvModeArg::Pull => tandem_core::TransferMode::Pull,
    };
    let check_interval =
        seconds(a.check_interval_secs, "--check-interval-secs")?.max(std::time::Duration::from_millis(50));
    let router = tandem_router::Router::new(tandem_router::RouterConfig {
        prefill_timeout: std::time::Duration::from_secs(a.prefill_timeout_secs),
        check_interval,
        local_prefill_max_tokens: a.local_prefill_max_tokens,
        kv_aware_routing: a.kv_aware_routing == args::Switch::On,
        ..tandem_router::RouterConfig::new(mode, a.prefill.clone(), a.decode.clone())
    })?;
    let drain = seconds(a.shutdown_timeout_secs, "--shutdown-timeout-secs")?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the async runtime")?;
    let result = rt.block_on(async move {
        tracing::info!(prefill = ?a.prefill, decode = ?a.decode, ?mode, "waiting for engines to become healthy");
        tokio::select! {
            r = router.wait_ready(std::time::Duration::from_secs(a.ready_timeout_secs)) => r?,
            _ = stop_signal() => return Ok(()),
        }
        let addr = format!("{}:{}", a.host, a.port);
        let listener = tokio::net::TcpListener::bind(&addr).await.with_context(|| format!("binding {addr}"))?;
        tracing::info!(%addr, ?mode, "router ready (Ctrl-C to stop)");
        let router = Arc::new(router);
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(tandem_router::serve(listener, router.clone(), async {
            let _ = stop_rx.await;
        }));
        let (r1, r2) = (router.clone(), router.clone());
        serve_until_signalled(server, stop_tx, drain, move || r1.in_flight(), move || r2.abort_all()).await
    });
    rt.shutdown_timeout(std::time::Duration::from_millis(100));
    result
}

fn generate(a: GenerateArgs) -> Result<()> {
    let parts = build_engine(&a.model, &a.engine, None)?;
    let prompt_ids = match (&a.prompt, &a.prompt_ids) {
        (Some(text), _) => match &parts.tokenizer {
            Some(tok) => tok.encode(text, true)?,
            None => bail!("this model has no tokenizer (token-ids mode): use --prompt-ids"),
        },
        (None, Some(ids)) => ids.clone(),
        (None, None) => bail!("give --prompt or --prompt-ids"),
    };
    let params = SamplingParams {
        temperature: a.temperature,
        top_p: a.top_p,
        top_k: (a.top_k > 0).then_some(a.top_k),
        seed: a.seed,
        max_tokens: a.max_tokens,
        ignore_eos: a.ignore_eos,
        ..SamplingParams::default()
    };
    let tokenizer = parts.tokenizer;
    let engine = tandem_engine::spawn(parts.model, parts.eos_token_ids, parts.max_model_len, parts.config)
        .context("starting the engine thread")?;
    let prompt_len = prompt_ids.len();
    let start = Instant::now();
    let mut stream = engine.submit(EngineRequest::new(RequestId::new("generate"), prompt_ids, params))?;
    let mut token_ids = Vec::new();
    let mut first_token_s = None;
    let mut finish = None;
    let mut detok = tandem_model::IncrementalDetokenizer::new();
    let mut text = String::new();
    let stdout = std::io::stdout();
    while let Some(ev) = stream.blocking_next() {
        match ev {
            EngineEvent::Tokens { token_ids: new, finish: f, .. } => {
                first_token_s.get_or_insert(start.elapsed().as_secs_f64());
                if let Some(tok) = &tokenizer {
                    let mut piece = detok.push(tok, &new)?;
                    if f.is_some() {
                        piece.push_str(&detok.finish(tok)?);
                    }
                    if !a.json {
                        let mut out = stdout.lock();
                        let _ = write!(out, "{piece}");
                        let _ = out.flush();
                    }
                    text.push_str(&piece);
                }
                token_ids.extend(new);
                if f.is_some() {
                    finish = f;
                    break;
                }
            }
            EngineEvent::Failed(e) => bail!("generation failed: {e}"),
            EngineEvent::QueueTimeout { .. } => bail!("generation failed: it waited in the queue past its bound"),
            // generate runs colocated: no KV is handed to a connector.
            EngineEvent::KvProduced { .. } | EngineEvent::KvLoaded { .. } => {}
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    if a.json {
        let out = serde_json::json!({
            "prompt_tokens": prompt_len,
            "token_ids": token_ids,
            "text": text,
            "finish_reason": finish.map(|f| f.as_str()),
            "time_to_first_token_s": first_token_s,
            "elapsed_s": elapsed,
        });
        println!("{out}");
    } else if tokenizer.is_some() {
        println!();
    } else {
        println!("{}", token_ids.iter().map(u32::to_string).collect::<Vec<_>>().join(","));
    }
    Ok(())
}

fn model_command(c: ModelCommand) -> Result<()> {
    match c {
        ModelCommand::Init { preset, out, seed } => {
            let p = Preset::find(&preset)?;
            let t = Instant::now();
            eprintln!("writing preset `{}` (seed {seed}) to {} ...", p.name, out.display());
            p.write_dir(&out, seed)?;
            eprintln!("done in {:.1}s", t.elapsed().as_secs_f64());
            Ok(())
        }
        ModelCommand::Inspect { model } => {
            // The config and tokenizer only: a shape needs no weights (a preset's would be
            // generated, gigabytes of them for the larger ones).
            let source = model_source(&model.model, model.model_seed)?;
            let m = ModelSpec::load_shape(&source, model.max_model_len)
                .with_context(|| format!("reading model `{}`", model.model))?;
            let has_tokenizer = m.tokenizer.is_some() || matches!(source, ModelSource::Preset { .. });
            let c = &m.config;
            let info = serde_json::json!({
                "architecture": c.architecture.hf_name(),
                "params": c.num_params(),
                "vocab_size": c.vocab_size,
                "hidden_size": c.hidden_size,
                "intermediate_size": c.intermediate_size,
                "num_layers": c.num_layers,
                "num_heads": c.num_heads,
                "num_kv_heads": c.num_kv_heads,
                "head_dim": c.head_dim,
                "tie_word_embeddings": c.tie_word_embeddings,
                "max_model_len": m.max_model_len,
                "kv_bytes_per_token_f32": c.kv_bytes_per_token_f32(),
                "weight_bytes_f32": c.num_params() * 4,
                "eos_token_ids": m.eos_token_ids,
                "tokenizer": has_tokenizer,
            });
            println!("{}", serde_json::to_string_pretty(&info)?);
            Ok(())
        }
        ModelCommand::List => {
            for p in PRESETS {
                let params = tandem_model::ModelConfig::from_preset(p)?.num_params();
                println!(
                    "{:<14} {:>9.1}M  {:<18} {}",
                    p.name,
                    params as f64 / 1e6,
                    p.architecture.hf_name(),
                    p.description
                );
            }
            Ok(())
        }
    }
}

fn bench_engine(a: args::BenchEngineArgs) -> Result<()> {
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
    let engine_cfg = tandem_bench::engine::engine_config(&cfg);
    let margs = ModelArgs { model: a.model.clone(), model_seed: a.model_seed, max_model_len: None };
    let bench_model = match device {
        DeviceSpec::Cpu => {
            let model = load_model(&margs)?;
            let c = model.transformer.config();
            let (params, matmul_params, pair) = (c.num_params(), matmul_params(c), attn_flops_per_pair(c));
            let weight_bytes = model.transformer.weight_bytes();
            eprintln!("... measuring read bandwidth");
            tandem_bench::engine::BenchModel {
                model: model.transformer.into(),
                max_model_len: model.max_model_len,
                weight_bytes,
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
            let spec = ModelSpec::load(&source, None)?;
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
                let ctx = a.decode_prompt_tokens.max(64);
                for (label, seqs, tokens, ctx) in [
                    (format!("decode, batch 1, context {ctx}"), 1, 1, ctx),
                    (format!("decode, batch {max_batch}, context {ctx}"), max_batch, 1, ctx),
                    (format!("prefill of {} tokens", cfg.prefill_tokens), 1, cfg.prefill_tokens, 0),
                ] {
                    println!("device time per forward by op: {label}");
                    for (op, ms) in model.profile_ops(seqs, tokens, ctx, a.sweep_gemv_plans)? {
                        println!("  {op:<40} {ms:>10.3} ms");
                    }
                }
            }
            let c = &spec.config;
            tandem_bench::engine::BenchModel {
                max_model_len: spec.max_model_len,
                weight_bytes: model.weight_bytes(),
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
fn matmul_params(c: &tandem_model::ModelConfig) -> usize {
    let embedding_matrices = if c.tie_word_embeddings { 1 } else { 2 };
    c.num_params() - embedding_matrices * c.vocab_size * c.hidden_size
}

/// Attention FLOPs per (query, key) pair: QK and PV, 2 each, per head and layer.
fn attn_flops_per_pair(c: &tandem_model::ModelConfig) -> f64 {
    4.0 * (c.num_layers * c.num_heads * c.head_dim) as f64
}

fn kv_bench_config(a: &args::BenchKvArgs) -> Result<tandem_bench::kv::KvBenchConfig> {
    let bytes = args::parse_bytes(&a.size).map_err(anyhow::Error::msg)?;
    if bytes == 0 {
        bail!("--size must be more than 0 bytes");
    }
    let cfg = tandem_bench::kv::KvBenchConfig {
        bytes,
        repeats: a.repeats.max(1),
        verify: a.verify,
        kernel_cache: kernel_cache_dir(),
        ..Default::default()
    };
    match a.device.as_deref().map(str::parse::<tandem_compute::cuda::DeviceSpec>) {
        None | Some(Ok(tandem_compute::cuda::DeviceSpec::Cpu)) => Ok(cfg),
        Some(Ok(tandem_compute::cuda::DeviceSpec::Cuda(n))) => Ok(cfg.on_gpu(n)),
        Some(Err(e)) => bail!("--device: {e}"),
    }
}

/// Starts the peer as a second process (this same binary), reads its port, measures, and
/// waits for the peer to exit.
fn bench_kv(a: args::BenchKvArgs) -> Result<()> {
    use std::io::BufRead;
    if a.transport == args::BenchKvTransport::CudaIpc {
        return bench_kv_cuda_ipc(a);
    }
    if a.transport == args::BenchKvTransport::Nixl {
        return bench_kv_nixl(a);
    }
    let cfg = kv_bench_config(&a)?;
    let exe = std::env::current_exe().context("locating the tandem binary")?;
    let mut child = std::process::Command::new(exe)
        .args(["--log", "warn", "bench", "kv-peer", "--size", &a.size, "--repeats", &a.repeats.to_string()])
        .args(a.device.as_ref().map(|d| ["--device", d.as_str()]).into_iter().flatten())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("starting the peer process")?;
    let stdout = child.stdout.take().context("peer stdout")?;
    let mut line = String::new();
    std::io::BufReader::new(stdout).read_line(&mut line).context("reading the peer's address")?;
    let addr = line.trim().to_string();
    eprintln!("... peer process {} listening on {addr}; moving {} x {} each way", child.id(), a.repeats, a.size);
    let report = tandem_bench::kv::measure(&addr, &cfg).map_err(anyhow::Error::from);
    finish_bench_kv(child, report, a.json_out)
}

/// Waits for the peer process, then prints the report (and writes it as JSON to `json_out`).
fn finish_bench_kv<R: std::fmt::Display + serde::Serialize>(
    mut peer: std::process::Child,
    report: Result<R>,
    json_out: Option<std::path::PathBuf>,
) -> Result<()> {
    let status = peer.wait().context("waiting for the peer")?;
    let report = report?;
    if !status.success() {
        bail!("the peer process failed ({status})");
    }
    print!("{report}");
    if let Some(path) = json_out {
        std::fs::write(&path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn ipc_bench_config(a: &args::BenchKvArgs) -> Result<tandem_bench::kv::cuda_ipc::IpcBenchConfig> {
    let sizes = a.sizes.iter().map(|s| args::parse_bytes(s).map_err(anyhow::Error::msg)).collect::<Result<Vec<_>>>()?;
    if sizes.is_empty() || sizes.contains(&0) {
        bail!("--sizes must list sizes of more than 0 bytes");
    }
    if a.peer_block_size == 0 {
        bail!("--peer-block-size must be at least 1");
    }
    Ok(tandem_bench::kv::cuda_ipc::IpcBenchConfig {
        sizes,
        repeats: a.repeats.max(1),
        peer_block_size: a.peer_block_size,
        ..Default::default()
    })
}

fn open_gpu(spec: &str) -> Result<tandem_compute::cuda::CudaDevice> {
    match spec.parse::<tandem_compute::cuda::DeviceSpec>().map_err(anyhow::Error::msg)? {
        tandem_compute::cuda::DeviceSpec::Cuda(n) => {
            tandem_compute::cuda::CudaDevice::open_with(n, Default::default(), kernel_cache_dir().as_deref())
                .with_context(|| format!("opening {spec}"))
        }
        tandem_compute::cuda::DeviceSpec::Cpu => bail!("{spec} is not a GPU (cuda:N)"),
    }
}

/// cuda-ipc: the peer process allocates and exports its cache, prints the export, and lives
/// until we close its stdin; we map it, copy into it, and compare with copies inside our GPU.
fn bench_kv_cuda_ipc(a: args::BenchKvArgs) -> Result<()> {
    use std::io::BufRead;
    let cfg = ipc_bench_config(&a)?;
    let device = a.device.clone().unwrap_or_else(|| "cuda:0".into());
    let peer_device = a.peer_device.clone().unwrap_or_else(|| device.clone());
    for spec in [&device, &peer_device] {
        if !matches!(spec.parse(), Ok(tandem_compute::cuda::DeviceSpec::Cuda(_))) {
            bail!("cuda-ipc moves GPU memory: give a GPU (cuda:N), not {spec}");
        }
    }
    let exe = std::env::current_exe().context("locating the tandem binary")?;
    let mut child = std::process::Command::new(exe)
        .args(["--log", "warn", "bench", "kv-peer", "--transport", "cuda-ipc", "--device", &peer_device])
        .args(["--sizes", &a.sizes.join(","), "--peer-block-size", &a.peer_block_size.to_string()])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("starting the peer process")?;
    let stdout = child.stdout.take().context("peer stdout")?;
    let mut line = String::new();
    std::io::BufReader::new(stdout).read_line(&mut line).context("reading the peer's export")?;
    let report =
        tandem_bench::kv::cuda_ipc::parse_export_line(line.trim()).map_err(anyhow::Error::msg).and_then(|export| {
            eprintln!("... peer process {} on {peer_device} exported its cache; copying from {device}", child.id());
            let dev = open_gpu(&device)?;
            tandem_bench::kv::cuda_ipc::measure(&dev, &cfg, &export, None).map_err(anyhow::Error::msg)
        });
    drop(child.stdin.take());
    finish_bench_kv(child, report, a.json_out)
}

fn bench_kv_peer(a: args::BenchKvArgs) -> Result<()> {
    if a.transport == args::BenchKvTransport::CudaIpc {
        use std::io::Read;
        let cfg = ipc_bench_config(&a)?;
        let dev = open_gpu(a.device.as_deref().unwrap_or("cuda:0"))?;
        let (_memory, export) = tandem_bench::kv::cuda_ipc::peer_cache(&dev, &cfg).map_err(anyhow::Error::msg)?;
        println!("{}", tandem_bench::kv::cuda_ipc::export_line(&export));
        std::io::stdout().flush()?;
        // Alive (and the cache mapped) until the driving process closes our stdin.
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        return Ok(());
    }
    if a.transport == args::BenchKvTransport::Nixl {
        return bench_kv_nixl_peer(a);
    }
    let cfg = kv_bench_config(&a)?;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("binding the peer listener")?;
    println!("{}", listener.local_addr()?);
    std::io::stdout().flush()?;
    tandem_bench::kv::serve_peer(listener, &cfg)?;
    Ok(())
}

/// `bench kv --transport nixl`: the peer is a second process (this binary) whose host KV
/// memory NIXL writes into.
#[cfg(feature = "nixl")]
fn bench_kv_nixl(a: args::BenchKvArgs) -> Result<()> {
    use std::io::BufRead;
    if a.device.as_deref().is_some_and(|d| d != "cpu") {
        return bench_kv_nixl_gpu(a);
    }
    let cfg = kv_bench_config(&a)?;
    let exe = std::env::current_exe().context("locating the tandem binary")?;
    let mut child = std::process::Command::new(exe)
        .args(["--log", "warn", "bench", "kv-peer", "--transport", "nixl", "--size", &a.size])
        .args(["--repeats", &a.repeats.to_string()])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("starting the peer process")?;
    let mut lines = std::io::BufReader::new(child.stdout.take().context("peer stdout")?).lines();
    let first = lines.next().context("the peer exited before naming its NIXL endpoint")??;
    eprintln!("... peer process {} ready; {} NIXL writes of {}", child.id(), a.repeats, a.size);
    let mut rest = || match lines.next() {
        Some(Ok(line)) => Ok(line),
        _ => Err("the peer exited before reporting what landed".to_string()),
    };
    let report = tandem_bench::kv_nixl::measure(&cfg, &first, &mut rest).map_err(anyhow::Error::msg);
    finish_bench_kv(child, report, a.json_out)
}

/// `bench kv --transport nixl --device cuda:N`: NIXL WRITEs between two processes' GPU caches
/// (VRAM), beside cuda-ipc into the same peer cache, in one run.
#[cfg(feature = "nixl")]
fn bench_kv_nixl_gpu(a: args::BenchKvArgs) -> Result<()> {
    use std::io::BufRead;
    use tandem_bench::kv_nixl::gpu::NixlGpuWriter;
    let cfg = tandem_bench::kv::cuda_ipc::IpcBenchConfig { peer_sets: 2, ..ipc_bench_config(&a)? };
    let device = a.device.clone().unwrap_or_else(|| "cuda:0".into());
    let peer_device = a.peer_device.clone().unwrap_or_else(|| device.clone());
    let exe = std::env::current_exe().context("locating the tandem binary")?;
    let mut child = std::process::Command::new(exe)
        .args(["--log", "warn", "bench", "kv-peer", "--transport", "nixl", "--device", &peer_device])
        .args(["--sizes", &a.sizes.join(","), "--peer-block-size", &a.peer_block_size.to_string()])
        .args(["--repeats", &a.repeats.to_string()])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("starting the peer process")?;
    let mut lines = std::io::BufReader::new(child.stdout.take().context("peer stdout")?).lines();
    let mut next = |what: &str| match lines.next() {
        Some(Ok(line)) => Ok(line),
        _ => Err(anyhow::anyhow!("the peer exited before {what}")),
    };
    let report = (|| {
        let export = tandem_bench::kv::cuda_ipc::parse_export_line(next("exporting its cache")?.trim())
            .map_err(anyhow::Error::msg)?;
        let mut nixl = NixlGpuWriter::new(&cfg, &next("naming its NIXL endpoint")?).map_err(anyhow::Error::msg)?;
        eprintln!("... peer process {} on {peer_device} ready (cuda-ipc and NIXL); writing from {device}", child.id());
        let dev = open_gpu(&device)?;
        let report =
            tandem_bench::kv::cuda_ipc::measure(&dev, &cfg, &export, Some(&mut nixl)).map_err(anyhow::Error::msg)?;
        nixl.check_landed(&next("reporting what NIXL landed")?).map_err(anyhow::Error::msg)?;
        Ok(report)
    })();
    drop(child.stdin.take());
    finish_bench_kv(child, report, a.json_out)
}

#[cfg(feature = "nixl")]
fn bench_kv_nixl_peer(a: args::BenchKvArgs) -> Result<()> {
    if let Some(device) = a.device.as_ref().filter(|d| *d != "cpu") {
        use std::io::Read;
        let cfg = tandem_bench::kv::cuda_ipc::IpcBenchConfig { peer_sets: 2, ..ipc_bench_config(&a)? };
        let dev = open_gpu(device)?;
        tandem_bench::kv_nixl::gpu::serve_peer(&dev, &cfg, &mut std::io::stdout()).map_err(anyhow::Error::msg)?;
        // Alive (its cache mapped by the driver) until the driver closes our stdin.
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        return Ok(());
    }
    let cfg = kv_bench_config(&a)?;
    tandem_bench::kv_nixl::serve_peer(&cfg, &mut std::io::stdout()).map_err(anyhow::Error::msg)
}

#[cfg(not(feature = "nixl"))]
fn bench_kv_nixl(_: args::BenchKvArgs) -> Result<()> {
    bail!("this build has no NIXL (build tandem with `--features nixl`)")
}

#[cfg(not(feature = "nixl"))]
fn bench_kv_nixl_peer(a: args::BenchKvArgs) -> Result<()> {
    bench_kv_nixl(a)
}

fn bench_serve(a: args::BenchServeArgs) -> Result<()> {
    use tandem_bench::serve::{Dataset, ServeConfig};
    let dataset = match a.dataset_name {
        args::DatasetName::Random => Dataset::Random {
            input_len: a.random_input_len,
            output_len: a.random_output_len,
            range_ratio: a.random_range_ratio,
            vocab_size: a.random_vocab_size,
            as_text: a.random_prompt_text,
        },
        args::DatasetName::Sharegpt => Dataset::ShareGpt {
            path: a.dataset_path.clone().context("--dataset-name sharegpt needs --dataset-path")?,
            output_len: None,
        },
        args::DatasetName::SharegptMultiTurn => Dataset::ShareGptMultiTurn {
            path: a.dataset_path.clone().context("--dataset-name sharegpt-multi-turn needs --dataset-path")?,
            turns: a.multi_turn_turns,
            output_len: None,
        },
        args::DatasetName::MultiTurn => Dataset::MultiTurn {
            shared_len: a.multi_turn_shared_len,
            distinct_openings: a.multi_turn_distinct_openings,
            turn_len: a.multi_turn_user_len,
            turns: a.multi_turn_turns,
            output_len: a.random_output_len,
            vocab_size: a.random_vocab_size,
        },
    };
    let slo = if a.goodput.is_empty() {
        None
    } else {
        Some(tandem_bench::metrics::Slo::parse(&a.goodput).map_err(anyhow::Error::msg)?)
    };
    let cfg = ServeConfig {
        base_url: a.base_url.clone(),
        endpoint: a.endpoint.clone(),
        model: a.model.clone(),
        backend: a.backend.clone(),
        dataset,
        num_prompts: a.num_prompts,
        request_rate: a.request_rate,
        burstiness: a.burstiness,
        seed: a.seed,
        max_concurrency: a.max_concurrency,
        num_warmups: a.num_warmups,
        ignore_eos: !a.no_ignore_eos,
        percentiles: a.percentiles.clone(),
        slo,
        progress: !a.no_progress,
    };
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the async runtime")?;
    eprintln!(
        "bench serve: {} prompts to {}{} at {} req/s",
        cfg.num_prompts, cfg.base_url, cfg.endpoint, cfg.request_rate
    );
    let run = rt.block_on(tandem_bench::serve::run(&cfg)).map_err(anyhow::Error::msg)?;
    print!("{}", run.summary.table(&cfg.percentiles));
    if !run.turns.is_empty() {
        let by_turn: Vec<String> = run.median_ttft_ms_by_turn().iter().map(|t| format!("{t:.1}")).collect();
        println!("Median TTFT by turn (ms):                {}", by_turn.join(" / "));
    }
    let failed: Vec<&String> = run.outcomes.iter().filter(|o| !o.success).map(|o| &o.error).collect();
    if let Some(first) = failed.first() {
        eprintln!("{} requests failed; first error: {first}", failed.len());
    }
    if a.save_result || a.save_detailed {
        let json = run.result_json(&cfg, a.save_detailed);
        let name = a.result_filename.clone().unwrap_or_else(|| {
            let rate = if cfg.request_rate.is_infinite() { "inf".to_string() } else { cfg.request_rate.to_string() };
            let model = run.model.rsplit('/').next().unwrap_or(&run.model).replace(':', "-");
            format!("{}-{rate}qps-{model}-{}.json", cfg.backend, tandem_bench::serve::utc_stamp())
        });
        std::fs::create_dir_all(&a.result_dir).with_context(|| format!("creating {}", a.result_dir.display()))?;
        let path = a.result_dir.join(name);
        std::fs::write(&path, serde_json::to_string_pretty(&json)?)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("result written to {}", path.display());
    }
    Ok(())
}

fn bench_sweep(a: args::SweepArgs) -> Result<()> {
    for m in &a.modes {
        if !["push", "pull", "colocated"].contains(&m.as_str()) {
            bail!("unknown mode `{m}` (push, pull, colocated)");
        }
    }
    let cfg = tandem_bench::sweep::SweepConfig {
        qps: a.qps.clone(),
        input_lens: a.input_lens.clone(),
        output_len: a.output_len,
        iterations: a.iterations.max(1),
        num_prompts: a.num_prompts,
        vocab_size: a.vocab_size,
        percentiles: vec![50.0, 90.0, 99.0],
        result_dir: a.result_dir.clone(),
        seed: a.seed,
    };
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the async runtime")?;
    let total = a.modes.len() * a.qps.len() * a.input_lens.len() * cfg.iterations;
    eprintln!("bench sweep: {total} points ({} modes x {} rates x {} input lengths x {} iterations), {} prompts each, results in {}",
        a.modes.len(), a.qps.len(), a.input_lens.len(), cfg.iterations, cfg.num_prompts, a.result_dir.display());
    for mode in &a.modes {
        let (url, mut procs) = if a.launch {
            eprintln!("... starting {mode} servers ({})", a.model);
            let launch = up::Launch {
                model: &a.model,
                base_port: a.base_port,
                log: "warn",
                prefill_device: &a.prefill_device,
                decode_device: &a.decode_device,
                colocated_device: &a.colocated_device,
                num_kv_blocks: a.num_kv_blocks,
                engine_args: &a.engine_args,
            };
            let (u, p) = up::launch_mode(mode, &launch)?;
            (u, p)
        } else {
            let url = a.urls.iter().find(|(m, _)| m == mode).map(|(_, u)| u.clone());
            (url.with_context(|| format!("no --url {mode}=URL given (or use --launch)"))?, Vec::new())
        };
        let result = rt.block_on(tandem_bench::sweep::run_mode(&cfg, mode, &url, |line| eprintln!("{line}")));
        up::stop_all(&mut procs, std::time::Duration::from_secs(10));
        result.map_err(anyhow::Error::msg)?;
    }
    println!("{}", std::fs::read_to_string(a.result_dir.join("summary.csv")).unwrap_or_default());
    if a.plot {
        bench_plot(args::PlotArgs {
            results_dir: a.result_dir.clone(),
            metric: vec!["ttft".into(), "tpot".into()],
            out_dir: None,
            turns_only: false,
        })?;
    }
    Ok(())
}

fn bench_plot(a: args::PlotArgs) -> Result<()> {
    let out = a.out_dir.clone().unwrap_or_else(|| a.results_dir.clone());
    // Multi-turn results (bench serve --dataset-name multi-turn) draw their own figure.
    if let Some((png, svg)) = tandem_bench::plot::ttft_by_turn(&a.results_dir, &out).map_err(anyhow::Error::msg)? {
        println!("{}\n{}", png.display(), svg.display());
        if a.turns_only {
            return Ok(());
        }
    }
    for m in &a.metric {
        let metric = tandem_bench::plot::Metric::parse(m).map_err(anyhow::Error::msg)?;
        let (png, svg) = tandem_bench::plot::four_panel(&a.results_dir, metric, &out).map_err(anyhow::Error::msg)?;
        println!("{}\n{}", png.display(), svg.display());
    }
    match tandem_bench::plot::ttft_breakdown(&a.results_dir, &out).map_err(anyhow::Error::msg)? {
        Some((png, svg)) => println!("{}\n{}", png.display(), svg.display()),
        None => eprintln!("no transfer timelines in the results (colocated only): no TTFT breakdown figure"),
    }
    Ok(())
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
