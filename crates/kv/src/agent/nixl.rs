//! The `nixl` transport (`--kv-transport nixl`). Push: prefill (the writer) puts a transfer's
//! KV straight into decode's registered KV memory with NIXL WRITEs, one descriptor per
//! contiguous copy of the copy plan (a run of blocks with equal block sizes), and a NIXL
//! notification naming the transfer after the data; then `Done` on the side channel says the
//! write ended, and decode counts its blocks landed only once it also has the notification.
//! Pull: decode READs prefill's blocks itself. Its `ReadBlocks` asks as for any direct
//! transport; prefill's `BlockData` grants the read (with the `--kv-verify` digest), keeping
//! the lease at least the I/O timeout or the lease time, whichever is shorter, from then, and
//! saying how long (`grant_us`); decode's READ must end within that of asking, so it never
//! reads blocks a lease no longer holds.
//!
//! So far for engines whose KV cache is host memory (CPU engines); a GPU engine's VRAM
//! registration is issue 31's next step, and such an engine is refused at start, saying so.
//! Without the `nixl` feature the flag fails at start, saying how to build it.

use std::sync::Arc;

use tandem_core::TransferId;

use crate::{AgentInfo, TransportOffer};

#[cfg(feature = "nixl")]
pub(super) use with_nixl::*;
#[cfg(not(feature = "nixl"))]
pub(super) use without_nixl::*;

/// This engine's NIXL endpoint, when `--kv-transport nixl` asked for one.
pub(super) type Endpoint = Option<Arc<EndpointImpl>>;

/// The nixl offer of `endpoint`, for the handshake.
pub(super) fn offer(endpoint: &Endpoint) -> Option<TransportOffer> {
    endpoint.as_ref().map(|e| e.offer())
}

/// The peer's nixl offer, or why it has none.
#[cfg_attr(not(feature = "nixl"), allow(dead_code))]
fn peer_offer(peer: &AgentInfo) -> Result<PeerOffer<'_>, String> {
    peer.transports
        .iter()
        .find_map(|t| match t {
            TransportOffer::Nixl { agent, metadata, addr, bytes, scratch_addr, scratch_bytes } => {
                Some(PeerOffer { agent, metadata, kv: (*addr, *bytes), scratch: (*scratch_addr, *scratch_bytes) })
            }
            _ => None,
        })
        .ok_or_else(|| "the peer offers no nixl (--kv-transport nixl there too)".to_string())
}

/// A peer's nixl offer.
#[cfg_attr(not(feature = "nixl"), allow(dead_code))]
struct PeerOffer<'a> {
    agent: &'a str,
    metadata: &'a str,
    /// Its KV memory: address and bytes.
    kv: (u64, u64),
    /// Its probe scratch: address and bytes.
    scratch: (u64, u64),
}

/// The NIXL message that says transfer `tid` has landed.
#[cfg_attr(not(feature = "nixl"), allow(dead_code))]
fn landed_message(tid: &TransferId) -> Vec<u8> {
    format!("tandem-kv:{}", tid.0).into_bytes()
}

#[cfg(feature = "nixl")]
mod with_nixl {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use tandem_compute::cuda::KvFences;
    use tandem_compute::kv_copy::{plan_kv_copy, KvCopy};
    use tandem_compute::KvLayout;
    use tandem_core::TransferId;

    use super::super::push::PushDone;
    use super::super::transport::{answer_direct_read, report_direct_write, Transport};
    use super::super::{Conn, Shared};
    use super::{landed_message, peer_offer};
    use crate::nixl::{NixlEndpoint, NixlFailure, NixlPlace, NixlRegion, NixlRun};
    use crate::{AgentInfo, ConnectorConfig, KvError, KvMemory, TransportOffer};

    /// This engine's NIXL agent and the name peers know it by.
    pub(in super::super) struct EndpointImpl {
        endpoint: NixlEndpoint,
        name: String,
        /// Our agent metadata, hex (read once: it covers every registration).
        metadata: String,
    }

    impl EndpointImpl {
        pub(super) fn offer(&self) -> TransportOffer {
            let (region, scratch) = (self.endpoint.region(), self.endpoint.scratch());
            TransportOffer::Nixl {
                agent: self.name.clone(),
                metadata: self.metadata.clone(),
                addr: region.addr as u64,
                bytes: region.len as u64,
                scratch_addr: scratch.addr as u64,
                scratch_bytes: scratch.len as u64,
            }
        }
    }

