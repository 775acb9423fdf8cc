//! The engine over real models: batching, chunked prefill and preemption never change a
//! greedy token, seeded sampling repeats, stops and aborts behave, and blocks come back.

use std::collections::HashMap;
use std::path::PathBuf;

use tandem_core::{FinishReason, RequestId, SamplingParams};
use tandem_engine::{spawn, EngineConfig, EngineCore, EngineEvent, EngineRequest, RequestRejected, SubmitError};
use tandem_model::{LoadedModel, ModelSource, Preset};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

struct Case {
    prompt: Vec<u32>,
    expected: Vec<u32>,
}

fn fixture_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures").join(name)
}

fn fixture(name: &str) -> (LoadedModel, Vec<Case>) {
    let dir = fixture_dir(name);
    let model = LoadedModel::load(&ModelSource::Dir(dir.clone()), None).unwrap();
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let ids = |x: &serde_json::Value| x.as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let cases = v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case { prompt: ids(&c["prompt_ids"]), expected: ids(&c["greedy_ids"]) })
        .collect();
    (model, cases)
}

fn core(model: LoadedModel, block_size: usize, num_blocks: usize, budget: usize) -> EngineCore {
    core_with(model, block_size, num_blocks, budget, false)
}

/// `pipelined`: async scheduling, each step submitted before the previous one's tokens are
/// collected (the CPU runner resolves the carried tokens; the engine's bookkeeping is what
/// these tests check).
fn core_with(model: LoadedModel, block_size: usize, num_blocks: usize, budget: usize, pipelined: bool) -> EngineCore {
    let cfg = EngineConfig {
        block_size,
        num_blocks,
        max_num_seqs: 64,
        max_num_batched_tokens: budget,
        async_scheduling: pipelined,
        max_queue_time: None,
        // As `serve` runs: with batching, chunking and preemption, cached blocks are shared
        // between requests and taken back by preempted ones.
        prefix_caching: true,
    };
    let core = EngineCore::new(model.transformer, model.eos_token_ids, model.max_model_len, &cfg);
    assert_eq!(core.pipelined(), pipelined);
    core
}

/// Runs until idle; returns each request's tokens and finish reason.
fn run(
    core: &mut EngineCore,
    mut rxs: Vec<(RequestId, UnboundedReceiver<EngineEvent>)>,
) -> HashMap<RequestId, (Vec<u32>, Option<FinishReason>)> {
    let mut steps = 0;
    while core.has_work() {
        core.step();
        steps += 1;
        assert!(steps < 100_000, "engine did not finish");
    }
    let mut out = HashMap::new();
    for (id, rx) in rxs.iter_mut() {
        let mut toks = Vec::new();
        let mut fin = None;
        while let Ok(ev) = rx.try_recv() {
            match ev {
                EngineEvent::Tokens { token_ids, finish, .. } => {
                    toks.extend(token_ids);
                    fin = finish.or(fin);
                }
                EngineEvent::Failed(e) => panic!("{id}: {e}"),
                EngineEvent::QueueTimeout { .. } => panic!("{id}: ended in the queue"),
                EngineEvent::KvProduced { .. } | EngineEvent::KvLoaded { .. } => {
                    panic!("{id}: a colocated engine moved remote KV")
                }
            }
        }
        out.insert(id.clone(), (toks, fin));
    }
    out
}

fn greedy_ignore_eos(n: usize) -> SamplingParams {
    SamplingParams { ignore_eos: true, ..SamplingParams::greedy(n) }
}

