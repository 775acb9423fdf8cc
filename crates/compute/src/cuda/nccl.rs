//! NCCL for tensor-parallel ranks on GPUs: a communicator over an engine's ranks, and the
//! all-reduce that sums a row-parallel product's partial sums, queued on the rank's stream.
//!
//! libnccl is loaded at run time like every CUDA library (cudarc's dynamic loading), under the
//! names cudarc tries (`libnccl.so` among them; NCCL installs `libnccl.so.2`, so a machine may
//! need the unversioned link): [`Communicator::present`] says whether it loads, and without it
//! a communicator is an error naming the library, never a crash.

use cudarc::nccl::{result, sys};

use super::{CudaDevice, CudaError};

/// One rank's membership of a group of ranks that sum their products together.
pub struct Communicator {
    comm: sys::ncclComm_t,
    stream: sys::cudaStream_t,
    rank: usize,
    size: usize,
}

// Safety: the communicator and stream are handles NCCL and CUDA let any thread use, one at a
// time; not being `Sync`, this type is used from one thread at a time, and its owner destroys
// it once.
unsafe impl Send for Communicator {}

fn nccl_error(what: &str, e: result::NcclError) -> CudaError {
    CudaError::Unavailable(format!("NCCL {what}: {e:?}"))
}

impl Communicator {
    /// Whether libnccl can be loaded.
    pub fn present() -> bool {
        // Safety: only tries to open the library.
        unsafe { sys::is_culib_present() }
    }

    /// A group of one rank on `dev`: its all-reduce is the identity, so one GPU runs the
    /// tensor-parallel code path through NCCL.
    pub fn one_rank(dev: &CudaDevice) -> Result<Self, CudaError> {
        if !Self::present() {
            return Err(CudaError::Unavailable(
                "libnccl cannot be loaded (install NCCL; cudarc opens libnccl.so, so link it to libnccl.so.2)".into(),
            ));
        }
        let id = result::get_uniqueid().map_err(|e| nccl_error("unique id", e))?;
        Self::join(dev, id, 0, 1)
    }

    /// Rank `rank` of `size` ranks that share `id` (made by one of them with
    /// `ncclGetUniqueId` and handed to the others), on `dev`'s stream. Blocks until every rank
    /// has joined.
    pub fn join(dev: &CudaDevice, id: sys::ncclUniqueId, rank: usize, size: usize) -> Result<Self, CudaError> {
        if rank >= size {
            return Err(CudaError::Unavailable(format!("rank {rank} of a group of {size}")));
        }
        // NCCL takes the device from the calling thread's current context.
        dev.stream().context().bind_to_thread()?;
        let (ranks, me) = (i32::try_from(size), i32::try_from(rank));
        let (Ok(ranks), Ok(me)) = (ranks, me) else {
            return Err(CudaError::Unavailable(format!("a group of {size} ranks")));
        };
        let mut comm = std::mem::MaybeUninit::uninit();
        // Safety: `comm` is written by NCCL before it is read; `id` is a unique id by contract.
        let comm = unsafe {
            result::comm_init_rank(comm.as_mut_ptr(), ranks, id, me).map_err(|e| nccl_error("joining the group", e))?;
            comm.assume_init()
        };
        let stream = dev.stream().cu_stream() as sys::cudaStream_t;
        Ok(Self { comm, stream, rank, size })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Sums `count` bf16 values at `ptr` over the ranks, in place, queued on the stream (every
    /// rank must queue the same all-reduces in the same order).
    ///
    /// # Safety
    /// `ptr` is the device address of `count` bf16 values that stay allocated until the
    /// stream has passed this point.
    pub unsafe fn all_reduce_bf16(&self, ptr: u64, count: usize) -> Result<(), CudaError> {
        let buf = ptr as *mut std::ffi::c_void;
        let (dtype, sum) = (sys::ncclDataType_t::ncclBfloat16, sys::ncclRedOp_t::ncclSum);
        // Safety: passed on from the caller; the communicator is alive.
        unsafe { result::all_reduce(buf, buf, count, dtype, sum, self.comm, self.stream) }
            .map(drop)
            .map_err(|e| nccl_error("all-reduce", e))
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // Safety: created by `comm_init_rank`, destroyed once, here.
        let _ = unsafe { result::comm_destroy(self.comm) };
    }
}
