//! Greedy continuations equal transformers' token for token (fixtures/ made by
//! scripts/make_fixtures.py), for the model alone: prefill the prompt through the paged
//! cache, then decode one token at a time. The engine-level test of the same fixtures runs
//! through `tandem generate` in the cli crate. The same fixtures as GGUF files (fixtures/gguf)
//! give the same tokens.

use std::path::{Path, PathBuf};

use tandem_compute::KvCache;
use tandem_model::{LoadedModel, ModelSource, ModelSpec, SeqBatch};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

fn greedy(model: &LoadedModel, prompt: &[u32], new_tokens: usize, block_size: usize) -> Vec<u32> {
    let t = &model.transformer;
    let total = prompt.len() + new_tokens;
    let blocks = total.div_ceil(block_size);
    let mut kv = KvCache::new(t.kv_layout(block_size, blocks + 3));
    // Deliberately scattered, reversed block table.
    let table: Vec<u32> = (0..blocks as u32).rev().map(|b| b + 2).collect();
    let argmax = |l: &[f32]| {
        let mut best = 0;
        for (i, v) in l.iter().enumerate() {
            if *v > l[best] {
                best = i;
            }
        }
        best as u32
    };
    let seq =
        SeqBatch { token_start: 0, num_tokens: prompt.len(), first_pos: 0, block_table: &table, want_logits: true };
    let mut out = vec![argmax(&t.forward(prompt, &[seq], &mut kv))];
    while out.len() < new_tokens {
        let pos = prompt.len() + out.len() - 1;
        let seq = SeqBatch { token_start: 0, num_tokens: 1, first_pos: pos, block_table: &table, want_logits: true };
        let last = *out.last().unwrap();
        out.push(argmax(&t.forward(&[last], &[seq], &mut kv)));
    }
    out
}

#[test]
fn greedy_matches_transformers_for_every_fixture() {
    for name in ["qwen3", "qwen2", "llama", "qwen3-moe", "qwen3-moe-fused"] {
        let dir = fixtures().join(name);
        let model = LoadedModel::load(&ModelSource::Dir(dir.clone()), None).unwrap();
        assert!(model.tokenizer.is_none(), "fixtures run in token-ids mode");
        let expected: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
        let n = expected["new_tokens"].as_u64().unwrap() as usize;
        for case in expected["cases"].as_array().unwrap() {
            let ids = |k: &str| -> Vec<u32> {
                case[k].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect()
            };
            let prompt = ids("prompt_ids");
            for block_size in [16, 5] {
                let got = greedy(&model, &prompt, n, block_size);
                assert_eq!(
                    got,
                    ids("greedy_ids"),
                    "{name}, prompt of {} tokens, block size {block_size}",
                    prompt.len()
                );
            }
        }
    }
}

/// Log-probabilities equal transformers' log-softmax (fixtures/*/logprobs.json, made by
/// scripts/gpu/logprobs_refs.py from the f32 model, in f64): at every greedy step of every
/// fixture, the chosen token's and the 5 most likely tokens', in order. Ranks may swap only
/// where transformers' own values are a near tie.
#[test]
fn logprobs_match_transformers_for_every_fixture() {
    const TOL: f64 = 2e-3;
    for name in ["qwen3", "qwen2", "llama"] {
        let dir = fixtures().join(name);
        let model = LoadedModel::load(&ModelSource::Dir(dir.clone()), None).unwrap();
        let t = &model.transformer;
        let refs: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("logprobs.json")).unwrap()).unwrap();
        let top = refs["top"].as_u64().unwrap() as u32;
        let mut steps_checked = 0;
        for case in refs["cases"].as_array().unwrap() {
            let ids = |v: &serde_json::Value| -> Vec<u32> {
                v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
            };
            let floats = |v: &serde_json::Value| -> Vec<f64> {
                v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
            };
            let prompt = ids(&case["prompt_ids"]);
            let steps = case["steps"].as_array().unwrap();
            let mut kv = KvCache::new(t.kv_layout(16, (prompt.len() + steps.len()).div_ceil(16) + 1));
            let table: Vec<u32> = (0..kv.layout().num_blocks as u32).collect();
            let mut pos = 0;
            let mut input = prompt.clone();
            for (k, step) in steps.iter().enumerate() {
                let seq = SeqBatch {
                    token_start: 0,
                    num_tokens: input.len(),
                    first_pos: pos,
                    block_table: &table,
                    want_logits: true,
                };
                let logits = t.forward(&input, &[seq], &mut kv);
                pos += input.len();
                let token = step["token"].as_u64().unwrap() as u32;
                let ours = tandem_model::token_logprobs(&logits, token, top);
                let at = format!("{name}, prompt of {} tokens, step {k}", prompt.len());
                let want = step["logprob"].as_f64().unwrap();
                assert!((ours.logprob as f64 - want).abs() < TOL, "{at}: logprob {} vs {want}", ours.logprob);
                let (want_ids, want_lps) = (ids(&step["top_ids"]), floats(&step["top_logprobs"]));
                assert_eq!(ours.top.len(), want_ids.len(), "{at}");
                for (r, &(id, lp)) in ours.top.iter().enumerate() {
                    assert!((lp as f64 - want_lps[r]).abs() < TOL, "{at}: rank {r}: {lp} vs {}", want_lps[r]);
                    if id != want_ids[r] {
                        let tie = [r.wrapping_sub(1), r + 1]
                            .iter()
                            .filter_map(|&o| want_lps.get(o))
                            .any(|&o| (o - want_lps[r]).abs() < TOL);
                        assert!(tie, "{at}: rank {r} is token {id}, transformers' is {} (no near tie)", want_ids[r]);
                    }
                }
                input = vec![token];
                steps_checked += 1;
            }
        }
        assert!(steps_checked >= 32, "{name}: only {steps_checked} steps in the fixture");
    }
}

