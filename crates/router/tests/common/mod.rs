//! Helpers shared by the P/D integration tests: in-process engines and routers on loopback.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tandem_core::{EngineId, TransferMode};
use tandem_engine::{EngineConfig, KvLoadFailure, KvSetup};
use tandem_kv::channel::Timeouts;
use tandem_kv::{ConnectorConfig, FaultInjection, KvMode, Role};
use tandem_model::{LoadedModel, ModelSource, Preset};
use tandem_router::{Router, RouterConfig};
use tandem_server::AppState;

pub struct Engine {
    pub url: String,
    pub state: Arc<AppState>,
}

/// Knobs the fault tests turn.
#[derive(Clone)]
pub struct Knobs {
    pub faults: FaultInjection,
    pub lease: Duration,
    pub transfer_timeout: Duration,
    pub load_failure: KvLoadFailure,
    pub budget: usize,
    /// Use the local transport (direct copies) instead of TCP bytes.
    pub local: bool,
    /// `--kv-transport` (nixl, with the `nixl` feature).
    pub transport: tandem_kv::KvTransport,
    /// `--kv-nixl-min-gb-s`.
    pub nixl_min_gb_s: f64,
    /// `--kv-tcp-streams` (default 2 here, so that every tcp pair stripes its bytes).
    pub tcp_streams: usize,
    /// `--api-key`: the engine's OpenAI routes want it.
    pub api_key: Option<&'static str>,
    /// `--cluster-secret-file`'s secret: KV peers and /kv/* callers must prove it.
    pub cluster_secret: Option<&'static str>,
    /// `--kv-nixl-pull`.
    pub nixl_pull: tandem_kv::NixlPull,
    /// Async scheduling (pipelined steps), as GPU engines run by default.
    pub pipelined: bool,
    /// KV blocks in the pool (default: 3000 tokens' worth).
    pub num_blocks: Option<usize>,
    /// Requests running at once (default 64).
    pub max_num_seqs: usize,
    /// `--max-queue-secs` (default: no bound).
    pub max_queue_time: Option<Duration>,
    /// Generations the server answers at once before it answers 429 (0: no bound).
    pub max_in_flight: usize,
    /// The host the side channel advertises (default 127.0.0.1, where it listens; another
    /// loopback address, where nothing listens, makes it unreachable to peers).
    pub advertise_host: &'static str,
    /// `--kv-verify`: checksums on every tcp bulk send (on by default: the P/D and fault tests
    /// run with it, so that KV corrupted on the way would fail them as a counted checksum
    /// failure, not as wrong tokens).
    pub verify: bool,
    /// Prefix caching on the engines (on by default, as `serve`'s: every P/D and fault test
    /// runs with cached blocks shared between requests).
    pub prefix_caching: bool,
}

impl Default for Knobs {
    fn default() -> Self {
        Self {
            faults: FaultInjection::default(),
            lease: Duration::from_secs(30),
            transfer_timeout: Duration::from_secs(10),
            load_failure: KvLoadFailure::Fail,
            budget: 96,
            local: false,
            transport: tandem_kv::KvTransport::Auto,
            nixl_min_gb_s: 0.0,
            tcp_streams: 2,
            api_key: None,
            cluster_secret: None,
            nixl_pull: tandem_kv::NixlPull::Auto,
            pipelined: false,
            num_blocks: None,
            max_num_seqs: 64,
            max_queue_time: None,
            prefix_caching: true,
            max_in_flight: 0,
            verify: true,
            advertise_host: "127.0.0.1",
        }
    }
}

pub async fn engine(role: Option<(Role, KvMode)>, block_size: usize, faults: FaultInjection) -> Engine {
    engine_with(role, block_size, Knobs { faults, ..Knobs::default() }).await
}

pub async fn engine_with(role: Option<(Role, KvMode)>, block_size: usize, k: Knobs) -> Engine {
    let m =
        LoadedModel::load(&ModelSource::Preset { preset: Preset::find("tiny-qwen3").unwrap(), seed: 0 }, None).unwrap();
    start_engine(m, role, block_size, k).await
}

