//! How a transfer's bytes move once the table says where from and where to. Each connection
//! gets its transport at handshake, picked by the accepting side (the prefill engine, which
//! does the writing in both modes) from what both ends offer: `local` (a direct copy between
//! two engines of this process), else `cuda-ipc` (device-to-device copies into the peer's
//! mapped GPU cache) when both are GPU engines of one host that can reach each other's
//! memory, else `tcp` (the bytes on the side channel, straight between socket and KV memory).

use std::collections::HashMap;
use std::io::Read;
use std::net::TcpStream;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use tandem_compute::cuda::{IpcExport, KvFences, PeerKvMemory};
use tandem_compute::kv_copy::plan_kv_copy;
use tandem_compute::{KvLayout, KvRegion};
use tandem_core::TransferId;

use super::push::PushDone;
use super::table::NoWrite;
use super::{bump, Conn, Shared};
use crate::blocks::{coalesce, copy_tokens, wire_bytes, BlockRun};
use crate::tcp::{recv_staged, send_pieces, send_staged, Destination, Picked, CHECKSUM_BYTES};
use crate::wire::{write_message, DoneStatus, Message};
use crate::{AgentInfo, ConnectorEvent, KvError, KvTransport, StagedSend, TransportOffer};

/// Moves a transfer's KV from this engine's blocks to a peer's.
pub(super) trait Transport: Send + Sync {
    /// The offer's name, for logs.
    fn name(&self) -> &'static str;

    /// Whether the writing side puts the bytes straight into the reader's memory, with no
    /// bytes on the socket and no call into the reader's table (cuda-ipc): the reader then
    /// treats its blocks as being written from the moment it names them until the writer
    /// says the write ended.
    fn writes_directly(&self) -> bool {
        false
    }

    /// Whether the reader acknowledges each push write (`WriteAck`, tcp): the write's outcome
    /// is counted then, when the reader has checked the bytes, not when they were sent.
    fn acknowledges_writes(&self) -> bool {
        false
    }

    /// Push: writes `num_tokens` of KV from our blocks `src` into the peer's registered blocks
    /// `dst` of transfer `tid`, then sends `Done` (with prefill's first token, `done`) on `conn`.
    #[allow(clippy::too_many_arguments)]
    fn push(
        &self,
        shared: &Shared,
        conn: &Conn,
        tid: &TransferId,
        src: &[u32],
        dst: &[u32],
        num_tokens: usize,
        done: PushDone,
    ) -> Result<(), KvError>;

    /// Push over a direct transport, while the prompt is still being computed: writes
    /// `num_tokens` of KV from our blocks `src` into the peer's blocks `dst` (the registered
    /// blocks from the part's first token on), each group of layers once `fences` say it is
    /// final, and waits for the copies. No notification.
    fn write_part(
        &self,
        _shared: &Shared,
        _src: &[u32],
        _dst: &[u32],
        _num_tokens: usize,
        _fences: &KvFences,
    ) -> Result<(), String> {
        Err(format!("the {} transport writes a prompt's KV only when it is complete", self.name()))
    }

    /// Pull: whether the reader moves the bytes itself (NIXL READs) once the writer's answer
    /// grants the read, rather than the writer copying them before it answers.
    fn reader_reads(&self) -> bool {
        false
    }

    /// Decode, pull, when [`Self::reader_reads`]: the read it is about to ask for, tokens
    /// `0..num_tokens` of prefill's blocks `src` into our `dst` (both from the first block
    /// decode does not hold).
    fn plan_read(&self, _tid: &TransferId, _src: Vec<u32>, _dst: Vec<u32>, _num_tokens: usize) {}

    /// Decode, pull, when [`Self::reader_reads`]: prefill granted the read of `tid`, keeping
    /// its lease for `validity` from its answer.
    fn granted(&self, _tid: &TransferId, _validity: std::time::Duration) {}

    /// Reader of a direct write: waits (bounded) until the bytes the writer says it wrote for
    /// `tid` are known to be in our memory. Copies the writer waited for are (cuda-ipc, local);
    /// a NIXL write is once its notification has arrived.
    fn confirm_landed(&self, _shared: &Shared, _tid: &TransferId) -> Result<(), String> {
        Ok(())
    }

