//! The connector's background threads and the transfer state they share.
//!
//! Threads: one control thread (engine commands, deadlines, heartbeats), one accept thread,
//! and one reader thread per side-channel connection. All transfer state lives in [`Tables`]
//! behind one mutex; it is never held across socket I/O. Bulk sends take the connection's
//! writer lock, so frames on one connection never interleave.
//!
//! The byte moving is the connection's [`transport`], chosen at handshake; the protocol of
//! each mode is in [`push`] and [`pull`]; the entries and their deadlines in [`table`].

mod pull;
mod push;
mod table;
mod transport;

pub(crate) use push::produced;

use std::collections::HashMap;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tandem_compute::KvRegion;
use tandem_core::{Epoch, RemoteKv, RequestId, TransferId};

use self::table::{Incoming, Landing, Tables};
use self::transport::Transport;
use crate::tcp::{accept_handshake, configure, connect, handshake};
use crate::wire::{read_message, write_message, Message};
use crate::{
    AgentInfo, ConnectorConfig, ConnectorEvent, ConnectorStats, EventSink, KvError, TransferTimeline, TransportOffer,
};

pub(crate) enum Command {
    Expect { request_id: RequestId, source: RemoteKv, blocks: Vec<u32>, num_tokens: usize },
    Abort { request_id: RequestId },
    Abandon { transfer_id: TransferId, reason: String },
}

/// One side-channel connection (either direction), with the transport both ends agreed on.
pub(crate) struct Conn {
    writer: Mutex<TcpStream>,
    peer: AgentInfo,
    alive: AtomicBool,
    transport: Arc<dyn Transport>,
}

impl Conn {
    fn send(&self, msg: &Message) -> Result<(), KvError> {
        write_message(&mut *self.writer(), msg)
    }

    /// The connection's writer: frames on one connection never interleave.
    fn writer(&self) -> MutexGuard<'_, TcpStream> {
        self.writer.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[derive(Default)]
struct Counters {
    transfers_ok: AtomicU64,
    transfers_failed: AtomicU64,
    bytes_sent: AtomicU64,
    bytes_received: AtomicU64,
    regions: AtomicU64,
    expired: AtomicU64,
    unknown_ids: AtomicU64,
    duplicate_ids: AtomicU64,
    peers_refused: AtomicU64,
}

pub(crate) struct Shared {
    info: AgentInfo,
    cfg: ConnectorConfig,
    region: Arc<KvRegion>,
    tables: Mutex<Tables>,
    peers: Mutex<HashMap<String, Arc<Conn>>>,
    events: EventSink,
    counters: Counters,
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

impl Shared {
    fn tables(&self) -> MutexGuard<'_, Tables> {
        // Table updates are single inserts/removals; a panicking holder cannot leave them
        // half-done, so a poisoned lock is still consistent.
        self.tables.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn emit(&self, ev: ConnectorEvent) {
        match &ev {
            ConnectorEvent::Ready { .. } => bump(&self.counters.transfers_ok, 1),
            ConnectorEvent::Failed { request_id, reason } => {
                tracing::warn!(request_id = %request_id, %reason, "KV transfer failed");
                bump(&self.counters.transfers_failed, 1)
            }
            ConnectorEvent::Refused { request_id, reason } => {
                tracing::warn!(request_id = %request_id, %reason, "prefill engine refused: cannot pair");
                bump(&self.counters.transfers_failed, 1)
            }
            ConnectorEvent::Released { .. } => {}
        }
        (self.events)(ev);
    }

    pub(crate) fn stats(&self) -> ConnectorStats {
        let c = &self.counters;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ConnectorStats {
            transfers_ok: g(&c.transfers_ok),
            transfers_failed: g(&c.transfers_failed),
            bytes_sent: g(&c.bytes_sent),
            bytes_received: g(&c.bytes_received),
            regions: g(&c.regions),
            expired: g(&c.expired),
            unknown_ids: g(&c.unknown_ids),
            duplicate_ids: g(&c.duplicate_ids),
            peers_refused: g(&c.peers_refused),
        }
    }

