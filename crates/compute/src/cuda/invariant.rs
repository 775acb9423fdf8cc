//! Matrix products whose every row is the same whatever the number of rows: the GEMMs of
//! batch-invariant serving (`--batch-invariant`).
//!
//! cuBLAS picks its kernel by shape, and on some shapes that kernel splits K over several
//! blocks and adds their partial sums: then row `r` of `x · wᵀ` depends on how many other rows
//! came with it (a different split, a different order of additions). Here cuBLASLt is asked
//! for algorithms that reduce nothing outside the block computing an output tile (reduction
//! scheme NONE) and get no workspace to do it in: each output element is one block's K loop,
//! in the kernel's fixed order, and a kernel's K loop does not depend on M. Which kernel runs
//! still depends on the shape; that the rows agree across the kernels chosen for every row
//! count is what `tests/cuda_kernels.rs` checks on the GPU
//! (`invariant_matmul_rows_do_not_depend_on_the_row_count`).
//!
//! Algorithms are chosen once per (n, k, rows, output type) and kept: the heuristic is a host
//! call of tens of microseconds, and a kept choice makes a replayed shape take the same kernel.

use std::collections::HashMap;
use std::sync::Mutex;

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;

use super::CudaError;

/// A cuBLASLt handle and the plans made with it.
pub(crate) struct InvariantGemm {
    handle: sys::cublasLtHandle_t,
    desc: sys::cublasLtMatmulDesc_t,
    pref: sys::cublasLtMatmulPreference_t,
    plans: Mutex<HashMap<PlanKey, Plan>>,
}

// Safety: the handle and descriptors are used from one thread at a time (the owning device's;
// see `CudaDevice`), and cuBLASLt handles are not tied to the creating thread.
unsafe impl Send for InvariantGemm {}

#[derive(Clone, Copy, Hash, PartialEq, Eq)]
struct PlanKey {
    n: usize,
    k: usize,
    t: usize,
    f32_out: bool,
    slices: usize,
}

/// A product's layouts (weight, activations, output) and the algorithm chosen for them.
pub(crate) struct Plan {
    pub w: sys::cublasLtMatrixLayout_t,
    pub x: sys::cublasLtMatrixLayout_t,
    pub y: sys::cublasLtMatrixLayout_t,
    pub algo: sys::cublasLtMatmulAlgo_t,
}

/// Plans kept before the cache starts over (prefill chunk sizes vary; a few thousand shapes
/// are a few MB of descriptors).
const MAX_PLANS: usize = 8192;

fn blas(e: lt::CublasError) -> CudaError {
    CudaError::Unavailable(format!("cuBLASLt: {e}"))
}

/// A cuBLASLt handle, a matmul descriptor of f32 accumulation and scaling, and a preference:
/// what the batch-invariant and the FP8 block-scaled products each start from.
pub(crate) fn lt_setup(
) -> Result<(sys::cublasLtHandle_t, sys::cublasLtMatmulDesc_t, sys::cublasLtMatmulPreference_t), lt::CublasError> {
    let handle = lt::create_handle()?;
    let desc = lt::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType::CUDA_R_32F)?;
    Ok((handle, desc, lt::create_matmul_pref()?))
}

/// Sets attribute `attr` of matmul descriptor `desc` to `value`.
///
/// # Safety
/// `desc` is a live descriptor and `T` the type the cuBLASLt documentation gives `attr`.
pub(crate) unsafe fn set_desc<T>(
    desc: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    value: &T,
) -> Result<(), lt::CublasError> {
    // Safety: per the function's contract; `value` is alive for the call.
    unsafe { lt::set_matmul_desc_attribute(desc, attr, (value as *const T).cast(), std::mem::size_of::<T>()) }
}

/// Sets attribute `attr` of preference `pref` to `value`.
///
/// # Safety
/// `pref` is a live preference and `T` the type the cuBLASLt documentation gives `attr`.
pub(crate) unsafe fn set_pref<T>(
    pref: sys::cublasLtMatmulPreference_t,
    attr: sys::cublasLtMatmulPreferenceAttributes_t,
    value: &T,
) -> Result<(), lt::CublasError> {
    // Safety: per the function's contract; `value` is alive for the call.
    unsafe { lt::set_matmul_pref_attribute(pref, attr, (value as *const T).cast(), std::mem::size_of::<T>()) }
}

