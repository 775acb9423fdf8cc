//! The connector's background threads and the transfer state they share.
//!
//! Threads: one control thread (engine commands, deadlines, heartbeats), one accept thread,
//! and one reader thread per side-channel connection. All transfer state lives in [`Tables`]
//! behind one mutex; it is never held across socket I/O. Bulk sends take the connection's
//! writer lock, so frames on one connection never interleave.
//!
//! Push (decode registers, prefill writes; the prefill side drives the data): decode's control
//! thread connects to prefill and sends `Register`. Prefill pairs registration and produced KV
//! by transfer id in either order; whichever arrives second starts the write on a short-lived
//! thread: `WriteBlocks` plus the bytes, then `Done` with the first token, then prefill frees
//! its blocks. Decode's reader thread writes the bytes into the registered blocks, then
//! reports `Ready` on `Done` (TCP order puts `Done` after the data).
//!
//! Pull (prefill holds, decode reads; the decode side drives): prefill keeps produced KV under a
//! lease. Decode connects, checks prefill's epoch is the one that produced the KV, and sends
//! `ReadBlocks`; prefill answers `BlockData` plus the bytes; decode writes them into its blocks,
//! sends `Done` (release) and reports `Ready`. Decode heartbeats extend the lease while it
//! waits; an expired lease is gone, so a late read is refused, never served from reused blocks.

use std::collections::HashMap;
use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tandem_compute::KvRegion;
use tandem_core::{Epoch, RemoteKv, RequestId, TransferId};

use crate::blocks::{coalesce, copy_tokens, wire_bytes};
use crate::connector::{ConnectorConfig, ConnectorEvent, ConnectorStats, HeldBlocks, TransferTimeline};
use crate::tcp::{accept_handshake, configure, connect, handshake, recv_blocks, send_blocks};
use crate::wire::{read_message, write_message, DoneStatus, Message};
use crate::{AgentInfo, KvError, TransportOffer};

pub(crate) enum Command {
    Expect { request_id: RequestId, source: RemoteKv, blocks: Vec<u32>, num_tokens: usize },
    Abort { request_id: RequestId },
    Abandon { transfer_id: TransferId, reason: String },
}

/// One side-channel connection (either direction).
pub(crate) struct Conn {
    writer: Mutex<TcpStream>,
    peer: AgentInfo,
    alive: AtomicBool,
}

impl Conn {
    fn send(&self, msg: &Message) -> Result<(), KvError> {
        let mut w = self.writer.lock().unwrap_or_else(|p| p.into_inner());
        write_message(&mut *w, msg)
    }
}

/// Decode side: a request waiting for its KV.
struct Incoming {
    request_id: RequestId,
    conn: Option<Arc<Conn>>,
    blocks: Vec<u32>,
    num_tokens: usize,
    deadline: Instant,
    /// A bulk write into the blocks is in progress on a reader thread.
    writing: bool,
    landed: bool,
    aborted: bool,
    /// Pull: known from the params. Push: comes with `Done`.
    first_token: Option<u32>,
    pull: bool,
    /// When the engine asked, and the stages since (for the timeline).
    started: Instant,
    timeline: TransferTimeline,
}

impl Incoming {
    fn since(&self) -> u64 {
        self.started.elapsed().as_micros() as u64
    }
}

/// Prefill side, push: decode's destination, waiting for the KV to be produced.
struct Registration {
    conn: Arc<Conn>,
    blocks: Vec<u32>,
    num_tokens: usize,
    deadline: Instant,
}

/// Prefill side: finished KV waiting for its registration (push) or its reader (pull lease).
struct Produced {
    held: HeldBlocks,
    blocks: Vec<u32>,
    num_tokens: usize,
    first_token: u32,
    deadline: Instant,
    /// A pull read is sending these blocks now; the lease cannot expire under it.
    reading: bool,
}

#[derive(Default)]
struct Tables {
    incoming: HashMap<TransferId, Incoming>,
    by_request: HashMap<RequestId, TransferId>,
    registrations: HashMap<TransferId, Registration>,
    produced: HashMap<TransferId, Produced>,
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
    events: mpsc::Sender<ConnectorEvent>,
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
        let _ = self.events.send(ev);
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

/// Connectors of this process that offer the local transport, by registry key.
static LOCAL_AGENTS: std::sync::OnceLock<Mutex<HashMap<String, std::sync::Weak<Shared>>>> = std::sync::OnceLock::new();

fn local_registry() -> MutexGuard<'static, HashMap<String, std::sync::Weak<Shared>>> {
    LOCAL_AGENTS.get_or_init(|| Mutex::new(HashMap::new())).lock().unwrap_or_else(|p| p.into_inner())
}

