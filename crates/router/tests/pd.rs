//! Prefill/decode disaggregation end to end, in one process over real sockets: a prefill
//! server, a decode server (another block size), the router, and a colocated server as the
//! reference. Push and pull must both give the colocated tokens exactly, and every engine's
//! blocks must come back.

mod common;

use common::*;
use std::time::Duration;
use tandem_core::TransferMode;

use serde_json::Value;
use tandem_kv::{FaultInjection, KvMode, Role};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn push_and_pull_equal_colocated_token_for_token() {
    let http = reqwest::Client::new();
    let reqs = workload();
    let colocated = engine(None, 16, FaultInjection::default()).await;
    let want = run_all(&http, &colocated.url, &reqs).await;
    for (i, w) in want.iter().enumerate() {
        assert_eq!(w.len(), reqs[i]["max_tokens"].as_u64().unwrap() as usize);
    }
    // Pipelined, a push prefill engine reports each step's KV as it submits the step (with
    // fences; on the CPU final at once), the last chunk of a prompt too.
    for (mode, kv_mode, local, pipelined) in [
        (TransferMode::Push, KvMode::Push, false, false),
        (TransferMode::Pull, KvMode::Pull, false, false),
        (TransferMode::Push, KvMode::Push, true, false),
        (TransferMode::Pull, KvMode::Pull, true, false),
        (TransferMode::Push, KvMode::Push, true, true),
    ] {
        let k = Knobs { local, pipelined, ..Knobs::default() };
        let p = engine_with(Some((Role::Prefill, kv_mode)), 16, k.clone()).await;
        let d = engine_with(Some((Role::Decode, kv_mode)), 8, k).await;
        let base = router(mode, &p, &d).await;
        let got = run_all(&http, &base, &reqs).await;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g,
                w,
                "{mode:?} local={local} pipelined={pipelined}: request {i} ({} prompt tokens)",
                reqs[i]["prompt"].as_array().unwrap().len()
            );
        }
        wait_idle(&[&p, &d]).await;
        let ds = kv_stats_until(&d, "50 transfers", |s| s.transfers_ok == 50).await;
        let ps =
            kv_stats_until(&p, "50 transfers", |s| s.transfers_ok == 50 && s.bytes_sent == ds.bytes_received).await;
        assert_eq!((ps.transfers_failed, ds.transfers_failed, ps.unknown_ids, ds.unknown_ids), (0, 0, 0, 0));
        assert!(ps.bytes_sent > 0 && ps.bytes_sent == ds.bytes_received);
        // Push sends the KV of prompts longer than the step budget (130 tokens in 96-token
        // steps) as they are computed, over either transport; pull reads it whole.
        match mode {
            TransferMode::Push => assert!(ps.parts_early > 0, "local={local}: {ps:?}"),
            TransferMode::Pull => assert_eq!(ps.parts_early, 0, "local={local}: {ps:?}"),
        }
        // /kv/info says which transport each open connection uses.
        let info: serde_json::Value =
            http.get(format!("{}/kv/info", p.url)).send().await.unwrap().json().await.unwrap();
        let transport = if local { "local" } else { "tcp" };
        let links = info["links"].as_array().unwrap();
        assert!(links.iter().any(|l| l["transport"] == transport && l["peer"] == "decode-8"), "{info}");
    }
    wait_idle(&[&colocated]).await;
}

/// NIXL (the `nixl` feature, the library from PyPI's nixl-cu13 wheel): CPU engines in push
/// and pull, prefill writing decode's host KV with NIXL WRITEs and a notification per transfer
/// (decode READing it in pull, or prefill writing it there too with `--kv-nixl-pull write`),
/// give the colocated tokens, with equal and different block sizes and with a 130-token prompt
/// pushed in parts as it is computed; `--kv-verify` digests agree, nothing fails, every block
/// comes back.
#[cfg(feature = "nixl")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn push_and_pull_over_nixl_equal_colocated_token_for_token() {
    use tandem_kv::NixlPull;
    let http = reqwest::Client::new();
    let reqs = workload();
    let colocated = engine(None, 16, FaultInjection::default()).await;
    let want = run_all(&http, &colocated.url, &reqs).await;
    for (mode, kv_mode, decode_block_size, nixl_pull) in [
        (TransferMode::Push, KvMode::Push, 16, NixlPull::Auto),
        (TransferMode::Pull, KvMode::Pull, 16, NixlPull::Auto),
        (TransferMode::Push, KvMode::Push, 8, NixlPull::Auto),
        (TransferMode::Pull, KvMode::Pull, 8, NixlPull::Auto),
        (TransferMode::Pull, KvMode::Pull, 8, NixlPull::Write),
    ] {
        let k = Knobs { transport: tandem_kv::KvTransport::Nixl, nixl_pull, ..Knobs::default() };
        let p = engine_with(Some((Role::Prefill, kv_mode)), 16, k.clone()).await;
        let d = engine_with(Some((Role::Decode, kv_mode)), decode_block_size, k).await;
        let base = router(mode, &p, &d).await;
        let got = run_all(&http, &base, &reqs).await;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "{mode:?} ({nixl_pull:?}) over nixl into {decode_block_size}-token blocks: request {i}");
        }
        wait_idle(&[&p, &d]).await;
        let ds = kv_stats_until(&d, "50 transfers", |s| s.transfers_ok == 50).await;
        let ps = kv_stats_until(&p, "50 transfers", |s| s.transfers_ok == 50).await;
        assert_eq!((ps.transfers_failed, ds.transfers_failed, ds.checksum_failures), (0, 0, 0), "{ps:?} {ds:?}");
        assert_eq!((ps.links_nixl, ps.links_tcp, ps.links_local), (1, 0, 0), "{ps:?}");
        if mode == TransferMode::Push {
            assert!(ps.parts_early > 0, "{ps:?}");
        }
    }
    wait_idle(&[&colocated]).await;

    // The self-check: a link whose probe write is slower than the floor is refused at
    // handshake, naming the rate, and the request fails clearly, losing no block.
    let slow = Knobs { transport: tandem_kv::KvTransport::Nixl, nixl_min_gb_s: 1e9, ..Knobs::default() };
    let p = engine_with(Some((Role::Prefill, KvMode::Push)), 16, slow.clone()).await;
    let d = engine_with(Some((Role::Decode, KvMode::Push)), 16, slow).await;
    let base = router(TransferMode::Push, &p, &d).await;
    let resp = http.post(format!("{base}/v1/completions")).json(&reqs[5]).send().await.unwrap();
    let (status, text) = (resp.status(), resp.text().await.unwrap());
    assert!(!status.is_success() && text.contains("--kv-nixl-min-gb-s"), "{status} {text}");
    wait_idle(&[&p, &d]).await;
    assert!(p.state.engine.stats().kv.unwrap().peers_refused >= 1);
}

