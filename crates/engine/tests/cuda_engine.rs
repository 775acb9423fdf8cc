//! The engine on a GPU: decode steps replayed from CUDA graphs (padded to a batch bucket) give
//! the same greedy tokens as launching every kernel, seeded sampling on the device repeats,
//! pipelined steps (async scheduling: tokens carried on the device) give the same tokens as
//! steps run one at a time, and every KV block comes back.
//! Ignored by `cargo test`: they need a GPU. scripts/gpu/run.sh runs them
//! with `--include-ignored`, where a missing GPU fails the test (`TANDEM_REQUIRE_CUDA=1`).

use std::collections::HashMap;

use tandem_compute::cuda::CudaTuning;
use tandem_core::{RequestId, SamplingParams};
use tandem_engine::{EngineConfig, EngineCore, EngineEvent, EngineRequest};
use tandem_model::{CudaModel, CudaOptions, ModelRunner, ModelSource, ModelSpec};
use tokio::sync::mpsc::unbounded_channel;

fn engine(graphs: bool) -> Option<EngineCore> {
    engine_with(graphs, false)
}

fn engine_with(graphs: bool, pipelined: bool) -> Option<EngineCore> {
    engine_of(small_engine(pipelined), graphs, false)
}

/// 256 blocks of 16 tokens, steps of up to 512 tokens and 16 sequences.
fn small_engine(pipelined: bool) -> EngineConfig {
    EngineConfig {
        block_size: 16,
        num_blocks: 256,
        max_num_seqs: 16,
        max_num_batched_tokens: 512,
        async_scheduling: pipelined,
        max_queue_time: None,
        prefix_caching: false,
    }
}

fn engine_of(cfg: EngineConfig, graphs: bool, batch_invariant: bool) -> Option<EngineCore> {
    engine_tuned(cfg, graphs, batch_invariant, CudaTuning::default())
}

/// [`engine_of`] with `tuning`.
fn engine_tuned(cfg: EngineConfig, graphs: bool, batch_invariant: bool, tuning: CudaTuning) -> Option<EngineCore> {
    if let Err(e) = tandem_compute::cuda::CudaDevice::open_with(0, Default::default(), kernel_cache().as_deref()) {
        assert!(std::env::var("TANDEM_REQUIRE_CUDA").map_or(true, |v| v != "1"), "no usable GPU: {e}");
        eprintln!("skipping: {e}");
        return None;
    }
    let spec = ModelSpec::load(&ModelSource::parse("preset:qwen3-0.6b", 1).unwrap(), Some(1024)).unwrap();
    let pipelined = cfg.async_scheduling;
    let opts = CudaOptions {
        block_size: cfg.block_size,
        max_tokens: cfg.max_num_batched_tokens,
        max_seqs: cfg.max_num_seqs,
        num_blocks: Some(cfg.num_blocks),
        cuda_graphs: graphs,
        batch_invariant,
        tuning,
        ..CudaOptions::default()
    };
    let model: Box<dyn ModelRunner> = Box::new(CudaModel::load(&spec, &opts).unwrap());
    let core = EngineCore::new(model, spec.eos_token_ids, spec.max_model_len, &cfg);
    assert_eq!(core.pipelined(), pipelined, "the CUDA runner pipelines");
    Some(core)
}

/// Five requests of different lengths at once (decode batches of 5, then fewer as they end:
/// padded to buckets 8, 4, 2, 1); returns each one's tokens.
fn run(core: &mut EngineCore, params: impl Fn(usize) -> SamplingParams) -> HashMap<usize, Vec<u32>> {
    let requests: Vec<(usize, Vec<u32>, SamplingParams)> = (0..5)
        .map(|i| {
            let prompt: Vec<u32> = (0..(10 + 37 * i) as u32).map(|j| (j * 31 + i as u32 * 7) % 150_000).collect();
            (i, prompt, params(i))
        })
        .collect();
    run_in_groups(core, &requests, requests.len())
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu/run.sh runs it with --include-ignored)"]
fn graph_replay_equals_eager_launches_and_seeds_repeat() {
    let Some(mut graphs) = engine(true) else { return };
    let Some(mut eager) = engine(false) else { return };
    let greedy = |i: usize| SamplingParams { ignore_eos: true, ..SamplingParams::greedy(8 + 6 * i) };
    let a = run(&mut graphs, greedy);
    let b = run(&mut eager, greedy);
    assert_eq!(a, b, "CUDA graph replay changed greedy tokens");
    for (i, t) in &a {
        assert_eq!(t.len(), 8 + 6 * i);
    }
    let seeded = |i: usize| SamplingParams {
        temperature: 0.8,
        top_p: 0.9,
        top_k: Some(50),
        seed: Some(i as u64),
        ignore_eos: true,
        ..SamplingParams::greedy(12)
    };
    let s1 = run(&mut graphs, seeded);
    let s2 = run(&mut graphs, seeded);
    assert_eq!(s1, s2, "same seeds, same tokens");
    assert_ne!(s1, a.iter().map(|(i, t)| (*i, t[..12.min(t.len())].to_vec())).collect::<HashMap<_, _>>());

    // Decode contexts split into ranges of 64 keys (as contexts past 256 keys are by default):
    // the split graphs (whole GQA groups on the tensor-core attention, RoPE in its own kernel)
    // against the same launches made one by one.
    let tuning = CudaTuning { attention_split_keys: 64, ..CudaTuning::default() };
    let Some(mut split_graphs) = engine_tuned(small_engine(false), true, false, tuning.clone()) else { return };
    let Some(mut split_eager) = engine_tuned(small_engine(false), false, false, tuning) else { return };
    let a = run(&mut split_graphs, greedy);
    assert_eq!(a, run(&mut split_eager, greedy), "CUDA graph replay of split steps changed greedy tokens");
}

