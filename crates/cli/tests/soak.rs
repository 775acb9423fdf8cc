//! The CI soak: `tandem bench soak` for a minute per mode through router + push and + pull,
//! at twice the measured capacity, with client cancellations and the prefill and decode
//! engines frozen in turn. Nothing may be wrong, lost (no answer within 120 s) or leaked.

use std::process::Command;

use serde_json::Value;

mod common;

#[cfg(target_os = "linux")]
#[test]
fn a_soak_past_capacity_with_frozen_engines_loses_nothing_answers_nothing_wrong_and_leaks_no_block() {
    let base = common::free_port();
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["bench", "soak", "--secs", "50", "--freeze-every-secs", "12", "--request-timeout-secs", "120"])
        .args(["--base-port", &base.to_string()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the soak failed:\n{stderr}");
    let reports: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}:\n{stderr}"));
    let reports = reports.as_array().unwrap();
    assert_eq!(reports.len(), 2, "push and pull");
    for r in reports {
        let n = |k: &str| r["report"][k].as_u64().unwrap();
        assert_eq!((n("wrong"), n("lost")), (0, 0), "{r}");
        assert!(n("completed") > 50, "the soak did real work: {r}");
        assert_eq!(
            n("sent"),
            n("completed") + n("cancelled") + n("errored") + n("refused"),
            "every request ended: {r}"
        );
        assert!(r["freezes"].as_u64().unwrap() >= 2, "both engines were frozen once: {r}");
        assert!(r["blocks_held_after"].as_array().unwrap().iter().all(|b| b.as_f64() == Some(0.0)), "{r}");
        assert_eq!(r["serves_after"], true);
    }
}