/// Prefill and decode over NIXL (a pull written by prefill, so its decode waits for the
/// notification too), prefill sending no notification for its first `lost` transfers, decode
/// (blocks of `decode_block_size` tokens) recomputing what does not land; and their router.
#[cfg(feature = "nixl")]
async fn nixl_pair_losing_notifications(
    mode: TransferMode,
    kv_mode: KvMode,
    lost: u32,
    decode_block_size: usize,
) -> (Engine, Engine, String) {
    let nixl =
        Knobs { transport: tandem_kv::KvTransport::Nixl, nixl_pull: tandem_kv::NixlPull::Write, ..Knobs::default() };
    let faults = FaultInjection { drop_nixl_notifications: lost, ..FaultInjection::default() };
    let p = engine_with(Some((Role::Prefill, kv_mode)), 16, Knobs { faults, ..nixl.clone() }).await;
    let recompute = Knobs { load_failure: tandem_engine::KvLoadFailure::Recompute, ..nixl };
    let d = engine_with(Some((Role::Decode, kv_mode)), decode_block_size, recompute).await;
    let base = router(mode, &p, &d).await;
    (p, d, base)
}

/// A lost NIXL notification costs the reader one I/O bound (5 s here), then the transfer
/// fails and decode recomputes to the colocated tokens, every block back. In push, and in a
/// pull prefill writes (`--kv-nixl-pull write`), whose decode so waits for the notification
/// and does not read.
#[cfg(feature = "nixl")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lost_nixl_notification_is_bounded_and_recompute_gives_the_same_tokens() {
    let http = reqwest::Client::new();
    let colocated = engine(None, 16, FaultInjection::default()).await;
    let reqs: Vec<Value> = workload().into_iter().filter(|r| r["stream"] == false).take(2).collect();
    let want = run_all(&http, &colocated.url, &reqs).await;
    for (mode, kv_mode) in [(TransferMode::Push, KvMode::Push), (TransferMode::Pull, KvMode::Pull)] {
        let (p, d, base) = nixl_pair_losing_notifications(mode, kv_mode, u32::MAX, 8).await;
        let start = std::time::Instant::now();
        assert_eq!(run_all(&http, &base, &reqs).await, want, "{mode:?}: recompute must give the colocated tokens");
        assert!(start.elapsed() < Duration::from_secs(20), "{mode:?}: each lost notification costs one bounded wait");
        kv_stats_until(&d, "2 failed transfers", |s| s.transfers_failed == 2).await;
        wait_idle(&[&p, &d]).await;
    }
    wait_idle(&[&colocated]).await;
}

/// A NIXL notification lost for one transfer holds up no other transfer on the connection:
/// decode lands each on a thread of its own, so a second request, sent while the first waits
/// out its 5 s bound, is answered long before that bound ends (landed on the connection's
/// reader, it queued behind the first). The first then recomputes to the colocated tokens.
#[cfg(feature = "nixl")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lost_nixl_notification_holds_up_no_other_transfer() {
    let http = reqwest::Client::new();
    let colocated = engine(None, 16, FaultInjection::default()).await;
    let reqs: Vec<Value> = workload().into_iter().filter(|r| r["stream"] == false).skip(2).take(2).collect();
    let want = run_all(&http, &colocated.url, &reqs).await;
    for (mode, kv_mode) in [(TransferMode::Push, KvMode::Push), (TransferMode::Pull, KvMode::Pull)] {
        let (p, d, base) = nixl_pair_losing_notifications(mode, kv_mode, 1, 16).await;
        let (h, b, first) = (http.clone(), base.clone(), reqs[..1].to_vec());
        let lost = tokio::spawn(async move { run_all(&h, &b, &first).await });
        // The first transfer's KV is written by now, its notification lost: decode waits.
        tokio::time::sleep(Duration::from_millis(1000)).await;
        assert!(!lost.is_finished(), "{mode:?}: the first request must still wait for its notification");
        let start = std::time::Instant::now();
        let second = run_all(&http, &base, &reqs[1..]).await;
        let waited = start.elapsed();
        assert_eq!(second[0], want[1], "{mode:?}: the second request");
        assert!(waited < Duration::from_millis(2000), "{mode:?}: the second request took {waited:?}");
        assert_eq!(lost.await.unwrap()[0], want[0], "{mode:?}: recompute must give the colocated tokens");
        let s =
            kv_stats_until(&d, "1 failed and 1 landed transfer", |s| s.transfers_failed == 1 && s.transfers_ok == 1)
                .await;
        assert_eq!((s.transfers_failed, s.transfers_ok), (1, 1), "{mode:?}");
        wait_idle(&[&p, &d]).await;
    }
    wait_idle(&[&colocated]).await;
}

