//! The decode engine's receiving side of both protocols: bytes off the side channel into a
//! transfer's blocks (inline), a direct writer's word that it wrote them (confirmed, and
//! checked under `--kv-verify`), the completion that makes the request ready, and the release
//! of prefill's lease (pull) before the engine hears.

use std::io::Read;
use std::sync::{Arc, Mutex};

use tandem_core::TransferId;

use super::conn::Conn;
use super::shared::{bump, Shared};
use crate::blocks::{coalesce, wire_bytes};
use crate::error::KvError;
use crate::events::{ConnectorEvent, TransferTimeline};
use crate::protocol::push;
use crate::stream::KvStream;
use crate::table::{Incoming, Landing, NoWrite, WriteSpan};
use crate::transport::tcp::{drain_striped, FRESH};
use crate::transport::Bulk;
use crate::wire::{DoneStatus, Message};

/// Runs `landing` (what follows a direct writer's word that it wrote a transfer: the landing's
/// confirmation, a pull's READ, the report) on a thread of its own when the connection's
/// transport waits on the network for it ([`crate::transport::Transport::landing_waits`]), so
/// that a notification lost for one transfer, or a long READ, holds up no other transfer's
/// message on the connection; else here, on the reader. Every wait inside is bounded; a landing
/// that fails to answer the peer shuts the connection, as the reader would, so what rides on it
/// fails at once.
pub(crate) fn land<F>(conn: &Arc<Conn>, shared: &Arc<Shared>, landing: F) -> Result<(), KvError>
where
    F: FnOnce(&Arc<Conn>, &Arc<Shared>) -> Result<(), KvError> + Send + 'static,
{
    if !conn.transport.landing_waits() {
        return landing(conn, shared);
    }
    // Taken by the thread, or back here if no thread could start.
    let job = Arc::new(Mutex::new(Some(landing)));
    let (theirs, c, s) = (job.clone(), conn.clone(), shared.clone());
    let spawned = std::thread::Builder::new().name("tandem-kv-land".into()).spawn(move || {
        let Some(landing) = theirs.lock().unwrap_or_else(|p| p.into_inner()).take() else { return };
        if let Err(e) = landing(&c, &s) {
            tracing::warn!(peer = %c.peer.engine_id, error = %e, "KV connection failed");
            c.writer().shutdown();
        }
    });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "no thread for a KV landing: landing it on the connection's reader");
        if let Some(landing) = job.lock().unwrap_or_else(|p| p.into_inner()).take() {
            return landing(conn, shared);
        }
    }
    Ok(())
}

/// Push, inline: prefill's bytes for `span` of `tid` follow on `stream`. The transfer's last
/// write is acknowledged either way, with why its KV did not all land if it did not (a part
/// that failed before it); a part that fails is recorded for that, not acknowledged.
pub(crate) fn on_write_blocks(
    stream: &mut KvStream,
    conn: &Conn,
    shared: &Shared,
    tid: TransferId,
    (span, blocks): (WriteSpan, &[u32]),
    bulk: Bulk,
) -> Result<(), KvError> {
    let last = span.last;
    let result = receive(stream, conn, shared, &tid, span, Some(blocks), bulk)?;
    if let Err(why) = &result {
        if let Some(inc) = shared.tables().incoming.get_mut(&tid) {
            inc.failure.get_or_insert_with(|| why.clone());
        }
    }
    if !last {
        return Ok(());
    }
    let failure = shared.tables().incoming.get(&tid).and_then(|i| i.failure.clone());
    conn.send(&Message::WriteAck { transfer_id: tid, error: result.err().or(failure) })
}

