//! The KV memory a connector moves: where its bytes are, as each transport needs them.

use std::ops::Range;
use std::sync::Arc;

use tandem_compute::cuda::{DeviceKvMemory, HostCopies, KvFence};
use tandem_compute::kv_digest::kv_digest_host;
use tandem_compute::{KvDtype, KvLayout, KvRegion};

use crate::error::KvError;

/// An engine's KV memory as its connector sees it: a host region (a CPU engine's cache
/// itself, or a GPU engine's host copy, which the tcp and local transports move), a GPU
/// engine's device cache (which cuda-ipc peers write directly), or both.
#[derive(Clone)]
pub struct KvMemory {
    host: Option<Arc<KvRegion>>,
    device: Option<Arc<DeviceKvMemory>>,
}

impl From<Arc<KvRegion>> for KvMemory {
    fn from(region: Arc<KvRegion>) -> Self {
        Self { host: Some(region), device: None }
    }
}

impl KvMemory {
    /// A GPU engine's memory: its device cache and, when the tcp transport may be used, the
    /// host copy of it (same layout and element type: bf16, or FP8 bytes).
    pub fn device(device: Arc<DeviceKvMemory>, host: Option<Arc<KvRegion>>) -> Result<Self, KvError> {
        if let Some(h) = &host {
            if h.layout() != device.layout() || h.dtype() != device.dtype() {
                return Err(KvError::Unsupported(format!(
                    "the host KV copy ({:?}, {}) does not match the device cache ({:?}, {})",
                    h.layout(),
                    h.dtype().name(),
                    device.layout(),
                    device.dtype().name()
                )));
            }
        }
        Ok(Self { host, device: Some(device) })
    }

    /// The cache's shape.
    pub fn layout(&self) -> KvLayout {
        match (&self.host, &self.device) {
            (Some(h), _) => *h.layout(),
            (None, Some(d)) => *d.layout(),
            (None, None) => unreachable!("a KvMemory has a host region or a device cache"),
        }
    }

    /// The element type moved.
    pub fn dtype(&self) -> KvDtype {
        match (&self.host, &self.device) {
            (Some(h), _) => h.dtype(),
            (None, Some(d)) => d.dtype(),
            (None, None) => unreachable!("a KvMemory has a host region or a device cache"),
        }
    }

    /// The host region, or why there is none.
    pub fn host_region(&self) -> Result<&Arc<KvRegion>, KvError> {
        self.host.as_ref().ok_or_else(|| {
            KvError::Unsupported(
                "this engine keeps no host copy of its KV cache (--kv-transport cuda-ipc), so it cannot move KV over tcp"
                    .into(),
            )
        })
    }

    /// Makes the host region's copy of `blocks` current before a transport reads it: a GPU
    /// engine's device cache is copied into its host copy here, on the connector's thread
    /// (the engine hands its blocks over without waiting for a copy). Nothing to do for a
    /// CPU engine, whose region is the cache.
    ///
    /// # Safety
    /// The connector holds `blocks` (produced KV, computed and handed over); their host-copy
    /// blocks are touched by nobody else while it holds them.
    pub unsafe fn stage_to_host(&self, blocks: &[u32]) -> Result<(), KvError> {
        let (Some(device), Some(host)) = (&self.device, &self.host) else { return Ok(()) };
        // Safety: passed on from the caller.
        unsafe { device.download(blocks, host) }.map_err(KvError::Transfer)
    }

    /// Loads `blocks` of the host region into the device cache after a transport wrote them
    /// there, so that `Ready` means the KV is in the engine's cache. Nothing to do for a CPU
    /// engine.
    ///
    /// # Safety
    /// The connector owns `blocks` (a decode transfer's destination, not yet reported ready):
    /// no step reads or writes them and nobody writes their host copy meanwhile.
    pub unsafe fn load_from_host(&self, blocks: &[u32]) -> Result<(), KvError> {
        let mut load = self.receiver()?;
        for run in crate::blocks::coalesce(blocks) {
            // Safety: passed on from the caller.
            unsafe { load.landed(run, 0..self.layout().num_layers)? };
        }
        load.finish()
    }