/// Engines that pipeline their steps, as GPU engines do by default (a step queued while the
/// one before still runs, so a prefill leg's KV is handed over while the next step is queued),
/// give the colocated tokens in both modes, over tcp bytes and over direct copies.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pipelined_engines_equal_colocated_token_for_token() {
    let http = reqwest::Client::new();
    let reqs: Vec<_> = workload().into_iter().take(12).collect();
    let colocated = engine(None, 16, FaultInjection::default()).await;
    let want = run_all(&http, &colocated.url, &reqs).await;
    for (mode, kv_mode, local) in [(TransferMode::Push, KvMode::Push, false), (TransferMode::Pull, KvMode::Pull, true)]
    {
        let k = Knobs { local, pipelined: true, ..Knobs::default() };
        let p = engine_with(Some((Role::Prefill, kv_mode)), 16, k.clone()).await;
        let d = engine_with(Some((Role::Decode, kv_mode)), 16, k.clone()).await;
        let base = router(mode, &p, &d).await;
        let got = run_all(&http, &base, &reqs).await;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "{mode:?} local={local}: request {i}");
        }
        wait_idle(&[&p, &d]).await;
        let ds = kv_stats_until(&d, "12 transfers", |s| s.transfers_ok == 12).await;
        assert_eq!(ds.transfers_failed, 0);
    }
    wait_idle(&[&colocated]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn decode_answers_carry_the_transfer_timeline_and_metrics_count_it() {
    let http = reqwest::Client::new();
    let p = engine(Some((Role::Prefill, KvMode::Push)), 16, FaultInjection::default()).await;
    let d = engine(Some((Role::Decode, KvMode::Push)), 16, FaultInjection::default()).await;
    let base = router(TransferMode::Push, &p, &d).await;
    let body = serde_json::json!({"prompt": (0..40).collect::<Vec<u32>>(), "max_tokens": 4, "ignore_eos": true});
    let v: serde_json::Value =
        http.post(format!("{base}/v1/completions")).json(&body).send().await.unwrap().json().await.unwrap();
    let t = &v["kv_timeline"];
    // 40 tokens in 16-token blocks: 3 blocks, whole blocks on the wire. One contiguous
    // region a write: the whole prompt in one, or (decode registered while the step ran) the
    // first two blocks in up to four group writes (4 layers, a group each; the groups computed
    // before decode registered may go together: CI saw three) and the last with the first token.
    let block_bytes = 4 * 2 * 2 * 16 * 32 * 4;
    assert_eq!(t["transfer"]["bytes"], 3 * block_bytes, "{v}");
    let regions = t["transfer"]["regions"].as_u64();
    assert!(matches!(regions, Some(1..=5)), "{v}");
    assert!(t["ready_us"].as_u64().unwrap() >= t["transfer"]["ready_us"].as_u64().unwrap(), "{v}");
    // From prefill handing the KV over to decode applying it, by the engines' clocks (one host).
    let handover = t["produced_to_ready_us"].as_u64().unwrap_or_else(|| panic!("no hand-over time: {v}"));
    assert!(handover < 5_000_000, "{v}");
    let mut sb = body.clone();
    sb["stream"] = serde_json::json!(true);
    // Another prompt: decode caches the first one's leading blocks, which would not travel again.
    sb["prompt"] = serde_json::json!((100..140).collect::<Vec<u32>>());
    let text = http.post(format!("{base}/v1/completions")).json(&sb).send().await.unwrap().text().await.unwrap();
    let chunks: Vec<serde_json::Value> = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(last["kv_timeline"]["transfer"]["bytes"], 3 * block_bytes, "timeline rides on the final chunk: {last}");
    assert!(chunks[..chunks.len() - 1].iter().all(|c| c.get("kv_timeline").is_none()));
    // The engine applies a landed transfer at once: the connector's event wakes its loop (no
    // poll, no wait for a timeout). From the connector's `Ready` to the engine applying it,
    // the faster of the two requests (tolerating one scheduling hiccup on a busy machine).
    let lag = |t: &serde_json::Value| {
        let u = |v: &serde_json::Value| v.as_u64().unwrap();
        u(&t["ready_us"]).saturating_sub(u(&t["queued_us"]) + u(&t["transfer"]["ready_us"]))
    };
    let lag_us = lag(t).min(lag(&last["kv_timeline"]));
    assert!(lag_us < 50_000, "a landed transfer waited {lag_us} us for the engine: {t}");
    let m = http.get(format!("{}/metrics", d.url)).send().await.unwrap().text().await.unwrap();
    assert!(m.contains("tandem:kv_load_wait_seconds_count 2"), "{m}");
    assert!(m.contains(&format!("tandem:kv_load_bytes_total {}", 6 * block_bytes)), "{m}");
    wait_idle(&[&p, &d]).await;
}

/// A CPU prefill engine pushing over tcp sends a prompt computed in one step group of layers
/// by group while the step still runs (the forward sets each layer group's fence as it passes
/// it; the engine reports the step to the connector before running it): early parts and
/// landed groups where before a one-step prompt went only once computed, and the answers
/// equal colocated's, with and without pipelined steps.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cpu_prefill_engine_pushes_a_one_step_prompt_group_of_layers_by_group() {
    let http = reqwest::Client::new();
    let reqs: Vec<_> = (0..6)
        .map(|i| {
            let prompt: Vec<u32> = (0..600).map(|j| ((i * 31 + j * 7) % 500) as u32).collect();
            serde_json::json!({"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0,
                               "ignore_eos": true})
        })
        .collect();
    let colocated = engine(None, 16, FaultInjection::default()).await;
    let want = run_all(&http, &colocated.url, &reqs).await;
    for pipelined in [false, true] {
        // Every prompt in one step; one request at a time, so decode has registered before the
        // step runs.
        let k = Knobs { budget: 2048, pipelined, ..Knobs::default() };
        let p = engine_with(Some((Role::Prefill, KvMode::Push)), 16, k.clone()).await;
        let d = engine_with(Some((Role::Decode, KvMode::Push)), 16, k).await;
        let base = router(TransferMode::Push, &p, &d).await;
        for (i, (r, w)) in reqs.iter().zip(&want).enumerate() {
            let got = run_all(&http, &base, std::slice::from_ref(r)).await;
            assert_eq!(&got[0], w, "pipelined={pipelined}: request {i}");
        }
        wait_idle(&[&p, &d]).await;
        let ps = kv_stats_until(&p, "6 transfers", |s| s.transfers_ok == 6).await;
        let ds = kv_stats_until(&d, "6 transfers", |s| s.transfers_ok == 6).await;
        assert!(ps.parts_early > 0, "pipelined={pipelined}: nothing went while the step ran: {ps:?}");
        assert!(ds.groups_landed >= 4, "pipelined={pipelined}: no group of layers landed on its own: {ds:?}");
    }
    wait_idle(&[&colocated]).await;
}