#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu/run.sh runs it with --include-ignored)"]
fn pipelined_steps_equal_steps_run_one_at_a_time() {
    let Some(mut pipelined) = engine_with(true, true) else { return };
    let Some(mut alone) = engine_with(true, false) else { return };
    let greedy = |i: usize| SamplingParams { ignore_eos: true, ..SamplingParams::greedy(8 + 6 * i) };
    let reference = run(&mut alone, greedy);
    assert_eq!(run(&mut pipelined, greedy), reference, "pipelined steps changed greedy tokens");
    // Stop tokens that end requests while their next step is already on the device (its
    // output dropped), and min_tokens bans counted with a token still in flight.
    let stops: HashMap<usize, u32> = reference.iter().map(|(i, t)| (*i, t[3 + i % 3])).collect();
    let stopping = |i: usize| SamplingParams {
        stop_token_ids: vec![stops[&i]],
        min_tokens: if i == 0 { 5 } else { 0 },
        ..SamplingParams::greedy(8 + 6 * i)
    };
    let a = run(&mut alone, stopping);
    assert_eq!(run(&mut pipelined, stopping), a, "stops and bans differ when pipelined");
    for (i, t) in &a {
        assert!(t.len() < reference[i].len() || *i == 0, "request {i} should have stopped early: {t:?}");
    }
    let seeded = |i: usize| SamplingParams {
        temperature: 0.8,
        top_p: 0.9,
        top_k: Some(50),
        seed: Some(100 + i as u64),
        ignore_eos: true,
        ..SamplingParams::greedy(12)
    };
    assert_eq!(run(&mut pipelined, seeded), run(&mut alone, seeded), "seeded sampling differs when pipelined");
}

/// Runs `requests` (index, prompt, sampling) `window` at a time (each group to completion before
/// the next arrives); returns each one's tokens, checking every KV block comes back.
fn run_in_groups(
    core: &mut EngineCore,
    requests: &[(usize, Vec<u32>, SamplingParams)],
    window: usize,
) -> HashMap<usize, Vec<u32>> {
    let free = core.num_free_blocks();
    let mut out = HashMap::new();
    for group in requests.chunks(window.max(1)) {
        let mut rxs = Vec::new();
        for (i, prompt, params) in group {
            let (tx, rx) = unbounded_channel();
            let req = EngineRequest::new(RequestId::new(format!("r{i}-{}", out.len())), prompt.clone(), params.clone());
            core.add_request(req, tx).unwrap();
            rxs.push((*i, rx));
        }
        let mut steps = 0;
        while core.has_work() {
            core.step();
            steps += 1;
            assert!(steps < 100_000);
        }
        for (i, mut rx) in rxs {
            let mut toks = Vec::new();
            while let Ok(ev) = rx.try_recv() {
                match ev {
                    EngineEvent::Tokens { token_ids, .. } => toks.extend(token_ids),
                    EngineEvent::Failed(e) => panic!("request {i}: {e}"),
                    _ => {}
                }
            }
            out.insert(i, toks);
        }
    }
    assert_eq!(core.num_free_blocks(), free, "every KV block comes back");
    out
}

