//! Prefill's push writes, on threads of their own (never the engine's, never the reader's).
//!
//! Once the rendezvous has met, the KV goes to decode's registered blocks and `Done` follows
//! ([`write_whole`]). A prompt still being computed goes in parts before that (over a direct
//! transport, copies into decode's memory; over tcp, bytes on the side channel, which decode
//! lands in order): the engine reports each step
//! ([`crate::connector::KvConnector::computed`]), a GPU engine as it submits the step with fences that say
//! when each group of layers has written its KV (the copies wait for them on the device), a CPU
//! engine once the step is done. Once decode's registration is here, every whole run of tokens
//! the two block sizes share becomes a part (`protocol::push::next_part`), queued on the
//! registration's writer thread; a report that comes before the registration waits for it (the
//! latest one: it covers the earlier ones). The writer runs the parts, then the rest of the
//! prompt and `Done` (or a failure notice) strictly in the order queued.
//!
//! A part reads blocks the prefill request still holds. If the request is preempted, its
//! blocks may be reused and a queued part copy garbage; the attempt count the engine passes
//! with every report then differs, and the writer starts again from the first token.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Instant;

use tandem_compute::cuda::KvFences;
use tandem_core::TransferId;

use super::conn::{Conn, Frames};
use super::parts::{Job, PartsWriter};
use super::shared::{bump, Shared};
use crate::blocks::{coalesce, wire_bytes};
use crate::error::KvError;
use crate::protocol::push::{self, Progress};
use crate::table::{Computing, Produced, Registration};
use crate::transport::{Bulk, NoAnnounce, Runs, WriteError};
use crate::wire::{DoneStatus, Message};

type Reg = Registration<Arc<Conn>, PartsWriter>;

/// What a push's `Done` carries besides its status.
#[derive(Clone, Copy, Debug)]
struct PushDone {
    /// The token prefill sampled after the prompt.
    first_token: u32,
    /// When prefill's engine handed the KV over (wall clock, Unix microseconds).
    produced_unix_us: u64,
    /// When the writing thread took the transfer on (a direct write's copy time counts from here).
    taken: Instant,
    /// How long the parts queued before the hand-over still ran after it.
    backlog_us: u64,
    /// A direct write under `--kv-verify`: the digest of the whole prompt's KV it copies.
    digest: Option<u64>,
}