/// A prefill engine short of KV blocks preempts prompts part-way through their chunks, after
/// some of their KV was already pushed into decode's blocks (a direct writer pushes each
/// finished chunk): the recomputed prompt's KV is written again from its first token, so the
/// answers still equal colocated's, with and without pipelined steps, and every block comes
/// back on both engines.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prompts_preempted_after_early_pushes_still_equal_colocated() {
    let http = reqwest::Client::new();
    let reqs: Vec<_> = (0..12)
        .map(|i| {
            let prompt: Vec<u32> = (0..130).map(|j| ((i * 53 + j * 7) % 500) as u32).collect();
            serde_json::json!({"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0,
                               "ignore_eos": true})
        })
        .collect();
    let colocated = engine(None, 16, FaultInjection::default()).await;
    let want = run_all(&http, &colocated.url, &reqs).await;
    for pipelined in [false, true] {
        // 14 blocks of 16 tokens and 64-token steps: a 130-token prompt (9 blocks) ends in a
        // step that starts the next one (4 blocks); each write out of prefill's blocks takes
        // 50 ms (a slow copy engine), so the finished prompt still holds its blocks when the
        // next one needs 4 more, and that one is preempted midway.
        let slow = FaultInjection { slow_write: Duration::from_millis(50), ..FaultInjection::default() };
        let short =
            Knobs { local: true, pipelined, budget: 64, num_blocks: Some(14), faults: slow, ..Knobs::default() };
        let p = engine_with(Some((Role::Prefill, KvMode::Push)), 16, short).await;
        let d = engine_with(Some((Role::Decode, KvMode::Push)), 8, Knobs { local: true, ..Knobs::default() }).await;
        let base = router(TransferMode::Push, &p, &d).await;
        let got = run_all(&http, &base, &reqs).await;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "pipelined={pipelined}: request {i}");
        }
        wait_idle(&[&p, &d]).await;
        let ps = kv_stats_until(&p, "12 transfers", |s| s.transfers_ok == 12).await;
        let preemptions = p.state.engine.stats().preemptions;
        assert!(ps.parts_early > 0, "pipelined={pipelined}: {ps:?}");
        assert!(preemptions > 0, "pipelined={pipelined}: no prompt was preempted: {ps:?}");
    }
    wait_idle(&[&colocated]).await;
}

/// A burst over a direct writer (push, local transport, pipelined prefill reporting each step's
/// KV as it submits it) with what reuses blocks at once: a third of the clients give up
/// mid-request (their legs abort while early parts may be queued), prefill's pool is small
/// enough to preempt prompts midway (after some of their parts were written), and prompts
/// repeat across requests. Every answer that comes back equals colocated's, and every block
/// comes back on both engines.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_burst_with_cancellations_and_preemption_over_a_direct_writer_equals_colocated() {
    burst_over_a_direct_writer(2000).await;
}

/// The same burst with decode's pool small too (120 blocks of 8 tokens for up to 32 requests
/// of up to 300 tokens): decode holds registrations waiting for prefill while prefill's pool
/// could fill with KV produced for requests decode has no blocks to register yet. Nobody may
/// wait for the other: every client that waits gets its answer, well inside the transfer
/// timeout (20 s), with no transfer failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_burst_over_a_direct_writer_with_both_pools_small_does_not_wedge() {
    let started = std::time::Instant::now();
    burst_over_a_direct_writer(120).await;
    assert!(started.elapsed() < Duration::from_secs(20), "the burst took {:?}", started.elapsed());
}

async fn burst_over_a_direct_writer(decode_blocks: usize) {
    let http = reqwest::Client::new();
    let prompts: Vec<Value> = (0..24)
        .map(|i| {
            let len = 20 + (i * 37) % 280;
            let prompt: Vec<u32> = (0..len).map(|j| ((i * 71 + j * 13) % 500) as u32).collect();
            serde_json::json!({"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0,
                               "ignore_eos": true})
        })
        .collect();
    let colocated = engine(None, 16, FaultInjection::default()).await;
    let want = run_all(&http, &colocated.url, &prompts).await;
    let small = |blocks| Knobs {
        local: true,
        pipelined: true,
        budget: 64,
        num_blocks: Some(blocks),
        transfer_timeout: Duration::from_secs(20),
        load_failure: tandem_engine::KvLoadFailure::Recompute,
        ..Knobs::default()
    };
    // Each write out of prefill's blocks takes 20 ms, so finished prompts hold blocks while
    // the next ones need more: those are preempted midway.
    let slow = FaultInjection { slow_write: Duration::from_millis(20), ..FaultInjection::default() };
    let p = engine_with(Some((Role::Prefill, KvMode::Push)), 16, Knobs { faults: slow, ..small(24) }).await;
    let d = engine_with(Some((Role::Decode, KvMode::Push)), 8, small(decode_blocks)).await;
    let base = router(TransferMode::Push, &p, &d).await;
    let tasks: Vec<_> = (0..96)
        .map(|n| {
            let (http, url) = (http.clone(), format!("{base}/v1/completions"));
            let i = (n * 7) % prompts.len();
            let body = prompts[i].clone();
            // Every third client gives up after 0-90 ms.
            let give_up = (n % 3 == 0).then(|| Duration::from_millis((n as u64 * 13) % 90));
            tokio::spawn(async move {
                let req = async {
                    let resp = http.post(url).json(&body).send().await.map_err(|e| e.to_string())?;
                    let v: Value = resp.json().await.map_err(|e| e.to_string())?;
                    let ids = v["choices"][0]["token_ids"].as_array().ok_or_else(|| v.to_string())?;
                    Ok::<Vec<u64>, String>(ids.iter().filter_map(Value::as_u64).collect())
                };
                let got = match give_up {
                    Some(after) => tokio::time::timeout(after, req).await.unwrap_or_else(|_| Err("gave up".into())),
                    None => req.await,
                };
                (i, give_up.is_some(), got)
            })
        })
        .collect();
    let mut answered = 0;
    for t in tasks {
        let (i, gave_up, got) = t.await.unwrap();
        match got {
            Ok(ids) => {
                assert_eq!(ids, want[i], "prompt {i} ({} tokens)", prompts[i]["prompt"].as_array().unwrap().len());
                answered += 1;
            }
            Err(e) => assert!(gave_up, "prompt {i}: a client that waited got no answer: {e}"),
        }
    }
    assert!(answered >= 64, "only {answered} answers");
    wait_idle(&[&p, &d]).await;
    let preemptions = p.state.engine.stats().preemptions + d.state.engine.stats().preemptions;
    let ps = kv_stats_until(&p, "idle", |_| true).await;
    assert!(ps.parts_early > 0, "no early part was written: {ps:?}");
    assert!(preemptions > 0, "nothing was preempted");
    eprintln!("{answered} answers, {preemptions} preemptions, {} early parts", ps.parts_early);
    wait_idle(&[&colocated]).await;
}

