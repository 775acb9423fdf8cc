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
    /// TLS (rustls) on this engine's HTTP port (HTTPS) and on its KV side channel and streams:
    /// this engine's certificate chain (PEM), naming the host clients and peers reach it at
    /// (--kv-advertise-host and the router's URL for it, an IP or DNS name). Needs --tls-key
    /// and --tls-ca; every engine of the deployment must run with TLS, and the router reaches
    /// engines at https:// URLs, trusting --tls-ca.
    #[arg(long, value_name = "PATH", requires_all = ["tls_key", "tls_ca"])]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, value_name = "PATH", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// The CA (PEM) every KV peer's certificate must chain to; peers verify this engine's too.
    /// (HTTP clients present no certificate: API keys and the cluster token say who they are.)
    #[arg(long, value_name = "PATH", requires = "tls_cert")]
    pub tls_ca: Option<PathBuf>,
}

/// A server's TLS, as its flags name it.
pub struct ServeTls {
    /// The KV side channel's (mutual).
    pub kv: tandem_kv::stream::KvTls,
    /// The HTTP port's.
    pub https: tandem_tls::HttpsConfig,
}

fn read_pem(flag: &str, path: &PathBuf) -> Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("reading {flag} {}", path.display()))
}

impl TlsArgs {
    /// The TLS setup the flags name, if any; an error naming the file that is wrong.
    pub fn load(&self) -> Result<Option<ServeTls>> {
        let (Some(cert), Some(key), Some(ca)) = (&self.tls_cert, &self.tls_key, &self.tls_ca) else { return Ok(None) };
        let (cert, key, ca) = (read_pem("--tls-cert", cert)?, read_pem("--tls-key", key)?, read_pem("--tls-ca", ca)?);
        let kv = tandem_kv::stream::KvTls::from_pem(&cert, &key, &ca)
            .map_err(|e| anyhow::anyhow!("--tls-cert/--tls-key/--tls-ca: {e}"))?;
        let https =
            tandem_tls::HttpsConfig::from_pem(&cert, &key).map_err(|e| anyhow::anyhow!("--tls-cert/--tls-key: {e}"))?;
        Ok(Some(ServeTls { kv, https }))
    }

    /// The flags as given, for a child process (`tandem up`).
    pub fn to_args(&self) -> Vec<String> {
        [("--tls-cert", &self.tls_cert), ("--tls-key", &self.tls_key), ("--tls-ca", &self.tls_ca)]
            .into_iter()
            .filter_map(|(flag, p)| p.as_ref().map(|p| [flag.to_string(), p.display().to_string()]))
            .flatten()
            .collect()
    }

    /// The CA's PEM, for a client of the servers these flags set up.
    pub fn ca_pem(&self) -> Result<Option<Vec<u8>>> {
        self.tls_ca.as_ref().map(|p| read_pem("--tls-ca", p)).transpose()
    }
}

#[derive(Args, Debug, Clone, Default)]
pub struct RouterTlsArgs {
    /// Serve clients over HTTPS (rustls) with this certificate chain (PEM), naming the host
    /// clients reach the router at. Needs --tls-key.
    #[arg(long, value_name = "PATH", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, value_name = "PATH", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// The CA (PEM) engines' HTTPS certificates must chain to: needed to reach engines at
    /// https:// URLs (engines started with --tls-cert).
    #[arg(long, value_name = "PATH")]
    pub tls_ca: Option<PathBuf>,
}

impl RouterTlsArgs {
    /// The HTTPS setup for the router's own port, if --tls-cert was given.
    pub fn https(&self) -> Result<Option<tandem_tls::HttpsConfig>> {
        let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) else { return Ok(None) };
        let https = tandem_tls::HttpsConfig::from_pem(&read_pem("--tls-cert", cert)?, &read_pem("--tls-key", key)?)
            .map_err(|e| anyhow::anyhow!("--tls-cert/--tls-key: {e}"))?;
        Ok(Some(https))
    }

    /// The engines' CA (PEM), if --tls-ca was given.
    pub fn engine_ca(&self) -> Result<Option<Vec<u8>>> {
        self.tls_ca.as_ref().map(|p| read_pem("--tls-ca", p)).transpose()
    }
}

/// An HTTP client (blocking) that trusts `ca` (PEM) besides nothing else, for `https://` URLs.
pub fn blocking_client(ca: Option<&[u8]>) -> Result<reqwest::blocking::Client> {
    let mut builder = reqwest::blocking::Client::builder();
    if let Some(ca) = ca {
        for cert in reqwest::Certificate::from_pem_bundle(ca).context("--tls-ca")? {
            builder = builder.add_root_certificate(cert);
        }
    }
    builder.build().context("building the HTTP client")
}
