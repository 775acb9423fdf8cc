//! The `tandem` binary end to end: `generate` equals transformers on every fixture (with
//! chunked prefill), `model init` is deterministic and loads back to the same model, and bad
//! input fails with a message, not a panic.

use std::path::PathBuf;
use std::process::Command;

fn tandem() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tandem"));
    c.arg("--log").arg("warn");
    c
}

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

fn generate_json(args: &[&str]) -> serde_json::Value {
    let out = tandem().arg("generate").args(args).arg("--json").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u64> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

#[test]
fn generate_matches_transformers_on_every_fixture_with_chunked_prefill() {
    for name in ["qwen3", "qwen2", "llama", "qwen3-moe", "qwen3-moe-fused"] {
        let dir = fixtures().join(name);
        let expected: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
        for case in expected["cases"].as_array().unwrap() {
            let prompt: Vec<String> = ids(&case["prompt_ids"]).iter().map(u64::to_string).collect();
            let want = ids(&case["greedy_ids"]);
            // The 100-token prompt exceeds the 32-token budget: it is prefilled in 4 chunks.
            let got = generate_json(&[
                "--model",
                dir.to_str().unwrap(),
                "--prompt-ids",
                &prompt.join(","),
                "--max-tokens",
                &want.len().to_string(),
                "--ignore-eos",
                "--max-num-batched-tokens",
                "32",
                "--block-size",
                "16",
            ]);
            assert_eq!(ids(&got["token_ids"]), want, "{name}, prompt of {} tokens", prompt.len());
            assert_eq!(got["finish_reason"], "length");
        }
    }
}

#[test]
fn model_init_is_deterministic_and_loads_back_to_the_preset() {
    let base = std::env::temp_dir().join(format!("tandem-init-{}", std::process::id()));
    let (a, b) = (base.join("a"), base.join("b"));
    for dir in [&a, &b] {
        let st = tandem()
            .args(["model", "init", "--preset", "tiny-llama", "--seed", "5", "--out"])
            .arg(dir)
            .status()
            .unwrap();
        assert!(st.success());
    }
    for f in ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"] {
        assert_eq!(
            std::fs::read(a.join(f)).unwrap(),
            std::fs::read(b.join(f)).unwrap(),
            "{f} differs between two inits"
        );
    }
    let from_dir = generate_json(&[
        "--model",
        a.to_str().unwrap(),
        "--prompt",
        "the cat sat",
        "--max-tokens",
        "12",
        "--ignore-eos",
    ]);
    let from_preset = generate_json(&[
        "--model",
        "preset:tiny-llama",
        "--model-seed",
        "5",
        "--prompt",
        "the cat sat",
        "--max-tokens",
        "12",
        "--ignore-eos",
    ]);
    assert_eq!(from_dir["token_ids"], from_preset["token_ids"]);
    assert_eq!(from_dir["text"], from_preset["text"]);
    let other_seed = generate_json(&[
        "--model",
        "preset:tiny-llama",
        "--model-seed",
        "6",
        "--prompt",
        "the cat sat",
        "--max-tokens",
        "12",
        "--ignore-eos",
    ]);
    assert_ne!(other_seed["token_ids"], from_preset["token_ids"]);
    std::fs::remove_dir_all(&base).ok();
}

#[test]
fn bad_input_fails_with_a_message() {
    let qwen3 = fixtures().join("qwen3");
    let cases: &[(&[&str], &str)] = &[
        (&["generate", "--model", "preset:nope", "--prompt", "x"], "unknown preset `nope`"),
        (&["generate", "--model", "/definitely/not/here", "--prompt", "x"], "not a model directory"),
        (&["generate", "--model", qwen3.to_str().unwrap(), "--prompt", "x"], "no tokenizer"),
        (&["generate", "--prompt-ids", "1,2,99999"], "out of range"),
        (&["generate", "--prompt", "x", "--kv-cache-memory", "lots"], "not a size"),
        (&["generate", "--prompt", "x", "--num-kv-blocks", "0"], "no blocks"),
        (&["generate", "--prompt", "x", "--device", "tpu:0"], "unknown device `tpu:0`"),
        (&["serve", "--role", "prefill", "--kv-host-gib", "0"], "--kv-host-gib must be a positive"),
        (
            &["serve", "--role", "prefill", "--kv-transport", "cuda-ipc", "--kv-port", "0", "--port", "0"],
            "--kv-transport cuda-ipc needs an engine whose KV cache is on a GPU",
        ),
        (&["bench", "kv", "--transport", "cuda-ipc", "--device", "cpu"], "give a GPU (cuda:N)"),
        (
            &["bench", "kv", "--transport", "cuda-ipc", "--tokens", "1024"],
            "--tokens and --kv-cache-dtype are for --transport tcp",
        ),
        (&["bench", "kv", "--kv-cache-dtype", "fp16"], "possible values: auto, fp8"),
        (&["bench", "soak", "--device", "cuda:0"], "add --batch-invariant"),
        (&["bench", "engine", "--kv-cache-dtype", "fp8"], "bench engine --kv-cache-dtype is for GPU engines"),
        (&["serve", "--generation-config", "model"], "possible values: auto, vllm"),
        (&["generate", "--prompt", "x", "--quantization", "int4"], "unknown quantization `int4` (known: fp8)"),
        (
            &["generate", "--prompt", "x", "--quantization", "fp8", "--device", "cuda:0", "--batch-invariant"],
            "--batch-invariant with --quantization on a GPU is not built yet",
        ),
        (
            &["generate", "--prompt", "x", "--kv-cache-dtype", "fp8", "--device", "cuda:0", "--batch-invariant"],
            "--kv-cache-dtype fp8 with --batch-invariant on a GPU is not built yet",
        ),
        (&["generate", "--prompt", "x", "--kv-cache-dtype", "fp8_e5m2"], "possible values: auto, fp8"),
        (
            &["bench", "engine", "--model", "preset:tiny-qwen3", "--batch", "1", "--decode-prompt-tokens", "5000"],
            "the engine refused a 5000-token prompt",
        ),
    ];
    for (args, needle) in cases {
        let out = tandem().args(*args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} should fail");
        assert!(err.contains(needle), "{args:?}: expected `{needle}` in: {err}");
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    }
}

