//! `tandem router`: the proxy in front of prefill and decode engines.

use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;

use crate::engine::{seconds, Switch};
use crate::serve::{serve_until_signalled, stop_signal, KvModeArg};

#[derive(Args, Debug)]
pub struct RouterArgs {
    /// push or pull (must match the engines).
    #[arg(long, value_enum, default_value = "push")]
    pub mode: KvModeArg,
    /// Prefill engine base URLs, e.g. http://127.0.0.1:8100 (repeat or comma-separate; none
    /// needed with --discovery).
    #[arg(long, value_delimiter = ',', required_unless_present = "discovery")]
    pub prefill: Vec<String>,
    /// Decode engine base URLs, e.g. http://127.0.0.1:8200 (repeat or comma-separate; none
    /// needed with --discovery).
    #[arg(long, value_delimiter = ',', required_unless_present = "discovery")]
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
    /// Clients' keys; the router sends the first to its engines, so give engines that take
    /// --api-key that key too.
    #[command(flatten)]
    pub auth: crate::auth::ApiKeyArgs,
    /// The secret shared with the engines: the router sends them its token (their /kv/*
    /// endpoints want it) and takes it on /admin/engines.
    #[command(flatten)]
    pub cluster: crate::auth::ClusterSecretArgs,
    /// /admin/engines (listing, adding and removing engines) answers only `Authorization:
    /// Bearer KEY` with one of these keys (repeat or comma-separate), or the cluster token.
    /// Neither this nor --cluster-secret-file: the admin endpoints are open to anyone who
    /// reaches the port.
    #[arg(long = "admin-key", value_name = "KEY", value_delimiter = ',')]
    pub admin_key: Vec<String>,
    #[command(flatten)]
    pub tls: crate::auth::RouterTlsArgs,
    #[command(flatten)]
    pub discovery: crate::discovery::DiscoveryArgs,
}

pub(crate) fn router(a: RouterArgs) -> Result<()> {
    let mode = match a.mode {
        KvModeArg::Push => tandem_core::TransferMode::Push,
        KvModeArg::Pull => tandem_core::TransferMode::Pull,
    };
    let check_interval =
        seconds(a.check_interval_secs, "--check-interval-secs")?.max(std::time::Duration::from_millis(50));
    let keys = a.auth.keys()?;
    if a.auth.api_key_for_metrics {
        anyhow::bail!("--api-key-for-metrics is for `serve`: the router has no /metrics");
    }
    let router = tandem_router::Router::new(tandem_router::RouterConfig {
        api_keys: tandem_core::ApiKeys::new(&keys).context("--api-key")?,
        engine_api_key: keys.first().cloned(),
        prefill_timeout: std::time::Duration::from_secs(a.prefill_timeout_secs),
        check_interval,
        local_prefill_max_tokens: a.local_prefill_max_tokens,
        kv_aware_routing: a.kv_aware_routing == Switch::On,
        cluster_secret: a.cluster.load()?,
        admin_keys: tandem_core::ApiKeys::new(&a.admin_key).context("--admin-key")?,
        engine_ca: a.tls.engine_ca()?,
        discovered_engines: a.discovery.discovery.is_some(),
        ..tandem_router::RouterConfig::new(mode, a.prefill.clone(), a.decode.clone())
    })?;
    let https = a.tls.https()?;
    let discovery = a.discovery.config()?;
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
        tracing::info!(%addr, ?mode, tls = https.is_some(), "router ready (Ctrl-C to stop)");
        let router = Arc::new(router);
        let _following = match &discovery {
            Some(cfg) => {
                let health = Arc::new(tandem_discovery::DiscoveryHealth::default());
                tracing::info!(endpoints = ?cfg.endpoints, prefix = %cfg.prefix, "following the engines registered in etcd");
                let (membership, watching) = tandem_discovery::watch(cfg, health.clone())?;
                Some((router.follow_membership(membership, health), AbortOnDrop(watching)))
            }
            None => None,
        };
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(tandem_router::serve(listener, https, router.clone(), async {
            let _ = stop_rx.await;
        }));
        let (r1, r2) = (router.clone(), router.clone());
        serve_until_signalled(server, stop_tx, async {}, drain, move || r1.in_flight(), move || r2.abort_all()).await
    });
    rt.shutdown_timeout(std::time::Duration::from_millis(100));
    result
}

/// Aborts the discovery watch when the router stops.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
