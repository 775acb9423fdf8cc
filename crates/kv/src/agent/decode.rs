//! The decode engine's asking side of both protocols, as the agent's threads carry it out: a
//! request the engine expects KV for becomes a table entry and a registration (push) or a read
//! (pull) on the prefill engine's connection; aborts, heartbeats, and what a lost connection
//! ends. What arrives for it is `landing`'s.

use std::sync::Arc;
use std::time::Instant;

use tandem_core::{RemoteKv, RequestId, TransferId};

use super::conn::Conn;
use super::shared::{bump, ended, Shared};
use crate::error::KvError;
use crate::events::{ConnectorEvent, TransferTimeline};
use crate::protocol::pull::{self, Lease};
use crate::protocol::push::shared_run;
use crate::protocol::Wanted;
use crate::table::{Aborted, Incoming, Landing, Lost, RankLanding};
use crate::wire::Message;

/// A transfer recorded and waiting for its request to go to the prefill engine at `peer`.
pub(crate) struct Pending {
    pub tid: TransferId,
    pub peer: String,
    /// Pull: what decode knows of prefill's lease; push: none.
    lease: Option<Lease>,
    wanted: Wanted,
    deadline: Instant,
}

/// Register (push) or read (pull) the KV of `num_tokens` prompt tokens into `blocks`, all but
/// the first `cached_tokens`, whose KV the blocks hold already (decode's prefix cache).
/// Everything after this sees only the rest: the blocks from the first uncached one, and the
/// tokens after the cached ones. `None`: the request ended here (reported).
pub(crate) fn expect(
    shared: &Shared,
    request_id: RequestId,
    source: RemoteKv,
    blocks: Vec<u32>,
    num_tokens: usize,
    cached_tokens: usize,
) -> Option<Pending> {
    let ours = shared.block_size();
    let skip = cached_tokens;
    let fail = |request_id, reason| {
        shared.emit(ConnectorEvent::Failed { request_id, reason });
        None
    };
    if !skip.is_multiple_of(ours) || (skip > 0 && skip >= num_tokens) || skip / ours > blocks.len() {
        return fail(
            request_id,
            format!("{skip} cached tokens is not a whole number of blocks before the last of {num_tokens}"),
        );
    }
    let deadline = Instant::now() + shared.cfg.transfer_timeout;
    let (tid, peer, lease, first_token) = match source {
        RemoteKv::PushFrom { transfer_id, peer, .. } => (transfer_id, peer, None, None),
        RemoteKv::PullFrom { num_tokens: remote_tokens, .. } if remote_tokens != num_tokens => {
            return fail(
                request_id,
                format!("prefill holds {remote_tokens} tokens of KV, this request needs {num_tokens}"),
            );
        }
        RemoteKv::PullFrom {
            transfer_id, peer, epoch, blocks: remote, num_tokens: remote_tokens, first_token, ..
        } => {
            let lease = Lease { epoch, blocks: remote, num_tokens: remote_tokens };
            (transfer_id, peer, Some(lease), Some(first_token))
        }
        RemoteKv::Produce { .. } => return fail(request_id, "a produce request cannot expect KV".into()),
    };
    let (blocks, num_tokens) = (blocks[skip / ours..].to_vec(), num_tokens - skip);
    let mut t = shared.tables();
    if t.incoming.contains_key(&tid) {
        bump(&shared.counters.duplicate_ids, 1);
        drop(t);
        return fail(request_id, format!("transfer id `{tid}` is already in use"));
    }
    t.by_request.insert(request_id.clone(), tid.clone());
    let incoming = Incoming {
        request_id,
        conn: None,
        blocks: blocks.clone(),
        num_tokens,
        deadline,
        landing: Landing::Waiting,
        ranks: vec![RankLanding::default()],
        // A direct writer's one write (which names no span) lands them all.
        writing_upto: num_tokens,
        writing_rank: 0,
        writing_group_end: None,
        first_token,
        pull: lease.is_some(),
        direct: false,
        failure: None,
        started: Instant::now(),
        timeline: TransferTimeline::default(),
    };
    t.incoming.insert(tid.clone(), incoming);
    Some(Pending { tid, peer, lease, wanted: Wanted { blocks, num_tokens, skip }, deadline })
}

/// The connection to the prefill engine for `pending` could not be made: the transfer ends,
/// refused when the engines cannot pair (a misconfiguration, which recomputing would hide).
pub(crate) fn unreachable(shared: &Shared, pending: &Pending, e: KvError) {
    let (tid, addr) = (&pending.tid, &pending.peer);
    let mut t = shared.tables();
    match e {
        KvError::Incompatible(_) | KvError::Refused(_) => {
            bump(&shared.counters.peers_refused, 1);
            let reason = format!("prefill engine at {addr} cannot pair with this engine: {e}");
            shared.finish_incoming(&mut t, tid, |inc| ConnectorEvent::Refused { request_id: inc.request_id, reason });
        }
        e => {
            let reason = format!("prefill engine at {addr}: {e}");
            shared.finish_incoming(&mut t, tid, |inc| ended(inc, reason));
        }
    }
}