    /// Opens this engine's NIXL endpoint over its KV memory when `cfg` asks for nixl.
    pub(in super::super) fn open(
        cfg: &ConnectorConfig,
        memory: &KvMemory,
        epoch: u64,
    ) -> Result<super::Endpoint, KvError> {
        if cfg.transport != crate::KvTransport::Nixl {
            return Ok(None);
        }
        if memory.device_cache().is_some() {
            return Err(KvError::Unsupported(
                "--kv-transport nixl works with engines whose KV cache is in host memory (CPU engines) so far; \
                 registering a GPU cache with NIXL is not built yet"
                    .into(),
            ));
        }
        let (addr, len) = memory.host_region()?.address_range();
        let name = format!("{}@{epoch}", cfg.engine_id);
        let region = NixlRegion { addr, len, place: NixlPlace::Dram };
        let endpoint =
            NixlEndpoint::open(&name, region).map_err(|e| KvError::Unsupported(format!("--kv-transport nixl: {e}")))?;
        let metadata =
            endpoint.metadata_hex().map_err(|e| KvError::Unsupported(format!("--kv-transport nixl: {e}")))?;
        tracing::info!(agent = %name, bytes = len, "NIXL agent ready (UCX backend), KV memory registered");
        Ok(Some(Arc::new(EndpointImpl { endpoint, name, metadata })))
    }

    /// Writing side: the nixl transport to `peer`, with its metadata loaded, or why not.
    pub(in super::super) fn pick(ours: &Shared, peer: &AgentInfo) -> Result<Arc<dyn Transport>, String> {
        let ep = ours.nixl.clone().ok_or("this engine has no NIXL endpoint")?;
        let offer = peer_offer(peer)?;
        let agent = offer.agent;
        let loaded = ep.endpoint.add_peer_hex(offer.metadata).map_err(|e| e.to_string())?;
        if loaded != agent {
            return Err(format!("the peer's NIXL metadata names agent `{loaded}`, its offer `{agent}`"));
        }
        // The self-check: what this link moves, before any KV does.
        let dram =
            |(addr, len): (u64, u64)| NixlRegion { addr: addr as usize, len: len as usize, place: NixlPlace::Dram };
        let gb_s = ep.endpoint.probe(agent, dram(offer.scratch), ours.cfg.timeouts.io).map_err(|e| e.to_string())?;
        let floor = ours.cfg.nixl_min_gb_s;
        if gb_s < floor {
            return Err(format!(
                "a {} MiB NIXL write to it ran at {gb_s:.2} GB/s, below --kv-nixl-min-gb-s {floor}: UCX may have \
                 fallen back to a software path (UCX_LOG_LEVEL=info shows the transports it picked; UCX_TLS \
                 chooses them)",
                crate::nixl::PROBE_BYTES >> 20
            ));
        }
        tracing::info!(peer = %peer.engine_id, gb_s = format!("{gb_s:.2}"), "nixl link probed");
        Ok(Arc::new(Nixl::new(ep, agent, dram(offer.kv), peer)))
    }

    /// The decode side: the nixl transport the acceptor picked, with the acceptor's metadata
    /// loaded too, since in pull decode READs prefill's blocks itself.
    pub(in super::super) fn accept(ours: &Shared, peer: &AgentInfo) -> Result<Arc<dyn Transport>, KvError> {
        let ep = ours.nixl.clone().ok_or_else(|| KvError::Refused("this engine has no NIXL endpoint".into()))?;
        let offer = peer_offer(peer).map_err(KvError::Refused)?;
        let loaded = ep.endpoint.add_peer_hex(offer.metadata).map_err(|e| KvError::Refused(e.to_string()))?;
        if loaded != offer.agent {
            return Err(KvError::Refused(format!(
                "the peer's NIXL metadata names `{loaded}`, its offer `{}`",
                offer.agent
            )));
        }
        let region = NixlRegion { addr: offer.kv.0 as usize, len: offer.kv.1 as usize, place: NixlPlace::Dram };
        Ok(Arc::new(Nixl::new(ep, offer.agent, region, peer)))
    }

    struct Nixl {
        ep: Arc<EndpointImpl>,
        /// The peer's agent name (whom notifications come from, or go to).
        peer_agent: String,
        /// The peer's KV memory and layout.
        target: (NixlRegion, KvLayout),
        /// Decode, pull: the READs asked for, by transfer, until prefill grants them.
        reads: Mutex<HashMap<TransferId, ReadPlan>>,
    }

