//! A connection's reader thread, once per connection: every message the peer sends, handed to
//! the side of the protocol it is for, until the connection ends; then what rode on it ends.

use std::sync::Arc;

use super::conn::Conn;
use super::landing::{self, DirectEnd, DoneReport};
use super::shared::{bump, ended, Shared};
use super::{decode, prefill};
use crate::agent_info::Role;
use crate::blocks::KvSlice;
use crate::error::KvError;
use crate::protocol::Wanted;
use crate::seal::Opener;
use crate::stream::KvStream;
use crate::table::WriteSpan;
use crate::transport::Bulk;
use crate::wire::Message;

/// Reads `conn`'s messages from `stream` (each opened by `opener`: checked against the
/// cluster secret's session key, when there is one) until it ends or breaks the protocol.
pub(crate) fn reader_loop(mut stream: KvStream, mut opener: Opener, conn: Arc<Conn>, shared: Arc<Shared>) {
    // Between messages a read waits up to the liveness bound (the peer pings every third of
    // it, so silence that long means it is frozen or gone); bulk data, once its header has
    // arrived, under the I/O timeout or that bound if shorter (a sender frozen mid-write is as
    // dead as one frozen between messages).
    let idle = |s: &KvStream, on: bool| {
        let _ = s.set_read_timeout(Some(if on { shared.cfg.liveness } else { shared.bulk_read_bound() }));
    };
    loop {
        idle(&stream, true);
        let msg = match opener.read(&mut stream) {
            Ok(m) => m,
            Err(e @ KvError::Unauthenticated(_)) => {
                bump(&shared.counters.auth_refused, 1);
                tracing::warn!(peer = %conn.peer.engine_id, error = %e, "KV connection closed: a frame failed authentication");
                break;
            }
            Err(e) => {
                tracing::info!(peer = %conn.peer.engine_id, error = %e, "KV connection closed");
                break;
            }
        };
        idle(&stream, false);
        if let Err(e) = handle_message(&mut stream, &conn, &shared, msg) {
            tracing::warn!(peer = %conn.peer.engine_id, error = %e, "KV connection failed");
            break;
        }
    }
    conn.close();
    decode::connection_lost(&shared, &conn);
}

fn handle_message(stream: &mut KvStream, conn: &Arc<Conn>, shared: &Arc<Shared>, msg: Message) -> Result<(), KvError> {
    match msg {
        // ---- prefill side ----
        Message::Register { transfer_id, epoch, block_ids, num_tokens, write_within_ms, skip_tokens, .. } => {
            let wanted = Wanted { blocks: block_ids, num_tokens, skip: skip_tokens };
            prefill::on_register(shared, conn, transfer_id, epoch, wanted, write_within_ms)?
        }
        Message::ReadBlocks { transfer_id, blocks, num_tokens, dst_blocks, write_within_ms, skip_tokens } => {
            let lease = (blocks, num_tokens);
            prefill::on_read_blocks(shared, conn, transfer_id, lease, dst_blocks, skip_tokens, write_within_ms)?
        }
        Message::Heartbeat { transfer_ids } => prefill::on_heartbeat(shared, transfer_ids),
        Message::WriteAck { transfer_id, error } => prefill::on_write_ack(shared, &transfer_id, error),
        Message::Abort { transfer_id } if shared.cfg.role == Role::Prefill => {
            prefill::on_abort(shared, conn, transfer_id)?
        }
        // ---- decode side ----
        Message::Abort { transfer_id } => {
            let mut t = shared.tables();
            shared.finish_incoming(&mut t, &transfer_id, |inc| ended(inc, "prefill aborted the transfer".into()));
        }
        Message::WriteBlocks {
            transfer_id,
            blocks,
            src_block_size,
            num_tokens,
            from_token,
            last,
            layers,
            rank,
            ranks,
            bytes,
            checksum,
            streams,
        } => {
            let layout = shared.memory.layout();
            let layers = layers.map_or(0..layout.num_layers, |[start, end]| start..end);
            let (rank, ranks) = (rank as usize, ranks as usize);
            let slice =
                KvSlice::of_layers(&layout, layers.clone()).of_rank(&layout, rank, ranks).map_err(KvError::Protocol)?;
            let bulk = Bulk { src_block_size, bytes, checksum, slice, rank, ranks, streams };
            let span =
                WriteSpan { from: from_token, num_tokens, last, layers, num_layers: layout.num_layers, rank, ranks };
            landing::on_write_blocks(stream, conn, shared, transfer_id, (span, &blocks), bulk)?
        }
        Message::BlockData {
            transfer_id,
            src_block_size,
            bytes,
            error,
            direct,
            checksum,
            copy_us,
            digest,
            grant_us,
            streams,
            rank,
            ranks,
        } => {
            let layout = shared.memory.layout();
            let (rank, ranks) = (rank as usize, ranks as usize);
            let slice = KvSlice::all(&layout).of_rank(&layout, rank, ranks).map_err(KvError::Protocol)?;
            let bulk = Bulk { src_block_size, bytes, checksum, slice, rank, ranks, streams };
            let direct = direct.then_some(DirectEnd { copy_us, digest, grant_us });
            landing::on_block_data(stream, conn, shared, transfer_id, bulk, error, direct)?
        }
        // ---- either side ----
        // Prefill: a pull release; decode: a push completion.
        Message::Done {
            transfer_id,
            rank,
            ranks,
            first_token,
            status,
            copy_us,
            produced_unix_us,
            backlog_us,
            digest,
        } => {
            if !prefill::on_release(shared, &transfer_id, &status) {
                let rank = (rank as usize, ranks as usize);
                let report = DoneReport { rank, first_token, status, copy_us, produced_unix_us, backlog_us, digest };
                landing::land(conn, shared, move |_, shared| {
                    landing::on_done(shared, &transfer_id, report);
                    Ok(())
                })?;
            }
        }
        Message::Failed { transfer_id, reason } => {
            let mut t = shared.tables();
            t.registrations.remove(&transfer_id);
            t.produced.remove(&transfer_id);
            shared.finish_incoming(&mut t, &transfer_id, |inc| ended(inc, reason));
        }
        other @ (Message::Hello { .. }
        | Message::Challenge { .. }
        | Message::Handshake { .. }
        | Message::HandshakeOk { .. }
        | Message::HandshakeRefused { .. }
        | Message::JoinStream { .. }) => {
            return Err(KvError::Protocol(format!("unexpected {other:?} after the handshake")));
        }
    }
    Ok(())
}