/// The peer's connector, when both sides offer the local transport and live in this process.
fn local_peer(ours: &Shared, peer: &AgentInfo) -> Option<Arc<Shared>> {
    if !ours.cfg.local_transport {
        return None;
    }
    peer.transports.iter().find_map(|t| match t {
        TransportOffer::Local { process, key } if *process == std::process::id() => {
            local_registry().get(key)?.upgrade()
        }
        _ => None,
    })
}

impl Shared {
    /// Local transport, receiving side: copies transfer `tid`'s KV from another engine's memory
    /// straight into this engine's registered blocks, with the same checks and ownership flags
    /// as a TCP receive.
    fn receive_local(
        &self,
        tid: &TransferId,
        src: &KvRegion,
        src_blocks: &[u32],
        num_tokens: usize,
    ) -> Result<(), String> {
        let blocks = {
            let mut t = self.tables();
            match t.incoming.get_mut(tid) {
                Some(inc) if !inc.aborted && inc.num_tokens == num_tokens => {
                    inc.writing = true;
                    inc.timeline.data_start_us = inc.since();
                    inc.blocks.clone()
                }
                other => {
                    if other.is_none() {
                        bump(&self.counters.unknown_ids, 1);
                    }
                    return Err(format!("transfer `{tid}` is unknown, aborted or does not match"));
                }
            }
        };
        let needed = self.region.layout().blocks_for(num_tokens);
        let ok = src_blocks.len() >= src.layout().blocks_for(num_tokens) && blocks.len() >= needed;
        if ok {
            // Safety: the sender holds its source blocks for this call; the destination blocks
            // are registered to this transfer and `writing` keeps an abort from freeing them.
            unsafe { copy_tokens(src, src_blocks, &self.region, &blocks, num_tokens) };
        }
        let mut t = self.tables();
        let aborted = match t.incoming.get_mut(tid) {
            Some(inc) => {
                inc.writing = false;
                inc.landed = ok;
                inc.timeline.data_end_us = inc.since();
                inc.timeline.bytes = wire_bytes(src.layout(), src.dtype(), num_tokens);
                inc.timeline.regions = coalesce(&blocks[..needed.min(blocks.len())]).len() as u32;
                inc.aborted
            }
            None => false,
        };
        if aborted {
            self.finish_incoming(&mut t, tid, |inc| ConnectorEvent::Released { request_id: inc.request_id });
        }
        if ok {
            bump(&self.counters.bytes_received, wire_bytes(src.layout(), src.dtype(), num_tokens));
            Ok(())
        } else {
            Err("block lists do not cover the tokens".into())
        }
    }
}

pub(crate) type Started = (mpsc::Sender<Command>, mpsc::Receiver<ConnectorEvent>, AgentInfo, Arc<Shared>);

pub(crate) fn start(cfg: ConnectorConfig, region: Arc<KvRegion>) -> Result<Started, KvError> {
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
    let (ev_tx, ev_rx) = mpsc::channel();
    let shared = Arc::new(Shared {
        info: info.clone(),
        cfg,
        region,
        tables: Mutex::new(Tables::default()),
        peers: Mutex::new(HashMap::new()),
        events: ev_tx,
        counters: Counters::default(),
    });
    if let Some(TransportOffer::Local { key, .. }) =
        info.transports.iter().find(|t| matches!(t, TransportOffer::Local { .. }))
    {
        local_registry().insert(key.clone(), Arc::downgrade(&shared));
    }
    let s = shared.clone();
    std::thread::Builder::new().name("tandem-kv-accept".into()).spawn(move || accept_loop(listener, s))?;
    let s = shared.clone();
    std::thread::Builder::new().name("tandem-kv-agent".into()).spawn(move || control_loop(cmd_rx, s))?;
    tracing::info!(engine_id = %info.engine_id, epoch = info.epoch.0, port, role = ?info.role, mode = ?info.kv_mode, "KV connector listening");
    Ok((cmd_tx, ev_rx, info, shared))
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
                    if let Ok(conn) = new_conn(&stream, peer) {
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

fn new_conn(stream: &TcpStream, peer: AgentInfo) -> Result<Arc<Conn>, KvError> {
    Ok(Arc::new(Conn { writer: Mutex::new(stream.try_clone()?), peer, alive: AtomicBool::new(true) }))
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
    let conn = new_conn(&stream, peer)?;
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
            heartbeat(&shared);
            last_heartbeat = Instant::now();
        }
    }
}

