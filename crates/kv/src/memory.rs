//! The KV memory a connector moves: where its bytes are, as each transport needs them.

use std::sync::Arc;

use tandem_compute::cuda::DeviceKvMemory;
use tandem_compute::{KvDtype, KvLayout, KvRegion};

use crate::KvError;

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
    /// host copy of it (same layout, bf16).
    pub fn device(device: Arc<DeviceKvMemory>, host: Option<Arc<KvRegion>>) -> Result<Self, KvError> {
        if let Some(h) = &host {
            if h.layout() != device.layout() || h.dtype() != KvDtype::Bf16 {
                return Err(KvError::Unsupported(format!(
                    "the host KV copy ({:?}, {}) does not match the device cache ({:?}, bf16)",
                    h.layout(),
                    h.dtype().name(),
                    device.layout()
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
        match &self.host {
            Some(h) => h.dtype(),
            None => KvDtype::Bf16,
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
    pub fn stage_to_host(&self, blocks: &[u32]) -> Result<(), KvError> {
        let (Some(device), Some(host)) = (&self.device, &self.host) else { return Ok(()) };
        // Safety: the connector holds `blocks` (produced KV, computed and handed over); their
        // host-copy blocks are touched by nobody else while it holds them.
        unsafe { device.download(blocks, host) }.map_err(KvError::Transfer)
    }

    /// Whether the connector copies the device cache to the host copy itself
    /// ([`KvMemory::stage_to_host`]), so the engine need not before handing blocks over.
    pub fn stages_to_host(&self) -> bool {
        self.device.is_some()
    }

    /// The device cache, if the engine's KV lives on a GPU.
    pub fn device_cache(&self) -> Option<&Arc<DeviceKvMemory>> {
        self.device.as_ref()
    }
}
