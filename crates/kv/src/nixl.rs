//! NIXL (NVIDIA's inference transfer library) between two engines' KV memory: the data path
//! the seed system uses across hosts (one-sided WRITEs over UCX on RDMA, EFA or NVLink, each
//! transfer followed by a notification the receiver polls).
//!
//! This is the endpoint the `nixl` transport is built on: one NIXL agent per engine with a UCX
//! backend, its KV region registered once ([`NixlEndpoint::open`]), agent metadata exchanged as
//! bytes (the side channel carries them at handshake: [`NixlEndpoint::metadata`] and
//! [`NixlEndpoint::add_peer`]), and a write of coalesced block runs into the peer's region with
//! a notification ([`NixlEndpoint::write`]). Every call runs on the connector's thread, never
//! the engine loop, and every wait has a bound.
//!
//! Built with the `nixl` feature. `nixl-sys`'s stub API resolves the library at run time
//! (`libnixl_capi.so` on the library path; PyPI's `nixl-cu13` wheel ships it with its UCX
//! plugin) and aborts the process if it is missing, so [`NixlEndpoint::open`] first checks that
//! it loads and otherwise fails with an error that says what to install.

use std::time::{Duration, Instant};

use nixl_sys::{
    Agent, AgentConfig, Backend, MemType, MemoryRegion, NixlDescriptor, NotificationMap, OptArgs, RegistrationHandle,
    ThreadSync, XferDescList, XferOp, XferRequest, XferStatus,
};

/// What went wrong with NIXL, in words for a log or a refused handshake.
#[derive(Debug, thiserror::Error)]
pub enum NixlFailure {
    /// The library is not installed where the loader looks.
    #[error(
        "the NIXL library (libnixl_capi.so) cannot be loaded: {0}; install NIXL (for example PyPI's \
         nixl-cu13 wheel) and put its library directory on LD_LIBRARY_PATH, with NIXL_PLUGIN_DIR naming \
         its plugins"
    )]
    Missing(String),
    /// A NIXL call failed.
    #[error("NIXL {call} failed: {error}")]
    Call {
        /// Which call.
        call: &'static str,
        /// NIXL's error.
        error: String,
    },
    /// A transfer did not complete within its bound.
    #[error("a NIXL transfer of {bytes} bytes with `{peer}` did not complete within {bound:?}")]
    Timeout {
        /// The peer agent.
        peer: String,
        /// Bytes in the write.
        bytes: usize,
        /// The bound it had.
        bound: Duration,
    },
    /// A write's notification did not arrive within its bound.
    #[error("no NIXL notification from `{peer}` within {bound:?} after its write ended")]
    NoNotification {
        /// The writing agent.
        peer: String,
        /// The bound it had.
        bound: Duration,
    },
    /// A run falls outside a registered region.
    #[error("a run of {len} bytes at offset {offset} falls outside the {side} region of {size} bytes")]
    OutOfRegion {
        /// `local` or `peer`.
        side: &'static str,
        /// The run's offset.
        offset: usize,
        /// The run's length.
        len: usize,
        /// The region's size.
        size: usize,
    },
}

fn call<T>(what: &'static str, r: Result<T, nixl_sys::NixlError>) -> Result<T, NixlFailure> {
    r.map_err(|e| NixlFailure::Call { call: what, error: format!("{e:?}") })
}

/// Where a KV region lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NixlPlace {
    /// Host memory (a CPU engine's cache).
    Dram,
    /// GPU memory of this CUDA device ordinal.
    Vram(u32),
}

/// A KV region as NIXL sees it: its address in this process, its length and where it lives.
/// Also what a peer needs of ours to address its writes (its address is only a number there).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NixlRegion {
    /// Start address.
    pub addr: usize,
    /// Length in bytes.
    pub len: usize,
    /// Host or which GPU.
    pub place: NixlPlace,
}

impl NixlRegion {
    fn mem_type(&self) -> MemType {
        match self.place {
            NixlPlace::Dram => MemType::Dram,
            NixlPlace::Vram(_) => MemType::Vram,
        }
    }

    fn device(&self) -> u64 {
        match self.place {
            NixlPlace::Dram => 0,
            NixlPlace::Vram(d) => u64::from(d),
        }
    }