/// `--batch-invariant`: every request gets the tokens it gets alone, whatever arrives with it
/// (24 or 64 at a time, in another order), with chunked prefill (a 512-token step budget) or
/// whole prompts (4096), over prefix-cached blocks, greedy and seeded sampling. Without the
/// flag the same comparison is reported (on a GPU some requests' greedy tokens move with their
/// batch).
#[test]
#[ignore = "needs a CUDA GPU (scripts/gpu/run.sh runs it with --include-ignored)"]
fn batch_invariant_requests_get_their_answer_alone_whatever_shares_the_batch() {
    let cfg = |budget: usize| EngineConfig {
        block_size: 16,
        num_blocks: 2048,
        max_num_seqs: 64,
        max_num_batched_tokens: budget,
        async_scheduling: true,
        max_queue_time: None,
        prefix_caching: false,
    };
    let requests: Vec<(usize, Vec<u32>, SamplingParams)> = (0..64)
        .map(|i| {
            let len = 5 + (i * 97) % 400;
            let prompt: Vec<u32> = (0..len as u32).map(|j| (j * 131 + i as u32 * 17 + 3) % 150_000).collect();
            let params = if i % 2 == 0 {
                SamplingParams { ignore_eos: true, ..SamplingParams::greedy(24) }
            } else {
                SamplingParams {
                    temperature: 0.8,
                    top_p: 0.95,
                    seed: Some(i as u64),
                    ignore_eos: true,
                    ..SamplingParams::greedy(24)
                }
            };
            (i, prompt, params)
        })
        .collect();
    let reversed: Vec<_> = requests.iter().rev().cloned().collect();
    // The mma.sync attention every GPU runs, and on a Hopper GPU the warpgroup-MMA build, alone
    // and with the norms of steps of few tokens inside their products.
    let hopper = tandem_compute::cuda::CudaDevice::open_with(0, Default::default(), kernel_cache().as_deref())
        .is_ok_and(|d| d.wgmma_capable());
    let mut tunings = vec![];
    if hopper {
        tunings.push(CudaTuning { invariant_wgmma: true, invariant_fused_norm: true, ..CudaTuning::default() });
        tunings.push(CudaTuning { invariant_wgmma: true, ..CudaTuning::default() });
    }
    tunings.push(CudaTuning::default());
    for tuning in tunings {
        eprintln!("batch-invariant, tuned: {tuning}");
        let Some(mut chunked) = engine_tuned(cfg(512), true, true, tuning.clone()) else { return };
        let alone = run_in_groups(&mut chunked, &requests, 1);
        for (label, got) in [
            ("64 at a time, chunked prefill", run_in_groups(&mut chunked, &requests, 64)),
            ("24 at a time, reversed, chunked prefill", run_in_groups(&mut chunked, &reversed, 24)),
        ] {
            let moved: Vec<usize> = (0..64).filter(|i| got[i] != alone[i]).collect();
            assert!(moved.is_empty(), "{label}: requests {moved:?} differ from their answers alone");
        }
        drop(chunked);
        let Some(mut whole) = engine_tuned(cfg(4096), true, true, tuning.clone()) else { return };
        for (label, got) in [
            ("alone, whole prompts", run_in_groups(&mut whole, &requests, 1)),
            ("64 at a time, whole prompts", run_in_groups(&mut whole, &requests, 64)),
            ("24 at a time, reversed, whole prompts, eager", {
                drop(whole);
                let Some(mut eager) = engine_tuned(cfg(4096), false, true, tuning.clone()) else { return };
                run_in_groups(&mut eager, &reversed, 24)
            }),
        ] {
            let moved: Vec<usize> = (0..64).filter(|i| got[i] != alone[i]).collect();
            assert!(
                moved.is_empty(),
                "{label}: requests {moved:?} differ from their answers alone with chunked prefill"
            );
        }
        // Prefix reuse gives the bits of the prompt computed whole: with prefix caching every
        // request runs again over its own cached blocks (all but its last token), and then 24 at a
        // time, in another order.
        let Some(mut cached) =
            engine_tuned(EngineConfig { prefix_caching: true, ..cfg(512) }, true, true, tuning.clone())
        else {
            return;
        };
        for (label, got) in [
            ("prefix caching, nothing cached yet", run_in_groups(&mut cached, &requests, 1)),
            ("prefix caching, from the cache", run_in_groups(&mut cached, &requests, 1)),
            ("prefix caching, 24 at a time, reversed", run_in_groups(&mut cached, &reversed, 24)),
        ] {
            let moved: Vec<usize> = (0..64).filter(|i| got[i] != alone[i]).collect();
            assert!(moved.is_empty(), "{label}: requests {moved:?} differ from their answers alone");
        }
        assert!(cached.prefix_cache().0.hit_tokens > 0, "nothing came from the cache");
        drop(cached);
        // A KV pool too small for all 64: requests are preempted and recomputed (their generated
        // tokens then go through prefill chunks) and still get their tokens.
        let Some(mut small) = engine_tuned(EngineConfig { num_blocks: 200, ..cfg(512) }, true, true, tuning.clone())
        else {
            return;
        };
        let got = run_in_groups(&mut small, &requests, 64);
        assert!(small.num_preemptions() > 0, "the small pool preempted nothing");
        let moved: Vec<usize> = (0..64).filter(|i| got[i] != alone[i]).collect();
        assert!(moved.is_empty(), "preempted and recomputed: requests {moved:?} differ from their answers alone");
        eprintln!("batch-invariant with {} preemptions: 64 of 64 equal alone", small.num_preemptions());
        drop(small);
    }
    let Some(mut default) = engine_of(cfg(512), true, false) else { return };
    let default_alone = run_in_groups(&mut default, &requests, 1);
    let together = run_in_groups(&mut default, &requests, 64);
    let moved = (0..64).filter(|i| together[i] != default_alone[i]).count();
    eprintln!("without --batch-invariant: {moved} of 64 requests differ between alone and 64 at a time");
}

/// The compiled kernels' disk cache scripts/gpu/run.sh names (`TANDEM_CACHE_DIR`): the first
/// open of a test process reads it, later opens reuse what that one loaded.
fn kernel_cache() -> Option<std::path::PathBuf> {
    std::env::var_os("TANDEM_CACHE_DIR").map(std::path::PathBuf::from)
}
