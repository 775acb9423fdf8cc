//! KV memory another process can reach: the device KV cache as one allocation CUDA IPC can
//! export, a peer's cache mapped into this process, and the KV connector's own transfer
//! stream.
//!
//! Stream-ordered pool memory (what `cuMemAllocAsync` hands out) cannot be exported, so the
//! cache is one `cuMemAlloc` allocation ([`CudaDevice::zeros_exportable`]). A peer maps it
//! once per connection ([`DeviceKvMemory::open_peer`]; peer access between two GPUs is enabled
//! lazily by the mapping) and writes its blocks with device-to-device copies planned by
//! [`crate::kv_copy`], on this process's transfer stream: the engine's stream never waits on a
//! transfer, and a transfer returns only once its copies have completed.

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::{
    sys, CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
    ValidAsZeroBits,
};

use super::{oom, Backing, CudaDevice, CudaError, DevBuf, KvFences};
use crate::kv_copy::{plan_kv_copy, plan_kv_copy_layers, KvCopy};
use crate::kv_digest::check_blocks;
use crate::{coalesce, BlockRun, KvDtype, KvLayout, KvRegion};

/// One `cuMemAlloc` allocation, freed with its last holder.
pub(crate) struct ExportableAlloc {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    bytes: usize,
}

impl Drop for ExportableAlloc {
    fn drop(&mut self) {
        // Nothing useful to do on failure at teardown.
        let _ = self.ctx.bind_to_thread();
        // Safety: `ptr` came from cuMemAlloc in this context and is freed exactly once, here,
        // after the last buffer or KV handle holding it is gone.
        let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
    }
}

/// What a peer needs to map an engine's KV cache: the IPC handle of its allocation, its size
/// and the GPU it lives on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IpcExport {
    /// `cuIpcGetMemHandle`'s opaque handle.
    pub handle: [u8; 64],
    /// Bytes of the allocation.
    pub bytes: usize,
    /// The GPU's UUID.
    pub device_uuid: [u8; 16],
}

impl IpcExport {
    /// The handle and the GPU UUID as hex, for a text message.
    pub fn to_hex(&self) -> (String, String) {
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        (hex(&self.handle), hex(&self.device_uuid))
    }

    /// The inverse of [`IpcExport::to_hex`]; `None` when either is malformed (a peer's data).
    pub fn from_hex(handle: &str, bytes: usize, device_uuid: &str) -> Option<Self> {
        fn unhex<const N: usize>(s: &str) -> Option<[u8; N]> {
            let mut out = [0u8; N];
            (s.len() == 2 * N).then_some(())?;
            for (i, o) in out.iter_mut().enumerate() {
                *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
            }
            Some(out)
        }
        Some(Self { handle: unhex(handle)?, bytes, device_uuid: unhex(device_uuid)? })
    }
}

impl CudaDevice {
    /// A zeroed buffer of `n` elements in an allocation of its own that [`DeviceKvMemory`] can
    /// export to another process.
    pub fn zeros_exportable<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<DevBuf<T>, CudaError> {
        let len = n.max(1);
        let bytes = len * std::mem::size_of::<T>();
        self.ctx.bind_to_thread()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // Safety: a plain allocation into a local; freed by ExportableAlloc's Drop.
        unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes).result().map_err(|e| oom(e, bytes))? };
        let alloc = Arc::new(ExportableAlloc { ctx: self.ctx.clone(), ptr, bytes });
        // Safety: the range is the allocation just made; zeroed on the stream, ahead of any
        // kernel that reads it.
        unsafe { sys::cuMemsetD8Async(ptr, 0, bytes, self.stream.cu_stream()).result()? };
        Ok(DevBuf { backing: Backing::Exportable(alloc), ptr, len })
    }

    /// The KV cache `cache` (from [`CudaDevice::zeros_exportable`], laid out as `layout` in
    /// `dtype`: bf16, or FP8 e4m3 bytes) as the KV connector uses it, with a transfer stream of
    /// its own.
    pub fn kv_memory(
        &self,
        cache: &DevBuf<u16>,
        layout: KvLayout,
        dtype: KvDtype,
    ) -> Result<Arc<DeviceKvMemory>, CudaError> {
        let alloc = cache.exportable().ok_or_else(|| {
            CudaError::Unavailable("the KV cache was not allocated exportable (zeros_exportable)".into())
        })?;
        if layout.num_blocks * layout.block_elems() * dtype.bytes() > alloc.bytes {
            return Err(CudaError::Unavailable("the KV layout is larger than its allocation".into()));
        }
        let stream = self.ctx.new_stream()?;
        Ok(Arc::new(DeviceKvMemory {
            ctx: self.ctx.clone(),
            alloc: alloc.clone(),
            layout,
            dtype,
            stream,
            scatter: self.kernels().get("kv_scatter").clone(),
            digest: self.kernels().get("kv_digest").clone(),
            ordinal: self.ordinal,
        }))
    }
}