    /// The address of `len` bytes at `offset`, when they lie inside the region.
    fn at(&self, side: &'static str, offset: usize, len: usize) -> Result<usize, NixlFailure> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.addr + offset),
            _ => Err(NixlFailure::OutOfRegion { side, offset, len, size: self.len }),
        }
    }
}

impl MemoryRegion for NixlRegion {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as *const u8
    }

    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for NixlRegion {
    fn mem_type(&self) -> MemType {
        NixlRegion::mem_type(self)
    }

    fn device_id(&self) -> u64 {
        self.device()
    }
}

/// One contiguous copy of a write: `len` bytes from `local_offset` in our region to
/// `peer_offset` in the peer's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NixlRun {
    /// Offset in our region.
    pub local_offset: usize,
    /// Offset in the peer's region.
    pub peer_offset: usize,
    /// Bytes.
    pub len: usize,
}

impl NixlRun {
    /// A KV copy plan as runs: each copy's source in our region, its destination in the
    /// peer's (a pitched copy one run per row).
    pub fn from_plan(plan: &[tandem_compute::kv_copy::KvCopy]) -> Vec<NixlRun> {
        use tandem_compute::kv_copy::KvCopy;
        let mut runs = Vec::with_capacity(plan.len());
        for copy in plan {
            match *copy {
                KvCopy::Linear { src, dst, bytes } => {
                    runs.push(NixlRun { local_offset: src, peer_offset: dst, len: bytes })
                }
                KvCopy::Pitched { src, src_pitch, dst, dst_pitch, width, rows } => runs.extend((0..rows).map(|r| {
                    NixlRun { local_offset: src + r * src_pitch, peer_offset: dst + r * dst_pitch, len: width }
                })),
            }
        }
        runs
    }

    /// [`Self::from_plan`] for a READ: the plan's source is the peer's region, its destination
    /// ours.
    pub fn from_read_plan(plan: &[tandem_compute::kv_copy::KvCopy]) -> Vec<NixlRun> {
        Self::from_plan(plan)
            .into_iter()
            .map(|r| NixlRun { local_offset: r.peer_offset, peer_offset: r.local_offset, len: r.len })
            .collect()
    }
}

/// How many notifications [`NixlEndpoint::wait_notification`] keeps for later waits.
pub const MAX_SET_ASIDE: usize = 4096;

/// Bytes of each endpoint's scratch memory, what a [`NixlEndpoint::probe`] writes.
pub const PROBE_BYTES: usize = 16 << 20;

/// The memory an endpoint's [`NixlEndpoint::probe`]s write: [`PROBE_BYTES`] in the KV's
/// place (host memory for a host cache, the same GPU for a GPU cache), so that a probe takes
/// the path the KV will.
pub struct NixlScratch {
    region: NixlRegion,
    /// What keeps `region`'s memory alive.
    _memory: Box<dyn std::any::Any + Send + Sync>,
}

impl NixlScratch {
    /// Host memory of its own.
    pub fn host() -> Self {
        let memory = vec![0u8; PROBE_BYTES].into_boxed_slice();
        let region = NixlRegion { addr: memory.as_ptr() as usize, len: memory.len(), place: NixlPlace::Dram };
        Self { region, _memory: Box::new(memory) }
    }

    /// `region`, whose memory `memory` owns (a GPU allocation: it must not be stream-ordered
    /// pool memory, which UCX cannot map).
    pub fn new(region: NixlRegion, memory: Box<dyn std::any::Any + Send + Sync>) -> Self {
        Self { region, _memory: memory }
    }
}

/// One engine's NIXL agent with its KV region registered (see the module docs).
pub struct NixlEndpoint {
    // Field order is drop order: the registrations go before the backend and the agent, and
    // the scratch memory after its registration.
    _registration: RegistrationHandle,
    _scratch_registration: RegistrationHandle,
    scratch: NixlScratch,
    backend: Backend,
    agent: Agent,
    region: NixlRegion,
    set_aside: std::sync::Mutex<Vec<(String, Vec<u8>)>>,
    /// Writes that outlived their bound, kept until NIXL ends them: nixl-sys destroys a
    /// request it releases whether or not the release worked, which for one still moving
    /// bytes would leave NIXL holding a freed request.
    overdue: std::sync::Mutex<Vec<XferRequest>>,
}