    /// Whether [`Self::confirm_landed`] waits on the network (a NIXL notification, or the READ
    /// itself): the reader then lands each transfer on a thread of its own, so that one slow or
    /// lost landing holds up no other message on the connection.
    fn landing_waits(&self) -> bool {
        false
    }

    /// Pull: answers the peer's read of our blocks `src` (held under a lease) into its blocks
    /// `dst` with `BlockData` (and, on tcp, the bytes).
    fn answer_read(
        &self,
        shared: &Shared,
        conn: &Conn,
        tid: &TransferId,
        src: &[u32],
        dst: &[u32],
        num_tokens: usize,
    ) -> Result<(), KvError>;
}

/// Accepting side: the transport for a connection from `peer`, and what to tell it; an error
/// refuses the peer, saying why.
pub(super) fn pick(ours: &Shared, peer: &AgentInfo) -> Result<(Arc<dyn Transport>, Picked), String> {
    let policy = ours.cfg.transport;
    if policy == KvTransport::Nixl {
        // Forced, so not `local` even in one process (the tests run NIXL that way).
        return match super::nixl::pick(ours, peer) {
            Ok(t) => {
                tracing::info!(peer = %peer.engine_id, "KV transport nixl: the peer's NIXL agent is loaded");
                Ok((t, Picked { transport: "nixl".into(), note: None }))
            }
            Err(why) => Err(format!("--kv-transport nixl, but nixl cannot work with `{}`: {why}", peer.engine_id)),
        };
    }
    if let Some(local) = local_peer(ours, peer) {
        return Ok((Arc::new(Local { peer: local }), Picked { transport: "local".into(), note: None }));
    }
    let ipc = match policy {
        KvTransport::Tcp => Err("--kv-transport tcp".to_string()),
        KvTransport::Auto | KvTransport::CudaIpc | KvTransport::Nixl => open_cuda_ipc(ours, peer),
    };
    match ipc {
        Ok(mapped) => {
            tracing::info!(peer = %peer.engine_id, place = mapped.place(), "KV transport cuda-ipc: the peer's GPU cache is mapped");
            Ok((Arc::new(CudaIpc { peer: Some(mapped) }), Picked { transport: "cuda-ipc".into(), note: None }))
        }
        Err(why) if policy == KvTransport::CudaIpc => {
            Err(format!("--kv-transport cuda-ipc, but cuda-ipc cannot work with `{}`: {why}", peer.engine_id))
        }
        Err(why) => {
            ours.memory.host_region().map_err(|e| e.to_string())?;
            let note = (policy == KvTransport::Auto).then(|| format!("cuda-ipc not possible: {why}"));
            Ok((Arc::new(Tcp), Picked { transport: "tcp".into(), note }))
        }
    }
}

/// Connecting side: the transport the acceptor picked, if this engine can take part in it.
pub(super) fn accept_pick(ours: &Shared, peer: &AgentInfo, picked: &Picked) -> Result<Arc<dyn Transport>, KvError> {
    let refuse = |why: String| Err(KvError::Refused(why));
    match picked.transport.as_str() {
        "local" => match local_peer(ours, peer) {
            Some(local) => Ok(Arc::new(Local { peer: local })),
            None => refuse(format!("`{}` picked the local transport, but it is not in this process", peer.engine_id)),
        },
        "cuda-ipc"
            if ours.memory.device_cache().is_some()
                && matches!(ours.cfg.transport, KvTransport::Auto | KvTransport::CudaIpc) =>
        {
            Ok(Arc::new(CudaIpc { peer: None }))
        }
        "nixl" if ours.cfg.transport == KvTransport::Nixl => super::nixl::accept(ours, peer),
        "tcp" if matches!(ours.cfg.transport, KvTransport::Auto | KvTransport::Tcp) => {
            ours.memory.host_region()?;
            Ok(Arc::new(Tcp))
        }
        other => {
            let why = picked.note.as_deref().unwrap_or("no reason given");
            refuse(format!(
                "`{}` picked the {other} transport ({why}), which --kv-transport {} here does not allow",
                peer.engine_id,
                ours.cfg.transport.name()
            ))
        }
    }
}

