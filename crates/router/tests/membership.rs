//! A router that takes its engines from a discovery membership (as `--discovery` feeds it from
//! etcd): empty, it says so; engines that join serve colocated's answers at once; one that
//! cannot serve its role here is never taken; one that leaves takes no new request.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;
use tandem_core::TransferMode;
use tandem_discovery::{DiscoveryHealth, EngineRecord, Membership};
use tandem_kv::{FaultInjection, KvMode, Role};
use tandem_router::RouterConfig;

fn record(id: &str, role: &str, e: &Engine) -> (String, EngineRecord) {
    let r = EngineRecord {
        engine_id: id.into(),
        epoch: 1,
        role: role.into(),
        kv_mode: "push".into(),
        model: "tiny".into(),
        fingerprint: String::new(),
        http_url: e.url.clone(),
        kv_address: None,
        transports: vec!["tcp".into()],
        block_size: 16,
        capacity_blocks: 0,
        lease_secs: 1,
    };
    (id.to_string(), r)
}

/// The router's prefill and decode engines' URLs, each list sorted: engines that join together
/// are vetted at once and added in whichever order their checks end.
async fn listed(http: &reqwest::Client, base: &str) -> (Vec<String>, Vec<String>) {
    let v: Value = http.get(format!("{base}/admin/engines")).send().await.unwrap().json().await.unwrap();
    let urls = |role: &str| {
        sorted(v[role].as_array().unwrap().iter().map(|e| e["url"].as_str().unwrap().to_string()).collect())
    };
    (urls("prefill"), urls("decode"))
}

fn sorted(mut urls: Vec<String>) -> Vec<String> {
    urls.sort();
    urls
}

async fn until_listed(http: &reqwest::Client, base: &str, want: (Vec<String>, Vec<String>)) {
    let want = (sorted(want.0), sorted(want.1));
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let now = listed(http, base).await;
        if now == want {
            return;
        }
        assert!(Instant::now() < deadline, "engines {now:?}, wanted {want:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn engines_join_and_leave_with_the_membership() {
    let http = reqwest::Client::new();
    let reqs: Vec<Value> = workload().into_iter().take(12).collect();
    let colocated = engine(None, 16, FaultInjection::default()).await;
    let want = run_all(&http, &colocated.url, &reqs).await;
    let p = engine(Some((Role::Prefill, KvMode::Push)), 16, FaultInjection::default()).await;
    let d1 = engine(Some((Role::Decode, KvMode::Push)), 8, FaultInjection::default()).await;
    let d2 = engine(Some((Role::Decode, KvMode::Push)), 16, FaultInjection::default()).await;
    let pull = engine(Some((Role::Prefill, KvMode::Pull)), 16, FaultInjection::default()).await;
    let cfg = RouterConfig { discovered_engines: true, ..RouterConfig::new(TransferMode::Push, vec![], vec![]) };
    let (base, router) = serve_router(cfg).await;
    let (tx, rx) = tokio::sync::watch::channel::<Option<Membership>>(None);
    let _following = router.follow_membership(rx, Arc::new(DiscoveryHealth::default()));

    // Nobody registered yet: unavailable, saying so.
    let health = http.get(format!("{base}/health")).send().await.unwrap();
    assert_eq!(health.status(), 503);
    let body: Value = health.json().await.unwrap();
    assert!(body["problems"].to_string().contains("no prefill engine"), "{body}");
    assert!(body["discovery"].is_object(), "{body}");

    tx.send_replace(Some(BTreeMap::from([record("p", "prefill", &p), record("d1", "decode", &d1)])));
    until_listed(&http, &base, (vec![p.url.clone()], vec![d1.url.clone()])).await;
    assert_eq!(run_all(&http, &base, &reqs).await, want, "engines that joined answer as colocated");

    // d2 joins; a pull engine registered as a prefill engine of this push router is refused.
    tx.send_replace(Some(BTreeMap::from([
        record("p", "prefill", &p),
        record("d1", "decode", &d1),
        record("d2", "decode", &d2),
        record("pull", "prefill", &pull),
    ])));
    until_listed(&http, &base, (vec![p.url.clone()], vec![d1.url.clone(), d2.url.clone()])).await;

    // d1 leaves (withdrawn, or its lease lapsed): no new request reaches it.
    tx.send_replace(Some(BTreeMap::from([record("p", "prefill", &p), record("d2", "decode", &d2)])));
    until_listed(&http, &base, (vec![p.url.clone()], vec![d2.url.clone()])).await;
    wait_idle(&[&p, &d1, &d2]).await;
    let d1_steps = d1.state.engine.stats().steps;
    assert_eq!(run_all(&http, &base, &reqs).await, want);
    assert_eq!(d1.state.engine.stats().steps, d1_steps, "an engine that left took a request");

    // Everyone leaves: requests are refused, not hung.
    tx.send_replace(Some(Membership::new()));
    until_listed(&http, &base, (vec![], vec![])).await;
    let r = http.post(format!("{base}/v1/completions")).json(&reqs[0]).send().await.unwrap();
    assert_eq!(r.status(), 503, "{}", r.text().await.unwrap());
    wait_idle(&[&p, &d2]).await;
}

/// An engine found through discovery may be anybody's. With a cluster secret the router asks
/// it to prove the secret before anything else: a stranger (here a server that records every
/// request) is never taken into service and never sees the cluster token or the API key.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stranger_in_the_membership_learns_neither_the_token_nor_the_key() {
    const SECRET: &str = "this deployment's cluster secret";
    let seen = Arc::new(std::sync::Mutex::new(Vec::<(String, Vec<String>)>::new()));
    let record_all = {
        let seen = seen.clone();
        move |req: axum::extract::Request| {
            let seen = seen.clone();
            async move {
                let names = req.headers().keys().map(|k| k.as_str().to_string()).collect();
                seen.lock().unwrap().push((req.uri().path().to_string(), names));
                axum::Json(serde_json::json!({"proof": "00", "status": "ok"}))
            }
        }
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let stranger_url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, axum::Router::new().fallback(record_all)).await });

    let k = Knobs { cluster_secret: Some(SECRET), ..Knobs::default() };
    let p = engine_with(Some((Role::Prefill, KvMode::Push)), 16, k.clone()).await;
    let d = engine_with(Some((Role::Decode, KvMode::Push)), 16, k).await;
    let cfg = RouterConfig {
        discovered_engines: true,
        cluster_secret: Some(tandem_core::ClusterSecret::new(SECRET.as_bytes()).unwrap()),
        engine_api_key: Some("sk-engines".into()),
        admin_keys: tandem_core::ApiKeys::new(["sk-admin"]).unwrap(),
        ..RouterConfig::new(TransferMode::Push, vec![], vec![])
    };
    let (base, router) = serve_router(cfg).await;
    let (tx, rx) = tokio::sync::watch::channel::<Option<Membership>>(None);
    let _following = router.follow_membership(rx, Arc::new(DiscoveryHealth::default()));
    let stranger = Engine { url: stranger_url.clone(), state: d.state.clone() };
    tx.send_replace(Some(BTreeMap::from([
        record("p", "prefill", &p),
        record("d", "decode", &d),
        record("stranger", "decode", &stranger),
    ])));
    let admin = reqwest::Client::builder()
        .default_headers(reqwest::header::HeaderMap::from_iter([(
            reqwest::header::AUTHORIZATION,
            "Bearer sk-admin".parse().unwrap(),
        )]))
        .build()
        .unwrap();
    until_listed(&admin, &base, (vec![p.url.clone()], vec![d.url.clone()])).await;
    // Vetted and refused: it was only challenged, without token or key.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let seen = seen.lock().unwrap().clone();
    assert!(!seen.is_empty(), "the stranger was never asked");
    for (path, headers) in &seen {
        assert_eq!(path, "/kv/prove", "the stranger was asked more than to prove itself");
        assert!(!headers.iter().any(|h| h == tandem_core::CLUSTER_TOKEN_HEADER || h == "authorization"), "{headers:?}");
    }
}