/// Inline: reads the announced bytes of `span` of `tid` from `stream` into its registered
/// blocks (exactly `dst` when the sender names them), or drains them if the transfer is unknown,
/// aborted or the span does not follow what landed. The inner result says whether the data landed; the outer one is
/// the connection's.
fn receive(
    stream: &mut KvStream,
    conn: &Conn,
    shared: &Shared,
    tid: &TransferId,
    span: WriteSpan,
    dst: Option<&[u32]>,
    bulk: Bulk,
) -> Result<Result<(), String>, KvError> {
    let num_tokens = span.num_tokens;
    // A group of layers, not all of them: counted once it has landed.
    let group = span.layers.len() < span.num_layers;
    // The bytes come on this stream, or striped over it and the connection's further ones.
    let mut further = match bulk.streams {
        1 => Vec::new(),
        n if n == conn.data.count() => conn.data.readers()?,
        n => return Err(KvError::Protocol(format!("bytes on {n} streams of a connection of {}", conn.data.count()))),
    };
    for s in &further {
        s.set_read_timeout(Some(shared.bulk_read_bound()))?;
    }
    let mut streams: Vec<&mut (dyn Read + Send)> = Vec::with_capacity(bulk.streams);
    streams.push(stream);
    streams.extend(further.iter_mut().map(|s| s as &mut (dyn Read + Send)));
    if shared.cfg.verify && !bulk.checksum {
        // Pairing checks both ends agree on checksums; a peer that still sends none is not
        // trusted with our blocks, which it never touches: the completion reports why.
        drain_striped(&mut streams, bulk.bytes, bulk.checksum)?;
        let reason = "the peer sent KV without the checksum --kv-verify asks for".to_string();
        if let Some(inc) = shared.tables().incoming.get_mut(tid) {
            inc.failure = Some(reason.clone());
        }
        return Ok(Err(reason));
    }
    let _span = tracing::debug_span!("kv_land", transfer_id = %tid).entered();
    let begun = shared.tables().begin_write(tid, span, dst, shared.block_size());
    let blocks = match begun {
        Ok(blocks) => blocks,
        Err(why) => {
            if matches!(why, NoWrite::Unknown) {
                bump(&shared.counters.unknown_ids, 1);
            }
            drain_striped(&mut streams, bulk.bytes, bulk.checksum)?;
            return Ok(Err(format!("transfer `{tid}` is unknown, aborted or does not match")));
        }
    };
    // Safety: these blocks are registered to this transfer; the engine keeps them out of the
    // schedule until the connector reports, and an abort waits for the write to end.
    let bytes = bulk.bytes;
    let crew = if bulk.streams > 1 { conn.data.recv_crew() } else { &FRESH };
    let result = unsafe { conn.transport.receive((&mut streams, crew), bulk, &blocks, num_tokens) };
    let used = shared.memory.layout().blocks_for(num_tokens).min(blocks.len());
    let regions = coalesce(&blocks[..used]).len() as u32;
    let mut t = shared.tables();
    if t.end_write(tid, result.is_ok(), bytes, regions) {
        shared.finish_incoming(&mut t, tid, |inc| ConnectorEvent::Released { request_id: inc.request_id });
    }
    match result {
        Ok(()) => {
            if group {
                bump(&shared.counters.groups_landed, 1);
            }
            bump(&shared.counters.bytes_received, bytes);
            Ok(Ok(()))
        }
        // The stream is still in step: the transfer fails, the connection stays.
        Err(e @ (KvError::Corrupt(_) | KvError::Transfer(_))) => {
            let reason = e.to_string();
            if matches!(e, KvError::Corrupt(_)) {
                bump(&shared.counters.checksum_failures, 1);
                tracing::warn!(transfer_id = %tid, %reason, "KV arrived corrupted");
            } else {
                tracing::warn!(transfer_id = %tid, %reason, "KV arrived but could not be loaded");
            }
            if let Some(inc) = t.incoming.get_mut(tid) {
                inc.failure = Some(reason.clone());
            }
            Ok(Err(reason))
        }
        Err(e) => {
            // The connection is done: closed before the engine hears of the failure, so that
            // a request it sends at once goes over a new connection, not this broken one.
            conn.close();
            let reason = format!("receiving KV: {e}");
            shared.finish_incoming(&mut t, tid, |inc| ConnectorEvent::Failed { request_id: inc.request_id, reason });
            Err(e)
        }
    }
}

/// How a direct writer's copies into our blocks ended, as its `Done` or `BlockData` says.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DirectEnd {
    /// How long the writer's copies took.
    pub copy_us: u64,
    /// The writer's digest of what it copied (`--kv-verify`).
    pub digest: Option<u64>,
    /// A reader that reads itself: how long the holder keeps the lease from its answer.
    pub grant_us: u64,
}