/// Prefix caching: a prompt that begins as an earlier one takes that one's cached KV for its
/// whole leading blocks and computes only the rest (at least its last token), and its tokens
/// are those it gets with nothing cached; blocks all come back, the cached ones still cached.
#[test]
fn a_prompt_that_begins_as_an_earlier_one_computes_only_the_rest_with_the_same_tokens() {
    let (_, cases) = fixture("qwen3");
    let first = cases.iter().find(|c| c.prompt.len() == 100).expect("a 100-token case").prompt.clone();
    let mut branched = first[..90].to_vec();
    branched.extend((0..20u32).map(|i| (i * 7 + 3) % 50));
    let prompts = [first.clone(), branched.clone(), first.clone(), first[..37].to_vec()];
    for pipelined in [false, true] {
        // Each prompt alone, nothing cached: the reference.
        let want: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| {
                let (model, _) = fixture("qwen3");
                let mut core = core_with(model, 16, 64, 4096, pipelined);
                let (tx, rx) = unbounded_channel();
                core.add_request(EngineRequest::new(RequestId::new("alone"), p.clone(), greedy_ignore_eos(8)), tx)
                    .unwrap();
                run(&mut core, vec![(RequestId::new("alone"), rx)]).remove(&RequestId::new("alone")).unwrap().0
            })
            .collect();
        // One after another on one engine: each after the first finds blocks cached.
        let (model, _) = fixture("qwen3");
        let mut core = core_with(model, 16, 64, 4096, pipelined);
        let mut hits = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            let id = RequestId::new(format!("r{i}"));
            let (tx, rx) = unbounded_channel();
            core.add_request(EngineRequest::new(id.clone(), p.clone(), greedy_ignore_eos(8)), tx).unwrap();
            let before = core.prefix_cache().0.hit_tokens;
            let toks = run(&mut core, vec![(id.clone(), rx)]).remove(&id).unwrap().0;
            assert_eq!(toks, want[i], "prompt {i} (pipelined: {pipelined})");
            hits.push(core.prefix_cache().0.hit_tokens - before);
            assert_eq!(core.num_free_blocks(), 64, "every block back after prompt {i}");
        }
        // The first computes all; the branch shares 5 whole blocks (80 of its first 90
        // tokens); the repeat takes 6 (96 tokens) and computes 4; the 37-token prefix of the
        // first takes its 2 whole blocks.
        assert_eq!(hits, [0, 80, 96, 32], "pipelined: {pipelined}");
        assert!(core.prefix_cache().1 >= 7, "the blocks stay cached while free");
    }
}

#[test]
fn batched_chunked_and_preempted_runs_match_transformers() {
    for name in ["qwen3", "qwen2", "llama"] {
        // (block size, blocks, token budget): roomy; chunked with odd blocks; so few blocks
        // that requests must be preempted and recomputed. Each also pipelined.
        for (bs, blocks, budget, pipelined) in [(16, 256, 4096), (5, 200, 32), (4, 40, 24)]
            .into_iter()
            .flat_map(|(bs, blocks, budget)| [(bs, blocks, budget, false), (bs, blocks, budget, true)])
        {
            let (model, cases) = fixture(name);
            let mut core = core_with(model, bs, blocks, budget, pipelined);
            let mut rxs = Vec::new();
            // Every prompt twice, all at once: requests share batches.
            for (i, c) in cases.iter().chain(cases.iter()).enumerate() {
                let (tx, rx) = unbounded_channel();
                let id = RequestId::new(format!("{name}-{i}"));
                core.add_request(
                    EngineRequest::new(id.clone(), c.prompt.clone(), greedy_ignore_eos(c.expected.len())),
                    tx,
                )
                .unwrap();
                rxs.push((id, rx));
            }
            let out = run(&mut core, rxs);
            for (i, c) in cases.iter().chain(cases.iter()).enumerate() {
                let (toks, fin) = &out[&RequestId::new(format!("{name}-{i}"))];
                assert_eq!(
                    toks,
                    &c.expected,
                    "{name} bs={bs} blocks={blocks} budget={budget} pipelined={pipelined} prompt of {}",
                    c.prompt.len()
                );
                assert_eq!(*fin, Some(FinishReason::Length));
            }
            if blocks == 40 {
                assert!(core.num_preemptions() > 0, "{name}: the tight pool should have forced preemption");
            }
            assert_eq!(core.num_free_blocks(), blocks, "{name}: every block back in the pool");
        }
    }
}

