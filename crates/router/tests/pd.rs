//! Prefill/decode disaggregation end to end, in one process over real sockets: a prefill
//! server, a decode server (another block size), the router, and a colocated server as the
//! reference. Push and pull must both give the colocated tokens exactly, and every engine's
//! blocks must come back.

mod common;

use common::*;
use tandem_core::TransferMode;
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
    for (mode, kv_mode) in [(TransferMode::Push, KvMode::Push), (TransferMode::Pull, KvMode::Pull)] {
        let p = engine(Some((Role::Prefill, kv_mode)), 16, FaultInjection::default()).await;
        let d = engine(Some((Role::Decode, kv_mode)), 8, FaultInjection::default()).await;
        let base = router(mode, &p, &d).await;
        let got = run_all(&http, &base, &reqs).await;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "{mode:?}: request {i} ({} prompt tokens)", reqs[i]["prompt"].as_array().unwrap().len());
        }
        wait_idle(&[&p, &d]).await;
        let ds = kv_stats_until(&d, "50 transfers", |s| s.transfers_ok == 50).await;
        let ps =
            kv_stats_until(&p, "50 transfers", |s| s.transfers_ok == 50 && s.bytes_sent == ds.bytes_received).await;
        assert_eq!((ps.transfers_failed, ds.transfers_failed, ps.unknown_ids, ds.unknown_ids), (0, 0, 0, 0));
        assert!(ps.bytes_sent > 0 && ps.bytes_sent == ds.bytes_received);
    }
    wait_idle(&[&colocated]).await;
}
