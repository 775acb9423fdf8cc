//! The device KV cache, block-major as on the CPU (`tandem_compute::KvLayout`), bf16 or FP8
//! e4m3 (with a one-layer bf16 shadow for the prefill attention), in memory a
//! peer process can map (the cuda-ipc transport), and its page-locked host copy for the KV
//! connector's tcp transport. It owns the cache's memory for the model's life;
//! forwards write it, and the connector reads and writes blocks (through
//! [`DeviceKvMemory`], on its own stream) only while the engine has handed them over.

use std::sync::Arc;

use tandem_compute::cuda::{CudaDevice, DevBuf, DeviceKvMemory, PinnedRegion};
use tandem_compute::{KvDtype, KvLayout, KvRegion};

use super::CudaOptions;
use crate::config::ModelConfig;
use crate::ModelError;

/// Room kept free for cuBLAS and CUDA graphs when the cache is sized from memory.
const RESERVE_BYTES: usize = 512 << 20;

pub(super) struct DeviceKv {
    /// The cache's memory: bf16 elements, or (FP8) two e4m3 bytes to each u16.
    pub cache: DevBuf<u16>,
    pub layout: KvLayout,
    /// bf16, or FP8 e4m3 (`--kv-cache-dtype fp8`).
    pub dtype: KvDtype,
    /// With an FP8 cache: one layer's bf16 copy over the same blocks, where each layer's
    /// prefill attention reads the keys and values its step needs (`ops::kv_fp8_shadow`).
    pub shadow: Option<DevBuf<u16>>,
    /// The cache as the KV connector's direct transports (cuda-ipc) see it.
    pub memory: Arc<DeviceKvMemory>,
    /// The KV connector's host copy of the cache (P/D roles): the same bytes.
    host: Option<Arc<KvRegion>>,
    /// `host` page-locked while the cache lives.
    _host_pinned: Option<PinnedRegion>,
}

impl DeviceKv {
    /// Allocates the cache: `opts.num_blocks`, or what `opts.memory_utilization` leaves after
    /// everything allocated so far (weights, activations), capped by the host copy's size.
    pub fn allocate(dev: &CudaDevice, cfg: &ModelConfig, opts: &CudaOptions) -> Result<Self, ModelError> {
        let dtype = opts.kv_dtype;
        let layer_elems = 2 * cfg.num_kv_heads * cfg.head_dim * opts.block_size;
        let block_bytes = cfg.num_layers * layer_elems * dtype.bytes();
        // An FP8 cache's blocks each have a bf16 layer in the shadow too.
        let shadow_bytes = if dtype == KvDtype::Fp8E4m3 { layer_elems * 2 } else { 0 };
        let num_blocks = match opts.num_blocks {
            Some(n) => n,
            None => {
                let (free, total) = dev.memory()?;
                let used = total - free;
                let budget = (total as f64 * opts.memory_utilization) as usize;
                budget.saturating_sub(used + RESERVE_BYTES) / (block_bytes + shadow_bytes).max(1)
            }
        };
        if num_blocks == 0 {
            return Err(ModelError::Device(format!(
                "no memory left for the KV cache on {} (raise --gpu-memory-utilization or lower --max-num-batched-tokens)",
                dev.describe()
            )));
        }
        // The host copy bounds the device cache.
        let num_blocks = match opts.host_kv_bytes.map(|bytes| bytes / block_bytes.max(1)) {
            Some(0) => {
                return Err(ModelError::Device(format!(
                    "the host KV copy holds no block of {block_bytes} bytes (raise --kv-host-gib)"
                )))
            }
            Some(cap) if cap < num_blocks => {
                tracing::info!(num_blocks, cap, "KV cache capped to what its host copy holds");
                cap
            }
            _ => num_blocks,
        };
        let layout = KvLayout {
            num_layers: cfg.num_layers,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            block_size: opts.block_size,
            num_blocks,
        };
        // One allocation of its own, so a peer engine in another process can map it (cuda-ipc).
        let cache = dev.zeros_exportable::<u16>((num_blocks * block_bytes).div_ceil(2))?;
        let memory = dev.kv_memory(&cache, layout, dtype)?;
        let shadow = match shadow_bytes {
            0 => None,
            bytes => Some(dev.zeros::<u16>(num_blocks * bytes / 2)?),
        };
        let host = opts.host_kv_bytes.map(|_| KvRegion::host_copy(layout, dtype));
        let host_pinned = host.as_ref().and_then(|region| pin(dev, region));
        tracing::info!(
            num_blocks,
            kv_tokens = num_blocks * opts.block_size,
            kv_gib = format!("{:.2}", (num_blocks * block_bytes) as f64 / (1u64 << 30) as f64),
            dtype = dtype.name(),
            "KV cache on the GPU"
        );
        Ok(Self { cache, layout, dtype, shadow, memory, host, _host_pinned: host_pinned })
    }

    /// The host copy the connector moves, if this cache has one.
    pub fn region(&self) -> Option<Arc<KvRegion>> {
        self.host.clone()
    }
}

/// Page-locks the host copy: device <-> host copies then run at PCIe speed (pageable, a copy
/// to a fresh region ran at about 1.3 GB/s on an H200 machine). If the OS refuses, copies still
/// work, slower.
fn pin(dev: &CudaDevice, region: &Arc<KvRegion>) -> Option<PinnedRegion> {
    let t = std::time::Instant::now();
    match dev.pin_region(region) {
        Ok(pinned) => {
            tracing::info!(
                gib =
                    format!("{:.2}", (region.block_bytes() * region.layout().num_blocks) as f64 / (1u64 << 30) as f64),
                secs = format!("{:.1}", t.elapsed().as_secs_f64()),
                "host KV copy page-locked"
            );
            Some(pinned)
        }
        Err(e) => {
            tracing::warn!(error = %e, "could not page-lock the host KV copy; its copies will be slower");
            None
        }
    }
}
