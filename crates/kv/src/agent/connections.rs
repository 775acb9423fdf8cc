//! Opening side-channel connections, once per peer: the handshake from either end, the
//! transport it picks, and the table of open connections. Starting a connection's reader is
//! the caller's (the agent's threads).

use std::net::TcpStream;

use crate::stream::KvStream;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use super::conn::{Conn, DataStreams};
use super::shared::{bump, Shared};
use crate::agent_info::AgentInfo;
use crate::channel::{answer_handshake, configure, connect, handshake, read_hello, Hello, Picked};
use crate::error::KvError;
use crate::protocol::push::shared_run;
use crate::seal::{Opener, Sealer, Session};
use crate::transport::Transport;
use crate::wire::{write_message, Message};

/// Accepting side: the first frame of a new `stream`: a peer's handshake, and the connection
/// it made with the reader of its frames (the caller's to run), or a further stream joining an
/// open connection (kept by it); `None` when there is no new connection to read (a stream
/// joined, or the handshake failed or was refused: logged, counted). Over TLS when this
/// engine has it: the TLS handshake comes first.
pub(crate) fn accept(shared: &Shared, sock: TcpStream) -> Option<(Arc<Conn>, Opener, KvStream)> {
    if let Err(e) = configure(&sock, shared.cfg.timeouts) {
        tracing::warn!(error = %e, "KV connection setup failed");
        return None;
    }
    let mut stream = match KvStream::accept(sock, shared.cfg.tls.as_ref()) {
        Ok(s) => s,
        Err(e) => {
            refused(shared, &e);
            return None;
        }
    };
    let stream = &mut stream;
    let opening = match read_hello(stream) {
        Ok(Hello::Open(opening)) => opening,
        Ok(Hello::Join { token, index, proof }) => {
            join(shared, token, index, proof.as_deref(), stream);
            return None;
        }
        Err(e) => {
            refused(shared, &e);
            return None;
        }
    };
    let mut transport = None;
    let mut data = None;
    let secret = shared.cfg.cluster_secret.as_ref();
    let picked = answer_handshake(stream, opening, &shared.info, secret, |peer, join_key| {
        let (t, mut picked) = shared.picker.pick(peer)?;
        let streams = pair_streams(shared, peer, &picked.transport);
        let cut = streams > 1 && shared.cfg.faults.cut_a_stream && !shared.cut_a_stream.swap(true, Ordering::SeqCst);
        let streams_of = DataStreams::expecting(streams - 1, shared.cfg.timeouts.connect, cut, join_key);
        if streams > 1 {
            // Registered before the reply goes, so no joining stream comes before it.
            let token = join_token();
            let mut joining = shared.joining.lock().unwrap_or_else(|p| p.into_inner());
            joining.retain(|_, d| d.strong_count() > 0);
            joining.insert(token, Arc::downgrade(&streams_of));
            picked.join_token = Some(token);
        }
        (transport, data) = (Some(t), Some(streams_of));
        Ok(picked)
    });
    match (picked, transport, data) {
        (Ok((peer, picked, session)), Some(transport), Some(data)) => {
            tracing::info!(peer = %peer.engine_id, epoch = peer.epoch.0, transport = %picked.transport, streams = data.count(), tls = shared.cfg.tls.is_some(), authenticated = session.authenticated(), note = picked.note.as_deref().unwrap_or(""), "KV peer connected");
            let Session { sealer, opener, .. } = session;
            let conn = new_conn(shared, stream, sealer, (peer, transport, picked.note), data).ok()?;
            let reader = stream.try_clone().ok()?;
            Some((conn, opener, reader))
        }
        (Ok(_), _, _) => {
            tracing::warn!("KV handshake accepted without a transport");
            None
        }
        (Err(e), _, _) => {
            refused(shared, &e);
            None
        }
    }
}

/// A handshake this engine refused or failed: counted by kind, logged.
fn refused(shared: &Shared, e: &KvError) {
    match e {
        KvError::Incompatible(_) | KvError::Refused(_) => bump(&shared.counters.peers_refused, 1),
        KvError::Unauthenticated(_) => bump(&shared.counters.auth_refused, 1),
        _ => {}
    }
    tracing::warn!(error = %e, "KV handshake refused");
}