impl InvariantGemm {
    /// Loads cuBLASLt and sets up `y[t, n] = x[t, k] · w[n, k]ᵀ` (bf16 inputs, f32 accumulation).
    pub fn new() -> Result<Self, CudaError> {
        // Safety: only tries to dlopen the library.
        if !unsafe { sys::is_culib_present() } {
            return Err(CudaError::Unavailable(
                "cannot load libcublasLt, which --batch-invariant needs (set LD_LIBRARY_PATH to the CUDA 13 libraries)"
                    .into(),
            ));
        }
        let (handle, desc, pref) = lt_setup().map_err(blas)?;
        // Column-major view, as in `ops::matmul_t`: yᵀ (n x t) = op(w) (w stored k x n,
        // transposed) times xᵀ (k x t).
        let trans_w = cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T;
        let none = sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_NONE as u32;
        let workspace = 0u64;
        use sys::cublasLtMatmulPreferenceAttributes_t as P;
        // Safety: the descriptor and preference were made above; each attribute gets a value of
        // the type the cuBLASLt documentation gives for it (cublasOperation_t, uint32, uint64).
        unsafe {
            set_desc(desc, sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA, &trans_w).map_err(blas)?;
            set_pref(pref, P::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &none).map_err(blas)?;
            set_pref(pref, P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace).map_err(blas)?;
        }
        Ok(Self { handle, desc, pref, plans: Mutex::new(HashMap::new()) })
    }

    /// Queues `y[t, n] = x[t, k] · w[n, k]ᵀ` on `stream` (output bf16, or f32 with `f32_out`).
    /// With `slices` > 1 (`f32_out` then required, `k` a multiple of `64 * slices`), a strided
    /// batch of `slices` products, slice `s` of columns `s k / slices ..` into `y[s, t, n]`: the
    /// partial products of `ops::matmul_t_invariant_sliced`.
    ///
    /// # Safety
    /// `x` holds `[t, k]` bf16, `w` `[n, k]` bf16, `y` `[slices, t, n]` of the output type, all
    /// live device allocations of the stream's context (which is current on this thread), each
    /// aligned to 256 bytes (cuBLASLt's default alignment assumption).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn matmul(
        &self,
        stream: sys::cudaStream_t,
        x: u64,
        w: u64,
        y: u64,
        t: usize,
        n: usize,
        k: usize,
        f32_out: bool,
        slices: usize,
    ) -> Result<(), CudaError> {
        if t == 0 {
            return Ok(());
        }
        let slices = slices.max(1);
        if slices > 1 && (!f32_out || !k.is_multiple_of(64 * slices)) {
            return Err(CudaError::Unavailable(format!(
                "a sliced product writes f32 slices of a multiple of 64 columns, not {k} in {slices}"
            )));
        }
        let key = PlanKey { n, k, t, f32_out, slices };
        let mut plans = self.plans.lock().unwrap_or_else(|p| p.into_inner());
        if !plans.contains_key(&key) {
            if plans.len() >= MAX_PLANS {
                for (_, p) in plans.drain() {
                    // Safety: the layouts were made by `plan` and are used by no queued call
                    // (cuBLASLt reads them at enqueue time).
                    unsafe { p.destroy() };
                }
            }
            let plan = self.plan(key)?;
            plans.insert(key, plan);
        }
        let Some(p) = plans.get(&key) else { unreachable!("inserted above") };
        // Safety: the caller's contract covers the buffers; the plan's layouts describe them
        // (made for this key); no workspace, as the plan's algorithm was chosen for none.
        unsafe { p.queue(self.handle, self.desc, (w, x, y), (0, 0), stream) }.map_err(blas)
    }

    fn plan(&self, key: PlanKey) -> Result<Plan, CudaError> {
        let PlanKey { n, k, t, f32_out, slices } = key;
        let out = if f32_out { sys::cudaDataType::CUDA_R_32F } else { sys::cudaDataType::CUDA_R_16BF };
        let cols = (k / slices) as u64;
        // A slice of w or x is `cols` rows of the column-major view, `k` apart; slice s starts
        // `s * cols` elements in, and its output `t * n` after the previous one.
        let w = lt::create_matrix_layout(sys::cudaDataType::CUDA_R_16BF, cols, n as u64, k as i64).map_err(blas)?;
        let x = lt::create_matrix_layout(sys::cudaDataType::CUDA_R_16BF, cols, t as u64, k as i64).map_err(blas)?;
        let y = lt::create_matrix_layout(out, n as u64, t as u64, n as i64).map_err(blas)?;
        if slices > 1 {
            let batch = slices as i32;
            for (layout, offset) in [(w, cols as i64), (x, cols as i64), (y, (t * n) as i64)] {
                // Safety: the layout was created above; each attribute gets the type and size
                // the cuBLASLt documentation gives for it (int32 count, int64 offset).
                let set = unsafe {
                    lt::set_matrix_layout_attribute(
                        layout,
                        sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                        (&batch as *const i32).cast(),
                        std::mem::size_of::<i32>(),
                    )
                    .and_then(|()| {
                        lt::set_matrix_layout_attribute(
                            layout,
                            sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                            (&offset as *const i64).cast(),
                            std::mem::size_of::<i64>(),
                        )
                    })
                };
                if let Err(e) = set {
                    // Safety: made above, used by nothing else.
                    unsafe { destroy_layouts([w, x, y]) };
                    return Err(blas(e));
                }
            }
        }
        // A slice starts `cols` elements (and its output `t * n`) past the previous one, so
        // only the first is at a buffer's 256-byte alignment: the heuristic is told how far
        // every slice's start is aligned, and picks no kernel that assumes more. (`plan` runs
        // under the plans' lock, so the preference is not shared meanwhile.)
        let aligned = |bytes: usize| 1u32 << bytes.trailing_zeros().min(8);
        let out_bytes = if f32_out { 4 } else { 2 };
        let (align_in, align_out) =
            if slices > 1 { (aligned(cols as usize * 2), aligned(t * n * out_bytes)) } else { (256, 256) };
        for (attr, align) in [
            (sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_in),
            (sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_in),
            (sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_out),
            (sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_out),
        ] {
            // Safety: the preference was created by `new`; the attribute is a uint32.
            if let Err(e) = unsafe { lt::set_matmul_pref_attribute(self.pref, attr, (&align as *const u32).cast(), 4) }
            {
                // Safety: made above, used by nothing else.
                unsafe { destroy_layouts([w, x, y]) };
                return Err(blas(e));
            }
        }
        // Safety: the descriptors were created above and by `new`, alive for the call.
        let heuristic = unsafe { lt::get_matmul_algo_heuristic(self.handle, self.desc, w, x, y, y, self.pref) };
        match heuristic {
            Ok(h) => Ok(Plan { w, x, y, algo: h.algo }),
            Err(e) => {
                // Safety: made above, used by nothing else.
                unsafe { destroy_layouts([w, x, y]) };
                Err(CudaError::Unavailable(format!(
                    "cuBLASLt has no algorithm without a split reduction for {t} x {k} by {n} in {slices} slices: {e}"
                )))
            }
        }
    }
}