/// A key can go while its engine is alive: etcd, after an outage, expires every lease it could
/// not renew. An engine that still answers healthy is kept for its lease (it registers again
/// meanwhile and never leaves); one that withdrew (draining) or is gone leaves at once; one
/// whose key does not come back leaves after its lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lapsed_key_of_a_healthy_engine_is_waited_for_a_withdrawn_one_is_not() {
    let http = reqwest::Client::new();
    let p = engine(Some((Role::Prefill, KvMode::Push)), 16, FaultInjection::default()).await;
    let d1 = engine(Some((Role::Decode, KvMode::Push)), 16, FaultInjection::default()).await;
    let d2 = engine(Some((Role::Decode, KvMode::Push)), 16, FaultInjection::default()).await;
    let cfg = RouterConfig { discovered_engines: true, ..RouterConfig::new(TransferMode::Push, vec![], vec![]) };
    let (base, router) = serve_router(cfg).await;
    let (tx, rx) = tokio::sync::watch::channel::<Option<Membership>>(None);
    let _following = router.follow_membership(rx, Arc::new(DiscoveryHealth::default()));
    let all = || BTreeMap::from([record("p", "prefill", &p), record("d1", "decode", &d1), record("d2", "decode", &d2)]);
    tx.send_replace(Some(all()));
    until_listed(&http, &base, (vec![p.url.clone()], vec![d1.url.clone(), d2.url.clone()])).await;

    // Every key lapses at once (etcd back from an outage) and comes back 300 ms later: nobody leaves.
    tx.send_replace(Some(Membership::new()));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let both = (vec![p.url.clone()], sorted(vec![d1.url.clone(), d2.url.clone()]));
    assert_eq!(listed(&http, &base).await, both);
    tx.send_replace(Some(all()));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(listed(&http, &base).await, both, "an engine whose key came back left");

    // d1 withdraws as it starts to drain: it leaves at once, well inside its lease.
    d1.state.start_draining();
    let mut without_d1 = all();
    without_d1.remove("d1");
    tx.send_replace(Some(without_d1.clone()));
    let start = Instant::now();
    until_listed(&http, &base, (vec![p.url.clone()], vec![d2.url.clone()])).await;
    assert!(start.elapsed() < Duration::from_millis(800), "a draining engine lingered {:?}", start.elapsed());

    // d2's key goes and does not come back while d2 stays healthy: it leaves after its lease (1 s).
    without_d1.remove("d2");
    tx.send_replace(Some(without_d1));
    let start = Instant::now();
    until_listed(&http, &base, (vec![p.url.clone()], vec![])).await;
    let took = start.elapsed();
    assert!(took >= Duration::from_millis(900) && took < Duration::from_secs(3), "left after {took:?} (lease 1 s)");
}
