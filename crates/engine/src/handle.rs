//! The engine thread and the handle other threads use to reach it.
//!
//! The engine loop runs on its own OS thread (it is CPU-bound and must not sit on an async
//! runtime). Callers hold an [`EngineHandle`], a cheap clone that sends typed commands over a
//! channel; each request's events come back on its own channel as a [`RequestStream`].
//! Aborts are applied at one fixed point: between steps, when the loop drains its commands.
//! The KV connector's events arrive on the same channel, so a request whose KV landed is
//! scheduled at the next step, without polling.
//!
//! Shutdown: when every handle and stream is dropped the command channel closes (the
//! connector holds only a weak reference to it); the loop aborts what is left and exits.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Weak};
use std::time::Duration;

use tandem_core::{RequestId, TransferId};
use tandem_kv::{AgentInfo, ConnectorEvent, ConnectorStats, KvError};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::core::{EngineCore, EngineLimits, EngineModel, KvSetup, RequestRejected};
use crate::request::{EngineEvent, EngineRequest};
use crate::EngineConfig;

enum Command {
    Add(Box<EngineRequest>, tokio::sync::mpsc::UnboundedSender<EngineEvent>),
    Abort(RequestId),
    ReleaseKv(TransferId),
    /// From the KV connector's threads.
    Kv(ConnectorEvent),
}

/// The engine's command channel. Handles and streams hold it strongly; the KV connector weakly,
/// so that it never keeps a stopped engine's loop alive.
type Commands = Arc<mpsc::Sender<Command>>;

/// Live counters the engine thread publishes after every step (read by `/metrics`).
#[derive(Debug, Default)]
pub struct EngineStats {
    running: AtomicUsize,
    waiting: AtomicUsize,
    free_blocks: AtomicUsize,
    preemptions: AtomicU64,
    steps: AtomicU64,
    rejected: AtomicU64,
    cached_blocks: AtomicUsize,
    prefix_queried_tokens: AtomicU64,
    prefix_hit_tokens: AtomicU64,
}

/// A copy of [`EngineStats`] at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// Requests in the running set.
    pub running: usize,
    /// Requests queued.
    pub waiting: usize,
    /// Free KV blocks.
    pub free_blocks: usize,
    /// KV blocks in the pool.
    pub total_blocks: usize,
    /// Preemptions so far.
    pub preemptions: u64,
    /// Engine steps that computed tokens so far.
    pub steps: u64,
    /// Requests the engine thread refused (e.g. duplicate ids).
    pub rejected: u64,
    /// KV blocks whose computed KV is cached for later prompts now (held or free).
    pub cached_blocks: usize,
    /// Prompt tokens looked up in the prefix cache so far (whole blocks).
    pub prefix_queried_tokens: u64,
    /// Of those, tokens whose KV was found, not computed.
    pub prefix_hit_tokens: u64,
    /// KV connector counters (prefill and decode roles).
    pub kv: Option<ConnectorStats>,
}

/// Why a request could not be submitted.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum SubmitError {
    /// The request is invalid for this engine.
    #[error(transparent)]
    Rejected(#[from] RequestRejected),
    /// The engine thread has stopped; nothing can be submitted.
    #[error("the engine has stopped")]
    EngineStopped,
}

/// A cheap, cloneable way to reach the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    commands: Commands,
    limits: Arc<EngineLimits>,
    stats: Arc<EngineStats>,
    alive: Arc<AtomicBool>,
    kv_info: Option<Arc<AgentInfo>>,
    kv_view: Option<tandem_kv::KvView>,
    prefix: Option<crate::core::PrefixProbe>,
}

/// Starts the engine thread with `model` (a CPU transformer gets a KV cache sized by
/// `config`; a runner brings its own).
pub fn spawn(
    model: impl Into<EngineModel>,
    eos_token_ids: Vec<u32>,
    max_model_len: usize,
    config: EngineConfig,
) -> std::io::Result<EngineHandle> {
    spawn_with(model, eos_token_ids, max_model_len, config, None).map_err(|e| match e {
        KvError::Io(io) => io,
        other => std::io::Error::other(other.to_string()),
    })
}