    /// Removes a decode-side entry and reports its end.
    fn finish_incoming(&self, t: &mut Tables, tid: &TransferId, ev: impl FnOnce(Incoming) -> ConnectorEvent) {
        if let Some(inc) = t.incoming.remove(tid) {
            t.by_request.remove(&inc.request_id);
            self.emit(ev(inc));
        }
    }
}

pub(crate) type Started = (mpsc::Sender<Command>, AgentInfo, Arc<Shared>);

pub(crate) fn start(cfg: ConnectorConfig, region: Arc<KvRegion>, events: EventSink) -> Result<Started, KvError> {
    let listener = TcpListener::bind(&cfg.listen)
        .map_err(|e| KvError::Unreachable { addr: cfg.listen.clone(), reason: format!("cannot listen: {e}") })?;
    let port = listener.local_addr()?.port();
    let l = *region.layout();
    let epoch = Epoch(SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0));
    let mut transports = vec![TransportOffer::Tcp { addr: format!("{}:{port}", cfg.advertise_host) }];
    if cfg.local_transport {
        transports
            .push(TransportOffer::Local { process: std::process::id(), key: format!("{}@{}", cfg.engine_id, epoch.0) });
    }
    let info = AgentInfo::for_layout(
        cfg.engine_id.clone(),
        epoch,
        cfg.role,
        cfg.mode,
        cfg.model_fingerprint.clone(),
        &l,
        region.dtype(),
        transports,
    );
    let (cmd_tx, cmd_rx) = mpsc::channel();
    let shared = Arc::new(Shared {
        info: info.clone(),
        cfg,
        region,
        tables: Mutex::new(Tables::default()),
        peers: Mutex::new(HashMap::new()),
        events,
        counters: Counters::default(),
    });
    if let Some(TransportOffer::Local { key, .. }) =
        info.transports.iter().find(|t| matches!(t, TransportOffer::Local { .. }))
    {
        transport::register_local(key, &shared);
    }
    let s = shared.clone();
    std::thread::Builder::new().name("tandem-kv-accept".into()).spawn(move || accept_loop(listener, s))?;
    let s = shared.clone();
    std::thread::Builder::new().name("tandem-kv-agent".into()).spawn(move || control_loop(cmd_rx, s))?;
    tracing::info!(engine_id = %info.engine_id, epoch = info.epoch.0, port, role = ?info.role, mode = ?info.kv_mode, "KV connector listening");
    Ok((cmd_tx, info, shared))
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else { continue };
        let s = shared.clone();
        let _ = std::thread::Builder::new().name("tandem-kv-conn".into()).spawn(move || {
            if let Err(e) = configure(&stream, s.cfg.timeouts) {
                tracing::warn!(error = %e, "KV connection setup failed");
                return;
            }
            match accept_handshake(&mut stream, &s.info) {
                Ok(peer) => {
                    tracing::info!(peer = %peer.engine_id, epoch = peer.epoch.0, "KV peer connected");
                    if let Ok(conn) = new_conn(&s, &stream, peer) {
                        reader_loop(stream, conn, s);
                    }
                }
                Err(e) => {
                    if matches!(e, KvError::Incompatible(_) | KvError::Refused(_)) {
                        bump(&s.counters.peers_refused, 1);
                    }
                    tracing::warn!(error = %e, "KV handshake refused")
                }
            }
        });
    }
}

/// A connection to `peer` after its handshake, over the transport both ends offer.
fn new_conn(shared: &Shared, stream: &TcpStream, peer: AgentInfo) -> Result<Arc<Conn>, KvError> {
    let transport = transport::choose(shared, &peer);
    tracing::debug!(peer = %peer.engine_id, transport = transport.name(), "KV transport chosen");
    Ok(Arc::new(Conn { writer: Mutex::new(stream.try_clone()?), peer, alive: AtomicBool::new(true), transport }))
}

/// The open connection to `addr`, or a new one (connect + handshake + reader thread).
fn peer_conn(shared: &Arc<Shared>, addr: &str) -> Result<Arc<Conn>, KvError> {
    if let Some(c) = shared.peers.lock().unwrap_or_else(|p| p.into_inner()).get(addr) {
        if c.alive.load(Ordering::SeqCst) {
            return Ok(c.clone());
        }
    }
    let mut stream = connect(addr, shared.cfg.timeouts)?;
    let peer = handshake(&mut stream, &shared.info)?;
    let conn = new_conn(shared, &stream, peer)?;
    shared.peers.lock().unwrap_or_else(|p| p.into_inner()).insert(addr.to_string(), conn.clone());
    let (s, c) = (shared.clone(), conn.clone());
    std::thread::Builder::new().name("tandem-kv-conn".into()).spawn(move || reader_loop(stream, c, s))?;
    Ok(conn)
}

fn control_loop(rx: mpsc::Receiver<Command>, shared: Arc<Shared>) {
    let tick = Duration::from_millis(50);
    let mut last_heartbeat = Instant::now();
    loop {
        match rx.recv_timeout(tick) {
            Ok(cmd) => handle_command(&shared, cmd),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        }
        expire(&shared);
        if last_heartbeat.elapsed() >= shared.cfg.lease / 3 {
            pull::heartbeat(&shared);
            last_heartbeat = Instant::now();
        }
    }
}

