//! The connector's background threads and the transfer state they share.
//!
//! Threads: one control thread (engine commands, deadlines, heartbeats), one accept thread,
//! one reader thread per side-channel connection, a short-lived thread per new outgoing
//! connection (connect and handshake, never on the control thread), one per push write, and
//! on decode one per transfer landing over a transport that waits on the network for it (a NIXL
//! notification or READ: [`land`]). All transfer state lives in [`Tables`]
//! behind one mutex; it is never held across socket I/O. Bulk sends take the connection's
//! writer lock, so frames on one connection never interleave.
//!
//! The byte moving is the connection's [`transport`], chosen at handshake; the protocol of
//! each mode is in [`push`] and [`pull`]; the entries and their deadlines in [`table`].

mod early;
mod nixl;
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

use tandem_compute::cuda::KvFences;
use tandem_core::{Epoch, RemoteKv, RequestId, TransferId};

use self::table::{Incoming, Landing, Tables};
use self::transport::Transport;
use crate::tcp::{accept_handshake, configure, connect, handshake};
use crate::wire::{read_message, write_message, Message};
use crate::{
    AgentInfo, ConnectorConfig, ConnectorEvent, ConnectorStats, EventSink, KvError, KvMemory, KvTransport,
    TransferTimeline, TransportOffer,
};

pub(crate) enum Command {
    Expect { request_id: RequestId, source: RemoteKv, blocks: Vec<u32>, num_tokens: usize, cached_tokens: usize },
    Abort { request_id: RequestId },
    Abandon { transfer_id: TransferId, reason: String },
    Computed { transfer_id: TransferId, blocks: Vec<u32>, num_tokens: usize, attempt: u32, fences: KvFences },
}

/// One side-channel connection (either direction), with the transport both ends agreed on.
pub(crate) struct Conn {
    writer: Mutex<TcpStream>,
    peer: AgentInfo,
    alive: AtomicBool,
    transport: Arc<dyn Transport>,
    /// Why a faster transport is not used, as the acceptor said.
    note: Option<String>,
}

impl Conn {
    fn send(&self, msg: &Message) -> Result<(), KvError> {
        write_message(&mut *self.writer(), msg)
    }

