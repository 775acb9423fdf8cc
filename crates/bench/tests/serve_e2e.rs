//! `bench serve` against a real server on loopback: every request counted, token totals exact,
//! and the result JSON carries vLLM's keys.

use std::sync::Arc;

use tandem_bench::metrics::Slo;
use tandem_bench::serve::{run, Dataset, ServeConfig};
use tandem_engine::EngineConfig;
use tandem_model::{LoadedModel, ModelSource, Preset};

/// A tiny-qwen3 server on loopback: its base URL and state.
async fn server(prefix_caching: bool) -> (String, Arc<tandem_server::AppState>) {
    let m =
        LoadedModel::load(&ModelSource::Preset { preset: Preset::find("tiny-qwen3").unwrap(), seed: 0 }, None).unwrap();
    let cfg = EngineConfig {
        block_size: 16,
        num_blocks: 400,
        max_num_seqs: 64,
        max_num_batched_tokens: 256,
        async_scheduling: false,
        max_queue_time: None,
        prefix_caching,
    };
    let engine = tandem_engine::spawn(m.transformer, m.eos_token_ids, m.max_model_len, cfg).unwrap();
    let state = Arc::new(tandem_server::AppState::new(engine, m.tokenizer.map(Arc::new), "tiny".into()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base_url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(tandem_server::serve(listener, None, state.clone(), std::future::pending()));
    (base_url, state)
}

/// A run of `num_prompts` from `dataset` against `base_url`, everything else plain: no
/// concurrency cap, no warm-up, median only, no SLO.
fn config(base_url: String, dataset: Dataset, num_prompts: usize, request_rate: f64) -> ServeConfig {
    ServeConfig {
        base_url,
        endpoint: "/v1/completions".into(),
        model: None,
        backend: "tandem".into(),
        dataset,
        num_prompts,
        request_rate,
        burstiness: 1.0,
        seed: 0,
        max_concurrency: None,
        num_warmups: 0,
        ignore_eos: true,
        percentiles: vec![50.0],
        slo: None,
        progress: false,
        api_key: None,
        tls_ca: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_generator_measures_a_real_server() {
    let (base_url, _) = server(false).await;
    let dataset = Dataset::Random { input_len: 30, output_len: 6, range_ratio: 0.0, vocab_size: 500, as_text: false };
    let cfg = ServeConfig {
        max_concurrency: Some(8),
        num_warmups: 1,
        percentiles: vec![50.0, 90.0, 99.0],
        slo: Some(Slo { ttft_ms: Some(60_000.0), tpot_ms: None, e2el_ms: None }),
        ..config(base_url, dataset, 24, 100.0)
    };
    let r = run(&cfg).await.unwrap();
    let s = &r.summary;
    assert_eq!((s.completed, s.failed), (24, 0), "{:?}", r.outcomes.iter().map(|o| &o.error).collect::<Vec<_>>());
    assert_eq!(s.total_input_tokens, 24 * 30);
    assert_eq!(s.total_output_tokens, 24 * 6);
    assert!(s.ttft.mean > 0.0 && s.tpot.mean > 0.0 && s.itl.mean > 0.0 && s.e2el.mean >= s.ttft.mean);
    assert!(r.outcomes.iter().all(|o| o.itl.len() == 5), "one chunk per token: 5 gaps after the first");
    assert_eq!(s.request_goodput, Some(s.request_throughput), "every request meets a 60 s TTFT");
    let j = r.result_json(&cfg, true);
    assert_eq!(j["model_id"], "tiny");
    assert_eq!(j["ttfts"].as_array().unwrap().len(), 24);
    for k in
        ["date", "backend", "num_prompts", "request_rate", "burstiness", "max_concurrency", "p90_tpot_ms", "errors"]
    {
        assert!(j.get(k).is_some(), "missing {k}");
    }
}

/// The multi-turn dataset against a real server with prefix caching: each conversation's turns
/// follow one another, each prompt is the conversation so far with the server's own answers in
/// it, and from the second turn on the server finds the history cached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_turn_conversations_resend_their_history_and_hit_the_prefix_cache() {
    let (base_url, state) = server(true).await;
    let (shared_len, turn_len, turns, output_len) = (64, 8, 3, 4);
    let dataset =
        Dataset::MultiTurn { shared_len, distinct_openings: false, turn_len, turns, output_len, vocab_size: 400 };
    let cfg = ServeConfig { seed: 1, ..config(base_url, dataset, 3, 50.0) };
    let r = run(&cfg).await.unwrap();
    assert_eq!((r.summary.completed, r.summary.failed), (9, 0));
    assert_eq!(r.turns.iter().filter(|&&t| t == 2).count(), 3);
    for (turn, req) in r.turns.iter().zip(&r.requests) {
        // The history: shared prompt, every earlier user turn and answer, this user turn.
        assert_eq!(req.prompt_len, shared_len + (turn + 1) * turn_len + turn * output_len);
    }
    // Each conversation's turn-2 prompt begins with its turn-1 prompt and the server's answer.
    let (t1, t2) = (r.turns.iter().position(|&t| t == 1).unwrap(), r.turns.iter().position(|&t| t == 2).unwrap());
    let ids = |i: usize| r.requests[i].prompt.as_array().unwrap().clone();
    let answer: Vec<serde_json::Value> = r.outcomes[t1].token_ids.iter().map(|&t| t.into()).collect();
    let mut want = ids(t1);
    want.extend(answer);
    assert_eq!(ids(t2)[..want.len()], want[..], "outcomes come conversation by conversation");
    assert_eq!(r.median_ttft_ms_by_turn().len(), 3);
    let stats = state.engine.stats();
    // Every turn after a conversation's first finds at least the shared 64 tokens cached.
    assert!(stats.prefix_hit_tokens >= 6 * 64, "{stats:?}");
    let j = r.result_json(&cfg, true);
    assert_eq!(j["median_ttft_ms_by_turn"].as_array().unwrap().len(), 3);
}

/// ShareGPT conversations turn by turn through the chat endpoint: each turn's messages are the
/// file's human messages so far with the server's own answers between them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharegpt_conversations_go_turn_by_turn_with_the_servers_answers() {
    let (base_url, _) = server(true).await;
    let dir = std::env::temp_dir().join(format!("tandem-sharegpt-mt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("conversations.json");
    let turn = |from: &str, value: &str| serde_json::json!({"from": from, "value": value});
    let file = serde_json::json!([
        {"conversations": [turn("human", "tell me about rivers"), turn("gpt", "rivers flow to the sea always"),
                           turn("human", "and stones?"), turn("gpt", "stones sit in rivers"),
                           turn("human", "why?"), turn("gpt", "water")]},
        {"conversations": [turn("gpt", "a reply with no question is skipped")]},
    ]);
    std::fs::write(&path, file.to_string()).unwrap();
    let dataset = Dataset::ShareGptMultiTurn { path, turns: 2, output_len: Some(5) };
    let cfg = config(base_url, dataset, 2, f64::INFINITY);
    let r = run(&cfg).await.unwrap();
    assert_eq!((r.summary.completed, r.summary.failed), (4, 0), "{:?}", r.outcomes);
    assert_eq!(r.turns, [0, 1, 0, 1], "two turns each (--multi-turn-turns 2), conversation by conversation");
    let messages = r.requests[1].prompt.as_array().unwrap();
    assert_eq!(messages.len(), 3);
    assert_eq!(messages[0]["content"], "tell me about rivers");
    assert_eq!(messages[1], serde_json::json!({"role": "assistant", "content": r.outcomes[0].text}));
    assert!(!r.outcomes[0].text.is_empty());
    assert_eq!(messages[2]["content"], "and stones?");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A sweep's points and their warm-ups send no prompt twice: against one server with prefix
/// caching on (a mode's engines stay up across its points) nothing is found cached, so each
/// point measures whole prefills. The same grid again (the next mode's prompts) is found.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweeps_points_and_warm_ups_send_no_prompt_twice() {
    let (base_url, state) = server(true).await;
    let dir = std::env::temp_dir().join(format!("tandem-sweep-seeds-{}", std::process::id()));
    let cfg = tandem_bench::sweep::SweepConfig {
        qps: vec![50.0, 100.0],
        input_lens: vec![32, 48],
        output_len: 2,
        iterations: 2,
        num_prompts: 4,
        vocab_size: 500,
        percentiles: vec![50.0],
        result_dir: dir.clone(),
        seed: 0,
        api_key: None,
        tls_ca: None,
    };
    tandem_bench::sweep::run_mode(&cfg, "colocated", &base_url, |_| {}).await.unwrap();
    let stats = state.engine.stats();
    assert_eq!(stats.prefix_hit_tokens, 0, "a point or a warm-up sent a prompt already sent: {stats:?}");
    tandem_bench::sweep::run_mode(&cfg, "colocated", &base_url, |_| {}).await.unwrap();
    // Each length's 16 measured prompts found the second time, all but their last block at least.
    let (measured, block) = (2 * 2 * 4, 16);
    let stats = state.engine.stats();
    assert!(stats.prefix_hit_tokens >= measured * (32 - block) + measured * (48 - block), "{stats:?}");
    std::fs::remove_dir_all(&dir).ok();
}
