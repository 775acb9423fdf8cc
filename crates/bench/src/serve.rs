//! `tandem bench serve`: a load generator for any OpenAI-compatible server (ours or vLLM's),
//! reporting what `vllm bench serve` reports ([`crate::metrics`]).
//!
//! Requests are streamed completions with usage; arrival gaps come from a gamma distribution
//! with shape = burstiness and mean 1/rate (burstiness 1 is Poisson), optionally capped by
//! `max_concurrency`. Failed requests are counted and their errors kept.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Gamma};
use serde_json::{json, Value};

use crate::metrics::{summarize, RequestOutcome, ServeSummary, Slo};

/// Where prompts come from.
#[derive(Clone, Debug)]
pub enum Dataset {
    /// Fixed-length random prompts (vLLM's `random`).
    Random {
        /// Prompt tokens (before the range ratio).
        input_len: usize,
        /// Output tokens (before the range ratio).
        output_len: usize,
        /// Lengths are drawn from `[len * (1 - r), len * (1 + r)]`.
        range_ratio: f64,
        /// Token ids are drawn below this (must not exceed the model's vocabulary).
        vocab_size: u32,
        /// Send prompts as text (random words) instead of token ids.
        as_text: bool,
    },
    /// Synthetic conversations, as chat clients and agents send them: every conversation opens
    /// with the same `shared_len`-token system prompt, then takes `turns` turns, each adding
    /// `turn_len` new user tokens; a turn's prompt is the whole conversation so far, the
    /// server's earlier answers included (the token ids it streamed, where it streams them).
    /// Conversations arrive at the request rate; a conversation's turns follow one another.
    /// `--num-prompts` counts conversations.
    MultiTurn {
        /// Tokens of the system prompt every conversation shares (or, with `distinct_openings`,
        /// of each conversation's own opening).
        shared_len: usize,
        /// Each conversation opens with its own `shared_len` tokens: only its own history is
        /// shared between its turns (what a turn-by-turn cache saving shows alone).
        distinct_openings: bool,
        /// New user tokens per turn.
        turn_len: usize,
        /// Turns per conversation.
        turns: usize,
        /// Output tokens per turn.
        output_len: usize,
        /// Token ids are drawn below this.
        vocab_size: u32,
    },
    /// Multi-turn conversations from a local ShareGPT-format JSON file, through the chat
    /// endpoint: each turn adds the file's next human message to the conversation, whose
    /// assistant messages are the server's own answers; the file's reply to it gives the
    /// output length (in words, at most 1024) unless `output_len` is set. At most `turns`
    /// turns a conversation; conversations arrive at the request rate.
    ShareGptMultiTurn {
        /// The file.
        path: std::path::PathBuf,
        /// Most turns per conversation.
        turns: usize,
        /// Output length override.
        output_len: Option<usize>,
    },
    /// A local ShareGPT-format JSON file: the first human turn is the prompt, the reply's
    /// length (in words) the output length.
    ShareGpt {
        /// The file.
        path: std::path::PathBuf,
        /// Output length override.
        output_len: Option<usize>,
    },
}

/// One request to send.
#[derive(Clone, Debug)]
pub struct SampledRequest {
    /// `prompt` as sent (text or ids).
    pub prompt: Value,
    /// Prompt length as the dataset knows it (the server's usage wins when reported).
    pub prompt_len: usize,
    /// `max_tokens`.
    pub output_len: usize,
}

/// What to run.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// Server base URL, e.g. `http://127.0.0.1:8000`.
    pub base_url: String,
    /// API path.
    pub endpoint: String,
    /// Model name (asked from `/v1/models` when absent).
    pub model: Option<String>,
    /// Label stored as `backend`.
    pub backend: String,
    /// Prompts.
    pub dataset: Dataset,
    /// Requests to send.
    pub num_prompts: usize,
    /// Requests per second (infinity: all at once).
    pub request_rate: f64,
    /// Gamma shape of the arrival gaps (1 = Poisson).
    pub burstiness: f64,
    /// Seed for prompts and arrivals.
    pub seed: u64,
    /// Most requests in flight.
    pub max_concurrency: Option<usize>,
    /// Unmeasured requests sent first.
    pub num_warmups: usize,
    /// Ask the server to ignore end-of-sequence tokens.
    pub ignore_eos: bool,
    /// Percentiles to report.
    pub percentiles: Vec<f64>,
    /// Goodput SLOs.
    pub slo: Option<Slo>,
    /// Show a progress bar.
    pub progress: bool,
    /// Sent as `Authorization: Bearer` on every request (a server with `--api-key`).
    pub api_key: Option<String>,
    /// The CA (PEM) an `https://` server's certificate must chain to.
    pub tls_ca: Option<Vec<u8>>,
}