impl Plan {
    /// Queues `y = op(w) · x` (alpha 1, beta 0) under `desc` with this plan's layouts and
    /// algorithm, on `stream`.
    ///
    /// # Safety
    /// `w`, `x` and `y` are live device buffers of the stream's context (current on this thread)
    /// that the plan's layouts describe; `workspace` holds `workspace_bytes` (0 and 0: none, which
    /// the plan's algorithm was chosen for); `handle` and `desc` are the plan's maker's.
    pub(crate) unsafe fn queue(
        &self,
        handle: sys::cublasLtHandle_t,
        desc: sys::cublasLtMatmulDesc_t,
        (w, x, y): (u64, u64, u64),
        (workspace, workspace_bytes): (u64, usize),
        stream: sys::cudaStream_t,
    ) -> Result<(), lt::CublasError> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        // Safety: per the function's contract; alpha and beta are host scalars alive for the call.
        unsafe {
            lt::matmul(
                handle,
                desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                w as *const _,
                self.w,
                x as *const _,
                self.x,
                y as *const _,
                self.y,
                y as *mut _,
                self.y,
                &self.algo,
                workspace as *mut _,
                workspace_bytes,
                stream,
            )
        }
    }

    /// # Safety
    /// The layouts are not used again.
    pub(crate) unsafe fn destroy(self) {
        // Safety: per the function's contract.
        unsafe { destroy_layouts([self.w, self.x, self.y]) }
    }
}

/// # Safety
/// The layouts are not used again.
pub(crate) unsafe fn destroy_layouts(layouts: [sys::cublasLtMatrixLayout_t; 3]) {
    for layout in layouts {
        // Safety: per the function's contract. An error here would only leak a descriptor.
        let _ = unsafe { lt::destroy_matrix_layout(layout) };
    }
}

impl Drop for InvariantGemm {
    fn drop(&mut self) {
        let plans = std::mem::take(self.plans.get_mut().unwrap_or_else(|p| p.into_inner()));
        // Safety: the owning device synchronizes its stream before it drops, so no queued
        // call still reads these; nothing uses them afterwards.
        unsafe {
            for (_, p) in plans {
                p.destroy();
            }
            let _ = lt::destroy_matmul_pref(self.pref);
            let _ = lt::destroy_matmul_desc(self.desc);
            let _ = lt::destroy_handle(self.handle);
        }
    }
}