    /// Sends `msg` unless the writer is busy (a bulk send in progress: the peer hears from us
    /// anyway). For liveness heartbeats, which must not hold up the control thread.
    fn try_send(&self, msg: &Message) {
        if let Ok(mut w) = self.writer.try_lock() {
            let _ = write_message(&mut *w, msg);
        }
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
    checksum_failures: AtomicU64,
    links_tcp: AtomicU64,
    links_local: AtomicU64,
    links_cuda_ipc: AtomicU64,
    links_nixl: AtomicU64,
    parts_early: AtomicU64,
}

pub(crate) struct Shared {
    info: AgentInfo,
    cfg: ConnectorConfig,
    memory: KvMemory,
    tables: Mutex<Tables>,
    peers: Mutex<HashMap<String, Arc<Conn>>>,
    /// One connect at a time per address (decode side).
    connecting: Mutex<HashMap<String, Arc<Mutex<()>>>>,
    /// Every connection opened (either direction), for `/kv/info`.
    links: Mutex<Vec<std::sync::Weak<Conn>>>,
    events: EventSink,
    counters: Counters,
    /// This engine's NIXL agent (`--kv-transport nixl`).
    #[cfg_attr(not(feature = "nixl"), allow(dead_code))]
    nixl: nixl::Endpoint,
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
            ConnectorEvent::FailedInFlight { request_id, reason, writes_until } => {
                let held_ms = writes_until.saturating_duration_since(Instant::now()).as_millis() as u64;
                tracing::warn!(request_id = %request_id, %reason, held_ms, "KV transfer failed; a direct write may still land, its blocks are held");
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

    /// The open connections and their transports.
    pub(crate) fn links(&self) -> Vec<crate::KvLink> {
        let links = self.links.lock().unwrap_or_else(|p| p.into_inner());
        links
            .iter()
            .filter_map(std::sync::Weak::upgrade)
            .filter(|c| c.alive.load(Ordering::SeqCst))
            .map(|c| crate::KvLink {
                peer: c.peer.engine_id.0.clone(),
                transport: c.transport.name().into(),
                note: c.note.clone(),
            })
            .collect()
    }

    /// Push prefill: decode has registered blocks for `tid` (its KV is written as soon as it is
    /// produced, or is being written).
    pub(crate) fn is_registered(&self, tid: &TransferId) -> bool {
        let t = self.tables();
        t.registrations.contains_key(tid) || t.pushing.contains(tid)
    }

    /// Push prefill: blocks held by produced KV that no decode engine has registered for yet.
    pub(crate) fn unclaimed_blocks(&self) -> usize {
        if self.cfg.mode != crate::KvMode::Push {
            return 0;
        }
        self.tables().produced.values().map(|p| p.blocks.len()).sum()
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
            checksum_failures: g(&c.checksum_failures),
            links_tcp: g(&c.links_tcp),
            links_local: g(&c.links_local),
            links_cuda_ipc: g(&c.links_cuda_ipc),
            links_nixl: g(&c.links_nixl),
            parts_early: g(&c.parts_early),
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

pub(crate) fn start(cfg: ConnectorConfig, memory: KvMemory, events: EventSink) -> Result<Started, KvError> {
    let ipc_offer = match (cfg.transport, memory.device_cache()) {
        (KvTransport::Tcp | KvTransport::Nixl, _) => None,
        (KvTransport::CudaIpc, None) => {
            return Err(KvError::Unsupported(
                "--kv-transport cuda-ipc needs an engine whose KV cache is on a GPU (--device cuda:N)".into(),
            ))
        }
        (KvTransport::Auto, None) => None,
        (policy, Some(dev)) => match dev.export() {
            Ok(export) => Some(transport::cuda_ipc_offer(&export)),
            Err(e) if policy == KvTransport::CudaIpc => {
                return Err(KvError::Unsupported(format!("--kv-transport cuda-ipc: cannot export the KV cache: {e}")))
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot export the KV cache for cuda-ipc; KV moves over tcp");
                None
            }
        },
    };
    let listener = TcpListener::bind(&cfg.listen)
        .map_err(|e| KvError::Unreachable { addr: cfg.listen.clone(), reason: format!("cannot listen: {e}") })?;
    let port = listener.local_addr()?.port();
    let l = memory.layout();
    let epoch = Epoch(SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0));
    let mut transports = vec![TransportOffer::Tcp { addr: crate::tcp::host_port(&cfg.advertise_host, port) }];
    if cfg.local_transport {
        transports
            .push(TransportOffer::Local { process: std::process::id(), key: format!("{}@{}", cfg.engine_id, epoch.0) });
    }
    transports.extend(ipc_offer);
    let nixl = nixl::open(&cfg, &memory, epoch.0)?;
    transports.extend(nixl::offer(&nixl));
    let info = AgentInfo {
        kv_verify: cfg.verify,
        ..AgentInfo::for_layout(
            cfg.engine_id.clone(),
            epoch,
            cfg.role,
            cfg.mode,
            cfg.model_fingerprint.clone(),
            &l,
            memory.dtype(),
            transports,
        )
    };
    let (cmd_tx, cmd_rx) = mpsc::channel();
    let shared = Arc::new(Shared {
        info: info.clone(),
        cfg,
        memory,
        tables: Mutex::new(Tables::default()),
        peers: Mutex::new(HashMap::new()),
        connecting: Mutex::new(HashMap::new()),
        links: Mutex::new(Vec::new()),
        events,
        counters: Counters::default(),
        nixl,
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
    let offers: Vec<&str> = info.transports.iter().map(TransportOffer::name).collect();
    tracing::info!(engine_id = %info.engine_id, epoch = info.epoch.0, port, role = ?info.role, mode = ?info.kv_mode, transports = ?offers, "KV connector listening");
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
            let mut transport = None;
            let picked = accept_handshake(&mut stream, &s.info, |peer| {
                let (t, picked) = transport::pick(&s, peer)?;
                transport = Some(t);
                Ok(picked)
            });
            match (picked, transport) {
                (Ok((peer, picked)), Some(transport)) => {
                    tracing::info!(peer = %peer.engine_id, epoch = peer.epoch.0, transport = %picked.transport, note = picked.note.as_deref().unwrap_or(""), "KV peer connected");
                    if let Ok(conn) = new_conn(&s, &stream, peer, transport, picked.note) {
                        reader_loop(stream, conn, s);
                    }
                }
                (Ok(_), None) => tracing::warn!("KV handshake accepted without a transport"),
                (Err(e), _) => {
                    if matches!(e, KvError::Incompatible(_) | KvError::Refused(_)) {
                        bump(&s.counters.peers_refused, 1);
                    }
                    tracing::warn!(error = %e, "KV handshake refused")
                }
            }
        });
    }
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
    let conn =
        Arc::new(Conn { writer: Mutex::new(stream.try_clone()?), peer, alive: AtomicBool::new(true), transport, note });
    let mut links = shared.links.lock().unwrap_or_else(|p| p.into_inner());
    links.retain(|l| l.upgrade().is_some_and(|c| c.alive.load(Ordering::SeqCst)));
    links.push(Arc::downgrade(&conn));
    Ok(conn)
}

/// The open connection to `addr`, or a new one (connect + handshake + reader thread).
fn peer_conn(shared: &Arc<Shared>, addr: &str) -> Result<Arc<Conn>, KvError> {
    if let Some(c) = shared.peers.lock().unwrap_or_else(|p| p.into_inner()).get(addr) {
        if c.alive.load(Ordering::SeqCst) {
            return Ok(c.clone());
        }
    }
    let mut stream = connect(addr, shared.cfg.timeouts)?;
    let (peer, picked) = handshake(&mut stream, &shared.info)?;
    let transport = transport::accept_pick(shared, &peer, &picked)?;
    match &picked.note {
        Some(note) => tracing::info!(peer = %peer.engine_id, transport = %picked.transport, %note, "KV peer connected"),
        None => tracing::info!(peer = %peer.engine_id, transport = %picked.transport, "KV peer connected"),
    }
    let conn = new_conn(shared, &stream, peer, transport, picked.note)?;
    shared.peers.lock().unwrap_or_else(|p| p.into_inner()).insert(addr.to_string(), conn.clone());
    let (s, c) = (shared.clone(), conn.clone());
    std::thread::Builder::new().name("tandem-kv-conn".into()).spawn(move || reader_loop(stream, c, s))?;
    Ok(conn)
}

fn control_loop(rx: mpsc::Receiver<Command>, shared: Arc<Shared>) {
    let tick = Duration::from_millis(50);
    let (mut last_heartbeat, mut last_ping) = (Instant::now(), Instant::now());
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
        if last_ping.elapsed() >= shared.cfg.liveness / 3 {
            ping(&shared);
            nixl::relay_ucx_log(&shared.nixl);
            last_ping = Instant::now();
        }
    }
}

/// A heartbeat naming no transfer on every open connection: the peer's reader hears from us
/// at least every third of the liveness bound, even when no transfer runs.
fn ping(shared: &Shared) {
    let conns: Vec<Arc<Conn>> = {
        let links = shared.links.lock().unwrap_or_else(|p| p.into_inner());
        links.iter().filter_map(std::sync::Weak::upgrade).filter(|c| c.alive.load(Ordering::SeqCst)).collect()
    };
    for c in conns {
        c.try_send(&Message::Heartbeat { transfer_ids: Vec::new() });
    }
}

fn handle_command(shared: &Arc<Shared>, cmd: Command) {
    match cmd {
        Command::Expect { .. } if shared.cfg.faults.silent_agent => {}
        Command::Expect { request_id, source, blocks, num_tokens, cached_tokens } => {
            expect(shared, request_id, source, blocks, num_tokens, cached_tokens)
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
                if t.produced.remove(&transfer_id).is_some() && shared.cfg.mode == crate::KvMode::Pull {
                    t.released.insert(transfer_id.clone(), Instant::now() + shared.cfg.lease);
                }
                t.computing.remove(&transfer_id);
                t.registrations.remove(&transfer_id)
            };
            if let Some(reg) = reg {
                early::notify(reg, Message::Failed { transfer_id, reason });
            }
        }
        Command::Computed { transfer_id, blocks, num_tokens, attempt, fences } => {
            let report = table::Computing { blocks, upto: num_tokens, attempt, fences, since: Instant::now() };
            early::on_computed(shared, &transfer_id, report)
        }
    }
}