/// Prefill: a step of the prompt of `tid` wrote (or, per `report.fences`, is writing) its KV
/// up to `report.upto` tokens. Queues a part if decode has registered over a direct transport
/// and whole shared runs of tokens are new; keeps the report for the registration if that has
/// not come yet.
pub(crate) fn on_computed(shared: &Arc<Shared>, tid: &TransferId, report: Computing) {
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
pub(crate) fn on_registered(shared: &Arc<Shared>, t: &mut super::shared::Tables, tid: &TransferId) {
    let Some(report) = t.computing.remove(tid) else { return };
    if let Some(reg) = t.registrations.get_mut(tid) {
        queue_part(shared, tid, reg, report);
    }
}

fn queue_part(shared: &Arc<Shared>, tid: &TransferId, reg: &mut Reg, report: Computing) {
    let Computing { blocks, upto, attempt, fences, .. } = report;
    if Instant::now() >= reg.deadline {
        return;
    }
    let sizes = (shared.block_size(), reg.conn.peer.block_size);
    let part = match push::next_part(&blocks, upto, (reg.skip, reg.num_tokens), sizes) {
        Ok(Some(part)) => part,
        Ok(None) => return,
        Err(why) => {
            tracing::warn!(transfer_id = %tid, upto, %why, "a computed step cannot go as a part");
            return;
        }
    };
    if reg.parts.is_none() {
        reg.parts = spawn_writer(shared, tid, reg, attempt);
    }
    let Some(writer) = reg.parts.as_mut() else { return };
    if writer.progress.attempt != attempt {
        writer.latest.store(attempt, Ordering::SeqCst);
    }
    if let Some((from, to)) = writer.progress.advance(attempt, part.to) {
        let _ = writer.jobs.send(Job::Part { src: part.src, from, to, attempt, fences });
    }
}

/// Push rendezvous met: writes `produced` into `reg`'s blocks and sends `Done`, after the parts
/// already queued when there are any (else on a thread of its own).
pub(crate) fn finish(shared: &Arc<Shared>, tid: TransferId, mut reg: Reg, mut produced: Produced) {
    let taken = Instant::now();
    tracing::debug!(transfer_id = %tid, "KV handed over");
    push::skip_cached(&mut produced, reg.skip, shared.block_size());
    match reg.parts.take() {
        Some(writer) => {
            let from = writer.progress.resume_at(produced.attempt);
            writer.latest.store(produced.attempt, Ordering::SeqCst);
            if let Err(mpsc::SendError(Job::Finish { reg, produced, .. })) =
                writer.jobs.send(Job::Finish { reg, produced, from, taken })
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
pub(crate) fn notify(reg: Reg, msg: Message) {
    let Some(writer) = &reg.parts else {
        let _ = reg.conn.send(&msg);
        return;
    };
    if let Err(mpsc::SendError(Job::Notify(msg))) = writer.jobs.send(Job::Notify(msg)) {
        let _ = reg.conn.send(&msg);
    }
}

fn spawn_whole(shared: &Arc<Shared>, tid: TransferId, reg: Reg, produced: Produced, taken: Instant) {
    let s = shared.clone();
    let spawned = std::thread::Builder::new().name("tandem-kv-push".into()).spawn(move || {
        let _span = tracing::debug_span!("kv_push", transfer_id = %tid).entered();
        write_whole(&s, tid, reg, produced, 0, None, (taken, std::time::Duration::ZERO))
    });
    if let Err(e) = spawned {
        tracing::error!(error = %e, "cannot start a KV push thread");
    }
}

fn spawn_writer(shared: &Arc<Shared>, tid: &TransferId, reg: &Reg, attempt: u32) -> Option<PartsWriter> {
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
        Ok(_) => Some(PartsWriter { jobs, progress: Progress::new(attempt), latest }),
        Err(e) => {
            tracing::error!(error = %e, "cannot start a KV early-write thread; the KV goes when complete");
            None
        }
    }
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

/// The writer thread: parts in order, then the finish or the notice; ends when the
/// registration is gone (its sender dropped) and nothing is queued.
fn run_writer(t: Target, jobs: mpsc::Receiver<Job>) {
    let _span = tracing::debug_span!("kv_push", transfer_id = %t.tid).entered();
    let ours = t.shared.block_size();
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
                let ranks = t.shared.write_ranks(&*t.conn.transport);
                let runs = Runs { src, dst, num_tokens: to - from, ranks };
                let num_layers = t.shared.memory.layout().num_layers;
                let header = |bulk: Bulk| write_blocks(&t.tid, runs, (from, false), bulk, num_layers);
                let mut frames = Frames::new(&t.conn, header);
                match t.conn.transport.write(runs, &fences, None, &mut frames) {
                    Ok(()) => bump(&t.shared.counters.parts_early, 1),
                    Err(e) => {
                        tracing::warn!(transfer_id = %t.tid, error = %e, "early KV part failed");
                        failed = Some(e.to_string());
                    }
                }
            }
            Job::Finish { reg, produced, from, taken } => {
                let backlog = taken.elapsed();
                write_whole(&t.shared, t.tid.clone(), reg, produced, from, failed.take(), (taken, backlog));
                return;
            }
            Job::Notify(msg) => {
                let _ = t.conn.send(&msg);
                return;
            }
        }
    }
}

/// Prefill: writes the produced KV from token `from` on (the parts before it are in place)
/// into the registered blocks, sends `Done`, then frees the blocks; or, with `failed` (an
/// early part did not land), fails the transfer. Runs on a writer thread, never the engine's.
/// `taken.0`: when the rendezvous met (the write's time, which `Done` reports, counts from
/// there, including any part still being copied); `taken.1`: how long the parts queued before
/// it ran on after it.
fn write_whole(
    s: &Arc<Shared>,
    tid: TransferId,
    reg: Reg,
    produced: Produced,
    from: usize,
    failed: Option<String>,
    (taken, backlog): (Instant, std::time::Duration),
) {
    let Produced { held, blocks, num_tokens, first_token, produced_unix_us, .. } = produced;
    let layout = s.memory.layout();
    let transport = &reg.conn.transport;
    let direct = transport.writes_directly();
    let sizes = (layout.block_size, reg.conn.peer.block_size.max(1));
    let late = direct && Instant::now() >= reg.deadline;
    let checked = push::rest_to_write((&blocks, &reg.blocks), sizes, from, num_tokens, reg.num_tokens, failed, late);
    // What decode checks the copies against (over the whole prompt: the parts written while it
    // computed too); tcp's bytes carry their own CRC-32.
    let digest = match checked {
        Ok(_) if direct => s.source_digest(&blocks, num_tokens),
        _ => Ok(None),
    };
    let checked = checked.and_then(|rest| digest.clone().map(|_| rest));
    let (src, dst) = match checked {
        Ok(rest) => rest,
        Err(reason) => {
            s.tables().pushing.remove(&tid);
            let _ = reg.conn.send(&Message::Failed { transfer_id: tid, reason });
            bump(&s.counters.transfers_failed, 1);
            return;
        }
    };
    std::thread::sleep(s.cfg.faults.slow_write);
    let backlog_us = backlog.as_micros() as u64;
    let done = PushDone { first_token, produced_unix_us, taken, backlog_us, digest: digest.ok().flatten() };
    let runs = Runs { src, dst, num_tokens: num_tokens - from, ranks: s.write_ranks(&**transport) };
    let result = send(s, &reg.conn, &tid, (runs, from), done);
    s.tables().pushing.remove(&tid);
    // The bytes have left our memory (or the write failed): the blocks can go back.
    drop(held);
    match result {
        Ok(()) => {
            bump(&s.counters.bytes_sent, wire_bytes(&layout, s.memory.dtype(), num_tokens));
            bump(
                &s.counters.regions,
                coalesce(&blocks[..layout.blocks_for(num_tokens).min(blocks.len())]).len() as u64,
            );
            // Over tcp, decode's acknowledgement says whether the bytes landed.
            if !transport.acknowledges_writes() {
                bump(&s.counters.transfers_ok, 1);
            }
        }
        Err(e) => {
            tracing::warn!(transfer_id = %tid, transport = transport.name(), error = %e, "push write failed");
            bump(&s.counters.transfers_failed, 1);
        }
    }
}

/// The final write of `runs` over the connection's transport, then `Done` with prefill's first
/// token: after the bytes on the side channel (inline), or once the copies into decode's
/// memory have completed, with how long they took (direct). A failed copy is returned as the
/// error once decode has been told.
fn send(
    s: &Shared,
    conn: &Conn,
    tid: &TransferId,
    (runs, from): (Runs<'_>, usize),
    done: PushDone,
) -> Result<(), KvError> {
    let transport = &conn.transport;
    let complete = KvFences::complete();
    if !transport.writes_directly() {
        let num_layers = s.memory.layout().num_layers;
        let mut frames = Frames::new(conn, |bulk: Bulk| write_blocks(tid, runs, (from, true), bulk, num_layers));
        let copied = transport.write(runs, &complete, None, &mut frames);
        return finish_inline(s, tid, copied, (done, runs.ranks), &mut frames);
    }
    let failure = match transport.write(runs, &complete, Some(tid), &mut NoAnnounce) {
        Ok(()) => None,
        Err(WriteError::Failed(e)) => Some(e),
        Err(WriteError::Channel(e)) => return Err(e),
    };
    let status = failure.clone().map_or(DoneStatus::Ok, DoneStatus::Failed);
    if !s.cfg.faults.drop_done {
        let copy_us = done.taken.elapsed().as_micros() as u64;
        conn.send(&done_message(tid, done, status, copy_us, (0, 1)))?;
    }
    // Decode has been told; the writer counts and logs the failure too.
    failure.map_or(Ok(()), |e| Err(KvError::Transfer(e)))
}

/// The frame announcing inline bytes of `runs`, tokens from `from` of the transfer (`last`: its
/// final write, which `Done` follows: the last rank's announcement of it), of the layers and
/// rank `bulk` says (the layers named when not all `num_layers`).
fn write_blocks(
    tid: &TransferId,
    runs: Runs<'_>,
    (from, last): (usize, bool),
    bulk: Bulk,
    num_layers: usize,
) -> Message {
    Message::WriteBlocks {
        transfer_id: tid.clone(),
        blocks: runs.dst.to_vec(),
        src_block_size: bulk.src_block_size,
        num_tokens: runs.num_tokens,
        from_token: from,
        last: last && bulk.rank + 1 == bulk.ranks,
        layers: (bulk.slice.layers.len() < num_layers).then_some([bulk.slice.layers.start, bulk.slice.layers.end]),
        rank: bulk.rank as u32,
        ranks: bulk.ranks as u32,
        bytes: bulk.bytes,
        checksum: bulk.checksum,
        streams: bulk.streams,
    }
}

/// Inline: `Done` after the bytes, one from each of the `ranks` that wrote their heads, on the
/// writer still held; a write that failed before any byte went is told to decode at once
/// (which recomputes or fails), the connection in step.
fn finish_inline<H: FnMut(Bulk) -> Message>(
    s: &Shared,
    tid: &TransferId,
    copied: Result<(), WriteError>,
    (done, ranks): (PushDone, usize),
    frames: &mut Frames<'_, H>,
) -> Result<(), KvError> {
    let faults = &s.cfg.faults;
    match copied {
        Ok(()) if faults.drop_done => Ok(()),
        Ok(()) => (0..ranks)
            .filter(|&rank| faults.drop_done_of_rank != Some(rank as u32))
            .try_for_each(|rank| frames.send(&done_message(tid, done, DoneStatus::Ok, 0, (rank, ranks)))),
        Err(WriteError::Failed(e)) => {
            frames.send(&done_message(tid, done, DoneStatus::Failed(e.clone()), 0, (0, ranks)))?;
            Err(KvError::Transfer(e))
        }
        Err(WriteError::Channel(e)) => Err(e),
    }
}

/// Rank `rank.0` of `rank.1`'s `Done`.
fn done_message(tid: &TransferId, done: PushDone, status: DoneStatus, copy_us: u64, rank: (usize, usize)) -> Message {
    Message::Done {
        transfer_id: tid.clone(),
        rank: rank.0 as u32,
        ranks: rank.1 as u32,
        first_token: Some(done.first_token),
        status,
        copy_us,
        produced_unix_us: done.produced_unix_us,
        backlog_us: done.backlog_us,
        digest: done.digest,
    }
}