    /// A pull read decode will make once prefill grants it (see [`Transport::plan_read`]).
    struct ReadPlan {
        /// Prefill's blocks, from the first one decode does not hold.
        src: Vec<u32>,
        /// Ours, the same.
        dst: Vec<u32>,
        num_tokens: usize,
        /// When decode asked (before `ReadBlocks` left): prefill's grant came after this.
        asked: Instant,
        /// How long prefill keeps the lease from its grant (zero until granted).
        validity: Duration,
    }

    impl Nixl {
        fn new(ep: Arc<EndpointImpl>, agent: &str, region: NixlRegion, peer: &AgentInfo) -> Self {
            let layout = KvLayout {
                num_layers: peer.num_layers,
                num_kv_heads: peer.num_kv_heads,
                head_dim: peer.head_dim,
                block_size: peer.block_size,
                num_blocks: peer.num_blocks,
            };
            Self { ep, peer_agent: agent.to_string(), target: (region, layout), reads: Mutex::default() }
        }

        /// Decode, pull: READs the planned transfer `tid` from prefill's blocks into ours,
        /// finished before the lease prefill granted could end.
        fn read(&self, shared: &Shared, plan: ReadPlan) -> Result<(), String> {
            let (region, layout) = &self.target;
            let ours = shared.memory.host_region().map_err(|e| e.to_string())?;
            let copies =
                plan_kv_copy(layout, ours.layout(), ours.dtype().bytes(), &plan.src, &plan.dst, plan.num_tokens)?;
            // The plan's source is prefill's memory (the peer), its destination ours.
            let runs: Vec<NixlRun> = runs_of(&copies)
                .into_iter()
                .map(|r| NixlRun { local_offset: r.peer_offset, peer_offset: r.local_offset, len: r.len })
                .collect();
            // Prefill holds the lease `validity` from its grant, which it sent after we asked.
            let safe_until = plan.asked + plan.validity;
            let bound = safe_until.saturating_duration_since(Instant::now());
            self.ep.endpoint.read(&self.peer_agent, *region, &runs, bound).map_err(|e| e.to_string())?;
            if Instant::now() > safe_until {
                return Err("the NIXL read ended after the lease prefill granted for it could have".into());
            }
            Ok(())
        }

        /// Writes tokens `0..num_tokens` of our blocks `src` into the peer's `dst`, then (given
        /// `tid`) the notification that says they landed.
        fn write(
            &self,
            shared: &Shared,
            src: &[u32],
            dst: &[u32],
            num_tokens: usize,
            tid: Option<&TransferId>,
        ) -> Result<(), String> {
            let (region, layout) = &self.target;
            let from = shared.memory.host_region().map_err(|e| e.to_string())?;
            // Validates the peer's block list (ids inside its region, enough of them) first.
            let plan = plan_kv_copy(from.layout(), layout, from.dtype().bytes(), src, dst, num_tokens)?;
            let runs = runs_of(&plan);
            let message = tid.filter(|_| !shared.cfg.faults.drop_nixl_notification).map(landed_message);
            let started = std::time::Instant::now();
            let bound = shared.cfg.timeouts.io;
            match self.ep.endpoint.write(&self.peer_agent, *region, &runs, message.as_deref(), bound) {
                Ok(()) => {
                    tracing::debug!(runs = runs.len(), us = started.elapsed().as_micros() as u64, "nixl write done");
                    Ok(())
                }
                Err(e @ NixlFailure::Timeout { .. }) => {
                    // The failure we report says the write ended, and the reader frees its
                    // blocks on it: give NIXL one more bound to end the overdue write first
                    // (a write stuck past that is the window docs/NIXL.md names).
                    let until = std::time::Instant::now() + bound;
                    while self.ep.endpoint.overdue_writes() > 0 && std::time::Instant::now() < until {
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    }
                    Err(e.to_string())
                }
                Err(e) => Err(e.to_string()),
            }
        }
    }

    /// A copy plan as NIXL runs: `local_offset` the plan's source, `peer_offset` its destination.
    fn runs_of(plan: &[KvCopy]) -> Vec<NixlRun> {
        let mut runs = Vec::with_capacity(plan.len());
        for copy in plan {
            match *copy {
                KvCopy::Linear { src, dst, bytes } => {
                    runs.push(NixlRun { local_offset: src, peer_offset: dst, len: bytes })
                }
                KvCopy::Pitched { src, src_pitch, dst, dst_pitch, width, rows } => runs.extend((0..rows).map(|r| {
                    NixlRun { local_offset: src + r * src_pitch, peer_offset: dst + r * dst_pitch, len: width }
                })),
            }
        }
        runs
    }

