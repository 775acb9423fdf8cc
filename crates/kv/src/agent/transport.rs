//! How a transfer's bytes move once the table says where from and where to. Each connection
//! gets its transport at handshake, by what both ends offer: `local` (a direct copy between
//! two engines of this process) when both offer it, else `tcp` (the bytes on the side channel,
//! straight between socket and KV memory).

use std::collections::HashMap;
use std::io::Read;
use std::net::TcpStream;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use tandem_compute::KvRegion;
use tandem_core::TransferId;

use super::table::NoWrite;
use super::{bump, Conn, Shared};
use crate::blocks::{coalesce, copy_tokens, wire_bytes};
use crate::tcp::{recv_blocks, send_blocks};
use crate::wire::{write_message, DoneStatus, Message};
use crate::{AgentInfo, ConnectorEvent, KvError, TransportOffer};

/// Moves a transfer's KV from this engine's blocks to a peer's.
pub(super) trait Transport: Send + Sync {
    /// The offer's name, for logs.
    fn name(&self) -> &'static str;

    /// Push: writes `num_tokens` of KV from our blocks `src` into the peer's registered blocks
    /// `dst` of transfer `tid`, then sends `Done` (with prefill's first token) on `conn`.
    #[allow(clippy::too_many_arguments)]
    fn push(
        &self,
        shared: &Shared,
        conn: &Conn,
        tid: &TransferId,
        src: &[u32],
        dst: &[u32],
        num_tokens: usize,
        first_token: u32,
    ) -> Result<(), KvError>;

    /// Pull: answers the peer's read of our blocks `src` (held under a lease) with `BlockData`
    /// and the bytes.
    fn answer_read(
        &self,
        shared: &Shared,
        conn: &Conn,
        tid: &TransferId,
        src: &[u32],
        num_tokens: usize,
    ) -> Result<(), KvError>;
}

/// The transport for a connection to `peer`: local when both ends offer it and the peer's
/// connector lives in this process, else tcp.
pub(super) fn choose(ours: &Shared, peer: &AgentInfo) -> Arc<dyn Transport> {
    let local = ours.cfg.local_transport.then(|| {
        peer.transports.iter().find_map(|t| match t {
            TransportOffer::Local { process, key } if *process == std::process::id() => registry().get(key).cloned(),
            _ => None,
        })
    });
    match local.flatten() {
        Some(peer) => Arc::new(Local { peer }),
        None => Arc::new(Tcp),
    }
}

/// Connectors of this process that offer the local transport, by registry key.
static LOCAL_AGENTS: std::sync::OnceLock<Mutex<HashMap<String, Weak<Shared>>>> = std::sync::OnceLock::new();

fn registry() -> MutexGuard<'static, HashMap<String, Weak<Shared>>> {
    LOCAL_AGENTS.get_or_init(|| Mutex::new(HashMap::new())).lock().unwrap_or_else(|p| p.into_inner())
}

/// Makes `shared` findable by engines of this process under `key` (its local offer).
pub(super) fn register_local(key: &str, shared: &Arc<Shared>) {
    registry().insert(key.to_string(), Arc::downgrade(shared));
}

/// The bytes on the side channel.
struct Tcp;

impl Transport for Tcp {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn push(
        &self,
        shared: &Shared,
        conn: &Conn,
        tid: &TransferId,
        src: &[u32],
        dst: &[u32],
        num_tokens: usize,
        first_token: u32,
    ) -> Result<(), KvError> {
        let region = &shared.region;
        let bytes = wire_bytes(region.layout(), region.dtype(), num_tokens);
        let mut w = conn.writer();
        let header = Message::WriteBlocks {
            transfer_id: tid.clone(),
            blocks: dst.to_vec(),
            src_block_size: region.layout().block_size,
            num_tokens,
            bytes,
        };
        write_message(&mut *w, &header)?;
        // Safety: the connector owns the source blocks until the push thread drops them; the
        // engine does not schedule a finished request's blocks.
        unsafe { send_blocks(&mut *w, region, src, num_tokens)? };
        if !shared.cfg.faults.drop_done {
            let done = Message::Done {
                transfer_id: tid.clone(),
                rank: 0,
                first_token: Some(first_token),
                status: DoneStatus::Ok,
            };
            write_message(&mut *w, &done)?;
        }
        Ok(())
    }

    fn answer_read(
        &self,
        shared: &Shared,
        conn: &Conn,
        tid: &TransferId,
        src: &[u32],
        num_tokens: usize,
    ) -> Result<(), KvError> {
        let region = &shared.region;
        let mut w = conn.writer();
        let header = Message::BlockData {
            transfer_id: tid.clone(),
            src_block_size: region.layout().block_size,
            bytes: wire_bytes(region.layout(), region.dtype(), num_tokens),
            error: None,
            local: false,
        };
        write_message(&mut *w, &header)?;
        // Safety: the lease holds these blocks and its `reading` flag keeps it from expiring
        // until this send is over.
        unsafe { send_blocks(&mut *w, region, src, num_tokens)? };
        Ok(())
    }
}

/// A direct copy into the memory of another engine of this process; the side channel carries
/// only the notifications.
struct Local {
    peer: Weak<Shared>,
}

impl Local {
    fn copy(&self, shared: &Shared, tid: &TransferId, src: &[u32], num_tokens: usize) -> Result<(), String> {
        let peer = self.peer.upgrade().ok_or("the peer engine is gone")?;
        receive_local(&peer, tid, &shared.region, src, num_tokens)
    }
}

