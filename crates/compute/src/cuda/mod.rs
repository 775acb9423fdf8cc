//! The CUDA backend: a device, its stream, cuBLAS for the matrix products and this project's
//! own kernels (`kernels/`) for everything else.
//!
//! CUDA libraries are loaded at run time (cudarc's dynamic loading): a build made on a machine
//! without CUDA runs there on CPU, and [`CudaDevice::open`] says why a GPU is not usable instead
//! of failing to start. Kernels are compiled with NVRTC on first use; the compiled images are
//! kept for the process, and on disk in the directory the caller names (keyed by the source
//! hash and the GPU arch: [`kernel_cache_path`]).
//!
//! Everything runs on one stream. Buffers are handed to kernels as raw device addresses
//! ([`DevBuf::ptr`]), so the launches in [`ops`] are `unsafe fn`s: their callers keep every
//! buffer alive and large enough for as long as work that uses it may be queued (the model
//! owns its buffers for its whole life and synchronizes before it returns results).

mod fences;
mod fp8_gemm;
mod invariant;
mod ipc;
mod nccl;
pub mod ops;
mod source;
mod tuning;

pub use fences::{HostFence, HostSignal, KvFence, KvFences};
pub use fp8_gemm::fp8_act_scale_ld;
pub use ipc::{DeviceKvMemory, DeviceScratch, HostCopies, IpcExport, PeerKvMemory};
pub use nccl::Communicator;
pub use source::{KERNEL_NAMES, KERNEL_SOURCE};
pub use tuning::{kv_fence_ends, CudaTuning, WgmmaPrefill};

use std::path::{Path, PathBuf};
use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DeviceRepr};
use cudarc::nvrtc::Ptx;

/// A host KV region page-locked for device copies ([`CudaDevice::pin_region`]).
pub struct PinnedRegion {
    region: Arc<crate::KvRegion>,
    ctx: Arc<CudaContext>,
}

impl Drop for PinnedRegion {
    fn drop(&mut self) {
        let (ptr, _) = self.region.raw_bytes();
        // Nothing useful to do on failure: the memory is freed (and so unpinned) with the region.
        let _ = self.ctx.bind_to_thread();
        // Safety: the range was registered by `pin_region` and is still allocated (we hold it).
        let _ = unsafe { cudarc::driver::sys::cuMemHostUnregister(ptr.cast()) };
    }
}

/// Why the CUDA backend could not do something.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// A CUDA library is missing or no device is present.
    #[error("CUDA is not available: {0}")]
    Unavailable(String),
    /// The driver API failed.
    #[error("CUDA driver error: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    /// cuBLAS failed.
    #[error("cuBLAS error: {0}")]
    Blas(#[from] cudarc::cublas::result::CublasError),
    /// NVRTC could not compile the kernels.
    #[error("compiling the CUDA kernels for {arch} failed:\n{log}")]
    Compile {
        /// Target arch, e.g. `sm_90`.
        arch: String,
        /// The compiler's log.
        log: String,
    },
    /// Not enough device memory.
    #[error("out of GPU memory: {0}")]
    OutOfMemory(String),
}

/// Checks that the CUDA driver, cuBLAS and NVRTC libraries can be loaded, without touching a
/// device. The message names what is missing.
pub fn libraries_present() -> Result<(), CudaError> {
    // Safety: these only try to dlopen the libraries by name.
    let (driver, blas, nvrtc) = unsafe {
        (
            cudarc::driver::sys::is_culib_present(),
            cudarc::cublas::sys::is_culib_present(),
            cudarc::nvrtc::sys::is_culib_present(),
        )
    };
    let missing: Vec<&str> = [(driver, "libcuda (the NVIDIA driver)"), (blas, "libcublas"), (nvrtc, "libnvrtc")]
        .iter()
        .filter(|(ok, _)| !ok)
        .map(|(_, n)| *n)
        .collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(CudaError::Unavailable(format!(
            "cannot load {} (set LD_LIBRARY_PATH to the CUDA 13 libraries)",
            missing.join(", ")
        )))
    }
}

/// Whether NVRTC alone can be loaded (enough to compile kernels, e.g. in CI without a GPU).
pub fn nvrtc_present() -> bool {
    // Safety: only tries to dlopen the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

fn source_hash() -> u64 {
    // FNV-1a: stable across builds and platforms (std's hasher is not).
    let mut h = 0xcbf29ce484222325u64;
    for b in KERNEL_SOURCE.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x100000001b3);
    }
    h
}

/// Whether a compiled image defines kernel `name`: its ELF string tables hold the whole name
/// (`gemv_norm_bf16_m1` is also the start of `gemv_norm_bf16_m1_pipe`) or its `.text.` section.
pub fn image_defines(cubin: &[u8], name: &str) -> bool {
    let text = format!(".text.{name}");
    cubin.split(|&b| b == 0).any(|sym| sym == name.as_bytes() || sym == text.as_bytes())
}

/// The kernels compile as this many separate programs (KERNEL_GROUPS in common.cuh), in
/// parallel: a cold start on a 16-core GPU machine waits for the largest group, not for all.
pub const KERNEL_GROUPS: usize = 6;

/// Where the compiled image of kernel group `group` for `arch` (e.g. `sm_90`) is cached in the
/// cache directory `dir`: `kernels-<source hash>-<arch>-g<group>.cubin`.
pub fn kernel_cache_path(dir: &Path, arch: &str, group: usize) -> PathBuf {
    dir.join(format!("kernels-{:016x}-{arch}-g{group}.cubin", source_hash()))
}

/// Compiles [`KERNEL_SOURCE`] for `arch` (e.g. `sm_90`) with NVRTC: one CUBIN per kernel
/// group, compiled on parallel threads. Needs only the NVRTC library, not a GPU.
pub fn compile_kernels(arch: &str) -> Result<Vec<Vec<u8>>, CudaError> {
    compile_groups(arch, &(0..KERNEL_GROUPS).collect::<Vec<_>>())
}

