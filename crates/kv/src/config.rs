//! How a connector is set up.

use std::time::Duration;

use tandem_core::EngineId;

use crate::agent_info::{KvMode, Role};
use crate::channel::Timeouts;

/// Fault injection for tests of the failure paths (off in production).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FaultInjection {
    /// Prefill sends push data but never the completion notification.
    pub drop_done: bool,
    /// A tensor-parallel prefill engine whose ranks each write their heads sends every rank's
    /// push completion but this rank's, as a rank whose notification is lost.
    pub drop_done_of_rank: Option<u32>,
    /// Prefill waits this long before each push write and each pull read it answers, as a slow
    /// link or copy engine would make it (the blocks stay held, and a lease being read stays
    /// alive, meanwhile).
    pub slow_write: std::time::Duration,
    /// Decode's agent ignores the engine's requests for KV and never answers them, as a stuck
    /// or dead agent thread would.
    pub silent_agent: bool,
    /// The sender flips one bit of the first byte of every bulk send after checksumming it,
    /// as a bad NIC, buffer or staging copy would (a direct writer: of the first block it
    /// copied into, after the copy).
    pub corrupt_sends: bool,
    /// Every copy a tcp transfer makes between a GPU engine's device cache and its host copy
    /// fails, as a device error would (on a CPU engine the same points fail).
    pub fail_host_copies: bool,
    /// The nixl writer sends no NIXL notification after the writes of its first this many
    /// transfers on a connection, as a lost one would: the reader gives up on each after its I/O
    /// bound (`u32::MAX`: every one).
    pub drop_nixl_notifications: u32,
    /// The engine's first send striped over several tcp streams shuts one of its connection's
    /// further streams down first, as a dropped TCP connection would.
    pub cut_a_stream: bool,
}

/// Which transports a connector may move KV bytes over.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvTransport {
    /// The fastest both ends offer: cuda-ipc between GPU engines of one host (on one GPU, or
    /// two with peer access), else tcp; the handshake logs why cuda-ipc was not possible.
    #[default]
    Auto,
    /// Bytes over the side channel only.
    Tcp,
    /// Device-to-device copies only (no host copy of the KV cache is kept); a peer that cannot
    /// use them is refused at handshake, saying why.
    CudaIpc,
    /// NIXL WRITEs into the peer's registered KV memory, host or GPU (builds with the `nixl`
    /// feature); a peer that cannot use it is refused at handshake, saying why.
    Nixl,
}

/// Who moves a pull's KV over NIXL (`--kv-nixl-pull`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum NixlPull {
    /// Decode READs, where prefill's probe READ from decode at handshake runs at least
    /// `--kv-nixl-min-gb-s`; otherwise prefill WRITEs (UCX may serve READs of GPU memory
    /// through its TCP emulation while WRITEs take cuda_ipc: measured on one H200).
    #[default]
    Auto,
    /// Decode READs prefill's blocks, as the seed system does.
    Read,
    /// Prefill WRITEs decode's blocks (with a notification), as in push.
    Write,
}

impl KvTransport {
    /// As `--kv-transport` spells it.
    pub fn name(self) -> &'static str {
        match self {
            KvTransport::Auto => "auto",
            KvTransport::Tcp => "tcp",
            KvTransport::CudaIpc => "cuda-ipc",
            KvTransport::Nixl => "nixl",
        }
    }
}

impl std::str::FromStr for KvTransport {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(KvTransport::Auto),
            "tcp" => Ok(KvTransport::Tcp),
            "cuda-ipc" => Ok(KvTransport::CudaIpc),
            "nixl" => Ok(KvTransport::Nixl),
            other => Err(format!("unknown KV transport `{other}` (auto, tcp, cuda-ipc or nixl)")),
        }
    }
}

