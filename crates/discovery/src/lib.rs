//! Engines and routers finding each other (`--discovery etcd://HOST:PORT[,HOST:PORT...]`).
//!
//! An engine writes its [`EngineRecord`] (role, model, addresses, transports, capacity) under
//! `PREFIX/engines/ENGINE_ID`, attached to an etcd lease it keeps alive ([`register`]); the
//! key vanishes when the engine withdraws it on shutdown or when the lease runs out (a killed
//! engine: at most the lease time). A router follows every key under the prefix ([`watch`])
//! as a [`Membership`] and serves the engines in it.
//!
//! etcd being unreachable changes nothing that serves: an engine keeps serving and registers
//! again when etcd answers; a router keeps its last view. Both say so in their logs and in
//! [`DiscoveryHealth`].
//!
//! The etcd client is the `etcd` feature (its build needs `protoc`); without it [`register`]
//! and [`watch`] answer [`DiscoveryError::NotBuilt`].

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use serde::{Deserialize, Serialize};

#[cfg(feature = "etcd")]
mod etcd;
#[cfg(feature = "etcd")]
pub mod test_etcd;

/// What an engine says of itself to routers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineRecord {
    /// Its KV side channel's engine id (unique in a deployment: the key it is registered under).
    pub engine_id: String,
    /// Bumped on every restart of the engine.
    pub epoch: u64,
    /// `prefill`, `decode` or `colocated`.
    pub role: String,
    /// `push` or `pull` (empty for a colocated engine).
    pub kv_mode: String,
    /// The model name it serves (`--served-model-name`).
    pub model: String,
    /// A digest of the model's shape and KV layout: engines that can exchange KV share it.
    pub fingerprint: String,
    /// Where routers reach its HTTP API, e.g. `http://10.0.0.5:8100`.
    pub http_url: String,
    /// Its KV side channel's `host:port`, if it has one.
    pub kv_address: Option<String>,
    /// The KV transports it offers (tcp, cuda-ipc, nixl).
    pub transports: Vec<String>,
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks in its pool.
    pub capacity_blocks: usize,
    /// Its lease, seconds: how long its key outlives it. A router keeps an engine whose key
    /// went while the engine still answers healthy for this long (etcd may expire every lease
    /// at once after an outage), expecting it to register again.
    #[serde(default = "default_lease_secs")]
    pub lease_secs: u64,
}

fn default_lease_secs() -> u64 {
    5
}

/// Every registered engine, by engine id.
pub type Membership = BTreeMap<String, EngineRecord>;

/// Where the registry is and how engines hold their keys there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiscoveryConfig {
    /// etcd endpoints, `host:port` each.
    pub endpoints: Vec<String>,
    /// Key prefix of this deployment (`/tandem` by default).
    pub prefix: String,
    /// An engine's lease: how long after its last keep-alive its key outlives it.
    pub lease_ttl: Duration,
}

impl DiscoveryConfig {
    /// From `--discovery etcd://HOST:PORT[,HOST:PORT...]`, the key prefix and the lease time.
    pub fn parse(url: &str, prefix: &str, lease_ttl: Duration) -> Result<Self, DiscoveryError> {
        let bad =
            |why: &str| DiscoveryError::BadUrl(format!("`{url}`: {why} (expected etcd://HOST:PORT[,HOST:PORT...])"));
        let rest = url.strip_prefix("etcd://").ok_or_else(|| bad("not an etcd:// URL"))?;
        let endpoints: Vec<String> =
            rest.trim_end_matches('/').split(',').map(str::trim).filter(|e| !e.is_empty()).map(String::from).collect();
        if endpoints.is_empty() {
            return Err(bad("no endpoint"));
        }
        for e in &endpoints {
            match e.rsplit_once(':') {
                Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {}
                _ => return Err(bad(&format!("`{e}` is not HOST:PORT"))),
            }
        }
        let prefix = prefix.trim_end_matches('/');
        if !prefix.starts_with('/') {
            return Err(DiscoveryError::BadUrl(format!("key prefix `{prefix}` must start with /")));
        }
        if lease_ttl < Duration::from_secs(1) {
            return Err(DiscoveryError::BadUrl("the lease must be at least 1 s (etcd counts it in seconds)".into()));
        }
        Ok(Self { endpoints, prefix: prefix.to_string(), lease_ttl })
    }

    /// The prefix every engine's key starts with.
    pub fn engines_prefix(&self) -> String {
        format!("{}/engines/", self.prefix)
    }

    /// The key engine `engine_id` is registered under.
    pub fn key_of(&self, engine_id: &str) -> String {
        format!("{}{engine_id}", self.engines_prefix())
    }
}

/// Why discovery could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DiscoveryError {
    /// The `--discovery` URL or its settings are wrong.
    #[error("--discovery {0}")]
    BadUrl(String),
    /// This build has no etcd client.
    #[error(
        "this tandem was built without etcd discovery: build it with `--features etcd` (which needs protoc; Debian: apt-get install protobuf-compiler)"
    )]
    NotBuilt,
}