/// The CUBINs of kernel `groups` for `arch`, compiled on one thread each (NVRTC programs are
/// independent), in the order asked.
fn compile_groups(arch: &str, groups: &[usize]) -> Result<Vec<Vec<u8>>, CudaError> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = groups.iter().map(|&g| scope.spawn(move || compile_group(arch, g))).collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(CudaError::Compile { arch: arch.to_string(), log: "the NVRTC thread panicked".into() })
                })
            })
            .collect()
    })
}

/// Compiles kernel group `group` of [`KERNEL_SOURCE`] for `arch`.
fn compile_group(arch: &str, group: usize) -> Result<Vec<u8>, CudaError> {
    use cudarc::nvrtc::{result, sys};
    let fail = |log: String| CudaError::Compile { arch: arch.to_string(), log };
    let src = std::ffi::CString::new(KERNEL_SOURCE).map_err(|e| fail(e.to_string()))?;
    let name = std::ffi::CString::new("tandem_kernels.cu").map_err(|e| fail(e.to_string()))?;
    let prog = result::create_program(&src, Some(&name)).map_err(|e| fail(format!("{e:?}")))?;
    let mut opts = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "--use_fast_math".to_string(),
        "--fmad=true".to_string(),
    ];
    opts.push(format!("-DTANDEM_GROUP={group}"));
    // Safety: `prog` is a live program created above and destroyed once at the end; the
    // buffers handed to NVRTC are sized from the sizes it reports.
    unsafe {
        let compiled = result::compile_program(prog, &opts);
        let out = match compiled {
            Err(e) => {
                let log = result::get_program_log(prog)
                    .map(|l| std::ffi::CStr::from_ptr(l.as_ptr()).to_string_lossy().into_owned())
                    .unwrap_or_default();
                Err(fail(format!("{e:?}\n{log}")))
            }
            Ok(()) => {
                let mut size = 0usize;
                let status = sys::nvrtcGetCUBINSize(prog, &mut size);
                if status != sys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
                    Err(fail(format!("no CUBIN produced ({status:?})")))
                } else {
                    let mut cubin = vec![0u8; size];
                    let status = sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast());
                    if status == sys::nvrtcResult::NVRTC_SUCCESS {
                        Ok(cubin)
                    } else {
                        Err(fail(format!("reading the CUBIN failed ({status:?})")))
                    }
                }
            }
        };
        let _ = result::destroy_program(prog);
        out
    }
}

/// A device allocation with its raw address, for kernel arguments.
pub struct DevBuf<T> {
    backing: Backing<T>,
    ptr: u64,
    len: usize,
}

/// Where a buffer's memory comes from.
enum Backing<T> {
    /// The stream's allocator (stream-ordered pool memory where the driver has it).
    Stream(#[allow(dead_code)] CudaSlice<T>), // held for its Drop
    /// One `cuMemAlloc` allocation another process can map (the KV cache).
    Exportable(Arc<ipc::ExportableAlloc>),
}

impl<T: DeviceRepr> DevBuf<T> {
    fn wrap(slice: CudaSlice<T>, stream: &CudaStream) -> Self {
        let ptr = {
            let (ptr, _sync) = slice.device_ptr(stream);
            ptr
        };
        let len = slice.len();
        Self { backing: Backing::Stream(slice), ptr, len }
    }

    /// The exportable allocation behind this buffer, if it has one.
    pub(crate) fn exportable(&self) -> Option<&Arc<ipc::ExportableAlloc>> {
        match &self.backing {
            Backing::Exportable(a) => Some(a),
            Backing::Stream(_) => None,
        }
    }

