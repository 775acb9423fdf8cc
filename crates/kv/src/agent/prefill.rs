//! The prefill engine's side of both protocols, as the agent's threads carry it out: produced
//! KV and decode's registrations meeting (push; the writes are `push_writer`'s), reads of
//! leased KV answered (pull), releases, heartbeats, aborts and abandoned transfers.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_compute::cuda::KvFences;
use tandem_core::{Epoch, TransferId};

use super::conn::{Conn, Frames};
use super::push_writer;
use super::shared::{bump, Shared};
use crate::blocks::{coalesce, wire_bytes};
use crate::error::KvError;
use crate::events::HeldBlocks;
use crate::protocol::pull::{self, ReadAsk};
use crate::protocol::push::{self, Rendezvous};
use crate::protocol::Wanted;
use crate::table::{Produced, Registration};
use crate::transport::{Bulk, NoAnnounce, Runs, WriteError};
use crate::wire::{DoneStatus, Message};

/// Records produced KV (called on the engine thread: a table insert, no I/O) and, if decode
/// already registered, starts the write.
pub(crate) fn produced(
    shared: &Arc<Shared>,
    tid: TransferId,
    held: HeldBlocks,
    blocks: Vec<u32>,
    num_tokens: usize,
    first_token: u32,
    attempt: u32,
) {
    let deadline = Instant::now()
        + match shared.cfg.mode {
            crate::agent_info::KvMode::Push => shared.cfg.transfer_timeout,
            crate::agent_info::KvMode::Pull => shared.cfg.lease,
        };
    let produced_unix_us = unix_us();
    let produced =
        Produced { held, blocks, num_tokens, first_token, produced_unix_us, deadline, reading: false, attempt };
    let met = push::meet_produced(&mut shared.tables(), tid.clone(), produced);
    match met {
        Rendezvous::Met(reg, produced) => push_writer::finish(shared, tid, reg, produced),
        Rendezvous::Waiting => {}
        Rendezvous::Aborted => tracing::debug!(transfer_id = %tid, "KV produced for a transfer decode gave up; freed"),
        Rendezvous::Duplicate => {
            bump(&shared.counters.duplicate_ids, 1);
            tracing::warn!(transfer_id = %tid, "KV produced twice under one transfer id; dropping the second");
        }
    }
}

/// Push: decode's registration arrived on `conn`.
pub(crate) fn on_register(
    shared: &Arc<Shared>,
    conn: &Arc<Conn>,
    tid: TransferId,
    epoch: Epoch,
    wanted: Wanted,
    write_within_ms: u64,
) -> Result<(), KvError> {
    if let Err(reason) = push::check_registration(epoch, conn.peer.epoch, wanted.skip, shared.block_size()) {
        return conn.send(&Message::Failed { transfer_id: tid, reason });
    }
    let now = Instant::now();
    let mut deadline = now + shared.cfg.transfer_timeout;
    if conn.transport.writes_directly() {
        // Decode frees its blocks once its own deadline has passed: no write may start later.
        deadline = deadline.min(now + Duration::from_millis(write_within_ms));
    }
    let Wanted { blocks, num_tokens, skip } = wanted;
    let reg = Registration { conn: conn.clone(), blocks, num_tokens, skip, deadline, parts: None };
    let met = {
        let mut t = shared.tables();
        let met = push::meet_registration(&mut t, tid.clone(), reg);
        if matches!(met, Rendezvous::Waiting) {
            push_writer::on_registered(shared, &mut t, &tid);
        }
        met
    };
    match met {
        Rendezvous::Met(reg, produced) => push_writer::finish(shared, tid, reg, produced),
        Rendezvous::Waiting | Rendezvous::Aborted => {}
        Rendezvous::Duplicate => {
            bump(&shared.counters.duplicate_ids, 1);
            conn.send(&Message::Failed { transfer_id: tid, reason: "duplicate registration".into() })?;
        }
    }
    Ok(())
}