/// How discovery is doing, for logs, `/health` and `/metrics`.
#[derive(Debug, Default)]
pub struct DiscoveryHealth {
    connected: AtomicBool,
    failures: AtomicU64,
    last_error: Mutex<String>,
    member: Mutex<String>,
}

impl DiscoveryHealth {
    /// Whether etcd answered last time it was asked.
    pub fn connected(&self) -> bool {
        self.connected.load(Ordering::Relaxed)
    }

    /// Times etcd could not be reached or a session with it broke.
    pub fn failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
    }

    /// The last thing that went wrong (empty if nothing has).
    pub fn last_error(&self) -> String {
        self.last_error.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The etcd member (`host:port`) the last session talked to (empty before the first).
    pub fn member(&self) -> String {
        self.member.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    fn pinned(&self, member: &str) {
        *self.member.lock().unwrap_or_else(|p| p.into_inner()) = member.to_string();
    }

    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    fn up(&self) -> bool {
        !self.connected.swap(true, Ordering::Relaxed)
    }

    /// Records a failure; whether this is news (the first since etcd last answered).
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    fn down(&self, error: String) -> bool {
        self.failures.fetch_add(1, Ordering::Relaxed);
        *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = error;
        self.connected.swap(false, Ordering::Relaxed)
    }
}

/// An engine's registration, kept alive in the background until [`Registration::withdraw`]
/// (or until it is dropped, which stops the keep-alives: the key then lasts its lease out).
pub struct Registration {
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    stop: Option<tokio::sync::oneshot::Sender<tokio::sync::oneshot::Sender<()>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Registration {
    /// Takes the key out of etcd now (revoking the lease), waiting at most `timeout`: routers
    /// stop sending new requests before the engine drains.
    pub async fn withdraw(mut self, timeout: Duration) {
        let Some(stop) = self.stop.take() else { return };
        let (done, withdrawn) = tokio::sync::oneshot::channel();
        if stop.send(done).is_ok() && tokio::time::timeout(timeout, withdrawn).await.is_err() {
            tracing::warn!("etcd did not confirm the withdrawal in time; the key lasts until its lease runs out");
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Registers `record` under `cfg` and keeps it registered (a task of the current tokio
/// runtime): connecting, granting a lease, writing the key if no other engine holds it, and
/// keeping the lease alive; whenever etcd cannot be reached it tries again, the engine serving
/// meanwhile.
pub fn register(
    cfg: &DiscoveryConfig,
    record: EngineRecord,
    health: std::sync::Arc<DiscoveryHealth>,
) -> Result<Registration, DiscoveryError> {
    #[cfg(feature = "etcd")]
    {
        Ok(etcd::register(cfg.clone(), record, health))
    }
    #[cfg(not(feature = "etcd"))]
    {
        let _ = (cfg, record, health);
        Err(DiscoveryError::NotBuilt)
    }
}

/// Follows every engine registered under `cfg`'s prefix (a task of the current tokio runtime).
/// The receiver holds `None` until etcd has been read once, then the membership as it stands;
/// while etcd is unreachable it keeps the last one.
pub fn watch(
    cfg: &DiscoveryConfig,
    health: std::sync::Arc<DiscoveryHealth>,
) -> Result<(tokio::sync::watch::Receiver<Option<Membership>>, tokio::task::JoinHandle<()>), DiscoveryError> {
    #[cfg(feature = "etcd")]
    {
        Ok(etcd::watch(cfg.clone(), health))
    }
    #[cfg(not(feature = "etcd"))]
    {
        let _ = (cfg, health);
        Err(DiscoveryError::NotBuilt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn discovery_urls_parse_and_bad_ones_say_what_is_wrong() {
        let ttl = Duration::from_secs(5);
        let one = DiscoveryConfig::parse("etcd://127.0.0.1:2379", "/tandem", ttl).unwrap();
        assert_eq!(one.endpoints, ["127.0.0.1:2379"]);
        assert_eq!(one.key_of("prefill-a"), "/tandem/engines/prefill-a");
        let three = DiscoveryConfig::parse("etcd://a:1,b:2, c:3/", "/prod/", ttl).unwrap();
        assert_eq!(three.endpoints, ["a:1", "b:2", "c:3"]);
        assert_eq!(three.engines_prefix(), "/prod/engines/");
        for (url, says) in [
            ("http://a:1", "not an etcd"),
            ("etcd://", "no endpoint"),
            ("etcd://a", "not HOST:PORT"),
            ("etcd://a:99999", "not HOST:PORT"),
        ] {
            let e = DiscoveryConfig::parse(url, "/tandem", ttl).unwrap_err().to_string();
            assert!(e.contains(says), "{url}: {e}");
        }
        assert!(DiscoveryConfig::parse("etcd://a:1", "tandem", ttl).is_err());
        assert!(DiscoveryConfig::parse("etcd://a:1", "/tandem", Duration::from_millis(500)).is_err());
    }
}