/// A finished run.
pub struct ServeRun {
    /// The model name used.
    pub model: String,
    /// The requests sent.
    pub requests: Vec<SampledRequest>,
    /// Their outcomes, in the same order.
    pub outcomes: Vec<RequestOutcome>,
    /// The summary.
    pub summary: ServeSummary,
    /// Multi-turn: each request's turn (0 first), in the order of `outcomes`; empty otherwise.
    pub turns: Vec<usize>,
}

const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "river", "stone", "light", "garden", "market", "cloud", "engine", "silver",
    "quiet", "north", "window", "paper", "music", "winter", "field",
];

/// Mixed into the seed of the warm-up requests' draw, so they are not the measured ones.
const WARMUP_SEED: u64 = 0x5741_524d_5550_0000;

/// Draws the requests (deterministic for a seed).
pub fn sample_requests(ds: &Dataset, n: usize, seed: u64) -> Result<Vec<SampledRequest>, String> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    match ds {
        Dataset::Random { input_len, output_len, range_ratio, vocab_size, as_text } => {
            if !(0.0..1.0).contains(range_ratio) {
                return Err(format!("--random-range-ratio must be in [0, 1), got {range_ratio}"));
            }
            if *vocab_size < 2 {
                return Err("--random-vocab-size must be at least 2".into());
            }
            let span = |len: usize, rng: &mut rand_chacha::ChaCha8Rng| {
                let lo = ((len as f64) * (1.0 - range_ratio)) as usize;
                let hi = ((len as f64) * (1.0 + range_ratio)) as usize;
                rng.random_range(lo.max(1)..=hi.max(1))
            };
            Ok((0..n)
                .map(|_| {
                    let (il, ol) = (span(*input_len, &mut rng), span(*output_len, &mut rng));
                    let prompt = if *as_text {
                        json!((0..il).map(|_| WORDS[rng.random_range(0..WORDS.len())]).collect::<Vec<_>>().join(" "))
                    } else {
                        json!((0..il).map(|_| rng.random_range(1..*vocab_size)).collect::<Vec<u32>>())
                    };
                    SampledRequest { prompt, prompt_len: il, output_len: ol }
                })
                .collect())
        }
        Dataset::MultiTurn { .. } | Dataset::ShareGptMultiTurn { .. } => {
            Err("a multi-turn dataset's prompts depend on the answers: use `run`".to_string())
        }
        Dataset::ShareGpt { path, output_len } => {
            let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
            let v: Value = serde_json::from_str(&text).map_err(|e| format!("{}: not JSON: {e}", path.display()))?;
            let convs =
                v.as_array().ok_or_else(|| format!("{}: expected a JSON array of conversations", path.display()))?;
            let mut pool = Vec::new();
            for c in convs {
                let turns = c.get("conversations").and_then(Value::as_array);
                let (Some(q), Some(a)) = (
                    turns.and_then(|t| t.first()).and_then(|t| t.get("value")).and_then(Value::as_str),
                    turns.and_then(|t| t.get(1)).and_then(|t| t.get("value")).and_then(Value::as_str),
                ) else {
                    continue;
                };
                let (ql, al) = (q.split_whitespace().count(), a.split_whitespace().count());
                if ql >= 4 && al >= 4 && ql <= 1024 {
                    pool.push(SampledRequest {
                        prompt: json!(q),
                        prompt_len: ql,
                        output_len: output_len.unwrap_or(al.min(1024)),
                    });
                }
            }
            if pool.is_empty() {
                return Err(format!("{}: no usable conversations (need a human turn and a reply)", path.display()));
            }
            Ok((0..n).map(|_| pool[rng.random_range(0..pool.len())].clone()).collect())
        }
    }
}