/// Pull: prefill's answer to our read of `tid`: the bytes follow on `stream` (inline), were
/// copied already (`direct`: with the copies' time), or an error says why not.
pub(crate) fn on_block_data(
    stream: &mut KvStream,
    conn: &Arc<Conn>,
    shared: &Arc<Shared>,
    tid: TransferId,
    bulk: Bulk,
    error: Option<String>,
    direct: Option<DirectEnd>,
) -> Result<(), KvError> {
    match (conn.transport.writes_directly(), direct) {
        (true, end) => {
            let end = end.unwrap_or(DirectEnd { copy_us: 0, digest: None, grant_us: 0 });
            return land(conn, shared, move |conn, shared| on_direct_read_end(conn, shared, tid, error, end));
        }
        (false, Some(_)) => return Err(KvError::Protocol("a direct-copy answer on a tcp connection".into())),
        (false, None) => {}
    }
    if let Some(reason) = error {
        let mut t = shared.tables();
        shared.finish_incoming(&mut t, &tid, |inc| ConnectorEvent::Failed { request_id: inc.request_id, reason });
        return Ok(());
    }
    let num_tokens = shared.tables().incoming.get(&tid).map(|i| i.num_tokens);
    let (rank, ranks) = (bulk.rank, bulk.ranks);
    let whole = WriteSpan::whole(num_tokens.unwrap_or(0), shared.memory.layout().num_layers);
    let span = WriteSpan { rank, ranks, last: rank + 1 == ranks, ..whole };
    let landed = receive(stream, conn, shared, &tid, span, None, bulk)?;
    if num_tokens.is_none() && rank > 0 {
        // A later rank's answer to a read that ended on an earlier one's (which released the
        // lease): its bytes are drained, nothing is left to release.
        return Ok(());
    }
    if ranks > 1 && landed.is_ok() {
        bump(&shared.counters.rank_notices, 1);
    }
    let failure = shared.tables().incoming.get_mut(&tid).and_then(|i| i.failure.take());
    // A tensor-parallel holder's ranks each answer with their own heads: the read is whole, and
    // the lease released, once every rank's have landed (or one failed, or the request ended).
    let waiting = shared.tables().incoming.get(&tid).is_some_and(|i| i.landing != Landing::Landed);
    if landed.is_ok() && failure.is_none() && waiting {
        return Ok(());
    }
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
    if landed.is_ok() {
        shared.finish_incoming(&mut t, &tid, ready);
    }
    Ok(())
}

/// Pull, direct transports: prefill's copies into our blocks for `tid` have completed (or,
/// with an error, never ran), or it granted our own read; release its lease and report.
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
    inc.direct_write_reported(end.copy_us);
    let (bytes, regions) = direct_write_size(shared, inc);
    let aborted = t.end_write(&tid, error.is_none(), bytes, regions);
    if error.is_none() {
        bump(&shared.counters.bytes_received, bytes);
    }
    shared.finish_incoming(&mut t, &tid, |inc| match (aborted, error) {
        (true, _) => ConnectorEvent::Released { request_id: inc.request_id },
        (false, Some(reason)) => ConnectorEvent::Failed { request_id: inc.request_id, reason },
        (false, None) => ready(inc),
    });
    released
}

/// Decode: releases prefill's lease on `tid`, saying whether the KV read landed (`status`).
fn release(tid: TransferId, status: DoneStatus) -> Message {
    Message::Done {
        transfer_id: tid,
        rank: 0,
        ranks: 1,
        first_token: None,
        status,
        copy_us: 0,
        produced_unix_us: 0,
        backlog_us: 0,
        digest: None,
    }
}

/// What decode learns from a push's `Done`.
#[derive(Clone, Debug)]
pub(crate) struct DoneReport {
    /// Which of the writer's ranks says it, of how many (each of which says `Done`).
    pub rank: (usize, usize),
    /// Prefill's first token.
    pub first_token: Option<u32>,
    /// Outcome.
    pub status: DoneStatus,
    /// A direct write's copy time (0 for bytes on the socket).
    pub copy_us: u64,
    /// When prefill handed the KV over (0: unknown).
    pub produced_unix_us: u64,
    /// How long the writer still sent earlier steps' KV after the hand-over.
    pub backlog_us: u64,
    /// A direct write under `--kv-verify`: the writer's digest of what it copied.
    pub digest: Option<u64>,
}