/// Decode side: register (push) or read (pull) the KV of `num_tokens` prompt tokens into
/// `blocks`, all but the first `cached_tokens`, whose KV the blocks hold already (decode's
/// prefix cache). Everything after this sees only the rest: the blocks from the first uncached
/// one, and the tokens after the cached ones.
fn expect(
    shared: &Arc<Shared>,
    request_id: RequestId,
    source: RemoteKv,
    blocks: Vec<u32>,
    num_tokens: usize,
    cached_tokens: usize,
) {
    let ours = shared.memory.layout().block_size;
    let skip = cached_tokens;
    if !skip.is_multiple_of(ours) || (skip > 0 && skip >= num_tokens) || skip / ours > blocks.len() {
        let reason = format!("{skip} cached tokens is not a whole number of blocks before the last of {num_tokens}");
        shared.emit(ConnectorEvent::Failed { request_id, reason });
        return;
    }
    let deadline = Instant::now() + shared.cfg.transfer_timeout;
    let (tid, peer_addr, lease, first_token) = match source {
        RemoteKv::PushFrom { transfer_id, peer, .. } => (transfer_id, peer, None, None),
        RemoteKv::PullFrom { num_tokens: remote_tokens, .. } if remote_tokens != num_tokens => {
            let reason = format!("prefill holds {remote_tokens} tokens of KV, this request needs {num_tokens}");
            shared.emit(ConnectorEvent::Failed { request_id, reason });
            return;
        }
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
    let (blocks, num_tokens) = (blocks[skip / ours..].to_vec(), num_tokens - skip);
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
                direct: false,
                failure: None,
                started: Instant::now(),
                timeline: TransferTimeline::default(),
            },
        );
    }
    // An open connection takes the request at once; a new one is made on a thread of its own,
    // so a peer that stalls its handshake holds up only the transfers that wait for it (not
    // this thread's other commands and deadlines).
    let wanted = Wanted { blocks, num_tokens, skip };
    if let Some(conn) = open_conn(shared, &peer_addr) {
        return send_request(shared, conn, tid, lease, wanted, deadline);
    }
    let s = shared.clone();
    let spawned = std::thread::Builder::new().name("tandem-kv-connect".into()).spawn(move || {
        let Some(conn) = connect_for(&s, &tid, &peer_addr) else { return };
        send_request(&s, conn, tid, lease, wanted, deadline);
    });
    if let Err(e) = spawned {
        tracing::error!(error = %e, "cannot start a KV connection thread");
    }
}