/// Pull: decode asks for the blocks of `tid`'s `lease` (blocks, tokens) but its first `skip`
/// tokens (into its `dst` for a direct transport).
pub(crate) fn on_read_blocks(
    shared: &Shared,
    conn: &Conn,
    tid: TransferId,
    lease: (Vec<u32>, usize),
    dst: Vec<u32>,
    skip: usize,
    write_within_ms: u64,
) -> Result<(), KvError> {
    let (blocks, num_tokens) = lease;
    let direct = conn.transport.writes_directly();
    let ask = ReadAsk { blocks: &blocks, num_tokens, skip, too_late: direct && write_within_ms == 0 };
    let held = pull::begin_read(&mut shared.tables(), &tid, ask, shared.block_size());
    let src = match held {
        Ok(src) => src,
        Err(refusal) => {
            if refusal.unknown {
                bump(&shared.counters.unknown_ids, 1);
            }
            return conn.send(&refused(shared, tid, refusal.reason, direct));
        }
    };
    // Decode holds the first `skip` tokens' KV: the rest is read (each rank's heads answered on
    // their own where the transport writes per rank).
    let ranks = shared.write_ranks(&*conn.transport);
    let runs = Runs { ranks, ..Runs::whole(&src, &dst, num_tokens - skip) };
    std::thread::sleep(shared.cfg.faults.slow_write);
    let sent = answer_read(shared, conn, &tid, runs);
    let failed_in_band = matches!(sent, Ok(false));
    pull::end_read(&mut shared.tables(), &tid, failed_in_band);
    if sent? {
        let layout = shared.memory.layout();
        bump(&shared.counters.bytes_sent, wire_bytes(&layout, shared.memory.dtype(), runs.num_tokens));
        let used = layout.blocks_for(runs.num_tokens).min(src.len());
        bump(&shared.counters.regions, coalesce(&src[..used]).len() as u64);
    }
    Ok(())
}

/// A refusal of decode's read, saying why.
fn refused(shared: &Shared, tid: TransferId, reason: String, direct: bool) -> Message {
    Message::BlockData {
        transfer_id: tid,
        src_block_size: shared.block_size(),
        bytes: 0,
        error: Some(reason),
        direct,
        checksum: false,
        copy_us: 0,
        digest: None,
        grant_us: 0,
        streams: 1,
        rank: 0,
        ranks: 1,
    }
}

/// Answers decode's read of `runs` through the connection's transport: `BlockData` and the
/// bytes (inline), a direct copy and then `BlockData` (direct), or a grant for decode to read
/// itself. `false`: the read failed in-band before a byte was sent (decode fails it and will not
/// read again).
fn answer_read(shared: &Shared, conn: &Conn, tid: &TransferId, runs: Runs<'_>) -> Result<bool, KvError> {
    let transport = &conn.transport;
    let complete = KvFences::complete();
    if transport.writes_directly() {
        if transport.grants_reads() {
            // Decode READs the blocks itself: the answer grants it, keeping the lease at least
            // `validity` from now, within which decode's READ must end, counted from before it
            // asked. Decode's own copy plan checks its blocks.
            let validity = pull::grant_validity(shared.cfg.timeouts.io, shared.cfg.lease);
            pull::grant(&mut shared.tables(), tid, validity, Instant::now());
            let grant_us = validity.as_micros() as u64;
            answer_direct_read(shared, conn, tid, Instant::now(), runs, Ok(()), grant_us)?;
            return Ok(true);
        }
        let started = Instant::now();
        // Where the reader's transport confirms landings (nixl), the write says it landed.
        let copied = transport.write(runs, &complete, Some(tid), &mut NoAnnounce).map_err(|e| e.to_string());
        answer_direct_read(shared, conn, tid, started, runs, copied, 0)?;
        return Ok(true);
    }
    let mut frames = Frames::new(conn, |bulk: Bulk| Message::BlockData {
        transfer_id: tid.clone(),
        src_block_size: bulk.src_block_size,
        bytes: bulk.bytes,
        error: None,
        direct: false,
        checksum: bulk.checksum,
        copy_us: 0,
        digest: None,
        grant_us: 0,
        streams: bulk.streams,
        rank: bulk.rank as u32,
        ranks: bulk.ranks as u32,
    });
    match transport.write(runs, &complete, None, &mut frames) {
        Ok(()) => Ok(true),
        Err(WriteError::Failed(e)) => {
            // Answered in-band, so the connection stays; the lease ends now.
            tracing::warn!(transfer_id = %tid, error = %e, "a pull read failed");
            frames.send(&refused(shared, tid.clone(), e, false))?;
            Ok(false)
        }
        Err(WriteError::Channel(e)) => Err(e),
    }
}