    /// Device address of element 0.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Device address of element `i`.
    pub fn ptr_at(&self, i: usize) -> u64 {
        self.ptr + (i * std::mem::size_of::<T>()) as u64
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Page-locked host memory for copies that return at once ([`CudaDevice::upload_async`],
/// [`CudaDevice::download_async`]): a copy from pageable memory may make the host wait for the
/// stream, which would let the engine thread stall on the previous step's kernels. One copy at
/// a time: touching the host side ([`HostStaging::host`], [`HostStaging::host_mut`]) first
/// waits for the last copy queued with it.
pub struct HostStaging<T> {
    host: cudarc::driver::PinnedHostSlice<T>,
    /// Recorded on the stream after each copy; the host side is free once it has completed.
    done: cudarc::driver::CudaEvent,
}

impl<T: DeviceRepr + cudarc::driver::ValidAsZeroBits> HostStaging<T> {
    /// Elements.
    pub fn len(&self) -> usize {
        self.host.len()
    }

    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.host.is_empty()
    }

    /// Waits for the last copy queued with this buffer (spinning: the engine thread waits on
    /// the step's tokens here), then gives the host side.
    pub fn host(&self) -> Result<&[T], CudaError> {
        self.done.synchronize()?;
        Ok(self.host.as_slice()?)
    }

    /// Waits like [`HostStaging::host`], then gives the host side to fill.
    pub fn host_mut(&mut self) -> Result<&mut [T], CudaError> {
        self.done.synchronize()?;
        Ok(self.host.as_mut_slice()?)
    }
}

impl<T> Drop for HostStaging<T> {
    fn drop(&mut self) {
        // The pinned memory is freed after this: no copy may still be using it.
        let _ = self.done.synchronize();
    }
}

/// A point in the stream's work ([`CudaDevice::fence`]).
pub struct Fence(cudarc::driver::CudaEvent);

impl Fence {
    /// Waits until the stream has passed the point.
    pub fn wait(&self) -> Result<(), CudaError> {
        Ok(self.0.synchronize()?)
    }
}

/// Loaded kernels, by name.
pub struct Kernels {
    _modules: Vec<Arc<CudaModule>>,
    funcs: std::collections::HashMap<&'static str, CudaFunction>,
}

impl Kernels {
    /// The kernel `name` (one of [`KERNEL_NAMES`]).
    pub(crate) fn get(&self, name: &str) -> &CudaFunction {
        // Every name is loaded (and checked) in `CudaDevice::open`; asking for another is a
        // programming error in this crate.
        &self.funcs[name]
    }
}

/// One GPU: context, stream, cuBLAS handle and the compiled kernels.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    _blas_workspace: CudaSlice<u8>,
    kernels: Kernels,
    ordinal: usize,
    name: String,
    arch: String,
    sm_count: u32,
    /// Dynamic shared memory a decode-projection block may use.
    gemv_smem: usize,
    /// Dynamic shared memory a tensor-core decode-projection block may use.
    gemv_mma_smem: usize,
    /// Dynamic shared memory a bulk-build decode-projection block may use.
    gemv_bulk_smem: usize,
    /// Shared memory per multiprocessor.
    smem_per_sm: usize,
    /// Kernel choices fixed at open.
    tuning: CudaTuning,
    /// Hopper or later: programmatic dependent launch is available.
    pdl_capable: bool,
    /// Ada or later: the tensor cores multiply e4m3 bytes (`mma` of kind e4m3).
    fp8_mma_capable: bool,
    /// The kernels were compiled for sm_90a, so the warpgroup-MMA kernels run.
    wgmma_capable: bool,
    /// The batch-invariant matrix products, once [`CudaDevice::enable_batch_invariant`] ran.
    invariant_gemm: std::sync::OnceLock<invariant::InvariantGemm>,
    /// The FP8 block-scaled products, once [`CudaDevice::enable_fp8_gemm`] ran.
    fp8_gemm: std::sync::OnceLock<fp8_gemm::Fp8Gemm>,
    /// The skinny kernels serve batch-invariant products of few rows: they gave cuBLASLt's bits
    /// on this GPU for the weights they serve ([`ops::verify_skinny`]).
    skinny_verified: std::sync::atomic::AtomicBool,
    /// The fused norm + skinny products gave the unfused path's bits on this GPU
    /// ([`ops::verify_skinny_norm`]).
    skinny_norm_verified: std::sync::atomic::AtomicBool,
}

// Safety: the device is used from one thread at a time (the engine thread owns its model);
// cudarc's handles are Send, and the raw cuBLAS handle is bound to our own stream.
unsafe impl Send for CudaDevice {}

impl CudaDevice {
    /// Opens GPU `ordinal` with the default tuning: loads the libraries, creates the stream
    /// and cuBLAS handle, and loads the kernels (compiling them with NVRTC if no cached image
    /// matches).
    pub fn open(ordinal: usize) -> Result<Self, CudaError> {
        Self::open_tuned(ordinal, CudaTuning::default())
    }

    /// [`CudaDevice::open`] with `tuning`.
    pub fn open_tuned(ordinal: usize, tuning: CudaTuning) -> Result<Self, CudaError> {
        Self::open_with(ordinal, tuning, None)
    }

