//! Push over a direct transport (cuda-ipc, local), prefill side: the KV of a prompt still
//! being computed goes into decode's registered blocks chunk by chunk, so that when the last
//! chunk is done only its own KV is left to copy before `Done`.
//!
//! The engine reports each step of the prompt ([`crate::KvConnector::computed`]): a GPU engine
//! as it submits the step, with fences that say when each group of layers has written its KV
//! (the copies wait for them on the device, so the KV moves while the step still runs), a CPU
//! engine (or one whose steps record no fences) once the step is done. Once decode's
//! registration is here, every whole run of tokens the two block sizes share becomes a part,
//! queued on the transfer's writer thread; a report that comes before the registration waits
//! for it (the latest one: it covers the earlier ones). The writer runs the parts, then the
//! rest of the prompt and `Done` (or a failure notice) strictly in the order they were queued,
//! so decode never hears "done" or "failed" while a part it was not told about may still land
//! in its blocks.
//!
//! A part reads blocks the prefill request still holds. If the request is preempted, its
//! blocks may be reused and a queued part copy garbage; the attempt count the engine passes
//! with every report (its preemptions so far) then differs, and the writer starts again from
//! the first token: the copies of the new attempt come after the old ones, in the same order.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Instant;

use tandem_compute::cuda::KvFences;
use tandem_core::TransferId;

use super::push::write_whole;
use super::table::{Computing, Produced, Registration, Tables};
use super::{bump, Conn, Shared};
use crate::wire::Message;

/// A registration's writer thread and how far it has been asked to write.
pub(super) struct EarlyWriter {
    jobs: mpsc::Sender<Job>,
    /// Tokens from the first one queued as parts so far, all computed in `attempt`.
    sent: usize,
    attempt: u32,
    /// The newest attempt reported, shared with the writer: a part queued under an older one
    /// is skipped (its tokens are written again under the new one anyway).
    latest: Arc<AtomicU32>,
}

impl EarlyWriter {
    /// The token the final write starts from for KV produced in `attempt`: where the parts
    /// stopped, unless the prompt was computed again since (then from the start).
    fn resume_at(&self, attempt: u32) -> usize {
        if attempt == self.attempt {
            self.sent
        } else {
            0
        }
    }
}

enum Job {
    /// Tokens `from..to` of the prompt computed in `attempt`, from our blocks `src` (the
    /// request's whole table), once `fences` say the KV is there.
    Part { src: Vec<u32>, from: usize, to: usize, attempt: u32, fences: KvFences },
    /// The prompt is complete: write the rest from token `from`, then `Done` (the write's time
    /// counts from `taken`, when the rendezvous met).
    Finish { reg: Registration, produced: Produced, from: usize, taken: Instant },
    /// Nothing more will be written: tell decode (after every part queued before this).
    Notify(Message),
}

/// What a writer thread needs of its registration.
struct Target {
    shared: Arc<Shared>,
    conn: Arc<Conn>,
    tid: TransferId,
    dst: Vec<u32>,
    deadline: Instant,
    latest: Arc<AtomicU32>,
}

/// Prefill: a step of the prompt of `tid` wrote (or, per `report.fences`, is writing) its KV
/// up to `report.upto` tokens. Queues a part if decode has registered over a direct transport
/// and whole shared runs of tokens are new; keeps the report for the registration if that has
/// not come yet.
pub(super) fn on_computed(shared: &Arc<Shared>, tid: &TransferId, report: Computing) {
    let mut guard = shared.tables();
    let t = &mut *guard;
    match t.registrations.get_mut(tid) {
        Some(reg) => queue_part(shared, tid, reg, report),
        // Not yet registered (and not finished: then the final write takes it all; nor given
        // up by decode).
        None if !t.produced.contains_key(tid) && !t.pushing.contains(tid) && !t.aborted.contains_key(tid) => {
            t.computing.insert(tid.clone(), report);
        }
        None => {}
    }
}

/// Prefill: decode's registration of `tid` was just recorded in `t`; the prompt's latest
/// report, if one came first, becomes a part now.
pub(super) fn on_registered(shared: &Arc<Shared>, t: &mut Tables, tid: &TransferId) {
    let Some(report) = t.computing.remove(tid) else { return };
    if let Some(reg) = t.registrations.get_mut(tid) {
        queue_part(shared, tid, reg, report);
    }
}

fn queue_part(shared: &Arc<Shared>, tid: &TransferId, reg: &mut Registration, report: Computing) {
    let Computing { blocks, upto, attempt, fences, .. } = report;
    if !reg.conn.transport.writes_directly() || Instant::now() >= reg.deadline {
        return;
    }
    let ours = shared.memory.layout().block_size;
    // Decode holds the first `skip` tokens' KV: parts count from there.
    let Some(blocks) = blocks.get(reg.skip / ours..).map(<[u32]>::to_vec) else { return };
    let upto = upto.saturating_sub(reg.skip);
    let step = shared_run(ours, reg.conn.peer.block_size);
    let to = upto.min(reg.num_tokens) / step * step;
    if to / ours > blocks.len() {
        tracing::warn!(transfer_id = %tid, upto, blocks = blocks.len(), "a computed step's blocks do not cover its tokens");
        return;
    }
    if reg.early.is_none() {
        reg.early = spawn_writer(shared, tid, reg, attempt);
    }
    let Some(early) = reg.early.as_mut() else { return };
    if early.attempt != attempt {
        // Computed again after a preemption: what was sent may be garbage; start over.
        (early.sent, early.attempt) = (0, attempt);
        early.latest.store(attempt, Ordering::SeqCst);
    }
    if to <= early.sent {
        return;
    }
    if early.jobs.send(Job::Part { src: blocks, from: early.sent, to, attempt, fences }).is_ok() {
        early.sent = to;
    }
}

