//! `bench serve` against a real server on loopback: every request counted, token totals exact,
//! and the result JSON carries vLLM's keys.

use std::sync::Arc;

use tandem_bench::metrics::Slo;
use tandem_bench::serve::{run, Dataset, ServeConfig};
use tandem_engine::EngineConfig;
use tandem_model::{LoadedModel, ModelSource, Preset};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_generator_measures_a_real_server() {
    let m =
        LoadedModel::load(&ModelSource::Preset { preset: Preset::find("tiny-qwen3").unwrap(), seed: 0 }, None).unwrap();
    let cfg = EngineConfig {
        block_size: 16,
        num_blocks: 400,
        max_num_seqs: 64,
        max_num_batched_tokens: 256,
        async_scheduling: false,
        max_queue_time: None,
        prefix_caching: false,
    };
    let engine = tandem_engine::spawn(m.transformer, m.eos_token_ids, m.max_model_len, cfg).unwrap();
    let state = Arc::new(tandem_server::AppState::new(engine, m.tokenizer.map(Arc::new), "tiny".into()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base_url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(tandem_server::serve(listener, state, std::future::pending()));
    let cfg = ServeConfig {
        base_url,
        endpoint: "/v1/completions".into(),
        model: None,
        backend: "tandem".into(),
        dataset: Dataset::Random { input_len: 30, output_len: 6, range_ratio: 0.0, vocab_size: 500, as_text: false },
        num_prompts: 24,
        request_rate: 100.0,
        burstiness: 1.0,
        seed: 0,
        max_concurrency: Some(8),
        num_warmups: 1,
        ignore_eos: true,
        percentiles: vec![50.0, 90.0, 99.0],
        slo: Some(Slo { ttft_ms: Some(60_000.0), tpot_ms: None, e2el_ms: None }),
        progress: false,
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