    /// [`CudaDevice::open_tuned`], the compiled kernels also cached in `kernel_cache` (a
    /// directory, made if missing): a later process starts without compiling them.
    pub fn open_with(ordinal: usize, tuning: CudaTuning, kernel_cache: Option<&Path>) -> Result<Self, CudaError> {
        libraries_present()?;
        let count = CudaContext::device_count().map_err(|e| CudaError::Unavailable(format!("{e:?}")))?;
        if ordinal >= count.max(0) as usize {
            return Err(CudaError::Unavailable(format!("cuda:{ordinal} requested but {count} GPU(s) are visible")));
        }
        let ctx = CudaContext::new(ordinal)?;
        // One stream, every buffer owned for the model's life: cudarc's per-buffer event
        // tracking would only add overhead (and break graph capture).
        // Safety: we use a single stream; see the module docs.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream()?;
        let blas = CudaBlas::new(stream.clone())?;
        // A fixed cuBLAS workspace, so no allocation happens inside a CUDA graph capture.
        let workspace_bytes = 32 << 20;
        let workspace = stream.alloc_zeros::<u8>(workspace_bytes)?;
        {
            let (wptr, _s) = workspace.device_ptr(&stream);
            // Safety: the workspace lives as long as the handle (both owned by self).
            unsafe {
                cudarc::cublas::sys::cublasSetWorkspace_v2(*blas.handle(), wptr as *mut _, workspace_bytes).result()?;
            }
        }
        let (major, minor) = ctx.compute_capability()?;
        // sm_90a (H100, H200) has the warpgroup MMAs (wgmma) the Hopper prefill kernel uses;
        // its images run only on compute capability 9.0, as the cache's name by arch keeps them.
        let arch = if (major, minor) == (9, 0) { "sm_90a".to_string() } else { format!("sm_{major}{minor}") };
        let name = ctx.name()?;
        let sm_count =
            ctx.attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        let attr = |a| ctx.attribute(a).map(|v| v.max(0) as usize);
        let smem_block_optin =
            attr(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
        let smem_per_sm =
            attr(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR)?;
        let cubins = Self::cubins(&arch, kernel_cache)?;
        // Each kernel is in exactly one group's image: ask that module only (a failed lookup
        // in the others is an API error that compute-sanitizer reports).
        let holders: Vec<Option<usize>> =
            KERNEL_NAMES.iter().map(|n| cubins.iter().position(|c| image_defines(c, n))).collect();
        let modules =
            cubins.into_iter().map(|cubin| ctx.load_module(Ptx::from_binary(cubin))).collect::<Result<Vec<_>, _>>()?;
        let mut funcs = std::collections::HashMap::new();
        for (&n, holder) in KERNEL_NAMES.iter().zip(holders) {
            let f = holder.and_then(|g| modules[g].load_function(n).ok()).ok_or_else(|| {
                CudaError::Unavailable(format!("kernel {n} is in none of the compiled images (stale cache?)"))
            })?;
            funcs.insert(n, f);
        }
        // Kernels that keep more than the default 48 KiB of dynamic shared memory.
        let allow_smem = |name: &str, bytes: usize| {
            funcs[name].set_attribute(
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
        };
        let named = |prefix: &'static str| KERNEL_NAMES.iter().copied().filter(move |n| n.starts_with(prefix));
        // The prefill kernels keep two stages of K/V tiles.
        for (name, hd) in [
            ("flash_prefill_hd64", 64),
            ("flash_prefill_hd128", 128),
            ("flash_prefill_packed_hd64", 64),
            ("flash_prefill_packed_hd128", 128),
            ("flash_prefill_split_hd64", 64),
            ("flash_prefill_split_hd128", 128),
        ] {
            allow_smem(name, ops::flash_smem_bytes(hd) as usize)?;
        }
        allow_smem("flash_prefill_wgmma_hd128", ops::WGMMA_PREFILL_SMEM_BYTES as usize)?;
        allow_smem("flash_prefill_wgmma_pp_hd128", ops::WGMMA_WS_PREFILL_SMEM_BYTES as usize)?;
        allow_smem("flash_prefill_wgmma_tma_hd128", ops::WGMMA_WS_PREFILL_SMEM_BYTES as usize)?;
        for name in ["flash_prefill_wgmma_packed_hd128", "flash_prefill_wgmma_packed_tma_hd128"] {
            allow_smem(name, ops::WGMMA_PACKED_PREFILL_SMEM_BYTES as usize)?;
        }
        for name in [
            "flash_prefill_wgmma_split_hd128",
            "flash_prefill_wgmma_split_tma_hd128",
            "flash_prefill_wgmma_packed3_hd128",
            "flash_prefill_wgmma_packed3_tma_hd128",
        ] {
            allow_smem(name, ops::WGMMA_WS_PREFILL_SMEM_BYTES as usize)?;
        }
        for name in ["flash_decode_narrow_hd128", "flash_decode_narrow_split_hd128"] {
            allow_smem(name, ops::narrow_smem_bytes(2) as usize)?;
        }
        // The decode attention stages a chunk of keys and values (over 48 KiB for head size 256).
        for name in named("attention_rows_") {
            let e: usize = name.trim_end_matches("_fp8").rsplit("_e").next().and_then(|e| e.parse().ok()).unwrap_or(8);
            allow_smem(name, ops::attention_rows_smem_bytes(32 * e, ops::attention_max_stages(32 * e)) as usize)?;
        }
        for name in named("attention_mma_") {
            let hd = if name.contains("_hd64") { 64 } else { 128 };
            allow_smem(name, ops::attention_mma_smem_bytes(hd, name.ends_with("_fp8")) as usize)?;
        }
        // The decode projections stage their input rows in shared memory (M x K bf16); the
        // tensor-core builds' partial sums (`_mma`, and the FP8 weights' `_fp8`) take more static shared memory.
        // (Their static part as the compiler laid it out, at least GEMV_STATIC_SMEM, which
        // the plans count per block: setting a kernel's limit past what is left fails.)
        let mut gemv_static = ops::GEMV_STATIC_SMEM;
        let tensor_core_build = |n: &str| n.ends_with("_mma") || n.ends_with("_fp8");
        for name in named("gemv_").filter(|n| !tensor_core_build(n) && !n.starts_with("gemv_bulk")) {
            gemv_static = gemv_static.max(funcs[name].shared_size_bytes()?.max(0) as usize);
        }
        let gemv_smem = smem_block_optin.saturating_sub(gemv_static);
        let gemv_mma_smem = smem_block_optin.saturating_sub(ops::GEMV_MMA_STATIC_SMEM);
        // The bulk build keeps its block's weight rows there too (what its static shared
        // memory leaves, as the compiler laid it out).
        let bulk_static = funcs["gemv_bulk_add"].shared_size_bytes()?.max(0) as usize;
        let gemv_bulk_smem = smem_block_optin.saturating_sub(bulk_static);
        for build in [ops::SkinnyBuild::B8, ops::SkinnyBuild::B16] {
            for stages in ops::SKINNY_STAGES {
                allow_smem(build.kernel(stages), ops::skinny_smem_bytes(build.max_tokens(), stages))?;
            }
        }
        // The normed rows of the widest K the norm takes, and the ring of weight stages.
        for stages in ops::SKINNY_WG_STAGES {
            allow_smem(ops::skinny_wg_kernel(stages), ops::skinny_wg_smem_bytes(stages).min(smem_block_optin))?;
        }
        for name in ["gemm_fp8_wg", "gemm_fp8_wg_t32", "gemm_fp8_wg_t64"] {
            allow_smem(name, ops::FP8_WG_SMEM_BYTES.min(smem_block_optin))?;
        }
        for build in ops::SKINNY_NORM_BUILDS {
            let most = ops::skinny_norm_smem_bytes(ops::SKINNY_NORM_MAX_K, build);
            allow_smem(ops::skinny_norm_kernel(build), most.min(smem_block_optin.saturating_sub(2048)))?;
        }
        for name in named("gemv_") {
            let limit = if tensor_core_build(name) {
                gemv_mma_smem
            } else if name.starts_with("gemv_bulk") {
                gemv_bulk_smem
            } else {
                gemv_smem
            };
            allow_smem(name, limit)?;
        }
        let wgmma_capable = arch == "sm_90a";
        Ok(Self {
            ctx,
            stream,
            blas,
            _blas_workspace: workspace,
            kernels: Kernels { _modules: modules, funcs },
            ordinal,
            name,
            arch,
            sm_count,
            gemv_smem,
            gemv_mma_smem,
            gemv_bulk_smem,
            smem_per_sm,
            tuning: CudaTuning { programmatic_launch: major >= 9 && tuning.programmatic_launch, ..tuning },
            pdl_capable: major >= 9,
            fp8_mma_capable: (major, minor) >= (8, 9),
            wgmma_capable,
            invariant_gemm: std::sync::OnceLock::new(),
            fp8_gemm: std::sync::OnceLock::new(),
            skinny_verified: std::sync::atomic::AtomicBool::new(false),
            skinny_norm_verified: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Every kernel group's image for `arch`: from this process's earlier opens or the disk
    /// cache `dir`, the missing ones compiled (in parallel) and kept in both.
    fn cubins(arch: &str, dir: Option<&Path>) -> Result<Vec<Vec<u8>>, CudaError> {
        static COMPILED: std::sync::Mutex<Vec<(String, Vec<Vec<u8>>)>> = std::sync::Mutex::new(Vec::new());
        let compiled = |c: &[(String, Vec<Vec<u8>>)]| c.iter().find(|(a, _)| a == arch).map(|(_, i)| i.clone());
        if let Some(images) = compiled(&COMPILED.lock().unwrap_or_else(|e| e.into_inner())) {
            return Ok(images);
        }
        let paths: Vec<Option<PathBuf>> =
            (0..KERNEL_GROUPS).map(|g| dir.map(|d| kernel_cache_path(d, arch, g))).collect();
        let mut images: Vec<Option<Vec<u8>>> =
            paths.iter().map(|p| p.as_ref().and_then(|p| std::fs::read(p).ok())).collect();
        let missing: Vec<usize> = (0..KERNEL_GROUPS).filter(|&g| images[g].is_none()).collect();
        if missing.is_empty() {
            tracing::debug!(arch, "cached kernels");
        } else {
            let started = std::time::Instant::now();
            tracing::info!(arch, groups = missing.len(), "compiling CUDA kernels with NVRTC (cached for later starts)");
            let compiled = compile_groups(arch, &missing)?;
            tracing::info!(arch, ms = started.elapsed().as_millis() as u64, "compiled CUDA kernels with NVRTC");
            for (g, cubin) in missing.into_iter().zip(compiled) {
                if let Some(p) = &paths[g] {
                    // A cache that cannot be written only costs a compile next time.
                    let tmp = p.with_extension(format!("tmp{}", std::process::id()));
                    let written = p.parent().map(std::fs::create_dir_all).transpose().is_ok()
                        && std::fs::write(&tmp, &cubin).is_ok()
                        && std::fs::rename(&tmp, p).is_ok();
                    if !written {
                        tracing::warn!(path = %p.display(), "could not cache the compiled kernels");
                    }
                }
                images[g] = Some(cubin);
            }
        }
        let images: Vec<Vec<u8>> = images.into_iter().flatten().collect();
        COMPILED.lock().unwrap_or_else(|e| e.into_inner()).push((arch.to_string(), images.clone()));
        Ok(images)
    }

    /// `cuda:N (NAME, sm_XY)`.
    pub fn describe(&self) -> String {
        let tuning = self.tuning.to_string();
        let tuning = if tuning.is_empty() { tuning } else { format!(", tuned {tuning}") };
        format!("cuda:{} ({}, {}{tuning})", self.ordinal, self.name, self.arch)
    }

    /// The GPU's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Multiprocessors (for sizing grid-stride launches).
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    /// Whether kernels are launched with programmatic dependent launch: each may start while
    /// the previous one finishes (its launch and set-up overlap the other's tail) and waits
    /// in-kernel before touching earlier kernels' data (`PDL_ENTER` in common.cuh). Only on a
    /// Hopper or later GPU, and only when tuned so ([`CudaTuning::programmatic_launch`]).
    pub fn programmatic_launch(&self) -> bool {
        self.tuning.programmatic_launch
    }

    /// Makes [`ops::matmul_t_invariant`] available (loads cuBLASLt); fails with what is missing.
    pub fn enable_batch_invariant(&self) -> Result<(), CudaError> {
        if self.invariant_gemm.get().is_none() {
            self.ctx.bind_to_thread()?;
            let gemm = invariant::InvariantGemm::new()?;
            let _ = self.invariant_gemm.set(gemm);
        }
        Ok(())
    }

    pub(crate) fn invariant_gemm(&self) -> Option<&invariant::InvariantGemm> {
        self.invariant_gemm.get()
    }

    /// Makes FP8 products of many rows on cuBLASLt's block-scaled GEMM available
    /// ([`ops::matmul_t_fp8`]): loads cuBLASLt and its workspace (32 MiB); fails with what is
    /// missing (a GPU without the scale modes fails later, at the first product's plan).
    pub fn enable_fp8_gemm(&self) -> Result<(), CudaError> {
        if self.fp8_gemm.get().is_none() {
            self.ctx.bind_to_thread()?;
            let workspace = self.zeros::<u8>(fp8_gemm::Fp8Gemm::workspace_bytes())?;
            let gemm = fp8_gemm::Fp8Gemm::new(workspace, usize::from(self.tuning.fp8_gemm_algo))?;
            let _ = self.fp8_gemm.set(gemm);
        }
        Ok(())
    }

    pub(crate) fn fp8_gemm(&self) -> Option<&fp8_gemm::Fp8Gemm> {
        self.fp8_gemm.get()
    }

    /// Whether batch-invariant products of few rows go to the skinny kernels: tuned so
    /// ([`CudaTuning::invariant_skinny`]) and verified on this GPU ([`ops::verify_skinny`]).
    pub fn invariant_skinny(&self) -> bool {
        self.tuning.invariant_skinny && self.skinny_verified()
    }

    /// Whether the skinny kernels gave cuBLASLt's bits on this GPU for the products the model
    /// asked about ([`ops::verify_skinny`]): the K-sliced products of few rows then use them.
    pub fn skinny_verified(&self) -> bool {
        self.skinny_verified.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub(crate) fn set_skinny_verified(&self, verified: bool) {
        self.skinny_verified.store(verified, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether batch-invariant steps of few tokens fold their norms into the products
    /// (`ops::matmul_t_skinny_norm`) and run the others on the same chains
    /// (`ops::matmul_t_skinny_wg`): tuned so ([`CudaTuning::invariant_fused_norm`]) and
    /// verified on this GPU ([`ops::verify_skinny_norm`]).
    pub fn invariant_fused_norm(&self) -> bool {
        self.tuning.invariant_fused_norm && self.skinny_norm_verified.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub(crate) fn set_skinny_norm_verified(&self, verified: bool) {
        self.skinny_norm_verified.store(verified, std::sync::atomic::Ordering::Relaxed);
    }

    /// The kernel choices this device was opened with.
    pub fn tuning(&self) -> &CudaTuning {
        &self.tuning
    }

    /// Whether programmatic dependent launch is available (Hopper or later), for kernels that
    /// ask for it themselves.
    pub fn pdl_capable(&self) -> bool {
        self.pdl_capable
    }

    /// Whether the tensor cores here multiply e4m3 bytes (Ada and later): the skinny FP8
    /// product ([`ops::matmul_t_fp8_skinny`]) runs.
    pub fn fp8_mma_capable(&self) -> bool {
        self.fp8_mma_capable
    }

    /// Whether the warpgroup-MMA (wgmma) kernels run here: a Hopper GPU (sm_90a images).
    pub fn wgmma_capable(&self) -> bool {
        self.wgmma_capable
    }

    /// Dynamic shared memory one decode-projection block may use, and shared memory per
    /// multiprocessor (for its occupancy).
    pub(crate) fn gemv_smem(&self) -> (usize, usize) {
        (self.gemv_smem, self.smem_per_sm)
    }

    /// Dynamic shared memory one block of the tensor-core decode projection may use.
    pub(crate) fn gemv_mma_smem(&self) -> usize {
        self.gemv_mma_smem
    }

    /// Dynamic shared memory one block of the bulk-build decode projection may use.
    pub(crate) fn gemv_bulk_smem(&self) -> usize {
        self.gemv_bulk_smem
    }

    /// Page-locks `region` (a GPU cache's host copy) so that copies between it and the device
    /// go by DMA at PCIe speed instead of through the driver's staging buffer (and first-touch
    /// page faults); unlocked when the returned guard drops. Touches every page of the region.
    pub fn pin_region(&self, region: &Arc<crate::KvRegion>) -> Result<PinnedRegion, CudaError> {
        let (ptr, bytes) = region.raw_bytes();
        self.ctx.bind_to_thread()?;
        // Safety: ptr..ptr + bytes is the region's live allocation; the guard keeps the region
        // alive (its Arc) until it unregisters the range in Drop.
        unsafe { cudarc::driver::sys::cuMemHostRegister_v2(ptr.cast(), bytes, 0).result()? };
        Ok(PinnedRegion { region: region.clone(), ctx: self.ctx.clone() })
    }

    /// (free, total) device memory in bytes.
    pub fn memory(&self) -> Result<(usize, usize), CudaError> {
        Ok(self.ctx.mem_get_info()?)
    }

    /// The stream all work goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Waits for all queued work.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        Ok(self.stream.synchronize()?)
    }

    /// A zeroed buffer of `n` elements.
    pub fn zeros<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(&self, n: usize) -> Result<DevBuf<T>, CudaError> {
        let s = self.stream.alloc_zeros::<T>(n.max(1)).map_err(|e| oom(e, n * std::mem::size_of::<T>()))?;
        Ok(DevBuf::wrap(s, &self.stream))
    }

    /// A buffer holding a copy of `data`.
    pub fn upload<T: DeviceRepr>(&self, data: &[T]) -> Result<DevBuf<T>, CudaError> {
        let s = if data.is_empty() {
            // Safety: a one-element allocation nobody reads; keeps pointers non-null.
            unsafe { self.stream.alloc::<T>(1)? }
        } else {
            self.stream.clone_htod(data).map_err(|e| oom(e, std::mem::size_of_val(data)))?
        };
        Ok(DevBuf::wrap(s, &self.stream))
    }

    /// Copies `data` into `dst` starting at element `offset`. The copy is from pageable host
    /// memory, so it has completed (been staged) when this returns and `data` may change.
    pub fn write<T: DeviceRepr>(&self, dst: &mut DevBuf<T>, offset: usize, data: &[T]) -> Result<(), CudaError> {
        assert!(offset + data.len() <= dst.len(), "write of {}+{} elements into {}", offset, data.len(), dst.len());
        if data.is_empty() {
            return Ok(());
        }
        self.ctx.bind_to_thread()?;
        // Safety: the destination range lies inside `dst` (checked above). From pageable memory
        // the driver has staged `data` when this returns, so it may change afterwards.
        unsafe { cudarc::driver::result::memcpy_htod_async(dst.ptr_at(offset), data, self.stream.cu_stream())? };
        Ok(())
    }

    /// A page-locked host buffer of `n` zeroed elements for copies that do not wait.
    pub fn host_staging<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<HostStaging<T>, CudaError> {
        // Flags 0, not write-combined: the host reads these back (sampled tokens).
        // Safety: the memory is zeroed below before anything reads it.
        let mut host = unsafe { self.ctx.alloc_pinned_with_flags::<T>(n.max(1), 0)? };
        for v in host.as_mut_slice()? {
            // Safety: T is ValidAsZeroBits.
            *v = unsafe { std::mem::zeroed() };
        }
        // Default flags: synchronizing on it spins (the context's scheduling), where the
        // pinned slice's own event would put the thread to sleep and wake it late.
        let done = self.ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))?;
        Ok(HostStaging { host, done })
    }

    /// Queues a copy of `staging`'s first `n` elements into `dst` from element `offset`;
    /// returns at once (the stream runs it after the work queued before it).
    pub fn upload_async<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        dst: &DevBuf<T>,
        offset: usize,
        staging: &mut HostStaging<T>,
        n: usize,
    ) -> Result<(), CudaError> {
        assert!(offset + n <= dst.len() && n <= staging.len(), "staged upload of {n} elements out of range");
        if n == 0 {
            return Ok(());
        }
        let src = &staging.host_mut()?[..n];
        self.ctx.bind_to_thread()?;
        // Safety: `src` is page-locked memory owned by `staging`, which nobody touches until
        // `done` (recorded right after on the same stream) has completed, and whose Drop waits
        // for it; the destination range lies inside `dst`.
        unsafe { cudarc::driver::result::memcpy_htod_async(dst.ptr_at(offset), src, self.stream.cu_stream())? };
        staging.done.record(&self.stream)?;
        Ok(())
    }

    /// Queues a copy of `src`'s first `n` elements into `staging`; returns at once.
    /// [`HostStaging::host`] waits for it.
    pub fn download_async<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        src: &DevBuf<T>,
        n: usize,
        staging: &mut HostStaging<T>,
    ) -> Result<(), CudaError> {
        self.download_ranges_async(src, &[(0, n)], staging)
    }

    /// Queues copies of `src`'s element ranges `(offset, len)` into `staging`, packed one after
    /// another from its start; returns at once. [`HostStaging::host`] waits for them.
    pub fn download_ranges_async<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        src: &DevBuf<T>,
        ranges: &[(usize, usize)],
        staging: &mut HostStaging<T>,
    ) -> Result<(), CudaError> {
        let total: usize = ranges.iter().map(|&(_, n)| n).sum();
        assert!(
            total <= staging.len() && ranges.iter().all(|&(offset, n)| offset + n <= src.len()),
            "staged download of {ranges:?} from {} elements into {}",
            src.len(),
            staging.len()
        );
        if total == 0 {
            return Ok(());
        }
        let mut dst = &mut staging.host_mut()?[..total];
        for &(offset, n) in ranges {
            let (head, rest) = std::mem::take(&mut dst).split_at_mut(n);
            // Safety: as in `upload_async`: page-locked memory owned by `staging`, untouched by
            // the host until `done` (recorded next) completes, kept alive until then by its Drop.
            unsafe { self.download_into_async(src, offset, head)? };
            dst = rest;
        }
        staging.done.record(&self.stream)?;
        Ok(())
    }

    /// Queues a copy of `dst.len()` elements of `src`, from element `offset`, into `dst`;
    /// returns at once. [`CudaDevice::fence`] after it tells when it has landed.
    ///
    /// # Safety
    /// `dst` must be page-locked (a [`PinnedRegion`]'s memory) and stay allocated and untouched
    /// by the host until a fence recorded after this call has been waited on.
    pub unsafe fn download_into_async<T: DeviceRepr>(
        &self,
        src: &DevBuf<T>,
        offset: usize,
        dst: &mut [T],
    ) -> Result<(), CudaError> {
        assert!(offset + dst.len() <= src.len(), "download of {}+{} elements from {}", offset, dst.len(), src.len());
        if dst.is_empty() {
            return Ok(());
        }
        self.ctx.bind_to_thread()?;
        // Safety: the source range lies inside `src`; the caller keeps `dst` alive and alone.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(dst, src.ptr_at(offset), self.stream.cu_stream())? };
        Ok(())
    }

    /// A marker after everything queued so far; [`Fence::wait`] waits (spinning) for it.
    pub fn fence(&self) -> Result<Fence, CudaError> {
        let event = self.ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))?;
        event.record(&self.stream)?;
        Ok(Fence(event))
    }

    /// Copies the first `n` elements of `src` to the host (waits for queued work).
    pub fn read<T: DeviceRepr + Default + Clone>(&self, src: &DevBuf<T>, n: usize) -> Result<Vec<T>, CudaError> {
        let mut out = vec![T::default(); n];
        self.read_at(src, 0, &mut out)?;
        Ok(out)
    }

    /// Copies `out.len()` elements of `src`, from element `offset`, to the host (waits for
    /// queued work, so it sees every earlier write on the stream).
    pub fn read_at<T: DeviceRepr>(&self, src: &DevBuf<T>, offset: usize, out: &mut [T]) -> Result<(), CudaError> {
        assert!(offset + out.len() <= src.len(), "read of {}+{} elements from {}", offset, out.len(), src.len());
        if !out.is_empty() {
            self.ctx.bind_to_thread()?;
            // Safety: the source range lies inside `src` (checked above); `out` is borrowed
            // until the synchronize below, after which the copy has landed.
            unsafe { cudarc::driver::result::memcpy_dtoh_async(out, src.ptr_at(offset), self.stream.cu_stream())? };
        }
        self.stream.synchronize()?;
        Ok(())
    }

    pub(crate) fn blas(&self) -> &CudaBlas {
        &self.blas
    }

    pub(crate) fn kernels(&self) -> &Kernels {
        &self.kernels
    }

    /// Starts capturing the stream's work into a CUDA graph.
    pub fn begin_capture(&self) -> Result<(), CudaError> {
        Ok(self.stream.begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?)
    }

    /// Ends a capture and instantiates the graph.
    pub fn end_capture(&self) -> Result<Graph, CudaError> {
        let flags = cudarc::driver::sys::CUgraphInstantiate_flags(0);
        let graph = self
            .stream
            .end_capture(flags)?
            .ok_or_else(|| CudaError::Unavailable("stream capture produced no graph".into()))?;
        Ok(Graph(graph))
    }

    /// Times `f` on the stream with CUDA events, in milliseconds.
    pub fn time_ms(&self, f: impl FnOnce() -> Result<(), CudaError>) -> Result<f64, CudaError> {
        let start = self.ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))?;
        let end = self.ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))?;
        start.record(&self.stream)?;
        f()?;
        end.record(&self.stream)?;
        end.synchronize()?;
        Ok(start.elapsed_ms(&end)? as f64)
    }

    /// Device-to-device copy of `bytes` from `src` to `dst` (raw addresses).
    pub fn copy_d2d(&self, dst: u64, src: u64, bytes: usize) -> Result<(), CudaError> {
        // Safety: callers pass addresses of live allocations at least `bytes` long.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream())?;
        }
        Ok(())
    }
}