/// Push rendezvous met: writes `produced` into `reg`'s blocks and sends `Done`, after the parts
/// already queued when there are any (else on a thread of its own).
pub(super) fn finish(shared: &Arc<Shared>, tid: TransferId, mut reg: Registration, mut produced: Produced) {
    let taken = Instant::now();
    // Decode holds the first `skip` tokens' KV: what is written (and checked) starts after them.
    if reg.skip > 0 {
        let ours = shared.memory.layout().block_size;
        produced.blocks = produced.blocks.get(reg.skip / ours..).map(<[u32]>::to_vec).unwrap_or_default();
        produced.num_tokens = produced.num_tokens.saturating_sub(reg.skip);
    }
    match reg.early.take() {
        Some(early) => {
            let from = early.resume_at(produced.attempt);
            early.latest.store(produced.attempt, Ordering::SeqCst);
            if let Err(mpsc::SendError(Job::Finish { reg, produced, .. })) =
                early.jobs.send(Job::Finish { reg, produced, from, taken })
            {
                // The writer is gone (it cannot be: it waits for this); write it all here.
                spawn_whole(shared, tid, reg, produced, taken);
            }
        }
        None => spawn_whole(shared, tid, reg, produced, taken),
    }
}

/// Tells decode `msg` (a failure: no more will be written) once every part queued for `reg`
/// has ended, so that decode frees its blocks only when no copy into them is left.
pub(super) fn notify(reg: Registration, msg: Message) {
    let Some(early) = &reg.early else {
        let _ = reg.conn.send(&msg);
        return;
    };
    if let Err(mpsc::SendError(Job::Notify(msg))) = early.jobs.send(Job::Notify(msg)) {
        let _ = reg.conn.send(&msg);
    }
}

fn spawn_whole(shared: &Arc<Shared>, tid: TransferId, reg: Registration, produced: Produced, taken: Instant) {
    let s = shared.clone();
    let spawned = std::thread::Builder::new()
        .name("tandem-kv-push".into())
        .spawn(move || write_whole(&s, tid, reg, produced, 0, None, taken));
    if let Err(e) = spawned {
        tracing::error!(error = %e, "cannot start a KV push thread");
    }
}

/// The run of tokens that is a whole number of blocks in both block sizes.
pub(super) fn shared_run(a: usize, b: usize) -> usize {
    let (mut x, mut y) = (a.max(1), b.max(1));
    while y != 0 {
        (x, y) = (y, x % y);
    }
    a.max(1) / x * b.max(1)
}

fn spawn_writer(shared: &Arc<Shared>, tid: &TransferId, reg: &Registration, attempt: u32) -> Option<EarlyWriter> {
    let (jobs, rx) = mpsc::channel();
    let latest = Arc::new(AtomicU32::new(attempt));
    let target = Target {
        shared: shared.clone(),
        conn: reg.conn.clone(),
        tid: tid.clone(),
        dst: reg.blocks.clone(),
        deadline: reg.deadline,
        latest: latest.clone(),
    };
    match std::thread::Builder::new().name("tandem-kv-early".into()).spawn(move || run_writer(target, rx)) {
        Ok(_) => Some(EarlyWriter { jobs, sent: 0, attempt, latest }),
        Err(e) => {
            tracing::error!(error = %e, "cannot start a KV early-write thread; the KV goes when complete");
            None
        }
    }
}

/// The writer thread: parts in order, then the finish or the notice; ends when the
/// registration is gone (its sender dropped) and nothing is queued.
fn run_writer(t: Target, jobs: mpsc::Receiver<Job>) {
    let ours = t.shared.memory.layout().block_size;
    let theirs = t.conn.peer.block_size.max(1);
    // Why a part did not land: the final write then fails the transfer instead of sending it.
    let mut failed: Option<String> = None;
    for job in jobs {
        match job {
            Job::Part { src, from, to, attempt, fences } => {
                // A preemption since made it stale (a request preempted again and again queues
                // a part each time: only the newest attempt's are worth a copy).
                let stale = || attempt < t.latest.load(Ordering::SeqCst);
                if failed.is_some() || stale() {
                    continue;
                }
                // Like every direct write: none starts after decode's deadline.
                if Instant::now() >= t.deadline {
                    failed = Some("the decode engine's deadline passed during the prefill".into());
                    continue;
                }
                std::thread::sleep(t.shared.cfg.faults.slow_write);
                if stale() {
                    continue;
                }
                let (src, dst) = match (src.get(from / ours..to / ours), t.dst.get(from / theirs..to / theirs)) {
                    (Some(s), Some(d)) => (s, d),
                    _ => {
                        failed = Some("an early part's blocks do not cover its tokens".into());
                        continue;
                    }
                };
                match t.conn.transport.write_part(&t.shared, src, dst, to - from, &fences) {
                    Ok(()) => bump(&t.shared.counters.parts_early, 1),
                    Err(e) => {
                        tracing::warn!(transfer_id = %t.tid, error = %e, "early KV part failed");
                        failed = Some(e);
                    }
                }
            }
            Job::Finish { reg, produced, from, taken } => {
                write_whole(&t.shared, t.tid.clone(), reg, produced, from, failed.take(), taken);
                return;
            }
            Job::Notify(msg) => {
                let _ = t.conn.send(&msg);
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::shared_run;

    #[test]
    fn a_shared_run_is_whole_blocks_in_both_sizes() {
        assert_eq!(shared_run(16, 16), 16);
        assert_eq!(shared_run(16, 32), 32);
        assert_eq!(shared_run(32, 16), 32);
        assert_eq!(shared_run(4, 6), 12);
        assert_eq!(shared_run(0, 8), 8);
    }
}
