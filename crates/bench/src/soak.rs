//! `tandem bench soak`: minutes of load past capacity through a disaggregated system, with
//! client cancellations and (from the binary) frozen engines, checking what a user must be able
//! to trust: no request is lost, none is answered from wrong KV, no KV block leaks.
//!
//! Every prompt comes from a fixed pool whose greedy answers a reference (colocated) engine
//! gave first; each completed answer is compared with its reference token for token. A request
//! may end with an error while an engine is frozen (a bounded failure); it may never hang past
//! the client's bound (`lost`) or return other tokens (`wrong`). Starting, freezing and
//! stopping the processes is the binary's job; this module loads URLs and reads `/metrics`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};

/// One soak run's setup.
#[derive(Clone, Debug)]
pub struct SoakConfig {
    /// Where requests go (a router).
    pub base_url: String,
    /// How long requests are sent.
    pub duration: Duration,
    /// Requests per second (Poisson arrivals).
    pub rate: f64,
    /// Fraction of requests the client abandons after a random delay of up to 300 ms.
    pub cancel_fraction: f64,
    /// A request with no complete answer after this long is lost.
    pub request_timeout: Duration,
    /// Seed of arrivals, prompt choice and cancellations.
    pub seed: u64,
}

/// A prompt of the pool and its reference answer.
#[derive(Clone, Debug)]
pub struct PoolEntry {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Tokens generated.
    pub max_tokens: usize,
    /// The reference engine's greedy tokens.
    pub want: Vec<u64>,
}

/// What a soak saw. `wrong` and `lost` must be 0.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct SoakReport {
    /// Requests sent.
    pub sent: usize,
    /// Answered in full.
    pub completed: usize,
    /// Abandoned by the client on purpose.
    pub cancelled: usize,
    /// Ended with an error (an HTTP error, or an error event in the stream), other than a
    /// refusal.
    pub errored: usize,
    /// Refused with a 429 (past the server's `--max-queued-requests`) or a 503 with
    /// `Retry-After` (queued past `--max-queue-secs` without running): it says when to retry.
    pub refused: usize,
    /// Answered with tokens other than the reference's.
    pub wrong: usize,
    /// No answer within the client's bound.
    pub lost: usize,
    /// Median and 99th percentile of the completed requests' end-to-end latency, ms.
    pub p50_e2e_ms: f64,
    /// As above, 99th percentile.
    pub p99_e2e_ms: f64,
    /// The first error messages seen (up to 5), for the report.
    pub sample_errors: Vec<String>,
    /// The first wrong answers (up to 5): which prompt, streamed or not, where the tokens part.
    pub sample_wrong: Vec<String>,
    /// The first lost requests (up to 5): which prompt, streamed or not.
    pub sample_lost: Vec<String>,
}

/// One line about request `entry` of the pool for a report sample.
fn describe(pool: &[PoolEntry], entry: usize, stream: bool) -> String {
    let e = &pool[entry];
    let how = if stream { "streamed" } else { "not streamed" };
    format!("pool entry {entry} ({} prompt tokens, {} out, {how})", e.prompt.len(), e.max_tokens)
}

/// `n` prompts of mixed lengths (1 token to several hundred) and output lengths, seeded. Every
/// other one of 16 tokens or more begins with the first three quarters of its length of one
/// shared text, so prefix caches hold parts of prompts and transfers skip what decode holds,
/// at many offsets, while the faults run.
pub fn prompt_pool(n: usize, vocab: u32, seed: u64) -> Vec<(Vec<u32>, usize)> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let lens = [1usize, 7, 16, 33, 100, 260, 600];
    let outs = [1usize, 4, 16, 40];
    let shared: Vec<u32> = (0..600).map(|_| rng.random_range(0..vocab)).collect();
    (0..n)
        .map(|i| {
            let len = lens[i % lens.len()];
            let from_shared = if i % 2 == 1 && len >= 16 { len * 3 / 4 } else { 0 };
            let mut prompt = shared[..from_shared].to_vec();
            prompt.extend((from_shared..len).map(|_| rng.random_range(0..vocab)));
            (prompt, outs[(i / lens.len()) % outs.len()])
        })
        .collect()
}

fn body(prompt: &[u32], max_tokens: usize, stream: bool) -> Value {
    json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true, "stream": stream})
}

/// How one request ended.
enum Outcome {
    Tokens(Vec<u64>),
    Error(String),
    Refused,
}