#[test]
fn missing_tensor_and_unknown_dir_fail_with_names() {
    let tmp = std::env::temp_dir().join(format!("tandem-missing-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    std::fs::copy(fixtures().join("qwen3/config.json"), tmp.join("config.json")).unwrap();
    // A checkpoint holding one unrelated tensor: the first needed one is reported by name.
    let data = vec![0u8; 16];
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![4], &data).unwrap();
    safetensors::tensor::serialize_to_file(vec![("other", view)], None, &tmp.join("model.safetensors")).unwrap();
    let err = LoadedModel::load(&ModelSource::Dir(tmp.clone()), None).err().unwrap().to_string();
    assert!(err.contains("model.embed_tokens.weight"), "{err}");
    let err = LoadedModel::load(&ModelSource::Dir(tmp.join("nope")), None).err().unwrap().to_string();
    assert!(err.contains("not a model directory"), "{err}");
    std::fs::remove_dir_all(&tmp).ok();
}

/// A prompt and transformers' greedy continuation.
type Case = (Vec<u32>, Vec<u32>);

fn cases(dir: &Path) -> (usize, Vec<Case>) {
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
    };
    let n = expected["new_tokens"].as_u64().unwrap() as usize;
    (n, expected["cases"].as_array().unwrap().iter().map(|c| (ids(&c["prompt_ids"]), ids(&c["greedy_ids"]))).collect())
}

#[test]
fn qwen3_and_qwen2_ggufs_give_transformers_greedy_tokens() {
    for name in ["qwen3", "qwen2"] {
        let source = ModelSource::parse(fixtures().join(format!("gguf/{name}.gguf")).to_str().unwrap(), 0).unwrap();
        assert!(matches!(source, ModelSource::Gguf(_)));
        let model = LoadedModel::load(&source, None).unwrap();
        assert!(model.tokenizer.is_none(), "no tokenizer metadata: token-ids mode");
        // The shape is the HF directory's.
        let from_gguf = ModelSpec::load(&source, None).unwrap().config;
        let from_dir = ModelSpec::load(&ModelSource::Dir(fixtures().join(name)), None).unwrap().config;
        assert_eq!(from_gguf.eos_token_ids, Vec::<u32>::new());
        assert_eq!(from_gguf, tandem_model::ModelConfig { eos_token_ids: vec![], reduction_groups: 1, ..from_dir });
        let (n, cases) = cases(&fixtures().join(name));
        for (prompt, want) in cases {
            assert_eq!(greedy(&model, &prompt, n, 16), want, "{name}: prompt of {} tokens", prompt.len());
        }
    }
}

