//! The `nixl` transport (`--kv-transport nixl`). Push: prefill (the writer) puts a transfer's
//! KV straight into decode's registered KV memory with NIXL WRITEs, one descriptor per
//! contiguous copy of the copy plan (a run of blocks with equal block sizes), and a NIXL
//! notification naming the transfer after the data; then `Done` on the side channel says the
//! write ended, and decode counts its blocks landed only once it also has the notification.
//! Pull: decode READs prefill's blocks itself. Its `ReadBlocks` asks as for any direct
//! transport; prefill's `BlockData` grants the read (with the `--kv-verify` digest), keeping
//! the lease at least the I/O timeout or the lease time, whichever is shorter, from then, and
//! saying how long (`grant_us`); decode's READ must end within that of asking, so it never
//! reads blocks a lease no longer holds. Where READs are slow (prefill's probe READ at handshake
//! below `--kv-nixl-min-gb-s`, or `--kv-nixl-pull write`), prefill WRITEs a pull's blocks with a
//! notification instead and grants no READ; decode then waits for the notification.
//!
//! A CPU engine registers its host KV memory; a GPU engine its device cache (VRAM, the one
//! `cuMemAlloc` allocation cuda-ipc exports too: UCX cannot map stream-ordered pool memory),
//! with a probe scratch on the same GPU, so the handshake's probe takes the KV's path. Every
//! NIXL call on a GPU engine's memory runs with its CUDA context current on the calling
//! thread. Without the `nixl` feature the flag fails at start, saying how to build it.

use std::sync::Arc;

use tandem_core::TransferId;

use crate::agent_info::{AgentInfo, TransportOffer};
use crate::config::NixlPull;

#[cfg(feature = "nixl")]
pub(crate) use with_nixl::*;
#[cfg(not(feature = "nixl"))]
pub(crate) use without_nixl::*;

/// This engine's NIXL endpoint, when `--kv-transport nixl` asked for one.
pub(crate) type Endpoint = Option<Arc<EndpointImpl>>;

/// This engine's NIXL endpoint and the rules its links follow.
#[cfg_attr(not(feature = "nixl"), allow(dead_code))]
pub(crate) struct NixlSetup {
    pub endpoint: Endpoint,
    /// `--kv-nixl-min-gb-s`: the probe's floor.
    pub min_gb_s: f64,
    /// `--kv-nixl-pull`.
    pub pull: NixlPull,
    /// This engine answers pulls (a prefill engine in pull mode): its links probe a READ.
    pub answers_pulls: bool,
}

impl NixlSetup {
    /// Relays what UCX has logged since the last look (its warnings, through tracing).
    pub(crate) fn relay_ucx_log(&self) {
        if let Some(e) = &self.endpoint {
            e.relay_ucx_log();
        }
    }

    /// The nixl offer of the endpoint, for the handshake.
    pub(crate) fn offer(&self) -> Option<TransportOffer> {
        self.endpoint.as_ref().map(|e| e.offer())
    }
}

