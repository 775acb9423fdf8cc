//! What the agent's threads share, once per connector: the transfer table (behind one mutex,
//! never held across socket I/O), the open connections, the counters, and how events reach the
//! engine.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Instant;

use tandem_core::TransferId;

use super::conn::{Conn, DataStreams};
use super::parts::PartsWriter;
use crate::agent_info::AgentInfo;
use crate::config::ConnectorConfig;
use crate::events::{ConnectorEvent, ConnectorStats, EventSink, KvLink};
use crate::memory::KvMemory;
use crate::table::{Incoming, Landing};
use crate::transport::pick::Picker;

/// The transfer table as the agent keeps it: entries name their connection, and a push
/// registration its parts' writer.
pub(crate) type Tables = crate::table::Tables<Arc<Conn>, PartsWriter>;

#[derive(Default)]
pub(crate) struct Counters {
    pub transfers_ok: AtomicU64,
    pub transfers_failed: AtomicU64,
    pub bytes_sent: AtomicU64,
    pub bytes_received: AtomicU64,
    pub regions: AtomicU64,
    pub expired: AtomicU64,
    pub unknown_ids: AtomicU64,
    pub duplicate_ids: AtomicU64,
    pub peers_refused: AtomicU64,
    pub checksum_failures: AtomicU64,
    pub links_tcp: AtomicU64,
    pub links_local: AtomicU64,
    pub links_cuda_ipc: AtomicU64,
    pub links_nixl: AtomicU64,
    pub parts_early: AtomicU64,
    pub groups_landed: AtomicU64,
    pub rank_notices: AtomicU64,
    pub streams_joined: AtomicU64,
    pub auth_refused: AtomicU64,
}

pub(crate) fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

pub(crate) struct Shared {
    pub info: AgentInfo,
    pub cfg: ConnectorConfig,
    /// Kept alive here for the local transport's registry, which holds it weakly.
    pub memory: Arc<KvMemory>,
    pub tables: Mutex<Tables>,
    /// Decode side: the open connection to each prefill address.
    pub peers: Mutex<HashMap<String, Arc<Conn>>>,
    /// One connect at a time per address (decode side).
    pub connecting: Mutex<HashMap<String, Arc<Mutex<()>>>>,
    /// Every connection opened (either direction), for `/kv/info` and the pings.
    pub links: Mutex<Vec<Weak<Conn>>>,
    pub events: EventSink,
    pub counters: Counters,
    /// Picks each connection's transport (and holds the NIXL endpoint).
    pub picker: Picker,
    /// Accepting side: the further streams still to join each tcp connection, by join token.
    pub joining: Mutex<HashMap<u64, Weak<DataStreams>>>,
    /// Fault injection: whether `cut_a_stream` has been handed to a connection already.
    pub cut_a_stream: AtomicBool,
}

impl Shared {
    pub(crate) fn tables(&self) -> MutexGuard<'_, Tables> {
        // Table updates are single inserts/removals; a panicking holder cannot leave them
        // half-done, so a poisoned lock is still consistent.
        self.tables.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The longest a bulk read may wait for its next bytes: the I/O timeout, or the liveness
    /// bound if shorter (a peer frozen mid-write is as dead as one frozen between messages).
    pub(crate) fn bulk_read_bound(&self) -> std::time::Duration {
        self.cfg.timeouts.io.min(self.cfg.liveness)
    }

    /// Tokens per block of this engine's cache.
    pub(crate) fn block_size(&self) -> usize {
        self.memory.layout().block_size
    }

    /// The writes a push over `transport` makes of each part: one per tensor-parallel rank, each
    /// of its own KV heads, where the transport writes per rank and the heads split evenly;
    /// else one of every head.
    pub(crate) fn write_ranks(&self, transport: &dyn crate::transport::Transport) -> usize {
        let ranks = self.cfg.tp_size.max(1) as usize;
        match transport.writes_per_rank() && self.memory.layout().num_kv_heads.is_multiple_of(ranks) {
            true => ranks,
            false => 1,
        }
    }

