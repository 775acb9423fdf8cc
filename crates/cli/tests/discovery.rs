//! `--discovery etcd://...` across processes, with a real etcd: a router given no engine finds
//! the prefill and decode processes that register, serves through them, takes a new decode
//! engine into service, lets one that stops gracefully go before it drains, drops a killed
//! prefill engine within its lease and takes it back when it starts again.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tandem_discovery::test_etcd::EtcdCluster;

mod common;
use common::free_port;

struct Proc(Child);
impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn tandem(args: &str) -> Proc {
    Proc(
        Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args(["--log", "warn"])
            .args(args.split_whitespace())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

/// The router's engines by role, as `/admin/engines` lists them (each list sorted: engines
/// found together join in whichever order their checks end).
fn listed(http: &reqwest::blocking::Client, router: &str) -> (Vec<String>, Vec<String>) {
    let Ok(r) = http.get(format!("{router}/admin/engines")).send() else { return Default::default() };
    let v: Value = r.json().unwrap_or(Value::Null);
    let urls = |role: &str| {
        v[role]
            .as_array()
            .map(|a| a.iter().filter_map(|e| e["url"].as_str().map(String::from)).collect())
            .map(sorted)
            .unwrap_or_default()
    };
    (urls("prefill"), urls("decode"))
}

fn sorted(mut urls: Vec<String>) -> Vec<String> {
    urls.sort();
    urls
}

/// Waits until the router lists exactly these engines (bounded); how long it took.
fn until_listed(http: &reqwest::blocking::Client, router: &str, want: (&[&str], &[&str]), bound: Duration) -> Duration {
    let start = Instant::now();
    let want = (
        sorted(want.0.iter().map(|s| s.to_string()).collect()),
        sorted(want.1.iter().map(|s| s.to_string()).collect()),
    );
    loop {
        let now = listed(http, router);
        if now == want {
            return start.elapsed();
        }
        assert!(start.elapsed() < bound, "the router lists {now:?}, not {want:?}, after {bound:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn complete(http: &reqwest::blocking::Client, router: &str) -> (u16, Value) {
    let body = json!({"model": "tandem", "prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9], "max_tokens": 5, "ignore_eos": true});
    let r = http.post(format!("{router}/v1/completions")).json(&body).send().unwrap();
    (r.status().as_u16(), r.json().unwrap_or(Value::Null))
}

#[test]
fn engines_found_through_etcd_serve_join_and_leave_across_processes() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let Some(etcd) = rt.block_on(EtcdCluster::start(1, std::env::var_os("TANDEM_REQUIRE_ETCD").is_some())) else {
        return;
    };
    let etcd_flags = format!("--discovery {} --discovery-prefix /cli{}", etcd.url(), std::process::id());
    let disc = format!("{etcd_flags} --discovery-lease-secs 2 --served-model-name tandem");
    let (pp, dp, d2p, rp) = (free_port(), free_port(), free_port(), free_port());
    let prefill_args = format!("serve --role prefill --kv-mode push --port {pp} --kv-port {} {disc}", free_port());
    let mut prefill = tandem(&prefill_args);
    let mut decode = tandem(&format!(
        "serve --role decode --kv-mode push --port {dp} --kv-port {} --block-size 8 {disc}",
        free_port()
    ));
    let _router = tandem(&format!("router --mode push --port {rp} {etcd_flags}"));
    let (p_url, d_url, d2_url) =
        (format!("http://127.0.0.1:{pp}"), format!("http://127.0.0.1:{dp}"), format!("http://127.0.0.1:{d2p}"));
    let router = format!("http://127.0.0.1:{rp}");
    let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(30)).build().unwrap();

    until_listed(&http, &router, (&[&p_url], &[&d_url]), Duration::from_secs(60));
    let (status, v) = complete(&http, &router);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 5, "{v}");
    assert!(v["kv_timeline"]["transfer"]["bytes"].as_u64().unwrap_or(0) > 0, "not disaggregated: {v}");

    // The engines say they are registered.
    let metrics = http.get(format!("{p_url}/metrics")).send().unwrap().text().unwrap();
    assert!(metrics.contains("tandem:discovery_connected 1"), "{metrics}");

    // A second decode engine joins.
    let _decode2 = tandem(&format!("serve --role decode --kv-mode push --port {d2p} --kv-port {} {disc}", free_port()));
    until_listed(&http, &router, (&[&p_url], &[&d_url, &d2_url]), Duration::from_secs(60));

    // The first stops gracefully: it withdraws before draining, and is gone from the router at once.
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(decode.0.id() as i32), nix::sys::signal::Signal::SIGINT).unwrap();
    let left = until_listed(&http, &router, (&[&p_url], &[&d2_url]), Duration::from_secs(3));
    assert!(decode.0.wait().unwrap().success());
    assert_eq!(complete(&http, &router).0, 200);

    // The prefill engine is killed: out of rotation within its 2 s lease.
    prefill.0.kill().unwrap();
    let _ = prefill.0.wait();
    let dropped = until_listed(&http, &router, (&[], &[&d2_url]), Duration::from_secs(5));
    let (status, v) = complete(&http, &router);
    assert_eq!(status, 503, "{v}");

    // Started again, it registers again and serves.
    let _prefill = tandem(&prefill_args);
    until_listed(&http, &router, (&[&p_url], &[&d2_url]), Duration::from_secs(60));
    let (status, v) = complete(&http, &router);
    assert_eq!(status, 200, "{v}");
    eprintln!(
        "withdrawn decode engine gone from the router in {left:?}; killed prefill engine in {dropped:?} (lease 2 s)"
    );
}
