//! `--model ORG/NAME`: a model from the Hugging Face Hub, downloaded as vLLM does into the
//! shared Hugging Face cache (`$HF_HOME/hub`, by default `~/.cache/huggingface/hub`), so that
//! transformers, vLLM and tandem reuse one copy.
//!
//! Only the files an engine reads are fetched: `config.json`, `generation_config.json`, the
//! tokenizer's files, `chat_template.jinja` and the safetensors weights (with their index).
//! `HF_ENDPOINT` points at a mirror, `HF_TOKEN` (or the token `huggingface-cli login` saved)
//! authorises gated and private repositories. A model already in the cache is used without
//! asking the Hub; a partial download is completed on the next start.

use std::path::{Path, PathBuf};

use hf_hub::api::sync::{ApiBuilder, ApiError};
use hf_hub::{Cache, Repo, RepoType};

use crate::ModelError;

/// Where the Hub is and who asks (the CLI fills it from HF_ENDPOINT and HF_TOKEN).
#[derive(Clone, Debug, Default)]
pub struct HubConfig {
    /// The Hub's base URL (`https://huggingface.co` when `None`).
    pub endpoint: Option<String>,
    /// Bearer token for gated and private repositories.
    pub token: Option<String>,
    /// The cache's `hub` directory (`$HF_HOME/hub` or `~/.cache/huggingface/hub` when `None`).
    pub cache_dir: Option<PathBuf>,
    /// Show a progress bar per file.
    pub progress: bool,
}

impl HubConfig {
    fn cache(&self) -> Cache {
        match &self.cache_dir {
            Some(dir) => Cache::new(dir.clone()),
            None => Cache::from_env(),
        }
    }

    fn endpoint(&self) -> &str {
        self.endpoint.as_deref().unwrap_or("https://huggingface.co")
    }
}

/// Whether `spec` names a Hub repository rather than a local path: `ORG/NAME` (one slash,
/// neither part empty or `.`/`..`) that is not a file or directory here.
pub fn is_repo_id(spec: &str) -> bool {
    let mut parts = spec.split('/');
    let (Some(org), Some(name), None) = (parts.next(), parts.next(), parts.next()) else { return false };
    let ok = |p: &str| {
        !p.is_empty() && p != "." && p != ".." && p.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    };
    ok(org) && ok(name) && !Path::new(spec).exists()
}

/// The files of a repository an engine reads.
fn wanted(file: &str) -> bool {
    const NAMED: [&str; 7] = [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
        "model.safetensors.index.json",
    ];
    NAMED.contains(&file) || (file.ends_with(".safetensors") && !file.contains('/'))
}

/// The local snapshot directory of `repo` (its `main` revision), downloading what is not in
/// the cache yet. A snapshot already holding its weights is used as it is, without asking
/// the Hub.
pub fn fetch(repo: &str, cfg: &HubConfig) -> Result<PathBuf, ModelError> {
    let cache = cfg.cache();
    let cached = cache.repo(Repo::new(repo.to_string(), RepoType::Model));
    if let Some(config) = cached.get("config.json") {
        let dir = config.parent().map(Path::to_path_buf).unwrap_or_default();
        if complete(&dir) {
            tracing::info!(repo, dir = %dir.display(), "model found in the Hugging Face cache");
            return Ok(dir);
        }
    }
    let failed = |e: ApiError| hub_error(repo, cfg.endpoint(), e);
    let mut api = ApiBuilder::from_cache(cache).with_progress(cfg.progress).with_token(cfg.token.clone());
    if let Some(endpoint) = &cfg.endpoint {
        api = api.with_endpoint(endpoint.trim_end_matches('/').to_string());
    }
    let api = api.build().map_err(failed)?;
    let remote = api.model(repo.to_string());
    let info = remote.info().map_err(failed)?;
    let files: Vec<String> = info.siblings.into_iter().map(|s| s.rfilename).filter(|f| wanted(f)).collect();
    if !files.iter().any(|f| f == "config.json") {
        return Err(ModelError::Hub(format!(
            "{repo} at {}: the repository has no config.json (not a transformers model; a GGUF repository's file can be downloaded and passed as --model FILE.gguf)",
            cfg.endpoint()
        )));
    }
    tracing::info!(repo, files = files.len(), endpoint = cfg.endpoint(), "downloading the model from the Hub");
    let mut dir = None;
    for file in &files {
        let path = remote.get(file).map_err(failed)?;
        if file == "config.json" {
            dir = path.parent().map(Path::to_path_buf);
        }
    }
    let dir = dir.ok_or_else(|| ModelError::Hub(format!("{repo}: config.json did not download")))?;
    if !complete(&dir) {
        return Err(ModelError::Hub(format!(
            "{repo} at {}: no safetensors weights (tandem reads model.safetensors or its shards)",
            cfg.endpoint()
        )));
    }
    Ok(dir)
}

/// A snapshot with a config and all of its weights.
fn complete(dir: &Path) -> bool {
    if !dir.join("config.json").is_file() {
        return false;
    }
    let index = dir.join("model.safetensors.index.json");
    if let Ok(text) = std::fs::read_to_string(&index) {
        let shards: Vec<String> = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| {
                v["weight_map"].as_object().map(|m| m.values().filter_map(|s| s.as_str().map(String::from)).collect())
            })
            .unwrap_or_default();
        return !shards.is_empty() && shards.iter().all(|s| dir.join(s).is_file());
    }
    dir.join("model.safetensors").is_file()
}

/// What went wrong talking to the Hub, in a user's words.
fn hub_error(repo: &str, endpoint: &str, e: ApiError) -> ModelError {
    let message = match &e {
        ApiError::RequestError(r) => match r.as_ref() {
            ureq::Error::Status(code @ (401 | 403), _) => format!(
                "{repo} at {endpoint}: access refused (HTTP {code}); a gated or private model needs HF_TOKEN (or `huggingface-cli login`)"
            ),
            ureq::Error::Status(404, _) => {
                format!("{repo} at {endpoint}: no such model (HTTP 404); check the name, or pass a local directory")
            }
            ureq::Error::Status(code, _) => format!("{repo} at {endpoint}: the Hub answered HTTP {code}"),
            ureq::Error::Transport(t) => format!(
                "{repo}: cannot reach the Hugging Face Hub at {endpoint} ({t}); set HF_ENDPOINT for a mirror, or pass a local directory or .gguf file"
            ),
        },
        _ => format!("{repo} at {endpoint}: {e}"),
    };
    ModelError::Hub(message)
}