impl NixlEndpoint {
    /// An agent named `name` (unique among the peers it will meet: the engine id) with a UCX
    /// backend and `region` (and `scratch`) registered for remote access. For GPU memory the
    /// GPU's CUDA context is current on this thread, and on every thread that moves it.
    ///
    /// The caller keeps `region`'s memory alive and in place for as long as the endpoint (and
    /// any peer's writes into it) may use it.
    pub fn open(name: &str, region: NixlRegion, scratch: NixlScratch) -> Result<Self, NixlFailure> {
        library_loads()?;
        // The connector calls in from several threads at once (each connection's reader, the
        // push writers, decode's landings), and NIXL's default synchronisation takes no locks:
        // RW lets transfers run side by side and serialises what changes the agent's metadata.
        let config = AgentConfig { thread_sync: ThreadSync::Rw, ..AgentConfig::default() };
        let agent = call("create_agent", Agent::new_configured(name, &config))?;
        let (_, params) = call("get_plugin_params(UCX)", agent.get_plugin_params("UCX"))?;
        let backend = call("create_backend(UCX)", agent.create_backend("UCX", &params))?;
        let mut args = call("opt_args", OptArgs::new())?;
        call("opt_args.add_backend", args.add_backend(&backend))?;
        let registration = call("register_memory", agent.register_memory(&region, Some(&args)))?;
        let scratch_registration = call("register_memory", agent.register_memory(&scratch.region, Some(&args)))?;
        Ok(Self {
            _registration: registration,
            _scratch_registration: scratch_registration,
            scratch,
            backend,
            agent,
            region,
            set_aside: Default::default(),
            overdue: Default::default(),
        })
    }

    /// [`Self::open`] over a GPU engine's KV cache (VRAM), with a scratch on the same GPU, and
    /// the GPU's CUDA context made current on this thread. The caller keeps `memory` alive for
    /// as long as the endpoint.
    pub fn open_gpu(name: &str, memory: &tandem_compute::cuda::DeviceKvMemory) -> Result<Self, NixlFailure> {
        let cuda = |e: tandem_compute::cuda::CudaError| NixlFailure::Call { call: "CUDA", error: e.to_string() };
        memory.bind().map_err(cuda)?;
        let place = NixlPlace::Vram(memory.ordinal() as u32);
        let (addr, len) = memory.device_range();
        let scratch = memory.scratch(PROBE_BYTES).map_err(cuda)?;
        let (scratch_addr, scratch_len) = scratch.range();
        let scratch_region = NixlRegion { addr: scratch_addr as usize, len: scratch_len, place };
        let region = NixlRegion { addr: addr as usize, len, place };
        Self::open(name, region, NixlScratch::new(scratch_region, Box::new(scratch)))
    }

    /// Our region.
    pub fn region(&self) -> NixlRegion {
        self.region
    }

    /// Our scratch memory for [`Self::probe`]s (registered beside the KV; nobody reads it).
    pub fn scratch(&self) -> NixlRegion {
        self.scratch.region
    }

    /// What this link moves: [`PROBE_BYTES`] from our scratch into `peer`'s (`peer_scratch`),
    /// twice, the faster counted; GB/s. A transfer library that found no fast path falls back
    /// silently (UCX to its TCP emulation: 0.35 GB/s measured on a GPU machine), and this is
    /// how the connector notices before it moves any KV.
    pub fn probe(&self, peer: &str, peer_scratch: NixlRegion, bound: Duration) -> Result<f64, NixlFailure> {
        self.probe_op(XferOp::Write, peer, peer_scratch, bound)
    }

    /// [`Self::probe`] for READs from the peer's scratch into ours: what a pull moves at. UCX
    /// picks its path per operation, and READs can fall back where WRITEs do not (measured on
    /// one H200: GPU-memory WRITEs over cuda_ipc, READs over its TCP emulation).
    pub fn probe_read(&self, peer: &str, peer_scratch: NixlRegion, bound: Duration) -> Result<f64, NixlFailure> {
        self.probe_op(XferOp::Read, peer, peer_scratch, bound)
    }

    fn probe_op(&self, op: XferOp, peer: &str, peer_scratch: NixlRegion, bound: Duration) -> Result<f64, NixlFailure> {
        let len = PROBE_BYTES.min(peer_scratch.len).min(self.scratch.region.len);
        let run = [NixlRun { local_offset: 0, peer_offset: 0, len }];
        let mut best = 0f64;
        for _ in 0..2 {
            let start = Instant::now();
            self.transfer(op, self.scratch(), peer, peer_scratch, &run, None, bound)?;
            best = best.max(len as f64 / start.elapsed().as_secs_f64() / 1e9);
        }
        Ok(best)
    }