/// Sampled requests with seeds and requests for log-probabilities (greedy and sampled) give
/// through push and pull what the colocated engine gives: the same tokens (a decode leg takes
/// the draw prefill made for the first token, or samples that token itself when the request
/// wants its distribution) and the same log-probabilities, and every block comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn seeded_sampling_and_logprobs_through_push_and_pull_equal_colocated() {
    let http = reqwest::Client::new();
    let reqs: Vec<Value> = (0..16)
        .map(|i| {
            let len = [1, 5, 17, 40][i % 4];
            let prompt: Vec<u32> = (0..len).map(|j| ((i * 53 + j * 7) % 500) as u32).collect();
            let mut b = serde_json::json!({"model": "tiny", "prompt": prompt, "max_tokens": 4 + i % 5,
                                           "ignore_eos": true, "temperature": 0.9, "seed": 100 + i});
            if i % 2 == 0 {
                b["logprobs"] = serde_json::json!(3);
            }
            if i % 4 == 0 {
                b["temperature"] = serde_json::json!(0);
            }
            b
        })
        .collect();
    let answers = |base: String| {
        let (http, reqs) = (http.clone(), reqs.clone());
        async move {
            let mut out = Vec::new();
            for b in &reqs {
                let v: Value =
                    http.post(format!("{base}/v1/completions")).json(b).send().await.unwrap().json().await.unwrap();
                assert!(v.get("error").is_none(), "{v}");
                out.push((v["choices"][0]["token_ids"].clone(), v["choices"][0]["logprobs"].clone()));
            }
            out
        }
    };
    let colocated = engine(None, 16, FaultInjection::default()).await;
    let want = answers(colocated.url.clone()).await;
    assert!(want.iter().step_by(2).all(|(_, lp)| lp["token_logprobs"].as_array().is_some_and(|a| !a.is_empty())));
    for (mode, kv_mode) in [(TransferMode::Push, KvMode::Push), (TransferMode::Pull, KvMode::Pull)] {
        let p = engine(Some((Role::Prefill, kv_mode)), 16, FaultInjection::default()).await;
        let d = engine(Some((Role::Decode, kv_mode)), 8, FaultInjection::default()).await;
        let got = answers(router(mode, &p, &d).await).await;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "{mode:?}: request {i}: {}", reqs[i]);
        }
        wait_idle(&[&p, &d]).await;
    }
    wait_idle(&[&colocated]).await;
}

/// Prefix caching through P/D: prompts that begin as an earlier one did take the prefill
/// engine's cached blocks for their whole leading blocks and compute only the rest, and the
/// KV decode gets (cached blocks and computed ones together) gives the tokens of a colocated
/// engine that caches nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prompts_sharing_a_prefix_take_prefills_cached_blocks_and_equal_colocated() {
    let http = reqwest::Client::new();
    let base: Vec<u32> = (0..100).map(|j| (j * 13 % 500) as u32).collect();
    let body = |tail: Vec<u32>, max_tokens: usize| {
        let prompt: Vec<u32> = base.iter().copied().chain(tail).collect();
        serde_json::json!({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                           "ignore_eos": true, "stream": max_tokens.is_multiple_of(2)})
    };
    let first = [body(Vec::new(), 6)];
    let rest: Vec<Value> =
        (0..6u32).map(|i| body((0..i * 5).map(|j| (j * 7 + i) % 500).collect(), 4 + i as usize)).collect();
    let colocated = engine_with(None, 16, Knobs { prefix_caching: false, ..Knobs::default() }).await;
    let want_first = run_all(&http, &colocated.url, &first).await;
    let want_rest = run_all(&http, &colocated.url, &rest).await;
    for (mode, kv_mode, local) in [
        (TransferMode::Push, KvMode::Push, false),
        (TransferMode::Pull, KvMode::Pull, false),
        (TransferMode::Push, KvMode::Push, true),
        (TransferMode::Pull, KvMode::Pull, true),
    ] {
        let k = Knobs { local, ..Knobs::default() };
        let p = engine_with(Some((Role::Prefill, kv_mode)), 16, k.clone()).await;
        let d = engine_with(Some((Role::Decode, kv_mode)), 8, k).await;
        let url = router(mode, &p, &d).await;
        assert_eq!(run_all(&http, &url, &first).await, want_first, "{mode:?} local={local}");
        assert_eq!(run_all(&http, &url, &rest).await, want_rest, "{mode:?} local={local}");
        wait_idle(&[&p, &d]).await;
        // Each of the six takes the first prompt's 6 whole blocks (96 tokens) at least.
        let stats = p.state.engine.stats();
        assert!(stats.prefix_hit_tokens >= 6 * 96, "{mode:?} local={local}: {stats:?}");
        assert!(stats.cached_blocks >= 6, "{stats:?}");
        let ds = kv_stats_until(&d, "7 transfers", |s| s.transfers_ok == 7).await;
        assert_eq!(ds.transfers_failed, 0);
    }
    wait_idle(&[&colocated]).await;
}