/// A GPU engine's KV cache as the KV connector sees it, usable from the connector's threads.
pub struct DeviceKvMemory {
    ctx: Arc<CudaContext>,
    alloc: Arc<ExportableAlloc>,
    layout: KvLayout,
    dtype: KvDtype,
    /// The connector's own stream: its copies neither wait behind nor hold up engine steps.
    stream: Arc<CudaStream>,
    /// The `kv_scatter` kernel: one launch for a copy between different block sizes.
    scatter: CudaFunction,
    /// The `kv_digest` kernel (`--kv-verify` of direct copies).
    digest: CudaFunction,
    ordinal: usize,
}

impl std::fmt::Debug for DeviceKvMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceKvMemory(cuda:{}, {:?})", self.ordinal, self.layout)
    }
}

/// Device memory of its own ([`DeviceKvMemory::scratch`]); freed on drop.
pub struct DeviceScratch(ExportableAlloc);

impl DeviceScratch {
    /// Its base address and bytes.
    pub fn range(&self) -> (u64, usize) {
        (self.0.ptr, self.0.bytes)
    }
}

/// A peer engine's KV cache mapped into this process; unmapped on drop.
pub struct PeerKvMemory {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    layout: KvLayout,
    /// Bytes per element (the handshake made the peer's dtype ours).
    elem_bytes: usize,
    /// Where it lives, for logs: `the same GPU` or `cuda:N`.
    place: String,
}

impl Drop for PeerKvMemory {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // Safety: `ptr` came from cuIpcOpenMemHandle and is closed once; every copy into it
        // was waited for before its transfer returned.
        let _ = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
    }
}

impl PeerKvMemory {
    /// Where the peer's cache lives relative to ours.
    pub fn place(&self) -> &str {
        &self.place
    }

    /// Fault injection (`corrupt_sends`): flips the lowest bit of the first byte of the peer's
    /// `block`, as a bad link or a stray write would, after a copy into it has completed.
    pub fn corrupt_block(&self, block: u32) -> Result<(), String> {
        if block as usize >= self.layout.num_blocks {
            return Err(format!("block {block} is outside the peer's {} blocks", self.layout.num_blocks));
        }
        self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
        let at = self.ptr + block as u64 * (self.layout.block_elems() * self.elem_bytes) as u64;
        let mut byte = [0u8; 1];
        // Safety: `at` is the first byte of a block inside the peer's mapped cache (checked
        // above); both copies touch that one byte.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_sync(&mut byte, at).map_err(|e| e.to_string())?;
            byte[0] ^= 1;
            cudarc::driver::result::memcpy_htod_sync(at, &byte).map_err(|e| e.to_string())?;
        }
        // A copy from pageable memory may return before its DMA lands: the flipped bit must be
        // in place before the writer reports the copy, as a bad link's would be, or the reader
        // may check the KV before it is corrupted (and then decode from it).
        cudarc::driver::result::ctx::synchronize().map_err(|e| e.to_string())
    }
}

fn uuid_bytes(u: sys::CUuuid) -> [u8; 16] {
    u.bytes.map(|b| b as u8)
}

impl DeviceKvMemory {
    /// The cache's shape.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Bytes per element (bf16: 2, FP8: 1).
    pub fn elem_bytes(&self) -> usize {
        self.dtype.bytes()
    }

    /// The cache's element type.
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// `cuda:N`.
    pub fn describe(&self) -> String {
        format!("cuda:{}", self.ordinal)
    }

    /// The cache's device memory: its allocation's base address and bytes, for registering it
    /// with a transfer library (NIXL).
    pub fn device_range(&self) -> (u64, usize) {
        (self.alloc.ptr, self.alloc.bytes)
    }

    /// The CUDA ordinal of the cache's GPU in this process.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Makes the cache's CUDA context current on this thread: a transfer library that moves
    /// GPU memory (UCX's CUDA transports, under NIXL) works in the caller's context.
    pub fn bind(&self) -> Result<(), CudaError> {
        Ok(self.ctx.bind_to_thread()?)
    }

