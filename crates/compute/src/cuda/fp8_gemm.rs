//! FP8 products of many rows on cuBLASLt's block-scaled GEMM (issue 51): `y = x · wᵀ` with the
//! weight as e4m3 bytes and one f32 scale per 128 x 128 block (as FP8 checkpoints hold it) and
//! the activations as e4m3 bytes with one scale per row and 128 columns (`fp8_quantize_rows`),
//! both multiplied on the tensor cores at FP8 rate and each block's partial sums scaled in the
//! kernel (cuBLASLt's `BLK128x128_32F` and `VEC128_32F` scale modes, Hopper, CUDA 12.9 and up).
//!
//! Layouts, in cuBLASLt's column-major view (as `ops::matmul_t` sees `yᵀ = w · xᵀ`): the weight
//! `[n, k]` row-major is A, `k x n` with leading dimension `k`, transposed; its block scales are
//! `[n / 128][k / 128]` row-major (a checkpoint's `weight_scale_inv` as stored; `k / 128` a
//! multiple of 4). The activations `[t, k]` are B, `k x t`, not transposed; their scales are
//! block-major, `[k / 128][ld]` with `ld` = `t` rounded up to 4 (each block's scales over the
//! tokens contiguous, as cuBLASLt's 1D block scaling reads them). The output is `n x t` with
//! leading dimension `n`: `[t, n]` row-major.

use std::collections::HashMap;
use std::sync::Mutex;

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;

use super::invariant::{destroy_layouts, lt_setup, set_desc, set_pref, Plan};
use super::{CudaError, DevBuf};

/// cuBLASLt with the FP8 block-scaled descriptor, its workspace and the plans made with it.
pub(crate) struct Fp8Gemm {
    handle: sys::cublasLtHandle_t,
    desc: sys::cublasLtMatmulDesc_t,
    pref: sys::cublasLtMatmulPreference_t,
    workspace: DevBuf<u8>,
    /// Plans by shape (`None`: cuBLASLt has none for it); the lock also covers the
    /// descriptor's scale pointers, set per call.
    plans: Mutex<HashMap<PlanKey, Option<Plan>>>,
    /// Which of cuBLASLt's heuristic candidates a plan takes (0: its first; past the last: the
    /// last), `CudaTuning::fp8_gemm_algo`.
    candidate: usize,
}

// Safety: used from the owning device's thread one call at a time (the lock above), and
// cuBLASLt handles are not tied to the creating thread.
unsafe impl Send for Fp8Gemm {}
// Safety: every use of the handle and descriptors goes through the plans' lock.
unsafe impl Sync for Fp8Gemm {}

#[derive(Clone, Copy, Hash, PartialEq, Eq)]
struct PlanKey {
    n: usize,
    k: usize,
    t: usize,
    f32_out: bool,
}

/// Plans kept before the cache starts over (prefill chunk sizes vary).
const MAX_PLANS: usize = 4096;

/// Workspace cuBLASLt may use (its FP8 kernels split K with it on some shapes).
const WORKSPACE_BYTES: usize = 32 << 20;

fn blas(e: lt::CublasError) -> CudaError {
    CudaError::Unavailable(format!("cuBLASLt FP8: {e}"))
}

/// The leading dimension of `t` tokens' activation scales (16-byte aligned columns).
pub fn fp8_act_scale_ld(t: usize) -> usize {
    t.div_ceil(4) * 4
}

impl Fp8Gemm {
    /// Loads cuBLASLt and sets up the FP8 block-scaled product (f32 accumulation); `workspace`
    /// is allocated on the device's context, current on this thread; plans take cuBLASLt's
    /// heuristic candidate `candidate` (0: the first).
    pub fn new(workspace: DevBuf<u8>, candidate: usize) -> Result<Self, CudaError> {
        // Safety: only tries to dlopen the library.
        if !unsafe { sys::is_culib_present() } {
            return Err(CudaError::Unavailable("cannot load libcublasLt, which FP8 products of many rows use".into()));
        }
        let (handle, desc, pref) = lt_setup().map_err(blas)?;
        let gemm = Self { handle, desc, pref, workspace, plans: Mutex::new(HashMap::new()), candidate };
        let trans = cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T;
        let block = sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F as i32;
        let vector = sys::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F as i32;
        let workspace = WORKSPACE_BYTES as u64;
        use sys::cublasLtMatmulDescAttributes_t as D;
        // Safety: the descriptor and preference were made above; each attribute gets the type
        // the cuBLASLt documentation gives it (cublasOperation_t, int32 scale modes, uint64).
        unsafe {
            set_desc(desc, D::CUBLASLT_MATMUL_DESC_TRANSA, &trans).map_err(blas)?;
            set_desc(desc, D::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &block).map_err(blas)?;
            set_desc(desc, D::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &vector).map_err(blas)?;
            let max_workspace = sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES;
            set_pref(pref, max_workspace, &workspace).map_err(blas)?;
        }
        Ok(gemm)
    }

    /// The bytes [`Fp8Gemm::new`]'s workspace must hold.
    pub fn workspace_bytes() -> usize {
        WORKSPACE_BYTES
    }