pub async fn start_engine(m: LoadedModel, role: Option<(Role, KvMode)>, block_size: usize, k: Knobs) -> Engine {
    let cfg = EngineConfig {
        block_size,
        num_blocks: k.num_blocks.unwrap_or(3000 / block_size),
        max_num_seqs: k.max_num_seqs,
        max_num_batched_tokens: k.budget,
        async_scheduling: k.pipelined,
        max_queue_time: k.max_queue_time,
        prefix_caching: k.prefix_caching,
    };
    let kv = role.map(|(role, mode)| KvSetup {
        connector: ConnectorConfig {
            engine_id: EngineId(format!("{role:?}-{block_size}").to_lowercase()),
            role,
            mode,
            listen: "127.0.0.1:0".into(),
            advertise_host: k.advertise_host.into(),
            model_fingerprint: m.transformer.fingerprint(),
            timeouts: Timeouts { connect: Duration::from_secs(2), io: Duration::from_secs(5) },
            lease: k.lease,
            transfer_timeout: k.transfer_timeout,
            liveness: Duration::from_secs(10),
            faults: k.faults.clone(),
            local_transport: k.local,
            transport: k.transport,
            verify: k.verify,
            tcp_streams: k.tcp_streams,
            stage_ahead: false,
            tp_size: 1,
            nixl_min_gb_s: k.nixl_min_gb_s,
            nixl_pull: k.nixl_pull,
            ucx_log: None,
            cluster_secret: k.cluster_secret.map(|s| tandem_core::ClusterSecret::new(s.as_bytes()).unwrap()),
            tls: None,
        },
        load_failure: k.load_failure,
    });
    let handle = tandem_engine::spawn_with(
        tandem_engine::EngineModel::from(m.transformer),
        m.eos_token_ids,
        m.max_model_len,
        cfg,
        kv,
    )
    .unwrap();
    let state = Arc::new(
        AppState::new(handle, m.tokenizer.map(Arc::new), "tiny".into())
            .with_max_in_flight(k.max_in_flight)
            .with_api_keys(tandem_core::ApiKeys::new(k.api_key).unwrap())
            .with_cluster_secret(k.cluster_secret.map(|s| tandem_core::ClusterSecret::new(s.as_bytes()).unwrap())),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(tandem_server::serve(listener, None, state.clone(), std::future::pending()));
    Engine { url, state }
}

pub async fn router(mode: TransferMode, p: &Engine, d: &Engine) -> String {
    router_over(mode, &[p], &[d]).await
}

/// A router over several prefill and decode engines.
pub async fn router_over(mode: TransferMode, prefill: &[&Engine], decode: &[&Engine]) -> String {
    router_with(mode, prefill, decode, None).await
}

/// A router over several engines that runs prompts decode would compute at most
/// `local_prefill_max_tokens` of on decode alone.
pub async fn router_with(
    mode: TransferMode,
    prefill: &[&Engine],
    decode: &[&Engine],
    local_prefill_max_tokens: Option<usize>,
) -> String {
    let urls = |es: &[&Engine]| es.iter().map(|e| e.url.clone()).collect();
    let cfg = RouterConfig {
        prefill_timeout: Duration::from_secs(30),
        local_prefill_max_tokens,
        ..RouterConfig::new(mode, urls(prefill), urls(decode))
    };
    serve_router(cfg).await.0
}

/// Starts a router with `cfg` once its engines are ready; its URL, and the router.
pub async fn serve_router(cfg: RouterConfig) -> (String, Arc<Router>) {
    let r = Router::new(cfg).unwrap();
    r.wait_ready(Duration::from_secs(10)).await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let r = Arc::new(r);
    tokio::spawn(tandem_router::serve(listener, None, r.clone(), std::future::pending()));
    (url, r)
}

/// Mixed prompts: 1 token, shorter than a block, several blocks, longer than the step budget.
pub fn workload() -> Vec<Value> {
    (0..50)
        .map(|i| {
            let len = [1, 3, 7, 8, 9, 16, 17, 40, 130][i % 9];
            let prompt: Vec<u32> = (0..len).map(|j| ((i * 37 + j * 11) % 500) as u32).collect();
            json!({"model": "tiny", "prompt": prompt, "max_tokens": 3 + i % 8, "temperature": 0,
                   "ignore_eos": true, "stream": i % 2 == 0})
        })
        .collect()
}

pub async fn run_all(http: &reqwest::Client, base: &str, reqs: &[Value]) -> Vec<Vec<u64>> {
    let tasks: Vec<_> = reqs
        .iter()
        .map(|b| {
            let (http, url, b) = (http.clone(), format!("{base}/v1/completions"), b.clone());
            tokio::spawn(async move {
                let resp = http.post(url).json(&b).send().await.unwrap();
                let status = resp.status();
                let text = resp.text().await.unwrap();
                assert_eq!(status, 200, "{text}");
                let mut ids = Vec::new();
                let bodies: Vec<String> = if b["stream"] == json!(true) {
                    text.split("\n\n")
                        .filter_map(|e| e.strip_prefix("data: "))
                        .filter(|e| *e != "[DONE]")
                        .map(str::to_string)
                        .collect()
                } else {
                    vec![text]
                };
                for body in bodies {
                    let v: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
                    assert!(v.get("error").is_none(), "{v}");
                    for id in v["choices"][0]["token_ids"].as_array().unwrap() {
                        ids.push(id.as_u64().unwrap());
                    }
                }
                ids
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

pub async fn wait_idle(engines: &[&Engine]) {
    let deadline = Instant::now() + Duration::from_secs(15);
    for e in engines {
        loop {
            let s = e.state.engine.stats();
            if s.running == 0 && s.waiting == 0 && s.free_blocks == s.total_blocks {
                break;
            }
            if Instant::now() >= deadline {
                let all: Vec<String> =
                    engines.iter().map(|e| format!("{}: {:?}", e.url, e.state.engine.stats())).collect();
                panic!("{} not idle with all blocks free: {s:?}\nall engines:\n{}", e.url, all.join("\n"));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// An engine whose preset weights use another seed (a different model of the same shape).
pub async fn engine_seeded(role: Option<(Role, KvMode)>, block_size: usize, seed: u64) -> Engine {
    let m =
        LoadedModel::load(&ModelSource::Preset { preset: Preset::find("tiny-qwen3").unwrap(), seed }, None).unwrap();
    start_engine(m, role, block_size, Knobs::default()).await
}

/// Waits (bounded) until this engine's connector counters satisfy `pred` (a transfer's
/// counters may follow the answer by a moment: the sender counts after its last byte).
pub async fn kv_stats_until(
    e: &Engine,
    what: &str,
    pred: impl Fn(&tandem_kv::ConnectorStats) -> bool,
) -> tandem_kv::ConnectorStats {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(s) = e.state.engine.stats().kv {
            if pred(&s) {
                return s;
            }
            assert!(Instant::now() < deadline, "{}: {what} never held: {s:?}", e.url);
        }
        assert!(Instant::now() < deadline, "{}: no connector stats", e.url);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