fn handle_command(shared: &Arc<Shared>, cmd: Command) {
    match cmd {
        Command::Expect { .. } if shared.cfg.faults.silent_agent => {}
        Command::Expect { request_id, source, blocks, num_tokens } => {
            expect(shared, request_id, source, blocks, num_tokens)
        }
        Command::Abort { request_id } => {
            let mut t = shared.tables();
            let Some(tid) = t.by_request.get(&request_id).cloned() else {
                // Never registered (or already over): nothing can write its blocks.
                drop(t);
                shared.emit(ConnectorEvent::Released { request_id });
                return;
            };
            let conn = t.incoming.get(&tid).and_then(|i| i.conn.clone());
            match t.incoming.get_mut(&tid) {
                // The writer releases when its write ends.
                Some(i) if i.writing() => i.landing = Landing::WritingAborted,
                _ => {
                    shared.finish_incoming(&mut t, &tid, |inc| ConnectorEvent::Released { request_id: inc.request_id })
                }
            }
            drop(t);
            if let Some(c) = conn {
                let _ = c.send(&Message::Abort { transfer_id: tid });
            }
        }
        Command::Abandon { transfer_id, reason } => {
            let reg = {
                let mut t = shared.tables();
                t.produced.remove(&transfer_id);
                t.registrations.remove(&transfer_id)
            };
            if let Some(reg) = reg {
                let _ = reg.conn.send(&Message::Failed { transfer_id, reason });
            }
        }
    }
}

/// Decode side: register (push) or read (pull).
fn expect(shared: &Arc<Shared>, request_id: RequestId, source: RemoteKv, blocks: Vec<u32>, num_tokens: usize) {
    let deadline = Instant::now() + shared.cfg.transfer_timeout;
    let (tid, peer_addr, lease, first_token) = match source {
        RemoteKv::PushFrom { transfer_id, peer, .. } => (transfer_id, peer, None, None),
        RemoteKv::PullFrom {
            transfer_id, peer, epoch, blocks: remote, num_tokens: remote_tokens, first_token, ..
        } => {
            let lease = pull::Lease { epoch, blocks: remote, num_tokens: remote_tokens };
            (transfer_id, peer, Some(lease), Some(first_token))
        }
        RemoteKv::Produce { .. } => {
            shared.emit(ConnectorEvent::Failed { request_id, reason: "a produce request cannot expect KV".into() });
            return;
        }
    };
    {
        let mut t = shared.tables();
        if t.incoming.contains_key(&tid) {
            bump(&shared.counters.duplicate_ids, 1);
            drop(t);
            shared
                .emit(ConnectorEvent::Failed { request_id, reason: format!("transfer id `{tid}` is already in use") });
            return;
        }
        t.by_request.insert(request_id.clone(), tid.clone());
        t.incoming.insert(
            tid.clone(),
            Incoming {
                request_id,
                conn: None,
                blocks: blocks.clone(),
                num_tokens,
                deadline,
                landing: Landing::Waiting,
                first_token,
                pull: lease.is_some(),
                started: Instant::now(),
                timeline: TransferTimeline::default(),
            },
        );
    }
    let fail = |reason: String| {
        let mut t = shared.tables();
        shared.finish_incoming(&mut t, &tid, |inc| ConnectorEvent::Failed { request_id: inc.request_id, reason });
    };
    let conn = match peer_conn(shared, &peer_addr) {
        Ok(c) => c,
        Err(e @ (KvError::Incompatible(_) | KvError::Refused(_))) => {
            bump(&shared.counters.peers_refused, 1);
            let reason = format!("prefill engine at {peer_addr} cannot pair with this engine: {e}");
            let mut t = shared.tables();
            shared.finish_incoming(&mut t, &tid, |inc| ConnectorEvent::Refused { request_id: inc.request_id, reason });
            return;
        }
        Err(e) => return fail(format!("prefill engine at {peer_addr}: {e}")),
    };
    {
        let mut t = shared.tables();
        match t.incoming.get_mut(&tid) {
            Some(inc) => inc.conn = Some(conn.clone()),
            None => return, // aborted meanwhile; already released
        }
    }
    let sent = match lease {
        None => push::register(shared, &conn, &tid, blocks, num_tokens),
        Some(lease) => match pull::read(&conn, &tid, lease, num_tokens) {
            Ok(sent) => sent,
            Err(reason) => return fail(reason),
        },
    };
    match sent {
        Err(e) => fail(format!("sending to prefill engine: {e}")),
        Ok(()) => {
            if let Some(inc) = shared.tables().incoming.get_mut(&tid) {
                inc.timeline.request_sent_us = inc.since();
            }
        }
    }
}