/// Arrival offsets (seconds from the start) for `n` requests.
pub fn arrivals(n: usize, rate: f64, burstiness: f64, seed: u64) -> Result<Vec<f64>, String> {
    if rate.is_infinite() {
        return Ok(vec![0.0; n]);
    }
    if rate.is_nan() || rate <= 0.0 || burstiness.is_nan() || burstiness <= 0.0 {
        return Err("--request-rate and --burstiness must be positive".into());
    }
    let gamma = Gamma::new(burstiness, 1.0 / (rate * burstiness)).map_err(|e| e.to_string())?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0x5eed);
    let mut t = 0.0;
    Ok((0..n)
        .map(|_| {
            let at = t;
            t += gamma.sample(&mut rng);
            at
        })
        .collect())
}

/// Sends one streamed request and measures it.
async fn send(http: &reqwest::Client, url: &str, body: &Value, fallback_prompt_len: usize) -> RequestOutcome {
    let mut out = RequestOutcome { prompt_len: fallback_prompt_len, ..Default::default() };
    let start = Instant::now();
    let resp = match http.post(url).json(body).send().await {
        Ok(r) => r,
        Err(e) => {
            out.error = e.to_string();
            return out;
        }
    };
    if !resp.status().is_success() {
        let status = resp.status();
        out.error = format!("HTTP {status}: {}", resp.text().await.unwrap_or_default());
        return out;
    }
    let mut stream = resp.bytes_stream();
    let mut buf = String::new();
    let mut last: Option<Instant> = None;
    let mut chunks = 0usize;
    let mut usage_tokens = None;
    'read: while let Some(piece) = stream.next().await {
        let piece = match piece {
            Ok(p) => p,
            Err(e) => {
                out.error = format!("stream broke: {e}");
                return out;
            }
        };
        buf.push_str(&String::from_utf8_lossy(&piece));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let Some(data) = event.trim().strip_prefix("data: ") else { continue };
            if data == "[DONE]" {
                break 'read;
            }
            let now = Instant::now();
            let v: Value = match serde_json::from_str(data) {
                Ok(v) => v,
                Err(e) => {
                    out.error = format!("bad chunk ({e}): {data}");
                    return out;
                }
            };
            if let Some(err) = v.get("error") {
                out.error = err.to_string();
                return out;
            }
            if let Some(t) = v.get("kv_timeline").filter(|t| !t.is_null()) {
                out.kv_timeline = Some(t.clone());
            }
            let choice = &v["choices"][0];
            if let Some(text) = choice["text"].as_str().or(choice["delta"]["content"].as_str()) {
                out.text.push_str(text);
            }
            if let Some(ids) = v["choices"][0].get("token_ids").and_then(Value::as_array) {
                out.token_ids.extend(ids.iter().filter_map(Value::as_u64).map(|t| t as u32));
            }
            if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                usage_tokens = u.get("completion_tokens").and_then(Value::as_u64);
                if let Some(p) = u.get("prompt_tokens").and_then(Value::as_u64) {
                    out.prompt_len = p as usize;
                }
            }
            if v.get("choices").and_then(Value::as_array).is_some_and(|c| !c.is_empty()) {
                match last {
                    None => out.ttft = (now - start).as_secs_f64(),
                    Some(prev) => out.itl.push((now - prev).as_secs_f64()),
                }
                last = Some(now);
                chunks += 1;
            }
        }
    }
    if last.is_none() {
        out.error = "no tokens streamed".into();
        return out;
    }
    out.latency = start.elapsed().as_secs_f64();
    out.output_len = usage_tokens.map(|n| n as usize).unwrap_or(chunks);
    out.success = true;
    out
}

