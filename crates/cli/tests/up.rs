//! `tandem up` brings the whole system up on the embedded default model, answers through the
//! router, and stops all three processes on Ctrl-C.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::free_port;

#[test]
fn up_serves_through_the_router_and_ctrl_c_stops_everything() {
    up_serves(None);
}

/// With `--api-key`, `--cluster-secret-file` and `--tls-cert`/`--tls-key`/`--tls-ca`, all three
/// processes take them (the engines the key through their environment): every HTTP port speaks
/// HTTPS only (a plain request gets no answer, a client without the CA refuses the
/// certificate), a request without the key is refused by the router and by an engine alike,
/// an engine's /kv/* refuse a caller without the cluster token, and the KV still moves between
/// the engines (over TLS, their side channels having proved the secret to each other).
#[test]
fn up_with_an_api_key_and_a_cluster_secret_guards_the_router_and_both_engines() {
    up_serves(Some("sk-up-key"));
}

fn up_serves(key: Option<&str>) {
    let (port, pp, dp, kp) = (free_port(), free_port(), free_port(), free_port());
    // A directory of this test's own: the two tests run at once in one process, and neither may
    // see (or remove) the other's secret and certificates.
    let dir = std::env::temp_dir().join(format!("tandem-up-{}-{port}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut secret_args = Vec::new();
    if key.is_some() {
        let secret_file = dir.join("secret");
        std::fs::write(&secret_file, "0f1e2d3c4b5a69788796a5b4c3d2e1f0\n").unwrap();
        secret_args = vec!["--cluster-secret-file".to_string(), secret_file.display().to_string()];
        secret_args.extend(tls_files(&dir));
    }
    // up's own log (and its children's, at warn), shown if it fails.
    let log_path = dir.join("up.log");
    let mut up = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["up", "--child-log", "warn", "--port", &port.to_string(), "--prefill-port", &pp.to_string()])
        .args(["--decode-port", &dp.to_string(), "--kv-port", &kp.to_string()])
        .args(key.map(|k| ["--api-key", k]).into_iter().flatten())
        .args(secret_args)
        .env_remove("TANDEM_API_KEY")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log_path).unwrap())
        .spawn()
        .unwrap();
    let log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    let mut http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(30));
    if key.is_some() {
        let ca = std::fs::read(dir.join("ca.pem")).unwrap();
        http = http.add_root_certificate(reqwest::Certificate::from_pem(&ca).unwrap());
    }
    let http = http.build().unwrap();
    let scheme = if key.is_some() { "https" } else { "http" };
    let url = format!("{scheme}://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !matches!(http.get(format!("{url}/health")).send(), Ok(r) if r.status().is_success()) {
        if let Some(status) = up.try_wait().unwrap() {
            panic!("tandem up exited during start-up ({status}); its log:\n{}", log());
        }
        assert!(Instant::now() < deadline, "tandem up never became healthy; its log:\n{}", log());
        std::thread::sleep(Duration::from_millis(100));
    }
    let body =
        serde_json::json!({"model": "tandem", "prompt": "Once upon a time", "max_tokens": 5, "ignore_eos": true});
    let post = |base: &str, key: Option<&str>| {
        let req = http.post(format!("{base}/v1/completions")).json(&body);
        match key {
            Some(k) => req.bearer_auth(k),
            None => req,
        }
        .send()
        .unwrap()
    };
    if key.is_some() {
        assert_eq!(post(&url, None).status(), 401, "the router let a request without the key in");
        assert_eq!(post(&format!("https://127.0.0.1:{pp}"), None).status(), 401, "prefill took no key");
        assert_eq!(post(&format!("https://127.0.0.1:{dp}"), None).status(), 401, "decode took no key");
        let info = http.get(format!("https://127.0.0.1:{pp}/kv/info")).send().unwrap();
        assert_eq!(info.status(), 401, "prefill's /kv/info answered a caller without the cluster token");
        for p in [port, pp, dp] {
            let plain = http.get(format!("http://127.0.0.1:{p}/health")).send();
            assert!(plain.is_err(), "port {p} answered plain HTTP: {plain:?}");
            let untrusting = reqwest::blocking::Client::new().get(format!("https://127.0.0.1:{p}/health")).send();
            assert!(untrusting.is_err(), "a client without the CA accepted port {p}'s certificate");
        }
    }
    let v: serde_json::Value = post(&url, key).json().unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 5, "{v}");
    assert!(
        v["kv_timeline"]["transfer"]["bytes"].as_u64().unwrap() > 0,
        "the answer went through prefill and decode: {v}"
    );
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(up.id() as i32), nix::sys::signal::Signal::SIGINT).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = up.try_wait().unwrap() {
            assert!(status.success(), "tandem up exited with {status}; its log:\n{}", log());
            break;
        }
        assert!(Instant::now() < deadline, "tandem up did not stop on Ctrl-C");
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = std::fs::remove_dir_all(&dir);
    // All three children are gone: their ports accept no connections.
    for p in [port, pp, dp, kp, kp + 1] {
        let deadline = Instant::now() + Duration::from_secs(5);
        while std::net::TcpStream::connect(("127.0.0.1", p)).is_ok() {
            assert!(Instant::now() < deadline, "port {p} still served after tandem up stopped");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// A CA and an engine certificate for 127.0.0.1 in `dir`, as the `--tls-*` flags name them.
fn tls_files(dir: &std::path::Path) -> Vec<String> {
    std::fs::create_dir_all(dir).unwrap();
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let cert =
        rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap().signed_by(&key, &ca, &ca_key).unwrap();
    let mut args = Vec::new();
    for (flag, name, pem) in [
        ("--tls-cert", "cert.pem", cert.pem()),
        ("--tls-key", "key.pem", key.serialize_pem()),
        ("--tls-ca", "ca.pem", ca.pem()),
    ] {
        std::fs::write(dir.join(name), pem).unwrap();
        args.extend([flag.to_string(), dir.join(name).display().to_string()]);
    }
    args
}