/// `logprobs`: each generated token's log-probability and its alternatives' are the
/// log-softmax (in f64 here) of the logits the model gives at that position computed alone
/// (a fresh cache, the whole prefix at once), whatever the batch, chunking or pipelining that
/// produced the token: the right row of the right step reaches the right request. Sampled with
/// a temperature too: log-probabilities are of the raw distribution.
#[test]
fn logprobs_are_the_log_softmax_of_the_tokens_own_logits() {
    let (_, cases) = fixture("qwen3");
    let reference = LoadedModel::load(&ModelSource::Dir(fixture_dir("qwen3")), None).unwrap().transformer;
    let vocab = reference.config().vocab_size;
    let logits_after = |prefix: &[u32]| {
        let mut kv = tandem_compute::KvCache::new(reference.kv_layout(16, prefix.len().div_ceil(16) + 1));
        let table: Vec<u32> = (0..kv.layout().num_blocks as u32).collect();
        let seq = tandem_model::SeqBatch {
            token_start: 0,
            num_tokens: prefix.len(),
            first_pos: 0,
            block_table: &table,
            want_logits: true,
        };
        let logits = reference.forward(prefix, &[seq], &mut kv);
        assert_eq!(logits.len(), vocab);
        logits
    };
    for (budget, pipelined) in [(4096, false), (7, true)] {
        let mut core = core_with(
            LoadedModel::load(&ModelSource::Dir(fixture_dir("qwen3")), None).unwrap(),
            4,
            300,
            budget,
            pipelined,
        );
        let mut rxs = Vec::new();
        for (i, c) in cases.iter().take(3).enumerate() {
            let (tx, rx) = unbounded_channel();
            let id = RequestId::new(format!("lp-{i}"));
            let params = SamplingParams {
                logprobs: Some(if i == 0 { 0 } else { 4 }),
                temperature: if i == 2 { 0.8 } else { 0.0 },
                seed: Some(7),
                ..greedy_ignore_eos(5)
            };
            core.add_request(EngineRequest::new(id.clone(), c.prompt.clone(), params), tx).unwrap();
            rxs.push((id, c.prompt.clone(), rx));
        }
        while core.has_work() {
            core.step();
        }
        for (i, (id, prompt, mut rx)) in rxs.into_iter().enumerate() {
            let (mut tokens, mut lps) = (Vec::new(), Vec::new());
            while let Ok(ev) = rx.try_recv() {
                if let EngineEvent::Tokens { token_ids, logprobs, .. } = ev {
                    assert_eq!(logprobs.len(), token_ids.len(), "{id}: one entry per token");
                    tokens.extend(token_ids);
                    lps.extend(logprobs);
                }
            }
            assert_eq!(tokens.len(), 5, "{id}");
            for (k, (&token, lp)) in tokens.iter().zip(&lps).enumerate() {
                let seq: Vec<u32> = prompt.iter().chain(&tokens[..k]).copied().collect();
                let logits = logits_after(&seq);
                let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
                let log_sum = logits.iter().map(|&l| (l as f64 - max).exp()).sum::<f64>().ln();
                let want = |t: u32| logits[t as usize] as f64 - max - log_sum;
                let case = format!("{id} token {k} (budget {budget}, pipelined {pipelined})");
                assert!((lp.logprob as f64 - want(token)).abs() < 1e-4, "{case}: {} vs {}", lp.logprob, want(token));
                assert_eq!(lp.top.len(), if i == 0 { 0 } else { 4 }, "{case}");
                for w in lp.top.windows(2) {
                    assert!(w[0].1 >= w[1].1, "{case}: most likely first: {:?}", lp.top);
                }
                for &(alt, alt_lp) in &lp.top {
                    assert!((alt_lp as f64 - want(alt)).abs() < 1e-4, "{case}: alternative {alt}");
                }
                let best = (0..vocab as u32)
                    .max_by(|&a, &b| logits[a as usize].total_cmp(&logits[b as usize]).then(b.cmp(&a)));
                if let Some(&(first, _)) = lp.top.first() {
                    assert_eq!(Some(first), best, "{case}: the most likely token heads the list");
                }
                if i < 2 {
                    assert_eq!(Some(token), best, "{case}: greedy took the most likely token");
                }
            }
        }
    }
}

