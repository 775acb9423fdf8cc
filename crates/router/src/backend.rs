//! One engine behind the router: its URL, load, health and (prefill) KV side channel.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

/// Where a prefill engine's KV side channel is (from its `/kv/info`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvEndpoint {
    /// Engine id.
    pub engine_id: String,
    /// Host of the side channel.
    pub host: String,
    /// Port of the side channel.
    pub port: u16,
}

/// An engine the router sends legs to.
#[derive(Debug)]
pub struct Backend {
    /// Base URL, e.g. `http://127.0.0.1:8100`.
    pub url: String,
    outstanding: AtomicUsize,
    healthy: AtomicBool,
    kv: Mutex<Option<KvEndpoint>>,
}

impl Backend {
    /// A backend at `url` (trailing slashes trimmed).
    pub fn new(url: &str) -> Self {
        Self {
            url: url.trim_end_matches('/').to_string(),
            outstanding: AtomicUsize::new(0),
            healthy: AtomicBool::new(true),
            kv: Mutex::new(None),
        }
    }

    /// Requests in flight on this backend.
    pub fn outstanding(&self) -> usize {
        self.outstanding.load(Ordering::Relaxed)
    }

    /// Whether the last health check passed.
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    pub(crate) fn set_healthy(&self, ok: bool) {
        self.healthy.store(ok, Ordering::Relaxed);
    }

    /// The prefill engine's side channel, once known.
    pub fn kv(&self) -> Option<KvEndpoint> {
        self.kv.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub(crate) fn set_kv(&self, kv: KvEndpoint) {
        *self.kv.lock().unwrap_or_else(|p| p.into_inner()) = Some(kv);
    }

    /// Counts a request in flight until the returned guard drops.
    pub(crate) fn start(self: &std::sync::Arc<Self>) -> InFlight {
        self.outstanding.fetch_add(1, Ordering::Relaxed);
        InFlight(self.clone())
    }
}

/// One request in flight on a backend.
pub(crate) struct InFlight(std::sync::Arc<Backend>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.outstanding.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Fewest outstanding among healthy backends, round-robin among ties (`turn` rotates the
/// starting point). Falls back to all backends when none is healthy.
pub(crate) fn choose(backends: &[std::sync::Arc<Backend>], turn: usize) -> Option<std::sync::Arc<Backend>> {
    let n = backends.len();
    let pick = |only_healthy: bool| {
        (0..n)
            .map(|i| &backends[(turn + i) % n])
            .filter(|b| !only_healthy || b.is_healthy())
            .min_by_key(|b| b.outstanding())
            .cloned()
    };
    pick(true).or_else(|| pick(false))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn least_outstanding_then_round_robin_skipping_unhealthy() {
        let bs: Vec<Arc<Backend>> = (0..3).map(|i| Arc::new(Backend::new(&format!("http://b{i}/")))).collect();
        assert_eq!(bs[0].url, "http://b0");
        let picks: Vec<String> = (0..3).map(|t| choose(&bs, t).unwrap().url.clone()).collect();
        assert_eq!(picks, ["http://b0", "http://b1", "http://b2"]);
        let _busy = bs[1].start();
        let _busy2 = bs[0].start();
        assert_eq!(choose(&bs, 0).unwrap().url, "http://b2");
        bs[2].set_healthy(false);
        assert_eq!(choose(&bs, 0).unwrap().url, "http://b0", "ties broken by turn among healthy");
        drop(_busy2);
        assert_eq!(bs[0].outstanding(), 0);
    }
}