/// Pull over a direct transport: the copy (begun at `started`) of the lease's KV is done
/// before the answer, so no bytes follow it; under `--kv-verify` the answer carries the digest
/// of what was copied. A reader that reads the blocks itself (NIXL) is granted the read for
/// `grant_us` of lease instead (see `Message::BlockData`; 0 for the others).
fn answer_direct_read(
    shared: &Shared,
    conn: &Conn,
    tid: &TransferId,
    started: Instant,
    runs: Runs<'_>,
    copied: Result<(), String>,
    grant_us: u64,
) -> Result<(), KvError> {
    let copy_us = started.elapsed().as_micros() as u64;
    let (digest, error) = match copied.and_then(|()| shared.source_digest(runs.src, runs.num_tokens)) {
        Ok(digest) => (digest, None),
        Err(e) => (None, Some(e)),
    };
    conn.send(&Message::BlockData {
        transfer_id: tid.clone(),
        src_block_size: shared.block_size(),
        bytes: 0,
        error,
        direct: true,
        checksum: false,
        copy_us,
        digest,
        grant_us,
        streams: 1,
        rank: 0,
        ranks: 1,
    })
}

/// Pull: decode released the lease of `tid` (its `Done`). Whether there was one.
pub(crate) fn on_release(shared: &Shared, tid: &TransferId, status: &DoneStatus) -> bool {
    let released = pull::release(&mut shared.tables(), tid);
    if released {
        // Decode says whether the KV it read landed: a read that did not is a failed transfer
        // here too, not a completed one.
        let counter = match status {
            DoneStatus::Ok => &shared.counters.transfers_ok,
            DoneStatus::Failed(_) => &shared.counters.transfers_failed,
        };
        bump(counter, 1);
    }
    released
}

/// Pull: decode still waits for these transfers; extend their leases.
pub(crate) fn on_heartbeat(shared: &Shared, tids: Vec<TransferId>) {
    pull::extend(&mut shared.tables(), tids, Instant::now() + shared.cfg.lease);
}

/// Push: decode checked a write's bytes (a checksum mismatch, a transfer it had ended, or
/// landed).
pub(crate) fn on_write_ack(shared: &Shared, tid: &TransferId, error: Option<String>) {
    match error {
        Some(e) => {
            tracing::warn!(transfer_id = %tid, error = %e, "decode refused a push write");
            bump(&shared.counters.transfers_failed, 1);
        }
        None => bump(&shared.counters.transfers_ok, 1),
    }
}

/// Decode aborted `tid`: free what is held for it, or, if its KV is not here yet (the prompt
/// computes, or its request is still on the way), free it when it comes. A decode engine whose
/// blocks we write directly keeps them until we say no write can land: the writer's `Done`
/// says so when one is running, else this notice, after any part still being written.
pub(crate) fn on_abort(shared: &Shared, conn: &Conn, tid: TransferId) -> Result<(), KvError> {
    let (reg, pushing) = {
        let mut t = shared.tables();
        let reg = t.registrations.remove(&tid);
        let pushing = t.pushing.contains(&tid);
        if t.produced.remove(&tid).is_none() {
            t.computing.remove(&tid);
            t.aborted.insert(tid.clone(), Instant::now() + shared.cfg.transfer_timeout);
        }
        (reg, pushing)
    };
    if conn.transport.writes_directly() && !pushing {
        let failed = Message::Failed { transfer_id: tid, reason: "aborted by the decode engine".into() };
        match reg {
            Some(reg) => push_writer::notify(reg, failed),
            None => conn.send(&failed)?,
        }
    }
    Ok(())
}

/// The engine gave up on `tid` (it ended before producing KV, or its KV will not be taken):
/// free what is held and tell a registered decoder.
pub(crate) fn abandon(shared: &Shared, tid: TransferId, reason: String) {
    let reg = {
        let mut t = shared.tables();
        if t.produced.remove(&tid).is_some() && shared.cfg.mode == crate::agent_info::KvMode::Pull {
            // Decode's own release may still come: it counts then.
            t.released.insert(tid.clone(), Instant::now() + shared.cfg.lease);
        }
        t.computing.remove(&tid);
        t.registrations.remove(&tid)
    };
    if let Some(reg) = reg {
        push_writer::notify(reg, Message::Failed { transfer_id: tid, reason });
    }
}

/// Microseconds since the Unix epoch now (0 if the clock is before it).
fn unix_us() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}