/// Sends `pending`'s registration (push) or read (pull) on `conn`.
pub(crate) fn send_request(shared: &Shared, conn: Arc<Conn>, pending: Pending) {
    let Pending { tid, lease, wanted, deadline, .. } = pending;
    let fail = |reason: String| {
        let mut t = shared.tables();
        shared.finish_incoming(&mut t, &tid, |inc| ended(inc, reason));
    };
    // The engine aligned its cached prefix to the connection it saw; a peer reconnected since
    // with other blocks would have to write into cached blocks other requests may share.
    let run = shared_run(shared.block_size(), conn.peer.block_size);
    if !wanted.skip.is_multiple_of(run) {
        return fail(format!(
            "the cached prefix ({} tokens) is not a whole number of {run}-token runs with this prefill engine",
            wanted.skip
        ));
    }
    let write_within_ms = deadline.saturating_duration_since(Instant::now()).as_millis() as u64;
    let Wanted { blocks, num_tokens, skip } = wanted;
    let msg = match lease {
        None => Message::Register {
            transfer_id: tid.clone(),
            decode_engine: shared.info.engine_id.clone(),
            epoch: shared.info.epoch,
            block_ids: blocks,
            num_tokens,
            write_within_ms,
            skip_tokens: skip,
        },
        Some(lease) => match read(&conn, &tid, lease, skip, blocks, write_within_ms) {
            Ok(msg) => msg,
            Err(reason) => return fail(reason),
        },
    };
    // The connection's writer is held from before the entry learns its connection until the
    // request is on the wire: an abort, which sends on the same writer once it sees the
    // connection, then always follows the request, so the peer never gets a request for a
    // transfer already given up.
    let mut w = conn.writer();
    {
        let mut t = shared.tables();
        match t.incoming.get_mut(&tid) {
            Some(inc) => {
                inc.conn = Some(conn.clone());
                if conn.transport.writes_directly() {
                    // From the moment the peer learns the blocks, it may write them.
                    inc.direct = true;
                    inc.landing = Landing::Writing;
                }
            }
            None => {
                // Aborted (or expired) while the connection was being made: the abort found no
                // connection to tell, so tell prefill now, which frees what it holds or will
                // produce under the id instead of keeping it for a registration that will not come.
                let _ = w.send(&Message::Abort { transfer_id: tid });
                return;
            }
        }
    }
    let sent = w.send(&msg);
    drop(w);
    match sent {
        Err(e) => fail(format!("sending to prefill engine: {e}")),
        Ok(()) => {
            if let Some(inc) = shared.tables().incoming.get_mut(&tid) {
                inc.timeline.request_sent_us = inc.since();
            }
        }
    }
}

/// Pull: the request for `lease`'s blocks of `tid`, all but the first `skip` tokens (decode
/// holds their KV), into our `dst` (from the first uncached block on; a direct writer must not
/// start later than `write_within_ms` after receipt). An error says why the read cannot even
/// be asked.
fn read(
    conn: &Conn,
    tid: &TransferId,
    lease: Lease,
    skip: usize,
    dst: Vec<u32>,
    write_within_ms: u64,
) -> Result<Message, String> {
    let src = pull::read_request(&lease, conn.peer.epoch, conn.peer.block_size, skip)
        .map_err(|why| format!("prefill engine `{}` {why}", conn.peer.engine_id))?;
    let dst_blocks = if conn.transport.writes_directly() { dst } else { Vec::new() };
    if conn.transport.reader_reads() {
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

/// The engine cancelled the request waiting for its KV: released at once unless a write into
/// its blocks is running (then when the write ends); prefill is told.
pub(crate) fn abort(shared: &Shared, request_id: RequestId) {
    let (conn, tid) = {
        let mut t = shared.tables();
        let tid = t.by_request.get(&request_id).cloned();
        match t.abort(&request_id) {
            Aborted::Unknown => (None, None),
            Aborted::Now(inc) => {
                let conn = inc.conn.clone();
                shared.emit(ConnectorEvent::Released { request_id: inc.request_id });
                (conn, tid)
            }
            Aborted::AtWriteEnd(conn) => (conn, tid),
        }
    };
    match (conn, tid) {
        (Some(conn), Some(tid)) => {
            let _ = conn.send(&Message::Abort { transfer_id: tid });
        }
        // Never registered (or already over): nothing can write its blocks.
        (_, None) => shared.emit(ConnectorEvent::Released { request_id }),
        (None, Some(_)) => {}
    }
}

/// Keeps prefill's leases alive for everything still being waited on.
pub(crate) fn heartbeat(shared: &Shared) {
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

/// `conn` is gone: everything waiting on it ends now rather than at its deadline (see
/// `Tables::lose_connection`).
pub(crate) fn connection_lost(shared: &Shared, conn: &Arc<Conn>) {
    let mut t = shared.tables();
    let reason = format!("connection to `{}` lost", conn.peer.engine_id);
    for (inc, lost) in t.lose_connection(|c| Arc::ptr_eq(c, conn), Instant::now(), shared.cfg.timeouts.io) {
        let (request_id, reason) = (inc.request_id, reason.clone());
        shared.emit(match lost {
            Lost::Failed => ConnectorEvent::Failed { request_id, reason },
            Lost::InFlight { writes_until } => ConnectorEvent::FailedInFlight { request_id, reason, writes_until },
        });
    }
}
