//! FP8 checkpoints in the published block-scaled layout (fixtures/qwen3-fp8, made from the qwen3
//! fixture by scripts/make_fp8_fixture.py): every FP8 tensor dequantizes to the bits ml_dtypes
//! gives (SHA-256 of its float32 values), and the model loads and serves.

use std::path::PathBuf;

use sha2::{Digest, Sha256};
use tandem_model::{LoadedModel, ModelSource, ModelSpec, Quantization};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures").join(name)
}

fn json(path: PathBuf) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn fp8_weights_dequantize_to_the_bits_an_independent_implementation_gives() {
    let dir = fixture("qwen3-fp8");
    let spec = ModelSpec::load(&ModelSource::Dir(dir.clone()), None).unwrap();
    assert_eq!(spec.config.fp8_weight_block, Some([32, 48]));
    let weights = spec.host_weights().unwrap();
    let expected = json(dir.join("dequantized.json"));
    let digests = expected["sha256"].as_object().unwrap();
    assert_eq!(digests.len(), 21, "every decoder linear weight of the three layers");
    for (name, digest) in digests {
        let (_, tensor) = weights.iter().find(|(n, _)| *n == name).unwrap_or_else(|| panic!("{name} missing"));
        let bytes: Vec<u8> = tensor.data.iter().flat_map(|v| v.to_le_bytes()).collect();
        let got: String = Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(&got, digest.as_str().unwrap(), "{name}");
    }
    // Everything not quantized is the source fixture's, bit for bit.
    let source = ModelSpec::load(&ModelSource::Dir(fixture("qwen3")), None).unwrap().host_weights().unwrap();
    for (name, tensor) in source.iter() {
        if !digests.contains_key(name.as_str()) {
            let (_, ours) = weights.iter().find(|(n, _)| *n == name).unwrap();
            assert_eq!(ours.data, tensor.data, "{name}");
        }
    }
}

/// `--quantization fp8` rounds a full-precision checkpoint as its FP8 checkpoint holds it: the
/// qwen3 fixture quantized here in the fixture's 32 x 48 blocks gives, tensor for tensor, the
/// bits ml_dtypes gave scripts/make_fp8_fixture.py (the same 21 tensors, nothing else touched).
#[test]
fn quantizing_at_load_gives_the_bits_of_the_published_fp8_layout() {
    let expected = json(fixture("qwen3-fp8").join("dequantized.json"));
    let digests = expected["sha256"].as_object().unwrap();
    let mut weights = ModelSpec::load(&ModelSource::Dir(fixture("qwen3")), None).unwrap().host_weights().unwrap();
    let untouched: Vec<(String, Vec<f32>)> = weights
        .iter()
        .filter(|(n, _)| !digests.contains_key(n.as_str()))
        .map(|(n, t)| (n.clone(), t.data.clone()))
        .collect();
    let names = weights.quantize_fp8([32, 48]);
    let mut want: Vec<&String> = digests.keys().collect();
    want.sort();
    assert_eq!(names.iter().collect::<Vec<_>>(), want, "the decoder's linear weights, and only they");
    for (name, digest) in digests {
        let (_, tensor) = weights.iter().find(|(n, _)| *n == name).unwrap();
        let bytes: Vec<u8> = tensor.data.iter().flat_map(|v| v.to_le_bytes()).collect();
        let got: String = Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(&got, digest.as_str().unwrap(), "{name}");
    }
    for (name, data) in untouched {
        let (_, t) = weights.iter().find(|(n, _)| **n == name).unwrap();
        assert!(t.data == data, "{name} changed");
    }
}

