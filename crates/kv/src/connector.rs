//! The engine's handle on the KV connector: what the engine may ask, and what it hears back.
//!
//! Hooks (engine -> connector), each of which only enqueues and returns at once:
//! - [`KvConnector::expect`] (decode, at allocation time): the request's blocks are allocated;
//!   fetch its KV into them (push: register them with prefill; pull: read prefill's blocks).
//! - [`KvConnector::produced`] (prefill, when a remote-decode request finishes): ownership of
//!   its blocks passes to the connector, which frees them after the push write, or when the
//!   pull lease ends (decode's release, or expiry).
//! - [`KvConnector::abort`] (decode, request cancelled while waiting for KV).
//! - [`KvConnector::abandon`] (prefill, request cancelled before it produced KV, or produced
//!   KV no decode engine will take: the router saw the decode leg fail).
//!
//! Events (connector -> engine), drained by [`KvConnector::poll`] once per engine step:
//! - `Ready`: the KV landed; the request can decode (its first token is included).
//! - `Failed`: the KV will not come, and no write to the request's blocks can land any more.
//! - `Released`: an abort is complete; the request's blocks may be freed.
//! - `Refused`: the prefill engine cannot pair with this one (another model, mode or KV
//!   shape): a misconfiguration, which recomputing locally would hide.
//!
//! Timing rule: for a request given to `expect`, exactly one of `Ready`, `Failed`, `Refused`
//! or `Released` is eventually sent, within the configured transfer timeout (plus one I/O
//! timeout if a write was in flight). Until then its blocks belong to the connector.

use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use tandem_compute::KvRegion;
use tandem_core::{EngineId, RemoteKv, RequestId, TransferId};

use crate::agent::{self, Command};
use crate::tcp::Timeouts;
use crate::{AgentInfo, KvError, KvMode, Role};

/// Blocks handed to the connector: dropping the box returns them to the engine's pool.
pub type HeldBlocks = Box<dyn Send>;

/// Fault injection for tests of the failure paths (off in production).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FaultInjection {
    /// Prefill sends push data but never the completion notification.
    pub drop_done: bool,
}

/// How the connector is set up.
#[derive(Clone, Debug)]
pub struct ConnectorConfig {
    /// This engine's id.
    pub engine_id: EngineId,
    /// Prefill or decode.
    pub role: Role,
    /// Push or pull.
    pub mode: KvMode,
    /// Where the side channel listens, `host:port` (port 0 picks one).
    pub listen: String,
    /// Host peers should connect to (what the router advertises).
    pub advertise_host: String,
    /// Identifies the model's weights; peers with another fingerprint are refused.
    pub model_fingerprint: String,
    /// Socket timeouts.
    pub timeouts: Timeouts,
    /// Pull: how long prefill holds a finished request's blocks without a heartbeat.
    pub lease: Duration,
    /// Decode: longest wait for a request's KV. Push prefill: longest wait for a registration.
    pub transfer_timeout: Duration,
    /// Test-only failure switches.
    pub faults: FaultInjection,
    /// Offer (and use, when the peer offers it too) direct copies between engines of this
    /// process instead of TCP bytes.
    pub local_transport: bool,
}

/// What the connector tells the engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConnectorEvent {
    /// The request's KV is in its blocks.
    Ready {
        /// The request.
        request_id: RequestId,
        /// The first token prefill sampled.
        first_token: Option<u32>,
        /// When each stage happened.
        timeline: TransferTimeline,
    },
    /// The KV will not come; no write to the request's blocks can land any more.
    Failed {
        /// The request.
        request_id: RequestId,
        /// Why.
        reason: String,
    },
    /// The abort is complete; the request's blocks may be freed.
    Released {
        /// The request.
        request_id: RequestId,
    },
    /// The prefill engine refused to pair at handshake (or we refused it); nothing was written.
    Refused {
        /// The request.
        request_id: RequestId,
        /// What differs, naming the field.
        reason: String,
    },
}