    /// Queues `y[t, n] = x[t, k] · w[n, k]ᵀ` on `stream` (bf16 out, or f32 with `f32_out`) from
    /// the weight's e4m3 bytes `w` and block scales `w_scales` and the activations' bytes `x`
    /// and scales `x_scales` (the module docs give the layouts).
    ///
    /// # Safety
    /// Every pointer is a live device allocation of the stream's context (current on this
    /// thread) holding what the module docs say for these `t`, `n`, `k`, 16-byte aligned;
    /// `k % 128 == 0`, `n % 16 == 0`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn matmul(
        &self,
        stream: sys::cudaStream_t,
        (w, w_scales): (u64, u64),
        (x, x_scales): (u64, u64),
        y: u64,
        (t, n, k): (usize, usize, usize),
        f32_out: bool,
    ) -> Result<(), CudaError> {
        if t == 0 {
            return Ok(());
        }
        let key = PlanKey { n, k, t, f32_out };
        let mut plans = self.plans.lock().unwrap_or_else(|p| p.into_inner());
        use sys::cublasLtMatmulDescAttributes_t as D;
        let (w_scales, x_scales) = (w_scales as *const std::ffi::c_void, x_scales as *const std::ffi::c_void);
        // Safety: the descriptor is this object's; the attributes are device pointers (the
        // caller's), read when a product is planned or queued, both under the lock.
        unsafe {
            set_desc(self.desc, D::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &w_scales).map_err(blas)?;
            set_desc(self.desc, D::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &x_scales).map_err(blas)?;
        }
        if !plans.contains_key(&key) {
            if plans.len() >= MAX_PLANS {
                for p in plans.drain().filter_map(|(_, p)| p) {
                    // Safety: made by `plan`; cuBLASLt reads layouts when a call is queued.
                    unsafe { p.destroy() };
                }
            }
            let plan = self.plan(key);
            if let Err(e) = &plan {
                tracing::debug!("{e}; such products go through a bf16 copy of the weight");
            }
            plans.insert(key, plan.ok());
        }
        let Some(Some(p)) = plans.get(&key) else {
            return Err(CudaError::Unavailable(format!(
                "cuBLASLt has no block-scaled FP8 product for {t} x {k} by {n}"
            )));
        };
        let workspace = (self.workspace.ptr(), WORKSPACE_BYTES);
        // Safety: the caller's contract covers the buffers, the plan's layouts describe them; the
        // workspace is this object's and holds WORKSPACE_BYTES.
        unsafe { p.queue(self.handle, self.desc, (w, x, y), workspace, stream) }.map_err(blas)
    }

    fn plan(&self, key: PlanKey) -> Result<Plan, CudaError> {
        let PlanKey { n, k, t, f32_out } = key;
        let out = if f32_out { sys::cudaDataType::CUDA_R_32F } else { sys::cudaDataType::CUDA_R_16BF };
        let fp8 = sys::cudaDataType::CUDA_R_8F_E4M3;
        let w = lt::create_matrix_layout(fp8, k as u64, n as u64, k as i64).map_err(blas)?;
        let x = lt::create_matrix_layout(fp8, k as u64, t as u64, k as i64).map_err(blas)?;
        let y = lt::create_matrix_layout(out, n as u64, t as u64, n as i64).map_err(blas)?;
        // Safety: the descriptors were created above and by `new`, alive for the call.
        match unsafe { self.candidates(w, x, y) } {
            Ok(found) if !found.is_empty() => {
                let algo = found[self.candidate.min(found.len() - 1)].algo;
                Ok(Plan { w, x, y, algo })
            }
            found => {
                // Safety: made above, used by nothing else.
                unsafe { destroy_layouts([w, x, y]) };
                let why = found.err().map_or("none found".to_string(), |e| e.to_string());
                Err(CudaError::Unavailable(format!(
                    "cuBLASLt has no block-scaled FP8 product for {t} x {k} by {n} on this GPU: {why}"
                )))
            }
        }
    }

    /// cuBLASLt's heuristic candidates for a product of these layouts, best first (up to 8).
    ///
    /// # Safety
    /// The layouts are live; so are this object's descriptors.
    unsafe fn candidates(
        &self,
        w: sys::cublasLtMatrixLayout_t,
        x: sys::cublasLtMatrixLayout_t,
        y: sys::cublasLtMatrixLayout_t,
    ) -> Result<Vec<sys::cublasLtMatmulHeuristicResult_t>, lt::CublasError> {
        const MOST: usize = 8;
        // Safety: plain C structs, valid when zeroed; cuBLASLt fills the first `count`.
        let mut found: [sys::cublasLtMatmulHeuristicResult_t; MOST] = unsafe { std::mem::zeroed() };
        let mut count = 0;
        // Safety: per the function's contract; `found` holds MOST results.
        unsafe {
            sys::cublasLtMatmulAlgoGetHeuristic(
                self.handle,
                self.desc,
                w,
                x,
                y,
                y,
                self.pref,
                MOST as i32,
                found.as_mut_ptr(),
                &mut count,
            )
            .result()?;
        }
        let usable = found.into_iter().take(count.clamp(0, MOST as i32) as usize);
        Ok(usable.filter(|h| h.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS).collect())
    }
}

impl Drop for Fp8Gemm {
    fn drop(&mut self) {
        let plans = std::mem::take(self.plans.get_mut().unwrap_or_else(|p| p.into_inner()));
        // Safety: the owning device synchronizes its stream before it drops, so no queued call
        // still reads these; nothing uses them afterwards.
        unsafe {
            for p in plans.into_values().flatten() {
                p.destroy();
            }
            let _ = lt::destroy_matmul_pref(self.pref);
            let _ = lt::destroy_matmul_desc(self.desc);
            let _ = lt::destroy_handle(self.handle);
        }
    }
}