/// Runs the benchmark. `on_done` is called after each measured request (for a progress bar).
pub async fn run(cfg: &ServeConfig) -> Result<ServeRun, String> {
    let mut headers = reqwest::header::HeaderMap::new();
    if let Some(key) = &cfg.api_key {
        let mut value = reqwest::header::HeaderValue::from_str(&format!("Bearer {key}"))
            .map_err(|_| "the API key cannot go in an HTTP header".to_string())?;
        value.set_sensitive(true);
        headers.insert(reqwest::header::AUTHORIZATION, value);
    }
    let mut http = reqwest::Client::builder().default_headers(headers);
    if let Some(ca) = &cfg.tls_ca {
        for cert in reqwest::Certificate::from_pem_bundle(ca).map_err(|e| format!("--tls-ca: {e}"))? {
            http = http.add_root_certificate(cert);
        }
    }
    let http = http.build().map_err(|e| e.to_string())?;
    let base = cfg.base_url.trim_end_matches('/');
    let model = match &cfg.model {
        Some(m) => m.clone(),
        None => {
            let v: Value = http
                .get(format!("{base}/v1/models"))
                .send()
                .await
                .map_err(|e| format!("asking {base}/v1/models for the model name: {e}"))?
                .json()
                .await
                .map_err(|e| format!("{base}/v1/models: {e}"))?;
            v["data"][0]["id"].as_str().ok_or_else(|| format!("{base}/v1/models lists no model"))?.to_string()
        }
    };
    let url = format!("{base}{}", cfg.endpoint);
    if matches!(cfg.dataset, Dataset::MultiTurn { .. } | Dataset::ShareGptMultiTurn { .. }) {
        // Chat conversations go to the chat endpoint whatever --endpoint says.
        let chat = if cfg.endpoint.contains("chat") { url.clone() } else { format!("{base}/v1/chat/completions") };
        return run_conversations(cfg, &http, &url, &chat, model).await;
    }
    let requests = sample_requests(&cfg.dataset, cfg.num_prompts, cfg.seed)?;
    let offsets = arrivals(cfg.num_prompts, cfg.request_rate, cfg.burstiness, cfg.seed)?;
    let body = |r: &SampledRequest| {
        json!({"model": model, "prompt": r.prompt, "max_tokens": r.output_len, "ignore_eos": cfg.ignore_eos,
               "temperature": 0, "stream": true, "stream_options": {"include_usage": true}})
    };
    // Warm-up prompts of their own: one of the measured prompts sent first would find its KV in
    // the prefix cache when measured, and measure no prefill.
    let warmups = match cfg.num_warmups {
        0 => Vec::new(),
        n => sample_requests(&cfg.dataset, n, cfg.seed ^ WARMUP_SEED)?,
    };
    for r in &warmups {
        let o = send(&http, &url, &body(r), r.prompt_len).await;
        if !o.success {
            return Err(format!("warm-up request failed: {}", o.error));
        }
    }
    let bar = progress_bar(cfg.progress, cfg.num_prompts);
    let limit = cfg.max_concurrency.map(|n| Arc::new(tokio::sync::Semaphore::new(n.max(1))));
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(requests.len());
    for (r, at) in requests.iter().zip(&offsets) {
        let wait = Duration::from_secs_f64(*at).saturating_sub(start.elapsed());
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        let permit = match &limit {
            Some(sem) => Some(sem.clone().acquire_owned().await.map_err(|e| e.to_string())?),
            None => None,
        };
        let (http, url, b, plen, bar) = (http.clone(), url.clone(), body(r), r.prompt_len, bar.clone());
        tasks.push(tokio::spawn(async move {
            let o = send(&http, &url, &b, plen).await;
            drop(permit);
            if let Some(bar) = bar {
                bar.inc(1);
            }
            o
        }));
    }
    let mut outcomes = Vec::with_capacity(tasks.len());
    for t in tasks {
        outcomes.push(
            t.await.unwrap_or_else(|e| RequestOutcome {
                error: format!("request task failed: {e}"),
                ..Default::default()
            }),
        );
    }
    let duration = start.elapsed().as_secs_f64();
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    let summary = summarize(&outcomes, duration, &cfg.percentiles, cfg.slo);
    Ok(ServeRun { model, requests, outcomes, summary, turns: Vec::new() })
}

/// A progress bar over `n` requests, when asked for.
fn progress_bar(show: bool, n: usize) -> Option<indicatif::ProgressBar> {
    show.then(|| {
        let b = indicatif::ProgressBar::new(n as u64);
        b.set_style(
            indicatif::ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} requests ({per_sec})")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        b
    })
}

/// One conversation of a multi-turn run: how each turn's request is made and how the answer
/// joins the conversation.
enum Conversation {
    /// Token ids to the completions endpoint: the history so far and each turn's new user ids;
    /// the server's answer joins as the ids it streamed (a stand-in of the same length from a
    /// server that does not stream ids).
    Ids { history: Vec<u32>, users: Vec<Vec<u32>>, output_len: usize },
    /// Messages to the chat endpoint: each turn adds a user message (with its output length);
    /// the server's answer joins as the assistant's message.
    Chat { messages: Vec<Value>, users: Vec<(String, usize)> },
}