#[test]
fn seeded_sampling_repeats_regardless_of_batch() {
    let p = Preset::find("tiny-qwen3").unwrap();
    let load = || LoadedModel::load(&ModelSource::Preset { preset: p, seed: 0 }, None).unwrap();
    let params = |seed| SamplingParams {
        temperature: 0.8,
        top_p: 0.9,
        top_k: Some(50),
        seed: Some(seed),
        ignore_eos: true,
        ..SamplingParams::greedy(20)
    };
    let prompt: Vec<u32> = (10..30).collect();
    // Alone.
    let mut c = core(load(), 16, 64, 512);
    let (tx, rx) = unbounded_channel();
    c.add_request(EngineRequest::new(RequestId::new("a"), prompt.clone(), params(7)), tx).unwrap();
    let alone = run(&mut c, vec![(RequestId::new("a"), rx)]).remove(&RequestId::new("a")).unwrap().0;
    // Beside other requests with other seeds, then the same pipelined.
    for pipelined in [false, true] {
        let mut c = core_with(load(), 16, 64, 512, pipelined);
        let mut rxs = Vec::new();
        for (i, seed) in [3u64, 7, 9].into_iter().enumerate() {
            let (tx, rx) = unbounded_channel();
            let id = RequestId::new(format!("r{i}"));
            c.add_request(EngineRequest::new(id.clone(), prompt.clone(), params(seed)), tx).unwrap();
            rxs.push((id, rx));
        }
        let out = run(&mut c, rxs);
        assert_eq!(out[&RequestId::new("r1")].0, alone, "pipelined={pipelined}");
        assert_ne!(out[&RequestId::new("r0")].0, alone, "a different seed should differ");
        assert_eq!(c.num_free_blocks(), 64);
    }
}

#[test]
fn eos_min_tokens_stop_ids_and_max_tokens() {
    // Pipelined, the stop tokens arrive while the next step of their request already runs.
    for pipelined in [false, true] {
        eos_min_tokens_stop_ids_and_max_tokens_in(pipelined);
    }
}

fn eos_min_tokens_stop_ids_and_max_tokens_in(pipelined: bool) {
    let (model, cases) = fixture("qwen3");
    let c = &cases[1];
    let eos = c.expected[3]; // make the 4th greedy token an end-of-sequence token
    let cfg = EngineConfig {
        block_size: 16,
        num_blocks: 64,
        max_num_seqs: 8,
        max_num_batched_tokens: 256,
        async_scheduling: pipelined,
        max_queue_time: None,
        prefix_caching: false,
    };
    let mut core = EngineCore::new(model.transformer, vec![eos], model.max_model_len, &cfg);
    assert_eq!(core.pipelined(), pipelined);
    let mut submit = |id: &str, params: SamplingParams| {
        let (tx, rx) = unbounded_channel();
        core.add_request(EngineRequest::new(RequestId::new(id), c.prompt.clone(), params), tx).unwrap();
        (RequestId::new(id), rx)
    };
    let rx = vec![
        submit("eos", SamplingParams::greedy(20)),
        submit("ignore", greedy_ignore_eos(6)),
        submit("min", SamplingParams { min_tokens: 5, ..SamplingParams::greedy(20) }),
        submit("stopid", SamplingParams { stop_token_ids: vec![c.expected[1]], ..SamplingParams::greedy(20) }),
        submit("one", greedy_ignore_eos(1)),
    ];
    let out = run(&mut core, rx);
    assert_eq!(out[&RequestId::new("eos")], (c.expected[..4].to_vec(), Some(FinishReason::Stop)));
    assert_eq!(out[&RequestId::new("ignore")], (c.expected[..6].to_vec(), Some(FinishReason::Length)));
    let min = &out[&RequestId::new("min")].0;
    assert!(min.len() >= 5 && !min[..4].contains(&eos), "eos suppressed until min_tokens: {min:?}");
    assert_eq!(out[&RequestId::new("stopid")], (c.expected[..2].to_vec(), Some(FinishReason::Stop)));
    assert_eq!(out[&RequestId::new("one")], (c.expected[..1].to_vec(), Some(FinishReason::Length)));
    assert_eq!(core.num_free_blocks(), 64);
}

