//! `tandem bench sweep --launch` then `bench plot`, end to end on the tiny model: the servers
//! start and stop per mode, every point's JSON parses with vLLM's keys, the CSV has a row per
//! point, and the figures are real PNG and SVG files.

use std::process::Command;

/// A base port whose +100, +200, +300 and +301 neighbours are free too.
fn free_base() -> u16 {
    for _ in 0..200 {
        let base = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        if !(1024..=65000).contains(&base) {
            continue;
        }
        if [0u16, 100, 200, 300, 301].iter().all(|d| std::net::TcpListener::bind(("127.0.0.1", base + d)).is_ok()) {
            return base;
        }
    }
    panic!("no free port block");
}

#[test]
fn sweep_launches_servers_writes_results_and_plots() {
    let dir = std::env::temp_dir().join(format!("tandem-sweep-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["--log", "warn", "bench", "sweep", "--launch", "--modes", "push,colocated", "--qps", "4,8"])
        .args(["--input-lens", "16,40", "--output-len", "4", "--num-prompts", "4", "--vocab-size", "500", "--plot"])
        .args(["--base-port", &free_base().to_string(), "--result-dir"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for mode in ["push", "colocated"] {
        for q in [4, 8] {
            for input in [16, 40] {
                let path = dir.join(format!("{mode}_qps{q}_in{input}_out4_iter0.json"));
                let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
                assert_eq!(v["completed"], 4, "{}", path.display());
                assert_eq!(v["total_input_tokens"], 4 * input);
                assert_eq!(v["backend"], mode);
                for k in ["median_ttft_ms", "p99_tpot_ms", "mean_itl_ms", "request_throughput", "ttfts", "itls"] {
                    assert!(v.get(k).is_some(), "{k} missing in {}", path.display());
                }
                assert_eq!(v.get("kv_timelines").is_some(), mode == "push", "timelines come from decode engines");
            }
        }
    }
    let csv = std::fs::read_to_string(dir.join("summary.csv")).unwrap();
    assert_eq!(csv.lines().count(), 1 + 8, "{csv}");
    for f in ["ttft.png", "tpot.png", "ttft_breakdown.png"] {
        let bytes = std::fs::read(dir.join(f)).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{f} is a PNG");
        assert!(bytes.len() > 10_000, "{f} has content");
    }
    for f in ["ttft.svg", "tpot.svg", "ttft_breakdown.svg"] {
        let svg = std::fs::read_to_string(dir.join(f)).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("request rate") || svg.contains("TTFT"), "{f}");
    }
    std::fs::remove_dir_all(&dir).ok();
}