    /// A tcp send's copies from the device cache of `layers` of the pieces' blocks: every
    /// piece queued at once on the connector's transfer stream, each waited for just before it
    /// goes on the socket ([`StagedSend::ready`]). Nothing is copied for a CPU engine.
    ///
    /// # Safety
    /// As [`KvMemory::stage_to_host`], for the pieces' blocks, until the result is dropped.
    pub unsafe fn stage_send(
        &self,
        pieces: &[crate::blocks::BlockRun],
        layers: Range<usize>,
    ) -> Result<StagedSend<'_>, KvError> {
        let (Some(device), Some(host)) = (&self.device, &self.host) else { return Ok(StagedSend(None)) };
        let mut copies = device.host_copies(host).map_err(KvError::Transfer)?;
        for &piece in pieces {
            // Safety: passed on from the caller.
            unsafe { copies.download(piece, layers.clone()) }.map_err(KvError::Transfer)?;
        }
        Ok(StagedSend(Some(copies)))
    }

    /// [`KvMemory::stage_send`] of every group of layers of a step at once: each group's copies
    /// queued behind its fence on the device, on a stream of their own, so that a group's copy
    /// runs as soon as the step has written it, while the groups before it are on the socket.
    /// Group `g` moves in `pieces[g]`; its piece `i` is number `i` plus the pieces of the groups
    /// before it for [`StagedSend::ready`]. A group whose
    /// fence a host thread sets (never a GPU step's) is waited for here. Nothing is copied for a
    /// CPU engine.
    ///
    /// # Safety
    /// As [`KvMemory::stage_send`].
    pub unsafe fn stage_send_ahead(
        &self,
        pieces: &[Vec<crate::blocks::BlockRun>],
        groups: &[(Range<usize>, Option<&KvFence>)],
    ) -> Result<StagedSend<'_>, KvError> {
        let (Some(device), Some(host)) = (&self.device, &self.host) else { return Ok(StagedSend(None)) };
        let mut copies = device.host_copies_apart(host).map_err(KvError::Transfer)?;
        for ((layers, fence), pieces) in groups.iter().zip(pieces) {
            match fence.map(|f| (f.event(), f)) {
                Some((Some(event), _)) => copies.after(event).map_err(KvError::Transfer)?,
                Some((None, fence)) => fence.wait().map_err(KvError::Transfer)?,
                None => {}
            }
            for &piece in pieces {
                // Safety: passed on from the caller.
                unsafe { copies.download(piece, layers.clone()) }.map_err(KvError::Transfer)?;
            }
        }
        Ok(StagedSend(Some(copies)))
    }

    /// A tcp receive's copies into the device cache, one per piece as it lands
    /// ([`StagedReceive::landed`]). Nothing is copied for a CPU engine.
    pub fn receiver(&self) -> Result<StagedReceive<'_>, KvError> {
        let (Some(device), Some(host)) = (&self.device, &self.host) else { return Ok(StagedReceive(None)) };
        device.host_copies(host).map(|c| StagedReceive(Some(c))).map_err(KvError::Transfer)
    }

    /// The `--kv-verify` digest ([`tandem_compute::kv_digest`]) of tokens `0..num_tokens` held
    /// in `blocks`, read where the engine computes with its KV (a GPU engine's device cache,
    /// a CPU engine's region): both ends of a direct copy that landed whole get the same
    /// number, whatever their block sizes.
    ///
    /// # Safety
    /// The connector holds `blocks` (produced KV, or a transfer's destination whose writer has
    /// finished): no step writes them meanwhile.
    pub unsafe fn digest(&self, blocks: &[u32], num_tokens: usize) -> Result<u64, KvError> {
        match (&self.device, &self.host) {
            (Some(device), _) => device.digest(blocks, num_tokens).map_err(KvError::Transfer),
            // Safety: passed on from the caller.
            (None, Some(host)) => unsafe { kv_digest_host(host, blocks, num_tokens) }.map_err(KvError::Transfer),
            (None, None) => unreachable!("a KvMemory has a host region or a device cache"),
        }
    }

    /// The device cache, if the engine's KV lives on a GPU.
    pub fn device_cache(&self) -> Option<&Arc<DeviceKvMemory>> {
        self.device.as_ref()
    }
}

/// The device-to-host copies of a tcp send ([`KvMemory::stage_send`]); dropping it waits for
/// any still running.
pub struct StagedSend<'a>(Option<HostCopies<'a>>);

impl StagedSend<'_> {
    /// Waits until piece `i` is in the host copy (at once for a CPU engine).
    pub fn ready(&self, i: usize) -> Result<(), KvError> {
        self.0.as_ref().map_or(Ok(()), |c| c.wait(i).map_err(KvError::Transfer))
    }
}

/// The host-to-device copies of a tcp receive ([`KvMemory::receiver`]); dropping it waits for
/// any still running.
pub struct StagedReceive<'a>(Option<HostCopies<'a>>);

impl StagedReceive<'_> {
    /// Queues the copy of `layers` of `run`, which have landed in the host copy, into the
    /// device cache.
    ///
    /// # Safety
    /// As [`KvMemory::load_from_host`], for `run`'s blocks, until [`StagedReceive::finish`].
    pub unsafe fn landed(&mut self, run: crate::blocks::BlockRun, layers: Range<usize>) -> Result<(), KvError> {
        match &mut self.0 {
            // Safety: passed on from the caller.
            Some(c) => unsafe { c.upload(run, layers) }.map(drop).map_err(KvError::Transfer),
            None => Ok(()),
        }
    }

    /// Waits until every landed piece is in the device cache.
    pub fn finish(self) -> Result<(), KvError> {
        self.0.as_ref().map_or(Ok(()), |c| c.wait_all().map_err(KvError::Transfer))
    }
}
