//! `tandem serve`: one engine behind the OpenAI API, colocated or as the prefill or decode
//! half of a disaggregated pair (its KV side channel set up from the disaggregation flags).

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::engine::{build_engine, seconds, EngineArgs, ModelArgs};

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
    pub auth: crate::auth::ApiKeyArgs,
    #[command(flatten)]
    pub cluster: crate::auth::ClusterSecretArgs,
    #[command(flatten)]
    pub tls: crate::auth::TlsArgs,
    #[command(flatten)]
    pub discovery: crate::discovery::DiscoveryArgs,
    /// The URL routers reach this engine's HTTP API at, registered with --discovery. Default:
    /// http(s)://HOST:PORT with HOST the address peers reach (--kv-advertise-host, or --host,
    /// or this host's address on its default route when --host is 0.0.0.0 or ::).
    #[arg(long, value_name = "URL")]
    pub advertise_url: Option<String>,
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
    /// TCP connections per peer over which KV sent over tcp is striped (a pair uses the smaller
    /// of its two engines' counts). One TCP stream carries about 3 GB/s, less than a GPU
    /// prefill produces KV (Qwen3-4B on an H200: 9 GB/s at 1k tokens); eight carried 16 GB/s
    /// on the H200 machine's loopback, and left a 1k prompt's push 3.5 ms after its last layer
    /// where four left 5.8. Each stream is a connection, and a thread kept for each way the
    /// connection's KV goes.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub kv_tcp_streams: u16,
    /// A GPU engine's push over tcp copies each group of layers of a step still computing from
    /// the device cache to the host copy as soon as the step has written it, while the groups
    /// before it are on the sockets (off: each group is copied once the one before has gone).
    /// To be measured on a GPU before it becomes the default.
    #[arg(long)]
    pub kv_stage_ahead: bool,
    /// Test only: prefill drops push completion notifications (exercises the timeout path).
    #[arg(long, hide = true)]
    pub fault_drop_done: bool,
    /// Test only: a tensor-parallel prefill engine drops this rank's push completion
    /// notifications (its other ranks' go), as a rank whose notice is lost.
    #[arg(long, hide = true)]
    pub fault_drop_done_of_rank: Option<u32>,
    /// Test only: prefill waits this long before each push write and pull read it answers
    /// (late writes into blocks decode gave up, reads past the lease).
    #[arg(long, hide = true, default_value_t = 0)]
    pub fault_slow_write_ms: u64,
    /// Test only: every KV send is corrupted by one flipped bit after it is checksummed (with
    /// --kv-verify, each transfer fails as a checksum failure and is recomputed).
    #[arg(long, hide = true)]
    pub fault_corrupt_sends: bool,
}

/// The connector setup for `--role prefill|decode`, or `None` for colocated serving.
fn kv_setup(
    k: &KvArgs,
    port: u16,
    fingerprint: &str,
    ucx_log: Option<std::path::PathBuf>,
    cluster_secret: Option<tandem_core::ClusterSecret>,
    tls: Option<tandem_kv::stream::KvTls>,
    unique_id_host: Option<&str>,
) -> Result<Option<tandem_engine::KvSetup>> {
    use {KvLoadFailureArg, KvModeArg, RoleArg};
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
            // Registered with discovery, the id is a key every engine of the deployment must
            // have its own of: the host joins the default.
            engine_id: tandem_core::EngineId(k.engine_id.clone().unwrap_or_else(|| {
                let role = format!("{role:?}").to_lowercase();
                match unique_id_host {
                    Some(host) => format!("{role}-{host}-{port}"),
                    None => format!("{role}-{port}"),
                }
            })),
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
                drop_done_of_rank: k.fault_drop_done_of_rank,
                slow_write: std::time::Duration::from_millis(k.fault_slow_write_ms),
                corrupt_sends: k.fault_corrupt_sends,
                ..Default::default()
            },
            // Separate processes: the local transport only applies within one process.
            local_transport: false,
            transport: k.kv_transport.to_kv(),
            verify: k.kv_verify,
            tcp_streams: k.kv_tcp_streams.into(),
            stage_ahead: k.kv_stage_ahead,
            tp_size: 1,
            nixl_min_gb_s: k.kv_nixl_min_gb_s,
            nixl_pull: k.kv_nixl_pull.to_kv(),
            ucx_log,
            cluster_secret,
            tls,
        },
        load_failure: match k.kv_load_failure {
            KvLoadFailureArg::Recompute => tandem_engine::KvLoadFailure::Recompute,
            KvLoadFailureArg::Fail => tandem_engine::KvLoadFailure::Fail,
        },
    }))
}

