//! The OpenAI API over real HTTP on loopback, in front of a real engine (tiny-qwen3 preset).

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tandem_engine::EngineConfig;
use tandem_model::{LoadedModel, ModelSource, Preset};
use tandem_server::AppState;

const MODEL: &str = "tiny";

struct Server {
    base: String,
    state: Arc<AppState>,
    http: reqwest::Client,
}

async fn start(num_blocks: usize, budget: usize) -> Server {
    start_with(num_blocks, budget, Default::default()).await
}

async fn start_with(num_blocks: usize, budget: usize, defaults: tandem_model::GenerationDefaults) -> Server {
    start_keyed(num_blocks, budget, defaults, tandem_core::ApiKeys::default()).await
}

async fn start_keyed(
    num_blocks: usize,
    budget: usize,
    defaults: tandem_model::GenerationDefaults,
    keys: tandem_core::ApiKeys,
) -> Server {
    start_keyed_metrics(num_blocks, budget, defaults, keys, false).await
}

async fn start_keyed_metrics(
    num_blocks: usize,
    budget: usize,
    defaults: tandem_model::GenerationDefaults,
    keys: tandem_core::ApiKeys,
    metrics_need_key: bool,
) -> Server {
    let preset = Preset::find("tiny-qwen3").unwrap();
    let m = LoadedModel::load(&ModelSource::Preset { preset, seed: 0 }, None).unwrap();
    let cfg = EngineConfig {
        block_size: 4,
        num_blocks,
        max_num_seqs: 64,
        max_num_batched_tokens: budget,
        async_scheduling: false,
        max_queue_time: None,
        prefix_caching: true,
    };
    let engine = tandem_engine::spawn(m.transformer, m.eos_token_ids, m.max_model_len, cfg).unwrap();
    let state = Arc::new(
        AppState::new(engine, m.tokenizer.map(Arc::new), MODEL.into())
            .with_sampling_defaults(defaults)
            .with_api_keys(keys)
            .with_metrics_needing_key(metrics_need_key),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(tandem_server::serve(listener, None, state.clone(), std::future::pending()));
    Server { base, state, http: reqwest::Client::new() }
}

impl Server {
    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let r = self.http.post(format!("{}{path}", self.base)).json(&body).send().await.unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }

    /// The SSE `data:` payloads of a streamed request, `[DONE]` included.
    async fn stream(&self, path: &str, body: Value) -> Vec<String> {
        let r = self.http.post(format!("{}{path}", self.base)).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));
        let text = r.text().await.unwrap();
        text.split("\n\n").filter_map(|ev| ev.strip_prefix("data: ").map(str::to_string)).collect()
    }

    async fn wait_idle(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let s = self.state.engine.stats();
            if s.running == 0 && s.waiting == 0 && s.free_blocks == s.total_blocks {
                return;
            }
            assert!(Instant::now() < deadline, "engine not idle with all blocks free: {s:?}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

fn token_ids(v: &Value) -> Vec<u64> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

fn streamed_ids(events: &[String]) -> Vec<u64> {
    let mut ids = Vec::new();
    for e in events.iter().filter(|e| *e != "[DONE]") {
        let v: Value = serde_json::from_str(e).unwrap();
        for c in v["choices"].as_array().unwrap() {
            ids.extend(token_ids(&c["token_ids"]));
        }
    }
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_streams_equal_one_at_a_time_and_blocks_return() {
    // Small blocks and a small step budget: long prompts are chunked and interleave with decodes.
    let s = start(2000, 64).await;
    let prompts: Vec<(Vec<u32>, usize)> = (0..40)
        .map(|i| {
            let len = [1, 3, 4, 5, 17, 40, 90][i % 7];
            ((0..len).map(|j| ((i * 31 + j * 7) % 500) as u32).collect(), 4 + i % 9)
        })
        .collect();
    let body = |p: &Vec<u32>, n: usize, stream: bool| json!({"model": MODEL, "prompt": p, "max_tokens": n, "temperature": 0, "ignore_eos": true, "stream": stream});
    let mut sequential = Vec::new();
    for (p, n) in &prompts {
        let (status, v) = s.post("/v1/completions", body(p, *n, false)).await;
        assert_eq!(status, 200, "{v}");
        sequential.push(token_ids(&v["choices"][0]["token_ids"]));
    }
    let tasks: Vec<_> = prompts
        .iter()
        .map(|(p, n)| {
            let (http, url, b) = (s.http.clone(), format!("{}/v1/completions", s.base), body(p, *n, true));
            tokio::spawn(async move {
                let text = http.post(url).json(&b).send().await.unwrap().text().await.unwrap();
                let events: Vec<String> =
                    text.split("\n\n").filter_map(|ev| ev.strip_prefix("data: ").map(str::to_string)).collect();
                streamed_ids(&events)
            })
        })
        .collect();
    for (i, t) in tasks.into_iter().enumerate() {
        let got = t.await.unwrap();
        assert_eq!(got, sequential[i], "request {i}");
        assert_eq!(got.len(), prompts[i].1);
    }
    s.wait_idle().await;
}

#[tokio::test]
async fn completion_stream_shape_usage_and_text_match_non_streaming() {
    let s = start(500, 256).await;
    let req =
        json!({"model": MODEL, "prompt": "once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": true});
    let (status, full) = s.post("/v1/completions", req.clone()).await;
    assert_eq!(status, 200);
    assert_eq!(full["object"], "text_completion");
    assert_eq!(full["model"], MODEL);
    assert_eq!(full["choices"][0]["finish_reason"], "length");
    let usage = &full["usage"];
    assert_eq!(usage["completion_tokens"], 12);
    assert_eq!(usage["total_tokens"], usage["prompt_tokens"].as_u64().unwrap() + 12);

    let mut sreq = req.clone();
    sreq["stream"] = json!(true);
    sreq["stream_options"] = json!({"include_usage": true});
    let events = s.stream("/v1/completions", sreq).await;
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    let (usage_chunk, token_chunks) = chunks.split_last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(&usage_chunk["usage"], usage);
    assert_eq!(token_chunks.len(), 12, "one chunk per token");
    let mut text = String::new();
    for (i, c) in token_chunks.iter().enumerate() {
        assert_eq!(c["object"], "text_completion");
        assert_eq!(c["id"], token_chunks[0]["id"]);
        assert!(c.get("usage").is_none());
        let fin = &c["choices"][0]["finish_reason"];
        assert_eq!(*fin == json!("length"), i == 11, "finish_reason only on the last chunk");
        text.push_str(c["choices"][0]["text"].as_str().unwrap());
    }
    assert_eq!(text, full["choices"][0]["text"].as_str().unwrap());
    s.wait_idle().await;
}

#[tokio::test]
async fn chat_completions_stream_and_not() {
    let s = start(500, 256).await;
    let req = json!({"model": MODEL, "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                     "max_completion_tokens": 9, "temperature": 0.7, "seed": 11, "ignore_eos": true});
    let (status, full) = s.post("/v1/chat/completions", req.clone()).await;
    assert_eq!(status, 200, "{full}");
    assert_eq!(full["object"], "chat.completion");
    assert_eq!(full["choices"][0]["message"]["role"], "assistant");
    assert_eq!(full["usage"]["completion_tokens"], 9);
    // The chat template was applied: the prompt is longer than the raw text.
    assert!(full["usage"]["prompt_tokens"].as_u64().unwrap() > 8);
    let mut sreq = req.clone();
    sreq["stream"] = json!(true);
    let events = s.stream("/v1/chat/completions", sreq).await;
    let chunks: Vec<Value> =
        events.iter().filter(|e| *e != "[DONE]").map(|e| serde_json::from_str(e).unwrap()).collect();
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = chunks.iter().map(|c| c["choices"][0]["delta"]["content"].as_str().unwrap_or("")).collect();
    assert_eq!(text, full["choices"][0]["message"]["content"].as_str().unwrap(), "same seed, same answer");
}

#[tokio::test]
async fn stop_strings_cut_the_text_and_end_the_request() {
    let s = start(500, 256).await;
    let req = json!({"prompt": "the", "max_tokens": 40, "temperature": 0, "ignore_eos": true});
    let (_, full) = s.post("/v1/completions", req.clone()).await;
    let text = full["choices"][0]["text"].as_str().unwrap().to_string();
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() > 12, "need some text to cut: {text:?}");
    let stop: String = chars[8..11].iter().collect();
    let cut = &text[..text.find(&stop).unwrap()];
    let mut with_stop = req.clone();
    with_stop["stop"] = json!([stop.clone(), "never-appears"]);
    let (_, stopped) = s.post("/v1/completions", with_stop.clone()).await;
    assert_eq!(stopped["choices"][0]["text"], cut);
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
    with_stop["stream"] = json!(true);
    let events = s.stream("/v1/completions", with_stop).await;
    let streamed: String = events
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str::<Value>(e).unwrap()["choices"][0]["text"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(streamed, cut, "no part of the stop string is ever streamed");
    s.wait_idle().await;
}

#[tokio::test]
async fn bad_requests_get_openai_errors_and_the_server_keeps_serving() {
    let s = start(64, 256).await;
    let long_prompt: Vec<u32> = vec![5; 4096];
    let cases = [
        ("/v1/completions", "{not json", 400, "invalid request body (not valid JSON)"),
        ("/v1/completions", r#"{"prompt": "hi", "max_tokens": "many"}"#, 400, "invalid type"),
        ("/v1/completions", r#"{"max_tokens": 3}"#, 400, "invalid request body"),
        ("/v1/completions", r#"{"model": "gpt-9", "prompt": "hi"}"#, 404, "The model `gpt-9` does not exist."),
        ("/v1/completions", r#"{"prompt": "hi", "temperature": -1}"#, 400, "temperature"),
        ("/v1/completions", r#"{"prompt": "hi", "top_p": 0}"#, 400, "top_p"),
        ("/v1/completions", r#"{"prompt": "hi", "top_k": -5}"#, 400, "top_k"),
        ("/v1/completions", r#"{"prompt": "hi", "max_tokens": 0}"#, 400, "max_tokens"),
        ("/v1/completions", r#"{"prompt": "hi", "n": 2}"#, 400, "n=1"),
        ("/v1/completions", r#"{"prompt": "hi", "min_tokens": 9, "max_tokens": 3}"#, 400, "min_tokens"),
        ("/v1/completions", r#"{"prompt": ""}"#, 400, "empty"),
        ("/v1/completions", r#"{"prompt": [1, 2, 100000]}"#, 400, "out of range"),
        ("/v1/completions", r#"{"prompt": ["a", "b"]}"#, 400, "batched"),
        ("/v1/completions", r#"{"prompt": "hi", "max_tokens": 5000}"#, 400, "maximum context length"),
        ("/v1/completions", r#"{"prompt": "hi", "max_tokens": 9223372036854775807}"#, 400, "maximum context length"),
        ("/v1/completions", r#"{"prompt": "hi", "max_tokens": 1e400}"#, 400, "invalid request body"),
        ("/v1/completions", r#"{"prompt": "hi", "max_tokens": 300}"#, 400, "KV blocks"),
        ("/v1/completions", r#"{"prompt": "hi", "echo": true}"#, 400, "echo is not supported"),
        ("/v1/completions", r#"{"prompt": "hi", "prompt_logprobs": 1}"#, 400, "prompt_logprobs is not supported"),
        ("/v1/chat/completions", r#"{"messages": []}"#, 400, "messages"),
        (
            "/v1/chat/completions",
            r#"{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}"#,
            400,
            "image_url",
        ),
        ("/tokenize", r#"{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}"#, 400, "exactly one"),
        ("/detokenize", r#"{"tokens": [1, 99999]}"#, 400, "out of range"),
        ("/kv/prefix", r#"{"max_tokens": 3}"#, 400, "exactly one"),
        ("/kv/prefix", r#"{"prompt": ["a", "b"]}"#, 400, "batched"),
    ];
    for (path, body, status, needle) in cases {
        let r = s
            .http
            .post(format!("{}{path}", s.base))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), status, "{path} {body}");
        let v: Value = r.json().await.unwrap();
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(needle), "{path} {body}: `{needle}` not in {v}");
        assert_eq!(v["error"]["code"], status);
        assert!(v["error"]["type"].as_str().unwrap().ends_with("Error"));
    }
    // Wrongly typed fields are named, in words, without serde's positions or type names.
    for (body, param, needle) in [
        (json!({"prompt": "hi", "max_tokens": "ten"}), "max_tokens", "invalid `max_tokens`: invalid type: string"),
        (json!({"prompt": {"text": "hi"}}), "prompt", "must be a string, a list of token ids"),
        (json!({"prompt": [1, -2]}), "prompt", "must be a string, a list of token ids"),
        (json!({"prompt": "hi", "stop": 5}), "stop", "must be a string or a list of strings"),
    ] {
        let (status, v) = s.post("/v1/completions", body.clone()).await;
        assert_eq!(status, 400, "{body}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(needle), "{body}: `{needle}` not in {msg}");
        assert!(!msg.contains("line 1") && !msg.contains("untagged"), "{body}: {msg}");
    }
    let (status, v) = s.post("/v1/chat/completions", json!({"messages": [{"role": "user", "content": 7}]})).await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("messages[0].content")), "{v}");
    // An oversize body: OpenAI-shaped JSON, not axum's plain text.
    let huge = format!(r#"{{"prompt": "{}"}}"#, "a".repeat(tandem_server::MAX_BODY_BYTES + 10));
    let r = s.http.post(format!("{}/v1/completions", s.base)).header("content-type", "application/json").body(huge);
    let r = r.send().await.unwrap();
    assert_eq!(r.status(), 413);
    let v: Value = r.json().await.unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("MiB"), "{v}");
    // A colocated engine has no KV side channel: 404, as documented.
    let r = s.http.get(format!("{}/kv/info", s.base)).send().await.unwrap();
    assert_eq!(r.status(), 404);
    let (status, _) = s.post("/kv/release", json!({"transfer_id": "t"})).await;
    assert_eq!(status, 404);
    let (status, v) = s.post("/v1/completions", json!({"prompt": long_prompt})).await;
    assert_eq!(status, 400);
    assert!(v["error"]["message"].as_str().unwrap().contains("maximum context length is 4096"), "{v}");
    // Still healthy and serving.
    assert_eq!(s.http.get(format!("{}/health", s.base)).send().await.unwrap().status(), 200);
    let (status, _) = s.post("/v1/completions", json!({"prompt": "ok", "max_tokens": 2})).await;
    assert_eq!(status, 200);
    let metrics = s.http.get(format!("{}/metrics", s.base)).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("tandem:request_errors_total{type=\"BadRequestError\"}"), "{metrics}");
    s.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_cancels_and_frees_blocks() {
    let s = start(1200, 256).await;
    let long = json!({"prompt": "go", "max_tokens": 3000, "ignore_eos": true, "stream": true});
    // Streaming: read the first chunk, then hang up.
    let mut r = s.http.post(format!("{}/v1/completions", s.base)).json(&long).send().await.unwrap();
    assert!(r.chunk().await.unwrap().is_some());
    let deadline = Instant::now() + Duration::from_secs(5);
    while s.state.engine.stats().running != 1 {
        assert!(Instant::now() < deadline, "the streamed request never showed as running");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    drop(r);
    s.wait_idle().await;
    // Not streaming: send the request on a raw socket and close it mid-generation.
    use tokio::io::AsyncWriteExt;
    let body = json!({"prompt": "go", "max_tokens": 3000, "ignore_eos": true}).to_string();
    let mut sock = tokio::net::TcpStream::connect(s.base.trim_start_matches("http://")).await.unwrap();
    let req = format!("POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len());
    sock.write_all(req.as_bytes()).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while s.state.engine.stats().running == 0 {
        assert!(Instant::now() < deadline, "request never started");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    drop(sock);
    s.wait_idle().await;
    let m = s.http.get(format!("{}/metrics", s.base)).send().await.unwrap().text().await.unwrap();
    assert!(m.contains("tandem:kv_blocks_used 0"), "{m}");
}

#[tokio::test]
async fn models_health_tokenize_request_id_and_metrics() {
    let s = start(500, 256).await;
    let models: Value = s.http.get(format!("{}/v1/models", s.base)).send().await.unwrap().json().await.unwrap();
    assert_eq!(models["data"][0]["id"], MODEL);
    assert_eq!(models["data"][0]["max_model_len"], 4096);
    let (_, tok) = s.post("/tokenize", json!({"prompt": "hello world"})).await;
    let (_, detok) = s.post("/detokenize", json!({"tokens": tok["tokens"]})).await;
    assert_eq!(detok["prompt"], "hello world");
    assert_eq!(tok["count"], tok["tokens"].as_array().unwrap().len());
    let r = s
        .http
        .post(format!("{}/v1/completions", s.base))
        .header("x-request-id", "my-req-42")
        .json(&json!({"prompt": "x", "max_tokens": 2, "ignore_eos": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["x-request-id"], "my-req-42");
    // ignore_eos: an unseeded draw could end either request with "stop" (counted below).
    let r = s
        .http
        .post(format!("{}/v1/completions", s.base))
        .json(&json!({"prompt": "x", "max_tokens": 3, "ignore_eos": true}))
        .send()
        .await
        .unwrap();
    assert!(!r.headers()["x-request-id"].is_empty(), "an id is generated when none is sent");
    // Engine gauges are published after each step, a moment after the last token is sent.
    s.wait_idle().await;
    let m = s.http.get(format!("{}/metrics", s.base)).send().await.unwrap().text().await.unwrap();
    for name in [
        "tandem:num_requests_running 0",
        "tandem:num_requests_waiting 0",
        "tandem:kv_blocks_free 500",
        "tandem:kv_blocks_used 0",
        "tandem:generation_tokens_total 5",
        "tandem:time_to_first_token_seconds_count 2",
        "tandem:time_per_output_token_seconds_count 2",
        "tandem:e2e_request_latency_seconds_count 2",
        "tandem:request_success_total{finished_reason=\"length\"} 2",
        "tandem:prompt_tokens_total",
        "tandem:prefix_cache_queries_total",
        "tandem:prefix_cache_hits_total",
        "tandem:kv_blocks_cached",
    ] {
        assert!(m.contains(name), "missing `{name}` in:\n{m}");
    }
}

#[tokio::test]
async fn the_last_incomplete_character_is_sent_when_generation_ends() {
    let s = start(64, 256).await;
    // The random preset mostly emits single bytes of multi-byte characters: the held bytes
    // must come out (as U+FFFD) when the request ends, streamed or not.
    let body = json!({"prompt": "the cat", "max_tokens": 20, "temperature": 0, "ignore_eos": true});
    let (status, v) = s.post("/v1/completions", body.clone()).await;
    assert_eq!(status, 200, "{v}");
    let ids = token_ids(&v["choices"][0]["token_ids"]);
    let (_, detok) = s.post("/detokenize", json!({"tokens": ids})).await;
    let want = detok["prompt"].as_str().unwrap();
    assert!(!want.is_empty());
    assert_eq!(v["choices"][0]["text"], want, "the text is the tokens' text: {v}");
    let mut streamed = String::new();
    let mut streaming = body.clone();
    streaming["stream"] = json!(true);
    let events = s.stream("/v1/completions", streaming).await;
    for e in events.iter().filter(|e| *e != "[DONE]") {
        let v: Value = serde_json::from_str(e).unwrap();
        streamed.push_str(v["choices"][0]["text"].as_str().unwrap_or_default());
    }
    assert_eq!(streamed, want);
    s.wait_idle().await;
}

/// A request resumed from its first k output tokens (`resume_output_token_ids`, as a router
/// sends it when the engine that streamed them failed) answers exactly as the whole request: the
/// same token ids, the same text (the random preset splits characters across tokens, so the
/// seam falls inside them), stop strings reaching back over the seam, and the same usage;
/// completions and chat alike.
#[tokio::test]
async fn a_resumed_request_answers_as_the_whole_request_would() {
    let s = start(500, 256).await;
    let body = json!({"prompt": "the cat", "max_tokens": 20, "temperature": 0, "ignore_eos": true});
    let (_, whole) = s.post("/v1/completions", body.clone()).await;
    let ids = token_ids(&whole["choices"][0]["token_ids"]);
    let text = whole["choices"][0]["text"].as_str().unwrap().to_string();
    let resumed_body = |body: &Value, k: usize, max_tokens: usize| {
        let mut b = body.clone();
        b["resume_output_token_ids"] = json!(ids[..k]);
        b["max_tokens"] = json!(max_tokens);
        b
    };
    for k in [1, 7, 19] {
        let (status, v) = s.post("/v1/completions", resumed_body(&body, k, 20 - k)).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(token_ids(&v["choices"][0]["token_ids"]), ids, "k = {k}");
        assert_eq!(v["choices"][0]["text"], text, "k = {k}");
        assert_eq!(v["usage"], whole["usage"], "k = {k}");
        let mut streaming = resumed_body(&body, k, 20 - k);
        streaming["stream"] = json!(true);
        let events = s.stream("/v1/completions", streaming).await;
        assert_eq!(streamed_ids(&events), ids, "k = {k}, streamed");
        let streamed: String = events
            .iter()
            .filter(|e| *e != "[DONE]")
            .map(|e| serde_json::from_str::<Value>(e).unwrap()["choices"][0]["text"].as_str().unwrap_or("").to_string())
            .collect();
        assert_eq!(streamed, text, "k = {k}, streamed");
    }

    // A stop string that begins in the resumed tokens' text ends the answer where the whole
    // request's did.
    let chars: Vec<char> = text.chars().collect();
    let stop: String = chars[6..9].iter().collect();
    let mut with_stop = body.clone();
    with_stop["stop"] = json!(stop);
    let (_, stopped) = s.post("/v1/completions", with_stop.clone()).await;
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
    let produced = token_ids(&stopped["choices"][0]["token_ids"]).len();
    assert!(produced > 1, "the stop must come after the first token");
    let (_, v) = s.post("/v1/completions", resumed_body(&with_stop, produced - 1, 20 - (produced - 1))).await;
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["choices"][0]["text"], stopped["choices"][0]["text"]);

    // Chat: with `return_token_ids` its chunks carry their ids, and a resumed chat streams the
    // whole answer too.
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12, "temperature": 0,
                      "ignore_eos": true, "stream": true, "return_token_ids": true});
    let chat_text = |events: &[String]| -> String {
        events
            .iter()
            .filter(|e| *e != "[DONE]")
            .map(|e| {
                serde_json::from_str::<Value>(e).unwrap()["choices"][0]["delta"]["content"]
                    .as_str()
                    .unwrap_or("")
                    .to_string()
            })
            .collect()
    };
    let events = s.stream("/v1/chat/completions", chat.clone()).await;
    let chat_ids = streamed_ids(&events);
    assert_eq!(chat_ids.len(), 12);
    let mut resumed_chat = chat.clone();
    resumed_chat["resume_output_token_ids"] = json!(chat_ids[..5]);
    resumed_chat["max_tokens"] = json!(7);
    let again = s.stream("/v1/chat/completions", resumed_chat).await;
    assert_eq!(streamed_ids(&again), chat_ids);
    assert_eq!(chat_text(&again), chat_text(&events));

    // Logprobs: the new tokens' only, equal to the whole request's from the seam on, their text
    // offsets running on from the resumed tokens'; streamed, the chunks' entries add up to the
    // same.
    let mut with_lps = body.clone();
    with_lps["logprobs"] = json!(2);
    let (_, whole_lps) = s.post("/v1/completions", with_lps.clone()).await;
    let entries = |lps: &Value, key: &str| -> Vec<Value> { lps[key].as_array().unwrap().clone() };
    let whole_lps = &whole_lps["choices"][0]["logprobs"];
    for k in [1, 7] {
        let (_, v) = s.post("/v1/completions", resumed_body(&with_lps, k, 20 - k)).await;
        let mut streaming = resumed_body(&with_lps, k, 20 - k);
        streaming["stream"] = json!(true);
        let events = s.stream("/v1/completions", streaming).await;
        for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
            let want = entries(whole_lps, key)[k..].to_vec();
            assert_eq!(entries(&v["choices"][0]["logprobs"], key), want, "k = {k}: {key}");
            let streamed: Vec<Value> = events
                .iter()
                .filter(|e| *e != "[DONE]")
                .map(|e| serde_json::from_str::<Value>(e).unwrap())
                .filter(|c| !c["choices"][0]["logprobs"].is_null())
                .flat_map(|c| entries(&c["choices"][0]["logprobs"], key))
                .collect();
            assert_eq!(streamed, want, "k = {k}, streamed: {key}");
        }
    }

    let (status, v) = s.post("/v1/completions", json!({"prompt": [1, 2, 3], "resume_output_token_ids": [-1]})).await;
    assert_eq!(status, 400, "negative: {v}");
    s.wait_idle().await;
}

#[tokio::test]
async fn abort_all_ends_streams_with_an_error_and_frees_every_block() {
    let s = start(64, 256).await;
    let body = json!({"prompt": "x", "max_tokens": 200, "ignore_eos": true, "stream": true});
    let r = s.http.post(format!("{}/v1/completions", s.base)).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let waiting = {
        let http = s.http.clone();
        let url = format!("{}/v1/completions", s.base);
        tokio::spawn(async move {
            let r = http.post(url).json(&json!({"prompt": "y", "max_tokens": 200, "ignore_eos": true})).send().await;
            let r = r.unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        })
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.state.in_flight() < 2 {
        assert!(Instant::now() < deadline, "requests never started");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    s.state.abort_all();
    let text = tokio::time::timeout(Duration::from_secs(5), r.text()).await.expect("the stream ended").unwrap();
    let events: Vec<&str> = text.split("\n\n").filter_map(|e| e.strip_prefix("data: ")).collect();
    assert_eq!(events.last(), Some(&"[DONE]"), "{text}");
    let last: Value = serde_json::from_str(events[events.len() - 2]).unwrap();
    assert_eq!(last["error"]["code"], 503, "{last}");
    assert!(last["error"]["message"].as_str().unwrap().contains("shutting down"));
    let (status, v) = tokio::time::timeout(Duration::from_secs(5), waiting).await.unwrap().unwrap();
    assert_eq!(status, 503, "{v}");
    s.wait_idle().await;
    assert_eq!(s.state.in_flight(), 0);
    let (status, _) = s.post("/v1/completions", json!({"prompt": "z", "max_tokens": 2})).await;
    assert_eq!(status, 503, "new requests are refused once shutting down");
}

/// A random JSON value, small and deep-ish: every kind a client could send where a field goes.
fn random_value(rng: &mut impl rand::Rng, depth: u32) -> Value {
    let kinds = if depth >= 2 { 7 } else { 9 };
    match rng.random_range(0..kinds) {
        0 => Value::Null,
        1 => json!(rng.random_bool(0.5)),
        2 => json!([-1i64, 0, 1, 2, 7, 255, 65535, 65536, 4_294_967_295, i64::MAX, i64::MIN][rng.random_range(0..11)]),
        3 => json!([0.0, -0.5, 0.5, 1.0, 1.5, 1e30, -1e30, f64::MIN_POSITIVE][rng.random_range(0..8)]),
        4 => json!(["", "x", "tiny", "\u{0}", "\u{1F600}", "-1", "1e9", "cuda-ipc"][rng.random_range(0..8)]),
        5 => json!("a".repeat(rng.random_range(0..3000))),
        6 => json!(rng.random_range(-3i64..10)),
        7 => Value::Array((0..rng.random_range(0..6)).map(|_| random_value(rng, depth + 1)).collect()),
        _ => {
            let keys = ["do_remote_decode", "do_remote_prefill", "remote_host", "remote_port", "transfer_id", "x"];
            Value::Object(
                (0..rng.random_range(0..5))
                    .map(|_| (keys[rng.random_range(0..keys.len())].to_string(), random_value(rng, depth + 1)))
                    .collect(),
            )
        }
    }
}

/// A completion body: a valid one with some fields replaced by random values, or a
/// `kv_transfer_params` made of the fields the disaggregated legs use, with random values.
fn random_body(rng: &mut impl rand::Rng) -> Value {
    let mut b = json!({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2});
    let fields = [
        "model",
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "n",
        "stop",
        "stop_token_ids",
        "seed",
        "stream",
        "ignore_eos",
        "min_tokens",
        "logprobs",
        "echo",
        "prompt_logprobs",
        "best_of",
        "stream_options",
        "kv_transfer_params",
    ];
    // About one field in ten, so that many bodies get past validation to the engine.
    for f in fields {
        if rng.random_bool(0.1) {
            b[f] = random_value(rng, 0);
        }
    }
    if rng.random_bool(0.3) {
        let keys = [
            "do_remote_decode",
            "do_remote_prefill",
            "remote_host",
            "remote_port",
            "remote_block_ids",
            "remote_epoch",
            "remote_num_tokens",
            "first_token_id",
            "transfer_id",
            "remote_engine_id",
        ];
        let mut params = serde_json::Map::new();
        for k in keys {
            if rng.random_bool(0.5) {
                params.insert(k.to_string(), random_value(rng, 1));
            }
        }
        b["kv_transfer_params"] = Value::Object(params);
    }
    // Keep a valid request's generation short: the point is parsing, not decoding.
    if b["max_tokens"].as_i64().is_some_and(|n| n > 8) && rng.random_bool(0.8) {
        b["max_tokens"] = json!(8);
    }
    b
}

/// Fuzzed request bodies (seeded, so a failure repeats): 400 random completion bodies, with
/// random `kv_transfer_params` among them, and 100 byte strings that are not JSON. Each gets an
/// answer or a 4xx with an error message, never a 5xx, a hang or a panic; the engine serves
/// afterwards with every block free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fuzzed_bodies_get_answers_or_clear_errors_and_lose_nothing() {
    use rand::{Rng, SeedableRng};
    let s = start(512, 64).await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let (started, mut statuses) = (Instant::now(), std::collections::BTreeMap::new());
    for i in 0..400 {
        let body = random_body(&mut rng);
        let r = tokio::time::timeout(Duration::from_secs(20), s.post("/v1/completions", body.clone())).await;
        let (status, v) = r.unwrap_or_else(|_| panic!("body {i} hung: {body}"));
        *statuses.entry(status).or_insert(0) += 1;
        assert!(status == 200 || (400..500).contains(&status), "body {i}: {status} {v} for {body}");
        if status != 200 {
            assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "body {i}: no message: {v}");
        }
    }
    for i in 0..100 {
        let bytes: Vec<u8> = (0..rng.random_range(0..200)).map(|_| rng.random()).collect();
        let r =
            s.http.post(format!("{}/v1/completions", s.base)).body(bytes).header("content-type", "application/json");
        let status = r.send().await.unwrap().status().as_u16();
        assert!((400..500).contains(&status), "garbage body {i}: {status}");
    }
    eprintln!("500 fuzzed bodies in {:.1} s; statuses of the JSON ones: {statuses:?}", started.elapsed().as_secs_f64());
    assert!(statuses.get(&200).is_some_and(|&n| n >= 40), "too few bodies reached the engine: {statuses:?}");
    assert!(s.state.engine.is_alive());
    // Sampled at the default temperature, so EOS may come early unless ignored.
    let after = json!({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": true});
    let (status, v) = s.post("/v1/completions", after).await;
    assert_eq!((status, v["usage"]["completion_tokens"].as_u64()), (200, Some(3)), "{v}");
    s.wait_idle().await;
}

/// Past its bound the server refuses at once with a 429, `Retry-After` and an error message,
/// instead of queueing without limit; once a place frees, requests are answered again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_its_bound_the_server_answers_429_with_retry_after() {
    let preset = Preset::find("tiny-qwen3").unwrap();
    let m = LoadedModel::load(&ModelSource::Preset { preset, seed: 0 }, None).unwrap();
    let cfg = EngineConfig {
        block_size: 4,
        num_blocks: 512,
        max_num_seqs: 64,
        max_num_batched_tokens: 64,
        async_scheduling: false,
        max_queue_time: None,
        prefix_caching: false,
    };
    let engine = tandem_engine::spawn(m.transformer, m.eos_token_ids, m.max_model_len, cfg).unwrap();
    let state = Arc::new(AppState::new(engine, m.tokenizer.map(Arc::new), MODEL.into()).with_max_in_flight(2));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(tandem_server::serve(listener, None, state.clone(), std::future::pending()));
    let http = reqwest::Client::new();
    let long = json!({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2000, "ignore_eos": true, "stream": true});
    // Two streams held open (their bodies unread): the bound is reached.
    let a = http.post(format!("{base}/v1/completions")).json(&long).send().await.unwrap();
    let b = http.post(format!("{base}/v1/completions")).json(&long).send().await.unwrap();
    assert_eq!((a.status().as_u16(), b.status().as_u16()), (200, 200));
    let short = json!({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2});
    let r = http.post(format!("{base}/v1/completions")).json(&short).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 429);
    assert_eq!(r.headers()["retry-after"], "1");
    let v: Value = r.json().await.unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("retry shortly"), "{v}");
    drop((a, b)); // the clients go: their generations end
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = http.post(format!("{base}/v1/completions")).json(&short).send().await.unwrap();
        if r.status() == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "still refused after the streams ended: {}", r.status());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The model's generation_config.json defaults (as `--generation-config auto` passes them):
/// a request that leaves temperature and max_tokens out gets the model's (greedy, at most 3
/// tokens), one that sets them gets its own; chat's "all the room left" default is capped too.
#[tokio::test]
async fn unset_sampling_fields_take_the_models_generation_config() {
    let defaults = tandem_model::GenerationDefaults::from_json(&json!({
        "temperature": 0.0, "max_new_tokens": 3, "repetition_penalty": 1.1, "eos_token_id": 2
    }));
    assert_eq!(defaults.unsupported, ["repetition_penalty=1.1"]);
    let s = start_with(256, 64, defaults).await;
    let (code, greedy) = s
        .post("/v1/completions", json!({"prompt": "once upon", "max_tokens": 8, "temperature": 0, "ignore_eos": true}))
        .await;
    assert_eq!(code, 200, "{greedy}");
    let greedy = token_ids(&greedy["choices"][0]["token_ids"]);
    assert_eq!(greedy.len(), 8);
    for _ in 0..2 {
        let (code, v) = s.post("/v1/completions", json!({"prompt": "once upon", "ignore_eos": true})).await;
        assert_eq!(code, 200, "{v}");
        assert_eq!(token_ids(&v["choices"][0]["token_ids"]), greedy[..3], "the model's temperature 0 and 3 tokens");
    }
    let (_, v) = s.post("/v1/completions", json!({"prompt": "once upon", "max_tokens": 5, "ignore_eos": true})).await;
    assert_eq!(token_ids(&v["choices"][0]["token_ids"]), greedy[..5], "the request's max_tokens wins");
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "ignore_eos": true});
    let (code, v) = s.post("/v1/chat/completions", chat).await;
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 3, "{v}");
    s.wait_idle().await;
}

/// `logprobs` in each API's spelling and shape: completions (`logprobs: N`) and chat
/// (`logprobs: true`, `top_logprobs: N`), whole and streamed, give one entry per generated
/// token with the alternatives asked for, most likely first, the greedy token heading them;
/// the stream carries the same numbers as the whole answer. Out-of-range counts and the wrong
/// type for the API get a 400 naming `logprobs`. (Through disaggregation: router/tests/pd.rs.)
#[tokio::test]
async fn logprobs_in_completions_and_chat_whole_and_streamed() {
    let s = start(500, 256).await;
    let body = json!({"model": MODEL, "prompt": "The capital of", "max_tokens": 6, "temperature": 0,
                      "ignore_eos": true, "logprobs": 3});
    let (status, full) = s.post("/v1/completions", body.clone()).await;
    assert_eq!(status, 200, "{full}");
    let lp = &full["choices"][0]["logprobs"];
    let n = token_ids(&full["choices"][0]["token_ids"]).len();
    assert_eq!(n, 6);
    for field in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        assert_eq!(lp[field].as_array().map(Vec::len), Some(n), "{field}: {lp}");
    }
    for (k, top) in lp["top_logprobs"].as_array().unwrap().iter().enumerate() {
        let top = top.as_object().unwrap();
        // Three alternatives and the token itself, keyed by text: two tokens that each decode to
        // part of a character ("\u{fffd}") share a key, as in OpenAI's and vLLM's format.
        assert!((1..=4).contains(&top.len()), "three alternatives, and the token itself: {top:?}");
        let best = top.values().map(|v| v.as_f64().unwrap()).fold(f64::NEG_INFINITY, f64::max);
        let chosen = lp["token_logprobs"][k].as_f64().unwrap();
        assert!(chosen <= 0.0 && (chosen - best).abs() < 1e-6, "greedy: the chosen token is the most likely");
        assert_eq!(top[lp["tokens"][k].as_str().unwrap()].as_f64(), Some(chosen));
    }
    let offsets: Vec<u64> = token_ids(&lp["text_offset"]);
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]) && offsets[0] == 0, "{offsets:?}");
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let events = s.stream("/v1/completions", sbody).await;
    let streamed: Vec<f64> = events
        .iter()
        .filter(|e| *e != "[DONE]")
        .flat_map(|e| {
            let v: Value = serde_json::from_str(e).unwrap();
            v["choices"][0]["logprobs"]["token_logprobs"].as_array().cloned().unwrap_or_default()
        })
        .map(|x| x.as_f64().unwrap())
        .collect();
    let whole: Vec<f64> = lp["token_logprobs"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    assert_eq!(streamed, whole);
    // Not asked: null.
    let (_, plain) = s.post("/v1/completions", json!({"model": MODEL, "prompt": "The", "max_tokens": 2})).await;
    assert!(plain["choices"][0]["logprobs"].is_null(), "{plain}");

    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                      "temperature": 0, "ignore_eos": true, "logprobs": true, "top_logprobs": 2});
    let (status, full) = s.post("/v1/chat/completions", chat.clone()).await;
    assert_eq!(status, 200, "{full}");
    let content = full["choices"][0]["logprobs"]["content"].as_array().unwrap().clone();
    assert_eq!(content.len(), 4);
    for c in &content {
        let top = c["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2);
        assert_eq!(top[0]["logprob"], c["logprob"], "greedy: the token is the most likely");
        assert!(top[0]["logprob"].as_f64() >= top[1]["logprob"].as_f64());
        let bytes: Vec<u8> = c["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8).collect();
        assert_eq!(String::from_utf8_lossy(&bytes), c["token"].as_str().unwrap());
    }
    let mut schat = chat.clone();
    schat["stream"] = json!(true);
    let events = s.stream("/v1/chat/completions", schat).await;
    let streamed: Vec<Value> = events
        .iter()
        .filter(|e| *e != "[DONE]")
        .flat_map(|e| {
            let v: Value = serde_json::from_str(e).unwrap();
            v["choices"][0]["logprobs"]["content"].as_array().cloned().unwrap_or_default()
        })
        .collect();
    assert_eq!(streamed, content);

    for (path, bad) in [
        ("/v1/completions", json!({"model": MODEL, "prompt": "x", "logprobs": 21})),
        ("/v1/completions", json!({"model": MODEL, "prompt": "x", "logprobs": true})),
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": 2}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
        ),
    ] {
        let (status, v) = s.post(path, bad.clone()).await;
        assert_eq!(status, 400, "{bad}: {v}");
        let param = v["error"]["param"].as_str().unwrap_or("");
        assert!(param.contains("logprobs"), "{bad}: {v}");
    }
    s.wait_idle().await;
}

/// A server started with API keys answers the OpenAI routes only for a request carrying one of
/// them: none, a wrong one, another scheme or a key's prefix gets a 401 in OpenAI's shape,
/// counted in /metrics, with nothing run (no tokens generated, every block free); /health and
/// /metrics stay open; either key works.
#[tokio::test]
async fn without_one_of_its_api_keys_a_request_is_refused_and_runs_nothing() {
    let keys = tandem_core::ApiKeys::new(["sk-test-one", "sk-test-two"]).unwrap();
    let s = start_keyed(200, 256, Default::default(), keys).await;
    let body = json!({"prompt": "hello", "max_tokens": 2, "ignore_eos": true});
    let refused =
        [None, Some("Bearer sk-wrong"), Some("Basic sk-test-one"), Some("Bearer sk-test-on"), Some("sk-test-one")];
    for auth in refused {
        for (path, body) in [
            ("/v1/completions", body.clone()),
            ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}]})),
            ("/tokenize", json!({"prompt": "hello"})),
            ("/detokenize", json!({"tokens": [1, 2]})),
        ] {
            let mut req = s.http.post(format!("{}{path}", s.base)).json(&body);
            if let Some(a) = auth {
                req = req.header("authorization", a);
            }
            let r = req.send().await.unwrap();
            assert_eq!(r.status(), 401, "{path} with {auth:?}");
            let err: Value = r.json().await.unwrap();
            assert_eq!(err["error"]["type"], "AuthenticationError", "{err}");
            assert!(err["error"]["message"].as_str().unwrap().contains("--api-key"), "{err}");
        }
    }
    let models = s.http.get(format!("{}/v1/models", s.base)).send().await.unwrap();
    assert_eq!(models.status(), 401);
    assert_eq!(s.http.get(format!("{}/health", s.base)).send().await.unwrap().status(), 200);
    let metrics = s.http.get(format!("{}/metrics", s.base)).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("tandem:request_errors_total{type=\"AuthenticationError\"} 21"), "{metrics}");
    assert!(metrics.contains("tandem:generation_tokens_total 0"), "a refused request ran: {metrics}");
    for key in ["sk-test-one", "sk-test-two"] {
        let r = s.http.post(format!("{}/v1/completions", s.base)).bearer_auth(key).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 200, "{key}");
    }
    s.wait_idle().await;
    // Asked to, /metrics wants a key too; /health never does.
    let keys = tandem_core::ApiKeys::new(["sk-test-one"]).unwrap();
    let s = start_keyed_metrics(200, 256, Default::default(), keys, true).await;
    let metrics = |key: Option<&str>| {
        let req = s.http.get(format!("{}/metrics", s.base));
        let req = match key {
            Some(k) => req.bearer_auth(k),
            None => req,
        };
        async move { req.send().await.unwrap().status().as_u16() }
    };
    assert_eq!((metrics(None).await, metrics(Some("sk-test-one")).await), (401, 200));
    assert_eq!(s.http.get(format!("{}/health", s.base)).send().await.unwrap().status(), 200);
}