/// The peer's nixl offer, or why it has none.
#[cfg_attr(not(feature = "nixl"), allow(dead_code))]
fn peer_offer(peer: &AgentInfo) -> Result<PeerOffer<'_>, String> {
    peer.transports
        .iter()
        .find_map(|t| match t {
            TransportOffer::Nixl { agent, metadata, addr, bytes, scratch_addr, scratch_bytes, gpu } => {
                Some(PeerOffer {
                    agent,
                    metadata,
                    kv: (*addr, *bytes),
                    scratch: (*scratch_addr, *scratch_bytes),
                    gpu: *gpu,
                })
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
    /// The GPU (its ordinal there) holding both, if not host memory.
    gpu: Option<u32>,
}

/// The NIXL message that says transfer `tid` has landed.
#[cfg_attr(not(feature = "nixl"), allow(dead_code))]
fn landed_message(tid: &TransferId) -> Vec<u8> {
    format!("tandem-kv:{}", tid.0).into_bytes()
}

#[cfg(feature = "nixl")]
mod with_nixl {
    use std::collections::HashMap;
    use std::ops::Range;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use tandem_compute::cuda::KvFences;
    use tandem_compute::kv_copy::{plan_kv_copy, plan_kv_copy_layers};
    use tandem_compute::KvLayout;
    use tandem_core::TransferId;

    use super::super::{peer_layout, Announce, Ours, Runs, Transport, WriteError};
    use super::{landed_message, peer_offer, NixlSetup, PeerOffer};
    use crate::agent_info::{AgentInfo, TransportOffer};
    use crate::config::{ConnectorConfig, NixlPull};
    use crate::error::KvError;
    use crate::memory::KvMemory;
    use crate::nixl::{NixlEndpoint, NixlFailure, NixlPlace, NixlRegion, NixlRun, NixlScratch};
    use crate::ucx_log::UcxLog;

    /// This engine's NIXL agent and the name peers know it by.
    pub(crate) struct EndpointImpl {
        endpoint: NixlEndpoint,
        name: String,
        /// Our agent metadata, hex (read once: it covers every registration).
        metadata: String,
        /// UCX's log, where it was redirected for us to read.
        ucx_log: Option<UcxLog>,
    }

    impl EndpointImpl {
        pub(crate) fn relay_ucx_log(&self) {
            self.transports();
        }

        /// The transports of the latest endpoint UCX configured (a link just probed: its
        /// own), worded for a log line; relays UCX's warnings meanwhile.
        fn transports(&self) -> String {
            match &self.ucx_log {
                Some(log) => log.read().unwrap_or_else(|| "not logged".into()),
                None => "see UCX's own log (UCX_LOG_LEVEL=info)".into(),
            }
        }

        pub(crate) fn offer(&self) -> TransportOffer {
            let (region, scratch) = (self.endpoint.region(), self.endpoint.scratch());
            TransportOffer::Nixl {
                agent: self.name.clone(),
                metadata: self.metadata.clone(),
                addr: region.addr as u64,
                bytes: region.len as u64,
                scratch_addr: scratch.addr as u64,
                scratch_bytes: scratch.len as u64,
                gpu: match region.place {
                    NixlPlace::Dram => None,
                    NixlPlace::Vram(d) => Some(d),
                },
            }
        }
    }

    /// Opens this engine's NIXL endpoint over its KV memory when `cfg` asks for nixl.
    pub(crate) fn open(cfg: &ConnectorConfig, memory: &KvMemory, epoch: u64) -> Result<super::Endpoint, KvError> {
        if cfg.transport != crate::config::KvTransport::Nixl {
            return Ok(None);
        }
        let name = format!("{}@{epoch}", cfg.engine_id);
        let nixl_error = |e: NixlFailure| KvError::Unsupported(format!("--kv-transport nixl: {e}"));
        let endpoint = match memory.device_cache() {
            // VRAM: the device cache and a scratch on its GPU, registered with the GPU's context
            // current (UCX's CUDA transports work in it).
            Some(dev) => NixlEndpoint::open_gpu(&name, dev).map_err(nixl_error)?,
            None => {
                let (addr, len) = memory.host_region()?.address_range();
                let region = NixlRegion { addr, len, place: NixlPlace::Dram };
                NixlEndpoint::open(&name, region, NixlScratch::host()).map_err(nixl_error)?
            }
        };
        let region = endpoint.region();
        let metadata = endpoint.metadata_hex().map_err(nixl_error)?;
        let place = match region.place {
            NixlPlace::Dram => "host memory".to_string(),
            NixlPlace::Vram(d) => format!("GPU memory of cuda:{d}"),
        };
        tracing::info!(agent = %name, bytes = region.len, "NIXL agent ready (UCX backend), KV registered in {place}");
        let ucx_log = cfg.ucx_log.as_deref().map(UcxLog::new);
        Ok(Some(Arc::new(EndpointImpl { endpoint, name, metadata, ucx_log })))
    }

    /// Writing side: the nixl transport to `peer`, with its metadata loaded, or why not.
    pub(crate) fn pick(ours: &Ours, setup: &NixlSetup, peer: &AgentInfo) -> Result<Arc<dyn Transport>, String> {
        let ep = setup.endpoint.clone().ok_or("this engine has no NIXL endpoint")?;
        let offer = peer_offer(peer)?;
        bind_device(ours)?;
        let agent = offer.agent;
        let loaded = ep.endpoint.add_peer_hex(offer.metadata).map_err(|e| e.to_string())?;
        if loaded != agent {
            return Err(format!("the peer's NIXL metadata names agent `{loaded}`, its offer `{agent}`"));
        }
        // The self-check: what this link moves, before any KV does (scratch to scratch, each
        // in its KV's place).
        let gb_s =
            ep.endpoint.probe(agent, offer.region(offer.scratch), ours.timeouts.io).map_err(|e| e.to_string())?;
        let ucx = ep.transports();
        check_rate(setup, "write to", gb_s, &ucx)?;
        tracing::info!(peer = %peer.engine_id, gb_s = format!("{gb_s:.2}"), ucx, "nixl link probed");
        let pull_by_write = pulls_written(ours, setup, &ep, &offer)?;
        Ok(Arc::new(Nixl::new(ours.clone(), ep, agent, offer.region(offer.kv), peer, pull_by_write)))
    }

    /// The decode side: the nixl transport the acceptor picked, with the acceptor's metadata
    /// loaded too, since in pull decode READs prefill's blocks itself.
    pub(crate) fn accept(ours: &Ours, setup: &NixlSetup, peer: &AgentInfo) -> Result<Arc<dyn Transport>, KvError> {
        let ep = setup.endpoint.clone().ok_or_else(|| KvError::Refused("this engine has no NIXL endpoint".into()))?;
        let offer = peer_offer(peer).map_err(KvError::Refused)?;
        let loaded = ep.endpoint.add_peer_hex(offer.metadata).map_err(|e| KvError::Refused(e.to_string()))?;
        if loaded != offer.agent {
            return Err(KvError::Refused(format!(
                "the peer's NIXL metadata names `{loaded}`, its offer `{}`",
                offer.agent
            )));
        }
        bind_device(ours).map_err(KvError::Refused)?;
        let pull_by_write = pulls_written(ours, setup, &ep, &offer).map_err(KvError::Refused)?;
        Ok(Arc::new(Nixl::new(ours.clone(), ep, offer.agent, offer.region(offer.kv), peer, pull_by_write)))
    }

    /// The self-check's floor: a probe of `gb_s` below `--kv-nixl-min-gb-s` refuses the link.
    fn check_rate(setup: &NixlSetup, what: &str, gb_s: f64, ucx: &str) -> Result<(), String> {
        let floor = setup.min_gb_s;
        if gb_s < floor {
            return Err(format!(
                "a {} MiB NIXL {what} the peer ran at {gb_s:.2} GB/s (UCX: {ucx}), below --kv-nixl-min-gb-s {floor}: \
                 UCX may have fallen back to a software path (UCX_TLS chooses its transports)",
                crate::nixl::PROBE_BYTES >> 20
            ));
        }
        Ok(())
    }

    /// Prefill, pull: whether this link's pulls are written by us instead of read by decode
    /// (`--kv-nixl-pull`). UCX picks the path of a READ apart from a WRITE's, so `auto` probes
    /// a READ from decode's scratch: one slower than `--kv-nixl-min-gb-s` makes us write.
    fn pulls_written(ours: &Ours, setup: &NixlSetup, ep: &EndpointImpl, offer: &PeerOffer<'_>) -> Result<bool, String> {
        if !setup.answers_pulls {
            return Ok(false);
        }
        match setup.pull {
            NixlPull::Read => Ok(false),
            NixlPull::Write => Ok(true),
            NixlPull::Auto => {
                let gb_s = ep
                    .endpoint
                    .probe_read(offer.agent, offer.region(offer.scratch), ours.timeouts.io)
                    .map_err(|e| e.to_string())?;
                let floor = setup.min_gb_s;
                let rate = format!("{gb_s:.2}");
                let ucx = ep.transports();
                if gb_s < floor {
                    tracing::warn!(
                        peer = offer.agent,
                        gb_s = rate,
                        ucx,
                        "nixl READs run below --kv-nixl-min-gb-s {floor} on this link (UCX may have fallen back to \
                         a software path for them): its pulls are written by this engine instead"
                    );
                    return Ok(true);
                }
                tracing::info!(peer = offer.agent, gb_s = rate, ucx, "nixl READs probed: decode reads its pulls");
                Ok(false)
            }
        }
    }

    impl PeerOffer<'_> {
        /// The peer's memory at `(addr, bytes)`, in its KV's place.
        fn region(&self, (addr, len): (u64, u64)) -> NixlRegion {
            let place = self.gpu.map_or(NixlPlace::Dram, NixlPlace::Vram);
            NixlRegion { addr: addr as usize, len: len as usize, place }
        }
    }

    /// Makes a GPU engine's CUDA context current on this (a connector) thread before a NIXL
    /// call that moves its memory.
    fn bind_device(ours: &Ours) -> Result<(), String> {
        ours.memory.device_cache().map_or(Ok(()), |dev| dev.bind().map_err(|e| e.to_string()))
    }

    struct Nixl {
        ours: Ours,
        ep: Arc<EndpointImpl>,
        /// The peer's agent name (whom notifications come from, or go to).
        peer_agent: String,
        /// The peer's KV memory and layout.
        target: (NixlRegion, KvLayout),
        /// Decode, pull: the READs asked for, by transfer, until prefill grants them.
        reads: Mutex<HashMap<TransferId, ReadPlan>>,
        /// Prefill, pull: we write the blocks decode asks for (and notify), granting no READ
        /// ([`pulls_written`]).
        pull_by_write: bool,
        /// Transfers whose final write this side has made (for the lost-notification fault).
        notified: AtomicU32,
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
        fn new(
            ours: Ours,
            ep: Arc<EndpointImpl>,
            agent: &str,
            region: NixlRegion,
            peer: &AgentInfo,
            pull_by_write: bool,
        ) -> Self {
            let layout: KvLayout = peer_layout(peer);
            Self {
                ours,
                ep,
                peer_agent: agent.to_string(),
                target: (region, layout),
                reads: Mutex::default(),
                pull_by_write,
                notified: AtomicU32::new(0),
            }
        }

        /// Decode, pull: READs the planned transfer `tid` from prefill's blocks into ours,
        /// finished before the lease prefill granted could end.
        fn read(&self, plan: ReadPlan) -> Result<(), String> {
            let (region, layout) = &self.target;
            let memory = &self.ours.memory;
            let copies =
                plan_kv_copy(layout, &memory.layout(), memory.dtype().bytes(), &plan.src, &plan.dst, plan.num_tokens)?;
            bind_device(&self.ours)?;
            // The plan's source is prefill's memory (the peer), its destination ours.
            let runs = NixlRun::from_read_plan(&copies);
            // Prefill holds the lease `validity` from its grant, which it sent after we asked.
            let safe_until = plan.asked + plan.validity;
            let bound = safe_until.saturating_duration_since(Instant::now());
            self.ep.endpoint.read(&self.peer_agent, *region, &runs, bound).map_err(|e| e.to_string())?;
            if Instant::now() > safe_until {
                return Err("the NIXL read ended after the lease prefill granted for it could have".into());
            }
            Ok(())
        }

        /// Writes the layers `layers` of tokens `0..num_tokens` of our blocks `src` into the
        /// peer's `dst`, then (given `tid`) the notification that says they landed.
        fn copy(&self, runs: Runs<'_>, layers: Range<usize>, tid: Option<&TransferId>) -> Result<(), String> {
            let Runs { src, dst, num_tokens, .. } = runs;
            let (region, layout) = &self.target;
            let from = &self.ours.memory;
            let elem_bytes = from.dtype().bytes();
            // Validates the peer's block list (ids inside its region, enough of them) first.
            let plan = plan_kv_copy_layers(&from.layout(), layout, elem_bytes, src, dst, num_tokens, layers)?;
            bind_device(&self.ours)?;
            let runs = NixlRun::from_plan(&plan);
            let lost = |_: &&TransferId| {
                self.notified.fetch_add(1, Ordering::Relaxed) < self.ours.faults.drop_nixl_notifications
            };
            let message = tid.filter(|tid| !lost(tid)).map(landed_message);
            let started = std::time::Instant::now();
            let bound = self.ours.timeouts.io;
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

    impl Transport for Nixl {
        fn name(&self) -> &'static str {
            "nixl"
        }

        fn writes_directly(&self) -> bool {
            true
        }

        fn write(
            &self,
            runs: Runs<'_>,
            fences: &KvFences,
            landed: Option<&TransferId>,
            _out: &mut dyn Announce,
        ) -> Result<(), WriteError> {
            // A step still computing goes group of layers by group, each WRITE posted once its
            // fence says the group's KV is written; a part has no notification (the final
            // write's, after it, covers it), and a write's notification follows its last group.
            let num_layers = self.ours.memory.layout().num_layers;
            for (layers, fence) in fences.groups(num_layers) {
                if let Some(fence) = fence {
                    fence.wait().map_err(WriteError::Failed)?;
                }
                let notify = landed.filter(|_| layers.end == num_layers);
                self.copy(runs, layers, notify).map_err(WriteError::Failed)?;
            }
            Ok(())
        }

        fn grants_reads(&self) -> bool {
            // Where READs are slow, we write a pull's blocks (and notify), as in push.
            !self.pull_by_write
        }

        fn granted(&self, tid: &TransferId, validity: Duration) {
            let mut reads = self.reads.lock().unwrap_or_else(|p| p.into_inner());
            if validity.is_zero() {
                // No READ granted: prefill wrote the blocks, and its notification says so.
                reads.remove(tid);
            } else if let Some(plan) = reads.get_mut(tid) {
                plan.validity = validity;
            }
        }

        fn reader_reads(&self) -> bool {
            true
        }

        fn landing_waits(&self) -> bool {
            true
        }

        fn plan_read(&self, tid: &TransferId, src: Vec<u32>, dst: Vec<u32>, num_tokens: usize) {
            let mut reads = self.reads.lock().unwrap_or_else(|p| p.into_inner());
            // A read asked for and never granted (aborted, refused) is over after its bound.
            reads.retain(|_, r| r.asked.elapsed() < Duration::from_secs(600));
            let plan = ReadPlan { src, dst, num_tokens, asked: Instant::now(), validity: Duration::ZERO };
            reads.insert(tid.clone(), plan);
        }

        fn confirm_landed(&self, tid: &TransferId) -> Result<(), String> {
            // Pull: prefill granted the read; the bytes are ours once our READ has completed.
            let planned = self.reads.lock().unwrap_or_else(|p| p.into_inner()).remove(tid);
            if let Some(plan) = planned {
                return self.read(plan);
            }
            // Push, or a pull prefill wrote: its write ended; its notification follows the data.
            self.ep
                .endpoint
                .wait_notification(&self.peer_agent, &landed_message(tid), self.ours.timeouts.io)
                .map_err(|e| e.to_string())
        }
    }
}

#[cfg(not(feature = "nixl"))]
mod without_nixl {
    use std::sync::Arc;

    use super::super::{Ours, Transport};
    use super::NixlSetup;
    use crate::agent_info::{AgentInfo, TransportOffer};
    use crate::config::ConnectorConfig;
    use crate::error::KvError;
    use crate::memory::KvMemory;

    /// No NIXL in this build: never made.
    pub(crate) enum EndpointImpl {}

    impl EndpointImpl {
        pub(crate) fn offer(&self) -> TransportOffer {
            match *self {}
        }

        pub(crate) fn relay_ucx_log(&self) {
            match *self {}
        }
    }

    pub(crate) fn open(cfg: &ConnectorConfig, _: &KvMemory, _: u64) -> Result<super::Endpoint, KvError> {
        match cfg.transport {
            crate::config::KvTransport::Nixl => Err(KvError::Unsupported(
                "--kv-transport nixl: this build has no NIXL (build tandem with `--features nixl`)".into(),
            )),
            _ => Ok(None),
        }
    }

    pub(crate) fn pick(_: &Ours, _: &NixlSetup, _: &AgentInfo) -> Result<Arc<dyn Transport>, String> {
        Err("this build has no NIXL".into())
    }

    pub(crate) fn accept(_: &Ours, _: &NixlSetup, _: &AgentInfo) -> Result<Arc<dyn Transport>, KvError> {
        Err(KvError::Refused("this build has no NIXL".into()))
    }
}