fn reader_loop(mut stream: TcpStream, conn: Arc<Conn>, shared: Arc<Shared>) {
    // Reads wait for the next message indefinitely (an idle connection is fine); bulk data is
    // read under the configured timeout once its header has arrived.
    let idle = |s: &TcpStream, on: bool| {
        let _ = s.set_read_timeout(if on { None } else { Some(shared.cfg.timeouts.io) });
    };
    loop {
        idle(&stream, true);
        let msg = match read_message(&mut stream) {
            Ok(m) => m,
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
    conn.alive.store(false, Ordering::SeqCst);
    // Everything waiting on this connection fails now rather than at its deadline.
    let mut t = shared.tables();
    let dead: Vec<TransferId> = t
        .incoming
        .iter()
        .filter(|(_, i)| i.conn.as_ref().is_some_and(|c| Arc::ptr_eq(c, &conn)) && !i.writing())
        .map(|(k, _)| k.clone())
        .collect();
    for tid in dead {
        shared.finish_incoming(&mut t, &tid, |inc| ConnectorEvent::Failed {
            request_id: inc.request_id,
            reason: format!("connection to `{}` lost", conn.peer.engine_id),
        });
    }
    t.registrations.retain(|_, r| !Arc::ptr_eq(&r.conn, &conn));
}

fn handle_message(stream: &mut TcpStream, conn: &Arc<Conn>, shared: &Arc<Shared>, msg: Message) -> Result<(), KvError> {
    match msg {
        // ---- prefill side ----
        Message::Register { transfer_id, epoch, block_ids, num_tokens, .. } => {
            push::on_register(shared, conn, transfer_id, epoch, block_ids, num_tokens)?
        }
        Message::ReadBlocks { transfer_id, blocks, num_tokens } => {
            pull::on_read_blocks(shared, conn, transfer_id, blocks, num_tokens)?
        }
        Message::Heartbeat { transfer_ids } => pull::on_heartbeat(shared, transfer_ids),
        Message::Abort { transfer_id } => {
            let mut t = shared.tables();
            t.registrations.remove(&transfer_id);
            if t.produced.remove(&transfer_id).is_none() {
                // Decode-side abort from prefill: fail the waiting request.
                shared.finish_incoming(&mut t, &transfer_id, |inc| ConnectorEvent::Failed {
                    request_id: inc.request_id,
                    reason: "prefill aborted the transfer".into(),
                });
            }
        }
        // ---- decode side ----
        Message::WriteBlocks { transfer_id, blocks, src_block_size, num_tokens, bytes } => {
            push::on_write_blocks(stream, conn, shared, transfer_id, &blocks, src_block_size, num_tokens, bytes)?
        }
        Message::BlockData { transfer_id, src_block_size, bytes, error, local } => {
            pull::on_block_data(stream, conn, shared, transfer_id, src_block_size, bytes, error, local)?
        }
        // Prefill: a pull release; decode: a push completion.
        Message::Done { transfer_id, first_token, status, .. } => {
            if !pull::on_release(shared, &transfer_id) {
                push::on_done(shared, &transfer_id, first_token, status);
            }
        }
        Message::Failed { transfer_id, reason } => {
            let mut t = shared.tables();
            t.registrations.remove(&transfer_id);
            t.produced.remove(&transfer_id);
            shared.finish_incoming(&mut t, &transfer_id, |inc| ConnectorEvent::Failed {
                request_id: inc.request_id,
                reason,
            });
        }
        Message::WriteAck { transfer_id, error } => {
            if let Some(e) = error {
                tracing::warn!(%transfer_id, error = %e, "decode refused a push write");
            }
        }
        other @ (Message::Handshake { .. } | Message::HandshakeOk { .. } | Message::HandshakeRefused { .. }) => {
            return Err(KvError::Protocol(format!("unexpected {other:?} after the handshake")));
        }
    }
    Ok(())
}

/// Reclaims everything past its deadline (all of it: one live entry never hides expired ones).
fn expire(shared: &Arc<Shared>) {
    let mut to_notify = Vec::new();
    {
        let mut t = shared.tables();
        let (reclaimed, late) = t.expire(Instant::now());
        bump(&shared.counters.expired, reclaimed as u64);
        for tid in late {
            if let Some(c) = t.incoming.get(&tid).and_then(|i| i.conn.clone()) {
                to_notify.push((c, tid.clone()));
            }
            shared.finish_incoming(&mut t, &tid, |inc| ConnectorEvent::Failed {
                request_id: inc.request_id,
                reason: "timed out waiting for the KV".into(),
            });
        }
    }
    for (conn, tid) in to_notify {
        let _ = conn.send(&Message::Abort { transfer_id: tid });
    }
}
