//! When a step's KV is in the cache, layer group by layer group: what lets a KV connector copy
//! a prompt's keys and values while the step that computes them still runs.

use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use cudarc::driver::CudaEvent;

use super::{CudaDevice, CudaError};

/// The KV a submitted step writes, as it becomes final: per group of layers (in layer order),
/// a mark set right after the forward wrote those layers' keys and values. A GPU forward's
/// mark is an event it recorded on the compute stream: an event completes only once everything
/// queued before it has (earlier steps, earlier groups), so a copy that waits for group `g`'s
/// event reads final KV of that group for every token the step or an earlier one computed. A
/// forward running on host threads sets a [`HostFence`] instead.
///
/// No groups at all ([`KvFences::complete`]): the KV is already in place (a CPU step runs
/// inside its submit).
#[derive(Clone, Default)]
pub struct KvFences {
    groups: Arc<Vec<(Range<usize>, KvFence)>>,
}

/// One group's mark.
pub enum KvFence {
    /// Recorded on a device stream after the group's KV writes.
    Device(CudaEvent),
    /// Set by a host thread once the group's KV is written.
    Host(HostFence),
}

impl KvFence {
    /// The device event to queue a copy behind, if the mark is one.
    pub fn event(&self) -> Option<&CudaEvent> {
        match self {
            KvFence::Device(event) => Some(event),
            KvFence::Host(_) => None,
        }
    }

    /// Waits on this thread until the group's KV is final.
    pub fn wait(&self) -> Result<(), String> {
        match self {
            KvFence::Device(event) => event.synchronize().map_err(|e| format!("waiting for a step's KV: {e}")),
            KvFence::Host(fence) => fence.wait(),
        }
    }

    /// Whether the group's KV is final already, without waiting (a device error reads as not
    /// yet: [`KvFence::wait`] reports it).
    pub fn is_set(&self) -> bool {
        match self {
            KvFence::Device(event) => event.is_complete(),
            KvFence::Host(fence) => fence.is_set(),
        }
    }
}

/// A mark a host thread sets once a group of layers has written its KV
/// ([`HostSignal::signal`]); dropping the last [`HostSignal`] unset (a forward that failed)
/// wakes every waiter with an error rather than leaving it asleep.
#[derive(Clone)]
pub struct HostFence(Arc<(Mutex<HostState>, Condvar)>);

#[derive(Clone, Copy, PartialEq, Eq)]
enum HostState {
    Pending,
    Set,
    Abandoned,
}

/// The setting half of a [`HostFence`], held by the thread that computes the group.
pub struct HostSignal(Arc<(Mutex<HostState>, Condvar)>);

impl HostFence {
    /// A fence and the signal that sets it.
    pub fn pair() -> (HostFence, HostSignal) {
        let shared = Arc::new((Mutex::new(HostState::Pending), Condvar::new()));
        (HostFence(shared.clone()), HostSignal(shared))
    }

    /// Waits until the group's KV is written, or its computing thread gave it up. Polls the
    /// state every second while waiting, so a waiter is never parked on a missed wake-up.
    pub fn wait(&self) -> Result<(), String> {
        let (state, cond) = &*self.0;
        let mut s = state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            match *s {
                HostState::Set => return Ok(()),
                HostState::Abandoned => return Err("the step computing this KV ended without writing it".into()),
                HostState::Pending => {
                    s = cond.wait_timeout(s, Duration::from_secs(1)).unwrap_or_else(|p| p.into_inner()).0;
                }
            }
        }
    }
}

impl HostFence {
    /// Whether the group's KV is written (not waiting).
    pub fn is_set(&self) -> bool {
        *self.0 .0.lock().unwrap_or_else(|p| p.into_inner()) == HostState::Set
    }
}

impl HostSignal {
    /// The group's KV is written.
    pub fn signal(self) {
        self.set(HostState::Set);
    }

    fn set(&self, to: HostState) {
        let (state, cond) = &*self.0;
        let mut s = state.lock().unwrap_or_else(|p| p.into_inner());
        if *s == HostState::Pending {
            *s = to;
        }
        cond.notify_all();
    }
}

impl Drop for HostSignal {
    fn drop(&mut self) {
        self.set(HostState::Abandoned);
    }
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

    /// Fences set by host threads: per group of layers (consecutive, in layer order, covering
    /// them all), the fence its computing thread signals.
    pub fn host(groups: Vec<(Range<usize>, HostFence)>) -> Self {
        Self { groups: Arc::new(groups.into_iter().map(|(layers, f)| (layers, KvFence::Host(f))).collect()) }
    }

    /// Marks the end of the KV writes of `layers` (the next group, in layer order) in the work
    /// queued so far on `dev`'s stream.
    pub fn record(&mut self, dev: &CudaDevice, layers: Range<usize>) -> Result<(), CudaError> {
        let event = dev.stream().record_event(None)?;
        match Arc::get_mut(&mut self.groups) {
            Some(groups) => {
                groups.push((layers, KvFence::Device(event)));
                Ok(())
            }
            None => Err(CudaError::Unavailable("a step's KV fences were recorded into after being handed out".into())),
        }
    }

    /// Whether the KV is already final (nothing to wait for).
    pub fn is_complete(&self) -> bool {
        self.groups.is_empty()
    }

    /// The groups of `num_layers` layers in order, each with the mark to wait for before its
    /// KV is read (`None`: final already).
    pub fn groups(&self, num_layers: usize) -> Vec<(Range<usize>, Option<&KvFence>)> {
        if self.groups.is_empty() {
            return vec![(0..num_layers, None)];
        }
        self.groups.iter().map(|(layers, fence)| (layers.clone(), Some(fence))).collect()
    }

    /// Waits on this thread until all of the step's KV is final (for copies that do not run on
    /// the device's streams).
    pub fn wait(&self) -> Result<(), String> {
        // Device events complete in order, so the last one covers the group before it; host
        // fences are each set by their own group's end.
        match self.groups.last() {
            Some((_, KvFence::Device(event))) => {
                event.synchronize().map_err(|e| format!("waiting for a step's KV: {e}"))
            }
            Some(_) => self.groups.iter().try_for_each(|(_, fence)| fence.wait()),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_fence_wakes_its_waiter_when_set_or_given_up() {
        let (set, signal) = HostFence::pair();
        let (dropped, gone) = HostFence::pair();
        let fences = KvFences::host(vec![(0..1, set.clone()), (1..2, dropped.clone())]);
        let waiter = std::thread::spawn(move || (set.wait(), dropped.wait()));
        std::thread::sleep(Duration::from_millis(20));
        signal.signal();
        drop(gone);
        let (a, b) = waiter.join().unwrap();
        assert!(a.is_ok());
        assert!(b.unwrap_err().contains("without writing"), "a dropped signal fails its waiters");
        assert!(fences.wait().is_err());
        assert_eq!(fences.groups(2).len(), 2);
    }
}