/// How the connector is set up.
#[derive(Clone, Debug)]
pub struct ConnectorConfig {
    /// This engine's id.
    pub engine_id: EngineId,
    /// Prefill or decode.
    pub role: Role,
    /// Push or pull.
    pub mode: KvMode,
    /// Where the side channel listens, `host:port` (port 0 picks one).
    pub listen: String,
    /// Host peers should connect to (what the router advertises).
    pub advertise_host: String,
    /// Identifies the model's weights; peers with another fingerprint are refused.
    pub model_fingerprint: String,
    /// Socket timeouts.
    pub timeouts: Timeouts,
    /// Pull: how long prefill holds a finished request's blocks without a heartbeat.
    pub lease: Duration,
    /// Decode: longest wait for a request's KV. Push prefill: longest wait for a registration.
    pub transfer_timeout: Duration,
    /// A peer that sends nothing for this long is dead: its connection closes and what waits on
    /// it fails (or, for a direct writer, ends after one more I/O timeout). Both ends send a
    /// heartbeat every third of it.
    pub liveness: Duration,
    /// Test-only failure switches.
    pub faults: FaultInjection,
    /// Offer (and use, when the peer offers it too) direct copies between engines of this
    /// process instead of TCP bytes.
    pub local_transport: bool,
    /// Which transports bulk KV may use with engines of other processes.
    pub transport: KvTransport,
    /// `--kv-verify`: every bulk send over tcp carries a CRC-32 of its bytes, checked where they
    /// land; a mismatch fails the transfer (counted as `checksum_failures`), which the decode
    /// engine recomputes or fails by its `--kv-load-failure` policy. Both ends of a pair must
    /// agree (checked at handshake). Direct copies (local, cuda-ipc) cross no socket and are not
    /// checksummed.
    pub verify: bool,
    /// `--kv-tcp-streams`: TCP connections per peer that tcp bulk bytes are striped over (a
    /// pair uses the smaller of its two ends' counts; 1: the side channel alone). One stream
    /// tops out near 3 GB/s on a loopback; several keep up with a GPU's prefill.
    pub tcp_streams: usize,
    /// `--kv-stage-ahead`: a GPU engine's push over tcp queues the copies of every group of
    /// layers of a step still computing to the host copy at once, each behind its group's fence
    /// on the device, so that one group's copy overlaps the socket send of the group before it
    /// (off: each group is copied once the one before has gone).
    pub stage_ahead: bool,
    /// Tensor-parallel ranks of the engine whose KV this connector moves, said at handshake.
    /// Every rank's KV heads lie in one region laid out as a one-rank engine's, so engines of
    /// any rank counts pair; over tcp a push writes each rank's heads as writes of their own,
    /// with a `Done` each, which decode counts.
    pub tp_size: u32,
    /// `--kv-nixl-min-gb-s`: a nixl link whose probe write runs slower than this is refused at
    /// handshake, naming the rate (0: accept any); a pull link whose probe READ does is served
    /// by prefill's writes ([`NixlPull::Auto`]).
    pub nixl_min_gb_s: f64,
    /// `--kv-nixl-pull`: who moves a pull's KV over NIXL (prefill decides, per link).
    pub nixl_pull: NixlPull,
    /// nixl: where UCX's log was redirected (by the binary, before any thread started), for the connector
    /// to read back the transports UCX chose and relay its warnings (`None`: UCX logs as its
    /// user set it).
    pub ucx_log: Option<std::path::PathBuf>,
    /// `--cluster-secret-file`: peers must prove they hold it (a mutual challenge-response at
    /// handshake, then every frame authenticated, [`crate::seal`]); `None`: any peer that
    /// reaches the side channel and pairs is taken.
    pub cluster_secret: Option<tandem_core::ClusterSecret>,
    /// `--tls-cert`, `--tls-key`, `--tls-ca`: the side channel and its further streams run
    /// over TLS, each end presenting its certificate and verifying the peer's against the CA;
    /// `None`: plain TCP.
    pub tls: Option<crate::stream::KvTls>,
}
