//! The connector's background threads: they own the sockets and carry out what the protocols
//! (`crate::protocol`) decide over the transfer table (`crate::table`), calling the
//! connection's transport (`crate::transport`) to move bytes.
//!
//! Threads: one control thread (engine commands, deadlines, heartbeats and pings), one accept
//! thread, one reader per side-channel connection ([`dispatch`]), a short-lived thread per new
//! outgoing connection (connect and handshake, never on the control thread), the push writers
//! ([`push_writer`]), and on decode one per transfer landing over a transport that waits on the
//! network for it ([`landing`]). All transfer state lives in the table behind one mutex
//! ([`shared`]); it is never held across socket I/O. Bulk sends take the connection's writer
//! lock, so frames on one connection never interleave.
//!
//! Files, top down: this one (start, the control and accept threads), [`dispatch`] (a
//! connection's reader), [`decode`] and [`landing`] (the decode engine's asking and receiving),
//! [`prefill`] and [`push_writer`] (the prefill engine's), [`connections`] (handshakes),
//! [`parts`], [`shared`], [`conn`].
//!
//! Layer: under `connector`. Owns the threads, the sockets and the transfer table's lock; calls
//! `protocol`, `table`, `transport`, `channel`, `wire` and the ground floor, never `connector`.

mod conn;
mod connections;
mod decode;
mod dispatch;
mod landing;
mod parts;
mod prefill;
mod push_writer;
mod shared;

pub(crate) use connections::transfer_alignment;
pub(crate) use prefill::produced;
pub(crate) use shared::Shared;

use std::collections::HashMap;
use std::net::TcpListener;
use std::sync::atomic::AtomicBool;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tandem_compute::cuda::KvFences;
use tandem_core::{Epoch, RemoteKv, RequestId, TransferId};

use self::decode::Pending;
use self::shared::{bump, ended, Counters};
use crate::agent_info::{AgentInfo, TransportOffer};
use crate::config::{ConnectorConfig, KvTransport};
use crate::error::KvError;
use crate::events::{ConnectorEvent, EventSink};
use crate::memory::KvMemory;
use crate::table::Computing;
use crate::transport::nixl::{self, NixlSetup};
use crate::transport::pick::Picker;
use crate::transport::{cuda_ipc, local, Ours};
use crate::wire::Message;

pub(crate) enum Command {
    Expect { request_id: RequestId, source: RemoteKv, blocks: Vec<u32>, num_tokens: usize, cached_tokens: usize },
    Abort { request_id: RequestId },
    Abandon { transfer_id: TransferId, reason: String },
    Computed { transfer_id: TransferId, blocks: Vec<u32>, num_tokens: usize, attempt: u32, fences: KvFences },
}

pub(crate) type Started = (mpsc::Sender<Command>, AgentInfo, Arc<Shared>);

pub(crate) fn start(mut cfg: ConnectorConfig, memory: KvMemory, events: EventSink) -> Result<Started, KvError> {
    // TLS pipes, unless set, as this engine's stream count makes them pay.
    cfg.tls = cfg.tls.map(|tls| tls.for_streams(cfg.tcp_streams));
    let ipc_offer = match (cfg.transport, memory.device_cache()) {
        (KvTransport::Tcp | KvTransport::Nixl, _) => None,
        (KvTransport::CudaIpc, None) => {
            return Err(KvError::Unsupported(
                "--kv-transport cuda-ipc needs an engine whose KV cache is on a GPU (--device cuda:N)".into(),
            ))
        }
        (KvTransport::Auto, None) => None,
        (policy, Some(dev)) => match dev.export() {
            Ok(export) => Some(cuda_ipc::offer(&export)),
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
    let bound = listener.local_addr()?;
    let port = bound.port();
    if !bound.ip().is_loopback() && cfg.cluster_secret.is_none() {
        // Without a secret nothing on the side channel is authenticated: say so where it matters.
        tracing::warn!(addr = %bound, "the KV side channel listens beyond this host without a cluster secret: anyone who can reach this port can read and write this engine's KV; give every engine and the router --cluster-secret-file, or keep it on a network only the deployment reaches");
    }
    let l = memory.layout();
    let epoch = Epoch(SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0));
    let mut transports = vec![TransportOffer::Tcp { addr: crate::channel::host_port(&cfg.advertise_host, port) }];
    if cfg.local_transport {
        transports
            .push(TransportOffer::Local { process: std::process::id(), key: format!("{}@{}", cfg.engine_id, epoch.0) });
    }
    transports.extend(ipc_offer);
    let nixl = NixlSetup {
        endpoint: nixl::open(&cfg, &memory, epoch.0)?,
        min_gb_s: cfg.nixl_min_gb_s,
        pull: cfg.nixl_pull,
        answers_pulls: cfg.role == crate::agent_info::Role::Prefill && cfg.mode == crate::agent_info::KvMode::Pull,
    };
    transports.extend(nixl.offer());
    let info = AgentInfo {
        kv_verify: cfg.verify,
        tcp_streams: cfg.tcp_streams.max(1),
        tp_size: cfg.tp_size.max(1),
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
    let ours = Ours {
        memory: memory.clone(),
        verify: cfg.verify,
        faults: cfg.faults.clone(),
        stage_ahead: cfg.stage_ahead,
        timeouts: cfg.timeouts,
    };
    let picker = Picker { ours, policy: cfg.transport, local: cfg.local_transport, nixl };
    let (cmd_tx, cmd_rx) = mpsc::channel();
    let shared = Arc::new(Shared {
        info: info.clone(),
        cfg,
        memory: Arc::new(memory),
        tables: Mutex::default(),
        peers: Mutex::new(HashMap::new()),
        connecting: Mutex::new(HashMap::new()),
        links: Mutex::new(Vec::new()),
        events,
        counters: Counters::default(),
        picker,
        joining: Mutex::new(HashMap::new()),
        cut_a_stream: AtomicBool::new(false),
    });
    if let Some(TransportOffer::Local { key, .. }) =
        info.transports.iter().find(|t| matches!(t, TransportOffer::Local { .. }))
    {
        local::register(key, &shared.memory);
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
        let Ok(stream) = stream else { continue };
        let s = shared.clone();
        let _ = std::thread::Builder::new().name("tandem-kv-conn".into()).spawn(move || {
            if let Some((conn, opener, stream)) = connections::accept(&s, stream) {
                dispatch::reader_loop(stream, opener, conn, s);
            }
        });
    }
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
            decode::heartbeat(&shared);
            last_heartbeat = Instant::now();
        }
        if last_ping.elapsed() >= shared.cfg.liveness / 3 {
            // A heartbeat naming no transfer on every open connection: the peer's reader hears
            // from us at least every third of the liveness bound, even when no transfer runs.
            for c in shared.open_links() {
                c.try_send(&Message::Heartbeat { transfer_ids: Vec::new() });
            }
            shared.picker.nixl.relay_ucx_log();
            last_ping = Instant::now();
        }
    }
}

