//! `--api-key` and `--api-key-file` on `serve`, `router` and `up`; the environment's
//! `TANDEM_API_KEY`, as vLLM reads `VLLM_API_KEY` (read here, in the binary only); the
//! deployment's `--cluster-secret-file` and the router's `--admin-key`.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use tandem_core::{ApiKeys, ClusterSecret};

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

#[derive(Args, Debug, Clone, Default)]
pub struct ClusterSecretArgs {
    /// A file holding the secret this deployment's router and engines share (at least 16
    /// bytes; `openssl rand -hex 32 > secret`, readable by their user only). With it, KV peers
    /// prove they hold it before any KV metadata is exchanged and every side-channel frame is
    /// authenticated, an engine's /kv/* endpoints and the router's /admin/engines answer only
    /// the deployment's own processes, and engines with another secret or none are refused.
    #[arg(long, value_name = "PATH")]
    pub cluster_secret_file: Option<PathBuf>,
}

impl ClusterSecretArgs {
    /// The secret in the file, if one was named; an error naming the file if it cannot be read
    /// or is too short. Warns when other users may read it.
    pub fn load(&self) -> Result<Option<ClusterSecret>> {
        let Some(path) = &self.cluster_secret_file else { return Ok(None) };
        let text = std::fs::read(path).with_context(|| format!("reading --cluster-secret-file {}", path.display()))?;
        let secret =
            ClusterSecret::new(&text).map_err(|e| anyhow::anyhow!("--cluster-secret-file {}: {e}", path.display()))?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            if std::fs::metadata(path).map(|m| m.permissions().mode() & 0o077 != 0).unwrap_or(false) {
                tracing::warn!(path = %path.display(), "the cluster secret file is readable by other users of this host (chmod 600 it)");
            }
        }
        Ok(Some(secret))
    }

    /// The flag as given, for a child process (`tandem up`).
    pub fn to_args(&self) -> Vec<String> {
        self.cluster_secret_file
            .iter()
            .flat_map(|p| ["--cluster-secret-file".to_string(), p.display().to_string()])
            .collect()
    }
}

#[derive(Args, Debug, Clone, Default)]
pub struct TlsArgs {
    /// The KV side channel and its streams over TLS (rustls): this engine's certificate chain
    /// (PEM), naming the host peers reach it at (--kv-advertise-host, an IP or DNS name). Needs
    /// --tls-key and --tls-ca; every engine of the deployment must run with TLS. (The HTTP
    /// ports take no TLS yet: put a TLS-terminating proxy in front of the router.)
    #[arg(long, value_name = "PATH", requires_all = ["tls_key", "tls_ca"])]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, value_name = "PATH", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// The CA (PEM) every peer's certificate must chain to; peers verify this engine's too.
    #[arg(long, value_name = "PATH", requires = "tls_cert")]
    pub tls_ca: Option<PathBuf>,
}

impl TlsArgs {
    /// The TLS setup the flags name, if any; an error naming the file that is wrong.
    pub fn load(&self) -> Result<Option<tandem_kv::stream::KvTls>> {
        let (Some(cert), Some(key), Some(ca)) = (&self.tls_cert, &self.tls_key, &self.tls_ca) else { return Ok(None) };
        let read =
            |flag: &str, p: &PathBuf| std::fs::read(p).with_context(|| format!("reading {flag} {}", p.display()));
        let tls = tandem_kv::stream::KvTls::from_pem(
            &read("--tls-cert", cert)?,
            &read("--tls-key", key)?,
            &read("--tls-ca", ca)?,
        )
        .map_err(|e| anyhow::anyhow!("--tls-cert/--tls-key/--tls-ca: {e}"))?;
        Ok(Some(tls))
    }

    /// The flags as given, for a child process (`tandem up`).
    pub fn to_args(&self) -> Vec<String> {
        [("--tls-cert", &self.tls_cert), ("--tls-key", &self.tls_key), ("--tls-ca", &self.tls_ca)]
            .into_iter()
            .filter_map(|(flag, p)| p.as_ref().map(|p| [flag.to_string(), p.display().to_string()]))
            .flatten()
            .collect()
    }
}
