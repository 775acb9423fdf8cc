//! Disaggregated serving across separate processes (the `tandem` binary): prefill, decode and
//! router as their own processes, KV over TCP. Push and pull equal a colocated process; a
//! prefill process killed mid-prefill ends the request with a clear error within a bound while
//! decode gets every block back; a decode process killed mid-request frees prefill's KV at once,
//! the router answers that request through the other decode engine and sends everything after
//! it there, then takes the restarted one back.

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

fn tandem(args: &[String]) -> Proc {
    Proc(
        Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args(["--log", "warn"])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

fn args(s: &str) -> Vec<String> {
    s.split_whitespace().map(str::to_string).collect()
}

fn wait_healthy(http: &reqwest::blocking::Client, url: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !matches!(http.get(format!("{url}/health")).send(), Ok(r) if r.status().is_success()) {
        assert!(Instant::now() < deadline, "{url} never became healthy");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn complete(http: &reqwest::blocking::Client, url: &str, body: &Value) -> (u16, Value) {
    let r = http.post(format!("{url}/v1/completions")).json(body).send().unwrap();
    (r.status().as_u16(), r.json().unwrap_or(Value::Null))
}

/// Sends every body at once (one thread each) and returns each answer's token ids, streamed
/// or not.
fn run_concurrently(url: &str, bodies: &[Value]) -> Vec<Vec<u64>> {
    let handles: Vec<_> = bodies
        .iter()
        .map(|b| {
            let (url, b) = (url.to_string(), b.clone());
            std::thread::spawn(move || {
                let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(120)).build().unwrap();
                let r = http.post(format!("{url}/v1/completions")).json(&b).send().unwrap();
                assert_eq!(r.status(), 200);
                let text = r.text().unwrap();
                let parts: Vec<String> = if b["stream"] == json!(true) {
                    text.split("\n\n")
                        .filter_map(|e| e.strip_prefix("data: "))
                        .filter(|e| *e != "[DONE]")
                        .map(str::to_string)
                        .collect()
                } else {
                    vec![text]
                };
                let mut ids = Vec::new();
                for p in parts {
                    let v: Value = serde_json::from_str(&p).unwrap();
                    assert!(v.get("error").is_none(), "{v}");
                    ids.extend(v["choices"][0]["token_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()));
                }
                ids
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn metric(http: &reqwest::blocking::Client, url: &str, name: &str) -> Option<f64> {
    let text = http.get(format!("{url}/metrics")).send().ok()?.text().ok()?;
    text.lines().find(|l| l.starts_with(name)).and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// The engine's KV connector counter `name` (`tandem:kv_connector{counter="name"}`).
fn kv_counter(http: &reqwest::blocking::Client, url: &str, name: &str) -> Option<f64> {
    metric(http, url, &format!("tandem:kv_connector{{counter=\"{name}\"}}"))
}

struct System {
    p: Proc,
    p_args: Vec<String>,
    _d: Proc,
    _r: Proc,
    p_url: String,
    d_url: String,
    r_url: String,
}

fn system(mode: &str, extra_p: &str, extra_d: &str) -> System {
    let (pp, dp, rp, pk, dk) = (free_port(), free_port(), free_port(), free_port(), free_port());
    let p_args = args(&format!(
        "serve --role prefill --kv-mode {mode} --port {pp} --kv-port {pk} --block-size 16 --kv-verify {extra_p}"
    ));
    let p = tandem(&p_args);
    let d = tandem(&args(&format!(
        "serve --role decode --kv-mode {mode} --port {dp} --kv-port {dk} --block-size 8 --kv-verify {extra_d}"
    )));
    let r = tandem(&args(&format!(
        "router --mode {mode} --prefill http://127.0.0.1:{pp} --decode http://127.0.0.1:{dp} --port {rp}"
    )));
    let (p_url, d_url, r_url) =
        (format!("http://127.0.0.1:{pp}"), format!("http://127.0.0.1:{dp}"), format!("http://127.0.0.1:{rp}"));
    let http = reqwest::blocking::Client::new();
    wait_healthy(&http, &r_url);
    System { p, p_args, _d: d, _r: r, p_url, d_url, r_url }
}

/// 50 mixed requests (1 token to several blocks, token ids and text, half streamed), to send
/// all at once.
fn mixed_requests() -> Vec<Value> {
    (0..50)
        .map(|i| {
            let n = [1usize, 5, 16, 17, 60, 130][i % 6];
            let prompt: Value = if i % 10 == 9 {
                json!(format!("request number {i} about foxes"))
            } else {
                json!((0..n).map(|j| ((i * 13 + j * 5) % 500) as u32).collect::<Vec<_>>())
            };
            json!({"prompt": prompt, "max_tokens": 3 + i % 6, "temperature": 0, "ignore_eos": true, "stream": i % 2 == 0})
        })
        .collect()
}

/// An engine over 2 and 4 tensor-parallel ranks answers the mixed requests, all at once, token
/// for token as a one-rank engine does; as a prefill or decode engine it refuses to start,
/// saying why.
#[test]
fn a_tensor_parallel_engine_answers_as_one_rank_does() {
    let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
    let bodies = mixed_requests();
    let serve = |size: usize| {
        let port = free_port();
        let p = tandem(&args(&format!("serve --port {port} --tensor-parallel-size {size}")));
        let url = format!("http://127.0.0.1:{port}");
        wait_healthy(&http, &url);
        (p, url)
    };
    let (_one, url) = serve(1);
    let want = run_concurrently(&url, &bodies);
    for size in [2, 4] {
        let (_p, url) = serve(size);
        let got = run_concurrently(&url, &bodies);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "{size} ranks: request {i}: {}", bodies[i]);
        }
    }
    // tiny-qwen3's 2 KV heads would repeat over 4 ranks: a prefill engine cannot move them.
    let refused = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(args(&format!("serve --role prefill --tensor-parallel-size 4 --port {}", free_port())))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && stderr.contains("at most 2 ranks"), "{stderr}");
}

/// Prefill and decode engines at different tensor-parallel sizes (2 -> 1, 1 -> 2, 4 -> 2 over
/// push and pull) answer the mixed requests, all at once, as a one-rank colocated engine does,
/// and give every block back.
#[test]
fn prefill_and_decode_at_different_tensor_parallel_sizes_equal_colocated() {
    let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
    let bodies = mixed_requests();
    let model = "--model preset:tiny-qwen3-tp";
    let (_c, c_url) = colocated(&http, model);
    let want = run_concurrently(&c_url, &bodies);
    for (mode, p_ranks, d_ranks) in [("push", 2, 1), ("pull", 1, 2), ("push", 4, 2), ("pull", 4, 2)] {
        let s = system(
            mode,
            &format!("{model} --tensor-parallel-size {p_ranks}"),
            &format!("{model} --tensor-parallel-size {d_ranks}"),
        );
        let got = run_concurrently(&s.r_url, &bodies);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "{mode} {p_ranks} -> {d_ranks} ranks: request {i}: {}", bodies[i]);
        }
        blocks_back(&http, [&s.p_url, &s.d_url]);
        if p_ranks > 1 {
            // Each of prefill's ranks moved its own heads and said so (push: its Done; pull: its
            // answer to the read): decode counted them all.
            let counter = |name: &str| kv_counter(&http, &s.d_url, name);
            let (ok, notices) = (counter("transfers_ok").unwrap_or(0.0), counter("rank_notices").unwrap_or(0.0));
            assert!(ok > 0.0 && notices == ok * p_ranks as f64, "{p_ranks} ranks: {ok} transfers, {notices} notices");
        }
    }
}

/// A tensor-parallel prefill engine whose ranks' KV arrives corrupted (`--kv-verify` on both
/// engines, every send with a flipped bit): in both modes decode refuses the first rank's
/// heads, recomputes, and answers as colocated; every block comes back on both engines, and
/// prefill hears of each transfer's end once (a later rank's answer to a pull read that already
/// ended is drained, not released again: prefill sees no message about a transfer it let go).
#[test]
fn a_tensor_parallel_prefill_engines_corrupted_kv_is_recomputed_in_both_modes() {
    let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
    let model = "--model preset:tiny-qwen3-tp";
    let (_c, c_url) = colocated(&http, model);
    let bodies: Vec<Value> = (0..4)
        .map(|i| {
            let prompt: Vec<u32> = (0..30 + 20 * i).map(|j| ((j * 11 + i) % 500) as u32).collect();
            json!({"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": true})
        })
        .collect();
    let want = run_concurrently(&c_url, &bodies);
    for mode in ["push", "pull"] {
        let s = system(mode, &format!("{model} --tensor-parallel-size 2 --fault-corrupt-sends"), model);
        let got = run_concurrently(&s.r_url, &bodies);
        assert_eq!(got, want, "{mode}: recomputed answers equal colocated's");
        let counter = |url: &str, name: &str| kv_counter(&http, url, name);
        assert_eq!(counter(&s.d_url, "transfers_ok"), Some(0.0), "{mode}: no corrupted KV used");
        assert!(counter(&s.d_url, "checksum_failures").is_some_and(|n| n >= 4.0), "{mode}");
        assert_eq!(counter(&s.p_url, "unknown_ids"), Some(0.0), "{mode}: prefill heard of an ended transfer again");
        blocks_back(&http, [&s.p_url, &s.d_url]);
    }
}

/// A tensor-parallel prefill engine one of whose ranks' completion notices is lost: decode
/// never starts a request on its other ranks' word alone (their KV heads landed, the lost
/// rank's too, but not its notice). It waits within its transfer timeout, then recomputes
/// the prompt: every answer equals colocated's, and every block comes back on both engines.
#[test]
fn a_prefill_ranks_lost_notice_leaves_decode_waiting_within_its_bound_then_recomputing() {
    let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
    let model = "--model preset:tiny-qwen3-tp";
    let (_c, c_url) = colocated(&http, model);
    let bodies: Vec<Value> = (0..4)
        .map(|i| {
            let prompt: Vec<u32> = (0..40 + 30 * i).map(|j| ((j * 7 + i * 3) % 500) as u32).collect();
            json!({"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": true})
        })
        .collect();
    let want = run_concurrently(&c_url, &bodies);
    let s = system(
        "push",
        &format!("{model} --tensor-parallel-size 2 --fault-drop-done-of-rank 1"),
        &format!("{model} --kv-transfer-timeout-secs 2"),
    );
    let started = Instant::now();
    let got = run_concurrently(&s.r_url, &bodies);
    let waited = started.elapsed();
    assert_eq!(got, want, "recomputed answers equal colocated's");
    assert!(waited >= Duration::from_secs(2) && waited < Duration::from_secs(20), "waited {waited:?}");
    let counter = |name: &str| kv_counter(&http, &s.d_url, name);
    assert_eq!(counter("transfers_ok"), Some(0.0), "no request started on part of its ranks' word");
    assert_eq!(counter("rank_notices"), Some(4.0), "rank 0's notice of each request counted");
    assert_eq!(counter("transfers_failed"), Some(4.0), "each transfer given up at its timeout");
    blocks_back(&http, [&s.p_url, &s.d_url]);
}

/// A tensor-parallel engine one of whose ranks dies (as a crashing rank would: mid-forward, at
/// an all-reduce): prefill's mid-prefill, with the first steps' KV already pushed to decode, or
/// decode's mid-decode, its KV landed. No wrong answer: the request ends with an error naming
/// the rank; every block comes back on both engines; the rank runs again at the next step, so
/// the same prompt then answers as a colocated engine does (none of the failed step's KV is
/// taken from the prefix cache).
#[test]
fn a_tensor_parallel_rank_dying_mid_transfer_or_mid_decode_answers_nothing_wrong_and_frees_every_block() {
    let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
    let model = "--model preset:tiny-qwen3-tp";
    let (_c, c_url) = colocated(&http, model);
    let prompt: Vec<u32> = (0..300).map(|j| ((j * 7) % 500) as u32).collect();
    let body = json!({"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": true});
    let (_, want) = complete(&http, &c_url, &body);
    // 32 tokens a step: prefill takes the prompt in 10 steps, the 4th of which loses a rank;
    // decode loses one in its 3rd step of 5.
    let ranks = format!("{model} --tensor-parallel-size 2 --max-num-batched-tokens 32");
    for (mode, dies) in [("push", "prefill"), ("pull", "prefill"), ("push", "decode"), ("pull", "decode")] {
        let (p, d) = match dies {
            "prefill" => (format!("{ranks} --fault-rank-fails-at-forward 4"), ranks.clone()),
            _ => (ranks.clone(), format!("{ranks} --fault-rank-fails-at-forward 3")),
        };
        let s = system(mode, &p, &d);
        let started = Instant::now();
        let (status, v) = complete(&http, &s.r_url, &body);
        let what = format!("{mode}, a {dies} rank died");
        assert!(status >= 500, "{what}: answered {status}: {v}");
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("rank 1 failed"), "{what}: the error says what failed: {v}");
        assert!(started.elapsed() < Duration::from_secs(10), "{what}: bounded: {:?}", started.elapsed());
        if mode == "push" {
            // Prefill's steps before the failed one had pushed their KV (decode's: all of it).
            let received = kv_counter(&http, &s.d_url, "bytes_received");
            assert!(received.is_some_and(|b| b > 0.0), "{what}: no KV had moved: {received:?}");
        }
        // Within 20 s: before decode's 30 s transfer timeout would have freed them.
        blocks_back(&http, [&s.p_url, &s.d_url]);
        let (status, v) = complete(&http, &s.r_url, &body);
        assert_eq!(status, 200, "{what}: the next request: {v}");
        assert_eq!(v["choices"][0]["token_ids"], want["choices"][0]["token_ids"], "{what}: the next request");
        blocks_back(&http, [&s.p_url, &s.d_url]);
    }
}

/// With another decode engine up, a request whose decode engine fails it (a tensor-parallel
/// rank dies mid-decode) is answered through the other one: not streamed, it is sent there
/// again (nothing had reached the client); streamed, it goes on from there (the engine's error
/// event ends the stream mid-way). Every request answers as colocated, the client reading one
/// whole stream without an error event, and the engine that failed one serves on.
#[test]
fn a_decode_engine_whose_rank_dies_hands_the_request_to_another() {
    let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
    let model = "--model preset:tiny-qwen3-tp";
    let (_c, c_url) = colocated(&http, model);
    let body = |i: u32, stream: bool| {
        let prompt: Vec<u32> = (0..40).map(|j| (j * 7 + i * 11) % 500).collect();
        json!({"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": true, "stream": stream})
    };
    let want: Vec<Value> =
        (0..4).map(|i| complete(&http, &c_url, &body(i, false)).1["choices"][0]["token_ids"].clone()).collect();
    for (mode, stream) in [("push", false), ("pull", false), ("push", true), ("pull", true)] {
        let what = format!("{mode}{}", if stream { ", streamed" } else { "" });
        let (pp, pk, rp) = (free_port(), free_port(), free_port());
        let _p = tandem(&args(&format!("serve {model} --role prefill --kv-mode {mode} --port {pp} --kv-port {pk}")));
        // The first engine's second rank dies in its third decode step.
        let faults = ["--fault-rank-fails-at-forward 3", ""];
        let d_urls: Vec<String> = faults.iter().map(|_| format!("http://127.0.0.1:{}", free_port())).collect();
        let _d: Vec<Proc> = faults
            .iter()
            .zip(&d_urls)
            .map(|(fault, url)| {
                let port = url.rsplit(':').next().unwrap();
                tandem(&args(&format!(
                    "serve {model} --tensor-parallel-size 2 --role decode --kv-mode {mode} --port {port} --kv-port {} {fault}",
                    free_port()
                )))
            })
            .collect();
        let _r = tandem(&args(&format!(
            "router --mode {mode} --prefill http://127.0.0.1:{pp} --decode {} --port {rp}",
            d_urls.join(",")
        )));
        let r_url = format!("http://127.0.0.1:{rp}");
        wait_healthy(&http, &r_url);
        for (i, want) in want.iter().enumerate() {
            let got = if stream {
                let got = read_stream(&r_url, "/v1/completions", &body(i as u32, true), std::sync::mpsc::channel().0);
                assert!(got.errors.is_empty() && got.done, "{what}: request {i}: {:?}", got.errors);
                json!(got.ids)
            } else {
                let (status, v) = complete(&http, &r_url, &body(i as u32, false));
                assert_eq!(status, 200, "{what}: request {i}: {v}");
                v["choices"][0]["token_ids"].clone()
            };
            assert_eq!(&got, want, "{what}: request {i}");
        }
        let failed = metric(&http, &d_urls[0], "tandem:request_errors_total");
        assert!(failed.is_some_and(|n| n >= 1.0), "{what}: the faulty engine's rank never died: {failed:?}");
        let served = metric(&http, &d_urls[0], "tandem:request_success_total").unwrap_or(0.0);
        assert!(served >= 1.0, "{what}: the engine that failed a request took none after it");
        blocks_back(&http, d_urls.iter().chain([&format!("http://127.0.0.1:{pp}")]));
    }
}

/// With another prefill engine up, a request whose prefill engine's rank dies mid-prefill is
/// computed by the other one (push: a new pair; pull: the other engine's lease), answering as
/// colocated; the engine that failed it serves on.
#[test]
fn a_prefill_engine_whose_rank_dies_hands_the_request_to_another() {
    let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
    let model = "--model preset:tiny-qwen3-tp";
    let (_c, c_url) = colocated(&http, model);
    let body = |i: u32| {
        let prompt: Vec<u32> = (0..200).map(|j| (j * 7 + i * 11) % 500).collect();
        json!({"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": true})
    };
    let want: Vec<Value> =
        (0..4).map(|i| complete(&http, &c_url, &body(i)).1["choices"][0]["token_ids"].clone()).collect();
    for mode in ["push", "pull"] {
        // 32 tokens a step; the first engine's second rank dies in its fourth.
        let faults = ["--fault-rank-fails-at-forward 4", ""];
        let p_urls: Vec<String> = faults.iter().map(|_| format!("http://127.0.0.1:{}", free_port())).collect();
        let _p: Vec<Proc> = faults
            .iter()
            .zip(&p_urls)
            .map(|(fault, url)| {
                let port = url.rsplit(':').next().unwrap();
                tandem(&args(&format!(
                    "serve {model} --tensor-parallel-size 2 --max-num-batched-tokens 32 --role prefill --kv-mode {mode} --port {port} --kv-port {} {fault}",
                    free_port()
                )))
            })
            .collect();
        let (dp, rp) = (free_port(), free_port());
        let _d = tandem(&args(&format!(
            "serve {model} --role decode --kv-mode {mode} --port {dp} --kv-port {}",
            free_port()
        )));
        let _r = tandem(&args(&format!(
            "router --mode {mode} --prefill {} --decode http://127.0.0.1:{dp} --port {rp}",
            p_urls.join(",")
        )));
        let r_url = format!("http://127.0.0.1:{rp}");
        wait_healthy(&http, &r_url);
        for (i, want) in want.iter().enumerate() {
            let (status, v) = complete(&http, &r_url, &body(i as u32));
            assert_eq!(status, 200, "{mode}: request {i}: {v}");
            assert_eq!(&v["choices"][0]["token_ids"], want, "{mode}: request {i}");
        }
        let failed = metric(&http, &p_urls[0], "tandem:request_errors_total");
        assert!(failed.is_some_and(|n| n >= 1.0), "{mode}: the faulty engine's rank never died: {failed:?}");
        blocks_back(&http, p_urls.iter().chain([&format!("http://127.0.0.1:{dp}")]));
    }
}

/// A dense model and a mixture of experts (whose tokens' experts differ within one batch).
#[test]
fn push_and_pull_across_processes_equal_colocated() {
    let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
    let bodies = mixed_requests();
    for model in ["preset:tiny-qwen3", "preset:tiny-qwen3-moe"] {
        let (_c, c_url) = colocated(&http, &format!("--model {model}"));
        let want = run_concurrently(&c_url, &bodies);
        for mode in ["push", "pull"] {
            let s = system(mode, &format!("--model {model}"), &format!("--model {model}"));
            let got = run_concurrently(&s.r_url, &bodies);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g, w, "{model}, {mode}: request {i}: {}", bodies[i]);
            }
            // Counters are published by the engine loop a moment after the transfer.
            let deadline = Instant::now() + Duration::from_secs(5);
            while kv_counter(&http, &s.p_url, "transfers_ok") != Some(bodies.len() as f64) {
                assert!(Instant::now() < deadline, "{model}, {mode}: prefill did not count {} transfers", bodies.len());
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// FP8 KV caches (`--kv-cache-dtype fp8`) on both engines: push, and pull from a prefill engine
/// of two tensor-parallel ranks, answer the mixed requests (all at once) as an FP8 colocated
/// engine does and give every block back; push moves a quarter of the bytes an f32 pair moves
/// for the same requests.
#[test]
fn fp8_kv_caches_answer_as_an_fp8_colocated_engine_and_move_a_quarter_of_the_bytes() {
    let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
    let bodies = mixed_requests();
    let fp8 = "--kv-cache-dtype fp8";
    let (_c, c_url) = colocated(&http, fp8);
    let want = run_concurrently(&c_url, &bodies);
    // Decode's received bytes, once it has counted every transfer.
    let received = |s: &System| {
        let deadline = Instant::now() + Duration::from_secs(5);
        while kv_counter(&http, &s.d_url, "transfers_ok") != Some(bodies.len() as f64) {
            assert!(Instant::now() < deadline, "decode did not count {} transfers", bodies.len());
            std::thread::sleep(Duration::from_millis(20));
        }
        kv_counter(&http, &s.d_url, "bytes_received").unwrap_or(0.0)
    };
    let mut fp8_bytes = 0.0;
    for (mode, p_extra) in [("push", fp8.to_string()), ("pull", format!("{fp8} --tensor-parallel-size 2"))] {
        let s = system(mode, &p_extra, fp8);
        let got = run_concurrently(&s.r_url, &bodies);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "{mode}: request {i}: {}", bodies[i]);
        }
        blocks_back(&http, [&s.p_url, &s.d_url]);
        if mode == "push" {
            fp8_bytes = received(&s);
        }
    }
    let s = system("push", "", "");
    run_concurrently(&s.r_url, &bodies);
    let f32_bytes = received(&s);
    assert!(fp8_bytes > 0.0 && fp8_bytes * 4.0 == f32_bytes, "fp8 moved {fp8_bytes} bytes, f32 {f32_bytes}");
}

#[test]
fn a_prefill_process_killed_mid_prefill_ends_the_request_and_frees_decode_blocks() {
    let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
    // One token per prefill step: the long prompt keeps prefill busy while we kill it.
    let mut s = system("push", "--max-num-batched-tokens 1", "--kv-load-failure fail --kv-transfer-timeout-secs 5");
    let prompt: Vec<u32> = (0..3000).map(|j| (j % 500) as u32).collect();
    let body = json!({"prompt": prompt, "max_tokens": 4, "temperature": 0});
    let r_url = s.r_url.clone();
    let client = std::thread::spawn(move || {
        let start = Instant::now();
        let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
        let (status, v) = complete(&http, &r_url, &body);
        (status, v, start.elapsed())
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    while metric(&http, &s.p_url, "tandem:num_requests_running") != Some(1.0) {
        assert!(Instant::now() < deadline, "prefill never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    s.p.0.kill().unwrap();
    let (status, v, took) = client.join().unwrap();
    assert!(status >= 500, "expected a 5xx, got {status}: {v}");
    assert!(v["error"]["message"].as_str().is_some_and(|m| m.contains("prefill")), "{v}");
    assert!(took < Duration::from_secs(30), "bounded: {took:?}");
    let deadline = Instant::now() + Duration::from_secs(15);
    while metric(&http, &s.d_url, "tandem:kv_blocks_used") != Some(0.0) {
        assert!(Instant::now() < deadline, "decode kept blocks after prefill died");
        std::thread::sleep(Duration::from_millis(50));
    }
    // The decode engine is still alive and serving.
    assert_eq!(http.get(format!("{}/health", s.d_url)).send().unwrap().status(), 200);
    let (status, _) = complete(&http, &s.d_url, &json!({"prompt": [1, 2, 3], "max_tokens": 2}));
    assert_eq!(status, 200);
    // A new prefill process on the same ports (a new epoch): decode must not trust its cached
    // connection to the dead one; it re-handshakes and the next request goes through.
    s.p.0.wait().ok();
    s.p = tandem(&s.p_args);
    wait_healthy(&http, &s.p_url);
    let (status, v) = complete(&http, &s.r_url, &json!({"prompt": [5, 6, 7, 8], "max_tokens": 3, "ignore_eos": true}));
    assert_eq!(status, 200, "after the prefill restart: {v}");
    assert_eq!(v["choices"][0]["token_ids"].as_array().map(Vec::len), Some(3));
    assert!(v["kv_timeline"]["transfer"]["bytes"].as_u64().unwrap_or(0) > 0, "the KV came from the new prefill: {v}");
}

/// Waits (bounded) until metric `name` on `url` satisfies `pred`; fails saying `what` if not.
fn metric_until(http: &reqwest::blocking::Client, url: &str, name: &str, pred: impl Fn(f64) -> bool, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !metric(http, url, name).is_some_and(&pred) {
        assert!(Instant::now() < deadline, "{url}: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A colocated engine (`serve` with `args`), healthy: its process and URL.
fn colocated(http: &reqwest::blocking::Client, args_: &str) -> (Proc, String) {
    let port = free_port();
    let p = tandem(&args(&format!("serve {args_} --port {port}")));
    let url = format!("http://127.0.0.1:{port}");
    wait_healthy(http, &url);
    (p, url)
}

/// Waits (bounded) until none of the engines at `urls` holds a KV block.
fn blocks_back<'a>(http: &reqwest::blocking::Client, urls: impl IntoIterator<Item = &'a String>) {
    for url in urls {
        metric_until(http, url, "tandem:kv_blocks_used", |b| b == 0.0, "an engine kept blocks");
    }
}

/// With another prefill engine to go to, a request whose prefill engine is killed mid-prefill
/// is not lost: the router sends it to a new pair (nothing of it had reached the client).
#[test]
fn a_prefill_process_killed_mid_prefill_with_another_one_up_loses_no_request() {
    let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
    let (dp, dk, rp) = (free_port(), free_port(), free_port());
    let p_ports: Vec<(u16, u16)> = (0..2).map(|_| (free_port(), free_port())).collect();
    let mut p: Vec<Proc> = p_ports
        .iter()
        .map(|(pp, pk)| {
            tandem(&args(&format!(
                "serve --role prefill --kv-mode push --port {pp} --kv-port {pk} --max-num-batched-tokens 2"
            )))
        })
        .collect();
    let _d = tandem(&args(&format!("serve --role decode --kv-mode push --port {dp} --kv-port {dk}")));
    let p_url: Vec<String> = p_ports.iter().map(|(pp, _)| format!("http://127.0.0.1:{pp}")).collect();
    let _r = tandem(&args(&format!(
        "router --mode push --prefill {} --decode http://127.0.0.1:{dp} --port {rp}",
        p_url.join(",")
    )));
    let r_url = format!("http://127.0.0.1:{rp}");
    wait_healthy(&http, &r_url);
    let prompt: Vec<u32> = (0..2000).map(|j| (j % 500) as u32).collect();
    let body = json!({"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": true});
    let url = r_url.clone();
    let client = std::thread::spawn(move || {
        let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
        complete(&http, &url, &body)
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    let victim = loop {
        let busy = |u: &String| metric(&http, u, "tandem:num_requests_running") == Some(1.0);
        if let Some(i) = p_url.iter().position(busy) {
            break i;
        }
        assert!(Instant::now() < deadline, "the request never reached a prefill engine");
        std::thread::sleep(Duration::from_millis(10));
    };
    p[victim].0.kill().unwrap();
    p[victim].0.wait().ok();
    let (status, v) = client.join().unwrap();
    assert_eq!(status, 200, "the request was lost with its prefill engine: {v}");
    assert_eq!(v["usage"]["completion_tokens"], 4, "{v}");
    let other = &p_url[1 - victim];
    assert!(
        metric(&http, other, "tandem:request_success_total").unwrap_or(0.0) >= 1.0,
        "the other prefill engine did not take it"
    );
}

#[test]
fn a_decode_process_killed_mid_request_frees_prefill_kv_and_the_router_fails_over_and_takes_it_back() {
    let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
    for mode in ["push", "pull"] {
        let (pp, pk, rp) = (free_port(), free_port(), free_port());
        // One token per prefill step: the long prompt keeps the request in flight while a
        // decode engine is killed.
        let _p = tandem(&args(&format!(
            "serve --role prefill --kv-mode {mode} --port {pp} --kv-port {pk} --max-num-batched-tokens 2 --kv-verify"
        )));
        let d_args: Vec<Vec<String>> = (0..2)
            .map(|_| {
                args(&format!(
                    "serve --role decode --kv-mode {mode} --port {} --kv-port {} --kv-verify",
                    free_port(),
                    free_port()
                ))
            })
            .collect();
        let mut d: Vec<Proc> = d_args.iter().map(|a| tandem(a)).collect();
        let d_url: Vec<String> = d_args.iter().map(|a| format!("http://127.0.0.1:{}", a[6])).collect();
        let _r = tandem(&args(&format!(
            "router --mode {mode} --prefill http://127.0.0.1:{pp} --decode {} --port {rp} --check-interval-secs 0.5",
            d_url.join(",")
        )));
        let (p_url, r_url) = (format!("http://127.0.0.1:{pp}"), format!("http://127.0.0.1:{rp}"));
        wait_healthy(&http, &r_url);

        // A long request; the decode engine that takes it dies while it is in flight.
        let prompt: Vec<u32> = (0..2000).map(|j| (j % 500) as u32).collect();
        let body = json!({"prompt": prompt, "max_tokens": 4, "temperature": 0});
        let url = r_url.clone();
        let client = std::thread::spawn(move || {
            let start = Instant::now();
            let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
            let (status, v) = complete(&http, &url, &body);
            (status, v, start.elapsed())
        });
        // Push: decode holds registered blocks while prefill computes. Pull: prefill computes,
        // then holds the KV under its lease while decode reads.
        let busy = |u: &String| metric(&http, u, "tandem:kv_blocks_used").is_some_and(|b| b > 0.0);
        let deadline = Instant::now() + Duration::from_secs(30);
        let victim = loop {
            let on = match mode {
                "push" => d_url.iter().position(busy),
                _ => (metric(&http, &p_url, "tandem:num_requests_running") == Some(1.0)).then_some(0),
            };
            if let Some(i) = on {
                break i;
            }
            assert!(Instant::now() < deadline, "{mode}: the request never reached the engines");
            std::thread::sleep(Duration::from_millis(10));
        };
        d[victim].0.kill().unwrap();
        d[victim].0.wait().ok();
        let (status, v, took) = client.join().unwrap();
        // Not streamed, nothing of the answer had reached the client: push tries the request
        // again on a new pair (the live decode engine), and pull has the live one read the KV
        // under the same lease. None is lost.
        assert_eq!(status, 200, "{mode}: {v}");
        assert_eq!(v["usage"]["completion_tokens"], 4, "{mode}: {v}");
        assert!(took < Duration::from_secs(30), "{mode}: bounded: {took:?}");
        // Prefill frees the prompt's KV at once (not after its 30 s lease or transfer timeout).
        metric_until(&http, &p_url, "tandem:kv_blocks_used", |b| b == 0.0, "prefill kept the dead decode's KV");

        // Until the check finds it down, and after: no request is lost to the dead engine.
        let live = &d_url[1 - victim];
        for i in 0..6 {
            let body = json!({"prompt": [i + 1, 2, 3, 4, 5], "max_tokens": 3, "temperature": 0, "ignore_eos": true});
            let (status, v) = complete(&http, &r_url, &body);
            assert_eq!(status, 200, "{mode}: request {i} after the kill: {v}");
            let (_, want) = complete(&http, live, &body);
            assert_eq!(v["choices"][0]["token_ids"], want["choices"][0]["token_ids"], "{mode}: request {i}");
        }
        // Restarted on its ports, it takes requests again.
        d[victim] = tandem(&d_args[victim]);
        wait_healthy(&http, &d_url[victim]);
        let deadline = Instant::now() + Duration::from_secs(20);
        while metric(&http, &d_url[victim], "tandem:request_success_total").unwrap_or(0.0) == 0.0 {
            assert!(Instant::now() < deadline, "{mode}: the restarted decode engine never took a request");
            let (status, v) = complete(&http, &r_url, &json!({"prompt": [9, 8, 7], "max_tokens": 2}));
            assert_eq!(status, 200, "{mode}: {v}");
            std::thread::sleep(Duration::from_millis(100));
        }
        for u in &d_url {
            metric_until(&http, u, "tandem:kv_blocks_used", |b| b == 0.0, "decode kept blocks");
        }
    }
}

/// What a client read of a streamed completion: its token ids and text, error events, and
/// whether `[DONE]` ended it.
#[derive(Default)]
struct Streamed {
    ids: Vec<u64>,
    text: String,
    errors: Vec<String>,
    done: bool,
    /// A chat chunk carried token ids.
    chat_ids: bool,
    /// Each token's log-probability entry (a completion's as [token, logprob, text offset, top
    /// alternatives]; a chat's as it comes).
    logprobs: Vec<Value>,
}

/// Reads a streamed completion or chat from `url` + `path`, saying on `first` once its first
/// tokens came.
fn read_stream(url: &str, path: &str, body: &Value, first: std::sync::mpsc::Sender<()>) -> Streamed {
    use std::io::BufRead;
    let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(120)).build().unwrap();
    let resp = http.post(format!("{url}{path}")).json(body).send().unwrap();
    assert_eq!(resp.status(), 200);
    let mut got = Streamed::default();
    for line in std::io::BufReader::new(resp).lines() {
        let Some(data) = line.unwrap().strip_prefix("data: ").map(str::to_string) else { continue };
        if data == "[DONE]" {
            got.done = true;
            continue;
        }
        let v: Value = serde_json::from_str(&data).unwrap();
        if v.get("error").is_some() {
            got.errors.push(data);
            continue;
        }
        for c in v["choices"].as_array().into_iter().flatten() {
            got.ids.extend(c["token_ids"].as_array().into_iter().flatten().filter_map(Value::as_u64));
            got.text.push_str(c["text"].as_str().or(c["delta"]["content"].as_str()).unwrap_or_default());
            if c.get("token_ids").is_some() && c.get("delta").is_some() {
                got.chat_ids = true;
            }
            let lps = &c["logprobs"];
            got.logprobs.extend(lps["content"].as_array().into_iter().flatten().cloned());
            for (i, token) in lps["tokens"].as_array().into_iter().flatten().enumerate() {
                let entry = |k: &str| lps[k][i].clone();
                got.logprobs.push(json!([token, entry("token_logprobs"), entry("text_offset"), entry("top_logprobs")]));
            }
        }
        if !got.ids.is_empty() {
            let _ = first.send(());
        }
    }
    got
}

/// A streamed answer whose decode engine is killed after its first tokens goes on from the
/// other decode engine: the client reads one whole answer, each token once and no error event,
/// token for token and character for character what a live engine answers, log-probabilities
/// too, and the router counts the resume. A completion over push, a chat over pull; blocks back
/// everywhere.
#[test]
fn a_decode_process_killed_mid_stream_is_resumed_on_another_and_the_client_reads_one_whole_answer() {
    let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(120)).build().unwrap();
    for (mode, path) in [("push", "/v1/completions"), ("pull", "/v1/chat/completions")] {
        let (pp, rp) = (free_port(), free_port());
        let _p = tandem(&args(&format!("serve --role prefill --kv-mode {mode} --port {pp} --kv-port {}", free_port())));
        let d_ports: Vec<u16> = (0..2).map(|_| free_port()).collect();
        let mut d: Vec<Proc> = d_ports
            .iter()
            .map(|port| {
                tandem(&args(&format!("serve --role decode --kv-mode {mode} --port {port} --kv-port {}", free_port())))
            })
            .collect();
        let d_url: Vec<String> = d_ports.iter().map(|p| format!("http://127.0.0.1:{p}")).collect();
        let _r = tandem(&args(&format!(
            "router --mode {mode} --prefill http://127.0.0.1:{pp} --decode {} --port {rp} --check-interval-secs 0.5",
            d_url.join(",")
        )));
        let (p_url, r_url) = (format!("http://127.0.0.1:{pp}"), format!("http://127.0.0.1:{rp}"));
        wait_healthy(&http, &r_url);

        // Long enough that the engine is killed while it is still generating.
        let mut body = json!({"max_tokens": 3000, "temperature": 0, "ignore_eos": true, "stream": true});
        if path.contains("chat") {
            body["logprobs"] = json!(true);
            body["top_logprobs"] = json!(2);
            body["messages"] = json!([{"role": "user", "content": "once upon a time"}]);
            // Token ids the router asked for itself are taken out of the client's chunks.
            let mut short = body.clone();
            short["max_tokens"] = json!(4);
            let plain = read_stream(&r_url, path, &short, std::sync::mpsc::channel().0);
            assert!(plain.done && !plain.chat_ids, "{mode}: chat chunks carry ids nobody asked for");
            body["return_token_ids"] = json!(true);
        } else {
            body["prompt"] = json!("once upon a time");
            body["logprobs"] = json!(2);
        }
        let want = read_stream(&d_url[0], path, &body, std::sync::mpsc::channel().0);
        assert!(want.done && want.ids.len() == 3000, "{mode}: {:?}", want.errors);
        let (first_tx, first_rx) = std::sync::mpsc::channel();
        let (url, b) = (r_url.clone(), body.clone());
        let client = std::thread::spawn(move || read_stream(&url, path, &b, first_tx));
        first_rx.recv_timeout(Duration::from_secs(60)).expect("no first token");
        let running = |u: &String| metric(&http, u, "tandem:num_requests_running") == Some(1.0);
        let deadline = Instant::now() + Duration::from_secs(10);
        let victim = loop {
            if let Some(i) = d_url.iter().position(running) {
                break i;
            }
            let now: Vec<_> = d_url.iter().map(|u| metric(&http, u, "tandem:num_requests_running")).collect();
            assert!(Instant::now() < deadline, "{mode}: no decode engine runs it: {now:?}");
            std::thread::sleep(Duration::from_millis(5));
        };
        d[victim].0.kill().unwrap();
        d[victim].0.wait().ok();
        let got = client.join().unwrap();

        assert!(got.errors.is_empty(), "{mode}: {:?}", got.errors);
        assert!(got.done, "{mode}: the stream ended without [DONE]");
        assert_eq!(got.ids.len(), 3000, "{mode}");
        assert!(got.ids == want.ids, "{mode}: the resumed answer differs from a live engine's");
        assert!(got.text == want.text, "{mode}: the resumed text differs from a live engine's");
        assert_eq!(want.logprobs.len(), 3000, "{mode}");
        if let Some(i) = (0..3000).find(|&i| got.logprobs.get(i) != want.logprobs.get(i)) {
            panic!("{mode}: logprobs differ at token {i}: {:?} vs {:?}", got.logprobs.get(i), want.logprobs[i]);
        }
        assert_eq!(got.logprobs.len(), 3000, "{mode}");
        let health: Value = http.get(format!("{r_url}/health")).send().unwrap().json().unwrap_or(Value::Null);
        assert_eq!(health["resumed_streams"], 1, "{mode}: {health}");
        let live = &d_url[1 - victim];
        metric_until(&http, live, "tandem:kv_blocks_used", |b| b == 0.0, "decode kept blocks");
        metric_until(&http, &p_url, "tandem:kv_blocks_used", |b| b == 0.0, "prefill kept blocks");
    }
}

#[cfg(target_os = "linux")]
#[test]
fn a_frozen_prefill_process_is_declared_dead_within_the_liveness_bound_and_trusted_again_only_after_a_new_handshake() {
    use nix::sys::signal::{kill, Signal};
    use nix::unistd::Pid;
    let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
    // A long prefill (two tokens a step) that freezes mid-way, its KV connection open.
    let s = system(
        "push",
        "--max-num-batched-tokens 2 --kv-liveness-secs 1",
        "--kv-liveness-secs 1 --kv-load-failure recompute",
    );
    let prompt: Vec<u32> = (0..1500).map(|j| (j * 7 % 500) as u32).collect();
    let body = json!({"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": true});
    let (_, want) = complete(&http, &s.d_url, &body);
    let (r_url, b) = (s.r_url.clone(), body.clone());
    let client = std::thread::spawn(move || {
        let start = Instant::now();
        let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
        let (status, v) = complete(&http, &r_url, &b);
        (status, v, start.elapsed())
    });
    // Decode has handshaken with prefill and registered; prefill is computing.
    metric_until(&http, &s.d_url, "tandem:kv_connector{counter=\"links_tcp\"}", |n| n >= 1.0, "decode never connected");
    metric_until(&http, &s.p_url, "tandem:num_requests_running", |n| n == 1.0, "prefill never started");
    let pid = Pid::from_raw(s.p.0.id() as i32);
    kill(pid, Signal::SIGSTOP).unwrap();
    let frozen = Instant::now();
    let (status, v, _) = client.join().unwrap();
    let took = frozen.elapsed();
    kill(pid, Signal::SIGCONT).unwrap();
    // Decode stopped waiting after about the liveness bound (not its 30 s transfer timeout)
    // and recomputed the prompt itself.
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["token_ids"], want["choices"][0]["token_ids"], "recomputed to the same tokens");
    assert!(took < Duration::from_secs(10), "declared dead after {took:?}");
    // Awake again: prefill is used again only over a new connection and handshake, and the KV
    // comes from it.
    let small = json!({"prompt": [3, 1, 4, 1, 5], "max_tokens": 3, "temperature": 0, "ignore_eos": true});
    let (_, want) = complete(&http, &s.d_url, &small);
    let (status, v) = complete(&http, &s.r_url, &small);
    assert_eq!(status, 200, "after the thaw: {v}");
    assert_eq!(v["choices"][0]["token_ids"], want["choices"][0]["token_ids"]);
    assert!(v["kv_timeline"]["transfer"]["bytes"].as_u64().unwrap_or(0) > 0, "the KV came from prefill: {v}");
    metric_until(&http, &s.d_url, "tandem:kv_connector{counter=\"links_tcp\"}", |n| n >= 2.0, "no new connection");
    for u in [&s.p_url, &s.d_url] {
        metric_until(&http, u, "tandem:kv_blocks_used", |b| b == 0.0, "blocks not back");
    }
}

/// `--api-key` across processes: the engines read their key from TANDEM_API_KEY, the router
/// its keys from a flag and a file, and sends the first to the engines. A client with either
/// router key is answered; one without a key, or with a key only the file comments out, gets
/// a 401; an engine asked directly without its key refuses too.
#[test]
fn api_keys_from_flags_files_and_the_environment_guard_every_process() {
    let http = reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
    let (pp, pk, dp, dk, rp) = (free_port(), free_port(), free_port(), free_port(), free_port());
    let engine = |role: &str, port: u16, kv_port: u16| {
        let a = args(&format!("--log warn serve --role {role} --kv-mode push --port {port} --kv-port {kv_port}"));
        let child = Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args(a)
            .env("TANDEM_API_KEY", "sk-one")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        Proc(child)
    };
    let (_p, _d) = (engine("prefill", pp, pk), engine("decode", dp, dk));
    let file = std::env::temp_dir().join(format!("tandem-keys-{}", std::process::id()));
    std::fs::write(&file, "# the router's second key\nsk-two\n# sk-three\n").unwrap();
    let _r = tandem(&args(&format!(
        "router --prefill http://127.0.0.1:{pp} --decode http://127.0.0.1:{dp} --port {rp} --api-key sk-one --api-key-file {}",
        file.display()
    )));
    let r_url = format!("http://127.0.0.1:{rp}");
    wait_healthy(&http, &r_url);
    let body = json!({"prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": true});
    let post = |url: &str, key: Option<&str>| {
        let mut req = http.post(format!("{url}/v1/completions")).json(&body);
        if let Some(k) = key {
            req = req.bearer_auth(k);
        }
        req.send().unwrap().status().as_u16()
    };
    assert_eq!((post(&r_url, Some("sk-one")), post(&r_url, Some("sk-two"))), (200, 200));
    assert_eq!((post(&r_url, None), post(&r_url, Some("sk-three"))), (401, 401));
    let p_url = format!("http://127.0.0.1:{pp}");
    assert_eq!((post(&p_url, None), post(&p_url, Some("sk-two"))), (401, 401), "the engine takes only its own key");
    let _ = std::fs::remove_file(file);
}
