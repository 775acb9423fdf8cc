//! Push: decode registers its blocks, prefill writes them. Prefill pairs the registration and
//! the produced KV by transfer id in either order; whichever arrives second starts the write
//! on a short-lived thread (the connection's transport: `WriteBlocks` plus the bytes, or a
//! local copy), then `Done` with the first token, then prefill frees its blocks. Decode writes
//! the bytes into the registered blocks and reports `Ready` on `Done` (which TCP orders after
//! the data).

use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_core::{Epoch, TransferId};

use super::early;
use super::table::{Produced, Registration, Rendezvous};
use super::transport::{receive_tcp, Bulk};
use super::{bump, Conn, Shared};
use crate::blocks::{coalesce, wire_bytes};
use crate::wire::{DoneStatus, Message};
use crate::{ConnectorEvent, HeldBlocks, KvError, TransferTimeline};

/// Decode: the request that asks prefill for the KV of `tid` by registering our blocks; a
/// direct writer must not start writing later than `write_within_ms` after it receives it.
pub(super) fn register(
    shared: &Shared,
    tid: &TransferId,
    blocks: Vec<u32>,
    num_tokens: usize,
    skip_tokens: usize,
    write_within_ms: u64,
) -> Message {
    Message::Register {
        transfer_id: tid.clone(),
        decode_engine: shared.info.engine_id.clone(),
        epoch: shared.info.epoch,
        block_ids: blocks,
        num_tokens,
        write_within_ms,
        skip_tokens,
    }
}

/// Prefill: records produced KV (called on the engine thread: a table insert, no I/O) and, if
/// decode already registered, starts the write.
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
            crate::KvMode::Push => shared.cfg.transfer_timeout,
            crate::KvMode::Pull => shared.cfg.lease,
        };
    let produced_unix_us = unix_us();
    let produced =
        Produced { held, blocks, num_tokens, first_token, produced_unix_us, deadline, reading: false, attempt };
    let met = shared.tables().meet_produced(tid.clone(), produced);
    match met {
        Rendezvous::Met(reg, produced) => early::finish(shared, tid, reg, produced),
        Rendezvous::Waiting => {}
        Rendezvous::Aborted => tracing::debug!(transfer_id = %tid, "KV produced for a transfer decode gave up; freed"),
        Rendezvous::Duplicate => {
            bump(&shared.counters.duplicate_ids, 1);
            tracing::warn!(transfer_id = %tid, "KV produced twice under one transfer id; dropping the second");
        }
    }
}

/// Prefill: decode's registration arrived on `conn`.
pub(super) fn on_register(
    shared: &Arc<Shared>,
    conn: &Arc<Conn>,
    tid: TransferId,
    epoch: Epoch,
    wanted: super::Wanted,
    write_within_ms: u64,
) -> Result<(), KvError> {
    if epoch != conn.peer.epoch {
        let reason = "registration epoch does not match the handshake".into();
        return conn.send(&Message::Failed { transfer_id: tid, reason });
    }
    let now = Instant::now();
    let mut deadline = now + shared.cfg.transfer_timeout;
    if conn.transport.writes_directly() {
        // Decode frees its blocks once its own deadline has passed: no write may start later.
        deadline = deadline.min(now + Duration::from_millis(write_within_ms));
    }
    let ours = shared.memory.layout().block_size;
    if !wanted.skip.is_multiple_of(ours) {
        let reason = format!("{} cached tokens is not a whole number of {ours}-token blocks", wanted.skip);
        return conn.send(&Message::Failed { transfer_id: tid, reason });
    }
    let super::Wanted { blocks, num_tokens, skip } = wanted;
    let reg = Registration { conn: conn.clone(), blocks, num_tokens, skip, deadline, early: None };
    let met = {
        let mut t = shared.tables();
        let met = t.meet_registration(tid.clone(), reg);
        if matches!(met, Rendezvous::Waiting) {
            early::on_registered(shared, &mut t, &tid);
        }
        met
    };
    match met {
        Rendezvous::Met(reg, produced) => early::finish(shared, tid, reg, produced),
        Rendezvous::Waiting | Rendezvous::Aborted => {}
        Rendezvous::Duplicate => {
            bump(&shared.counters.duplicate_ids, 1);
            conn.send(&Message::Failed { transfer_id: tid, reason: "duplicate registration".into() })?;
        }
    }
    Ok(())
}

/// Prefill: writes the produced KV from token `from` on (the parts before it are in place)
/// into the registered blocks, sends `Done`, then frees the blocks; or, with `failed` (an
/// early part did not land), fails the transfer. Runs on a writer thread, never the engine's.
/// `taken`: when the rendezvous met (the write's time, which `Done` reports, counts from
/// there, including any part still being copied).
pub(super) fn write_whole(
    s: &Arc<Shared>,
    tid: TransferId,
    reg: Registration,
    produced: Produced,
    from: usize,
    failed: Option<String>,
    taken: Instant,
) {
    let Produced { held, blocks, num_tokens, first_token, produced_unix_us, .. } = produced;
    let layout = s.memory.layout();
    let (ours, theirs) = (layout.block_size, reg.conn.peer.block_size.max(1));
    let rest = match (blocks.get(from / ours..), reg.blocks.get(from / theirs..)) {
        (Some(src), Some(dst)) if from <= num_tokens => Ok((src, dst)),
        _ => Err("the blocks do not cover the KV written so far".to_string()),
    };
    let checked = if reg.num_tokens != num_tokens {
        Err(format!("decode registered {} tokens, prefill produced {num_tokens}", reg.num_tokens))
    } else if let Some(why) = failed {
        Err(why)
    } else if reg.conn.transport.writes_directly() && Instant::now() >= reg.deadline {
        Err("the decode engine's deadline passed before the KV was ready".to_string())
    } else {
        rest
    };
    // What decode checks the copies against (over the whole prompt: the parts written while it
    // computed too); tcp's bytes carry their own CRC-32.
    let digest = match checked {
        Ok(_) if reg.conn.transport.writes_directly() => super::transport::source_digest(s, &blocks, num_tokens),
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
    let done = PushDone { first_token, produced_unix_us, taken, digest: digest.ok().flatten() };
    let result = reg.conn.transport.push(s, &reg.conn, &tid, src, dst, num_tokens - from, done);
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
            if !reg.conn.transport.acknowledges_writes() {
                bump(&s.counters.transfers_ok, 1);
            }
        }
        Err(e) => {
            tracing::warn!(transfer_id = %tid, transport = reg.conn.transport.name(), error = %e, "push write failed");
            bump(&s.counters.transfers_failed, 1);
        }
    }
}