impl Conversation {
    fn turns(&self) -> usize {
        match self {
            Self::Ids { users, .. } => users.len(),
            Self::Chat { users, .. } => users.len(),
        }
    }

    /// Turn `turn`'s request body and what it is sent as.
    fn next(&mut self, turn: usize, model: &str, ignore_eos: bool) -> (Value, SampledRequest) {
        let (input, prompt_len, output_len) = match self {
            Self::Ids { history, users, output_len } => {
                history.extend(users[turn].iter().copied());
                (("prompt", json!(history)), history.len(), *output_len)
            }
            Self::Chat { messages, users } => {
                let (text, output_len) = &users[turn];
                messages.push(json!({"role": "user", "content": text}));
                let words = messages.iter().filter_map(|m| m["content"].as_str()).map(|t| t.split_whitespace().count());
                (("messages", json!(messages)), words.sum(), *output_len)
            }
        };
        let mut body = json!({"model": model, "max_tokens": output_len, "ignore_eos": ignore_eos, "temperature": 0,
                              "stream": true, "stream_options": {"include_usage": true}});
        body[input.0] = input.1.clone();
        (body, SampledRequest { prompt: input.1, prompt_len, output_len })
    }

    fn answer(&mut self, o: &RequestOutcome) {
        match self {
            Self::Ids { history, output_len, .. } => {
                if o.token_ids.is_empty() {
                    history.extend(std::iter::repeat_n(1, *output_len));
                } else {
                    history.extend(&o.token_ids);
                }
            }
            Self::Chat { messages, .. } => messages.push(json!({"role": "assistant", "content": o.text})),
        }
    }
}

/// The conversations a multi-turn dataset holds, `n` of them (deterministic for a seed).
fn conversations(ds: &Dataset, n: usize, seed: u64) -> Result<Vec<Conversation>, String> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    match ds {
        &Dataset::MultiTurn { shared_len, distinct_openings, turn_len, turns, output_len, vocab_size } => {
            if vocab_size < 2 || turns == 0 {
                return Err("a multi-turn dataset needs --random-vocab-size of at least 2 and at least one turn".into());
            }
            let mut draw = |n: usize| -> Vec<u32> { (0..n).map(|_| rng.random_range(1..vocab_size)).collect() };
            let shared = draw(shared_len);
            Ok((0..n)
                .map(|_| {
                    let history = if distinct_openings { draw(shared_len) } else { shared.clone() };
                    Conversation::Ids { history, users: (0..turns).map(|_| draw(turn_len)).collect(), output_len }
                })
                .collect())
        }
        Dataset::ShareGptMultiTurn { path, turns, output_len } => {
            let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
            let v: Value = serde_json::from_str(&text).map_err(|e| format!("{}: not JSON: {e}", path.display()))?;
            let convs =
                v.as_array().ok_or_else(|| format!("{}: expected a JSON array of conversations", path.display()))?;
            let mut pool: Vec<Vec<(String, usize)>> = Vec::new();
            for c in convs {
                let Some(msgs) = c.get("conversations").and_then(Value::as_array) else { continue };
                fn said<'a>(m: &'a Value, who: &str) -> Option<&'a str> {
                    (m["from"] == who).then(|| m["value"].as_str()).flatten()
                }
                let users: Vec<(String, usize)> = msgs
                    .chunks_exact(2)
                    .map_while(|pair| Some((said(&pair[0], "human")?, said(&pair[1], "gpt")?)))
                    .map(|(q, a)| (q.to_string(), output_len.unwrap_or(a.split_whitespace().count().clamp(1, 1024))))
                    .take(*turns)
                    .collect();
                if !users.is_empty() {
                    pool.push(users);
                }
            }
            if pool.is_empty() {
                return Err(format!("{}: no conversations that start with a human turn and a reply", path.display()));
            }
            Ok((0..n)
                .map(|_| Conversation::Chat {
                    messages: Vec::new(),
                    users: pool[rng.random_range(0..pool.len())].clone(),
                })
                .collect())
        }
        _ => Err("not a multi-turn dataset".into()),
    }
}

