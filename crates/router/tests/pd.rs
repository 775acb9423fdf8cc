//! Prefill/decode disaggregation end to end, in one process over real sockets: a prefill
//! server, a decode server (another block size), the router, and a colocated server as the
//! reference. Push and pull must both give the colocated tokens exactly, and every engine's
//! blocks must come back.

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tandem_core::{EngineId, TransferMode};
use tandem_engine::{EngineConfig, KvLoadFailure, KvSetup};
use tandem_kv::tcp::Timeouts;
use tandem_kv::{ConnectorConfig, FaultInjection, KvMode, Role};
use tandem_model::{LoadedModel, ModelSource, Preset};
use tandem_router::{Router, RouterConfig};
use tandem_server::AppState;

struct Engine {
    url: String,
    state: Arc<AppState>,
}

async fn engine(role: Option<(Role, KvMode)>, block_size: usize, faults: FaultInjection) -> Engine {
    let m =
        LoadedModel::load(&ModelSource::Preset { preset: Preset::find("tiny-qwen3").unwrap(), seed: 0 }, None).unwrap();
    let cfg = EngineConfig { block_size, num_blocks: 3000 / block_size, max_num_seqs: 64, max_num_batched_tokens: 96 };
    let kv = role.map(|(role, mode)| KvSetup {
        connector: ConnectorConfig {
            engine_id: EngineId(format!("{role:?}-{block_size}").to_lowercase()),
            role,
            mode,
            listen: "127.0.0.1:0".into(),
            advertise_host: "127.0.0.1".into(),
            model_fingerprint: m.transformer.fingerprint(),
            timeouts: Timeouts { connect: Duration::from_secs(2), io: Duration::from_secs(5) },
            lease: Duration::from_secs(30),
            transfer_timeout: Duration::from_secs(10),
            faults,
        },
        load_failure: KvLoadFailure::Fail,
    });
    let handle = tandem_engine::spawn_with(m.transformer, m.eos_token_ids, m.max_model_len, cfg, kv).unwrap();
    let state = Arc::new(AppState::new(handle, m.tokenizer.map(Arc::new), "tiny".into()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(tandem_server::serve(listener, state.clone(), std::future::pending()));
    Engine { url, state }
}

async fn router(mode: TransferMode, p: &Engine, d: &Engine) -> String {
    let r = Router::new(RouterConfig {
        mode,
        prefill: vec![p.url.clone()],
        decode: vec![d.url.clone()],
        prefill_timeout: Duration::from_secs(30),
    })
    .unwrap();
    r.wait_ready(Duration::from_secs(10)).await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(tandem_router::serve(listener, Arc::new(r), std::future::pending()));
    url
}

/// Mixed prompts: 1 token, shorter than a block, several blocks, longer than the step budget.
fn workload() -> Vec<Value> {
    (0..50)
        .map(|i| {
            let len = [1, 3, 7, 8, 9, 16, 17, 40, 130][i % 9];
            let prompt: Vec<u32> = (0..len).map(|j| ((i * 37 + j * 11) % 500) as u32).collect();
            json!({"model": "tiny", "prompt": prompt, "max_tokens": 3 + i % 8, "temperature": 0,
                   "ignore_eos": true, "stream": i % 2 == 0})
        })
        .collect()
}

async fn run_all(http: &reqwest::Client, base: &str, reqs: &[Value]) -> Vec<Vec<u64>> {
    let tasks: Vec<_> = reqs
        .iter()
        .map(|b| {
            let (http, url, b) = (http.clone(), format!("{base}/v1/completions"), b.clone());
            tokio::spawn(async move {
                let resp = http.post(url).json(&b).send().await.unwrap();
                assert_eq!(resp.status(), 200);
                let text = resp.text().await.unwrap();
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

async fn wait_idle(engines: &[&Engine]) {
    let deadline = Instant::now() + Duration::from_secs(15);
    for e in engines {
        loop {
            let s = e.state.engine.stats();
            if s.running == 0 && s.waiting == 0 && s.free_blocks == s.total_blocks {
                break;
            }
            assert!(Instant::now() < deadline, "{} not idle with all blocks free: {s:?}", e.url);
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn push_and_pull_equal_colocated_token_for_token() {
    let http = reqwest::Client::new();
    let reqs = workload();
    let colocated = engine(None, 16, FaultInjection::default()).await;
    let want = run_all(&http, &colocated.url, &reqs).await;
    for (i, w) in want.iter().enumerate() {
        assert_eq!(w.len(), reqs[i]["max_tokens"].as_u64().unwrap() as usize);
    }
    for (mode, kv_mode) in [(TransferMode::Push, KvMode::Push), (TransferMode::Pull, KvMode::Pull)] {
        let p = engine(Some((Role::Prefill, kv_mode)), 16, FaultInjection::default()).await;
        let d = engine(Some((Role::Decode, kv_mode)), 8, FaultInjection::default()).await;
        let base = router(mode, &p, &d).await;
        let got = run_all(&http, &base, &reqs).await;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "{mode:?}: request {i} ({} prompt tokens)", reqs[i]["prompt"].as_array().unwrap().len());
        }
        wait_idle(&[&p, &d]).await;
        let (ps, ds) = (p.state.engine.stats().kv.unwrap(), d.state.engine.stats().kv.unwrap());
        assert_eq!(ds.transfers_ok, 50, "{mode:?}: decode {ds:?}");
        assert_eq!(ps.transfers_ok, 50, "{mode:?}: prefill {ps:?}");
        assert_eq!((ps.transfers_failed, ds.transfers_failed, ps.unknown_ids, ds.unknown_ids), (0, 0, 0, 0));
        assert!(ps.bytes_sent > 0 && ps.bytes_sent == ds.bytes_received);
    }
    wait_idle(&[&colocated]).await;
}