/// Delta-only transfer: a decode engine that holds a prompt's leading blocks from an earlier
/// request (its prefix cache) has prefill send only the rest. At every hit offset (none, part
/// of a block, an exact block boundary, all but the last block, the whole prompt again), for
/// equal and differing block sizes, push and pull, tcp and direct copies, with `--kv-verify`:
/// the answers equal an uncached colocated engine's (no prefix KV lands in another slot), the
/// bytes fall with the hit, and every block comes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn decode_with_a_cached_prefix_receives_only_the_rest_at_every_hit_offset() {
    let http = reqwest::Client::new();
    let base: Vec<u32> = (0..100).map(|j| (j * 29 % 500 + 1) as u32).collect();
    // (shared with `base`, own tokens after it)
    let shapes = [(0, 60), (5, 60), (16, 60), (96, 40), (100, 0)];
    let body = |shared: usize, own: usize, salt: u32| {
        let prompt: Vec<u32> =
            base[..shared].iter().copied().chain((0..own as u32).map(|j| (j * 17 + salt) % 500 + 3)).collect();
        serde_json::json!({"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0,
                           "ignore_eos": true, "stream": false})
    };
    let first = [body(100, 0, 0)];
    let rest: Vec<Value> = shapes.iter().enumerate().map(|(i, &(s, o))| body(s, o, 100 + i as u32)).collect();
    let colocated = engine_with(None, 16, Knobs { prefix_caching: false, ..Knobs::default() }).await;
    let want_first = run_all(&http, &colocated.url, &first).await;
    let mut want = Vec::new();
    for r in &rest {
        want.push(run_all(&http, &colocated.url, std::slice::from_ref(r)).await.remove(0));
    }
    let mut settings = vec![
        (TransferMode::Push, KvMode::Push, "tcp", (16, 8)),
        (TransferMode::Pull, KvMode::Pull, "tcp", (8, 16)),
        (TransferMode::Push, KvMode::Push, "local", (8, 16)),
        (TransferMode::Pull, KvMode::Pull, "local", (16, 16)),
    ];
    if cfg!(feature = "nixl") {
        // Push writes the rest into decode's blocks; pull has decode READ it, cutting
        // prefill's lease blocks at the skip as prefill does.
        settings.push((TransferMode::Push, KvMode::Push, "nixl", (16, 8)));
        settings.push((TransferMode::Pull, KvMode::Pull, "nixl", (8, 16)));
    }
    for (mode, kv_mode, transport, (pbs, dbs)) in settings {
        let what = format!("{mode:?} over {transport}, blocks {pbs}/{dbs}");
        let k = Knobs {
            local: transport == "local",
            transport: if transport == "nixl" { tandem_kv::KvTransport::Nixl } else { tandem_kv::KvTransport::Auto },
            ..Knobs::default()
        };
        let p = engine_with(Some((Role::Prefill, kv_mode)), pbs, k.clone()).await;
        let d = engine_with(Some((Role::Decode, kv_mode)), dbs, k).await;
        let url = router(mode, &p, &d).await;
        assert_eq!(run_all(&http, &url, &first).await, want_first, "{what}");
        wait_idle(&[&p, &d]).await;
        let full = kv_stats_until(&d, "1 transfer", |s| s.transfers_ok == 1).await.bytes_received;
        let mut received = Vec::new();
        for (i, r) in rest.iter().enumerate() {
            let got = run_all(&http, &url, std::slice::from_ref(r)).await.remove(0);
            assert_eq!(got, want[i], "{what}: shape {:?}", shapes[i]);
            wait_idle(&[&p, &d]).await;
            let s = kv_stats_until(&d, "the transfer", |s| s.transfers_ok == 2 + i as u64).await;
            received.push(s.bytes_received);
        }
        let bytes: Vec<u64> = std::iter::once(full)
            .chain(received.iter().copied())
            .collect::<Vec<_>>()
            .windows(2)
            .map(|w| w[1] - w[0])
            .collect();
        let ds = kv_stats_until(&d, "no failures", |s| s.transfers_failed == 0 && s.checksum_failures == 0).await;
        assert_eq!(ds.transfers_ok, 1 + rest.len() as u64, "{what}: {ds:?}");
        // The whole prompt again: its 96 leading tokens stay at decode, 4 of 100 travel.
        assert!(bytes[4] * 100 <= full * 15, "{what}: {bytes:?} of {full} bytes for the whole prompt");
        // No hit, or one inside the first block: everything travels; more shared, fewer bytes.
        assert!(bytes[0] > bytes[3] && bytes[1] > bytes[3], "{what}: {bytes:?}");
        assert!(d.state.engine.stats().prefix_hit_tokens >= 96 + 96, "{what}: {:?}", d.state.engine.stats());
    }
    wait_idle(&[&colocated]).await;
}

/// Conditional disaggregation: with `local_prefill_max_tokens`, a prompt decode would compute
/// little of (short, or a long one whose prefix decode's cache holds) runs on decode alone,
/// with no transfer; a long uncached one is disaggregated; `kv_transfer_params.disaggregate`
/// overrides either way. Every answer equals an uncached colocated engine's.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn short_uncached_prompts_run_on_decode_alone_and_long_ones_are_disaggregated() {
    let http = reqwest::Client::new();
    let long: Vec<u32> = (0..100).map(|j| (j * 31 % 500 + 2) as u32).collect();
    let body = |prompt: Vec<u32>, disaggregate: Option<bool>| {
        let mut b = serde_json::json!({"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0,
                                       "ignore_eos": true, "stream": false});
        if let Some(d) = disaggregate {
            b["kv_transfer_params"] = serde_json::json!({"disaggregate": d});
        }
        b
    };
    let short: Vec<u32> = (0..20).map(|j| j * 3 + 1).collect();
    let mut follow_up = long.clone();
    follow_up.extend([7, 8, 9, 10, 11, 12, 13, 14, 15, 16]);
    let other_long: Vec<u32> = (0..100).map(|j| (j * 7 % 500 + 5) as u32).collect();
    // (request, whether it should cause a transfer)
    let steps = [
        (body(short.clone(), None), false),
        (body(long.clone(), None), true),
        (body(follow_up.clone(), None), false), // 96 of its 110 tokens are cached at decode
        (body(short.clone(), Some(true)), true),
        (body(other_long.clone(), Some(false)), false),
    ];
    let colocated = engine_with(None, 16, Knobs { prefix_caching: false, ..Knobs::default() }).await;
    for (mode, kv_mode) in [(TransferMode::Push, KvMode::Push), (TransferMode::Pull, KvMode::Pull)] {
        let p = engine_with(Some((Role::Prefill, kv_mode)), 16, Knobs::default()).await;
        let d = engine_with(Some((Role::Decode, kv_mode)), 16, Knobs::default()).await;
        let url = router_with(mode, &[&p], &[&d], Some(32)).await;
        let mut transfers = 0;
        for (i, (b, transfer)) in steps.iter().enumerate() {
            let mut plain = b.clone();
            plain.as_object_mut().unwrap().remove("kv_transfer_params");
            let want = run_all(&http, &colocated.url, &[plain]).await;
            assert_eq!(run_all(&http, &url, std::slice::from_ref(b)).await, want, "{mode:?} step {i}");
            wait_idle(&[&p, &d]).await;
            transfers += u64::from(*transfer);
            let ds = d.state.engine.stats().kv.unwrap();
            assert_eq!(ds.transfers_ok, transfers, "{mode:?} step {i}: {ds:?}");
        }
        // The follow-up computed only its uncached tail on decode.
        assert!(d.state.engine.stats().prefix_hit_tokens >= 96, "{:?}", d.state.engine.stats());
        let bad = body(short.clone(), None);
        let mut bad = bad.as_object().unwrap().clone();
        bad.insert("kv_transfer_params".into(), serde_json::json!({"disaggregate": "yes"}));
        let r = http.post(format!("{url}/v1/completions")).json(&bad).send().await.unwrap();
        assert_eq!(r.status(), 400);
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["param"], "kv_transfer_params", "{v}");
    }
    wait_idle(&[&colocated]).await;
}