    pub(crate) fn emit(&self, ev: ConnectorEvent) {
        match &ev {
            ConnectorEvent::Ready { .. } => bump(&self.counters.transfers_ok, 1),
            ConnectorEvent::Failed { request_id, reason } => {
                tracing::warn!(request_id = %request_id, %reason, "KV transfer failed");
                bump(&self.counters.transfers_failed, 1)
            }
            ConnectorEvent::FailedInFlight { request_id, reason, writes_until } => {
                let held_ms = writes_until.saturating_duration_since(Instant::now()).as_millis() as u64;
                tracing::warn!(request_id = %request_id, %reason, held_ms, "KV transfer failed; a direct write may still land, its blocks are held");
                bump(&self.counters.transfers_failed, 1)
            }
            ConnectorEvent::Refused { request_id, reason } => {
                tracing::warn!(request_id = %request_id, %reason, "prefill engine refused: cannot pair");
                bump(&self.counters.transfers_failed, 1)
            }
            ConnectorEvent::Released { .. } => {}
        }
        (self.events)(ev);
    }

    /// Removes a decode-side entry and reports its end.
    pub(crate) fn finish_incoming(
        &self,
        t: &mut Tables,
        tid: &TransferId,
        ev: impl FnOnce(Incoming<Arc<Conn>>) -> ConnectorEvent,
    ) {
        if let Some(inc) = t.remove_incoming(tid) {
            self.emit(ev(inc));
        }
    }

    /// The connections still open, oldest first.
    pub(crate) fn open_links(&self) -> Vec<Arc<Conn>> {
        let links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        links.iter().filter_map(Weak::upgrade).filter(|c| c.is_alive()).collect()
    }

    /// The open connections and their transports.
    pub(crate) fn links(&self) -> Vec<KvLink> {
        self.open_links()
            .iter()
            .map(|c| KvLink {
                peer: c.peer.engine_id.0.clone(),
                transport: c.transport.name().into(),
                note: c.note.clone(),
            })
            .collect()
    }

    /// Push prefill: decode has registered blocks for `tid` (its KV is written as soon as it is
    /// produced, or is being written).
    pub(crate) fn is_registered(&self, tid: &TransferId) -> bool {
        let t = self.tables();
        t.registrations.contains_key(tid) || t.pushing.contains(tid)
    }

    /// Push prefill: blocks held by produced KV that no decode engine has registered for yet.
    pub(crate) fn unclaimed_blocks(&self) -> usize {
        if self.cfg.mode != crate::agent_info::KvMode::Push {
            return 0;
        }
        self.tables().produced.values().map(|p| p.blocks.len()).sum()
    }

    pub(crate) fn stats(&self) -> ConnectorStats {
        let c = &self.counters;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ConnectorStats {
            transfers_ok: g(&c.transfers_ok),
            transfers_failed: g(&c.transfers_failed),
            bytes_sent: g(&c.bytes_sent),
            bytes_received: g(&c.bytes_received),
            regions: g(&c.regions),
            expired: g(&c.expired),
            unknown_ids: g(&c.unknown_ids),
            duplicate_ids: g(&c.duplicate_ids),
            peers_refused: g(&c.peers_refused),
            checksum_failures: g(&c.checksum_failures),
            links_tcp: g(&c.links_tcp),
            links_local: g(&c.links_local),
            links_cuda_ipc: g(&c.links_cuda_ipc),
            links_nixl: g(&c.links_nixl),
            parts_early: g(&c.parts_early),
            groups_landed: g(&c.groups_landed),
            rank_notices: g(&c.rank_notices),
            streams_joined: g(&c.streams_joined),
            auth_refused: g(&c.auth_refused),
        }
    }

    /// A direct writer under `--kv-verify`: the digest of the KV it copies, tokens
    /// `0..num_tokens` of its `blocks` (`None` without the flag).
    pub(crate) fn source_digest(&self, blocks: &[u32], num_tokens: usize) -> Result<Option<u64>, String> {
        if !self.cfg.verify {
            return Ok(None);
        }
        // Safety: the connector holds the blocks (produced KV, or a lease being read).
        unsafe { self.memory.digest(blocks, num_tokens) }.map(Some).map_err(|e| e.to_string())
    }
}

/// How a decode-side transfer that will get no (more) data ends: `Released` if the engine
/// aborted it (its blocks come back), else `Failed` with `reason`.
pub(crate) fn ended<L>(inc: Incoming<L>, reason: String) -> ConnectorEvent {
    if inc.landing == Landing::WritingAborted {
        ConnectorEvent::Released { request_id: inc.request_id }
    } else {
        ConnectorEvent::Failed { request_id: inc.request_id, reason }
    }
}
