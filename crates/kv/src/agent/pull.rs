//! Pull: prefill holds produced KV under a lease, decode reads it. Decode connects, checks
//! prefill's epoch is the one that produced the KV, and sends `ReadBlocks`; prefill answers
//! through the connection's transport (`BlockData` plus the bytes, or a local copy); decode
//! writes them into its blocks, sends `Done` (the release) and reports `Ready`. Decode's
//! heartbeats extend the lease while it waits; an expired lease is gone, so a late read is
//! refused, never served from reused blocks.

use std::net::TcpStream;
use std::sync::Arc;
use std::time::Instant;

use tandem_core::{Epoch, TransferId};

use super::transport::{check_direct, receive_tcp, Bulk, DirectEnd};
use super::{bump, Conn, Shared};
use crate::blocks::{coalesce, wire_bytes};
use crate::wire::{DoneStatus, Message};
use crate::{ConnectorEvent, KvError, TransferTimeline};

/// What decode knows of the KV it will read (from the prefill leg's `kv_transfer_params`).
pub(super) struct Lease {
    pub epoch: Epoch,
    pub blocks: Vec<u32>,
    pub num_tokens: usize,
}

/// Decode: the request for `lease`'s blocks of `tid`, all but the first `skip` tokens (decode
/// holds their KV), into our `dst` (from the first uncached block on; a direct writer must not
/// start later than `write_within_ms` after receipt). An error says why the read cannot even
/// be asked.
pub(super) fn read(
    conn: &Conn,
    tid: &TransferId,
    lease: Lease,
    skip: usize,
    dst: Vec<u32>,
    write_within_ms: u64,
) -> Result<Message, String> {
    if conn.peer.epoch != lease.epoch {
        return Err(format!(
            "prefill engine `{}` restarted (epoch {} now, the KV was produced under epoch {}): its blocks are gone",
            conn.peer.engine_id, conn.peer.epoch.0, lease.epoch.0
        ));
    }
    let dst_blocks = if conn.transport.writes_directly() { dst } else { Vec::new() };
    if conn.transport.reader_reads() {
        // Prefill cuts its lease's blocks at `skip` by its own block size, as we do here.
        let from = (skip / conn.peer.block_size.max(1)).min(lease.blocks.len());
        let src = lease.blocks[from..].to_vec();
        conn.transport.plan_read(tid, src, dst_blocks.clone(), lease.num_tokens.saturating_sub(skip));
    }
    Ok(Message::ReadBlocks {
        transfer_id: tid.clone(),
        blocks: lease.blocks,
        num_tokens: lease.num_tokens,
        dst_blocks,
        write_within_ms,
        skip_tokens: skip,
    })
}

