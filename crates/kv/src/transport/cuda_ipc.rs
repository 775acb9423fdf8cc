//! The `cuda-ipc` transport: device-to-device copies into the peer's GPU cache, mapped into
//! this process once per connection (writing side), on the cache's own transfer stream; the
//! side channel carries only the notifications, sent once the copies have completed.

use tandem_compute::cuda::{IpcExport, KvFences, PeerKvMemory};
use tandem_core::TransferId;

use super::{peer_layout, Announce, Ours, Runs, Transport, WriteError};
use crate::agent_info::{AgentInfo, TransportOffer};

pub(crate) struct CudaIpc {
    ours: Ours,
    /// The peer's cache; `None` on the side that is written to.
    peer: Option<PeerKvMemory>,
}

impl CudaIpc {
    /// The side that writes: `peer` mapped.
    pub(crate) fn writer(ours: Ours, peer: PeerKvMemory) -> Self {
        Self { ours, peer: Some(peer) }
    }

    /// The side that is written to.
    pub(crate) fn reader(ours: Ours) -> Self {
        Self { ours, peer: None }
    }

    fn copy(&self, runs: Runs<'_>, fences: &KvFences) -> Result<(), String> {
        let Runs { src, dst, num_tokens, .. } = runs;
        let peer = self.peer.as_ref().ok_or("this end of the connection is written to; it does not write")?;
        let dev = self.ours.memory.device_cache().ok_or("this engine has no device cache")?;
        // The KV in `src` is final once `fences` say so: the engine hands blocks over whole
        // once the step that wrote them has returned its tokens (the stream finished that step
        // before that), and a part of a prompt still computing with the events of the step
        // writing it, which the copies wait for on the device; later steps do not write them.
        let started = std::time::Instant::now();
        let (bytes, copies) = dev.write_to_peer(peer, src, dst, num_tokens, fences)?;
        tracing::debug!(bytes, copies, us = started.elapsed().as_micros() as u64, "cuda-ipc write done");
        match dst.first() {
            // As a bad link would: one bit of the first block that landed, after the copy.
            Some(&first) if self.ours.faults.corrupt_sends && num_tokens > 0 => peer.corrupt_block(first),
            _ => Ok(()),
        }
    }
}

impl Transport for CudaIpc {
    fn name(&self) -> &'static str {
        "cuda-ipc"
    }

    fn writes_directly(&self) -> bool {
        true
    }

    fn write(
        &self,
        runs: Runs<'_>,
        fences: &KvFences,
        _landed: Option<&TransferId>,
        _out: &mut dyn Announce,
    ) -> Result<(), WriteError> {
        self.copy(runs, fences).map_err(WriteError::Failed)
    }
}

/// Identifies this host for the cuda-ipc offer: its boot id (two containers of one kernel
/// share it; whether their IPC namespaces do is the driver's answer at mapping time).
pub(crate) fn host_id() -> String {
    for path in ["/proc/sys/kernel/random/boot_id", "/etc/hostname"] {
        if let Ok(s) = std::fs::read_to_string(path) {
            let s = s.trim();
            if !s.is_empty() {
                return s.to_string();
            }
        }
    }
    "unknown-host".into()
}

/// The cuda-ipc offer for an export of our cache.
pub(crate) fn offer(export: &IpcExport) -> TransportOffer {
    let (handle, device) = export.to_hex();
    TransportOffer::CudaIpc { host: host_id(), process: std::process::id(), device, handle, bytes: export.bytes as u64 }
}

/// Maps `peer`'s GPU cache, or says why cuda-ipc cannot work with it.
pub(crate) fn open(ours: &Ours, peer: &AgentInfo) -> Result<PeerKvMemory, String> {
    let dev = ours.memory.device_cache().ok_or("this engine's KV cache is in host memory (a CPU engine)")?;
    let offer = peer.transports.iter().find_map(|t| match t {
        TransportOffer::CudaIpc { host, process, device, handle, bytes } => {
            Some((host, *process, device, handle, *bytes))
        }
        _ => None,
    });
    let (host, process, device, handle, bytes) =
        offer.ok_or("the peer offers no cuda-ipc (a CPU engine, or --kv-transport tcp there)")?;
    if *host != host_id() {
        return Err("the peer is on another host".into());
    }
    if process == std::process::id() {
        return Err("the peer is in this process (its handle cannot be opened here)".into());
    }
    let export = IpcExport::from_hex(handle, bytes as usize, device).ok_or("the peer's IPC handle is malformed")?;
    dev.open_peer(&export, peer_layout(peer))
}