#[test]
fn a_llama_gguf_with_its_rotary_rows_permuted_gives_the_hf_directorys_tokens() {
    // The HF fixture with default RoPE (the GGUF leaves out Llama 3 scaling).
    let dir = std::env::temp_dir().join(format!("tandem-gguf-llama-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["model.safetensors", "config.json"] {
        std::fs::copy(fixtures().join("llama").join(f), dir.join(f)).unwrap();
    }
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    cfg["rope_parameters"] = serde_json::json!({"rope_theta": 500000.0, "rope_type": "default"});
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let hf = LoadedModel::load(&ModelSource::Dir(dir.clone()), None).unwrap();
    let gguf = LoadedModel::load(&ModelSource::Gguf(fixtures().join("gguf/llama.gguf")), None).unwrap();
    let (n, cases) = cases(&fixtures().join("llama"));
    for (prompt, _) in cases {
        assert_eq!(greedy(&gguf, &prompt, n, 16), greedy(&hf, &prompt, n, 16), "prompt of {} tokens", prompt.len());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A GGUF's matrices kept in their stored formats (F16, BF16 here; every block format in
/// SmolLM2's Q4_1 file when TANDEM_SMOLLM2_GGUF names it, as .ci/run does) give the logits of
/// the same file dequantized at load, bit for bit, for a prompt and for decode steps; the
/// fingerprint is the same and the bytes a forward reads are the stored ones.
#[test]
fn ggufs_kept_in_their_block_formats_give_the_dequantized_logits_bit_for_bit() {
    let mut files = vec![fixtures().join("gguf/qwen2.gguf"), fixtures().join("gguf/llama.gguf")];
    if let Ok(p) = std::env::var("TANDEM_SMOLLM2_GGUF") {
        files.push(PathBuf::from(p));
    }
    for path in files {
        let spec = ModelSpec::load(&ModelSource::Gguf(path.clone()), Some(64)).unwrap();
        let dense =
            tandem_model::Transformer::from_weights(spec.config.clone(), spec.host_weights().unwrap(), 64).unwrap();
        let kept =
            tandem_model::Transformer::from_weights(spec.config.clone(), spec.cpu_weights().unwrap(), 64).unwrap();
        assert_eq!(kept.fingerprint(), dense.fingerprint(), "{path:?}");
        assert!(
            kept.weight_bytes() < dense.weight_bytes(),
            "{path:?}: {} vs {}",
            kept.weight_bytes(),
            dense.weight_bytes()
        );
        let vocab = spec.config.vocab_size as u32;
        let prompt: Vec<u32> = (0..9).map(|i| (i * 7919 + 3) % vocab).collect();
        let run = |t: &tandem_model::Transformer| {
            let mut kv = KvCache::new(t.kv_layout(16, 2));
            let table = [1u32, 0];
            let mut all = vec![];
            let seq = SeqBatch { token_start: 0, num_tokens: 9, first_pos: 0, block_table: &table, want_logits: true };
            all.extend(t.forward(&prompt, &[seq], &mut kv));
            for (i, &tok) in [5u32, 11, 2].iter().enumerate() {
                let seq = SeqBatch {
                    token_start: 0,
                    num_tokens: 1,
                    first_pos: 9 + i,
                    block_table: &table,
                    want_logits: true,
                };
                all.extend(t.forward(&[tok % vocab], &[seq], &mut kv));
            }
            all
        };
        let (a, b) = (run(&kept), run(&dense));
        assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "{path:?}: logits differ");
    }
}

/// The fingerprint follows the weights: the same preset shape with other seeded weights gets
/// another (so P/D refuses to pair engines whose KV would mean different things).
#[test]
fn fingerprints_tell_the_same_shape_with_other_weights_apart() {
    let fp = |seed| {
        let source = ModelSource::parse("preset:tiny-qwen3", seed).unwrap();
        LoadedModel::load(&source, None).unwrap().transformer.fingerprint()
    };
    assert_eq!(fp(0), fp(0));
    assert_ne!(fp(0), fp(7));
}

/// A mixture of experts reads the experts its tokens chose: one token, its `num_experts_per_tok`
/// of each sparse layer (the batch-1 decode floor's bytes); forty tokens, more of them, at most
/// all.
#[test]
fn a_mixture_of_experts_reads_the_experts_its_tokens_chose() {
    let model = LoadedModel::load(&ModelSource::Dir(fixtures().join("qwen3-moe")), None).unwrap();
    let t = &model.transformer;
    let read = t.weights_read();
    let forward = |tokens: usize| {
        let mut kv = KvCache::new(t.kv_layout(16, 4));
        let table = [0, 1, 2, 3];
        let prompt: Vec<u32> = (0..tokens as u32).map(|i| 3 + i * 11 % 500).collect();
        let seq = SeqBatch { token_start: 0, num_tokens: tokens, first_pos: 0, block_table: &table, want_logits: true };
        t.forward(&prompt, &[seq], &mut kv);
        read.load(std::sync::atomic::Ordering::Relaxed)
    };
    let moe = t.config().moe.clone().unwrap();
    let (h, inter) = (t.config().hidden_size, moe.moe_intermediate_size);
    let expert = 3 * h * inter * 4;
    let unchosen = (moe.num_experts - moe.num_experts_per_tok) * expert;
    assert_eq!(forward(1), t.weight_bytes());
    let many = forward(40);
    // Two sparse layers: at most every expert of both.
    assert!(many > t.weight_bytes() && many <= t.weight_bytes() + 2 * unchosen, "{many}");
}