/// One decode-side transfer, stage by stage, in microseconds since the engine asked for the
/// KV (`expect`). In push mode prefill starts writing as soon as its prompt is done (decode
/// registered earlier), so `data_start_us` is also when prefill finished, on decode's clock.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TransferTimeline {
    /// Registration (push) or read request (pull) sent to prefill.
    pub request_sent_us: u64,
    /// First KV bytes arrived.
    pub data_start_us: u64,
    /// All KV bytes in place.
    pub data_end_us: u64,
    /// Completion seen; the request can decode.
    pub ready_us: u64,
    /// KV bytes moved.
    pub bytes: u64,
    /// Contiguous block regions written.
    pub regions: u32,
}

/// Counters for `/metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConnectorStats {
    /// Transfers completed (either side).
    pub transfers_ok: u64,
    /// Transfers failed (either side).
    pub transfers_failed: u64,
    /// Bulk bytes sent.
    pub bytes_sent: u64,
    /// Bulk bytes received.
    pub bytes_received: u64,
    /// Contiguous block regions moved.
    pub regions: u64,
    /// Leases (pull) or registrations/produced KV (push) that expired and were reclaimed.
    pub expired: u64,
    /// Messages naming a transfer this engine does not know (late, finished or bogus).
    pub unknown_ids: u64,
    /// Transfer ids seen twice.
    pub duplicate_ids: u64,
    /// Handshakes refused (either side): peers of another model, mode or KV shape.
    pub peers_refused: u64,
}

/// The engine's handle. Dropping it stops the control thread (connections close with it).
pub struct KvConnector {
    commands: mpsc::Sender<Command>,
    events: mpsc::Receiver<ConnectorEvent>,
    info: AgentInfo,
    shared: Arc<agent::Shared>,
}

impl KvConnector {
    /// Binds the side channel and starts the agent's threads over the engine's KV memory.
    pub fn start(cfg: ConnectorConfig, region: Arc<KvRegion>) -> Result<Self, KvError> {
        let (commands, events, info, shared) = agent::start(cfg, region)?;
        Ok(Self { commands, events, info, shared })
    }

    /// This engine's metadata (as sent at handshake), including the bound address.
    pub fn info(&self) -> &AgentInfo {
        &self.info
    }

    /// Decode: fetch the KV for `request_id` into `blocks` (already allocated, in token order).
    pub fn expect(&self, request_id: RequestId, source: RemoteKv, blocks: Vec<u32>, num_tokens: usize) {
        let _ = self.commands.send(Command::Expect { request_id, source, blocks, num_tokens });
    }

    /// Prefill: a remote-decode request finished; its blocks now belong to the connector.
    pub fn produced(
        &self,
        transfer_id: TransferId,
        held: HeldBlocks,
        blocks: Vec<u32>,
        num_tokens: usize,
        first_token: u32,
    ) {
        // Recorded before this returns (a table insert, no I/O), so a decode engine that learns of
        // the KV from the response that follows finds it here.
        agent::produced(&self.shared, transfer_id, held, blocks, num_tokens, first_token);
    }

    /// Decode: the request was cancelled while waiting for its KV.
    pub fn abort(&self, request_id: RequestId) {
        let _ = self.commands.send(Command::Abort { request_id });
    }

    /// Prefill: a remote-decode request ended before producing KV, or its KV will not be
    /// taken; frees what is held under `transfer_id` and tells a registered decoder.
    pub fn abandon(&self, transfer_id: TransferId, reason: String) {
        let _ = self.commands.send(Command::Abandon { transfer_id, reason });
    }

    /// Events since the last poll (never blocks).
    pub fn poll(&self) -> Vec<ConnectorEvent> {
        self.events.try_iter().collect()
    }

    /// Counters so far.
    pub fn stats(&self) -> ConnectorStats {
        self.shared.stats()
    }
}
