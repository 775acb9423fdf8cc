//! Streaming through the router, timed: its own test binary, so that the other end-to-end
//! tests' load (cargo runs a binary's tests at once, binaries one after another) does not
//! decide the timing.

mod common;

use common::*;
use std::time::Duration;
use tandem_core::TransferMode;
use tandem_kv::{KvMode, Role};

/// Streamed tokens leave the engine and the router as they come: without TCP_NODELAY each
/// small write after the first waited for the peer's delayed ACK (40 ms on Linux), so a
/// routed 8-token stream took 41-44 ms where it takes a few.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn routed_streams_are_not_held_back_by_delayed_acks() {
    let http = reqwest::Client::new();
    let p = engine_with(Some((Role::Prefill, KvMode::Push)), 16, Knobs::default()).await;
    let d = engine_with(Some((Role::Decode, KvMode::Push)), 16, Knobs::default()).await;
    let url = router_with(TransferMode::Push, &[&p], &[&d], Some(32)).await;
    let mut fastest = Duration::MAX;
    for i in 0..10u32 {
        let body = serde_json::json!({"model": "tiny", "prompt": [i + 1, 2, 3, 4], "max_tokens": 8,
                                      "ignore_eos": true, "stream": true});
        let t0 = std::time::Instant::now();
        let text = http.post(format!("{url}/v1/completions")).json(&body).send().await.unwrap().text().await.unwrap();
        fastest = fastest.min(t0.elapsed());
        assert!(text.contains("[DONE]"), "{text}");
    }
    // The fastest of ten: load on the machine can slow some, never all, of them.
    assert!(fastest < Duration::from_millis(35), "fastest 8-token stream through the router took {fastest:?}");
    wait_idle(&[&p, &d]).await;
}