pub(crate) fn serve(a: ServeArgs, ucx_log: Option<std::path::PathBuf>) -> Result<()> {
    let port = a.port.unwrap_or(match a.kv.role {
        RoleArg::Both => 8000,
        RoleArg::Prefill => 8100,
        RoleArg::Decode => 8200,
    });
    // Prefill and decode on a GPU: tcp transfers go through a host copy of the KV cache;
    // cuda-ipc and nixl move the device caches directly.
    let direct = matches!(a.kv.kv_transport, KvTransportArg::CudaIpc | KvTransportArg::Nixl);
    let host_kv_bytes = if a.kv.role == RoleArg::Both || direct {
        None
    } else {
        if !(a.kv.kv_host_gib.is_finite() && a.kv.kv_host_gib > 0.0) {
            bail!("--kv-host-gib must be a positive number of GiB");
        }
        Some((a.kv.kv_host_gib * (1u64 << 30) as f64) as usize)
    };
    if a.kv.role != RoleArg::Both {
        crate::engine::check_tensor_parallel_kv(&a.model, &a.engine)?;
    }
    let parts = build_engine(&a.model, &a.engine, host_kv_bytes)?;
    let cluster_secret = a.cluster.load()?;
    let tls = a.tls.load()?;
    let discovery = a.discovery.config()?;
    // Where routers and KV peers reach this engine (registered with --discovery).
    let reach_host = match &a.kv.kv_advertise_host {
        Some(h) => h.clone(),
        None => tandem_kv::channel::advertised_host(&a.host)
            .map_err(|e| anyhow::anyhow!("--host {e}: name the address routers reach with --advertise-url"))?,
    };
    let kv = kv_setup(
        &a.kv,
        port,
        &parts.fingerprint,
        ucx_log,
        cluster_secret.clone(),
        tls.as_ref().map(|t| t.kv.clone()),
        discovery.as_ref().map(|_| reach_host.as_str()),
    )?;
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
    let scheme = if tls.is_some() { "https" } else { "http" };
    let http_url = a.advertise_url.clone().unwrap_or_else(|| {
        let host = if reach_host.contains(':') { format!("[{reach_host}]") } else { reach_host.clone() };
        format!("{scheme}://{host}:{port}")
    });
    let record = crate::discovery::engine_record(
        engine.kv_info(),
        format!("colocated-{reach_host}-{port}"),
        &name,
        &parts.fingerprint,
        http_url,
        a.discovery.discovery_lease_secs,
    );
    let max_in_flight = match a.max_queued_requests {
        0 => 0,
        n => n + a.engine.max_num_seqs,
    };
    let defaults = match a.generation_config {
        GenerationConfigArg::Auto => parts.generation_defaults,
        GenerationConfigArg::Vllm => Default::default(),
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
    let keys = a.auth.api_keys()?;
    if a.auth.api_key_for_metrics && !keys.required() {
        anyhow::bail!("--api-key-for-metrics needs --api-key (or TANDEM_API_KEY)");
    }
    if !keys.required() && a.host != "127.0.0.1" && a.host != "localhost" && a.host != "::1" {
        tracing::warn!(host = %a.host, "no --api-key: anyone who reaches this port can use the API");
    }
    let state = Arc::new(
        tandem_server::AppState::new(engine, tokenizer, name.clone())
            .with_max_in_flight(max_in_flight)
            .with_sampling_defaults(defaults)
            .with_api_keys(keys)
            .with_metrics_needing_key(a.auth.api_key_for_metrics)
            .with_cluster_secret(cluster_secret),
    );
    let drain = seconds(a.shutdown_timeout_secs, "--shutdown-timeout-secs")?;
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the async runtime")?;
    let result = rt.block_on(async move {
        let addr = format!("{}:{port}", a.host);
        let listener = tokio::net::TcpListener::bind(&addr).await.with_context(|| format!("binding {addr}"))?;
        let https = tls.map(|t| t.https);
        tracing::info!(%addr, model = %name, tls = https.is_some(), "serving the OpenAI API (Ctrl-C to stop)");
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(tandem_server::serve(listener, https, state.clone(), async {
            let _ = stop_rx.await;
        }));
        // Registered once serving: a router that reads the key can reach the port.
        let registration = match &discovery {
            Some(cfg) => {
                let health = std::sync::Arc::new(tandem_discovery::DiscoveryHealth::default());
                state.metrics.watch_discovery(health.clone());
                tracing::info!(url = %record.http_url, engine_id = %record.engine_id, endpoints = ?cfg.endpoints, "registering with etcd");
                Some(tandem_discovery::register(cfg, record, health)?)
            }
            None => None,
        };
        // Withdrawn before the drain, and /health says "draining": routers stop sending new
        // requests while these finish.
        let draining = state.clone();
        let withdraw = async move {
            draining.start_draining();
            if let Some(r) = registration {
                r.withdraw(std::time::Duration::from_secs(3)).await;
            }
        };
        let (s1, s2) = (state.clone(), state.clone());
        serve_until_signalled(server, stop_tx, withdraw, drain, move || s1.in_flight(), move || s2.abort_all()).await
    });
    // Threads still blocked in the runtime (none expected) must not hold the exit.
    rt.shutdown_timeout(std::time::Duration::from_millis(100));
    result
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM (a process manager's stop).
pub(crate) async fn stop_signal() {
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
pub(crate) async fn serve_until_signalled(
    mut server: tokio::task::JoinHandle<std::io::Result<()>>,
    stop: tokio::sync::oneshot::Sender<()>,
    before_drain: impl std::future::Future<Output = ()>,
    drain: std::time::Duration,
    in_flight: impl Fn() -> usize,
    abort_all: impl FnOnce(),
) -> Result<()> {
    tokio::select! {
        r = &mut server => return r.context("the server task failed")?.context("serving"),
        _ = stop_signal() => {}
    }
    before_drain.await;
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