/// Prefill: decode asks for the blocks of `tid`'s `lease` (blocks, tokens) but its first `skip`
/// tokens (into its `dst` for a direct transport).
pub(super) fn on_read_blocks(
    shared: &Shared,
    conn: &Conn,
    tid: TransferId,
    lease: (Vec<u32>, usize),
    dst: Vec<u32>,
    skip: usize,
    write_within_ms: u64,
) -> Result<(), KvError> {
    let (blocks, num_tokens) = lease;
    let ours = shared.memory.layout().block_size;
    let held = {
        let mut t = shared.tables();
        match t.produced.get_mut(&tid) {
            Some(_) if conn.transport.writes_directly() && write_within_ms == 0 => {
                Err("the decode engine's deadline has passed".to_string())
            }
            Some(_) if !skip.is_multiple_of(ours) || (skip > 0 && skip >= num_tokens) => {
                Err(format!("{skip} cached tokens is not a whole number of {ours}-token blocks before the last"))
            }
            Some(p) if p.blocks.starts_with(&blocks) && p.num_tokens == num_tokens && !p.reading => {
                p.reading = true;
                Ok(p.blocks.get(skip / ours..).map(<[u32]>::to_vec).unwrap_or_default())
            }
            Some(_) => Err("blocks or token count do not match the lease".to_string()),
            None => {
                bump(&shared.counters.unknown_ids, 1);
                Err(format!("no KV held for transfer `{tid}` (unknown, released or lease expired)"))
            }
        }
    };
    let layout = shared.memory.layout();
    let src = match held {
        Ok(src) => src,
        Err(error) => {
            let refusal = Message::BlockData {
                transfer_id: tid,
                src_block_size: layout.block_size,
                bytes: 0,
                error: Some(error),
                direct: conn.transport.writes_directly(),
                checksum: false,
                copy_us: 0,
                digest: None,
                grant_us: 0,
            };
            return conn.send(&refusal);
        }
    };
    // Decode holds the first `skip` tokens' KV: the rest is read.
    let num_tokens = num_tokens - skip;
    std::thread::sleep(shared.cfg.faults.slow_write);
    let sent = conn.transport.answer_read(shared, conn, &tid, &src, &dst, num_tokens);
    let mut t = shared.tables();
    if let Err(KvError::Transfer(e)) = &sent {
        // Answered in-band (the read failed before a byte was sent), so the connection stays;
        // decode fails the transfer and will not read again: the lease ends now.
        tracing::warn!(transfer_id = %tid, error = %e, "a pull read failed");
        t.produced.remove(&tid);
        return Ok(());
    }
    if let Some(p) = t.produced.get_mut(&tid) {
        p.reading = false;
    }
    drop(t);
    sent?;
    bump(&shared.counters.bytes_sent, wire_bytes(&layout, shared.memory.dtype(), num_tokens));
    bump(&shared.counters.regions, coalesce(&src[..layout.blocks_for(num_tokens).min(src.len())]).len() as u64);
    Ok(())
}