    /// This agent's metadata (connection info and registered memory), for the peer's
    /// [`Self::add_peer`].
    pub fn metadata(&self) -> Result<Vec<u8>, NixlFailure> {
        call("get_local_md", self.agent.get_local_md())
    }

    /// Loads a peer's metadata; returns its agent name, which [`Self::write`] addresses.
    pub fn add_peer(&self, metadata: &[u8]) -> Result<String, NixlFailure> {
        call("load_remote_md", self.agent.load_remote_md(metadata))
    }

    /// [`Self::metadata`] as hex, as it travels in a handshake or a line of text.
    pub fn metadata_hex(&self) -> Result<String, NixlFailure> {
        Ok(self.metadata()?.iter().map(|b| format!("{b:02x}")).collect())
    }

    /// [`Self::add_peer`] from [`Self::metadata_hex`]'s text.
    pub fn add_peer_hex(&self, hex: &str) -> Result<String, NixlFailure> {
        let bytes: Option<Vec<u8>> =
            (0..hex.len()).step_by(2).map(|i| hex.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok())).collect();
        let bytes = bytes.ok_or(NixlFailure::Call { call: "load_remote_md", error: "malformed metadata".into() })?;
        self.add_peer(&bytes)
    }

    /// Writes `runs` from our region into `peer`'s region `peer_region`, then, when given,
    /// delivers `notification` to it (after the data); returns when the write is complete, or
    /// fails after `bound`. Polls (yielding, then sleeping), so it belongs on a thread that may
    /// wait.
    pub fn write(
        &self,
        peer: &str,
        peer_region: NixlRegion,
        runs: &[NixlRun],
        notification: Option<&[u8]>,
        bound: Duration,
    ) -> Result<(), NixlFailure> {
        self.transfer(XferOp::Write, self.region, peer, peer_region, runs, notification, bound)
    }

    /// Reads `runs` from `peer`'s region `peer_region` into ours (each run's `peer_offset` the
    /// source, `local_offset` the destination); returns when the bytes are in our memory, or
    /// fails after `bound`.
    pub fn read(
        &self,
        peer: &str,
        peer_region: NixlRegion,
        runs: &[NixlRun],
        bound: Duration,
    ) -> Result<(), NixlFailure> {
        self.transfer(XferOp::Read, self.region, peer, peer_region, runs, None, bound)
    }

    /// One WRITE or READ between `ours` and the peer's region, polled to its end within `bound`.
    #[allow(clippy::too_many_arguments)]
    fn transfer(
        &self,
        op: XferOp,
        ours: NixlRegion,
        peer: &str,
        peer_region: NixlRegion,
        runs: &[NixlRun],
        notification: Option<&[u8]>,
        bound: Duration,
    ) -> Result<(), NixlFailure> {
        self.reap_overdue();
        let runs: Vec<&NixlRun> = runs.iter().filter(|r| r.len > 0).collect();
        if runs.is_empty() {
            // Nothing left to move (a push whose parts all went ahead of it): the notification
            // alone, which follows those parts, since each was complete before this call.
            if let Some(message) = notification {
                call("send_notification", self.agent.send_notification(peer, message, Some(&self.backend)))?;
            }
            return Ok(());
        }
        let mut local = call("xfer_dlist", XferDescList::new(ours.mem_type()))?;
        let mut remote = call("xfer_dlist", XferDescList::new(peer_region.mem_type()))?;
        let mut bytes = 0;
        for run in runs {
            local.add_desc(ours.at("local", run.local_offset, run.len)?, run.len, ours.device());
            remote.add_desc(peer_region.at("peer", run.peer_offset, run.len)?, run.len, peer_region.device());
            bytes += run.len;
        }
        let mut args = call("opt_args", OptArgs::new())?;
        call("opt_args.add_backend", args.add_backend(&self.backend))?;
        if let Some(message) = notification {
            call("set_has_notification", args.set_has_notification(true))?;
            call("set_notification_message", args.set_notification_message(message))?;
        }
        let req = call("create_xfer_req", self.agent.create_xfer_req(op, &local, &remote, peer, Some(&args)))?;
        let deadline = Instant::now() + bound;
        let mut done = !call("post_xfer_req", self.agent.post_xfer_req(&req, Some(&args)))?;
        let mut poll = Poll::new();
        while !done {
            if Instant::now() >= deadline {
                self.overdue.lock().unwrap_or_else(|p| p.into_inner()).push(req);
                return Err(NixlFailure::Timeout { peer: peer.to_string(), bytes, bound });
            }
            poll.pause();
            done = call("get_xfer_status", self.agent.get_xfer_status(&req))?.is_success();
        }
        Ok(())
    }

    /// Overdue writes NIXL has ended (done or failed) are released now.
    fn reap_overdue(&self) {
        let mut overdue = self.overdue.lock().unwrap_or_else(|p| p.into_inner());
        overdue.retain(|r| matches!(self.agent.get_xfer_status(r), Ok(XferStatus::InProgress)));
    }

    /// How many writes outlived their bound and are still in NIXL's hands.
    pub fn overdue_writes(&self) -> usize {
        self.reap_overdue();
        self.overdue.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Notifications that arrived since the last call, as (peer agent, message), leaving out
    /// any a [`Self::wait_notification`] has set aside.
    pub fn notifications(&self) -> Result<Vec<(String, Vec<u8>)>, NixlFailure> {
        let mut map = call("notif_map", NotificationMap::new())?;
        call("get_notifications", self.agent.get_notifications(&mut map, None))?;
        let taken = call("take_notifs", map.take_notifs())?;
        Ok(taken
            .into_iter()
            .flat_map(|(peer, msgs)| msgs.into_iter().map(move |m| (peer.clone(), m.into_bytes())))
            .collect())
    }

    /// Waits up to `bound` for `message` from `peer`; notifications for other waits that
    /// arrive meanwhile are kept for them (the most recent [`MAX_SET_ASIDE`]: a transfer that
    /// failed before its waiter came leaves its notification behind).
    pub fn wait_notification(&self, peer: &str, message: &[u8], bound: Duration) -> Result<(), NixlFailure> {
        let deadline = Instant::now() + bound;
        let mut poll = Poll::new();
        loop {
            {
                let mut aside = self.set_aside.lock().unwrap_or_else(|p| p.into_inner());
                aside.extend(self.notifications()?);
                if let Some(i) = aside.iter().position(|(p, m)| p == peer && m == message) {
                    aside.remove(i);
                    return Ok(());
                }
                let excess = aside.len().saturating_sub(MAX_SET_ASIDE);
                aside.drain(..excess);
            }
            if Instant::now() >= deadline {
                return Err(NixlFailure::NoNotification { peer: peer.to_string(), bound });
            }
            poll.pause();
        }
    }
}