/// A captured, instantiated CUDA graph that replays on the device's stream.
pub struct Graph(cudarc::driver::CudaGraph);

// Safety: a graph is used by the thread that owns its device (the engine thread); the handle
// moves with the model when the engine starts, it is never shared.
unsafe impl Send for Graph {}

impl Graph {
    /// Queues one replay.
    pub fn launch(&self) -> Result<(), CudaError> {
        Ok(self.0.launch()?)
    }
}

/// Device copy bandwidth in bytes per second, counting bytes read plus bytes written, over a
/// `bytes`-sized device-to-device copy (median of `repeats`). The decode floor's denominator.
pub fn measure_copy_bandwidth(dev: &CudaDevice, bytes: usize, repeats: usize) -> Result<f64, CudaError> {
    let src = dev.zeros::<u8>(bytes)?;
    let dst = dev.zeros::<u8>(bytes)?;
    dev.copy_d2d(dst.ptr(), src.ptr(), bytes)?;
    let mut times: Vec<f64> = (0..repeats.max(1))
        .map(|_| dev.time_ms(|| dev.copy_d2d(dst.ptr(), src.ptr(), bytes)))
        .collect::<Result<_, _>>()?;
    times.sort_by(f64::total_cmp);
    Ok(2.0 * bytes as f64 / (times[times.len() / 2] / 1e3))
}