impl Transport for Local {
    fn name(&self) -> &'static str {
        "local"
    }

    fn push(
        &self,
        shared: &Shared,
        conn: &Conn,
        tid: &TransferId,
        src: &[u32],
        _dst: &[u32],
        num_tokens: usize,
        first_token: u32,
    ) -> Result<(), KvError> {
        let status = match self.copy(shared, tid, src, num_tokens) {
            Ok(()) => DoneStatus::Ok,
            Err(e) => DoneStatus::Failed(e),
        };
        if !shared.cfg.faults.drop_done {
            conn.send(&Message::Done { transfer_id: tid.clone(), rank: 0, first_token: Some(first_token), status })?;
        }
        Ok(())
    }

    fn answer_read(
        &self,
        shared: &Shared,
        conn: &Conn,
        tid: &TransferId,
        src: &[u32],
        num_tokens: usize,
    ) -> Result<(), KvError> {
        // The copy is done before the answer: no bytes follow it.
        let error = self.copy(shared, tid, src, num_tokens).err();
        conn.send(&Message::BlockData {
            transfer_id: tid.clone(),
            src_block_size: shared.region.layout().block_size,
            bytes: 0,
            error,
            local: true,
        })
    }
}

/// Local transport, receiving side: copies transfer `tid`'s KV from another engine's memory
/// straight into `dst`'s registered blocks, with the same checks and ownership rules as a TCP
/// receive.
fn receive_local(
    dst: &Shared,
    tid: &TransferId,
    src: &KvRegion,
    src_blocks: &[u32],
    num_tokens: usize,
) -> Result<(), String> {
    let blocks = match dst.tables().begin_write(tid, num_tokens, None) {
        Ok(blocks) => blocks,
        Err(why) => {
            if matches!(why, NoWrite::Unknown) {
                bump(&dst.counters.unknown_ids, 1);
            }
            return Err(format!("transfer `{tid}` is unknown, aborted or does not match"));
        }
    };
    let needed = dst.region.layout().blocks_for(num_tokens);
    let ok = src_blocks.len() >= src.layout().blocks_for(num_tokens) && blocks.len() >= needed;
    if ok {
        // Safety: the sender holds its source blocks for this call; the destination blocks are
        // registered to this transfer and the table's `Writing` keeps an abort from freeing them.
        unsafe { copy_tokens(src, src_blocks, &dst.region, &blocks, num_tokens) };
    }
    let bytes = wire_bytes(src.layout(), src.dtype(), num_tokens);
    let regions = coalesce(&blocks[..needed.min(blocks.len())]).len() as u32;
    let mut t = dst.tables();
    if t.end_write(tid, ok, bytes, regions) {
        dst.finish_incoming(&mut t, tid, |inc| ConnectorEvent::Released { request_id: inc.request_id });
    }
    if ok {
        bump(&dst.counters.bytes_received, bytes);
        Ok(())
    } else {
        Err("block lists do not cover the tokens".into())
    }
}

/// TCP, receiving side: reads `bytes` of KV for `tid` from `stream` into its registered blocks
/// (exactly `dst` when the sender names them), or drains them if the transfer is unknown,
/// aborted or does not match. The inner result says whether the data landed; the outer one is
/// the connection's.
pub(super) fn receive_tcp(
    stream: &mut TcpStream,
    shared: &Shared,
    tid: &TransferId,
    dst: Option<&[u32]>,
    src_block_size: usize,
    num_tokens: usize,
    bytes: u64,
) -> Result<Result<(), String>, KvError> {
    let begun = shared.tables().begin_write(tid, num_tokens, dst);
    let blocks = match begun {
        Ok(blocks) => blocks,
        Err(why) => {
            if matches!(why, NoWrite::Unknown) {
                bump(&shared.counters.unknown_ids, 1);
            }
            drain(stream, bytes)?;
            return Ok(Err(format!("transfer `{tid}` is unknown, aborted or does not match")));
        }
    };
    // Safety: these blocks are registered to this transfer; the engine keeps them out of the
    // schedule until the connector reports, and an abort waits for the write to end.
    let result = unsafe { recv_blocks(stream, bytes, src_block_size, &shared.region, &blocks, num_tokens) };
    let regions = coalesce(&blocks[..shared.region.layout().blocks_for(num_tokens).min(blocks.len())]).len() as u32;
    let mut t = shared.tables();
    if t.end_write(tid, result.is_ok(), bytes, regions) {
        shared.finish_incoming(&mut t, tid, |inc| ConnectorEvent::Released { request_id: inc.request_id });
    }
    match result {
        Ok(()) => {
            bump(&shared.counters.bytes_received, bytes);
            Ok(Ok(()))
        }
        Err(e) => {
            let reason = format!("receiving KV: {e}");
            shared.finish_incoming(&mut t, tid, |inc| ConnectorEvent::Failed { request_id: inc.request_id, reason });
            Err(e)
        }
    }
}

/// Reads `bytes` from the stream and throws them away (data for a transfer we refuse).
fn drain(stream: &mut TcpStream, mut bytes: u64) -> Result<(), KvError> {
    let mut sink = vec![0u8; 1 << 20];
    while bytes > 0 {
        let n = bytes.min(sink.len() as u64) as usize;
        stream.read_exact(&mut sink[..n])?;
        bytes -= n as u64;
    }
    Ok(())
}