/// KV-aware routing over two prefill and two decode engines: prompts that begin as an earlier
/// one go to the prefill engine whose prefix cache holds that beginning, and to the decode
/// engine that holds it (which then receives only the rest); round-robin would send half of
/// them elsewhere, to compute or receive them whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prompts_go_to_the_prefill_engine_that_holds_their_prefix() {
    let http = reqwest::Client::new();
    let base: Vec<u32> = (0..100).map(|j| (j * 11 % 500 + 4) as u32).collect();
    let body = |tail: u32| {
        let prompt: Vec<u32> = base.iter().copied().chain((0..tail).map(|j| j * 13 % 500 + 6)).collect();
        serde_json::json!({"model": "tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": true})
    };
    let p1 = engine_with(Some((Role::Prefill, KvMode::Push)), 16, Knobs::default()).await;
    let p2 = engine_with(Some((Role::Prefill, KvMode::Push)), 16, Knobs::default()).await;
    let d1 = engine_with(Some((Role::Decode, KvMode::Push)), 16, Knobs::default()).await;
    let d2 = engine_with(Some((Role::Decode, KvMode::Push)), 16, Knobs::default()).await;
    let url = router_over(TransferMode::Push, &[&p1, &p2], &[&d1, &d2]).await;
    let all = [&p1, &p2, &d1, &d2];
    run_all(&http, &url, &[body(0)]).await;
    wait_idle(&all).await;
    for tail in 1..=6 {
        run_all(&http, &url, &[body(tail * 4)]).await;
        wait_idle(&all).await;
    }
    let hits = |es: [&Engine; 2]| -> Vec<u64> { es.iter().map(|e| e.state.engine.stats().prefix_hit_tokens).collect() };
    let (p_hits, d_hits) = (hits([&p1, &p2]), hits([&d1, &d2]));
    assert!(p_hits.iter().any(|&h| h >= 6 * 96) && p_hits.contains(&0), "prefill hits {p_hits:?}");
    assert!(d_hits.iter().any(|&h| h >= 6 * 96) && d_hits.contains(&0), "decode hits {d_hits:?}");
}

/// Engines join and leave a running router (`/admin/engines`): an added prefill engine takes
/// requests, a removed one takes no more, the last engine of a role cannot be removed, and an
/// engine that cannot serve the role it is added as is refused with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn engines_join_and_leave_a_running_router() {
    let http = reqwest::Client::new();
    let p1 = engine(Some((Role::Prefill, KvMode::Push)), 16, FaultInjection::default()).await;
    let p2 = engine(Some((Role::Prefill, KvMode::Push)), 16, FaultInjection::default()).await;
    let d = engine(Some((Role::Decode, KvMode::Push)), 16, FaultInjection::default()).await;
    let pull = engine(Some((Role::Prefill, KvMode::Pull)), 16, FaultInjection::default()).await;
    let url = router(TransferMode::Push, &p1, &d).await;
    let reqs: Vec<Value> = workload().into_iter().take(8).collect();
    let steps = |e: &Engine| e.state.engine.stats().steps;
    let admin = |method: reqwest::Method, body: Value| {
        let req = http.request(method, format!("{url}/admin/engines")).json(&body);
        async move {
            let r = req.send().await.unwrap();
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap())
        }
    };
    run_all(&http, &url, &reqs).await;
    assert_eq!(steps(&p2), 0);
    let (status, v) = admin(reqwest::Method::POST, serde_json::json!({"role": "prefill", "url": p2.url})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["prefill"].as_array().unwrap().len(), 2, "{v}");
    run_all(&http, &url, &reqs).await;
    assert!(steps(&p2) > 0, "the added engine took requests");
    let (status, _) = admin(reqwest::Method::DELETE, serde_json::json!({"url": p1.url})).await;
    assert_eq!(status, 200);
    wait_idle(&[&p1, &p2, &d]).await;
    let before = steps(&p1);
    run_all(&http, &url, &reqs).await;
    assert_eq!(steps(&p1), before, "a removed engine takes no more requests");
    let (status, v) = admin(reqwest::Method::DELETE, serde_json::json!({"url": p2.url})).await;
    assert_eq!(status, 409, "{v}");
    let (status, v) = admin(reqwest::Method::POST, serde_json::json!({"role": "prefill", "url": pull.url})).await;
    assert_eq!(status, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("pull"), "{v}");
    let (status, _) = admin(reqwest::Method::DELETE, serde_json::json!({"url": "http://127.0.0.1:1"})).await;
    assert_eq!(status, 404);
    // An engine at an https:// URL, and this router has no CA to check its certificate with.
    let (status, v) =
        admin(reqwest::Method::POST, serde_json::json!({"role": "decode", "url": "https://127.0.0.1:1"})).await;
    assert_eq!(status, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("--tls-ca"), "{v}");
    wait_idle(&[&p1, &p2, &d]).await;
}

/// A router reaches an https:// engine only trusting a CA (`--tls-ca`): without one, or with
/// a file holding no certificate, it refuses to start and says why.
#[test]
fn an_https_engine_needs_a_ca_to_check_it_by() {
    let cfg = |ca: Option<&[u8]>| tandem_router::RouterConfig {
        engine_ca: ca.map(<[u8]>::to_vec),
        ..tandem_router::RouterConfig::new(TransferMode::Push, vec!["https://p:1".into()], vec!["http://d:1".into()])
    };
    let refused = |ca| tandem_router::Router::new(cfg(ca)).err().expect("the router started").to_string();
    assert!(refused(None).contains("https://p:1") && refused(None).contains("--tls-ca"), "{}", refused(None));
    assert!(refused(Some(b"no certificate here")).contains("--tls-ca"), "{}", refused(Some(b"no pem")));
}