/// What a decode leg asks of prefill: KV for `num_tokens` tokens after the first `skip` of the
/// prompt, into `blocks` (ours, from the first uncached block on).
struct Wanted {
    blocks: Vec<u32>,
    num_tokens: usize,
    skip: usize,
}

/// Tokens per transferred run with the peer at `addr` (a whole number of blocks on both
/// sides: what a cached prefix skipped by a transfer must be a multiple of), if we are
/// connected to it now. A table lookup.
pub(crate) fn transfer_alignment(shared: &Shared, addr: &str) -> Option<usize> {
    let conn = open_conn(shared, addr)?;
    Some(early::shared_run(shared.memory.layout().block_size, conn.peer.block_size))
}

/// The open connection to `addr`, if there is one.
fn open_conn(shared: &Shared, addr: &str) -> Option<Arc<Conn>> {
    let peers = shared.peers.lock().unwrap_or_else(|p| p.into_inner());
    peers.get(addr).filter(|c| c.alive.load(Ordering::SeqCst)).cloned()
}

/// Connects to `addr` for transfer `tid` (one connect at a time per address: the others wait
/// and take the connection it makes); `None` when it failed, after ending the transfer.
fn connect_for(shared: &Arc<Shared>, tid: &TransferId, addr: &str) -> Option<Arc<Conn>> {
    let gate = shared.connecting.lock().unwrap_or_else(|p| p.into_inner()).entry(addr.to_string()).or_default().clone();
    let _one_at_a_time = gate.lock().unwrap_or_else(|p| p.into_inner());
    let reason = match peer_conn(shared, addr) {
        Ok(c) => return Some(c),
        Err(e @ (KvError::Incompatible(_) | KvError::Refused(_))) => {
            bump(&shared.counters.peers_refused, 1);
            let reason = format!("prefill engine at {addr} cannot pair with this engine: {e}");
            let mut t = shared.tables();
            shared.finish_incoming(&mut t, tid, |inc| ConnectorEvent::Refused { request_id: inc.request_id, reason });
            return None;
        }
        Err(e) => format!("prefill engine at {addr}: {e}"),
    };
    let mut t = shared.tables();
    shared.finish_incoming(&mut t, tid, |inc| ended(inc, reason));
    None
}