/// cuBLAS bf16 matrix-product rate in FLOP/s for `m x n x k` (median of `repeats`) on random
/// (not zero) inputs. The prefill floor's denominator.
pub fn measure_gemm_rate(dev: &CudaDevice, m: usize, n: usize, k: usize, repeats: usize) -> Result<f64, CudaError> {
    let a = dev.zeros::<u16>(m * k)?;
    let b = dev.zeros::<u16>(n * k)?;
    let c = dev.zeros::<u16>(m * n)?;
    // Safety: a, b and c hold m x k, n x k and m x n elements and live until the end of this
    // function, after the timed launches have run (time_ms waits for them).
    let gemm = || unsafe { ops::matmul_t(dev, a.ptr(), b.ptr(), c.ptr(), m, n, k, false) };
    unsafe {
        ops::preset_uniform(dev, a.ptr(), (m * k) as u64, 1, 1.0)?;
        ops::preset_uniform(dev, b.ptr(), (n * k) as u64, 2, 1.0)?;
    }
    gemm()?;
    let mut times: Vec<f64> = (0..repeats.max(1)).map(|_| dev.time_ms(gemm)).collect::<Result<_, _>>()?;
    times.sort_by(f64::total_cmp);
    Ok(2.0 * (m * n * k) as f64 / (times[times.len() / 2] / 1e3))
}