/// API keys through P/D: engines and router take the same `--api-key`, and the router sends it
/// on every request of its own (checks, both legs, releases). A client with the key gets the
/// colocated answers; one without it, or with another, gets a 401 from the router (counted)
/// and reaches no engine; an engine asked directly without the key refuses too.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_api_keys_a_keyed_client_gets_colocated_answers_and_others_get_401() {
    const KEY: &str = "sk-deployment-key";
    let keyed = |key: &str| {
        let mut h = reqwest::header::HeaderMap::new();
        h.insert(reqwest::header::AUTHORIZATION, format!("Bearer {key}").parse().unwrap());
        reqwest::Client::builder().default_headers(h).build().unwrap()
    };
    let reqs: Vec<Value> = workload().into_iter().take(9).collect();
    let colocated = engine(None, 16, FaultInjection::default()).await;
    let want = run_all(&reqwest::Client::new(), &colocated.url, &reqs).await;
    let k = Knobs { api_key: Some(KEY), ..Knobs::default() };
    let p = engine_with(Some((Role::Prefill, KvMode::Push)), 16, k.clone()).await;
    let d = engine_with(Some((Role::Decode, KvMode::Push)), 8, k).await;
    let cfg = tandem_router::RouterConfig {
        api_keys: tandem_core::ApiKeys::new([KEY]).unwrap(),
        engine_api_key: Some(KEY.into()),
        ..tandem_router::RouterConfig::new(TransferMode::Push, vec![p.url.clone()], vec![d.url.clone()])
    };
    let (base, router) = serve_router(cfg).await;
    assert_eq!(run_all(&keyed(KEY), &base, &reqs).await, want);
    let body = serde_json::json!({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 2});
    for client in [reqwest::Client::new(), keyed("sk-other")] {
        let r = client.post(format!("{base}/v1/completions")).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 401);
        let err: Value = r.json().await.unwrap();
        assert_eq!(err["error"]["type"], "AuthenticationError", "{err}");
    }
    assert_eq!(router.refused_unauthorized(), 2);
    let direct = reqwest::Client::new().post(format!("{}/v1/completions", p.url)).json(&body).send().await.unwrap();
    assert_eq!(direct.status(), 401, "an engine with --api-key refuses a request without it");
    wait_idle(&[&p, &d]).await;
    let ps = kv_stats_until(&p, "9 transfers", |s| s.transfers_ok == 9).await;
    assert_eq!(ps.transfers_failed, 0, "{ps:?}");
}

/// A deployment with a cluster secret: engines and router share it, so push and pull answer as
/// colocated does; an engine of another secret is refused by the router (it cannot read its
/// /kv/info) and its KV never pairs; /kv/* and /admin/engines without the token (or the admin
/// key) are refused, counted, and change nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_a_cluster_secret_pd_equals_colocated_and_strangers_reach_no_kv_or_admin_endpoint() {
    const SECRET: &str = "this deployment's cluster secret";
    let secret = || Some(tandem_core::ClusterSecret::new(SECRET.as_bytes()).unwrap());
    let reqs: Vec<Value> = workload().into_iter().take(9).collect();
    let colocated = engine(None, 16, FaultInjection::default()).await;
    let want = run_all(&reqwest::Client::new(), &colocated.url, &reqs).await;
    for (mode, kv) in [(TransferMode::Push, KvMode::Push), (TransferMode::Pull, KvMode::Pull)] {
        let k = Knobs { cluster_secret: Some(SECRET), ..Knobs::default() };
        let p = engine_with(Some((Role::Prefill, kv)), 16, k.clone()).await;
        let d = engine_with(Some((Role::Decode, kv)), 8, k).await;
        let cfg = tandem_router::RouterConfig {
            cluster_secret: secret(),
            admin_keys: tandem_core::ApiKeys::new(["sk-admin"]).unwrap(),
            ..tandem_router::RouterConfig::new(mode, vec![p.url.clone()], vec![d.url.clone()])
        };
        let (base, router) = serve_router(cfg).await;
        assert_eq!(run_all(&reqwest::Client::new(), &base, &reqs).await, want, "{mode:?}");
        // Strangers: an engine's KV endpoints and the router's admin endpoints.
        let http = reqwest::Client::new();
        let release = serde_json::json!({"transfer_id": "t-0"});
        let r = http.post(format!("{}/kv/release", p.url)).json(&release).send().await.unwrap();
        assert_eq!(r.status(), 401);
        assert_eq!(http.get(format!("{}/kv/info", d.url)).send().await.unwrap().status(), 401);
        let wrong = http.get(format!("{}/kv/info", d.url)).header(tandem_core::CLUSTER_TOKEN_HEADER, "00").send().await;
        assert_eq!(wrong.unwrap().status(), 401);
        let token = secret().unwrap().http_token();
        let ok = http.get(format!("{}/kv/info", d.url)).header(tandem_core::CLUSTER_TOKEN_HEADER, &token).send().await;
        assert_eq!(ok.unwrap().status(), 200, "the deployment's own token opens it");
        let add = serde_json::json!({"role": "decode", "url": colocated.url});
        let r = http.post(format!("{base}/admin/engines")).json(&add).send().await.unwrap();
        assert_eq!(r.status(), 401, "a stranger adds no engine");
        let listed = http.get(format!("{base}/admin/engines")).bearer_auth("sk-admin").send().await.unwrap();
        assert_eq!(listed.status(), 200);
        let listed: Value = listed.json().await.unwrap();
        assert_eq!(listed["decode"].as_array().map(Vec::len), Some(1), "{listed}");
        assert_eq!(router.refused_unauthorized(), 1);
        wait_idle(&[&p, &d]).await;
        let ps = kv_stats_until(&p, "9 transfers", |s| s.transfers_ok == 9).await;
        assert_eq!((ps.transfers_failed, ps.auth_refused), (0, 0), "{ps:?}");
        // An engine of another deployment: the router cannot read its /kv/info, and its side
        // channel and this prefill engine's refuse each other.
        let other = Knobs { cluster_secret: Some("another deployment's secret"), ..Knobs::default() };
        let stranger = engine_with(Some((Role::Decode, kv)), 8, other).await;
        let r = http
            .post(format!("{base}/admin/engines"))
            .bearer_auth("sk-admin")
            .json(&serde_json::json!({"role": "decode", "url": stranger.url}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400);
        let why: Value = r.json().await.unwrap();
        assert!(why["error"]["message"].as_str().unwrap().contains("another --cluster-secret-file"), "{why}");
        assert_eq!(run_all(&reqwest::Client::new(), &base, &reqs[..3]).await, want[..3], "{mode:?}");
    }
}