/// Sends one completion and reads its answer (streamed or not) to the end.
async fn complete(http: &reqwest::Client, url: &str, body: &Value) -> Outcome {
    let resp = match http.post(format!("{url}/v1/completions")).json(body).send().await {
        Ok(r) => r,
        Err(e) => return Outcome::Error(format!("sending: {e}")),
    };
    let status = resp.status().as_u16();
    if status == 429 || (status == 503 && resp.headers().contains_key("retry-after")) {
        return Outcome::Refused;
    }
    let mut text = Vec::new();
    let mut chunks = resp.bytes_stream();
    while let Some(c) = chunks.next().await {
        match c {
            Ok(c) => text.extend_from_slice(&c),
            Err(e) => return Outcome::Error(format!("reading the answer: {e}")),
        }
    }
    let text = String::from_utf8_lossy(&text);
    if status != 200 {
        return Outcome::Error(format!("HTTP {status}: {text}"));
    }
    let parts: Vec<&str> = if body["stream"] == json!(true) {
        text.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).filter(|e| *e != "[DONE]").collect()
    } else {
        vec![&text]
    };
    let mut ids = Vec::new();
    for p in parts {
        let v: Value = match serde_json::from_str(p) {
            Ok(v) => v,
            Err(e) => return Outcome::Error(format!("unreadable answer ({e}): {p}")),
        };
        if let Some(err) = v.get("error") {
            return Outcome::Error(err.to_string());
        }
        ids.extend(v["choices"][0]["token_ids"].as_array().into_iter().flatten().filter_map(Value::as_u64));
    }
    Outcome::Tokens(ids)
}

/// The reference answers for `prompts`, from the engine at `url` (one request at a time).
pub async fn references(url: &str, prompts: Vec<(Vec<u32>, usize)>) -> Result<Vec<PoolEntry>, String> {
    let http = reqwest::Client::new();
    let mut pool = Vec::new();
    for (prompt, max_tokens) in prompts {
        match complete(&http, url, &body(&prompt, max_tokens, false)).await {
            Outcome::Tokens(want) => pool.push(PoolEntry { prompt, max_tokens, want }),
            Outcome::Error(e) => return Err(format!("reference engine at {url}: {e}")),
            Outcome::Refused => return Err(format!("reference engine at {url} refused a request (429)")),
        }
    }
    Ok(pool)
}

/// Completed requests per second with `concurrency` clients for `for_how_long`: the rate the
/// system sustains, which the soak runs past.
pub async fn capacity(url: &str, pool: &[PoolEntry], concurrency: usize, for_how_long: Duration) -> f64 {
    let http = reqwest::Client::new();
    let start = Instant::now();
    let pool = Arc::new(pool.to_vec());
    let workers: Vec<_> = (0..concurrency)
        .map(|w| {
            let (http, url, pool) = (http.clone(), url.to_string(), pool.clone());
            tokio::spawn(async move {
                let mut done = 0usize;
                let mut i = w;
                while start.elapsed() < for_how_long {
                    let e = &pool[i % pool.len()];
                    if let Outcome::Tokens(_) = complete(&http, &url, &body(&e.prompt, e.max_tokens, false)).await {
                        done += 1;
                    }
                    i += concurrency;
                }
                done
            })
        })
        .collect();
    let mut done = 0;
    for w in workers {
        done += w.await.unwrap_or(0);
    }
    done as f64 / start.elapsed().as_secs_f64()
}