/// Prefill: decode released the lease of `tid` (its `Done`). Whether there was one.
pub(super) fn on_release(shared: &Shared, tid: &TransferId, status: &DoneStatus) -> bool {
    let released = {
        let mut t = shared.tables();
        // Freed already on the router's word as the request ended: decode's word still counts.
        t.produced.remove(tid).is_some() || t.released.remove(tid).is_some()
    };
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

/// Prefill: decode still waits for these transfers; extend their leases.
pub(super) fn on_heartbeat(shared: &Shared, tids: Vec<TransferId>) {
    let until = Instant::now() + shared.cfg.lease;
    let mut t = shared.tables();
    for tid in tids {
        if let Some(p) = t.produced.get_mut(&tid) {
            p.deadline = p.deadline.max(until);
        }
    }
}

/// Decode: prefill's answer to our read of `tid`: the bytes follow on `stream` (tcp), were
/// copied already (`direct`: local, or cuda-ipc; with the copies' time), or an error says why
/// not.
pub(super) fn on_block_data(
    stream: &mut TcpStream,
    conn: &Arc<Conn>,
    shared: &Arc<Shared>,
    tid: TransferId,
    data: Bulk,
    error: Option<String>,
    direct: Option<DirectEnd>,
) -> Result<(), KvError> {
    match (conn.transport.writes_directly(), direct) {
        (true, end) => {
            let end = end.unwrap_or(DirectEnd { copy_us: 0, digest: None, grant_us: 0 });
            return super::land(conn, shared, move |conn, shared| on_direct_read_end(conn, shared, tid, error, end));
        }
        (false, Some(_)) => return Err(KvError::Protocol("a direct-copy answer on a tcp connection".into())),
        (false, None) => {}
    }
    if let Some(reason) = error {
        let mut t = shared.tables();
        shared.finish_incoming(&mut t, &tid, |inc| ConnectorEvent::Failed { request_id: inc.request_id, reason });
        return Ok(());
    }
    let num_tokens = shared.tables().incoming.get(&tid).map(|i| i.num_tokens).unwrap_or(0);
    let landed = receive_tcp(stream, shared, &tid, None, num_tokens, data)?;
    let failure = shared.tables().incoming.get_mut(&tid).and_then(|i| i.failure.take());
    // Release prefill's blocks whatever happened here: we will not read them again.
    let outcome = match (&landed, &failure) {
        (Ok(()), None) => DoneStatus::Ok,
        (_, Some(why)) | (Err(why), None) => DoneStatus::Failed(why.clone()),
    };
    conn.send(&release(tid.clone(), outcome))?;
    let mut t = shared.tables();
    if let Some(reason) = failure {
        shared.finish_incoming(&mut t, &tid, |inc| ConnectorEvent::Failed { request_id: inc.request_id, reason });
        return Ok(());
    }
    drop(t);
    if landed.is_ok() {
        let mut t = shared.tables();
        let first_token = t.incoming.get(&tid).and_then(|i| i.first_token);
        shared.finish_incoming(&mut t, &tid, |inc| ConnectorEvent::Ready {
            timeline: TransferTimeline { ready_us: inc.since(), ..inc.timeline },
            request_id: inc.request_id,
            first_token,
        });
    }
    Ok(())
}

/// Decode, direct transports (cuda-ipc, local): prefill's copies into our blocks for `tid` have completed (or, with an
/// error, never ran); release its lease and report.
fn on_direct_read_end(
    conn: &Conn,
    shared: &Shared,
    tid: TransferId,
    mut error: Option<String>,
    end: DirectEnd,
) -> Result<(), KvError> {
    if error.is_none() {
        conn.transport.granted(&tid, std::time::Duration::from_micros(end.grant_us));
        // Before the table is locked again: the digest reads every block once.
        error = check_direct(shared, &tid, end.digest).err();
    }
    let copy_us = end.copy_us;
    let outcome = match &error {
        None => DoneStatus::Ok,
        Some(why) => DoneStatus::Failed(why.clone()),
    };
    // Release prefill's blocks whatever happened here (we will not read them again), before
    // the engine hears: the lease has then ended at prefill, counted by decode's word, before
    // the request can end and the router has prefill free what it still holds for it.
    let released = conn.send(&release(tid.clone(), outcome));
    let mut t = shared.tables();
    let Some(inc) = t.incoming.get_mut(&tid) else {
        return released;
    };
    inc.direct_write_reported(copy_us);
    let (bytes, regions) = super::push::direct_write_size(shared, inc);
    let aborted = t.end_write(&tid, error.is_none(), bytes, regions);
    if error.is_none() {
        bump(&shared.counters.bytes_received, bytes);
    }
    let first_token = t.incoming.get(&tid).and_then(|i| i.first_token);
    shared.finish_incoming(&mut t, &tid, |inc| match (aborted, error) {
        (true, _) => ConnectorEvent::Released { request_id: inc.request_id },
        (false, Some(reason)) => ConnectorEvent::Failed { request_id: inc.request_id, reason },
        (false, None) => ConnectorEvent::Ready {
            timeline: TransferTimeline { ready_us: inc.since(), ..inc.timeline },
            request_id: inc.request_id,
            first_token,
        },
    });
    released
}

/// Decode: the message that releases prefill's lease on `tid` (its blocks go back).
/// Decode: releases prefill's lease on `tid`, saying whether the KV read landed (`status`).
fn release(tid: TransferId, status: DoneStatus) -> Message {
    Message::Done {
        transfer_id: tid,
        rank: 0,
        first_token: None,
        status,
        copy_us: 0,
        produced_unix_us: 0,
        digest: None,
    }
}

/// Decode: keeps prefill's leases alive for everything still being waited on.
pub(super) fn heartbeat(shared: &Shared) {
    let mut per_conn: Vec<(Arc<Conn>, Vec<TransferId>)> = Vec::new();
    {
        let t = shared.tables();
        for (tid, inc) in t.incoming.iter().filter(|(_, i)| i.pull) {
            if let Some(c) = &inc.conn {
                match per_conn.iter_mut().find(|(pc, _)| Arc::ptr_eq(pc, c)) {
                    Some((_, v)) => v.push(tid.clone()),
                    None => per_conn.push((c.clone(), vec![tid.clone()])),
                }
            }
        }
    }
    for (c, ids) in per_conn {
        let _ = c.send(&Message::Heartbeat { transfer_ids: ids });
    }
}