/// Decode: prefill's bytes for `tid` follow on `stream`; acknowledged either way.
pub(super) fn on_write_blocks(
    stream: &mut TcpStream,
    conn: &Conn,
    shared: &Shared,
    tid: TransferId,
    blocks: &[u32],
    num_tokens: usize,
    data: Bulk,
) -> Result<(), KvError> {
    let result = receive_tcp(stream, shared, &tid, Some(blocks), num_tokens, data)?;
    conn.send(&Message::WriteAck { transfer_id: tid, error: result.err() })
}

/// What a push's `Done` carries besides its status.
#[derive(Clone, Copy, Debug)]
pub(super) struct PushDone {
    /// The token prefill sampled after the prompt.
    pub first_token: u32,
    /// When prefill's engine handed the KV over (wall clock, Unix microseconds).
    pub produced_unix_us: u64,
    /// When the writing thread took the transfer on (a direct write's copy time counts from here).
    pub taken: Instant,
    /// A direct write under `--kv-verify`: the digest of the whole prompt's KV it copies.
    pub digest: Option<u64>,
}

/// Microseconds since the Unix epoch now (0 if the clock is before it).
pub(super) fn unix_us() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

/// What decode learns from a push's `Done`.
#[derive(Clone, Debug)]
pub(super) struct DoneReport {
    /// Prefill's first token.
    pub first_token: Option<u32>,
    /// Outcome.
    pub status: DoneStatus,
    /// A direct write's copy time (0 for bytes on the socket).
    pub copy_us: u64,
    /// When prefill handed the KV over (0: unknown).
    pub produced_unix_us: u64,
    /// A direct write under `--kv-verify`: the writer's digest of what it copied.
    pub digest: Option<u64>,
}

/// Decode: prefill says the write of `tid` is complete (or failed).
pub(super) fn on_done(shared: &Shared, tid: &TransferId, done: DoneReport) {
    let DoneReport { first_token, mut status, copy_us, produced_unix_us, digest } = done;
    let direct = shared.tables().incoming.get(tid).is_some_and(|i| i.direct && !i.pull);
    if direct && status == DoneStatus::Ok {
        // Before the table is locked again: the digest reads every block once.
        if let Err(why) = super::transport::check_direct(shared, tid, digest) {
            status = DoneStatus::Failed(why);
        }
    }
    let mut t = shared.tables();
    let Some(inc) = t.incoming.get(tid) else {
        bump(&shared.counters.unknown_ids, 1);
        return;
    };
    if inc.pull {
        return;
    }
    let direct = inc.direct;
    if direct {
        // The peer's copies into our blocks have completed (or will never run).
        let (bytes, regions) = direct_write_size(shared, inc);
        if let Some(inc) = t.incoming.get_mut(tid) {
            inc.direct_write_reported(copy_us);
        }
        if t.end_write(tid, status == DoneStatus::Ok, bytes, regions) {
            shared.finish_incoming(&mut t, tid, |inc| ConnectorEvent::Released { request_id: inc.request_id });
            return;
        }
        if status == DoneStatus::Ok {
            bump(&shared.counters.bytes_received, bytes);
        }
    }
    if let Some(inc) = t.incoming.get_mut(tid) {
        inc.timeline.produced_unix_us = produced_unix_us;
    }
    let landed = t.incoming.get(tid).is_some_and(|i| i.landing == super::table::Landing::Landed);
    shared.finish_incoming(&mut t, tid, |inc| match status {
        DoneStatus::Ok if landed => ConnectorEvent::Ready {
            timeline: TransferTimeline { ready_us: inc.since(), ..inc.timeline },
            request_id: inc.request_id,
            first_token,
        },
        DoneStatus::Ok => ConnectorEvent::Failed {
            request_id: inc.request_id,
            reason: inc.failure.unwrap_or_else(|| "completion arrived without data".into()),
        },
        DoneStatus::Failed(reason) => ConnectorEvent::Failed { request_id: inc.request_id, reason },
    });
}

/// Decode: what a direct write into `inc`'s blocks moved: the writer's whole blocks (as tcp
/// would have sent them), over our contiguous runs.
pub(super) fn direct_write_size(shared: &Shared, inc: &super::table::Incoming) -> (u64, u32) {
    let layout = shared.memory.layout();
    let writer_block = inc.conn.as_ref().map_or(layout.block_size, |c| c.peer.block_size.max(1));
    let sent = wire_bytes(
        &tandem_compute::KvLayout { block_size: writer_block, ..layout },
        shared.memory.dtype(),
        inc.num_tokens,
    );
    let used = layout.blocks_for(inc.num_tokens).min(inc.blocks.len());
    (sent, coalesce(&inc.blocks[..used]).len() as u32)
}