/// Decode: sends transfer `tid`'s registration (push) or read (pull) on `conn`.
fn send_request(
    shared: &Shared,
    conn: Arc<Conn>,
    tid: TransferId,
    lease: Option<pull::Lease>,
    wanted: Wanted,
    deadline: Instant,
) {
    let fail = |reason: String| {
        let mut t = shared.tables();
        shared.finish_incoming(&mut t, &tid, |inc| ended(inc, reason));
    };
    // The engine aligned its cached prefix to the connection it saw; a peer reconnected since
    // with other blocks would have to write into cached blocks other requests may share.
    let run = early::shared_run(shared.memory.layout().block_size, conn.peer.block_size);
    if !wanted.skip.is_multiple_of(run) {
        return fail(format!(
            "the cached prefix ({} tokens) is not a whole number of {run}-token runs with this prefill engine",
            wanted.skip
        ));
    }
    let write_within_ms = deadline.saturating_duration_since(Instant::now()).as_millis() as u64;
    let Wanted { blocks, num_tokens, skip } = wanted;
    let msg = match lease {
        None => push::register(shared, &tid, blocks, num_tokens, skip, write_within_ms),
        Some(lease) => match pull::read(&conn, &tid, lease, skip, blocks, write_within_ms) {
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
                let _ = write_message(&mut *w, &Message::Abort { transfer_id: tid });
                return;
            }
        }
    }
    let sent = write_message(&mut *w, &msg);
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