    impl Transport for Nixl {
        fn name(&self) -> &'static str {
            "nixl"
        }

        fn writes_directly(&self) -> bool {
            true
        }

        fn write_part(
            &self,
            shared: &Shared,
            src: &[u32],
            dst: &[u32],
            num_tokens: usize,
            fences: &KvFences,
        ) -> Result<(), String> {
            fences.wait()?;
            // No notification: the final write's, after this one has completed, covers it.
            self.write(shared, src, dst, num_tokens, None)
        }

        fn push(
            &self,
            shared: &Shared,
            conn: &Conn,
            tid: &TransferId,
            src: &[u32],
            dst: &[u32],
            num_tokens: usize,
            done: PushDone,
        ) -> Result<(), KvError> {
            report_direct_write(shared, conn, tid, done, self.write(shared, src, dst, num_tokens, Some(tid)))
        }

        fn answer_read(
            &self,
            shared: &Shared,
            conn: &Conn,
            tid: &TransferId,
            src: &[u32],
            _dst: &[u32],
            num_tokens: usize,
        ) -> Result<(), KvError> {
            // Decode READs the blocks itself: the answer grants it, keeping the lease at least
            // `validity` from now, within which decode's READ must end, counted from before it
            // asked (`ReadPlan::asked`). Decode's own copy plan checks its blocks.
            let validity = shared.cfg.timeouts.io.min(shared.cfg.lease);
            if let Some(p) = shared.tables().produced.get_mut(tid) {
                p.deadline = p.deadline.max(Instant::now() + validity);
            }
            let grant_us = validity.as_micros() as u64;
            answer_direct_read(shared, conn, tid, Instant::now(), (src, num_tokens), Ok(()), grant_us)
        }

        fn granted(&self, tid: &TransferId, validity: Duration) {
            if let Some(plan) = self.reads.lock().unwrap_or_else(|p| p.into_inner()).get_mut(tid) {
                plan.validity = validity;
            }
        }

        fn reader_reads(&self) -> bool {
            true
        }

        fn plan_read(&self, tid: &TransferId, src: Vec<u32>, dst: Vec<u32>, num_tokens: usize) {
            let mut reads = self.reads.lock().unwrap_or_else(|p| p.into_inner());
            // A read asked for and never granted (aborted, refused) is over after its bound.
            reads.retain(|_, r| r.asked.elapsed() < Duration::from_secs(600));
            let plan = ReadPlan { src, dst, num_tokens, asked: Instant::now(), validity: Duration::ZERO };
            reads.insert(tid.clone(), plan);
        }

        fn confirm_landed(&self, shared: &Shared, tid: &TransferId) -> Result<(), String> {
            // Pull: prefill granted the read; the bytes are ours once our READ has completed.
            let planned = self.reads.lock().unwrap_or_else(|p| p.into_inner()).remove(tid);
            if let Some(plan) = planned {
                return self.read(shared, plan);
            }
            // Push: prefill's write ended; its notification follows the data.
            self.ep
                .endpoint
                .wait_notification(&self.peer_agent, &landed_message(tid), shared.cfg.timeouts.io)
                .map_err(|e| e.to_string())
        }
    }
}

#[cfg(not(feature = "nixl"))]
mod without_nixl {
    use std::sync::Arc;

    use super::super::transport::Transport;
    use super::super::Shared;
    use crate::{AgentInfo, ConnectorConfig, KvError, KvMemory, TransportOffer};

    /// No NIXL in this build: never made.
    pub(in super::super) enum EndpointImpl {}

    impl EndpointImpl {
        pub(super) fn offer(&self) -> TransportOffer {
            match *self {}
        }
    }

    pub(in super::super) fn open(cfg: &ConnectorConfig, _: &KvMemory, _: u64) -> Result<super::Endpoint, KvError> {
        match cfg.transport {
            crate::KvTransport::Nixl => Err(KvError::Unsupported(
                "--kv-transport nixl: this build has no NIXL (build tandem with `--features nixl`)".into(),
            )),
            _ => Ok(None),
        }
    }

    pub(in super::super) fn pick(_: &Shared, _: &AgentInfo) -> Result<Arc<dyn Transport>, String> {
        Err("this build has no NIXL".into())
    }

    pub(in super::super) fn accept(_: &Shared, _: &AgentInfo) -> Result<Arc<dyn Transport>, KvError> {
        Err(KvError::Refused("this build has no NIXL".into()))
    }
}
