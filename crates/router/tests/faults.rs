//! Failure paths of disaggregated serving. Each test is bounded in time, checks no engine
//! died, and ends with every engine's free-block count back at its starting value.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};
use tandem_core::TransferMode;
use tandem_engine::KvLoadFailure;
use tandem_kv::{FaultInjection, KvMode, Role};

fn prompt(len: usize, salt: usize) -> Vec<u32> {
    (0..len).map(|j| ((salt * 31 + j * 7) % 500) as u32).collect()
}

async fn post(http: &reqwest::Client, url: &str, body: Value) -> (u16, Value) {
    let r = http.post(format!("{url}/v1/completions")).json(&body).send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

fn ids(v: &Value) -> Vec<u64> {
    v["choices"][0]["token_ids"].as_array().map(|a| a.iter().map(|x| x.as_u64().unwrap()).collect()).unwrap_or_default()
}

fn alive(engines: &[&Engine]) {
    for e in engines {
        assert!(e.state.engine.is_alive(), "{} engine thread died", e.url);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dropped_completion_is_bounded_and_recompute_gives_the_same_tokens() {
    let http = reqwest::Client::new();
    let colocated = engine(None, 16, FaultInjection::default()).await;
    let p = engine_with(
        Some((Role::Prefill, KvMode::Push)),
        16,
        Knobs { faults: FaultInjection { drop_done: true, ..FaultInjection::default() }, ..Knobs::default() },
    )
    .await;
    let d = engine_with(
        Some((Role::Decode, KvMode::Push)),
        8,
        Knobs {
            transfer_timeout: Duration::from_millis(400),
            load_failure: KvLoadFailure::Recompute,
            ..Knobs::default()
        },
    )
    .await;
    let base = router(TransferMode::Push, &p, &d).await;
    let start = Instant::now();
    for i in 0..4 {
        let body = json!({"prompt": prompt(20 + i * 9, i), "max_tokens": 6, "temperature": 0, "ignore_eos": true});
        let (s1, want) = post(&http, &colocated.url, body.clone()).await;
        let (s2, got) = post(&http, &base, body).await;
        assert_eq!((s1, s2), (200, 200), "{got}");
        assert_eq!(ids(&got), ids(&want), "request {i}: recompute must give the colocated tokens");
    }
    assert!(start.elapsed() < Duration::from_secs(20), "each lost notification costs one bounded timeout");
    kv_stats_until(&d, "4 failed transfers", |s| s.transfers_failed == 4).await;
    wait_idle(&[&p, &d, &colocated]).await;
    alive(&[&p, &d]);
}

/// A direct writer (the local transport, as cuda-ipc) whose copy is still running at decode's
/// deadline (it took the transfer on in time, then its copy engine stalls for 2.5 s): decode
/// cannot know the copy will not land, so it fails the transfer at the deadline with the blocks
/// held through the grace (one I/O timeout, 5 s here) and recomputes in other blocks at once,
/// not when the late write ends or the grace has passed. The answer is colocated's, the late
/// write lands in the held blocks (no other request's), and they come back after the grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_direct_write_past_decodes_deadline_is_recomputed_at_once_in_other_blocks() {
    let http = reqwest::Client::new();
    let colocated = engine(None, 16, FaultInjection::default()).await;
    let slow = FaultInjection { slow_write: Duration::from_millis(2500), ..FaultInjection::default() };
    let p =
        engine_with(Some((Role::Prefill, KvMode::Push)), 16, Knobs { local: true, faults: slow, ..Knobs::default() })
            .await;
    let d = engine_with(
        Some((Role::Decode, KvMode::Push)),
        8,
        Knobs {
            local: true,
            transfer_timeout: Duration::from_millis(800),
            load_failure: KvLoadFailure::Recompute,
            ..Knobs::default()
        },
    )
    .await;
    let base = router(TransferMode::Push, &p, &d).await;
    let body = json!({"prompt": prompt(40, 3), "max_tokens": 6, "temperature": 0, "ignore_eos": true});
    let (_, want) = post(&http, &colocated.url, body.clone()).await;
    let start = Instant::now();
    let (status, got) = post(&http, &base, body.clone()).await;
    let took = start.elapsed();
    assert_eq!(status, 200, "{got}");
    assert_eq!(ids(&got), ids(&want), "the recompute must give the colocated tokens");
    assert!(took < Duration::from_millis(2000), "answered after {took:?}: it waited for the late write");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let s = d.state.engine.stats();
    assert!(s.free_blocks < s.total_blocks, "the failed transfer's blocks were not held: {s:?}");
    // The late write lands at about 2.5 s, into the held blocks; a request sent meanwhile and
    // after gets its own blocks and the colocated tokens.
    for salt in [4, 5] {
        let body = json!({"prompt": prompt(33, salt), "max_tokens": 5, "temperature": 0, "ignore_eos": true});
        let (_, want) = post(&http, &colocated.url, body.clone()).await;
        let (_, got) = post(&http, &base, body).await;
        assert_eq!(ids(&got), ids(&want), "prompt {salt}");
        tokio::time::sleep(Duration::from_millis(1500)).await;
    }
    wait_idle(&[&p, &d, &colocated]).await;
    assert!(start.elapsed() > Duration::from_millis(5800), "the held blocks came back before the grace ended");
    alive(&[&p, &d]);
}

/// A failed copy between a GPU engine's device cache and its host copy (the tcp transport's
/// staging, injected here) is a failed transfer, not a hang or wrong tokens, and the connection
/// survives it: decode failing to load what arrived (push), or prefill failing to copy out what
/// decode reads (pull), is known at once, `--kv-load-failure recompute` gives the colocated
/// tokens, and every block comes back on both engines.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failed_host_copy_fails_the_transfer_and_recompute_gives_the_same_tokens() {
    let http = reqwest::Client::new();
    let colocated = engine(None, 16, FaultInjection::default()).await;
    let healthy = Knobs { load_failure: KvLoadFailure::Recompute, ..Knobs::default() };
    let failing =
        Knobs { faults: FaultInjection { fail_host_copies: true, ..FaultInjection::default() }, ..healthy.clone() };
    for (mode, kv_mode, p_knobs, d_knobs) in
        [(TransferMode::Push, KvMode::Push, &healthy, &failing), (TransferMode::Pull, KvMode::Pull, &failing, &healthy)]
    {
        let p = engine_with(Some((Role::Prefill, kv_mode)), 16, p_knobs.clone()).await;
        let d = engine_with(Some((Role::Decode, kv_mode)), 16, d_knobs.clone()).await;
        let base = router(mode, &p, &d).await;
        let start = Instant::now();
        for i in 0..3 {
            let body = json!({"prompt": prompt(20 + i * 9, i), "max_tokens": 6, "temperature": 0, "ignore_eos": true});
            let (s1, want) = post(&http, &colocated.url, body.clone()).await;
            let (s2, got) = post(&http, &base, body).await;
            assert_eq!((s1, s2), (200, 200), "{mode:?}: {got}");
            assert_eq!(ids(&got), ids(&want), "{mode:?} request {i}: recompute must give the colocated tokens");
        }
        // Reported in-band, not found by the transfer timeout (10 s each).
        assert!(start.elapsed() < Duration::from_secs(5), "{mode:?}: {:?}", start.elapsed());
        let ds = kv_stats_until(&d, "3 failed transfers", |s| s.transfers_failed == 3).await;
        assert_eq!(ds.transfers_ok, 0, "{mode:?}: {ds:?}");
        // One connection throughout: a failed copy does not cost the side channel.
        assert_eq!(ds.links_tcp, 1, "{mode:?}: {ds:?}");
        wait_idle(&[&p, &d]).await;
        alive(&[&p, &d]);
    }
    wait_idle(&[&colocated]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn client_disconnect_during_prefill_cancels_both_legs() {
    let http = reqwest::Client::new();
    // One token per step: the 1500-token prompt keeps prefill busy long enough to hang up.
    let p = engine_with(Some((Role::Prefill, KvMode::Push)), 16, Knobs { budget: 1, ..Knobs::default() }).await;
    let d = engine(Some((Role::Decode, KvMode::Push)), 8, FaultInjection::default()).await;
    let base = router(TransferMode::Push, &p, &d).await;
    let body = json!({"prompt": prompt(1500, 1), "max_tokens": 5, "temperature": 0, "stream": true});
    let resp = http.post(format!("{base}/v1/completions")).json(&body).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    let deadline = Instant::now() + Duration::from_secs(10);
    while p.state.engine.stats().running == 0
        || d.state.engine.stats().free_blocks == d.state.engine.stats().total_blocks
    {
        assert!(Instant::now() < deadline, "both legs should be in flight");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    drop(resp);
    wait_idle(&[&p, &d]).await;
    let steps = p.state.engine.stats().steps;
    assert!(steps < 1500, "prefill ran to the end after the client left ({steps} steps)");
    assert_eq!(kv_stats_until(&p, "stats", |_| true).await.transfers_ok, 0);
    alive(&[&p, &d]);
}

/// The client leaves after prefill has computed the prompt but before the decode engine
/// registered for (push) or read (pull) its KV (here it never would: its agent is silent).
/// Nothing on the decode side can tell prefill, which would hold the blocks for 30 s (its
/// registration wait, or the lease): the router has them freed the moment the client is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_leaving_before_decode_took_the_kv_frees_prefills_blocks_at_once() {
    let http = reqwest::Client::new();
    for (mode, kv_mode) in [(TransferMode::Push, KvMode::Push), (TransferMode::Pull, KvMode::Pull)] {
        let long =
            Knobs { transfer_timeout: Duration::from_secs(30), lease: Duration::from_secs(30), ..Knobs::default() };
        // Room for a push prompt that no decode engine has registered for yet (past a
        // longest prompt's worth of blocks).
        let p = engine_with(Some((Role::Prefill, kv_mode)), 16, Knobs { num_blocks: Some(300), ..long.clone() }).await;
        let silent = Knobs { faults: FaultInjection { silent_agent: true, ..FaultInjection::default() }, ..long };
        let d = engine_with(Some((Role::Decode, kv_mode)), 16, silent).await;
        let base = router(mode, &p, &d).await;
        let body = json!({"prompt": prompt(100, 1), "max_tokens": 4, "temperature": 0});
        let client = tokio::spawn({
            let http = http.clone();
            async move { post(&http, &base, body).await }
        });
        // Prefill has finished the prompt and holds its KV for decode.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let s = p.state.engine.stats();
            if s.running == 0 && s.waiting == 0 && s.free_blocks < s.total_blocks {
                break;
            }
            assert!(Instant::now() < deadline, "{mode:?}: prefill never held the prompt's KV: {s:?}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        let left = Instant::now();
        client.abort();
        let deadline = left + Duration::from_secs(3);
        loop {
            let s = p.state.engine.stats();
            if s.free_blocks == s.total_blocks {
                break;
            }
            assert!(Instant::now() < deadline, "{mode:?}: prefill still holds the KV 3 s after the client left: {s:?}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(p.state.engine.stats().kv.map(|k| k.expired), Some(0), "{mode:?}: freed by expiry");
        wait_idle(&[&p, &d]).await;
        alive(&[&p, &d]);
    }
}

/// A decode engine that cannot reach the prefill engine's side channel (the KV network cut
/// between two hosts while the router still reaches both; here prefill advertises a loopback
/// address nothing listens on) recomputes every prompt to the colocated tokens, and cannot tell
/// prefill so; the router has prefill free the prompts' KV as each request ends, rather than
/// hold it until its registration wait (push) or lease (pull) runs out, 30 s here.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kv_no_decode_can_reach_is_freed_as_each_request_ends() {
    let http = reqwest::Client::new();
    let colocated = engine(None, 16, FaultInjection::default()).await;
    let bodies: Vec<Value> =
        (0..6).map(|i| json!({"prompt": prompt(40 + 30 * i, i), "max_tokens": 4, "temperature": 0})).collect();
    let mut want = Vec::new();
    for b in &bodies {
        want.push(post(&http, &colocated.url, b.clone()).await.1["choices"][0]["token_ids"].clone());
    }
    for (mode, kv_mode) in [(TransferMode::Push, KvMode::Push), (TransferMode::Pull, KvMode::Pull)] {
        let long =
            Knobs { transfer_timeout: Duration::from_secs(30), lease: Duration::from_secs(30), ..Knobs::default() };
        let unreachable = Knobs { advertise_host: "127.0.0.2", ..long.clone() };
        let p = engine_with(Some((Role::Prefill, kv_mode)), 16, unreachable).await;
        let recompute = Knobs { load_failure: KvLoadFailure::Recompute, ..long };
        let d = engine_with(Some((Role::Decode, kv_mode)), 16, recompute).await;
        let base = router(mode, &p, &d).await;
        for (b, w) in bodies.iter().zip(&want) {
            let (status, v) = post(&http, &base, b.clone()).await;
            assert_eq!(status, 200, "{mode:?}: {v}");
            assert_eq!(&v["choices"][0]["token_ids"], w, "{mode:?}: recomputed at decode");
        }
        let deadline = Instant::now() + Duration::from_secs(3);
        loop {
            let s = p.state.engine.stats();
            if s.running == 0 && s.waiting == 0 && s.free_blocks == s.total_blocks {
                break;
            }
            assert!(Instant::now() < deadline, "{mode:?}: prefill still holds KV 3 s after the last answer: {s:?}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let failed = d.state.engine.stats().kv.map(|k| k.transfers_failed);
        assert_eq!(failed, Some(bodies.len() as u64), "{mode:?}: every transfer failed at decode");
        assert_eq!(p.state.engine.stats().kv.map(|k| k.expired), Some(0), "{mode:?}: freed by expiry");
        wait_idle(&[&p, &d]).await;
        alive(&[&p, &d]);
    }
    wait_idle(&[&colocated]).await;
}

/// Past capacity, a request that cannot start within the prefill engine's `--max-queue-secs`
/// ends with a 503 and `Retry-After` that the router passes on (no engine of the role is left
/// to take it), within the bound plus a step, having cost no block; the request that was
/// running is unaffected and gives the colocated tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_queued_past_the_bound_gets_a_503_with_retry_after_through_the_router() {
    let http = reqwest::Client::new();
    let colocated = engine(None, 16, FaultInjection::default()).await;
    // One request at a time, one token per step: the 1500-token prompt holds the only place.
    let bound = Duration::from_millis(150);
    let busy = Knobs { budget: 1, max_num_seqs: 1, max_queue_time: Some(bound), ..Knobs::default() };
    let p = engine_with(Some((Role::Prefill, KvMode::Push)), 16, busy).await;
    let d = engine(Some((Role::Decode, KvMode::Push)), 16, FaultInjection::default()).await;
    let base = router(TransferMode::Push, &p, &d).await;
    let long = json!({"prompt": prompt(1500, 1), "max_tokens": 4, "temperature": 0, "ignore_eos": true});
    let first = tokio::spawn({
        let (http, url) = (http.clone(), format!("{base}/v1/completions"));
        let long = long.clone();
        async move { http.post(url).json(&long).send().await.unwrap().json::<Value>().await.unwrap() }
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    while p.state.engine.stats().running == 0 {
        assert!(Instant::now() < deadline, "the long prompt should be running");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let start = Instant::now();
    let short = json!({"prompt": prompt(20, 2), "max_tokens": 4, "temperature": 0});
    let r = http.post(format!("{base}/v1/completions")).json(&short).send().await.unwrap();
    let waited = start.elapsed();
    assert_eq!(r.status().as_u16(), 503);
    assert_eq!(r.headers()["retry-after"], "1");
    let v: Value = r.json().await.unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("--max-queue-secs"), "{v}");
    assert!(waited >= bound && waited < bound + Duration::from_secs(2), "{waited:?}");
    assert_eq!(p.state.engine.stats().running, 1, "the long prompt is still running: the bound ended the other");
    let (_, want) = post(&http, &colocated.url, long).await;
    assert_eq!(ids(&first.await.unwrap()), ids(&want));
    wait_idle(&[&p, &d, &colocated]).await;
    alive(&[&p, &d]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lease_expiry_then_a_late_read_recomputes_with_correct_tokens() {
    let http = reqwest::Client::new();
    let colocated = engine(None, 16, FaultInjection::default()).await;
    let p = engine_with(
        Some((Role::Prefill, KvMode::Pull)),
        16,
        Knobs { lease: Duration::from_millis(200), ..Knobs::default() },
    )
    .await;
    let d = engine_with(
        Some((Role::Decode, KvMode::Pull)),
        8,
        Knobs { load_failure: KvLoadFailure::Recompute, ..Knobs::default() },
    )
    .await;
    let body = json!({"prompt": prompt(37, 3), "max_tokens": 7, "temperature": 0, "ignore_eos": true});
    let mut pb = body.clone();
    pb["max_tokens"] = json!(1);
    pb["kv_transfer_params"] = json!({"do_remote_decode": true, "transfer_id": "late-1"});
    let (status, pv) = post(&http, &p.url, pb).await;
    assert_eq!(status, 200, "{pv}");
    let kv = pv["kv_transfer_params"].clone();
    assert_eq!(kv["remote_block_ids"].as_array().unwrap().len(), 3, "37 tokens in 16-token blocks");
    // Let the lease lapse: prefill frees (and may reuse) those blocks.
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(
        p.state.engine.stats().free_blocks,
        p.state.engine.stats().total_blocks,
        "expired lease freed its blocks"
    );
    let mut db = body.clone();
    db["kv_transfer_params"] = kv;
    let (s1, got) = post(&http, &d.url, db).await;
    let (_, want) = post(&http, &colocated.url, body).await;
    assert_eq!(s1, 200, "{got}");
    assert_eq!(ids(&got), ids(&want), "never tokens from stale KV");
    kv_stats_until(&p, "an expired lease and a refused late read", |s| s.expired >= 1 && s.unknown_ids >= 1).await;
    wait_idle(&[&p, &d, &colocated]).await;
    alive(&[&p, &d]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unknown_and_duplicate_transfer_ids_are_refused_and_counted() {
    let http = reqwest::Client::new();
    let p = engine_with(
        Some((Role::Prefill, KvMode::Pull)),
        16,
        Knobs { lease: Duration::from_millis(300), ..Knobs::default() },
    )
    .await;
    let d = engine(Some((Role::Decode, KvMode::Pull)), 16, FaultInjection::default()).await;
    let epoch = p.state.engine.kv_info().unwrap().epoch.0;
    let port: u16 = p.state.engine.kv_info().unwrap().tcp_addr().unwrap().rsplit_once(':').unwrap().1.parse().unwrap();
    // A decode leg naming a transfer prefill never produced: refused (load_failure = fail).
    let bogus = json!({"prompt": prompt(20, 4), "max_tokens": 3, "kv_transfer_params": {
        "do_remote_prefill": true, "remote_host": "127.0.0.1", "remote_port": port, "transfer_id": "never-made",
        "remote_block_ids": [1, 2], "remote_epoch": epoch, "remote_num_tokens": 20, "first_token_id": 5}});
    let (status, v) = post(&http, &d.url, bogus).await;
    assert_eq!(status, 500, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("no KV held for transfer `never-made`"), "{v}");
    kv_stats_until(&p, "one unknown id", |s| s.unknown_ids == 1).await;
    // Two prefill legs under one transfer id: both answer, the second's KV is refused.
    let leg = json!({"prompt": prompt(20, 5), "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": true, "transfer_id": "dup"}});
    let (a, b) = tokio::join!(post(&http, &p.url, leg.clone()), post(&http, &p.url, leg));
    assert_eq!((a.0, b.0), (200, 200));
    kv_stats_until(&p, "one duplicate id", |s| s.duplicate_ids == 1).await;
    wait_idle(&[&p, &d]).await;
    alive(&[&p, &d]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn malformed_params_wrong_roles_and_failed_legs_are_clear_errors() {
    let http = reqwest::Client::new();
    let colocated = engine(None, 16, FaultInjection::default()).await;
    let p = engine(Some((Role::Prefill, KvMode::Push)), 16, FaultInjection::default()).await;
    let d = engine(Some((Role::Decode, KvMode::Push)), 16, FaultInjection::default()).await;
    let with = |kv: Value| json!({"prompt": [1, 2, 3], "max_tokens": 2, "kv_transfer_params": kv});
    let cases = [
        (&d, with(json!({"do_remote_prefill": true})), 400, "remote_host"),
        (&d, with(json!({"do_remote_prefill": true, "remote_host": "h"})), 400, "remote_port"),
        (&d, with(json!("not an object")), 400, "invalid kv_transfer_params"),
        (&d, with(json!({"remote_port": "x"})), 400, "invalid kv_transfer_params"),
        (&d, with(json!({"do_remote_decode": true, "do_remote_prefill": true})), 400, "both"),
        (
            &d,
            with(json!({"do_remote_decode": true, "transfer_id": "t"})),
            400,
            "decode engine cannot serve a prefill leg",
        ),
        (
            &p,
            with(json!({"do_remote_prefill": true, "remote_host": "h", "remote_port": 1, "transfer_id": "t"})),
            400,
            "prefill engine cannot serve a decode leg",
        ),
        (&colocated, with(json!({"do_remote_decode": true, "transfer_id": "t"})), 400, "no KV connector"),
    ];
    for (e, body, status, needle) in cases {
        let (s, v) = post(&http, &e.url, body.clone()).await;
        assert_eq!(s, status, "{body} -> {v}");
        assert!(v["error"]["message"].as_str().unwrap_or("").contains(needle), "{body}: `{needle}` not in {v}");
    }
    // A prefill leg the prefill engine refuses: the router answers with that 400 at once, and
    // the decode leg it had already sent is cancelled.
    let base = router(TransferMode::Push, &p, &d).await;
    let start = Instant::now();
    let (s, v) = post(&http, &base, json!({"prompt": [1, 2, 99999], "max_tokens": 2})).await;
    assert_eq!(s, 400, "{v}");
    assert!(start.elapsed() < Duration::from_secs(5));
    wait_idle(&[&p, &d, &colocated]).await;
    alive(&[&p, &d, &colocated]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn peers_with_another_model_are_refused_at_handshake_naming_the_field() {
    let http = reqwest::Client::new();
    let p = engine(Some((Role::Prefill, KvMode::Push)), 16, FaultInjection::default()).await;
    // Same shape, other weights: decode's connector refuses prefill at handshake.
    let d = engine_seeded(Some((Role::Decode, KvMode::Push)), 16, 7).await;
    let port: u16 = p.state.engine.kv_info().unwrap().tcp_addr().unwrap().rsplit_once(':').unwrap().1.parse().unwrap();
    let body = json!({"prompt": [1, 2, 3], "max_tokens": 2, "kv_transfer_params": {
        "do_remote_prefill": true, "remote_host": "127.0.0.1", "remote_port": port, "transfer_id": "x1"}});
    let (s, v) = post(&http, &d.url, body).await;
    assert_eq!(s, 500, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("model_fingerprint differs"), "{v}");
    wait_idle(&[&p, &d]).await;
}

/// A decode engine whose KV agent stops answering (it takes the request for KV and never
/// reports) still ends the request within its bound, with an error naming the connector, and
/// gets its blocks back once the agent acknowledges the abort: the engine keeps its own
/// deadline for every request waiting on KV.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_silent_kv_agent_fails_the_request_within_the_engines_own_bound() {
    let http = reqwest::Client::new();
    let short = Knobs { transfer_timeout: Duration::from_millis(400), ..Knobs::default() };
    let p = engine_with(Some((Role::Prefill, KvMode::Push)), 16, short.clone()).await;
    let silent = Knobs { faults: FaultInjection { silent_agent: true, ..FaultInjection::default() }, ..short };
    let d = engine_with(Some((Role::Decode, KvMode::Push)), 16, silent).await;
    let base = router(TransferMode::Push, &p, &d).await;
    let start = Instant::now();
    let answer = post(&http, &base, json!({"prompt": prompt(30, 1), "max_tokens": 4}));
    let (status, v) = tokio::time::timeout(Duration::from_secs(15), answer).await.expect("the request never ended");
    let took = start.elapsed();
    assert!(status >= 500, "{status}: {v}");
    assert!(v.to_string().contains("did not answer"), "{v}");
    // The connector's 0.4 s plus one 5 s I/O timeout plus 1 s of slack, and no more.
    assert!(took < Duration::from_secs(9), "the request waited {took:?}");
    wait_idle(&[&p, &d]).await;
    alive(&[&p, &d]);
}

/// A decode request waiting for its KV keeps its blocks while the pool runs out under it: the
/// running requests are preempted (and recomputed) instead, and the KV prefill writes into
/// those blocks directly later (the local transport, as cuda-ipc) lands in blocks nobody else
/// was given. Every answer equals colocated's and both pools end full.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_waiting_for_its_kv_keeps_its_blocks_while_others_are_preempted() {
    let http = reqwest::Client::new();
    let colocated = engine(None, 16, FaultInjection::default()).await;
    let k = Knobs { local: true, ..Knobs::default() };
    let p = engine_with(Some((Role::Prefill, KvMode::Push)), 16, k.clone()).await;
    // 14 blocks of 16 tokens: the waiting request holds 4, three running ones want 6 each.
    let d = engine_with(Some((Role::Decode, KvMode::Push)), 16, Knobs { num_blocks: Some(14), ..k }).await;
    let port: u16 = p.state.engine.kv_info().unwrap().tcp_addr().unwrap().rsplit_once(':').unwrap().1.parse().unwrap();
    let waiting = json!({"prompt": prompt(60, 9), "max_tokens": 6, "temperature": 0, "ignore_eos": true});
    let mut leg = waiting.clone();
    leg["kv_transfer_params"] = json!({"do_remote_prefill": true, "remote_host": "127.0.0.1", "remote_port": port,
        "transfer_id": "wait-1"});
    let decode_leg = tokio::spawn({
        let (http, url) = (http.clone(), d.url.clone());
        async move { post(&http, &url, leg).await }
    });
    let deadline = Instant::now() + Duration::from_secs(5);
    while d.state.engine.stats().free_blocks == d.state.engine.stats().total_blocks {
        assert!(Instant::now() < deadline, "the decode leg never allocated its blocks");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let others: Vec<Value> = (0..3)
        .map(|i| json!({"prompt": prompt(48, 20 + i), "max_tokens": 40, "temperature": 0, "ignore_eos": true}))
        .collect();
    let got = futures::future::join_all(others.iter().map(|b| post(&http, &d.url, b.clone()))).await;
    assert!(d.state.engine.stats().preemptions > 0, "the pool never ran out: {:?}", d.state.engine.stats());
    for (b, (status, v)) in others.iter().zip(&got) {
        assert_eq!(*status, 200, "{v}");
        assert_eq!(ids(v), ids(&post(&http, &colocated.url, b.clone()).await.1), "a preempted request recomputed");
    }
    // Only now does prefill compute the waiting request's KV and write it into decode's blocks.
    let mut prefill_leg = waiting.clone();
    prefill_leg["max_tokens"] = json!(1);
    prefill_leg["kv_transfer_params"] = json!({"do_remote_decode": true, "transfer_id": "wait-1"});
    let (status, v) = post(&http, &p.url, prefill_leg).await;
    assert_eq!(status, 200, "{v}");
    let (status, v) = decode_leg.await.unwrap();
    assert_eq!(status, 200, "{v}");
    assert_eq!(ids(&v), ids(&post(&http, &colocated.url, waiting).await.1), "the waiting request's KV was intact");
    kv_stats_until(&p, "one local link", |s| s.links_local == 1 && s.transfers_ok == 1).await;
    wait_idle(&[&p, &d, &colocated]).await;
    alive(&[&p, &d]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_engine_hands_the_request_to_another_and_with_none_left_the_429_keeps_retry_after() {
    let http = reqwest::Client::new();
    let colocated = engine(None, 16, FaultInjection::default()).await;
    let long = json!({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4000, "ignore_eos": true, "stream": true});
    for (mode, kv_mode) in [(TransferMode::Push, KvMode::Push), (TransferMode::Pull, KvMode::Pull)] {
        let full = Knobs { max_in_flight: 1, num_blocks: Some(1000), ..Knobs::default() };
        let p_full = engine_with(Some((Role::Prefill, kv_mode)), 16, full.clone()).await;
        let p = engine(Some((Role::Prefill, kv_mode)), 16, FaultInjection::default()).await;
        let d_full = engine_with(Some((Role::Decode, kv_mode)), 16, full).await;
        let d = engine(Some((Role::Decode, kv_mode)), 16, FaultInjection::default()).await;
        // Each full engine's one place is taken by a stream of its own (its body unread).
        let mut holds = Vec::new();
        for e in [&p_full, &d_full] {
            let r = http.post(format!("{}/v1/completions", e.url)).json(&long).send().await.unwrap();
            assert_eq!(r.status(), 200, "{}: {}", e.url, r.text().await.unwrap());
            holds.push(r);
        }
        // With no other decode engine, the client gets the engine's 429 and when to retry.
        let lone = router_over(mode, &[&p], &[&d_full]).await;
        let refused = || async {
            let r = http
                .post(format!("{lone}/v1/completions"))
                .json(&json!({"model": "tiny", "prompt": [4, 5, 6], "max_tokens": 2}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 429, "{mode:?}");
            assert_eq!(r.headers()["retry-after"], "1");
            let v: Value = r.json().await.unwrap();
            assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("retry")), "{mode:?}: {v}");
        };
        refused().await;
        let r_url = router_over(mode, &[&p_full, &p], &[&d_full, &d]).await;
        // Round robin sends half the legs to a full engine: each goes to the other one instead.
        for i in 0..8 {
            let body = json!({"model": "tiny", "prompt": prompt(5 + i * 9, i), "max_tokens": 4, "temperature": 0,
                              "ignore_eos": true});
            let (status, v) = post(&http, &r_url, body.clone()).await;
            assert_eq!(status, 200, "{mode:?} request {i}: {v}");
            let (_, want) = post(&http, &colocated.url, body).await;
            assert_eq!(ids(&v), ids(&want), "{mode:?} request {i}");
        }
        refused().await; // the full engines were full throughout
        drop(holds);
        wait_idle(&[&p_full, &p, &d_full, &d]).await;
        alive(&[&p_full, &p, &d_full, &d]);
    }
}

/// `--kv-verify`: KV that arrives corrupted (one bit flipped on the way, or in the blocks a
/// direct writer copied into) is caught by its checksum (tcp) or digest (the local transport,
/// as cuda-ipc), counted, and recomputed to the colocated tokens, in both modes and across
/// block sizes; clean transfers with checksums on land as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_kv_verify_corrupted_kv_is_caught_counted_and_recomputed_to_the_colocated_tokens() {
    let http = reqwest::Client::new();
    let colocated = engine(None, 16, FaultInjection::default()).await;
    let modes = [(TransferMode::Push, KvMode::Push), (TransferMode::Pull, KvMode::Pull)];
    for ((mode, kv_mode), local) in modes.into_iter().flat_map(|m| [(m, false), (m, true)]) {
        for corrupt in [false, true] {
            let verify = Knobs { load_failure: KvLoadFailure::Recompute, local, ..Knobs::default() };
            assert!(verify.verify, "the fault tests run with --kv-verify");
            let faults = FaultInjection { corrupt_sends: corrupt, ..FaultInjection::default() };
            let p = engine_with(Some((Role::Prefill, kv_mode)), 16, Knobs { faults, ..verify.clone() }).await;
            let d = engine_with(Some((Role::Decode, kv_mode)), 8, verify).await;
            let base = router(mode, &p, &d).await;
            for i in 0..4 {
                let body =
                    json!({"prompt": prompt(10 + i * 13, i), "max_tokens": 5, "temperature": 0, "ignore_eos": true});
                let (s1, want) = post(&http, &colocated.url, body.clone()).await;
                let (s2, got) = post(&http, &base, body).await;
                assert_eq!((s1, s2), (200, 200), "{got}");
                assert_eq!(ids(&got), ids(&want), "{mode:?} local={local} corrupt={corrupt} request {i}");
            }
            let case = format!("{mode:?} local={local} corrupt={corrupt}");
            let s = kv_stats_until(&d, "4 transfers ended", |s| s.transfers_ok + s.transfers_failed == 4).await;
            let bad = if corrupt { 4 } else { 0 };
            assert_eq!((s.checksum_failures, s.transfers_failed), (bad, bad), "{case}: {s:?}");
            assert_eq!(s.links_local, u64::from(local), "{case}: {s:?}");
            // Decode's acknowledgement (tcp push) or release (pull) says the KV did not land:
            // prefill counts it failed, not done. (A direct push counts its copies done.)
            let ps = kv_stats_until(&p, "4 transfers ended", |s| s.transfers_ok + s.transfers_failed == 4).await;
            if !(local && mode == TransferMode::Push) {
                assert_eq!((ps.transfers_ok, ps.transfers_failed), (4 - bad, bad), "{case}: {ps:?}");
            }
            wait_idle(&[&p, &d]).await;
            alive(&[&p, &d]);
        }
    }
}