    /// `bytes` of zeroed memory on the cache's GPU in an allocation of its own (`cuMemAlloc`:
    /// a transfer library can register it, unlike stream-ordered pool memory), freed when the
    /// result is dropped.
    pub fn scratch(&self, bytes: usize) -> Result<DeviceScratch, CudaError> {
        let bytes = bytes.max(1);
        self.ctx.bind_to_thread()?;
        let mut ptr: sys::CUdeviceptr = 0;
        // Safety: a plain allocation into a local; freed by ExportableAlloc's Drop.
        unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes).result().map_err(|e| oom(e, bytes))? };
        let alloc = ExportableAlloc { ctx: self.ctx.clone(), ptr, bytes };
        // Safety: the range is the allocation just made; a synchronous memset.
        unsafe { sys::cuMemsetD8_v2(ptr, 0, bytes).result()? };
        Ok(DeviceScratch(alloc))
    }

    /// The IPC handle of the cache's allocation, for peers in other processes.
    pub fn export(&self) -> Result<IpcExport, CudaError> {
        self.ctx.bind_to_thread()?;
        let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
        // Safety: the pointer is the base of a live cuMemAlloc allocation of this context.
        unsafe { sys::cuIpcGetMemHandle(&mut handle, self.alloc.ptr).result()? };
        Ok(IpcExport {
            handle: handle.reserved.map(|b| b as u8),
            bytes: self.alloc.bytes,
            device_uuid: uuid_bytes(self.ctx.uuid()?),
        })
    }

    /// Maps a peer's exported cache (laid out as `layout`) into this process. The error says
    /// why it cannot be used: its GPU is not visible here, the two GPUs have no peer access, or
    /// the driver refused the handle (another host, another container's IPC namespace).
    pub fn open_peer(&self, export: &IpcExport, layout: KvLayout) -> Result<PeerKvMemory, String> {
        let needed = layout.num_blocks * layout.block_elems() * self.elem_bytes();
        if needed > export.bytes {
            return Err(format!("the peer's KV layout needs {needed} bytes but it exports {}", export.bytes));
        }
        let ours = self.ctx.uuid().map_err(|e| format!("reading this GPU's UUID: {e:?}"))?;
        let place = if uuid_bytes(ours) == export.device_uuid {
            "the same GPU".to_string()
        } else {
            let peer = self.visible_ordinal(&export.device_uuid)?;
            let mut can = 0;
            let peer_dev = device_handle(peer)?;
            // Safety: both are valid device handles of this process's driver.
            unsafe { sys::cuDeviceCanAccessPeer(&mut can, self.ctx.cu_device(), peer_dev) }
                .result()
                .map_err(|e| format!("asking for peer access: {e:?}"))?;
            if can == 0 {
                return Err(format!("cuda:{} cannot access cuda:{peer} directly (no peer access)", self.ordinal));
            }
            format!("cuda:{peer}")
        };
        self.ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
        let mut ptr: sys::CUdeviceptr = 0;
        let handle = sys::CUipcMemHandle { reserved: export.handle.map(|b| b as _) };
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        // Safety: maps the peer's allocation into a local; unmapped by PeerKvMemory's Drop.
        unsafe { sys::cuIpcOpenMemHandle_v2(&mut ptr, handle, flags) }
            .result()
            .map_err(|e| format!("the driver refused the peer's IPC handle ({e:?})"))?;
        Ok(PeerKvMemory { ctx: self.ctx.clone(), ptr, layout, elem_bytes: self.elem_bytes(), place })
    }

    /// This process's ordinal of the GPU with `uuid`.
    fn visible_ordinal(&self, uuid: &[u8; 16]) -> Result<usize, String> {
        let count = CudaContext::device_count().map_err(|e| format!("{e:?}"))?.max(0) as usize;
        for i in 0..count {
            let dev = device_handle(i)?;
            let mut u = sys::CUuuid { bytes: [0; 16] };
            // Safety: a valid device handle and a local to write into.
            if unsafe { sys::cuDeviceGetUuid_v2(&mut u, dev) }.result().is_ok() && &uuid_bytes(u) == uuid {
                return Ok(i);
            }
        }
        Err("the peer's GPU is not visible to this process (CUDA_VISIBLE_DEVICES?)".into())
    }

    /// Writes the KV of tokens `0..num_tokens` from our `src_blocks` into the peer's
    /// `dst_blocks` and waits (on this thread, asleep) until the copies have completed.
    /// Returns the bytes moved and the number of copies.
    ///
    /// Each group of layers is copied once `fences` says the step computing it has written
    /// its KV (the transfer stream waits for the group's event; this thread does not), so a
    /// prompt's KV moves while its step still runs. The caller holds `src_blocks` (no step
    /// but the fenced one writing them) and the peer has given `dst_blocks` to this transfer.
    pub fn write_to_peer(
        &self,
        peer: &PeerKvMemory,
        src_blocks: &[u32],
        dst_blocks: &[u32],
        num_tokens: usize,
        fences: &KvFences,
    ) -> Result<(usize, usize), String> {
        self.copy(self.alloc.ptr, (&peer.layout, peer.ptr), src_blocks, dst_blocks, num_tokens, fences)
    }

    /// The same copies inside this cache (the device-copy floor `tandem bench kv` measures).
    pub fn copy_within(&self, src_blocks: &[u32], dst_blocks: &[u32], num_tokens: usize) -> Result<usize, String> {
        let (bytes, _) = self.copy(
            self.alloc.ptr,
            (&self.layout, self.alloc.ptr),
            src_blocks,
            dst_blocks,
            num_tokens,
            &KvFences::complete(),
        )?;
        Ok(bytes)
    }

    /// [`DeviceKvMemory::write_to_peer`] into another cache of this process on the same GPU
    /// (tests of the copy paths, which cannot map their own process's export).
    pub fn copy_into(
        &self,
        other: &DeviceKvMemory,
        src_blocks: &[u32],
        dst_blocks: &[u32],
        num_tokens: usize,
        fences: &KvFences,
    ) -> Result<(usize, usize), String> {
        if !Arc::ptr_eq(&self.ctx, &other.ctx) {
            return Err("the other cache belongs to another CUDA context".into());
        }
        self.copy(self.alloc.ptr, (&other.layout, other.alloc.ptr), src_blocks, dst_blocks, num_tokens, fences)
    }

    /// Plans the copies of tokens `0..num_tokens` from our `src_blocks` (our cache at `src`)
    /// into `dst_blocks` of the cache laid out as `dst.0` at `dst.1`, queues them on the
    /// transfer stream group by group of `fences` (each behind its group's event) and waits.
    /// Equal block sizes and all layers at once go as linear copies (runs merged); different
    /// block sizes, or groups of layers, as one `kv_scatter` launch a group when a token's row
    /// is whole 16-byte vectors, else as pitched copies. Returns the bytes moved and the copies
    /// (or launches).
    fn copy(
        &self,
        src: sys::CUdeviceptr,
        dst: (&KvLayout, sys::CUdeviceptr),
        src_blocks: &[u32],
        dst_blocks: &[u32],
        num_tokens: usize,
        fences: &KvFences,
    ) -> Result<(usize, usize), String> {
        let (dst_layout, dst_base) = dst;
        // Validates the block lists (a peer's data) and keeps every copy inside both caches.
        let whole = plan_kv_copy(&self.layout, dst_layout, self.elem_bytes(), src_blocks, dst_blocks, num_tokens)?;
        let bytes = whole.iter().map(KvCopy::bytes).sum();
        if num_tokens == 0 {
            // Nothing left (the parts written while the prompt computed covered it all).
            return Ok((0, 0));
        }
        let token_bytes = self.layout.head_dim * self.elem_bytes();
        // One kernel launch a group moves rows of whole 16-byte vectors between any block
        // sizes; the copy engine's pitched copies of a group of layers ran at half its rate.
        let scattered = token_bytes.is_multiple_of(16)
            && (self.layout.block_size != dst_layout.block_size || !fences.is_complete());
        let failed = |e: CudaError| format!("device copy failed: {e:?}");
        self.ctx.bind_to_thread().map_err(|e| failed(e.into()))?;
        // Copies that wait for a step still running go on a stream of their own: on the shared
        // one, every transfer's copies queued after them (another request's final write) would
        // wait for that step too.
        let stream = if fences.is_complete() {
            self.stream.clone()
        } else {
            self.ctx.new_stream().map_err(|e| failed(e.into()))?
        };
        // The kernel's block tables, on the device; they live (and the launches read them)
        // until the wait below.
        let tables = if scattered {
            let (s, d) =
                (&src_blocks[..self.layout.blocks_for(num_tokens)], &dst_blocks[..dst_layout.blocks_for(num_tokens)]);
            let upload = |t: &[u32]| stream.clone_htod(t).map_err(|e| failed(e.into()));
            Some((upload(s)?, upload(d)?))
        } else {
            None
        };
        let mut copies = 0;
        for (layers, fence) in fences.groups(self.layout.num_layers) {
            match fence.map(|f| (f.event(), f)) {
                Some((Some(event), _)) => stream.wait(event).map_err(|e| failed(e.into()))?,
                // A group a host thread computes: queued once it is written.
                Some((None, fence)) => fence.wait()?,
                None => {}
            }
            match &tables {
                Some(tables) => {
                    self.scatter(&stream, src, (dst_layout, dst_base), tables, num_tokens, layers).map_err(failed)?;
                    copies += 1;
                }
                None => {
                    // All layers at once is the plan made above.
                    let group;
                    let plan = if layers.len() == self.layout.num_layers {
                        &whole
                    } else {
                        group = plan_kv_copy_layers(
                            &self.layout,
                            dst_layout,
                            self.elem_bytes(),
                            src_blocks,
                            dst_blocks,
                            num_tokens,
                            layers,
                        )?;
                        &group
                    };
                    self.run(&stream, plan, src, dst_base).map_err(failed)?;
                    copies += plan.len();
                }
            }
        }
        self.wait(&stream).map_err(failed)?;
        Ok((bytes, copies))
    }

    /// The `--kv-verify` digest ([`crate::kv_digest`]) of tokens `0..num_tokens` held in
    /// `blocks` of the cache, computed on the transfer stream (one launch; this thread sleeps
    /// until it is done). The caller holds the blocks: no step writes them meanwhile.
    pub fn digest(&self, blocks: &[u32], num_tokens: usize) -> Result<u64, String> {
        let blocks = check_blocks(&self.layout, blocks, num_tokens)?;
        let l = &self.layout;
        let planes = l.num_layers * 2 * l.num_kv_heads;
        let per_plane = num_tokens * l.head_dim;
        if per_plane == 0 {
            return Ok(0); // no element: the empty sum (and an empty grid is not a launch)
        }
        let too_big = |n: usize| u32::try_from(n).map_err(|_| format!("{n} is too large for a KV digest"));
        let args = [
            too_big(num_tokens)?,
            too_big(planes)?,
            too_big(l.head_dim)?,
            too_big(l.block_size)?,
            too_big(self.elem_bytes())?,
        ];
        too_big(per_plane)?;
        let failed = |e: CudaError| format!("KV digest failed: {e:?}");
        self.ctx.bind_to_thread().map_err(|e| failed(e.into()))?;
        let stream = &self.stream;
        let table = stream.clone_htod(blocks).map_err(|e| failed(e.into()))?;
        let mut sum = stream.alloc_zeros::<u64>(1).map_err(|e| failed(e.into()))?;
        let cfg = LaunchConfig {
            grid_dim: (per_plane.div_ceil(256).min(1024) as u32, planes.min(65_535) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = stream.launch_builder(&self.digest);
        b.arg(&self.alloc.ptr).arg(&table).arg(&args[0]).arg(&args[1]).arg(&args[2]).arg(&args[3]).arg(&args[4]);
        b.arg(&mut sum);
        // Safety: the arguments match kv_digest's signature; `check_blocks` kept every block id
        // inside the cache and the table covers the tokens, so every element read lies inside
        // the allocation (`layout` in `dtype`); `sum` is one u64 the kernel adds into; the copy
        // below waits for the launch before either buffer drops.
        unsafe { b.launch(cfg) }.map_err(|e| failed(e.into()))?;
        let host = stream.clone_dtoh(&sum).map_err(|e| failed(e.into()))?;
        self.wait(stream).map_err(failed)?;
        host.first().copied().ok_or_else(|| "KV digest: nothing came back".to_string())
    }

    /// Copies `blocks` of the cache into the same blocks of `host` (its host copy: same layout,
    /// bf16, page-locked for speed) on the transfer stream, and waits for the copies.
    ///
    /// # Safety
    /// As [`DeviceKvMemory::host_copies`] and [`HostCopies::download`], for `blocks`.
    pub unsafe fn download(&self, blocks: &[u32], host: &KvRegion) -> Result<(), String> {
        let mut copies = self.host_copies(host)?;
        for run in coalesce(blocks) {
            // Safety: passed on from the caller.
            unsafe { copies.download(run, 0..self.layout.num_layers)? };
        }
        copies.wait_all()
    }

    /// Copies between the cache and `host`, its host copy (same layout, bf16, page-locked so
    /// that the copies run while this thread does other work), queued piece by piece on the
    /// transfer stream. The KV connector's tcp transport uses them to move one piece on the
    /// socket while the next one copies.
    pub fn host_copies<'a>(&'a self, host: &'a KvRegion) -> Result<HostCopies<'a>, String> {
        if host.layout() != &self.layout || host.dtype() != self.dtype {
            return Err("the host copy's layout differs from the device cache's".into());
        }
        self.ctx.bind_to_thread().map_err(|e| format!("binding the CUDA context: {e}"))?;
        Ok(HostCopies { mem: self, host, stream: self.stream.clone(), events: Vec::new() })
    }

    /// [`DeviceKvMemory::host_copies`] on a stream of their own: copies that wait on the device
    /// for a step still running ([`HostCopies::after`]) hold up no other transfer's copies, as
    /// they would on the connector's shared stream.
    pub fn host_copies_apart<'a>(&'a self, host: &'a KvRegion) -> Result<HostCopies<'a>, String> {
        let mut copies = self.host_copies(host)?;
        copies.stream = self.ctx.new_stream().map_err(|e| format!("creating a KV copy stream: {e}"))?;
        Ok(copies)
    }

    /// Queues one `kv_scatter` launch on `stream` (a transfer stream) moving tokens `0..num_tokens` of
    /// `layers` from our blocks `tables.0` into `tables.1` (device copies of the tables) of the
    /// cache laid out as `dst.0` at `dst.1`. The tables were checked by `plan_kv_copy` (enough
    /// blocks, every id inside its cache); the caller waits for the stream before they drop.
    fn scatter(
        &self,
        stream: &CudaStream,
        src: sys::CUdeviceptr,
        dst: (&KvLayout, sys::CUdeviceptr),
        tables: &(CudaSlice<u32>, CudaSlice<u32>),
        num_tokens: usize,
        layers: std::ops::Range<usize>,
    ) -> Result<(), CudaError> {
        let (dst_layout, dst_base) = dst;
        let l = &self.layout;
        let planes = l.num_layers * 2 * l.num_kv_heads;
        let (first_plane, group_planes) = (layers.start * 2 * l.num_kv_heads, layers.len() * 2 * l.num_kv_heads);
        if layers.is_empty() || layers.end > l.num_layers {
            return Err(CudaError::Unavailable(format!(
                "layers {layers:?} are not inside the {} layers",
                l.num_layers
            )));
        }
        let token_vecs = l.head_dim * self.elem_bytes() / 16;
        let per_plane = num_tokens * token_vecs;
        if per_plane == 0 {
            return Ok(()); // an empty grid is not a launch
        }
        let too_big =
            |n: usize| u32::try_from(n).map_err(|_| CudaError::Unavailable(format!("{n} is too large a copy")));
        let dims = [too_big(num_tokens)?, too_big(planes)?, too_big(token_vecs)?, too_big(l.block_size)?];
        let group = [too_big(first_plane)?, too_big(group_planes)?];
        too_big(per_plane)?;
        let cfg = LaunchConfig {
            grid_dim: (per_plane.div_ceil(256).min(1 << 16) as u32, group_planes.min(65_535) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let dst_bs = too_big(dst_layout.block_size)?;
        let mut b = stream.launch_builder(&self.scatter);
        b.arg(&src).arg(&dst_base).arg(&tables.0).arg(&tables.1);
        b.arg(&dims[0]).arg(&dims[1]).arg(&dims[2]).arg(&dims[3]).arg(&dst_bs);
        b.arg(&group[0]).arg(&group[1]);
        // Safety: the arguments match kv_scatter's signature; `plan_kv_copy` checked that the
        // tables cover the tokens with ids inside both caches, whose shapes (but block size and
        // count) are equal, and the planes `first_plane..first_plane + group_planes` lie inside
        // a block (checked above), so every vector read and written lies inside `src`'s and
        // `dst_base`'s caches; rows are whole 16-byte vectors and block offsets multiples of a
        // row, so the vector accesses are aligned; the caller's wait on the stream ends the
        // kernel's use of all.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Blocks (asleep, not spinning beside the engine's thread) until `stream`'s work so far
    /// has completed.
    fn wait(&self, stream: &CudaStream) -> Result<(), CudaError> {
        let done = self.ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))?;
        done.record(stream)?;
        done.synchronize()?;
        Ok(())
    }

    /// Queues `plan` from `src` to `dst` on `stream` (the caller waits for it).
    fn run(
        &self,
        stream: &CudaStream,
        plan: &[KvCopy],
        src: sys::CUdeviceptr,
        dst: sys::CUdeviceptr,
    ) -> Result<(), CudaError> {
        let s = stream.cu_stream();
        for c in plan {
            match *c {
                // Safety (both arms): `plan_kv_copy` keeps every copy inside both caches, and
                // `src`/`dst` are their bases (ours, or the peer's mapping, alive while `self`
                // and the peer are borrowed); the caller's wait on the stream ends the copies' use
                // of them.
                KvCopy::Linear { src: so, dst: d, bytes } => unsafe {
                    sys::cuMemcpyDtoDAsync_v2(dst + d as u64, src + so as u64, bytes, s).result()?
                },
                KvCopy::Pitched { src: so, src_pitch, dst: d, dst_pitch, width, rows } => {
                    let p = sys::CUDA_MEMCPY2D {
                        srcXInBytes: 0,
                        srcY: 0,
                        srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                        srcHost: std::ptr::null(),
                        srcDevice: src + so as u64,
                        srcArray: std::ptr::null_mut(),
                        srcPitch: src_pitch,
                        dstXInBytes: 0,
                        dstY: 0,
                        dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                        dstHost: std::ptr::null_mut(),
                        dstDevice: dst + d as u64,
                        dstArray: std::ptr::null_mut(),
                        dstPitch: dst_pitch,
                        WidthInBytes: width,
                        Height: rows,
                    };
                    unsafe { sys::cuMemcpy2DAsync_v2(&p, s).result()? }
                }
            }
        }
        Ok(())
    }
}

/// Copies between a device cache and its host copy, each piece followed by an event of its
/// own ([`DeviceKvMemory::host_copies`]). Pieces complete in the order they were queued.
/// Dropping it waits for the copies still queued: they read or write the host copy's bytes.
pub struct HostCopies<'a> {
    mem: &'a DeviceKvMemory,
    host: &'a KvRegion,
    /// Where the copies are queued: the connector's stream, or one of their own.
    stream: Arc<CudaStream>,
    events: Vec<CudaEvent>,
}

/// Which way a [`HostCopies`] copy goes.
enum Direction {
    ToHost,
    ToDevice,
}

impl HostCopies<'_> {
    /// Queues the copy of layers `layers` of `run`'s blocks (all of them: one linear copy; a
    /// group: one pitched copy, a slice of each block) from the device cache into the host
    /// copy; returns its piece number for [`HostCopies::wait`].
    ///
    /// # Safety
    /// The caller holds `run`'s blocks on both sides until the piece has been waited for: their
    /// KV is computed (no step writes them) and nobody reads or writes them in the host copy.
    pub unsafe fn download(&mut self, run: BlockRun, layers: Range<usize>) -> Result<usize, String> {
        // Safety: passed on from the caller.
        unsafe { self.queue(run, layers, Direction::ToHost) }
            .map_err(|e| format!("copying KV to the host copy failed: {e}"))?;
        self.mark()
    }

    /// Queues the copy of layers `layers` of `run`'s blocks from the host copy into the device
    /// cache; returns its piece number for [`HostCopies::wait`].
    ///
    /// # Safety
    /// The caller holds `run`'s blocks on both sides until the piece has been waited for: no
    /// step reads or writes them on the device and nobody writes them in the host copy.
    pub unsafe fn upload(&mut self, run: BlockRun, layers: Range<usize>) -> Result<usize, String> {
        // Safety: passed on from the caller.
        unsafe { self.queue(run, layers, Direction::ToDevice) }
            .map_err(|e| format!("copying KV into the device cache failed: {e}"))?;
        self.mark()
    }

    /// Copies queued from now on start, on the device, only once `event` (a step's mark that a
    /// group of layers has written its KV) has completed; nothing waits on this thread.
    pub fn after(&mut self, event: &CudaEvent) -> Result<(), String> {
        self.stream.wait(event).map_err(|e| format!("queueing a KV copy behind a step: {e}"))
    }

    /// Blocks (asleep) until piece `i` (and every piece before it) has been copied.
    pub fn wait(&self, i: usize) -> Result<(), String> {
        let event = self.events.get(i).ok_or_else(|| format!("no KV copy piece {i}"))?;
        event.synchronize().map_err(|e| format!("waiting for a KV copy: {e}"))
    }

    /// Blocks until every queued piece has been copied.
    pub fn wait_all(&self) -> Result<(), String> {
        match self.events.len() {
            0 => Ok(()),
            n => self.wait(n - 1),
        }
    }

    /// Queues the copy of `layers` of `run` one way; an error if either lies outside the cache.
    ///
    /// # Safety
    /// As [`HostCopies::download`] and [`HostCopies::upload`].
    unsafe fn queue(&self, run: BlockRun, layers: Range<usize>, way: Direction) -> Result<(), String> {
        let (first, count) = (run.start as usize, run.len as usize);
        let l = &self.mem.layout;
        if first + count > l.num_blocks || layers.start >= layers.end || layers.end > l.num_layers {
            return Err(format!("blocks {first}+{count}, layers {layers:?} are outside the cache"));
        }
        let block_bytes = l.block_elems() * self.mem.elem_bytes();
        let layer_bytes = block_bytes / l.num_layers;
        // Safety: only the address is taken here (bounds checked by `bytes_mut`); the callers'
        // contracts cover the copies that use it.
        let host = unsafe { self.host.bytes_mut(first, count) }.as_mut_ptr();
        let device = self.mem.alloc.ptr + (first * block_bytes) as u64;
        let stream = self.stream.cu_stream();
        // Safety: both spans lie inside their caches (checked above); the caller holds the
        // blocks, and the piece's event, waited for before they are used or given back (at
        // the latest on drop), ends the copy's use of them.
        unsafe {
            if layers.len() == l.num_layers {
                let bytes = count * block_bytes;
                return match way {
                    Direction::ToHost => sys::cuMemcpyDtoHAsync_v2(host.cast(), device, bytes, stream),
                    Direction::ToDevice => sys::cuMemcpyHtoDAsync_v2(device, host.cast_const().cast(), bytes, stream),
                }
                .result()
                .map_err(|e| e.to_string());
            }
            // The group's slice of each block: `count` rows at the block's pitch.
            let offset = layers.start * layer_bytes;
            let (host_at, device_at) = (host.add(offset), device + offset as u64);
            let (src_type, dst_type) = match way {
                Direction::ToHost => (sys::CUmemorytype::CU_MEMORYTYPE_DEVICE, sys::CUmemorytype::CU_MEMORYTYPE_HOST),
                Direction::ToDevice => (sys::CUmemorytype::CU_MEMORYTYPE_HOST, sys::CUmemorytype::CU_MEMORYTYPE_DEVICE),
            };
            let to_host = matches!(way, Direction::ToHost);
            let p = sys::CUDA_MEMCPY2D {
                srcXInBytes: 0,
                srcY: 0,
                srcMemoryType: src_type,
                srcHost: if to_host { std::ptr::null() } else { host_at.cast_const().cast() },
                srcDevice: if to_host { device_at } else { 0 },
                srcArray: std::ptr::null_mut(),
                srcPitch: block_bytes,
                dstXInBytes: 0,
                dstY: 0,
                dstMemoryType: dst_type,
                dstHost: if to_host { host_at.cast() } else { std::ptr::null_mut() },
                dstDevice: if to_host { 0 } else { device_at },
                dstArray: std::ptr::null_mut(),
                dstPitch: block_bytes,
                WidthInBytes: layers.len() * layer_bytes,
                Height: count,
            };
            sys::cuMemcpy2DAsync_v2(&p, stream).result().map_err(|e| e.to_string())
        }
    }

    fn mark(&mut self) -> Result<usize, String> {
        let record = || -> Result<CudaEvent, CudaError> {
            let event = self.mem.ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))?;
            event.record(&self.stream)?;
            Ok(event)
        };
        let event = record().map_err(|e| format!("recording a KV copy's event: {e}"))?;
        self.events.push(event);
        Ok(self.events.len() - 1)
    }
}

impl Drop for HostCopies<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.wait_all() {
            tracing::error!(error = %e, "a KV copy between the device cache and its host copy failed at teardown");
        }
    }
}

/// The driver's handle of GPU `ordinal` (an error if there is none).
fn device_handle(ordinal: usize) -> Result<sys::CUdevice, String> {
    let mut dev: sys::CUdevice = 0;
    // Safety: writes a local; an ordinal out of range is an error return.
    unsafe { sys::cuDeviceGet(&mut dev, ordinal as i32) }.result().map_err(|e| format!("{e:?}"))?;
    Ok(dev)
}

#[cfg(test)]
mod tests {
    use super::IpcExport;

    #[test]
    fn exports_round_trip_through_hex_and_malformed_ones_are_refused() {
        let e = IpcExport { handle: std::array::from_fn(|i| i as u8 * 3), bytes: 1 << 30, device_uuid: [0xab; 16] };
        let (handle, device) = e.to_hex();
        assert_eq!(IpcExport::from_hex(&handle, e.bytes, &device), Some(e));
        assert_eq!(IpcExport::from_hex(&handle[2..], 1, &device), None, "too short");
        assert_eq!(IpcExport::from_hex(&handle, 1, &device.replace('a', "g")), None, "not hex");
    }
}