/// A further stream of the connection whose join token is `token`, as its stream `index`, if
/// it proves it belongs to it.
fn join(shared: &Shared, token: u64, index: usize, proof: Option<&str>, stream: &KvStream) {
    let data = shared.joining.lock().unwrap_or_else(|p| p.into_inner()).get(&token).and_then(Weak::upgrade);
    let joined = match (data, stream.try_clone()) {
        (Some(data), _) if !data.join_key().allows(token, index, proof) => {
            bump(&shared.counters.auth_refused, 1);
            Err(KvError::Unauthenticated(format!("stream {index} did not prove it belongs to its connection")))
        }
        (Some(data), Ok(s)) => data.attach(index, s),
        (None, _) => Err(KvError::Protocol("a stream joined no open connection".into())),
        (_, Err(e)) => Err(e.into()),
    };
    match joined {
        Ok(()) => bump(&shared.counters.streams_joined, 1),
        Err(e) => {
            tracing::warn!(error = %e, "a KV stream could not join its connection");
            stream.shutdown();
        }
    }
}

/// A new connection to `addr`, over TLS when this engine has it (the TLS handshake done:
/// the peer's certificate names the host it was reached at, and chains to the CA).
fn open(shared: &Shared, addr: &str) -> Result<KvStream, KvError> {
    let sock = connect(addr, shared.cfg.timeouts)?;
    let host = addr.rsplit_once(':').map_or(addr, |(host, _)| host);
    KvStream::connect(sock, shared.cfg.tls.as_ref(), host).inspect_err(|e| {
        if matches!(e, KvError::Unauthenticated(_)) {
            bump(&shared.counters.auth_refused, 1);
        }
    })
}

/// How many streams a connection to `peer` over `transport` stripes its bytes over: the
/// smaller of the two ends' counts over tcp, else one.
fn pair_streams(shared: &Shared, peer: &AgentInfo, transport: &str) -> usize {
    match transport {
        "tcp" => shared.info.tcp_streams.min(peer.tcp_streams).max(1),
        _ => 1,
    }
}

/// A fresh join token: a random number (std's hasher keys are random per process and call).
fn join_token() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.finish()
}

/// Connecting side: a new connection to `addr` (connect, handshake, the transport the
/// acceptor picked, and its further streams when the pair stripes over several), recorded as
/// the one to use for it. Its reader is the caller's to run on the returned stream, with the
/// returned opener.
pub(crate) fn connect_to(shared: &Shared, addr: &str) -> Result<(Arc<Conn>, KvStream, Opener), KvError> {
    let t = shared.cfg.timeouts;
    let mut stream = open(shared, addr)?;
    let (peer, picked, session) = handshake(&mut stream, &shared.info, shared.cfg.cluster_secret.as_ref())
        .inspect_err(|e| {
            if matches!(e, KvError::Unauthenticated(_)) {
                bump(&shared.counters.auth_refused, 1);
            }
        })?;
    let transport = shared.picker.accept(&peer, &picked)?;
    let Picked { transport: name, note, join_token } = picked;
    let streams = match join_token {
        Some(_) => pair_streams(shared, &peer, &name),
        None => 1,
    };
    let cut = streams > 1 && shared.cfg.faults.cut_a_stream && !shared.cut_a_stream.swap(true, Ordering::SeqCst);
    let data = DataStreams::expecting(streams - 1, t.connect, cut, session.join_key());
    if let Some(token) = join_token {
        for index in 1..streams {
            let mut s = open(shared, addr)?;
            let proof = session.join_proof(token, index);
            write_message(&mut s, &Message::JoinStream { token, index, proof })?;
            data.attach(index, s)?;
            bump(&shared.counters.streams_joined, 1);
        }
    }
    tracing::info!(peer = %peer.engine_id, epoch = peer.epoch.0, transport = %name, streams, tls = shared.cfg.tls.is_some(), authenticated = session.authenticated(), note = note.as_deref().unwrap_or(""), "KV peer connected");
    let Session { sealer, opener, .. } = session;
    let conn = new_conn(shared, &stream, sealer, (peer, transport, note), data)?;
    shared.peers.lock().unwrap_or_else(|p| p.into_inner()).insert(addr.to_string(), conn.clone());
    Ok((conn, stream, opener))
}

/// A connection to `peer` after its handshake, over the transport the acceptor picked.
fn new_conn(
    shared: &Shared,
    stream: &KvStream,
    sealer: Sealer,
    (peer, transport, note): (AgentInfo, Arc<dyn Transport>, Option<String>),
    data: Arc<DataStreams>,
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
    let conn = Arc::new(Conn::new(stream, sealer, peer, transport, note, data)?);
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