/// Push: prefill says the write of `tid` is complete (or failed).
pub(crate) fn on_done(shared: &Shared, tid: &TransferId, done: DoneReport) {
    let DoneReport { rank: (rank, ranks), first_token, mut status, copy_us, produced_unix_us, backlog_us, digest } =
        done;
    if ranks != 1 && status == DoneStatus::Ok {
        // A tensor-parallel writer's ranks each say `Done`: the transfer goes on with the last
        // of them (a failure ends it at once; a rank whose word is lost leaves it to its deadline).
        let mut t = shared.tables();
        let counted = t.incoming.get_mut(tid).filter(|i| !i.pull && !i.direct).map(|i| i.rank_done(rank, ranks));
        if matches!(counted, Some(Ok(_))) {
            bump(&shared.counters.rank_notices, 1);
        }
        match counted {
            Some(Ok(false)) => return,
            Some(Err(why)) => status = DoneStatus::Failed(why),
            // The last rank's word, or one the path below refuses.
            Some(Ok(true)) | None => {}
        }
    }
    let direct = shared.tables().incoming.get(tid).is_some_and(|i| i.direct && !i.pull);
    if direct && status == DoneStatus::Ok {
        // Before the table is locked again: the digest reads every block once.
        if let Err(why) = check_direct(shared, tid, digest) {
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
    if inc.direct {
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
    let Some(inc) = t.incoming.get_mut(tid) else { return };
    inc.timeline.produced_unix_us = produced_unix_us;
    inc.timeline.handover_backlog_us = backlog_us;
    inc.first_token = first_token;
    let landed = inc.landing == Landing::Landed;
    let failure = inc.failure.take();
    shared.finish_incoming(&mut t, tid, |inc| match push::completion(status, landed, failure) {
        Ok(()) => ready(inc),
        Err(reason) => ConnectorEvent::Failed { request_id: inc.request_id, reason },
    });
}

/// The `Ready` that ends `inc`, with prefill's first token (pull: from the router; push: from
/// `Done`).
fn ready(inc: Incoming<Arc<Conn>>) -> ConnectorEvent {
    ConnectorEvent::Ready {
        timeline: TransferTimeline { ready_us: inc.since(), ..inc.timeline },
        first_token: inc.first_token,
        request_id: inc.request_id,
    }
}

/// Whether the KV a direct writer says it copied into the blocks of `tid` has landed (the
/// transport confirms it) and, under `--kv-verify`, is what it copied, by its digest against
/// ours of those blocks (not a byte of it crossed a socket, so tcp's CRC-32 never saw it). A
/// mismatch counts as a checksum failure; either failure fails the transfer, and the engine
/// recomputes or fails it by its policy.
fn check_direct(shared: &Shared, tid: &TransferId, theirs: Option<u64>) -> Result<(), String> {
    let conn = shared.tables().incoming.get(tid).and_then(|i| i.conn.clone());
    if let Some(conn) = conn {
        conn.transport.confirm_landed(tid)?;
    }
    if !shared.cfg.verify {
        return Ok(());
    }
    let Some(theirs) = theirs else {
        return Err("the peer copied KV without the digest --kv-verify asks for".into());
    };
    // The blocks stay the transfer's (writing, not yet ready) until this returns.
    let Some((blocks, num_tokens)) = shared.tables().incoming.get(tid).map(|i| (i.blocks.clone(), i.num_tokens)) else {
        return Ok(()); // over already: nothing will use the blocks
    };
    // Safety: the writer's copies have completed and nobody else writes a transfer's blocks
    // before it is reported.
    let ours = unsafe { shared.memory.digest(&blocks, num_tokens) }.map_err(|e| e.to_string())?;
    if ours != theirs {
        bump(&shared.counters.checksum_failures, 1);
        return Err(format!(
            "KV digest mismatch: the writer's digest is {theirs:016x}, the {num_tokens} tokens that landed give {ours:016x}"
        ));
    }
    Ok(())
}

/// What a direct write into `inc`'s blocks moved: the writer's whole blocks (as tcp would have
/// sent them), over our contiguous runs.
fn direct_write_size(shared: &Shared, inc: &Incoming<Arc<Conn>>) -> (u64, u32) {
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