/// Like [`spawn`], with a KV connector for the prefill or decode role.
pub fn spawn_with(
    model: impl Into<EngineModel>,
    eos_token_ids: Vec<u32>,
    max_model_len: usize,
    config: EngineConfig,
    kv: Option<KvSetup>,
) -> Result<EngineHandle, KvError> {
    let mut core = EngineCore::new(model, eos_token_ids, max_model_len, &config);
    let (tx, rx) = mpsc::channel();
    let commands: Commands = Arc::new(tx);
    let kv_info = match kv {
        Some(setup) => {
            let weak: Weak<mpsc::Sender<Command>> = Arc::downgrade(&commands);
            let sink = Box::new(move |ev| {
                if let Some(tx) = weak.upgrade() {
                    let _ = tx.send(Command::Kv(ev));
                }
            });
            Some(Arc::new(core.attach_connector(setup, sink)?))
        }
        None => None,
    };
    let kv_view = core.kv_view();
    let prefix = core.prefix_probe();
    let limits = Arc::new(core.limits().clone());
    let stats = Arc::new(EngineStats::default());
    stats.free_blocks.store(core.num_free_blocks(), Ordering::Relaxed);
    let alive = Arc::new(AtomicBool::new(true));
    let (s, a) = (stats.clone(), alive.clone());
    std::thread::Builder::new().name("tandem-engine".into()).spawn(move || run_loop(core, rx, s, a))?;
    Ok(EngineHandle { commands, limits, stats, alive, kv_info, kv_view, prefix })
}

/// Marks the engine dead when the loop exits, by return or by panic.
struct AliveGuard(Arc<AtomicBool>);
impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

