//! What the connector hands the engine: blocks it holds, and the events it reports.

use tandem_core::RequestId;

/// Blocks handed to the connector: dropping the box returns them to the engine's pool.
pub type HeldBlocks = Box<dyn Send>;

/// What the connector tells the engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConnectorEvent {
    /// The request's KV is in its blocks, in the engine's cache itself (a GPU engine's device
    /// cache included: a transport that lands bytes in the host copy loads them before this).
    Ready {
        /// The request.
        request_id: RequestId,
        /// The first token prefill sampled.
        first_token: Option<u32>,
        /// When each stage happened.
        timeline: TransferTimeline,
    },
    /// The KV will not come; no write to the request's blocks can land any more.
    Failed {
        /// The request.
        request_id: RequestId,
        /// Why.
        reason: String,
    },
    /// The KV will not come, but a direct writer (cuda-ipc, local) may still have a copy into
    /// the request's blocks in flight until `writes_until` (its connection was lost, or the
    /// transfer timed out, while the write could be running): the engine keeps those blocks
    /// out of use until then and recomputes (or fails) the request in others, at once rather
    /// than after the wait.
    FailedInFlight {
        /// The request.
        request_id: RequestId,
        /// Why.
        reason: String,
        /// No write can land in the blocks after this.
        writes_until: std::time::Instant,
    },
    /// The abort is complete; the request's blocks may be freed.
    Released {
        /// The request.
        request_id: RequestId,
    },
    /// The prefill engine refused to pair at handshake (or we refused it); nothing was written.
    Refused {
        /// The request.
        request_id: RequestId,
        /// What differs, naming the field.
        reason: String,
    },
}

/// One decode-side transfer, stage by stage, in microseconds since the engine asked for the
/// KV (`expect`). In push mode prefill starts writing as soon as its prompt is done (decode
/// registered earlier), so `data_start_us` is also when prefill finished, on decode's clock.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TransferTimeline {
    /// Registration (push) or read request (pull) sent to prefill.
    pub request_sent_us: u64,
    /// First KV bytes arrived.
    pub data_start_us: u64,
    /// All KV bytes in place.
    pub data_end_us: u64,
    /// Completion seen; the request can decode.
    pub ready_us: u64,
    /// KV bytes moved.
    pub bytes: u64,
    /// Contiguous block regions written.
    pub regions: u32,
    /// Push: when the prefill engine handed this KV over, on prefill's wall clock (Unix
    /// microseconds; 0 when not known). Against the decode engine's clock on one host it times
    /// prefill's last step -> KV ready at decode.
    #[serde(default)]
    pub produced_unix_us: u64,
    /// Push: of the wait from that hand-over to the KV being ready, how long prefill's writer
    /// was still sending what earlier steps had computed (the rest is the final write, its
    /// completion and this engine's copies).
    #[serde(default)]
    pub handover_backlog_us: u64,
}

/// One open side-channel connection and the transport its bytes take (for `/kv/info`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct KvLink {
    /// The peer engine's id.
    pub peer: String,
    /// `tcp`, `local` or `cuda-ipc`.
    pub transport: String,
    /// Why a faster transport both ends offer is not used, if one is not.
    pub note: Option<String>,
}

/// Counters for `/metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConnectorStats {
    /// Transfers completed (either side; prefill counts a tcp push when decode acknowledges
    /// its bytes and a pull read when decode's release says it landed).
    pub transfers_ok: u64,
    /// Transfers failed (either side; on prefill also the writes and reads decode found bad).
    pub transfers_failed: u64,
    /// Bulk bytes sent.
    pub bytes_sent: u64,
    /// Bulk bytes received.
    pub bytes_received: u64,
    /// Contiguous block regions moved.
    pub regions: u64,
    /// Leases (pull) or registrations/produced KV (push) that expired and were reclaimed.
    pub expired: u64,
    /// Messages naming a transfer this engine does not know (late, finished or bogus).
    pub unknown_ids: u64,
    /// Transfer ids seen twice.
    pub duplicate_ids: u64,
    /// Handshakes refused (either side): peers of another model, mode or KV shape.
    pub peers_refused: u64,
    /// Bulk sends whose bytes did not match the sender's checksum (`--kv-verify`).
    pub checksum_failures: u64,
    /// Connections opened over tcp.
    pub links_tcp: u64,
    /// Connections opened over the in-process local transport.
    pub links_local: u64,
    /// Connections opened over cuda-ipc.
    pub links_cuda_ipc: u64,
    /// Connections opened over nixl.
    pub links_nixl: u64,
    /// Prefill, push: parts of a prompt's KV written into decode's blocks (or sent on the side
    /// channel) while later chunks of the prompt were still being computed.
    pub parts_early: u64,
    /// Decode, push over tcp: groups of layers that landed (a step's KV sent group by group
    /// while its later layers computed), not counting writes of all layers.
    pub groups_landed: u64,
    /// Decode, over tcp from a tensor-parallel prefill engine: its ranks' completions (push:
    /// each rank's `Done`) and answers (pull: each rank's `BlockData`), each rank having moved
    /// its own KV heads (a transfer counts one a rank).
    pub rank_notices: u64,
    /// Further TCP streams of tcp connections (`--kv-tcp-streams` above 1), opened or joined:
    /// bulk bytes are striped over a connection and its further streams.
    pub streams_joined: u64,
    /// Peers, streams and frames refused for the cluster secret (`--cluster-secret-file`):
    /// handshakes without it or with another, joins without the connection's proof, frames
    /// whose tag did not check (each ends its connection).
    pub auth_refused: u64,
}

/// Where the connector delivers its events, as they happen, from its own threads: the engine
/// puts them on its input channel. It must not block.
pub type EventSink = Box<dyn Fn(ConnectorEvent) + Send + Sync>;