/// Multi-turn datasets: conversations start at the request rate, each sends its turns one
/// after another (the next once the answer is in).
async fn run_conversations(
    cfg: &ServeConfig,
    http: &reqwest::Client,
    ids_url: &str,
    chat_url: &str,
    model: String,
) -> Result<ServeRun, String> {
    let convs = conversations(&cfg.dataset, cfg.num_prompts, cfg.seed)?;
    let offsets = arrivals(cfg.num_prompts, cfg.request_rate, cfg.burstiness, cfg.seed)?;
    let bar = progress_bar(cfg.progress, convs.iter().map(Conversation::turns).sum());
    let limit = cfg.max_concurrency.map(|n| Arc::new(tokio::sync::Semaphore::new(n.max(1))));
    let ignore_eos = cfg.ignore_eos;
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(convs.len());
    for (mut conversation, at) in convs.into_iter().zip(&offsets) {
        let wait = Duration::from_secs_f64(*at).saturating_sub(start.elapsed());
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        let url = match conversation {
            Conversation::Ids { .. } => ids_url.to_string(),
            Conversation::Chat { .. } => chat_url.to_string(),
        };
        let (http, model, bar, limit) = (http.clone(), model.clone(), bar.clone(), limit.clone());
        tasks.push(tokio::spawn(async move {
            let mut sent = Vec::new();
            for turn in 0..conversation.turns() {
                let (body, request) = conversation.next(turn, &model, ignore_eos);
                let permit = match &limit {
                    Some(sem) => sem.clone().acquire_owned().await.ok(),
                    None => None,
                };
                let o = send(&http, &url, &body, request.prompt_len).await;
                drop(permit);
                if let Some(bar) = &bar {
                    bar.inc(1);
                }
                conversation.answer(&o);
                let failed = !o.success;
                sent.push((turn, request, o));
                if failed {
                    break; // the conversation cannot go on without its answer
                }
            }
            sent
        }));
    }
    let (mut requests, mut outcomes, mut turn_of) = (Vec::new(), Vec::new(), Vec::new());
    for t in tasks {
        for (turn, request, o) in t.await.map_err(|e| format!("conversation task failed: {e}"))? {
            turn_of.push(turn);
            requests.push(request);
            outcomes.push(o);
        }
    }
    let duration = start.elapsed().as_secs_f64();
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    let summary = summarize(&outcomes, duration, &cfg.percentiles, cfg.slo);
    Ok(ServeRun { model, requests, outcomes, summary, turns: turn_of })
}

/// `YYYYMMDD-HHMMSS` in UTC (vLLM's `date` field), without a date library.
pub fn utc_stamp() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}{m:02}{d:02}-{:02}{:02}{:02}", rem / 3600, rem % 3600 / 60, rem % 60)
}

impl ServeRun {
    /// Multi-turn: the median TTFT (ms) of each turn's successful requests, first turn first.
    pub fn median_ttft_ms_by_turn(&self) -> Vec<f64> {
        let turns = self.turns.iter().max().map_or(0, |t| t + 1);
        (0..turns)
            .map(|turn| {
                let mut ttfts: Vec<f64> = self
                    .turns
                    .iter()
                    .zip(&self.outcomes)
                    .filter(|(t, o)| **t == turn && o.success)
                    .map(|(_, o)| o.ttft * 1e3)
                    .collect();
                ttfts.sort_by(f64::total_cmp);
                match ttfts.len() {
                    0 => f64::NAN,
                    n if n % 2 == 1 => ttfts[n / 2],
                    n => (ttfts[n / 2 - 1] + ttfts[n / 2]) / 2.0,
                }
            })
            .collect()
    }

