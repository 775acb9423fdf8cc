//! One engine behind the router: its URL, load, and what the router last learned of it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tandem_kv::{AgentInfo, Role};

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

impl KvEndpoint {
    /// The TCP side channel an engine offers, if it offers one.
    pub fn of(info: &AgentInfo) -> Option<Self> {
        let (host, port) = info.tcp_addr()?.rsplit_once(':')?;
        Some(Self {
            engine_id: info.engine_id.0.clone(),
            host: host.trim_matches(|c| c == '[' || c == ']').to_string(),
            port: port.parse().ok()?,
        })
    }
}

/// What the router last learned about a backend (from `/health` and `/kv/info`).
#[derive(Clone, Debug)]
pub enum BackendState {
    /// Not checked yet.
    Unknown,
    /// Healthy, in the router's mode and the role it was given as.
    Ready(Arc<AgentInfo>),
    /// Not answering, or not healthy. Requests still try it when no ready engine is left
    /// (it may have come back since the last check).
    Down(String),
    /// Answering, but set up so that no request through it can work (no KV connector, the
    /// other role or mode). Never sent a request until a check finds it fixed.
    Misconfigured(String),
}

/// An engine the router sends legs to.
#[derive(Debug)]
pub struct Backend {
    /// Base URL, e.g. `http://127.0.0.1:8100`.
    pub url: String,
    /// The part the router was told this engine plays.
    pub role: Role,
    outstanding: AtomicUsize,
    state: Mutex<BackendState>,
}

impl Backend {
    /// A backend at `url` (trailing slashes trimmed) in `role`.
    pub fn new(url: &str, role: Role) -> Self {
        Self {
            url: url.trim_end_matches('/').to_string(),
            role,
            outstanding: AtomicUsize::new(0),
            state: Mutex::new(BackendState::Unknown),
        }
    }

    /// Requests in flight on this backend.
    pub fn outstanding(&self) -> usize {
        self.outstanding.load(Ordering::Relaxed)
    }

    /// The last check's verdict.
    pub fn state(&self) -> BackendState {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Records a check's verdict and returns the one before.
    pub(crate) fn set_state(&self, state: BackendState) -> BackendState {
        std::mem::replace(&mut *self.state.lock().unwrap_or_else(|p| p.into_inner()), state)
    }

    /// Whether the last check found it ready.
    pub fn is_healthy(&self) -> bool {
        matches!(self.state(), BackendState::Ready(_))
    }

    /// Its KV metadata, when the last check found it ready.
    pub fn info(&self) -> Option<Arc<AgentInfo>> {
        match self.state() {
            BackendState::Ready(info) => Some(info),
            _ => None,
        }
    }

    /// The prefill engine's side channel, once known.
    pub fn kv(&self) -> Option<KvEndpoint> {
        self.info().and_then(|i| KvEndpoint::of(&i))
    }

    /// Counts a request in flight until the returned guard drops.
    pub(crate) fn start(self: &Arc<Self>) -> InFlight {
        self.outstanding.fetch_add(1, Ordering::Relaxed);
        InFlight(self.clone())
    }
}

/// One request in flight on a backend.
pub(crate) struct InFlight(Arc<Backend>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.outstanding.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Fewest outstanding among ready backends that `fits`, round-robin among ties (`turn`
/// rotates the starting point). Falls back to down or unchecked ones when none is ready;
/// misconfigured ones are never chosen.
pub(crate) fn choose(backends: &[Arc<Backend>], turn: usize, fits: impl Fn(&Backend) -> bool) -> Option<Arc<Backend>> {
    let n = backends.len();
    let pick = |only_ready: bool| {
        (0..n)
            .map(|i| &backends[(turn + i) % n])
            .filter(|b| fits(b))
            .filter(|b| match b.state() {
                BackendState::Ready(_) => true,
                BackendState::Unknown | BackendState::Down(_) => !only_ready,
                BackendState::Misconfigured(_) => false,
            })
            .min_by_key(|b| b.outstanding())
            .cloned()
    };
    pick(true).or_else(|| pick(false))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_compute::{KvDtype, KvLayout};
    use tandem_core::{EngineId, Epoch};
    use tandem_kv::KvMode;

    fn ready() -> BackendState {
        let layout = KvLayout { num_layers: 1, num_kv_heads: 1, head_dim: 4, block_size: 4, num_blocks: 4 };
        BackendState::Ready(Arc::new(AgentInfo::for_layout(
            EngineId("e".into()),
            Epoch(1),
            Role::Decode,
            KvMode::Push,
            "m".into(),
            &layout,
            KvDtype::F32,
            Vec::new(),
        )))
    }

    #[test]
    fn least_outstanding_then_round_robin_skipping_down_and_never_misconfigured() {
        let bs: Vec<Arc<Backend>> =
            (0..3).map(|i| Arc::new(Backend::new(&format!("http://b{i}/"), Role::Decode))).collect();
        assert_eq!(bs[0].url, "http://b0");
        let any = |_: &Backend| true;
        let picks: Vec<String> = (0..3).map(|t| choose(&bs, t, any).unwrap().url.clone()).collect();
        assert_eq!(picks, ["http://b0", "http://b1", "http://b2"], "unchecked backends are tried");
        for b in &bs {
            b.set_state(ready());
        }
        let _busy = bs[1].start();
        let _busy2 = bs[0].start();
        assert_eq!(choose(&bs, 0, any).unwrap().url, "http://b2");
        bs[2].set_state(BackendState::Down("connection refused".into()));
        assert_eq!(choose(&bs, 0, any).unwrap().url, "http://b0", "ties broken by turn among ready");
        assert_eq!(choose(&bs, 0, |b| b.url == "http://b2").unwrap().url, "http://b2", "down is a last resort");
        bs[2].set_state(BackendState::Misconfigured("pull mode".into()));
        assert!(choose(&bs, 0, |b| b.url == "http://b2").is_none(), "misconfigured is never chosen");
        drop(_busy2);
        assert_eq!(bs[0].outstanding(), 0);
    }
}