fn run_loop(mut core: EngineCore, rx: mpsc::Receiver<Command>, stats: Arc<EngineStats>, alive: Arc<AtomicBool>) {
    let _guard = AliveGuard(alive);
    let apply = |core: &mut EngineCore, cmd: Command| match cmd {
        Command::Add(req, events) => {
            let id = req.id.clone();
            if let Err(e) = core.add_request(*req, events.clone()) {
                tracing::warn!(request_id = %id, error = %e, "request refused by the engine");
                stats.rejected.fetch_add(1, Ordering::Relaxed);
                let _ = events.send(EngineEvent::Failed(e.to_string()));
            }
        }
        Command::Abort(id) => {
            if core.abort(&id) {
                tracing::debug!(request_id = %id, "aborted");
            }
        }
        Command::ReleaseKv(transfer_id) => {
            core.release_kv(&transfer_id);
            tracing::debug!(%transfer_id, "KV released");
        }
        Command::Kv(ev) => core.connector_event(ev),
    };
    loop {
        // Drain commands between steps; when idle, wait for one (bounded, so the loop can
        // notice a closed channel even if no command ever arrives).
        loop {
            let cmd = if core.has_runnable() {
                match rx.try_recv() {
                    Ok(c) => c,
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => return,
                }
            } else if core.has_work() {
                // Only remote loads (or quarantined blocks) are pending: their events come on
                // this channel; step again by the earliest KV wait's deadline at the latest.
                match rx.recv_timeout(core.idle_wait(Duration::from_millis(100))) {
                    Ok(c) => c,
                    Err(RecvTimeoutError::Timeout) => break,
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            } else {
                match rx.recv_timeout(Duration::from_millis(100)) {
                    Ok(c) => c,
                    Err(RecvTimeoutError::Timeout) => break,
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            };
            apply(&mut core, cmd);
        }
        if core.has_work() {
            // Count steps that computed something, not the polls made while only remote KV
            // loads are pending.
            if core.step().num_tokens > 0 {
                stats.steps.fetch_add(1, Ordering::Relaxed);
            }
        }
        stats.running.store(core.num_running(), Ordering::Relaxed);
        stats.waiting.store(core.num_waiting(), Ordering::Relaxed);
        stats.free_blocks.store(core.num_free_blocks(), Ordering::Relaxed);
        stats.preemptions.store(core.num_preemptions(), Ordering::Relaxed);
        let (prefix, cached) = core.prefix_cache();
        stats.cached_blocks.store(cached, Ordering::Relaxed);
        stats.prefix_queried_tokens.store(prefix.queried_tokens, Ordering::Relaxed);
        stats.prefix_hit_tokens.store(prefix.hit_tokens, Ordering::Relaxed);
    }
}

impl EngineHandle {
    /// Validates and queues a request. The returned stream yields its events; dropping the
    /// stream before the last event aborts the request.
    pub fn submit(&self, req: EngineRequest) -> Result<RequestStream, SubmitError> {
        self.limits.check(&req)?;
        crate::core::check_role(&req, self.kv_info.as_ref().map(|i| i.role))?;
        let (tx, rx) = unbounded_channel();
        let id = req.id.clone();
        self.commands.send(Command::Add(Box::new(req), tx)).map_err(|_| SubmitError::EngineStopped)?;
        Ok(RequestStream { id, events: rx, commands: self.commands.clone(), done: false })
    }

    /// Asks the engine to end a request (no effect if it already ended).
    pub fn abort(&self, id: RequestId) {
        let _ = self.commands.send(Command::Abort(id));
    }

    /// Prefill: frees the KV produced (or being produced) under `transfer_id` now, because
    /// no decode engine will take it. No effect for an unknown id.
    pub fn release_kv(&self, transfer_id: TransferId) {
        let _ = self.commands.send(Command::ReleaseKv(transfer_id));
    }

    /// The engine's limits, for validating requests.
    pub fn limits(&self) -> &EngineLimits {
        &self.limits
    }

    /// The KV connector's metadata (engine id, epoch, side-channel address), if any.
    pub fn kv_info(&self) -> Option<&AgentInfo> {
        self.kv_info.as_deref()
    }

    /// The KV connector's open connections and the transport of each (empty without one).
    pub fn kv_links(&self) -> Vec<tandem_kv::KvLink> {
        self.kv_view.as_ref().map(tandem_kv::KvView::links).unwrap_or_default()
    }

    /// Whether the engine thread is running.
    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }

    /// Leading tokens of `prompt` whose KV this engine's prefix cache holds now (0 without
    /// prefix caching); a hint for routing.
    pub fn cached_prefix_tokens(&self, prompt: &[u32]) -> usize {
        self.prefix.as_ref().map_or(0, |p| p.cached_tokens(prompt))
    }

    /// Current counters.
    pub fn stats(&self) -> StatsSnapshot {
        let s = &self.stats;
        StatsSnapshot {
            running: s.running.load(Ordering::Relaxed),
            waiting: s.waiting.load(Ordering::Relaxed),
            free_blocks: s.free_blocks.load(Ordering::Relaxed),
            total_blocks: self.limits.num_blocks,
            preemptions: s.preemptions.load(Ordering::Relaxed),
            steps: s.steps.load(Ordering::Relaxed),
            rejected: s.rejected.load(Ordering::Relaxed),
            cached_blocks: s.cached_blocks.load(Ordering::Relaxed),
            prefix_queried_tokens: s.prefix_queried_tokens.load(Ordering::Relaxed),
            prefix_hit_tokens: s.prefix_hit_tokens.load(Ordering::Relaxed),
            kv: self.kv_view.as_ref().map(tandem_kv::KvView::stats),
        }
    }
}

/// One request's events. Dropping it before the final event aborts the request (this is how a
/// client disconnect reaches the engine).
pub struct RequestStream {
    id: RequestId,
    events: UnboundedReceiver<EngineEvent>,
    commands: Commands,
    done: bool,
}

impl RequestStream {
    /// The request's id.
    pub fn id(&self) -> &RequestId {
        &self.id
    }

    fn observe(&mut self, ev: Option<EngineEvent>) -> Option<EngineEvent> {
        match &ev {
            Some(EngineEvent::Tokens { finish: Some(_), .. })
            | Some(EngineEvent::Failed(_))
            | Some(EngineEvent::QueueTimeout { .. })
            | None => self.done = true,
            _ => {}
        }
        ev
    }

    /// The next event; `None` once the engine dropped the request (stopped engine).
    ///
    /// Cancel safety: safe; an event not yet received stays queued.
    pub async fn next(&mut self) -> Option<EngineEvent> {
        let ev = self.events.recv().await;
        self.observe(ev)
    }

    /// The next event, blocking the calling (non-async) thread.
    pub fn blocking_next(&mut self) -> Option<EngineEvent> {
        let ev = self.events.blocking_recv();
        self.observe(ev)
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.commands.send(Command::Abort(self.id.clone()));
        }
    }
}