    /// The result JSON vLLM writes (identity fields, metrics, and with `detailed` the
    /// per-request arrays).
    pub fn result_json(&self, cfg: &ServeConfig, detailed: bool) -> Value {
        let mut m = serde_json::Map::new();
        m.insert("date".into(), json!(utc_stamp()));
        m.insert("backend".into(), json!(cfg.backend));
        m.insert("model_id".into(), json!(self.model));
        m.insert("tokenizer_id".into(), json!(self.model));
        m.insert("num_prompts".into(), json!(cfg.num_prompts));
        m.insert(
            "request_rate".into(),
            if cfg.request_rate.is_infinite() { json!("inf") } else { json!(cfg.request_rate) },
        );
        m.insert("burstiness".into(), json!(cfg.burstiness));
        m.insert("max_concurrency".into(), json!(cfg.max_concurrency));
        m.extend(self.summary.to_json());
        if !self.turns.is_empty() {
            m.insert("median_ttft_ms_by_turn".into(), json!(self.median_ttft_ms_by_turn()));
        }
        if detailed {
            if !self.turns.is_empty() {
                m.insert("turns".into(), json!(self.turns));
            }
            m.insert("input_lens".into(), json!(self.outcomes.iter().map(|o| o.prompt_len).collect::<Vec<_>>()));
            m.insert("output_lens".into(), json!(self.outcomes.iter().map(|o| o.output_len).collect::<Vec<_>>()));
            m.insert("ttfts".into(), json!(self.outcomes.iter().map(|o| o.ttft).collect::<Vec<_>>()));
            m.insert("itls".into(), json!(self.outcomes.iter().map(|o| o.itl.clone()).collect::<Vec<_>>()));
            m.insert("errors".into(), json!(self.outcomes.iter().map(|o| o.error.clone()).collect::<Vec<_>>()));
            if self.outcomes.iter().any(|o| o.kv_timeline.is_some()) {
                m.insert(
                    "kv_timelines".into(),
                    json!(self.outcomes.iter().map(|o| o.kv_timeline.clone()).collect::<Vec<_>>()),
                );
            }
        }
        Value::Object(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arrivals_have_the_requested_mean_rate() {
        let a = arrivals(4000, 8.0, 1.0, 1).unwrap();
        let mean_gap = a.last().unwrap() / 3999.0;
        assert!((mean_gap - 0.125).abs() < 0.01, "{mean_gap}");
        assert!(a.windows(2).all(|w| w[1] >= w[0]));
        assert_eq!(arrivals(3, f64::INFINITY, 1.0, 1).unwrap(), vec![0.0; 3]);
        // Burstier arrivals keep the mean but spread more.
        let b = arrivals(4000, 8.0, 0.25, 1).unwrap();
        assert!((b.last().unwrap() / 3999.0 - 0.125).abs() < 0.02);
        assert!(arrivals(3, -1.0, 1.0, 1).is_err());
    }

    #[test]
    fn random_dataset_respects_lengths_and_seed() {
        let ds = Dataset::Random { input_len: 100, output_len: 10, range_ratio: 0.5, vocab_size: 300, as_text: false };
        let a = sample_requests(&ds, 50, 3).unwrap();
        for r in &a {
            assert!((50..=150).contains(&r.prompt_len) && (5..=15).contains(&r.output_len));
            let ids = r.prompt.as_array().unwrap();
            assert_eq!(ids.len(), r.prompt_len);
            assert!(ids.iter().all(|i| (1..300).contains(&i.as_u64().unwrap())));
        }
        let b = sample_requests(&ds, 50, 3).unwrap();
        assert_eq!(
            a.iter().map(|r| r.prompt.clone()).collect::<Vec<_>>(),
            b.iter().map(|r| r.prompt.clone()).collect::<Vec<_>>()
        );
        let fixed = Dataset::Random { input_len: 64, output_len: 8, range_ratio: 0.0, vocab_size: 300, as_text: true };
        assert!(sample_requests(&fixed, 5, 1)
            .unwrap()
            .iter()
            .all(|r| r.prompt.as_str().unwrap().split(' ').count() == 64));
    }

    #[test]
    fn sharegpt_takes_the_first_exchange() {
        let dir = std::env::temp_dir().join(format!("tandem-sharegpt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("d.json");
        std::fs::write(
            &path,
            r#"[{"conversations": [{"from": "human", "value": "tell me about the river today"},
            {"from": "gpt", "value": "the river is wide and calm and blue"}]}, {"conversations": []}]"#,
        )
        .unwrap();
        let r = sample_requests(&Dataset::ShareGpt { path: path.clone(), output_len: None }, 3, 0).unwrap();
        assert_eq!(r.len(), 3);
        assert_eq!(r[0].prompt, json!("tell me about the river today"));
        assert_eq!(r[0].output_len, 8);
        std::fs::write(&path, "[]").unwrap();
        assert!(sample_requests(&Dataset::ShareGpt { path, output_len: None }, 1, 0).is_err());
    }
}
