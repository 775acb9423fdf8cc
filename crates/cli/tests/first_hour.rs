//! What a new user trips over, as separate `tandem` processes: requests the router must refuse
//! before prefill computes anything (and prefill KV freed at once when decode refuses), engines
//! set up inconsistently (refused at start and taken out of service later, naming why),
//! bounded shutdown, and `tandem up`'s flags and ports.

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod common;
use common::free_port;

struct Proc(Child);
impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Proc {
    fn signal(&self, sig: nix::sys::signal::Signal) {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.0.id() as i32), sig).unwrap();
    }

    /// Waits (bounded) for the process to exit; returns how long it took.
    fn exit_within(&mut self, bound: Duration) -> Duration {
        let start = Instant::now();
        loop {
            if let Some(status) = self.0.try_wait().unwrap() {
                assert!(status.success(), "exited with {status}");
                return start.elapsed();
            }
            assert!(start.elapsed() < bound, "still running after {bound:?}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

fn spawn(args: &str, stderr: Stdio) -> Proc {
    Proc(
        Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args(["--log", "info"])
            .args(args.split_whitespace())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap(),
    )
}

fn tandem(args: &str) -> Proc {
    spawn(args, Stdio::null())
}

fn http() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).build().unwrap()
}

fn wait_healthy(url: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !matches!(http().get(format!("{url}/health")).send(), Ok(r) if r.status().is_success()) {
        assert!(Instant::now() < deadline, "{url} never became healthy");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn post(url: &str, body: &Value) -> (u16, Value) {
    let r = http().post(format!("{url}/v1/completions")).json(body).send().unwrap();
    (r.status().as_u16(), r.json().unwrap_or(Value::Null))
}

fn metric(url: &str, name: &str) -> f64 {
    let text = http().get(format!("{url}/metrics")).send().unwrap().text().unwrap();
    text.lines().find(|l| l.starts_with(name)).and_then(|l| l.rsplit(' ').next()?.parse().ok()).unwrap_or(f64::NAN)
}

struct Engine {
    _p: Proc,
    url: String,
}

fn engine(role: &str, mode: &str, extra: &str) -> Engine {
    let (port, kv) = (free_port(), free_port());
    let p = tandem(&format!("serve --role {role} --kv-mode {mode} --port {port} --kv-port {kv} {extra}"));
    let url = format!("http://127.0.0.1:{port}");
    wait_healthy(&url);
    Engine { _p: p, url }
}

fn router(mode: &str, p: &Engine, d: &Engine, stderr: Stdio) -> (Proc, String) {
    let port = free_port();
    let r = spawn(
        &format!("router --mode {mode} --prefill {} --decode {} --port {port} --check-interval-secs 0.2", p.url, d.url),
        stderr,
    );
    (r, format!("http://127.0.0.1:{port}"))
}

/// Blocks prefill holds: 0 once every KV it produced is freed.
fn wait_blocks_free(url: &str, bound: Duration, what: &str) {
    let start = Instant::now();
    while metric(url, "tandem:kv_blocks_used") != 0.0 {
        assert!(start.elapsed() < bound, "{what}: prefill still holds KV blocks after {bound:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn bad_requests_are_refused_before_prefill_computes_and_decode_refusals_free_prefill_kv_at_once() {
    for mode in ["push", "pull"] {
        let p = engine("prefill", mode, "--block-size 16");
        // Decode takes shorter requests than prefill: its refusal comes after prefill's KV.
        let d = engine("decode", mode, "--block-size 8 --max-model-len 64");
        let (_r, r_url) = router(mode, &p, &d, Stdio::null());
        wait_healthy(&r_url);
        for bad in [json!(-5), json!(1e9), json!("ten"), json!(1_000_000_000)] {
            let (status, v) = post(&r_url, &json!({"prompt": [1, 2, 3], "max_tokens": bad}));
            assert_eq!(status, 400, "{mode}, max_tokens {bad}: {v}");
            assert_eq!(v["error"]["param"], "max_tokens", "{mode}, max_tokens {bad}: {v}");
            let msg = v["error"]["message"].as_str().unwrap();
            assert!(!msg.contains("line 1"), "no positions in a body the router rewrote: {msg}");
        }
        let (status, v) = post(&r_url, &json!({"prompt": [1, 2, 3], "stream": "yes"}));
        assert_eq!((status, v["error"]["param"].as_str()), (400, Some("stream")), "{v}");
        assert_eq!(metric(&p.url, "tandem:prompt_tokens_total"), 0.0, "{mode}: prefill computed a refused request");
        // Fits prefill's context, not decode's: decode refuses after prefill produced the KV,
        // and the router has prefill free it now instead of after a 30 s lease or wait.
        let prompt: Vec<u32> = (0..40).collect();
        let (status, v) = post(&r_url, &json!({"prompt": prompt, "max_tokens": 40}));
        assert_eq!(status, 400, "{mode}: {v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("maximum context length"), "{v}");
        // (Push sends both legs at once: prefill may not even have started.)
        assert!(metric(&p.url, "tandem:prompt_tokens_total") <= 40.0);
        wait_blocks_free(&p.url, Duration::from_secs(3), mode);
        let (status, v) = post(&r_url, &json!({"prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": true}));
        assert_eq!(status, 200, "{mode}: still serving: {v}");
        wait_blocks_free(&p.url, Duration::from_secs(3), mode);
    }
}

fn stderr_of(mut p: Proc, bound: Duration) -> String {
    p.exit_within_any(bound);
    let mut s = String::new();
    p.0.stderr.take().unwrap().read_to_string(&mut s).unwrap();
    s
}

/// The lines `p` writes to its (piped) stderr, as they come; the channel closes at its exit.
fn stderr_lines(p: &mut Proc) -> std::sync::mpsc::Receiver<String> {
    let stderr = p.0.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    rx
}

impl Proc {
    /// Like [`Proc::exit_within`], for a process expected to fail; returns its status.
    fn exit_within_any(&mut self, bound: Duration) -> std::process::ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(status) = self.0.try_wait().unwrap() {
                return status;
            }
            assert!(start.elapsed() < bound, "still running after {bound:?}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

#[test]
fn misconfigured_engines_are_refused_at_start_and_taken_out_of_service_naming_why() {
    // Decode in the other mode: the router refuses to start, naming the engine and the mode.
    let p = engine("prefill", "push", "");
    let d_pull = engine("decode", "pull", "");
    let (r, _) = router("push", &p, &d_pull, Stdio::piped());
    let log = stderr_of(r, Duration::from_secs(30));
    assert!(log.contains(&d_pull.url) && log.contains("runs in pull mode, the router in push mode"), "{log}");
    // Other weights on decode: refused, naming the field.
    let d_other = engine("decode", "push", "--model-seed 7");
    let (r, _) = router("push", &p, &d_other, Stdio::piped());
    let log = stderr_of(r, Duration::from_secs(30));
    assert!(log.contains("cannot pair") && log.contains("model_fingerprint differs"), "{log}");
    // An FP8 KV cache on decode only: refused, naming the field and both types.
    let d_fp8 = engine("decode", "push", "--kv-cache-dtype fp8");
    let (r, _) = router("push", &p, &d_fp8, Stdio::piped());
    let log = stderr_of(r, Duration::from_secs(30));
    assert!(log.contains("cannot pair") && log.contains("dtype differs") && log.contains("fp8_e4m3"), "{log}");
    // The same decode engine asked directly: it fails the request and counts the refusal
    // instead of silently recomputing under its own model.
    let kv_port: u64 = {
        let info: Value = http().get(format!("{}/kv/info", p.url)).send().unwrap().json().unwrap();
        info["transports"][0]["addr"].as_str().unwrap().rsplit_once(':').unwrap().1.parse().unwrap()
    };
    let body = json!({"prompt": [1, 2, 3], "max_tokens": 2, "kv_transfer_params": {
        "do_remote_prefill": true, "remote_host": "127.0.0.1", "remote_port": kv_port, "transfer_id": "x1"}});
    let (status, v) = post(&d_other.url, &body);
    assert_eq!(status, 500, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("model_fingerprint differs"), "{v}");
    assert_eq!(metric(&d_other.url, "tandem:kv_connector{counter=\"peers_refused\"}"), 1.0);

    // A good pair, then decode restarts in the other mode (same port): requests get a 503
    // naming the misconfiguration, never a 400 blaming the client; /health says why.
    let d_port = free_port();
    let d_kv = free_port();
    let d_args = |mode: &str| format!("serve --role decode --kv-mode {mode} --port {d_port} --kv-port {d_kv}");
    let mut d = Engine { _p: tandem(&d_args("push")), url: format!("http://127.0.0.1:{d_port}") };
    wait_healthy(&d.url);
    let (_r, r_url) = router("push", &p, &d, Stdio::null());
    wait_healthy(&r_url);
    let (status, v) = post(&r_url, &json!({"prompt": [1, 2, 3], "max_tokens": 2}));
    assert_eq!(status, 200, "{v}");
    drop(std::mem::replace(&mut d._p, tandem("--version")));
    d._p = tandem(&d_args("pull"));
    wait_healthy(&d.url);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, v) = post(&r_url, &json!({"prompt": [1, 2, 3], "max_tokens": 2}));
        if status == 503 {
            let msg = v["error"]["message"].as_str().unwrap();
            assert!(msg.contains("runs in pull mode"), "{v}");
            break;
        }
        assert!(status != 400, "a misconfiguration answered as the client's fault: {v}");
        assert!(Instant::now() < deadline, "the router never noticed decode's new mode: {status} {v}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let r = http().get(format!("{r_url}/health")).send().unwrap();
    assert_eq!(r.status(), 503);
    let h: Value = r.json().unwrap();
    assert!(h["problems"][0].as_str().unwrap().contains("runs in pull mode"), "{h}");
    // Decode gone altogether: the cause is named, not "error sending request".
    drop(std::mem::replace(&mut d._p, tandem("--version")));
    std::thread::sleep(Duration::from_millis(600));
    let (status, v) = post(&r_url, &json!({"prompt": [1, 2, 3], "max_tokens": 2}));
    assert_eq!(status, 502, "{v}");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("could not connect") && msg.contains("refused"), "{msg}");
}

/// Starts `serve`, streams a long generation and returns the process and the reader thread.
fn serve_with_a_long_stream(extra: &str) -> (Proc, String, std::thread::JoinHandle<(u16, String)>) {
    let port = free_port();
    let p = tandem(&format!("serve --port {port} {extra}"));
    let url = format!("http://127.0.0.1:{port}");
    wait_healthy(&url);
    let u = url.clone();
    let reader = std::thread::spawn(move || {
        let body = json!({"prompt": [1, 2, 3], "max_tokens": 3000, "ignore_eos": true, "stream": true});
        let r = http().post(format!("{u}/v1/completions")).json(&body).send().unwrap();
        let status = r.status().as_u16();
        (status, r.text().unwrap_or_default())
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    while metric(&url, "tandem:num_requests_running") != 1.0 {
        assert!(Instant::now() < deadline, "the stream never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    (p, url, reader)
}

fn last_events(text: &str) -> (Value, &str) {
    let events: Vec<&str> = text.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).collect();
    assert!(events.len() >= 2, "{text}");
    (serde_json::from_str(events[events.len() - 2]).unwrap(), events[events.len() - 1])
}

#[test]
fn shutdown_is_immediate_when_idle_and_bounded_with_streams_in_flight() {
    use nix::sys::signal::Signal;
    // Idle: out at once.
    let port = free_port();
    let mut p = tandem(&format!("serve --port {port}"));
    wait_healthy(&format!("http://127.0.0.1:{port}"));
    p.signal(Signal::SIGINT);
    let took = p.exit_within(Duration::from_secs(5));
    assert!(took < Duration::from_secs(1), "idle serve took {took:?} to exit");

    // A 3000-token stream: ended after the 1 s drain, with an error chunk and [DONE].
    let (mut p, _, reader) = serve_with_a_long_stream("--shutdown-timeout-secs 1");
    let start = Instant::now();
    p.signal(Signal::SIGINT);
    p.exit_within(Duration::from_secs(5));
    let took = start.elapsed();
    assert!(took >= Duration::from_millis(900) && took < Duration::from_secs(3), "drain took {took:?}");
    let (status, text) = reader.join().unwrap();
    assert_eq!(status, 200);
    let (err, done) = last_events(&text);
    assert_eq!((err["error"]["code"].as_u64(), done), (Some(503), "[DONE]"), "{err}");

    // A second signal ends the drain at once.
    let (mut p, _, reader) = serve_with_a_long_stream("--shutdown-timeout-secs 60");
    p.signal(Signal::SIGTERM);
    std::thread::sleep(Duration::from_millis(300));
    let start = Instant::now();
    p.signal(Signal::SIGINT);
    p.exit_within(Duration::from_secs(3));
    assert!(start.elapsed() < Duration::from_secs(2), "the second signal took {:?}", start.elapsed());
    let (_, text) = reader.join().unwrap();
    assert_eq!(last_events(&text).0["error"]["code"], 503, "{text}");

    // The router, idle: out at once too.
    let pe = engine("prefill", "push", "");
    let de = engine("decode", "push", "");
    let (mut r, r_url) = router("push", &pe, &de, Stdio::null());
    wait_healthy(&r_url);
    r.signal(Signal::SIGINT);
    let took = r.exit_within(Duration::from_secs(5));
    assert!(took < Duration::from_secs(1), "idle router took {took:?} to exit");

    // The router with a stream through it: ended after its drain, with an error chunk, and
    // decode frees the stream's blocks.
    let port = free_port();
    let mut r = tandem(&format!(
        "router --mode push --prefill {} --decode {} --port {port} --shutdown-timeout-secs 1",
        pe.url, de.url
    ));
    let r_url = format!("http://127.0.0.1:{port}");
    wait_healthy(&r_url);
    let u = r_url.clone();
    let reader = std::thread::spawn(move || {
        let body = json!({"prompt": [1, 2, 3], "max_tokens": 3000, "ignore_eos": true, "stream": true});
        http().post(format!("{u}/v1/completions")).json(&body).send().unwrap().text().unwrap_or_default()
    });
    let deadline = Instant::now() + Duration::from_secs(20);
    while metric(&de.url, "tandem:num_requests_running") != 1.0 {
        assert!(Instant::now() < deadline, "the stream never started on decode");
        std::thread::sleep(Duration::from_millis(10));
    }
    let start = Instant::now();
    r.signal(Signal::SIGINT);
    r.exit_within(Duration::from_secs(5));
    let took = start.elapsed();
    assert!(took >= Duration::from_millis(900) && took < Duration::from_secs(3), "router drain took {took:?}");
    let text = reader.join().unwrap();
    let (err, done) = last_events(&text);
    assert_eq!((err["error"]["code"].as_u64(), done), (Some(503), "[DONE]"), "{err}");
    wait_blocks_free(&de.url, Duration::from_secs(5), "decode after the router stopped");
}

#[test]
fn up_refuses_busy_ports_and_passes_engine_flags_to_its_engines() {
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy_port = busy.local_addr().unwrap().port();
    let (pp, dp, kp) = (free_port(), free_port(), free_port());
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["up", "--port", &busy_port.to_string(), "--prefill-port", &pp.to_string()])
        .args(["--decode-port", &dp.to_string(), "--kv-port", &kp.to_string()])
        .stdout(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("127.0.0.1:{busy_port}")) && err.contains("not free"), "{err}");
    assert!(!err.contains("tandem is up"), "{err}");
    drop(busy);

    let port = free_port();
    let mut up = tandem(&format!(
        "up --child-log warn --port {port} --prefill-port {pp} --decode-port {dp} --kv-port {kp} --max-model-len 64 --block-size 8"
    ));
    let url = format!("http://127.0.0.1:{port}");
    wait_healthy(&url);
    for engine in [&url, &format!("http://127.0.0.1:{pp}"), &format!("http://127.0.0.1:{dp}")] {
        let models: Value = http().get(format!("{engine}/v1/models")).send().unwrap().json().unwrap();
        assert_eq!(models["data"][0]["max_model_len"], 64, "{engine}: {models}");
    }
    let info: Value = http().get(format!("http://127.0.0.1:{dp}/kv/info")).send().unwrap().json().unwrap();
    assert_eq!(info["block_size"], 8, "{info}");
    let (status, v) = post(&url, &json!({"prompt": "hi", "max_tokens": 100}));
    assert_eq!(status, 400, "--max-model-len 64 holds: {v}");
    up.signal(nix::sys::signal::Signal::SIGINT);
    up.exit_within(Duration::from_secs(20));
}

#[test]
fn up_on_a_model_without_a_tokenizer_suggests_a_token_id_prompt_that_works() {
    let dir = std::env::temp_dir().join(format!("tandem-notok-{}", std::process::id()));
    let st = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["--log", "warn", "model", "init", "--preset", "tiny-qwen3", "--out"])
        .arg(&dir)
        .status()
        .unwrap();
    assert!(st.success());
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    let (port, pp, dp, kp) = (free_port(), free_port(), free_port(), free_port());
    let mut up = Proc(
        Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args(["up", "--child-log", "warn", "--model"])
            .arg(&dir)
            .args(["--port", &port.to_string(), "--prefill-port", &pp.to_string()])
            .args(["--decode-port", &dp.to_string(), "--kv-port", &kp.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let rx = stderr_lines(&mut up);
    let deadline = Instant::now() + Duration::from_secs(60);
    let curl = loop {
        let line = rx.recv_timeout(deadline.saturating_duration_since(Instant::now())).expect("no curl suggested");
        if line.contains("-d '") {
            break line;
        }
    };
    // The suggested body, sent as suggested, is answered.
    let body: Value = serde_json::from_str(curl.split("-d '").nth(1).unwrap().trim_end_matches('\'')).unwrap();
    assert!(body["prompt"].is_array(), "a token-ids model needs token ids: {curl}");
    let (status, v) = post(&format!("http://127.0.0.1:{port}"), &body);
    assert_eq!(status, 200, "{v}");
    up.signal(nix::sys::signal::Signal::SIGINT);
    up.exit_within(Duration::from_secs(20));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn model_inspect_reads_the_shape_without_building_weights() {
    let start = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["--log", "warn", "model", "inspect", "--model", "preset:qwen3-4b"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // Building 4B random weights (16 GB of f32) would take minutes and exhaust memory here.
    assert!(start.elapsed() < Duration::from_secs(5), "took {:?}", start.elapsed());
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((v["num_layers"].as_u64(), v["hidden_size"].as_u64()), (Some(36), Some(2560)), "{v}");
    assert_eq!(v["weight_bytes_f32"].as_u64(), v["params"].as_u64().map(|p| p * 4));
}

/// The children of `pid` whose command line holds `needle` (from /proc).
#[cfg(target_os = "linux")]
fn children_with(pid: u32, needle: &str) -> Vec<i32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(child) = entry.file_name().to_string_lossy().parse::<i32>() else { continue };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else { continue };
        // "pid (comm) state ppid ...": comm may hold spaces, so split after its closing parenthesis.
        let ppid = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        if ppid == Some(pid) && String::from_utf8_lossy(&cmdline).replace('\0', " ").contains(needle) {
            found.push(child);
        }
    }
    found
}

#[cfg(target_os = "linux")]
#[test]
fn up_stops_everything_and_says_which_child_died_when_one_dies_while_serving() {
    let (port, pp, dp, kp) = (free_port(), free_port(), free_port(), free_port());
    let mut up = spawn(
        &format!("up --child-log warn --port {port} --prefill-port {pp} --decode-port {dp} --kv-port {kp}"),
        Stdio::piped(),
    );
    let rx = stderr_lines(&mut up);
    // Serving from the user's point of view: `up` has said so.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut err = String::new();
    while !err.contains("tandem is up") {
        let line = match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(line) => line,
            Err(e) => panic!("up never said it is up ({e}); it wrote:\n{err}"),
        };
        err.push_str(&line);
        err.push('\n');
    }
    let url = format!("http://127.0.0.1:{port}");
    let (status, v) = post(&url, &json!({"prompt": "hi", "max_tokens": 4}));
    assert_eq!(status, 200, "{v}");
    let decode = children_with(up.0.id(), "--role decode");
    assert_eq!(decode.len(), 1, "one decode child of up");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(decode[0]), nix::sys::signal::Signal::SIGKILL).unwrap();
    let status = up.exit_within_any(Duration::from_secs(20));
    assert!(!status.success(), "up exits with failure when a child dies");
    // The channel ends when up's stderr closes, at its exit (bounded, in case it does not).
    while let Ok(line) = rx.recv_timeout(Duration::from_secs(10)) {
        err.push_str(&line);
        err.push('\n');
    }
    assert!(err.contains("the decode process stopped while serving") && err.contains("SIGKILL"), "{err}");
    // The others were stopped with it: every port is free again.
    for p in [port, pp, dp, kp, kp + 1] {
        assert!(std::net::TcpListener::bind(("127.0.0.1", p)).is_ok(), "port {p} still in use after up exited");
    }
}

/// `serve --chat-template FILE` renders chats with that template instead of the model's: a chat
/// whose template is the message text alone costs the prompt tokens of that text as a plain
/// completion (the model's ChatML would add its role markers). A path that is neither a file
/// nor a template is refused at start, saying so.
#[test]
fn serve_takes_a_chat_template_from_a_file() {
    let dir = std::env::temp_dir().join(format!("tandem-chat-template-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("plain.jinja");
    std::fs::write(&file, "{{ messages[0].content }}").unwrap();
    let port = free_port();
    let p = tandem(&format!("serve --port {port} --chat-template {}", file.display()));
    let url = format!("http://127.0.0.1:{port}");
    wait_healthy(&url);
    let text = "the quick brown fox";
    let chat = json!({"messages": [{"role": "user", "content": text}], "max_tokens": 1});
    let r = http().post(format!("{url}/v1/chat/completions")).json(&chat).send().unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let chat: Value = r.json().unwrap();
    let (code, plain) = post(&url, &json!({"prompt": text, "max_tokens": 1}));
    assert_eq!(code, 200, "{plain}");
    assert_eq!(chat["usage"]["prompt_tokens"], plain["usage"]["prompt_tokens"], "{chat} vs {plain}");
    drop(p);
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["serve", "--port", "0", "--chat-template", "/no/such/template.jinja"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("no such file, and not a template"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