/// The FP8 model answers the source fixture's prompts close to the full-precision one (FP8 keeps
/// 3 mantissa bits: a token may flip where two were close, so most, not all, first tokens agree).
#[test]
fn the_fp8_model_serves_and_stays_close_to_full_precision() {
    let model = LoadedModel::load(&ModelSource::Dir(fixture("qwen3-fp8")), None).unwrap();
    let full = LoadedModel::load(&ModelSource::Dir(fixture("qwen3")), None).unwrap();
    let source = json(fixture("qwen3").join("expected.json"));
    let (mut same, mut total) = (0, 0);
    for case in source["cases"].as_array().unwrap() {
        let prompt: Vec<u32> =
            case["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let (ours, theirs) = (first_token_logits(&model, &prompt), first_token_logits(&full, &prompt));
        let argmax = |l: &[f32]| (0..l.len()).max_by(|&a, &b| l[a].total_cmp(&l[b])).unwrap();
        same += usize::from(argmax(&ours) == argmax(&theirs));
        total += 1;
        let err = ours.iter().zip(&theirs).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        let scale = theirs.iter().map(|v| v.abs()).fold(0f32, f32::max);
        assert!(err < 0.25 * scale, "prompt of {}: logits off by {err} (largest {scale})", prompt.len());
        assert!(ours.iter().all(|v| v.is_finite()));
    }
    assert!(same * 4 >= total * 3, "first tokens agree at {same} of {total} prompts");
}

/// `with_quantization(Fp8)` (what `--quantization fp8` asks) loads the full-precision fixture
/// rounded in 128 x 128 blocks: its own fingerprint (a P/D peer without the rounding does not
/// pair with it), logits close to full precision's; an FP8 checkpoint is left as stored.
#[test]
fn a_model_quantized_at_load_is_its_fp8_self() {
    let spec = || ModelSpec::load(&ModelSource::Dir(fixture("qwen3")), None).unwrap();
    let rounded = spec().with_quantization(Some(Quantization::Fp8)).unwrap();
    let mut by_hand = spec().host_weights().unwrap();
    by_hand.quantize_fp8(Quantization::FP8_BLOCK);
    let loaded = rounded.host_weights().unwrap();
    for (name, t) in by_hand.iter() {
        let (_, ours) = loaded.iter().find(|(n, _)| *n == name).unwrap();
        assert!(ours.data == t.data, "{name}");
    }
    let model = LoadedModel::from_spec(rounded).unwrap();
    let full = LoadedModel::from_spec(spec()).unwrap();
    assert_ne!(model.transformer.fingerprint(), full.transformer.fingerprint());
    let prompt: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 200).collect();
    let (ours, theirs) = (first_token_logits(&model, &prompt), first_token_logits(&full, &prompt));
    let err = ours.iter().zip(&theirs).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    let scale = theirs.iter().map(|v| v.abs()).fold(0f32, f32::max);
    assert!(err > 0.0 && err < 0.25 * scale, "logits off by {err} (largest {scale})");

    let stored = ModelSpec::load(&ModelSource::Dir(fixture("qwen3-fp8")), None).unwrap();
    let as_stored = stored.host_weights().unwrap();
    let kept = ModelSpec::load(&ModelSource::Dir(fixture("qwen3-fp8")), None)
        .unwrap()
        .with_quantization(Some(Quantization::Fp8))
        .unwrap()
        .host_weights()
        .unwrap();
    for (name, t) in as_stored.iter() {
        let (_, ours) = kept.iter().find(|(n, _)| *n == name).unwrap();
        assert!(ours.data == t.data, "{name}: an FP8 checkpoint is kept as stored");
    }
}

fn first_token_logits(model: &LoadedModel, prompt: &[u32]) -> Vec<f32> {
    let t = &model.transformer;
    let block_size = 16;
    let blocks = prompt.len().div_ceil(block_size);
    let mut kv = tandem_compute::KvCache::new(t.kv_layout(block_size, blocks));
    let table: Vec<u32> = (0..blocks as u32).collect();
    let seq = tandem_model::SeqBatch {
        token_start: 0,
        num_tokens: prompt.len(),
        first_pos: 0,
        block_table: &table,
        want_logits: true,
    };
    t.forward(prompt, &[seq], &mut kv)
}