fn oom(e: cudarc::driver::DriverError, bytes: usize) -> CudaError {
    if format!("{e:?}").contains("OUT_OF_MEMORY") {
        CudaError::OutOfMemory(format!("allocating {:.1} MiB", bytes as f64 / (1 << 20) as f64))
    } else {
        CudaError::Driver(e)
    }
}

/// Parses `cpu`, `cuda` or `cuda:N`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    /// The CPU backend (f32).
    #[default]
    Cpu,
    /// GPU `N` (bf16).
    Cuda(usize),
}

impl std::str::FromStr for DeviceSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" | "gpu" => Ok(Self::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Self::Cuda)
                .ok_or_else(|| format!("unknown device `{s}`: use cpu, cuda or cuda:N")),
        }
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Cpu => write!(f, "cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_specs_parse_and_print() {
        for (text, spec) in [("cpu", DeviceSpec::Cpu), ("cuda", DeviceSpec::Cuda(0)), ("cuda:3", DeviceSpec::Cuda(3))] {
            assert_eq!(text.parse::<DeviceSpec>(), Ok(spec));
        }
        assert_eq!(DeviceSpec::Cuda(1).to_string(), "cuda:1");
        assert!("tpu".parse::<DeviceSpec>().unwrap_err().contains("unknown device"));
    }

    #[test]
    fn a_kernel_is_found_in_an_image_by_its_whole_name_only() {
        let image = b"\x7fELF\0.shstrtab\0.text.gemv_norm_bf16_m1_pipe\0gemv_norm_bf16_m1_pipe\0\0".as_slice();
        assert!(image_defines(image, "gemv_norm_bf16_m1_pipe"));
        assert!(!image_defines(image, "gemv_norm_bf16_m1"), "a name's prefix is not the name");
        assert!(image_defines(b"\0.text.sample_rows\0", "sample_rows"));
        assert!(!image_defines(b"\0text.sample_rows\0", "sample_rows"));
    }
}