#[test]
fn invalid_requests_are_refused_with_reasons() {
    let (model, _) = fixture("llama");
    let cfg = EngineConfig {
        block_size: 16,
        num_blocks: 4,
        max_num_seqs: 8,
        max_num_batched_tokens: 64,
        async_scheduling: false,
        max_queue_time: None,
        prefix_caching: false,
    };
    let mut core = EngineCore::new(model.transformer, model.eos_token_ids, 1024, &cfg);
    let mut add = |prompt: Vec<u32>, params: SamplingParams| {
        let (tx, _rx) = unbounded_channel();
        core.add_request(EngineRequest::new(RequestId::new("x"), prompt, params), tx)
    };
    assert_eq!(add(vec![], SamplingParams::greedy(1)), Err(RequestRejected::EmptyPrompt));
    assert!(matches!(
        add(vec![5, 512], SamplingParams::greedy(1)),
        Err(RequestRejected::TokenOutOfRange { id: 512, .. })
    ));
    assert!(matches!(add(vec![5; 1024], SamplingParams::greedy(1)), Err(RequestRejected::PromptTooLong { .. })));
    assert!(matches!(add(vec![5; 1000], SamplingParams::greedy(30)), Err(RequestRejected::ExceedsContext { .. })));
    assert!(matches!(
        add(vec![5; 60], SamplingParams::greedy(10)),
        Err(RequestRejected::ExceedsKvCapacity { needed: 5, total: 4 })
    ));
    assert!(matches!(
        add(vec![5], SamplingParams { temperature: -1.0, ..SamplingParams::greedy(1) }),
        Err(RequestRejected::Sampling(_))
    ));
    assert!(add(vec![5; 60], SamplingParams::greedy(4)).is_ok());
    assert!(matches!(add(vec![5], SamplingParams::greedy(4)), Err(RequestRejected::DuplicateId(_))));
}

#[tokio::test]
async fn dropping_a_stream_aborts_and_frees_blocks_on_the_engine_thread() {
    for pipelined in [false, true] {
        dropping_a_stream_aborts_in(pipelined).await;
    }
}