fn handle_command(shared: &Arc<Shared>, cmd: Command) {
    match cmd {
        Command::Expect { .. } if shared.cfg.faults.silent_agent => {}
        Command::Expect { request_id, source, blocks, num_tokens, cached_tokens } => {
            if let Some(pending) = decode::expect(shared, request_id, source, blocks, num_tokens, cached_tokens) {
                send_when_connected(shared, pending);
            }
        }
        Command::Abort { request_id } => decode::abort(shared, request_id),
        Command::Abandon { transfer_id, reason } => prefill::abandon(shared, transfer_id, reason),
        Command::Computed { transfer_id, blocks, num_tokens, attempt, fences } => {
            let report = Computing { blocks, upto: num_tokens, attempt, fences, since: Instant::now() };
            push_writer::on_computed(shared, &transfer_id, report)
        }
    }
}

/// Sends `pending`'s request on the open connection to its prefill engine at once, or on a
/// new one made on a thread of its own, so a peer that stalls its handshake holds up only the
/// transfers that wait for it (not this thread's other commands and deadlines).
fn send_when_connected(shared: &Arc<Shared>, pending: Pending) {
    if let Some(conn) = connections::open_conn(shared, &pending.peer) {
        return decode::send_request(shared, conn, pending);
    }
    let s = shared.clone();
    let spawned = std::thread::Builder::new().name("tandem-kv-connect".into()).spawn(move || {
        let Some(conn) = connect_for(&s, &pending) else { return };
        decode::send_request(&s, conn, pending);
    });
    if let Err(e) = spawned {
        tracing::error!(error = %e, "cannot start a KV connection thread");
    }
}

/// Connects to `pending`'s prefill engine (one connect at a time per address: the others wait
/// and take the connection it makes) and starts its reader; `None` when it failed, after
/// ending the transfer.
fn connect_for(shared: &Arc<Shared>, pending: &Pending) -> Option<Arc<conn::Conn>> {
    let addr = &pending.peer;
    let gate = shared.connecting.lock().unwrap_or_else(|p| p.into_inner()).entry(addr.clone()).or_default().clone();
    let _one_at_a_time = gate.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(conn) = connections::open_conn(shared, addr) {
        return Some(conn);
    }
    match connections::connect_to(shared, addr) {
        Ok((conn, stream, opener)) => {
            let (s, c) = (shared.clone(), conn.clone());
            let reader = std::thread::Builder::new()
                .name("tandem-kv-conn".into())
                .spawn(move || dispatch::reader_loop(stream, opener, c, s));
            match reader {
                Ok(_) => Some(conn),
                Err(e) => {
                    conn.close();
                    decode::unreachable(shared, pending, e.into());
                    None
                }
            }
        }
        Err(e) => {
            decode::unreachable(shared, pending, e);
            None
        }
    }
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
        push_writer::notify(reg, Message::Failed { transfer_id: tid, reason });
    }
}