/// `--quantization fp8` serves a full-precision checkpoint rounded to FP8 (the model crate checks
/// the rounding's bits against ml_dtypes): it answers, chunked prefill and all.
#[test]
fn generate_runs_a_checkpoint_quantized_to_fp8_at_load() {
    let dir = fixtures().join("qwen3");
    let got = generate_json(&[
        "--model",
        dir.to_str().unwrap(),
        "--quantization",
        "fp8",
        "--prompt-ids",
        &(0..40).map(|i| ((i * 7 + 3) % 200).to_string()).collect::<Vec<_>>().join(","),
        "--max-tokens",
        "6",
        "--ignore-eos",
        "--max-num-batched-tokens",
        "16",
    ]);
    assert_eq!(ids(&got["token_ids"]).len(), 6);
}

/// `bench fidelity` compares the rounded model with the one as read and says how close they stay.
#[test]
fn bench_fidelity_reports_how_close_fp8_stays() {
    let out = tandem()
        .args(["bench", "fidelity", "--model", "preset:tiny-qwen3", "--quantization", "fp8"])
        .args(["--num-prompts", "2", "--prompt-len", "8", "--output-len", "5"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("of 10 positions") && text.contains("mean |difference|"), "{text}");
    let out = tandem()
        .args(["bench", "fidelity", "--model", "preset:tiny-qwen3", "--kv-cache-dtype", "fp8"])
        .args(["--num-prompts", "2", "--prompt-len", "8", "--output-len", "5"])
        .output()
        .unwrap();
    let (text, err) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && err.contains("fp8_e4m3 KV cache") && text.contains("of 10 positions"), "{err}");
    let out = tandem().args(["bench", "fidelity", "--model", "preset:tiny-qwen3"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("nothing to compare"), "{err}");
}

/// `--model ORG/NAME` asks the Hub named by HF_ENDPOINT (the download itself is tested against a
/// local hub in the model crate): one that cannot be reached fails at once with a message that
/// names it and what to do instead.
#[test]
fn a_hub_model_from_an_unreachable_hub_says_so() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let home = std::env::temp_dir().join(format!("tandem-cli-hf-home-{}", std::process::id()));
    let out = tandem()
        .args(["generate", "--model", "tandem-tests/not-here", "--prompt", "x"])
        .env("HF_ENDPOINT", format!("http://{closed}"))
        .env("HF_HOME", &home)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains(&format!("cannot reach the Hugging Face Hub at http://{closed}")), "{err}");
    assert!(err.contains("tandem-tests/not-here") && !err.contains("panicked"), "{err}");
    std::fs::remove_dir_all(&home).ok();
}

/// `--device cuda:0` either runs (a GPU is here) or says why CUDA is unusable, naming what is
/// missing, without a panic; `--device auto` falls back to the CPU and still answers.
#[test]
fn cuda_device_runs_or_explains_and_auto_falls_back() {
    let out =
        tandem().args(["generate", "--prompt", "the cat", "--max-tokens", "4", "--device", "cuda:0"]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    if !out.status.success() {
        assert!(err.contains("CUDA is not available") || err.contains("GPU"), "unhelpful error: {err}");
        let auto = generate_json(&["--prompt", "the cat", "--max-tokens", "4", "--device", "auto"]);
        assert_eq!(ids(&auto["token_ids"]).len(), 4);
    }
}

#[test]
fn generate_seed_makes_sampling_repeatable() {
    let run = |seed: &str| {
        generate_json(&[
            "--prompt",
            "a b c",
            "--max-tokens",
            "16",
            "--temperature",
            "1.0",
            "--seed",
            seed,
            "--ignore-eos",
        ])["token_ids"]
            .clone()
    };
    assert_eq!(run("3"), run("3"));
    assert_ne!(run("3"), run("4"));
}
