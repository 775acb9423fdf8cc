//! `--api-key` and `--api-key-file` on `serve`, `router` and `up`; the environment's
//! `TANDEM_API_KEY`, as vLLM reads `VLLM_API_KEY` (read here, in the binary only).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use tandem_core::ApiKeys;

#[derive(Args, Debug, Clone, Default)]
pub struct ApiKeyArgs {
    /// Requests to the OpenAI API (/v1/*, /tokenize, /detokenize) must carry `Authorization:
    /// Bearer KEY` with one of these keys (repeat or comma-separate for several); others get a
    /// 401. /health and /metrics stay open. Default: TANDEM_API_KEY from the environment
    /// (comma-separated); neither: open to anyone who reaches the port.
    #[arg(long = "api-key", value_name = "KEY", env = "TANDEM_API_KEY", hide_env_values = true, value_delimiter = ',')]
    pub api_key: Vec<String>,
    /// A file of API keys, one a line (blank lines and lines starting with # are skipped),
    /// taken besides any --api-key.
    #[arg(long, value_name = "PATH")]
    pub api_key_file: Option<PathBuf>,
    /// `serve`: /metrics answers only with one of the keys too (it names the model and shows
    /// the load; open by default, as Prometheus scrapers expect).
    #[arg(long)]
    pub api_key_for_metrics: bool,
}

impl ApiKeyArgs {
    /// Every key given, the file's after the flags'.
    pub fn keys(&self) -> Result<Vec<String>> {
        let mut keys = self.api_key.clone();
        if let Some(path) = &self.api_key_file {
            let text =
                std::fs::read_to_string(path).with_context(|| format!("reading --api-key-file {}", path.display()))?;
            keys.extend(text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).map(String::from));
            if keys.is_empty() {
                anyhow::bail!("--api-key-file {} holds no key", path.display());
            }
        }
        Ok(keys)
    }

    /// The keys as a server checks them.
    pub fn api_keys(&self) -> Result<ApiKeys> {
        ApiKeys::new(self.keys()?).context("--api-key")
    }

    /// The TANDEM_API_KEY that gives a child process every key (comma-separated, in its
    /// environment rather than on a command line others can list); `None`: no key.
    pub fn child_env(&self) -> Result<Option<String>> {
        let keys = self.keys()?;
        Ok((!keys.is_empty()).then(|| keys.join(",")))
    }
}
