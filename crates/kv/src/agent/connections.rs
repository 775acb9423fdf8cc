//! Opening side-channel connections, once per peer: the handshake from either end, the
//! transport it picks, and the table of open connections. Starting a connection's reader is
//! the caller's (the agent's threads).

use std::net::TcpStream;
use std::sync::Arc;

use super::conn::Conn;
use super::shared::{bump, Shared};
use crate::agent_info::AgentInfo;
use crate::channel::{accept_handshake, configure, connect, handshake, Picked};
use crate::error::KvError;
use crate::protocol::push::shared_run;
use crate::transport::Transport;

/// Accepting side: the handshake on a new `stream`, and the connection it made (its reader is
/// the caller's to run); `None` when it failed or was refused (logged, counted).
pub(crate) fn accept(shared: &Shared, stream: &mut TcpStream) -> Option<Arc<Conn>> {
    if let Err(e) = configure(stream, shared.cfg.timeouts) {
        tracing::warn!(error = %e, "KV connection setup failed");
        return None;
    }
    let mut transport = None;
    let picked = accept_handshake(stream, &shared.info, |peer| {
        let (t, picked) = shared.picker.pick(peer)?;
        transport = Some(t);
        Ok(picked)
    });
    match (picked, transport) {
        (Ok((peer, picked)), Some(transport)) => {
            tracing::info!(peer = %peer.engine_id, epoch = peer.epoch.0, transport = %picked.transport, note = picked.note.as_deref().unwrap_or(""), "KV peer connected");
            new_conn(shared, stream, peer, transport, picked.note).ok()
        }
        (Ok(_), None) => {
            tracing::warn!("KV handshake accepted without a transport");
            None
        }
        (Err(e), _) => {
            if matches!(e, KvError::Incompatible(_) | KvError::Refused(_)) {
                bump(&shared.counters.peers_refused, 1);
            }
            tracing::warn!(error = %e, "KV handshake refused");
            None
        }
    }
}

/// Connecting side: a new connection to `addr` (connect, handshake, the transport the
/// acceptor picked), recorded as the one to use for it. Its reader is the caller's to run on
/// the returned stream.
pub(crate) fn connect_to(shared: &Shared, addr: &str) -> Result<(Arc<Conn>, TcpStream), KvError> {
    let mut stream = connect(addr, shared.cfg.timeouts)?;
    let (peer, picked) = handshake(&mut stream, &shared.info)?;
    let transport = shared.picker.accept(&peer, &picked)?;
    let Picked { transport: name, note } = picked;
    match &note {
        Some(note) => tracing::info!(peer = %peer.engine_id, transport = %name, %note, "KV peer connected"),
        None => tracing::info!(peer = %peer.engine_id, transport = %name, "KV peer connected"),
    }
    let conn = new_conn(shared, &stream, peer, transport, note)?;
    shared.peers.lock().unwrap_or_else(|p| p.into_inner()).insert(addr.to_string(), conn.clone());
    Ok((conn, stream))
}

/// A connection to `peer` after its handshake, over the transport the acceptor picked.
fn new_conn(
    shared: &Shared,
    stream: &TcpStream,
    peer: AgentInfo,
    transport: Arc<dyn Transport>,
    note: Option<String>,
) -> Result<Arc<Conn>, KvError> {
    let c = &shared.counters;
    bump(
        match transport.name() {
            "local" => &c.links_local,
            "cuda-ipc" => &c.links_cuda_ipc,
            "nixl" => &c.links_nixl,
            _ => &c.links_tcp,
        },
        1,
    );
    let conn = Arc::new(Conn::new(stream, peer, transport, note)?);
    let mut links = shared.links.lock().unwrap_or_else(|p| p.into_inner());
    links.retain(|l| l.upgrade().is_some_and(|c| c.is_alive()));
    links.push(Arc::downgrade(&conn));
    Ok(conn)
}

/// The open connection to `addr`, if there is one.
pub(crate) fn open_conn(shared: &Shared, addr: &str) -> Option<Arc<Conn>> {
    let peers = shared.peers.lock().unwrap_or_else(|p| p.into_inner());
    peers.get(addr).filter(|c| c.is_alive()).cloned()
}

/// Tokens per transferred run with the peer at `addr` (a whole number of blocks on both
/// sides: what a cached prefix skipped by a transfer must be a multiple of), if we are
/// connected to it now. A table lookup.
pub(crate) fn transfer_alignment(shared: &Shared, addr: &str) -> Option<usize> {
    let conn = open_conn(shared, addr)?;
    Some(shared_run(shared.block_size(), conn.peer.block_size))
}