async fn dropping_a_stream_aborts_in(pipelined: bool) {
    let p = Preset::find("tiny-llama").unwrap();
    let m = LoadedModel::load(&ModelSource::Preset { preset: p, seed: 1 }, None).unwrap();
    let cfg = EngineConfig {
        block_size: 16,
        num_blocks: 128,
        max_num_seqs: 8,
        max_num_batched_tokens: 256,
        async_scheduling: pipelined,
        max_queue_time: None,
        prefix_caching: false,
    };
    let engine = spawn(m.transformer, m.eos_token_ids, m.max_model_len, cfg).unwrap();
    let mut long =
        engine.submit(EngineRequest::new(RequestId::new("long"), vec![7; 40], greedy_ignore_eos(2000))).unwrap();
    assert!(matches!(long.next().await, Some(EngineEvent::Tokens { .. })));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    // Stats are published after each step, a moment after its events are sent.
    while engine.stats().free_blocks == 128 {
        assert!(std::time::Instant::now() < deadline, "the request never held blocks");
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    drop(long);
    while engine.stats().free_blocks != 128 || engine.stats().running != 0 {
        assert!(std::time::Instant::now() < deadline, "blocks not freed after abort: {:?}", engine.stats());
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    // The engine still serves after the abort, and refuses bad input without dying.
    let err = engine.submit(EngineRequest::new(RequestId::new("bad"), vec![9999], SamplingParams::greedy(1)));
    assert!(matches!(err, Err(SubmitError::Rejected(RequestRejected::TokenOutOfRange { .. }))));
    let mut ok = engine.submit(EngineRequest::new(RequestId::new("ok"), vec![7; 3], greedy_ignore_eos(3))).unwrap();
    let mut n = 0;
    while let Some(EngineEvent::Tokens { token_ids, finish, .. }) = ok.next().await {
        n += token_ids.len();
        if finish.is_some() {
            break;
        }
    }
    assert_eq!(n, 3);
    assert!(engine.is_alive());
}

#[tokio::test]
async fn dropping_a_stream_mid_prefill_stops_the_prefill() {
    // Budget 1: the 2000-token prompt needs 2000 steps before its first token, so only the
    // explicit abort sent on drop (not a failed token send) can stop it early.
    let p = Preset::find("tiny-llama").unwrap();
    let m = LoadedModel::load(&ModelSource::Preset { preset: p, seed: 1 }, None).unwrap();
    let cfg = EngineConfig {
        block_size: 16,
        num_blocks: 256,
        max_num_seqs: 8,
        max_num_batched_tokens: 1,
        async_scheduling: false,
        max_queue_time: None,
        prefix_caching: false,
    };
    let engine = spawn(m.transformer, m.eos_token_ids, m.max_model_len, cfg).unwrap();
    let stream = engine.submit(EngineRequest::new(RequestId::new("p"), vec![3; 2000], greedy_ignore_eos(1))).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while engine.stats().steps < 5 {
        assert!(std::time::Instant::now() < deadline);
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    drop(stream);
    while engine.stats().free_blocks != 256 || engine.stats().running != 0 {
        assert!(std::time::Instant::now() < deadline, "{:?}", engine.stats());
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    assert!(engine.stats().steps < 1000, "prefill ran on after the abort: {:?}", engine.stats());
}

/// Where [`FailingOnce`] fails.
#[derive(Clone, Copy, PartialEq)]
enum FailAt {
    /// The `n`-th `execute` (a runner that runs one step at a time).
    Execute,
    /// The `n`-th `submit` is refused (a pipelining runner).
    Submit,
    /// The `n`-th `collect` reports a failure: the step ran on the device, its tokens never
    /// arrive.
    Collect,
}

/// Fault injection around the real CPU runner: its `fail_at`-th call of one kind fails (as a
/// GPU launch error would), every other call runs the model.
struct FailingOnce {
    inner: tandem_model::CpuRunner,
    calls: usize,
    fail_at: usize,
    at: FailAt,
}

impl FailingOnce {
    /// Counts a call of kind `at`; true when it is the one to fail.
    fn fails(&mut self, at: FailAt) -> bool {
        if self.at != at {
            return false;
        }
        self.calls += 1;
        self.calls == self.fail_at
    }
}

fn injected() -> tandem_model::ModelError {
    tandem_model::ModelError::Device("injected launch failure".into())
}

impl tandem_model::ModelRunner for FailingOnce {
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn config(&self) -> &tandem_model::ModelConfig {
        self.inner.config()
    }
    fn max_positions(&self) -> usize {
        self.inner.max_positions()
    }
    fn kv_layout(&self) -> tandem_compute::KvLayout {
        self.inner.kv_layout()
    }
    fn kv_region(&self) -> Option<std::sync::Arc<tandem_compute::KvRegion>> {
        self.inner.kv_region()
    }
    fn fingerprint(&self) -> String {
        self.inner.fingerprint()
    }
    fn execute(
        &mut self,
        token_ids: &[u32],
        seqs: &[tandem_model::SeqBatch<'_>],
        samples: &[tandem_model::SampleSpec],
    ) -> Result<Vec<u32>, tandem_model::ModelError> {
        if self.fails(FailAt::Execute) {
            return Err(injected());
        }
        self.inner.execute(token_ids, seqs, samples)
    }
    fn can_pipeline(&self) -> bool {
        self.at != FailAt::Execute
    }
    fn submit(
        &mut self,
        token_ids: &[u32],
        seqs: &[tandem_model::SeqBatch<'_>],
        samples: &[tandem_model::SampleSpec],
    ) -> Result<(), tandem_model::ModelError> {
        if self.fails(FailAt::Submit) {
            return Err(injected());
        }
        self.inner.submit(token_ids, seqs, samples)
    }
    fn collect(&mut self) -> Result<Vec<u32>, tandem_model::ModelError> {
        let tokens = self.inner.collect();
        if self.fails(FailAt::Collect) {
            return Err(injected());
        }
        tokens
    }
}

/// A failed forward ends the requests of that batch with the error, returns their blocks, and
/// the engine serves the next request with the right tokens: run one step at a time, and
/// pipelined with the failure at submit or at collect.
#[test]
fn a_failed_forward_fails_its_batch_and_the_engine_keeps_serving() {
    for at in [FailAt::Execute, FailAt::Submit, FailAt::Collect] {
        a_failed_forward_fails_its_batch_in(at);
    }
}

fn a_failed_forward_fails_its_batch_in(at: FailAt) {
    let pipelined = at != FailAt::Execute;
    let (model, cases) = fixture("qwen3");
    let cfg = EngineConfig {
        block_size: 16,
        num_blocks: 64,
        max_num_seqs: 8,
        max_num_batched_tokens: 4096,
        async_scheduling: pipelined,
        max_queue_time: None,
        prefix_caching: false,
    };
    let runner =
        FailingOnce { inner: tandem_model::CpuRunner::new(model.transformer, 16, 64), calls: 0, fail_at: 2, at };
    let boxed: Box<dyn tandem_model::ModelRunner> = Box::new(runner);
    let mut core = EngineCore::new(boxed, model.eos_token_ids, model.max_model_len, &cfg);
    assert_eq!(core.pipelined(), pipelined);
    let case = &cases[1];
    let submit = |core: &mut EngineCore, id: &str| {
        let (tx, rx) = unbounded_channel();
        core.add_request(EngineRequest::new(RequestId::new(id), case.prompt.clone(), greedy_ignore_eos(4)), tx)
            .unwrap();
        rx
    };
    // Step 1 prefills, step 2 (the first decode) fails.
    let mut first = submit(&mut core, "first");
    let mut steps = 0;
    while core.has_work() {
        core.step();
        steps += 1;
        assert!(steps < 100);
    }
    let mut failed = None;
    while let Ok(ev) = first.try_recv() {
        if let EngineEvent::Failed(e) = ev {
            failed = Some(e);
        }
    }
    let failed = failed.expect("the request in the failed batch gets an error");
    assert!(failed.contains("injected launch failure"), "{failed}");
    assert_eq!(core.num_free_blocks(), 64, "its blocks come back");
    // The next request runs normally and matches transformers.
    let second = submit(&mut core, "second");
    let out = run(&mut core, vec![(RequestId::new("second"), second)]);
    assert_eq!(out[&RequestId::new("second")].0, case.expected[..4].to_vec(), "pipelined={pipelined}");
}

/// Pipelined, a step's report describes the step it collected: the first step only submits,
/// and every later one reports the step before it. Aborting a request whose step is in flight
/// and reusing its id at once gives the new request its own tokens (the late token of the old
/// one is dropped), and every block comes back.
#[test]
fn pipelined_steps_report_the_collected_step_and_drop_tokens_of_ended_requests() {
    let (model, cases) = fixture("qwen3");
    let mut core = core_with(model, 16, 64, 4096, true);
    let (a, b) = (&cases[0], &cases[1]);
    let (tx, mut old_rx) = unbounded_channel();
    core.add_request(EngineRequest::new(RequestId::new("x"), a.prompt.clone(), greedy_ignore_eos(8)), tx).unwrap();
    let first = core.step();
    assert_eq!(first.num_tokens, 0, "the first step is only submitted");
    let second = core.step();
    assert_eq!((second.num_tokens, second.num_seqs), (a.prompt.len(), 1), "the second reports the prefill");
    let third = core.step();
    assert_eq!((third.num_tokens, third.num_seqs), (1, 1), "then one decode token a step");
    // "x" has its third token in flight; end it and start another "x" at once.
    assert!(core.abort(&RequestId::new("x")));
    let (tx, rx) = unbounded_channel();
    core.add_request(EngineRequest::new(RequestId::new("x"), b.prompt.clone(), greedy_ignore_eos(6)), tx).unwrap();
    let out = run(&mut core, vec![(RequestId::new("x"), rx)]);
    assert_eq!(out[&RequestId::new("x")], (b.expected[..6].to_vec(), Some(FinishReason::Length)));
    let mut old = Vec::new();
    while let Ok(EngineEvent::Tokens { token_ids, .. }) = old_rx.try_recv() {
        old.extend(token_ids);
    }
    assert_eq!(old, a.expected[..2].to_vec(), "the aborted request got the tokens collected before the abort");
    assert_eq!(core.num_free_blocks(), 64);
}

/// `max_queue_time`: a request still queued past the bound without having run ends with
/// `QueueTimeout` (nothing computed, no block held), while the running request, a request that
/// ran and was preempted back into the queue, and one that arrived later all finish with their
/// greedy tokens, and every block comes back.
#[test]
fn a_request_queued_past_the_bound_ends_and_nothing_that_ran_does() {
    let (model, cases) = fixture("qwen3");
    let c = &cases[0];
    let bound = std::time::Duration::from_millis(200);
    // Blocks of 4 tokens, room for both prompts and a few tokens: the newer of two running
    // requests is preempted as they grow.
    let num_blocks = 2 * (c.prompt.len() + 4).div_ceil(4);
    let cfg = EngineConfig {
        block_size: 4,
        num_blocks,
        max_num_seqs: 2,
        max_num_batched_tokens: 256,
        async_scheduling: false,
        max_queue_time: Some(bound),
        prefix_caching: false,
    };
    let mut core = EngineCore::new(model.transformer, model.eos_token_ids, model.max_model_len, &cfg);
    let submit = |core: &mut EngineCore, id: &str| {
        let (tx, rx) = unbounded_channel();
        core.add_request(EngineRequest::new(RequestId::new(id), c.prompt.clone(), greedy_ignore_eos(12)), tx).unwrap();
        (RequestId::new(id), rx)
    };
    let (a, b, mut queued) = (submit(&mut core, "a"), submit(&mut core, "b"), submit(&mut core, "queued"));
    let mut steps = 0;
    while core.num_preemptions() == 0 {
        core.step();
        steps += 1;
        assert!(steps < 1000, "no preemption: the test's block count is off");
    }
    // `b` is back in the queue, `queued` never ran; both wait past the bound.
    std::thread::sleep(bound + std::time::Duration::from_millis(50));
    core.step();
    match queued.1.try_recv() {
        Ok(EngineEvent::QueueTimeout { waited_ms, bound_ms }) => {
            assert_eq!(bound_ms, 200);
            assert!(waited_ms >= 200, "{waited_ms}");
        }
        other => panic!("`queued` should have ended in the queue, got {other:?}"),
    }
    assert!(queued.1.try_recv().is_err(), "nothing follows the queue timeout");
    let late = submit(&mut core, "late");
    let out = run(&mut core, vec![a, b, late]);
    for id in ["a", "b", "late"] {
        assert_eq!(out[&RequestId::new(id)], (c.expected[..12].to_vec(), Some(FinishReason::Length)), "{id}");
    }
    assert_eq!(core.num_free_blocks(), num_blocks);
}
