//! Tensor parallelism on the CPU: a model split over 2, 4 (and 8) ranks gives the logits of one
//! rank bit for bit, prompt and decode steps, because the row-parallel sums go in the same order
//! at every rank count; shapes that cannot split are refused by name.

use std::path::PathBuf;

use tandem_compute::{KvCache, KvDtype};
use tandem_model::{ModelSource, ModelSpec, Preset, SeqBatch, Shard, TpModel, Transformer};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

const BLOCK: usize = 4;
const BLOCKS: usize = 16;

/// One forward: token ids and sequences to logits.
type Forward<'a> = dyn FnMut(&[u32], &[SeqBatch<'_>]) -> Vec<f32> + 'a;

/// A 23-token prompt, then 5 decode steps, in scattered blocks; every logit.
fn run(forward: &mut Forward<'_>, vocab: u32) -> Vec<f32> {
    let table: Vec<u32> = (0..BLOCKS as u32).rev().collect();
    let prompt: Vec<u32> = (0..23).map(|i| (i * 7919 + 3) % vocab).collect();
    let seq = |n: usize, at: usize| SeqBatch {
        token_start: 0,
        num_tokens: n,
        first_pos: at,
        block_table: &table,
        want_logits: true,
    };
    let mut all = forward(&prompt, &[seq(prompt.len(), 0)]);
    for step in 0..5u32 {
        all.extend(forward(&[(step * 31 + 7) % vocab], &[seq(1, prompt.len() + step as usize)]));
    }
    all
}

/// With an f32 and with an FP8 KV cache (the ranks' views of one region round their heads as
/// one cache of every head does).
#[test]
fn two_four_and_eight_ranks_give_one_ranks_logits_bit_for_bit() {
    let sources = [
        (ModelSource::Preset { preset: Preset::find("tiny-qwen3").unwrap(), seed: 2 }, vec![2, 4]),
        (ModelSource::Dir(fixtures().join("qwen2")), vec![2, 4]),
        (ModelSource::Dir(fixtures().join("llama")), vec![2, 4, 8]),
    ];
    for (source, sizes) in sources {
        let spec = ModelSpec::load(&source, Some(64)).unwrap();
        let vocab = spec.config.vocab_size as u32;
        let one = Transformer::from_weights(spec.config.clone(), spec.cpu_weights().unwrap(), 64).unwrap();
        for dtype in [KvDtype::F32, KvDtype::Fp8E4m3] {
            let mut kv = KvCache::of(one.kv_layout(BLOCK, BLOCKS), dtype);
            let want = run(&mut |ids, seqs| one.forward(ids, seqs, &mut kv), vocab);
            for &size in &sizes {
                let weights = spec.cpu_weights().unwrap();
                let mut tp = TpModel::load(&spec.config, weights, 64, size, (BLOCK, BLOCKS), dtype).unwrap();
                assert_eq!(tp.size(), size);
                assert_eq!(tp.rank0().fingerprint(), one.fingerprint(), "{source:?}: every rank names the whole model");
                let got = run(&mut |ids, seqs| tp.forward(ids, seqs).unwrap(), vocab);
                assert_eq!(got.len(), want.len());
                let differ = got.iter().zip(&want).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                assert_eq!(differ, 0, "{source:?} over {size} ranks, {dtype:?} KV: {differ} logits differ");
            }
        }
    }
}

#[test]
fn shapes_that_cannot_split_are_refused_by_name() {
    let tiny = ModelSpec::load(&ModelSource::Preset { preset: Preset::find("tiny-qwen3").unwrap(), seed: 0 }, None)
        .unwrap()
        .config;
    // 4 heads: at most 4 ranks, a power of two.
    for size in [3, 8] {
        let e = Shard::check(size, &tiny).unwrap_err().to_string();
        assert!(e.contains("power of two up to 4"), "{size}: {e}");
    }
    let moe = ModelSpec::load(&ModelSource::Dir(fixtures().join("qwen3-moe")), None).unwrap().config;
    let e = Shard::check(2, &moe).unwrap_err().to_string();
    assert!(e.contains("mixture of experts"), "{e}");
    let gguf = ModelSpec::load(&ModelSource::Gguf(fixtures().join("gguf/qwen2.gguf")), None).unwrap().config;
    let e = Shard::check(2, &gguf).unwrap_err().to_string();
    assert!(e.contains("GGUF"), "{e}");
    assert!(Shard::check(1, &gguf).is_ok() && Shard::check(1, &moe).is_ok());
}

/// A rank that fails mid-forward (at its third all-reduce) ends that forward with an error
/// naming it, at once, on every rank; the next forward runs whole and gives one rank's logits.
#[test]
fn a_rank_failing_mid_forward_fails_that_forward_at_once_and_the_next_one_runs() {
    let spec =
        ModelSpec::load(&ModelSource::Preset { preset: Preset::find("tiny-qwen3-tp").unwrap(), seed: 1 }, Some(64))
            .unwrap();
    let vocab = spec.config.vocab_size as u32;
    let one = Transformer::from_weights(spec.config.clone(), spec.cpu_weights().unwrap(), 64).unwrap();
    let mut kv = KvCache::new(one.kv_layout(BLOCK, BLOCKS));
    let want = run(&mut |ids, seqs| one.forward(ids, seqs, &mut kv), vocab);
    let weights = spec.cpu_weights().unwrap();
    let mut tp = TpModel::load(&spec.config, weights, 64, 4, (BLOCK, BLOCKS), KvDtype::F32).unwrap();
    tp.fail_rank_once(2, 3);
    let table: Vec<u32> = (0..BLOCKS as u32).collect();
    let seq = SeqBatch { token_start: 0, num_tokens: 3, first_pos: 0, block_table: &table, want_logits: true };
    let started = std::time::Instant::now();
    let e = tp.forward(&[1, 2, 3], &[seq]).unwrap_err().to_string();
    assert!(e.contains("rank 2 failed"), "{e}");
    assert!(started.elapsed() < std::time::Duration::from_secs(5), "{:?}", started.elapsed());
    let got = run(&mut |ids, seqs| tp.forward(ids, seqs).unwrap(), vocab);
    assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "the next forwards give one rank's logits");
}