/// The local peer for `peer`, when both ends offer the local transport in this process.
fn local_peer(ours: &Shared, peer: &AgentInfo) -> Option<Weak<Shared>> {
    if !ours.cfg.local_transport {
        return None;
    }
    peer.transports.iter().find_map(|t| match t {
        TransportOffer::Local { process, key } if *process == std::process::id() => registry().get(key).cloned(),
        _ => None,
    })
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

/// Identifies this host for the cuda-ipc offer: its boot id (two containers of one kernel
/// share it; whether their IPC namespaces do is the driver's answer at mapping time).
pub(super) fn host_id() -> String {
    for path in ["/proc/sys/kernel/random/boot_id", "/etc/hostname"] {
        if let Ok(s) = std::fs::read_to_string(path) {
            let s = s.trim();
            if !s.is_empty() {
                return s.to_string();
            }
        }
    }
    "unknown-host".into()
}

/// The cuda-ipc offer for an export of our cache.
pub(super) fn cuda_ipc_offer(export: &IpcExport) -> TransportOffer {
    let (handle, device) = export.to_hex();
    TransportOffer::CudaIpc { host: host_id(), process: std::process::id(), device, handle, bytes: export.bytes as u64 }
}

/// Maps `peer`'s GPU cache, or says why cuda-ipc cannot work with it.
fn open_cuda_ipc(ours: &Shared, peer: &AgentInfo) -> Result<PeerKvMemory, String> {
    let dev = ours.memory.device_cache().ok_or("this engine's KV cache is in host memory (a CPU engine)")?;
    let offer = peer.transports.iter().find_map(|t| match t {
        TransportOffer::CudaIpc { host, process, device, handle, bytes } => {
            Some((host, *process, device, handle, *bytes))
        }
        _ => None,
    });
    let (host, process, device, handle, bytes) =
        offer.ok_or("the peer offers no cuda-ipc (a CPU engine, or --kv-transport tcp there)")?;
    if *host != host_id() {
        return Err("the peer is on another host".into());
    }
    if process == std::process::id() {
        return Err("the peer is in this process (its handle cannot be opened here)".into());
    }
    let export = IpcExport::from_hex(handle, bytes as usize, device).ok_or("the peer's IPC handle is malformed")?;
    let layout = KvLayout {
        num_layers: peer.num_layers,
        num_kv_heads: peer.num_kv_heads,
        head_dim: peer.head_dim,
        block_size: peer.block_size,
        num_blocks: peer.num_blocks,
    };
    dev.open_peer(&export, layout)
}

/// The bytes on the side channel.
struct Tcp;

impl Transport for Tcp {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn acknowledges_writes(&self) -> bool {
        true
    }

    fn push(
        &self,
        shared: &Shared,
        conn: &Conn,
        tid: &TransferId,
        src: &[u32],
        dst: &[u32],
        num_tokens: usize,
        done: PushDone,
    ) -> Result<(), KvError> {
        let region = shared.memory.host_region()?;
        let pieces = send_pieces(region, src, num_tokens)?;
        // Safety: the connector owns the source blocks until the push thread drops them.
        let staged = match unsafe { stage_send(shared, &pieces) } {
            Ok(staged) => staged,
            Err(e) => {
                // Nothing is on the socket yet: decode learns at once, and recomputes or fails.
                let failed = Message::Done {
                    transfer_id: tid.clone(),
                    rank: 0,
                    first_token: Some(done.first_token),
                    status: DoneStatus::Failed(e.to_string()),
                    copy_us: 0,
                    produced_unix_us: done.produced_unix_us,
                    digest: None,
                };
                conn.send(&failed)?;
                return Err(e);
            }
        };
        let bytes = wire_bytes(region.layout(), region.dtype(), num_tokens);
        let mut w = conn.writer();
        let header = Message::WriteBlocks {
            transfer_id: tid.clone(),
            blocks: dst.to_vec(),
            src_block_size: region.layout().block_size,
            num_tokens,
            bytes,
            checksum: shared.cfg.verify,
        };
        write_message(&mut *w, &header)?;
        // Safety: the connector owns the source blocks until the push thread drops them; the
        // engine does not schedule a finished request's blocks.
        unsafe { send_data(shared, &mut w, region, (&pieces, &staged), num_tokens)? };
        if !shared.cfg.faults.drop_done {
            let done = Message::Done {
                transfer_id: tid.clone(),
                rank: 0,
                first_token: Some(done.first_token),
                status: DoneStatus::Ok,
                copy_us: 0,
                produced_unix_us: done.produced_unix_us,
                digest: None,
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
        _dst: &[u32],
        num_tokens: usize,
    ) -> Result<(), KvError> {
        let region = shared.memory.host_region()?;
        let pieces = send_pieces(region, src, num_tokens)?;
        // Safety: the lease holds these blocks while they are read.
        let staged = match unsafe { stage_send(shared, &pieces) } {
            Ok(staged) => staged,
            Err(e) => {
                // Answered in-band: decode fails the read (and recomputes or fails by its
                // policy); the connection stays in step.
                conn.send(&Message::BlockData {
                    transfer_id: tid.clone(),
                    src_block_size: region.layout().block_size,
                    bytes: 0,
                    error: Some(e.to_string()),
                    direct: false,
                    checksum: false,
                    copy_us: 0,
                    digest: None,
                    grant_us: 0,
                })?;
                return Err(e);
            }
        };
        let mut w = conn.writer();
        let header = Message::BlockData {
            transfer_id: tid.clone(),
            src_block_size: region.layout().block_size,
            bytes: wire_bytes(region.layout(), region.dtype(), num_tokens),
            error: None,
            direct: false,
            checksum: shared.cfg.verify,
            copy_us: 0,
            digest: None,
            grant_us: 0,
        };
        write_message(&mut *w, &header)?;
        // Safety: the lease holds these blocks and its `reading` flag keeps it from expiring
        // until this send is over.
        unsafe { send_data(shared, &mut w, region, (&pieces, &staged), num_tokens)? };
        Ok(())
    }
}

/// [`KvMemory::stage_send`](crate::KvMemory::stage_send), or its injected failure.
///
/// # Safety
/// As `stage_send`.
unsafe fn stage_send<'a>(shared: &'a Shared, pieces: &[BlockRun]) -> Result<StagedSend<'a>, KvError> {
    if shared.cfg.faults.fail_host_copies {
        return Err(KvError::Transfer("copying KV to the host copy failed: injected".into()));
    }
    // Safety: passed on from the caller.
    unsafe { shared.memory.stage_send(pieces) }
}

/// [`send_staged`] with this connector's checksum setting (and its fault injection), each
/// piece sent once its copy from the device cache (if any) has landed.
///
/// # Safety
/// As [`send_staged`].
unsafe fn send_data(
    shared: &Shared,
    w: &mut TcpStream,
    region: &KvRegion,
    (pieces, staged): (&[BlockRun], &StagedSend<'_>),
    num_tokens: usize,
) -> Result<u64, KvError> {
    let checksum = shared.cfg.verify;
    let mut ready = |i| staged.ready(i);
    // Safety: passed on from the caller.
    unsafe {
        if shared.cfg.faults.corrupt_sends {
            let mut w = FlipFirstBit { inner: w, flipped: false };
            send_staged(&mut w, region, pieces, num_tokens, checksum, &mut ready)
        } else {
            send_staged(w, region, pieces, num_tokens, checksum, &mut ready)
        }
    }
}

/// Fault injection: a writer that flips the lowest bit of the first byte written through it.
struct FlipFirstBit<'a> {
    inner: &'a mut TcpStream,
    flipped: bool,
}

impl std::io::Write for FlipFirstBit<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match buf.first() {
            Some(&b) if !self.flipped => {
                self.inner.write_all(&[b ^ 1])?;
                self.flipped = true;
                Ok(1)
            }
            _ => self.inner.write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// A direct copy into the host region of another engine of this process (tests, one-process
/// setups); the side channel carries only the notifications. The writer copies into the
/// blocks the reader named without touching the reader's table: the same protocol as
/// cuda-ipc, so the CPU tests exercise it.
struct Local {
    peer: Weak<Shared>,
}

impl Local {
    fn copy(&self, shared: &Shared, src: &[u32], dst: &[u32], num_tokens: usize) -> Result<(), String> {
        let peer = self.peer.upgrade().ok_or("the peer engine is gone")?;
        let from = shared.memory.host_region().map_err(|e| e.to_string())?;
        let to = peer.memory.host_region().map_err(|e| e.to_string())?;
        // Validates the peer's block list (ids inside its region, enough of them) before a copy.
        plan_kv_copy(from.layout(), to.layout(), from.dtype().bytes(), src, dst, num_tokens)?;
        if from.dtype() != to.dtype() {
            return Err("KV element types differ".into());
        }
        let dst = &dst[..to.layout().blocks_for(num_tokens)];
        // Safety: we hold `src` for this call; the reader gave `dst` to this transfer and keeps
        // them until we report the write's end (its `Writing` state), so nobody else touches
        // either, on the device or in the host copies.
        unsafe {
            shared.memory.stage_to_host(&src[..from.layout().blocks_for(num_tokens)]).map_err(|e| e.to_string())?;
            copy_tokens(from, src, to, dst, num_tokens);
            if shared.cfg.faults.corrupt_sends {
                // As a bad link would: one bit of the first block that landed, after the copy.
                if let Some(&first) = dst.first() {
                    to.bytes_mut(first as usize, 1)[0] ^= 1;
                }
            }
            peer.memory.load_from_host(dst).map_err(|e| e.to_string())
        }
    }
}

impl Transport for Local {
    fn name(&self) -> &'static str {
        "local"
    }

    fn writes_directly(&self) -> bool {
        true
    }

    fn write_part(
        &self,
        shared: &Shared,
        src: &[u32],
        dst: &[u32],
        num_tokens: usize,
        fences: &KvFences,
    ) -> Result<(), String> {
        // The copy goes through the host copies: all of the step's KV first.
        fences.wait()?;
        self.copy(shared, src, dst, num_tokens)
    }

    fn push(
        &self,
        shared: &Shared,
        conn: &Conn,
        tid: &TransferId,
        src: &[u32],
        dst: &[u32],
        num_tokens: usize,
        done: PushDone,
    ) -> Result<(), KvError> {
        report_direct_write(shared, conn, tid, done, self.copy(shared, src, dst, num_tokens))
    }

    fn answer_read(
        &self,
        shared: &Shared,
        conn: &Conn,
        tid: &TransferId,
        src: &[u32],
        dst: &[u32],
        num_tokens: usize,
    ) -> Result<(), KvError> {
        let started = std::time::Instant::now();
        let copied = self.copy(shared, src, dst, num_tokens);
        answer_direct_read(shared, conn, tid, started, (src, num_tokens), copied, 0)
    }
}

/// Push over a direct transport: the copy into the peer's blocks has ended (`copied`); `Done`
/// tells it so, with prefill's first token and how long the write took; a failed copy is
/// returned as the error once decode has been told.
pub(super) fn report_direct_write(
    shared: &Shared,
    conn: &Conn,
    tid: &TransferId,
    done: PushDone,
    copied: Result<(), String>,
) -> Result<(), KvError> {
    let failure = copied.as_ref().err().cloned();
    let status = match copied {
        Ok(()) => DoneStatus::Ok,
        Err(e) => DoneStatus::Failed(e),
    };
    if !shared.cfg.faults.drop_done {
        conn.send(&Message::Done {
            transfer_id: tid.clone(),
            rank: 0,
            first_token: Some(done.first_token),
            status,
            copy_us: done.taken.elapsed().as_micros() as u64,
            produced_unix_us: done.produced_unix_us,
            digest: done.digest,
        })?;
    }
    // Decode has been told; the writer counts and logs the failure too.
    failure.map_or(Ok(()), |e| Err(KvError::Transfer(e)))
}

/// Pull over a direct transport: the copy (begun at `started`) of the lease's KV (`held`: its
/// blocks and tokens) is done before the answer, so no bytes follow it; under `--kv-verify`
/// the answer carries the digest of what was copied. A reader that reads the blocks itself
/// (NIXL) is granted the read for `grant_us` of lease instead (see `Message::BlockData`; 0
/// for the others).
pub(super) fn answer_direct_read(
    shared: &Shared,
    conn: &Conn,
    tid: &TransferId,
    started: std::time::Instant,
    held: (&[u32], usize),
    copied: Result<(), String>,
    grant_us: u64,
) -> Result<(), KvError> {
    let copy_us = started.elapsed().as_micros() as u64;
    let (digest, error) = match copied {
        Ok(()) => match source_digest(shared, held.0, held.1) {
            Ok(digest) => (digest, None),
            Err(e) => (None, Some(e)),
        },
        Err(e) => (None, Some(e)),
    };
    conn.send(&Message::BlockData {
        transfer_id: tid.clone(),
        src_block_size: shared.memory.layout().block_size,
        bytes: 0,
        error,
        direct: true,
        checksum: false,
        copy_us,
        digest,
        grant_us,
    })
}

/// A direct writer under `--kv-verify`: the digest of the KV it copies, tokens `0..num_tokens`
/// of its `blocks` (`None` without the flag).
pub(super) fn source_digest(shared: &Shared, blocks: &[u32], num_tokens: usize) -> Result<Option<u64>, String> {
    if !shared.cfg.verify {
        return Ok(None);
    }
    // Safety: the connector holds the blocks (produced KV, or a lease being read).
    unsafe { shared.memory.digest(blocks, num_tokens) }.map(Some).map_err(|e| e.to_string())
}

/// How a direct writer's copies into our blocks ended, as its `Done` or `BlockData` says.
#[derive(Clone, Copy, Debug)]
pub(super) struct DirectEnd {
    /// How long the writer's copies took.
    pub copy_us: u64,
    /// The writer's digest of what it copied (`--kv-verify`).
    pub digest: Option<u64>,
    /// A reader that reads itself: how long the holder keeps the lease from its answer.
    pub grant_us: u64,
}

/// A reader under `--kv-verify`: whether the KV a direct writer says it copied into the blocks
/// of `tid` is what it copied, by its digest against ours of those blocks (not a byte of it
/// crossed a socket, so tcp's CRC-32 never saw it). A mismatch counts as a checksum failure;
/// either failure fails the transfer, and the engine recomputes or fails it by its policy.
pub(super) fn check_direct(shared: &Shared, tid: &TransferId, theirs: Option<u64>) -> Result<(), String> {
    let conn = shared.tables().incoming.get(tid).and_then(|i| i.conn.clone());
    if let Some(conn) = conn {
        conn.transport.confirm_landed(shared, tid)?;
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

/// Device-to-device copies into the peer's GPU cache, mapped into this process at handshake
/// (writing side), on the cache's own transfer stream; the side channel carries only the
/// notifications, sent once the copies have completed.
struct CudaIpc {
    /// The peer's cache; `None` on the side that is written to.
    peer: Option<PeerKvMemory>,
}

impl CudaIpc {
    fn write(
        &self,
        shared: &Shared,
        src: &[u32],
        dst: &[u32],
        num_tokens: usize,
        fences: &KvFences,
    ) -> Result<(), String> {
        let peer = self.peer.as_ref().ok_or("this end of the connection is written to; it does not write")?;
        let dev = shared.memory.device_cache().ok_or("this engine has no device cache")?;
        // The KV in `src` is final once `fences` say so: the engine hands blocks over whole
        // once the step that wrote them has returned its tokens (the stream finished that step
        // before that), and a part of a prompt still computing with the events of the step
        // writing it, which the copies wait for on the device; later steps do not write them.
        let started = std::time::Instant::now();
        let (bytes, copies) = dev.write_to_peer(peer, src, dst, num_tokens, fences)?;
        tracing::debug!(bytes, copies, us = started.elapsed().as_micros() as u64, "cuda-ipc write done");
        match dst.first() {
            // As a bad link would: one bit of the first block that landed, after the copy.
            Some(&first) if shared.cfg.faults.corrupt_sends && num_tokens > 0 => peer.corrupt_block(first),
            _ => Ok(()),
        }
    }
}

impl Transport for CudaIpc {
    fn name(&self) -> &'static str {
        "cuda-ipc"
    }

    fn writes_directly(&self) -> bool {
        true
    }

    fn write_part(
        &self,
        shared: &Shared,
        src: &[u32],
        dst: &[u32],
        num_tokens: usize,
        fences: &KvFences,
    ) -> Result<(), String> {
        self.write(shared, src, dst, num_tokens, fences)
    }

    fn push(
        &self,
        shared: &Shared,
        conn: &Conn,
        tid: &TransferId,
        src: &[u32],
        dst: &[u32],
        num_tokens: usize,
        done: PushDone,
    ) -> Result<(), KvError> {
        report_direct_write(shared, conn, tid, done, self.write(shared, src, dst, num_tokens, &KvFences::complete()))
    }

    fn answer_read(
        &self,
        shared: &Shared,
        conn: &Conn,
        tid: &TransferId,
        src: &[u32],
        dst: &[u32],
        num_tokens: usize,
    ) -> Result<(), KvError> {
        let started = std::time::Instant::now();
        let copied = self.write(shared, src, dst, num_tokens, &KvFences::complete());
        answer_direct_read(shared, conn, tid, started, (src, num_tokens), copied, 0)
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
    num_tokens: usize,
    data: Bulk,
) -> Result<Result<(), String>, KvError> {
    let Bulk { src_block_size, bytes, checksum } = data;
    let on_wire = bytes + if checksum { CHECKSUM_BYTES } else { 0 };
    let region = match shared.memory.host_region() {
        Ok(r) => r,
        Err(e) => {
            drain(stream, on_wire)?;
            return Ok(Err(e.to_string()));
        }
    };
    if shared.cfg.verify && !checksum {
        // Pairing checks both ends agree on checksums; a peer that still sends none is not
        // trusted with our blocks, which it never touches: the completion reports why.
        drain(stream, on_wire)?;
        let reason = "the peer sent KV without the checksum --kv-verify asks for".to_string();
        if let Some(inc) = shared.tables().incoming.get_mut(tid) {
            inc.failure = Some(reason.clone());
        }
        return Ok(Err(reason));
    }
    let begun = shared.tables().begin_write(tid, num_tokens, dst);
    let blocks = match begun {
        Ok(blocks) => blocks,
        Err(why) => {
            if matches!(why, NoWrite::Unknown) {
                bump(&shared.counters.unknown_ids, 1);
            }
            drain(stream, on_wire)?;
            return Ok(Err(format!("transfer `{tid}` is unknown, aborted or does not match")));
        }
    };
    // Safety: these blocks are registered to this transfer; the engine keeps them out of the
    // schedule until the connector reports, and an abort waits for the write to end.
    let result =
        unsafe { receive_into(stream, shared, region, (src_block_size, bytes), &blocks, num_tokens, checksum) };
    let regions = coalesce(&blocks[..region.layout().blocks_for(num_tokens).min(blocks.len())]).len() as u32;
    let mut t = shared.tables();
    if t.end_write(tid, result.is_ok(), bytes, regions) {
        shared.finish_incoming(&mut t, tid, |inc| ConnectorEvent::Released { request_id: inc.request_id });
    }
    match result {
        Ok(()) => {
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
            let reason = format!("receiving KV: {e}");
            shared.finish_incoming(&mut t, tid, |inc| ConnectorEvent::Failed { request_id: inc.request_id, reason });
            Err(e)
        }
    }
}

/// [`recv_staged`] into `blocks` of `region`, each piece queued for the device cache (a GPU
/// engine's) as it lands, and waited for before returning: once the connector reports the
/// transfer ready, the KV is in the cache the engine reads.
///
/// # Safety
/// As [`recv_staged`].
unsafe fn receive_into(
    stream: &mut TcpStream,
    shared: &Shared,
    region: &KvRegion,
    (src_block_size, bytes): (usize, u64),
    blocks: &[u32],
    num_tokens: usize,
    checksum: bool,
) -> Result<(), KvError> {
    let mut load = shared.memory.receiver()?;
    let into = Destination { region, blocks, num_tokens };
    // A failed copy into the device cache fails the transfer, but the bytes are still read,
    // so the connection stays in step.
    let mut failed = None;
    let mut landed = |run| {
        let copied = match shared.cfg.faults.fail_host_copies {
            true => Err(KvError::Transfer("copying KV into the device cache failed: injected".into())),
            // Safety: passed on from the caller (which owns `blocks` on both sides until it
            // reports).
            false => unsafe { load.landed(run) },
        };
        if let (Err(e), None) = (copied, &failed) {
            failed = Some(e);
        }
        Ok(())
    };
    // Safety: as above.
    unsafe { recv_staged(stream, bytes, src_block_size, into, checksum, &mut landed)? };
    match failed {
        Some(e) => Err(e),
        None => load.finish(),
    }
}

/// How a bulk send's bytes come: in which block size, how many, and whether their checksum
/// follows them.
pub(super) struct Bulk {
    pub src_block_size: usize,
    pub bytes: u64,
    pub checksum: bool,
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
