//! When a step's KV is in the cache, layer group by layer group: what lets a KV connector copy
//! a prompt's keys and values while the step that computes them still runs.

use std::ops::Range;
use std::sync::Arc;

use cudarc::driver::CudaEvent;

use super::{CudaDevice, CudaError};

/// The KV a submitted step writes, as it becomes final: per group of layers (in layer order),
/// an event the forward recorded on the compute stream right after it wrote those layers' keys
/// and values. An event completes only once everything queued before it has (earlier steps,
/// earlier groups), so a copy that waits for group `g`'s event reads final KV of that group
/// for every token the step or an earlier one computed.
///
/// No groups at all ([`KvFences::complete`]): the KV is already in place (a CPU step runs
/// inside its submit).
#[derive(Clone, Default)]
pub struct KvFences {
    groups: Arc<Vec<(Range<usize>, CudaEvent)>>,
}

impl std::fmt::Debug for KvFences {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let groups: Vec<&Range<usize>> = self.groups.iter().map(|(layers, _)| layers).collect();
        write!(f, "KvFences({groups:?})")
    }
}

impl KvFences {
    /// KV that is already final.
    pub fn complete() -> Self {
        Self::default()
    }

    /// Marks the end of the KV writes of `layers` (the next group, in layer order) in the work
    /// queued so far on `dev`'s stream.
    pub fn record(&mut self, dev: &CudaDevice, layers: Range<usize>) -> Result<(), CudaError> {
        let event = dev.stream().record_event(None)?;
        match Arc::get_mut(&mut self.groups) {
            Some(groups) => {
                groups.push((layers, event));
                Ok(())
            }
            None => Err(CudaError::Unavailable("a step's KV fences were recorded into after being handed out".into())),
        }
    }

    /// Whether the KV is already final (nothing to wait for).
    pub fn is_complete(&self) -> bool {
        self.groups.is_empty()
    }

    /// The groups of `num_layers` layers in order, each with the event to wait for before its
    /// KV is read (`None`: final already).
    pub fn groups(&self, num_layers: usize) -> Vec<(Range<usize>, Option<&CudaEvent>)> {
        if self.groups.is_empty() {
            return vec![(0..num_layers, None)];
        }
        self.groups.iter().map(|(layers, event)| (layers.clone(), Some(event))).collect()
    }

    /// Waits on this thread until all of the step's KV is final (for copies that do not run on
    /// the device's streams).
    pub fn wait(&self) -> Result<(), String> {
        match self.groups.last() {
            Some((_, event)) => event.synchronize().map_err(|e| format!("waiting for a step's KV: {e}")),
            None => Ok(()),
        }
    }
}