/// Prefill: records produced KV (called on the engine thread: a table insert, no I/O) and, if
/// decode already registered, starts the push write on its own thread.
pub(crate) fn produced(
    shared: &Arc<Shared>,
    transfer_id: TransferId,
    held: HeldBlocks,
    blocks: Vec<u32>,
    num_tokens: usize,
    first_token: u32,
) {
    let deadline = Instant::now()
        + match shared.cfg.mode {
            crate::KvMode::Push => shared.cfg.transfer_timeout,
            crate::KvMode::Pull => shared.cfg.lease,
        };
    let produced = Produced { held, blocks, num_tokens, first_token, deadline, reading: false };
    let mut t = shared.tables();
    if t.produced.contains_key(&transfer_id) {
        bump(&shared.counters.duplicate_ids, 1);
        tracing::warn!(%transfer_id, "KV produced twice under one transfer id; dropping the second");
        return;
    }
    match t.registrations.remove(&transfer_id) {
        Some(reg) => {
            drop(t);
            spawn_push_write(shared, transfer_id, reg, produced);
        }
        None => {
            t.produced.insert(transfer_id, produced);
        }
    }
}

fn handle_command(shared: &Arc<Shared>, cmd: Command) {
    match cmd {
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
            let writing = t.incoming.get(&tid).is_some_and(|i| i.writing);
            if writing {
                // The reader thread releases when its write ends.
                if let Some(i) = t.incoming.get_mut(&tid) {
                    i.aborted = true;
                }
            } else {
                shared.finish_incoming(&mut t, &tid, |inc| ConnectorEvent::Released { request_id: inc.request_id });
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
    let (tid, peer_addr, pull) = match &source {
        RemoteKv::PushFrom { transfer_id, peer, .. } => (transfer_id.clone(), peer.clone(), None),
        RemoteKv::PullFrom {
            transfer_id, peer, epoch, blocks: remote, num_tokens: remote_tokens, first_token, ..
        } => (transfer_id.clone(), peer.clone(), Some((*epoch, remote.clone(), *remote_tokens, *first_token))),
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
                writing: false,
                landed: false,
                aborted: false,
                first_token: pull.as_ref().map(|p| p.3),
                pull: pull.is_some(),
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
    let sent = match pull {
        None => conn.send(&Message::Register {
            transfer_id: tid.clone(),
            decode_engine: shared.info.engine_id.clone(),
            epoch: shared.info.epoch,
            block_ids: blocks,
            num_tokens,
        }),
        Some((epoch, remote_blocks, remote_tokens, _)) => {
            if conn.peer.epoch != epoch {
                return fail(format!(
                    "prefill engine `{}` restarted (epoch {} now, the KV was produced under epoch {}): its blocks are gone",
                    conn.peer.engine_id, conn.peer.epoch.0, epoch.0
                ));
            }
            if remote_tokens != num_tokens {
                return fail(format!("prefill holds {remote_tokens} tokens of KV, this request needs {num_tokens}"));
            }
            conn.send(&Message::ReadBlocks { transfer_id: tid.clone(), blocks: remote_blocks, num_tokens })
        }
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

fn spawn_push_write(shared: &Arc<Shared>, tid: TransferId, reg: Registration, produced: Produced) {
    let s = shared.clone();
    let _ = std::thread::Builder::new().name("tandem-kv-push".into()).spawn(move || {
        let Produced { held, blocks, num_tokens, first_token, .. } = produced;
        if reg.num_tokens != num_tokens {
            let reason = format!("decode registered {} tokens, prefill produced {num_tokens}", reg.num_tokens);
            let _ = reg.conn.send(&Message::Failed { transfer_id: tid, reason });
            bump(&s.counters.transfers_failed, 1);
            return;
        }
        let bytes = wire_bytes(s.region.layout(), s.region.dtype(), num_tokens);
        let local = local_peer(&s, &reg.conn.peer);
        let result = (|| -> Result<(), KvError> {
            if let Some(peer) = &local {
                // Same process: copy straight into decode's blocks, then notify as usual.
                let status = match peer.receive_local(&tid, &s.region, &blocks, num_tokens) {
                    Ok(()) => DoneStatus::Ok,
                    Err(e) => DoneStatus::Failed(e),
                };
                if !s.cfg.faults.drop_done {
                    reg.conn.send(&Message::Done {
                        transfer_id: tid.clone(),
                        rank: 0,
                        first_token: Some(first_token),
                        status,
                    })?;
                }
                return Ok(());
            }
            let mut w = reg.conn.writer.lock().unwrap_or_else(|p| p.into_inner());
            write_message(
                &mut *w,
                &Message::WriteBlocks {
                    transfer_id: tid.clone(),
                    blocks: reg.blocks.clone(),
                    src_block_size: s.region.layout().block_size,
                    num_tokens,
                    bytes,
                },
            )?;
            // Safety: the connector owns these blocks (`held`) until this thread drops them; the
            // engine does not schedule a finished request's blocks.
            unsafe { send_blocks(&mut *w, &s.region, &blocks, num_tokens)? };
            if !s.cfg.faults.drop_done {
                write_message(
                    &mut *w,
                    &Message::Done {
                        transfer_id: tid.clone(),
                        rank: 0,
                        first_token: Some(first_token),
                        status: DoneStatus::Ok,
                    },
                )?;
            }
            Ok(())
        })();
        // The bytes have left our memory (or the write failed): the blocks can go back.
        drop(held);
        match result {
            Ok(()) => {
                bump(&s.counters.bytes_sent, bytes);
                bump(
                    &s.counters.regions,
                    coalesce(&blocks[..s.region.layout().blocks_for(num_tokens).min(blocks.len())]).len() as u64,
                );
                bump(&s.counters.transfers_ok, 1);
            }
            Err(e) => {
                tracing::warn!(transfer_id = %tid, error = %e, "push write failed");
                bump(&s.counters.transfers_failed, 1);
            }
        }
    });
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
        .filter(|(_, i)| i.conn.as_ref().is_some_and(|c| Arc::ptr_eq(c, &conn)) && !i.writing)
        .map(|(k, _)| k.clone())
        .collect();
    for tid in dead {
        let aborted = t.incoming.get(&tid).is_some_and(|i| i.aborted);
        shared.finish_incoming(&mut t, &tid, |inc| {
            let request_id = inc.request_id;
            if aborted {
                ConnectorEvent::Released { request_id }
            } else {
                ConnectorEvent::Failed { request_id, reason: format!("connection to `{}` lost", conn.peer.engine_id) }
            }
        });
    }
    t.registrations.retain(|_, r| !Arc::ptr_eq(&r.conn, &conn));
}

/// Receives bulk bytes for `tid` into its registered blocks, or drains them if the transfer is
/// unknown, aborted or does not match. Returns whether the data landed.
fn receive_into(
    stream: &mut TcpStream,
    shared: &Arc<Shared>,
    tid: &TransferId,
    dst: Option<&[u32]>,
    src_block_size: usize,
    num_tokens: usize,
    bytes: u64,
) -> Result<Result<(), String>, KvError> {
    let target = {
        let mut t = shared.tables();
        match t.incoming.get_mut(tid) {
            Some(inc) if !inc.aborted && inc.num_tokens == num_tokens && dst.is_none_or(|d| d == inc.blocks) => {
                inc.writing = true;
                inc.timeline.data_start_us = inc.since();
                Some(inc.blocks.clone())
            }
            Some(_) => None,
            None => {
                bump(&shared.counters.unknown_ids, 1);
                None
            }
        }
    };
    let Some(blocks) = target else {
        drain(stream, bytes)?;
        return Ok(Err(format!("transfer `{tid}` is unknown, aborted or does not match")));
    };
    // Safety: these blocks are registered to this transfer; the engine keeps them out of the
    // schedule until the connector reports, and an abort waits for `writing` to clear.
    let result = unsafe { recv_blocks(stream, bytes, src_block_size, &shared.region, &blocks, num_tokens) };
    let mut t = shared.tables();
    let aborted = match t.incoming.get_mut(tid) {
        Some(inc) => {
            inc.writing = false;
            inc.landed = result.is_ok();
            inc.timeline.data_end_us = inc.since();
            inc.timeline.bytes = bytes;
            inc.timeline.regions =
                coalesce(&blocks[..shared.region.layout().blocks_for(num_tokens).min(blocks.len())]).len() as u32;
            inc.aborted
        }
        None => false,
    };
    if aborted {
        shared.finish_incoming(&mut t, tid, |inc| ConnectorEvent::Released { request_id: inc.request_id });
    }
    match result {
        Ok(()) => {
            bump(&shared.counters.bytes_received, bytes);
            Ok(Ok(()))
        }
        Err(e) => {
            let reason = format!("receiving KV: {e}");
            shared.finish_incoming(&mut t, tid, |inc| ConnectorEvent::Failed {
                request_id: inc.request_id,
                reason: reason.clone(),
            });
            Err(e)
        }
    }
}

fn handle_message(stream: &mut TcpStream, conn: &Arc<Conn>, shared: &Arc<Shared>, msg: Message) -> Result<(), KvError> {
    match msg {
        // ---- prefill side ----
        Message::Register { transfer_id, epoch, block_ids, num_tokens, .. } => {
            if epoch != conn.peer.epoch {
                conn.send(&Message::Failed {
                    transfer_id,
                    reason: "registration epoch does not match the handshake".into(),
                })?;
                return Ok(());
            }
            let reg = Registration {
                conn: conn.clone(),
                blocks: block_ids,
                num_tokens,
                deadline: Instant::now() + shared.cfg.transfer_timeout,
            };
            let mut t = shared.tables();
            if t.registrations.contains_key(&transfer_id) {
                bump(&shared.counters.duplicate_ids, 1);
                drop(t);
                conn.send(&Message::Failed { transfer_id, reason: "duplicate registration".into() })?;
                return Ok(());
            }
            match t.produced.remove(&transfer_id) {
                Some(p) => {
                    drop(t);
                    spawn_push_write(shared, transfer_id, reg, p);
                }
                None => {
                    t.registrations.insert(transfer_id, reg);
                }
            }
        }
        Message::ReadBlocks { transfer_id, blocks, num_tokens } => {
            let ok = {
                let mut t = shared.tables();
                match t.produced.get_mut(&transfer_id) {
                    Some(p) if p.blocks.starts_with(&blocks) && p.num_tokens == num_tokens && !p.reading => {
                        p.reading = true;
                        Ok(p.blocks.clone())
                    }
                    Some(_) => Err("blocks or token count do not match the lease".to_string()),
                    None => {
                        bump(&shared.counters.unknown_ids, 1);
                        Err(format!("no KV held for transfer `{transfer_id}` (unknown, released or lease expired)"))
                    }
                }
            };
            let layout = *shared.region.layout();
            match ok {
                Ok(src) => {
                    let bytes = wire_bytes(&layout, shared.region.dtype(), num_tokens);
                    let local = local_peer(shared, &conn.peer);
                    let sent = (|| -> Result<(), KvError> {
                        if let Some(peer) = &local {
                            // Same process: copy straight into decode's blocks; no bytes follow.
                            let error = peer.receive_local(&transfer_id, &shared.region, &src, num_tokens).err();
                            return conn.send(&Message::BlockData {
                                transfer_id: transfer_id.clone(),
                                src_block_size: layout.block_size,
                                bytes: 0,
                                error,
                                local: true,
                            });
                        }
                        let mut w = conn.writer.lock().unwrap_or_else(|p| p.into_inner());
                        write_message(
                            &mut *w,
                            &Message::BlockData {
                                transfer_id: transfer_id.clone(),
                                src_block_size: layout.block_size,
                                bytes,
                                error: None,
                                local: false,
                            },
                        )?;
                        // Safety: the lease holds these blocks and `reading` keeps it from expiring
                        // until this send is over.
                        unsafe { send_blocks(&mut *w, &shared.region, &src, num_tokens)? };
                        Ok(())
                    })();
                    if let Some(p) = shared.tables().produced.get_mut(&transfer_id) {
                        p.reading = false;
                    }
                    sent?;
                    bump(&shared.counters.bytes_sent, bytes);
                    bump(
                        &shared.counters.regions,
                        coalesce(&src[..layout.blocks_for(num_tokens).min(src.len())]).len() as u64,
                    );
                }
                Err(error) => conn.send(&Message::BlockData {
                    transfer_id,
                    src_block_size: layout.block_size,
                    bytes: 0,
                    error: Some(error),
                    local: false,
                })?,
            }
        }
        Message::Heartbeat { transfer_ids } => {
            let until = Instant::now() + shared.cfg.lease;
            let mut t = shared.tables();
            for tid in transfer_ids {
                if let Some(p) = t.produced.get_mut(&tid) {
                    p.deadline = p.deadline.max(until);
                }
            }
        }
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
            let result = receive_into(stream, shared, &transfer_id, Some(&blocks), src_block_size, num_tokens, bytes)?;
            conn.send(&Message::WriteAck { transfer_id, error: result.err() })?;
        }
        Message::BlockData { transfer_id, src_block_size, bytes, error, local } => {
            if let Some(reason) = error {
                let mut t = shared.tables();
                shared.finish_incoming(&mut t, &transfer_id, |inc| ConnectorEvent::Failed {
                    request_id: inc.request_id,
                    reason,
                });
                return Ok(());
            }
            let num_tokens = shared.tables().incoming.get(&transfer_id).map(|i| i.num_tokens).unwrap_or(0);
            let landed = if local {
                // The holder already copied the blocks in (local transport).
                match shared.tables().incoming.get(&transfer_id) {
                    Some(inc) if inc.landed => Ok(()),
                    _ => Err("local copy did not land".to_string()),
                }
            } else {
                receive_into(stream, shared, &transfer_id, None, src_block_size, num_tokens, bytes)?
            };
            // Release prefill's blocks whatever happened here: we will not read them again.
            conn.send(&Message::Done {
                transfer_id: transfer_id.clone(),
                rank: 0,
                first_token: None,
                status: DoneStatus::Ok,
            })?;
            if landed.is_ok() {
                let mut t = shared.tables();
                let first = t.incoming.get(&transfer_id).and_then(|i| i.first_token);
                shared.finish_incoming(&mut t, &transfer_id, |inc| ConnectorEvent::Ready {
                    timeline: TransferTimeline { ready_us: inc.since(), ..inc.timeline },
                    request_id: inc.request_id,
                    first_token: first,
                });
            }
        }
        Message::Done { transfer_id, first_token, status, .. } => {
            let mut t = shared.tables();
            if let Some(p) = t.produced.remove(&transfer_id) {
                // Pull release from decode.
                drop(p);
                bump(&shared.counters.transfers_ok, 1);
                return Ok(());
            }
            match t.incoming.get(&transfer_id) {
                Some(inc) if inc.pull => {}
                Some(inc) => {
                    let landed = inc.landed;
                    match status {
                        DoneStatus::Ok if landed => {
                            shared.finish_incoming(&mut t, &transfer_id, |inc| ConnectorEvent::Ready {
                                timeline: TransferTimeline { ready_us: inc.since(), ..inc.timeline },
                                request_id: inc.request_id,
                                first_token,
                            })
                        }
                        DoneStatus::Ok => shared.finish_incoming(&mut t, &transfer_id, |inc| ConnectorEvent::Failed {
                            request_id: inc.request_id,
                            reason: "completion arrived without data".into(),
                        }),
                        DoneStatus::Failed(reason) => shared.finish_incoming(&mut t, &transfer_id, |inc| {
                            ConnectorEvent::Failed { request_id: inc.request_id, reason }
                        }),
                    }
                }
                None => bump(&shared.counters.unknown_ids, 1),
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
    let now = Instant::now();
    let mut to_notify = Vec::new();
    {
        let mut t = shared.tables();
        let before = t.produced.len() + t.registrations.len();
        t.produced.retain(|_, p| p.reading || p.deadline > now);
        t.registrations.retain(|_, r| r.deadline > now);
        bump(&shared.counters.expired, (before - t.produced.len() - t.registrations.len()) as u64);
        let late: Vec<TransferId> =
            t.incoming.iter().filter(|(_, i)| !i.writing && i.deadline <= now).map(|(k, _)| k.clone()).collect();
        for tid in late {
            if let Some(c) = t.incoming.get(&tid).and_then(|i| i.conn.clone()) {
                to_notify.push((c, tid.clone()));
            }
            let aborted = t.incoming.get(&tid).is_some_and(|i| i.aborted);
            shared.finish_incoming(&mut t, &tid, |inc| {
                let request_id = inc.request_id;
                if aborted {
                    ConnectorEvent::Released { request_id }
                } else {
                    ConnectorEvent::Failed { request_id, reason: "timed out waiting for the KV".into() }
                }
            });
        }
    }
    for (conn, tid) in to_notify {
        let _ = conn.send(&Message::Abort { transfer_id: tid });
    }
}

/// Pull: keeps prefill's leases alive for everything still being waited on.
fn heartbeat(shared: &Arc<Shared>) {
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