/// The pauses between polls of a transfer or a notification (each poll also drives UCX's
/// progress): the first [`Poll::SPIN`] only yield, since a GPU-to-GPU transfer of a prompt's
/// KV ends within a few hundred microseconds and a sleep's granularity would be most of it;
/// then sleeps growing to a millisecond, so a long wait costs no core.
struct Poll {
    started: Instant,
    sleep: Duration,
}

impl Poll {
    const SPIN: Duration = Duration::from_millis(2);

    fn new() -> Self {
        Self { started: Instant::now(), sleep: Duration::from_micros(50) }
    }

    fn pause(&mut self) {
        if self.started.elapsed() < Self::SPIN {
            std::thread::yield_now();
        } else {
            std::thread::sleep(self.sleep);
            self.sleep = (self.sleep * 2).min(Duration::from_millis(1));
        }
    }
}

/// Whether `libnixl_capi.so` loads here: the stub API aborts the process when it does not, so
/// we ask first.
fn library_loads() -> Result<(), NixlFailure> {
    // SAFETY: loading NIXL's C API runs its initialisers, which have no preconditions; the
    // handle is dropped at once (the stub's own dlopen keeps the library loaded).
    unsafe { libloading::Library::new("libnixl_capi.so") }.map(drop).map_err(|e| {
        // libloading's message is "dlopen failed"; the loader's own reason is its source.
        let why = std::error::Error::source(&e).map_or_else(|| e.to_string(), |s| s.to_string());
        NixlFailure::Missing(why)
    })
}
