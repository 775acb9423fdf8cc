//! `--model ORG/NAME` against a local server that answers in the Hugging Face Hub's URL layout
//! (`/api/models/REPO/revision/main`, `/REPO/resolve/main/FILE` with range requests), serving
//! the tiny Qwen3 fixture: the files land in an HF cache layout, load as the fixture does, a
//! second start uses the cache without a request, and an unknown, gated or unreachable
//! repository fails with a message that says which.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tandem_model::hub::{fetch, is_repo_id, HubConfig};
use tandem_model::{LoadedModel, ModelSource};

const REPO: &str = "tandem-tests/tiny-qwen3";
const GATED: &str = "tandem-tests/gated";
const TOKEN: &str = "hf_test_token";
const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/qwen3")
}

/// Serves `files` under `REPO` (and, to a request with the token, under `GATED`); counts requests.
fn serve(files: HashMap<String, Vec<u8>>) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let requests = Arc::new(AtomicUsize::new(0));
    let (files, count) = (Arc::new(files), requests.clone());
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            count.fetch_add(1, Ordering::SeqCst);
            let files = files.clone();
            std::thread::spawn(move || answer(stream, &files));
        }
    });
    (url, requests)
}

fn answer(mut stream: TcpStream, files: &HashMap<String, Vec<u8>>) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() {
        return;
    }
    let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
    let mut headers = HashMap::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    let authorised = headers.get("authorization").is_some_and(|a| a == &format!("Bearer {TOKEN}"));
    let respond = |stream: &mut TcpStream, status: &str, extra: &[(String, String)], body: &[u8]| {
        let mut head = format!("HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n", body.len());
        for (k, v) in extra {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        let _ = stream.write_all(head.as_bytes());
        let _ = stream.write_all(body);
    };
    for repo in [REPO, GATED] {
        if repo == GATED && !authorised {
            if path.contains(GATED) {
                return respond(&mut stream, "401 Unauthorized", &[], b"{\"error\":\"gated\"}");
            }
            continue;
        }
        if path == format!("/api/models/{repo}/revision/main") {
            let mut names: Vec<&String> = files.keys().collect();
            names.sort();
            let siblings: Vec<serde_json::Value> = names
                .iter()
                .map(|n| serde_json::json!({ "rfilename": n }))
                .chain([serde_json::json!({"rfilename": "README.md"})])
                .collect();
            let body = serde_json::json!({ "sha": COMMIT, "siblings": siblings }).to_string();
            let json = [("Content-Type".to_string(), "application/json".to_string())];
            return respond(&mut stream, "200 OK", &json, body.as_bytes());
        }
        if let Some(file) = path.strip_prefix(&format!("/{repo}/resolve/main/")) {
            let Some(bytes) = files.get(file) else { break };
            let range = headers.get("range").and_then(|r| r.strip_prefix("bytes=")).unwrap_or("0-");
            let (from, to) = range.split_once('-').unwrap_or(("0", ""));
            let from: usize = from.parse().unwrap_or(0);
            let to: usize = to.parse().map_or(bytes.len() - 1, |t: usize| t.min(bytes.len() - 1));
            let extra = [
                ("ETag".to_string(), format!("\"{:016x}{}\"", bytes.len(), file.len())),
                ("X-Repo-Commit".to_string(), COMMIT.to_string()),
                ("Content-Range".to_string(), format!("bytes {from}-{to}/{}", bytes.len())),
            ];
            return respond(&mut stream, "206 Partial Content", &extra, &bytes[from..=to]);
        }
    }
    respond(&mut stream, "404 Not Found", &[], b"{\"error\":\"Repository not found\"}");
}

#[test]
fn a_hub_model_downloads_into_the_cache_loads_and_is_used_from_there_after() {
    let mut files = HashMap::new();
    for f in ["config.json", "generation_config.json", "model.safetensors"] {
        files.insert(f.to_string(), std::fs::read(fixture().join(f)).unwrap());
    }
    let (endpoint, requests) = serve(files.clone());
    let cache = std::env::temp_dir().join(format!("tandem-hub-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cache);
    let cfg =
        HubConfig { endpoint: Some(endpoint.clone()), token: None, cache_dir: Some(cache.clone()), progress: false };
    let dir = fetch(REPO, &cfg).unwrap();
    // The shared cache's layout: models--ORG--NAME/snapshots/COMMIT/FILE.
    assert_eq!(dir, cache.join("models--tandem-tests--tiny-qwen3").join("snapshots").join(COMMIT));
    for (name, bytes) in &files {
        assert_eq!(&std::fs::read(dir.join(name)).unwrap(), bytes, "{name}");
    }
    assert!(!dir.join("README.md").exists(), "only what an engine reads is fetched");
    let hub = LoadedModel::load(&ModelSource::Dir(dir.clone()), None).unwrap();
    let local = LoadedModel::load(&ModelSource::Dir(fixture()), None).unwrap();
    assert_eq!(hub.transformer.fingerprint(), local.transformer.fingerprint());
    // Next start: from the cache, without asking the server.
    let before = requests.load(Ordering::SeqCst);
    assert_eq!(fetch(REPO, &cfg).unwrap(), dir);
    assert_eq!(requests.load(Ordering::SeqCst), before, "a cached model needs no request");

    // Unknown, gated without and with the token, unreachable.
    let err = |repo: &str, cfg: &HubConfig| fetch(repo, cfg).unwrap_err().to_string();
    let e = err("tandem-tests/nope", &cfg);
    assert!(e.contains("tandem-tests/nope") && e.contains("no such model (HTTP 404)"), "{e}");
    let e = err(GATED, &cfg);
    assert!(e.contains("HTTP 401") && e.contains("HF_TOKEN"), "{e}");
    let with_token = HubConfig { token: Some(TOKEN.into()), ..cfg.clone() };
    assert!(fetch(GATED, &with_token).is_ok(), "the token opens the gated repository");
    let closed = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let nowhere = HubConfig { endpoint: Some(format!("http://{closed}")), ..cfg.clone() };
    let e = err("tandem-tests/other", &nowhere);
    assert!(e.contains("cannot reach the Hugging Face Hub") && e.contains("HF_ENDPOINT"), "{e}");
    let _ = std::fs::remove_dir_all(&cache);
}

#[test]
fn only_org_slash_name_that_is_no_local_path_goes_to_the_hub() {
    assert!(is_repo_id("HuggingFaceTB/SmolLM2-135M-Instruct"));
    assert!(is_repo_id("Qwen/Qwen3-0.6B"));
    for not in ["preset:tiny-qwen3", "model.gguf", "/abs/dir", "a/b/c", "./x", "../x", "a/", "/b", "a b/c"] {
        assert!(!is_repo_id(not), "{not}");
    }
    // An existing relative directory is a path, not a repository.
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    std::env::set_current_dir(here.join("../..")).unwrap();
    assert!(!is_repo_id("fixtures/qwen3"));
}
