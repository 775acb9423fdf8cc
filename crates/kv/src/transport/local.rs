//! The `local` transport: a direct copy into the host region of another engine of this process
//! (tests, one-process setups); the side channel carries only the notifications. The writer
//! copies into the blocks the reader named without touching the reader's table: the same
//! protocol as cuda-ipc, so the CPU tests exercise it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

use tandem_compute::cuda::KvFences;
use tandem_compute::kv_copy::plan_kv_copy;
use tandem_core::TransferId;

use super::{Announce, Ours, Runs, Transport, WriteError};
use crate::blocks::copy_tokens;
use crate::memory::KvMemory;

/// Engines of this process that offer the local transport, by their offer's key.
static LOCAL_ENGINES: OnceLock<Mutex<HashMap<String, Weak<KvMemory>>>> = OnceLock::new();

fn registry() -> MutexGuard<'static, HashMap<String, Weak<KvMemory>>> {
    LOCAL_ENGINES.get_or_init(|| Mutex::new(HashMap::new())).lock().unwrap_or_else(|p| p.into_inner())
}

/// Makes `memory` findable by engines of this process under `key` (its local offer), for as
/// long as the caller keeps it.
pub(crate) fn register(key: &str, memory: &Arc<KvMemory>) {
    registry().insert(key.to_string(), Arc::downgrade(memory));
}

/// The memory of the engine of this process that registered `key`.
pub(crate) fn find(key: &str) -> Option<Weak<KvMemory>> {
    registry().get(key).cloned()
}

pub(crate) struct Local {
    ours: Ours,
    peer: Weak<KvMemory>,
}

impl Local {
    pub(crate) fn new(ours: Ours, peer: Weak<KvMemory>) -> Self {
        Self { ours, peer }
    }

    fn copy(&self, runs: Runs<'_>) -> Result<(), String> {
        let Runs { src, dst, num_tokens, .. } = runs;
        let peer = self.peer.upgrade().ok_or("the peer engine is gone")?;
        let ours = &self.ours.memory;
        let from = ours.host_region().map_err(|e| e.to_string())?;
        let to = peer.host_region().map_err(|e| e.to_string())?;
        // Validates the peer's block list (ids inside its region, enough of them) before a copy.
        plan_kv_copy(from.layout(), to.layout(), from.dtype().bytes(), src, dst, num_tokens)?;
        if from.dtype() != to.dtype() {
            return Err("KV element types differ".into());
        }
        let dst = &dst[..to.layout().blocks_for(num_tokens)];
        // Safety: the caller holds `src` for this call; the reader gave `dst` to this transfer
        // and keeps them until we report the write's end (its `Writing` state), so nobody else
        // touches either, on the device or in the host copies.
        unsafe {
            ours.stage_to_host(&src[..from.layout().blocks_for(num_tokens)]).map_err(|e| e.to_string())?;
            copy_tokens(from, src, to, dst, num_tokens);
            if self.ours.faults.corrupt_sends {
                // As a bad link would: one bit of the first block that landed, after the copy.
                if let Some(&first) = dst.first() {
                    to.bytes_mut(first as usize, 1)[0] ^= 1;
                }
            }
            peer.load_from_host(dst).map_err(|e| e.to_string())
        }
    }
}

impl Transport for Local {
    fn name(&self) -> &'static str {
        "local"
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
        // The copy goes through the host copies: all of the step's KV first.
        fences.wait().map_err(WriteError::Failed)?;
        self.copy(runs).map_err(WriteError::Failed)
    }
}