fn reader_loop(mut stream: TcpStream, conn: Arc<Conn>, shared: Arc<Shared>) {
    // Between messages a read waits up to the liveness bound (the peer pings every third of
    // it, so silence that long means it is frozen or gone); bulk data is read under the I/O
    // timeout once its header has arrived.
    let idle = |s: &TcpStream, on: bool| {
        let _ = s.set_read_timeout(Some(if on { shared.cfg.liveness } else { shared.cfg.timeouts.io }));
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
    // Everything waiting on this connection fails now rather than at its deadline. What the
    // peer may be writing directly fails now too, its blocks held for the expiry grace (a
    // frozen writer may resume and finish a copy it started); an aborted one ends after it.
    let mut t = shared.tables();
    let now = Instant::now();
    let on_conn = |i: &Incoming| i.conn.as_ref().is_some_and(|c| Arc::ptr_eq(c, &conn));
    for inc in t.incoming.values_mut().filter(|i| on_conn(i) && i.landing == Landing::WritingAborted) {
        inc.deadline = inc.deadline.min(now);
    }
    let writes_until = now + shared.cfg.timeouts.io;
    let reason = format!("connection to `{}` lost", conn.peer.engine_id);
    let dead: Vec<(TransferId, bool)> = t
        .incoming
        .iter()
        .filter(|(_, i)| on_conn(i) && i.landing != Landing::WritingAborted)
        .map(|(k, i)| (k.clone(), i.direct && i.writing()))
        .collect();
    for (tid, in_flight) in dead {
        let reason = reason.clone();
        shared.finish_incoming(&mut t, &tid, |inc| match in_flight {
            true => ConnectorEvent::FailedInFlight { request_id: inc.request_id, reason, writes_until },
            false => ConnectorEvent::Failed { request_id: inc.request_id, reason },
        });
    }
    t.registrations.retain(|_, r| !Arc::ptr_eq(&r.conn, &conn));
}

fn handle_message(stream: &mut TcpStream, conn: &Arc<Conn>, shared: &Arc<Shared>, msg: Message) -> Result<(), KvError> {
    match msg {
        // ---- prefill side ----
        Message::Register { transfer_id, epoch, block_ids, num_tokens, write_within_ms, skip_tokens, .. } => {
            let wanted = Wanted { blocks: block_ids, num_tokens, skip: skip_tokens };
            push::on_register(shared, conn, transfer_id, epoch, wanted, write_within_ms)?
        }
        Message::ReadBlocks { transfer_id, blocks, num_tokens, dst_blocks, write_within_ms, skip_tokens } => {
            let lease = (blocks, num_tokens);
            pull::on_read_blocks(shared, conn, transfer_id, lease, dst_blocks, skip_tokens, write_within_ms)?
        }
        Message::Heartbeat { transfer_ids } => pull::on_heartbeat(shared, transfer_ids),
        Message::Abort { transfer_id } => {
            let mut t = shared.tables();
            let reg = t.registrations.remove(&transfer_id);
            let pushing = t.pushing.contains(&transfer_id);
            if t.produced.remove(&transfer_id).is_none() {
                if shared.cfg.role == crate::Role::Prefill {
                    // The KV is not here yet (the prompt computes, or its request is still on
                    // the way): free it when it comes.
                    t.computing.remove(&transfer_id);
                    t.aborted.insert(transfer_id.clone(), Instant::now() + shared.cfg.transfer_timeout);
                } else {
                    // Decode-side abort from prefill: fail the waiting request.
                    shared
                        .finish_incoming(&mut t, &transfer_id, |inc| ended(inc, "prefill aborted the transfer".into()));
                }
            }
            drop(t);
            // A decode engine aborting a transfer we write directly keeps its blocks until we
            // say no write can land: the write thread's `Done` says so when one is running,
            // else this notice, after any early part still being written.
            if shared.cfg.role == crate::Role::Prefill && conn.transport.writes_directly() && !pushing {
                let failed = Message::Failed { transfer_id, reason: "aborted by the decode engine".into() };
                match reg {
                    Some(reg) => early::notify(reg, failed),
                    None => conn.send(&failed)?,
                }
            }
        }
        // ---- decode side ----
        Message::WriteBlocks { transfer_id, blocks, src_block_size, num_tokens, bytes, checksum } => {
            let data = transport::Bulk { src_block_size, bytes, checksum };
            push::on_write_blocks(stream, conn, shared, transfer_id, &blocks, num_tokens, data)?
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
        } => {
            let data = transport::Bulk { src_block_size, bytes, checksum };
            let direct = direct.then_some(transport::DirectEnd { copy_us, digest, grant_us });
            pull::on_block_data(stream, conn, shared, transfer_id, data, error, direct)?
        }
        // Prefill: a pull release; decode: a push completion.
        Message::Done { transfer_id, first_token, status, copy_us, produced_unix_us, digest, .. } => {
            if !pull::on_release(shared, &transfer_id, &status) {
                let report = push::DoneReport { first_token, status, copy_us, produced_unix_us, digest };
                land(conn, shared, move |_, shared| {
                    push::on_done(shared, &transfer_id, report);
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
        // Prefill: decode checked a push write's bytes (a checksum mismatch, a transfer it had
        // ended, or landed).
        Message::WriteAck { transfer_id, error } => match error {
            Some(e) => {
                tracing::warn!(%transfer_id, error = %e, "decode refused a push write");
                bump(&shared.counters.transfers_failed, 1);
            }
            None => bump(&shared.counters.transfers_ok, 1),
        },
        other @ (Message::Handshake { .. } | Message::HandshakeOk { .. } | Message::HandshakeRefused { .. }) => {
            return Err(KvError::Protocol(format!("unexpected {other:?} after the handshake")));
        }
    }
    Ok(())
}

/// Decode: runs `landing` (what follows a direct writer's word that it wrote a transfer: the
/// landing's confirmation, a pull's READ, the report) on a thread of its own when the
/// connection's transport waits on the network for it ([`Transport::landing_waits`]), so that
/// a notification lost for one transfer, or a long READ, holds up no other transfer's message
/// on the connection; else here, on the reader. Every wait inside is bounded; a landing that
/// fails to answer the peer shuts the connection, as the reader would, so what rides on it fails
/// at once.
fn land<F>(conn: &Arc<Conn>, shared: &Arc<Shared>, landing: F) -> Result<(), KvError>
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
            let _ = c.writer().shutdown(std::net::Shutdown::Both);
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

/// Reclaims everything past its deadline (all of it: one live entry never hides expired ones).
fn expire(shared: &Arc<Shared>) {
    let (mut to_notify, mut failed) = (Vec::new(), Vec::new());
    {
        let mut t = shared.tables();
        // A prompt that failed without a word to us (a model error) leaves its report here;
        // none waits longer than a push may for its registration.
        t.computing.retain(|_, c| c.since.elapsed() < shared.cfg.transfer_timeout);
        let expired = t.expire(Instant::now(), shared.cfg.timeouts.io);
        bump(&shared.counters.expired, expired.reclaimed as u64);
        for (tid, reg) in expired.registrations {
            if reg.conn.transport.writes_directly() {
                failed.push((reg, tid));
            }
        }
        for tid in expired.late {
            if let Some(c) = t.incoming.get(&tid).and_then(|i| i.conn.clone()) {
                to_notify.push((c, tid.clone()));
            }
            shared.finish_incoming(&mut t, &tid, |inc| ended(inc, "timed out waiting for the KV".into()));
        }
        let grace = shared.cfg.timeouts.io;
        for tid in expired.late_in_flight {
            if let Some(c) = t.incoming.get(&tid).and_then(|i| i.conn.clone()) {
                to_notify.push((c, tid.clone()));
            }
            shared.finish_incoming(&mut t, &tid, |inc| ConnectorEvent::FailedInFlight {
                request_id: inc.request_id,
                reason: "timed out waiting for the KV".into(),
                writes_until: inc.deadline + grace,
            });
        }
    }
    for (conn, tid) in to_notify {
        let _ = conn.send(&Message::Abort { transfer_id: tid });
    }
    for (reg, tid) in failed {
        let reason = "the decode engine's deadline passed before the KV was ready".into();
        early::notify(reg, Message::Failed { transfer_id: tid, reason });
    }
}

/// How a decode-side transfer that will get no (more) data ends: `Released` if the engine
/// aborted it (its blocks come back), else `Failed` with `reason`.
fn ended(inc: Incoming, reason: String) -> ConnectorEvent {
    if inc.landing == Landing::WritingAborted {
        ConnectorEvent::Released { request_id: inc.request_id }
    } else {
        ConnectorEvent::Failed { request_id: inc.request_id, reason }
    }
}
