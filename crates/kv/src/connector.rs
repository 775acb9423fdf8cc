//! The engine's handle on the KV connector: what the engine may ask, and what it hears back.
//!
//! Hooks (engine -> connector), each of which only enqueues and returns at once:
//! - [`KvConnector::expect`] (decode, at allocation time): the request's blocks are allocated;
//!   fetch its KV into them (push: register them with prefill; pull: read prefill's blocks).
//! - [`KvConnector::produced`] (prefill, when a remote-decode request finishes): ownership of
//!   its blocks passes to the connector, which frees them after the push write, or when the
//!   pull lease ends (decode's release, or expiry).
//! - [`KvConnector::computed`] (prefill, after each step of a remote-decode prompt that does
//!   not finish it): the KV so far; a push writes its whole shared runs at once.
//! - [`KvConnector::abort`] (decode, request cancelled while waiting for KV).
//! - [`KvConnector::abandon`] (prefill, request cancelled before it produced KV, or produced
//!   KV no decode engine will take: the router saw the decode leg fail).
//!
//! Events (connector -> engine), delivered to the engine's [`EventSink`] as they happen (the
//! engine applies them at one fixed point of its step):
//! - `Ready`: the KV landed; the request can decode (its first token is included).
//! - `Failed`: the KV will not come, and no write to the request's blocks can land any more.
//! - `Released`: an abort is complete; the request's blocks may be freed.
//! - `Refused`: the prefill engine cannot pair with this one (another model, mode or KV
//!   shape): a misconfiguration, which recomputing locally would hide.
//!
//! Timing rule: for a request given to `expect`, exactly one of `Ready`, `Failed`, `Refused`
//! or `Released` is eventually sent, within the configured transfer timeout (plus one I/O
//! timeout if a write was in flight). Until then its blocks belong to the connector.
//!
//! Layer: the top of the crate. Owns the engine's handle; calls `agent` (start, commands, the
//! shared state's lookups) and takes the ground floor's types (config, events, memory, errors).

use std::sync::mpsc;
use std::sync::Arc;

use tandem_compute::cuda::KvFences;
use tandem_core::{RemoteKv, RequestId, TransferId};

use crate::agent::{self, Command};
use crate::agent_info::AgentInfo;
use crate::config::ConnectorConfig;
use crate::error::KvError;
use crate::events::{ConnectorStats, EventSink, HeldBlocks, KvLink};
use crate::memory::KvMemory;

/// The engine's handle. Dropping it stops the control thread (connections close with it).
pub struct KvConnector {
    commands: mpsc::Sender<Command>,
    info: AgentInfo,
    shared: Arc<agent::Shared>,
}

impl KvConnector {
    /// Binds the side channel and starts the agent's threads over the engine's KV memory (a
    /// host region, or a GPU engine's device cache with or without a host copy); events go to
    /// `sink`.
    pub fn start(cfg: ConnectorConfig, memory: impl Into<KvMemory>, sink: EventSink) -> Result<Self, KvError> {
        let (commands, info, shared) = agent::start(cfg, memory.into(), sink)?;
        Ok(Self { commands, info, shared })
    }

    /// This engine's metadata (as sent at handshake), including the bound address.
    pub fn info(&self) -> &AgentInfo {
        &self.info
    }

    /// Decode: fetch the KV for `request_id`'s `num_tokens` prompt tokens into `blocks`
    /// (already allocated, in token order), all but the first `cached_tokens`, whose KV the
    /// blocks hold already (a whole number of [`KvConnector::transfer_alignment`] runs).
    pub fn expect(
        &self,
        request_id: RequestId,
        source: RemoteKv,
        blocks: Vec<u32>,
        num_tokens: usize,
        cached_tokens: usize,
    ) {
        let _ = self.commands.send(Command::Expect { request_id, source, blocks, num_tokens, cached_tokens });
    }

    /// Decode: what a cached prefix that a transfer from the prefill engine at `peer` skips
    /// must be a whole number of (tokens that are whole blocks on both engines), if this engine
    /// is connected to it now; `None` otherwise (then nothing can be skipped). A table lookup.
    pub fn transfer_alignment(&self, peer: &str) -> Option<usize> {
        agent::transfer_alignment(&self.shared, peer)
    }

    /// Prefill: a step of a remote-decode prompt computes its KV up to `num_tokens` into
    /// `blocks` (the request's table), final once `fences` say so ([`KvFences::complete`]: the
    /// step is done), and no later step writes those tokens. `attempt` counts the request's
    /// preemptions so far: KV reported under an earlier attempt is written again. With push the
    /// whole blocks of it go into decode's blocks while the rest of the prompt computes (over a
    /// direct transport, fenced, while the rest of this step does too; over tcp once the step is
    /// done).
    pub fn computed(
        &self,
        transfer_id: TransferId,
        blocks: Vec<u32>,
        num_tokens: usize,
        attempt: u32,
        fences: KvFences,
    ) {
        let _ = self.commands.send(Command::Computed { transfer_id, blocks, num_tokens, attempt, fences });
    }

    /// Prefill: a remote-decode request finished; its blocks now belong to the connector.
    /// `attempt` as for [`KvConnector::computed`].
    pub fn produced(
        &self,
        transfer_id: TransferId,
        held: HeldBlocks,
        blocks: Vec<u32>,
        num_tokens: usize,
        first_token: u32,
        attempt: u32,
    ) {
        // Recorded before this returns (a table insert, no I/O), so a decode engine that learns of
        // the KV from the response that follows finds it here.
        agent::produced(&self.shared, transfer_id, held, blocks, num_tokens, first_token, attempt);
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

    /// Push prefill: whether decode has registered its blocks for `transfer_id` (so the KV is
    /// written the moment it is produced). A table lookup, for the engine's scheduler.
    pub fn is_registered(&self, transfer_id: &TransferId) -> bool {
        self.shared.is_registered(transfer_id)
    }

    /// Push prefill: blocks the connector holds for produced KV that no decode engine has
    /// registered for yet (0 in pull mode). A table lookup, for the engine's scheduler.
    pub fn unclaimed_blocks(&self) -> usize {
        self.shared.unclaimed_blocks()
    }

    /// Counters so far.
    pub fn stats(&self) -> ConnectorStats {
        self.shared.stats()
    }

    /// A read-only view of the connector for other threads: its open connections and counters.
    pub fn view(&self) -> KvView {
        KvView(self.shared.clone())
    }
}

/// Reads a connector's state from any thread (see [`KvConnector::view`]). Counters read here
/// are current: a refusal is counted before the request that met it fails, so a client that
/// sees the failure and then reads the counters sees it counted.
#[derive(Clone)]
pub struct KvView(Arc<agent::Shared>);

impl KvView {
    /// The open connections, oldest first.
    pub fn links(&self) -> Vec<KvLink> {
        self.0.links()
    }

    /// The connector's counters now.
    pub fn stats(&self) -> ConnectorStats {
        self.0.stats()
    }
}