/// Runs the soak: Poisson arrivals at `cfg.rate` for `cfg.duration`, each request a random
/// pool entry, streamed or not, some abandoned; waits for every request to end (each bounded
/// by `cfg.request_timeout`). `progress` gets a line every 10 s.
pub async fn run(cfg: &SoakConfig, pool: &[PoolEntry], mut progress: impl FnMut(&str)) -> SoakReport {
    let http = reqwest::Client::new();
    let mut rng = ChaCha8Rng::seed_from_u64(cfg.seed);
    let pool = Arc::new(pool.to_vec());
    let start = Instant::now();
    let mut next = Duration::ZERO;
    let mut tasks = Vec::new();
    // (pool entry, streamed) of each task.
    let mut requests = Vec::new();
    let mut last_note = Instant::now();
    while next < cfg.duration {
        tokio::time::sleep_until((start + next).into()).await;
        let entry = rng.random_range(0..pool.len());
        let stream = rng.random_bool(0.5);
        let cancel_after = rng
            .random_bool(cfg.cancel_fraction.clamp(0.0, 1.0))
            .then(|| Duration::from_millis(rng.random_range(0..300)));
        let (http, url, pool, bound) = (http.clone(), cfg.base_url.clone(), pool.clone(), cfg.request_timeout);
        tasks.push(tokio::spawn(async move {
            let e = &pool[entry];
            let sent = Instant::now();
            let b = body(&e.prompt, e.max_tokens, stream);
            let req = complete(&http, &url, &b);
            if let Some(after) = cancel_after {
                // Dropping the request future is the client going away.
                return match tokio::time::timeout(after, req).await {
                    Ok(outcome) => (Some(outcome), sent.elapsed(), false),
                    Err(_) => (None, sent.elapsed(), true),
                };
            }
            match tokio::time::timeout(bound, req).await {
                Ok(outcome) => (Some(outcome), sent.elapsed(), false),
                Err(_) => (None, sent.elapsed(), false),
            }
        }));
        requests.push((entry, stream));
        // Exponential gaps: a Poisson process at `rate`.
        let u: f64 = rng.random_range(f64::EPSILON..1.0);
        next += Duration::from_secs_f64(-u.ln() / cfg.rate.max(1e-3));
        if last_note.elapsed() >= Duration::from_secs(10) {
            progress(&format!("... {:.0} s, {} requests sent", start.elapsed().as_secs_f64(), tasks.len()));
            last_note = Instant::now();
        }
    }
    let mut r = SoakReport { sent: tasks.len(), ..SoakReport::default() };
    let mut e2e = Vec::new();
    for (t, (entry, stream)) in tasks.into_iter().zip(requests) {
        let want = &pool[entry].want;
        let Ok((outcome, took, cancelled)) = t.await else {
            r.lost += 1;
            continue;
        };
        match outcome {
            None if cancelled => r.cancelled += 1,
            None => {
                r.lost += 1;
                if r.sample_lost.len() < 5 {
                    r.sample_lost.push(format!(
                        "{}: no answer in {:.0} s",
                        describe(&pool, entry, stream),
                        took.as_secs_f64()
                    ));
                }
            }
            Some(Outcome::Refused) => r.refused += 1,
            Some(Outcome::Error(msg)) => {
                r.errored += 1;
                if r.sample_errors.len() < 5 {
                    r.sample_errors.push(msg);
                }
            }
            Some(Outcome::Tokens(got)) => {
                r.completed += 1;
                e2e.push(took.as_secs_f64() * 1e3);
                if &got != want {
                    r.wrong += 1;
                    if r.sample_wrong.len() < 5 {
                        let at = got.iter().zip(want).take_while(|(g, w)| g == w).count();
                        let show = |v: &[u64]| format!("{:?}", &v[at.min(v.len())..v.len().min(at + 8)]);
                        r.sample_wrong.push(format!(
                            "{}: {} tokens, {} wanted, first difference at token {at}: got {} want {}",
                            describe(&pool, entry, stream),
                            got.len(),
                            want.len(),
                            show(&got),
                            show(want)
                        ));
                    }
                }
            }
        }
    }
    e2e.sort_by(f64::total_cmp);
    let pct = |q: f64| e2e.get(((e2e.len() as f64 - 1.0) * q).round() as usize).copied().unwrap_or(0.0);
    r.p50_e2e_ms = pct(0.5);
    r.p99_e2e_ms = pct(0.99);
    r
}

/// A gauge or counter from an engine's `/metrics` (the first series of that name).
pub async fn metric(url: &str, name: &str) -> Option<f64> {
    let text = reqwest::Client::new()
        .get(format!("{url}/metrics"))
        .timeout(Duration::from_secs(5))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    text.lines().find(|l| l.starts_with(name)).and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// An engine's `/kv/info` (its transport, peers and transfer counters), `null` when it does not
/// answer: kept with a soak's report to tell where a wrong answer came from.
pub async fn kv_info(url: &str) -> serde_json::Value {
    let got = async {
        let r =
            reqwest::Client::new().get(format!("{url}/kv/info")).timeout(Duration::from_secs(5)).send().await.ok()?;
        r.json::<serde_json::Value>().await.ok()
    };
    got.await.unwrap_or(serde_json::Value::Null)
}

/// KV blocks each engine still holds once it has been idle (bounded by `wait`): 0 each, or
/// a leak.
pub async fn blocks_held_when_idle(engines: &[String], wait: Duration) -> Vec<f64> {
    let deadline = Instant::now() + wait;
    loop {
        let mut held = Vec::new();
        for e in engines {
            held.push(metric(e, "tandem:kv_blocks_used").await.unwrap_or(f64::NAN));
        }
        if held.iter().all(|&b| b == 0.0) || Instant::now() >= deadline {
            return held;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
