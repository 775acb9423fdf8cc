//! What the engine knows about one request, and what it sends back.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use tandem_core::{FinishReason, RemoteKv, RequestId, SamplingParams, TokenLogprobs, TransferId};
use tokio::sync::mpsc::UnboundedSender;

use crate::block_pool::{BlockAllocation, BlockHash};

/// A request as the engine accepts it: tokens, not text. Built by the server (or the CLI)
/// after validation; [`crate::EngineLimits::check`] repeats the checks that need engine facts.
#[derive(Clone, Debug)]
pub struct EngineRequest {
    /// Unique among in-flight requests.
    pub id: RequestId,
    /// The prompt's token ids.
    pub prompt_token_ids: Vec<u32>,
    /// How to sample and when to stop.
    pub params: SamplingParams,
    /// Its part in a disaggregated request, if any (from `kv_transfer_params`).
    pub remote: Option<RemoteKv>,
}

impl EngineRequest {
    /// An ordinary (colocated) request.
    pub fn new(id: RequestId, prompt_token_ids: Vec<u32>, params: SamplingParams) -> Self {
        Self { id, prompt_token_ids, params, remote: None }
    }
}

/// What the engine sends about a request.
#[derive(Clone, Debug, PartialEq)]
pub enum EngineEvent {
    /// Newly generated tokens; `finish` is set on the request's last event.
    Tokens {
        /// Token ids generated since the previous event.
        token_ids: Vec<u32>,
        /// Why the request ended, on its last event.
        finish: Option<FinishReason>,
        /// Each token's log-probabilities, when the request asked for them (else empty).
        logprobs: Vec<TokenLogprobs>,
    },
    /// The engine could not run the request; nothing more will come.
    Failed(String),
    /// The request waited in the queue past [`crate::EngineConfig::max_queue_time`] without
    /// running and was ended; nothing more will come. Nothing of it was computed, so it may be
    /// sent again (here later, or to another engine).
    QueueTimeout {
        /// How long it waited.
        waited_ms: u64,
        /// The bound.
        bound_ms: u64,
    },
    /// Decode leg: the prompt's KV arrived from prefill (sent just before the first token).
    KvLoaded {
        /// Where the time went.
        timeline: KvLoadTimeline,
    },
    /// Prefill leg: the prompt's KV was handed to the connector (sent just before the final
    /// `Tokens`). Pull-mode decode engines read these blocks.
    KvProduced {
        /// The attempt.
        transfer_id: TransferId,
        /// Blocks holding the KV, in token order.
        block_ids: Vec<u32>,
        /// Tokens of KV.
        num_tokens: usize,
        /// The token sampled after the prompt.
        first_token: u32,
    },
}

/// A decode leg's path to its first token, in microseconds from its arrival at the engine.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KvLoadTimeline {
    /// Waiting for KV blocks to allocate (arrival -> KV requested from prefill).
    pub queued_us: u64,
    /// The transfer, measured from when the KV was requested.
    pub transfer: tandem_kv::TransferTimeline,
    /// Arrival -> the engine applied the completion (the first token goes out now).
    pub ready_us: u64,
    /// Push: from the prefill engine handing the KV over (its last step's end) to this engine
    /// applying the completion, by the two engines' wall clocks: meaningful on one host only.
    #[serde(default)]
    pub produced_to_ready_us: Option<u64>,
}

/// How an engine with prefix caching keys its blocks.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PrefixKeys {
    /// What the first block's key chains from (a hash of the model's fingerprint).
    pub salt: u128,
    pub block_size: usize,
}

/// Where a live request is. Finished requests leave the engine at once (their blocks with
/// them), so there is no finished state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RequestStatus {
    /// Queued; holds no blocks. Preempted requests come back here and recompute.
    Waiting,
    /// Scheduled each step until it finishes; holds blocks for its computed tokens.
    Running,
    /// Decode leg: its blocks are allocated and the connector is filling them with the
    /// prompt's KV from a prefill engine. Never scheduled; leaves this state on the connector's
    /// `Ready` (to running), `Failed` (recompute or fail) or, after an abort, `Released`.
    WaitingForRemoteKvs,
}

/// The engine's record of a live request.
pub(crate) struct Request {
    pub id: RequestId,
    /// Unique over the engine's life (ids may be reused once a request ends).
    pub serial: u64,
    /// Prompt followed by the tokens generated so far.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Tokens whose keys and values are in the cache (`<= tokens.len()`).
    pub num_computed: usize,
    pub params: SamplingParams,
    /// The request's own random stream, so sampling does not depend on other requests.
    pub rng: ChaCha8Rng,
    pub blocks: BlockAllocation,
    pub events: UnboundedSender<EngineEvent>,
    pub status: RequestStatus,
    pub num_preemptions: u32,
    pub remote: Option<RemoteKv>,
    /// When the engine accepted the request, and when it asked for remote KV.
    pub arrived: std::time::Instant,
    pub kv_requested: Option<std::time::Instant>,
    /// Prefix caching: the keys of its full blocks of known tokens, made as they fill, and how
    /// many of its blocks are registered in the pool's cache.
    pub block_keys: Vec<BlockHash>,
    pub num_registered: usize,
}

impl Request {
    /// Still queued as it arrived: nothing computed, never preempted, no KV load begun.
    pub fn never_ran(&self) -> bool {
        self.status == RequestStatus::Waiting
            && self.num_computed == 0
            && self.num_preemptions == 0
            && self.kv_requested.is_none()
    }

    pub fn new(req: EngineRequest, blocks: BlockAllocation, events: UnboundedSender<EngineEvent>) -> Self {
        let rng = match req.params.seed {
            Some(seed) => ChaCha8Rng::seed_from_u64(seed),
            None => ChaCha8Rng::from_os_rng(),
        };
        Self {
            id: req.id,
            serial: 0,
            prompt_len: req.prompt_token_ids.len(),
            tokens: req.prompt_token_ids,
            num_computed: 0,
            params: req.params,
            rng,
            blocks,
            events,
            status: RequestStatus::Waiting,
            num_preemptions: 0,
            remote: req.remote,
            arrived: std::time::Instant::now(),
            kv_requested: None,
            block_keys: Vec::new(),
            num_registered: 0,
        }
    }

    /// Extends `block_keys` over its full blocks of known tokens (a token sampled on the device
    /// but not yet seen here ends them).
    pub fn extend_block_keys(&mut self, keys: PrefixKeys) {
        // Only the tail can hold carried tokens: look past the blocks already keyed.
        let from = (self.block_keys.len() * keys.block_size).min(self.tokens.len());
        let known = self.tokens[from..]
            .iter()
            .position(|&t| tandem_model::carried_row(t).is_some())
            .map_or(self.tokens.len(), |i| from + i);
        BlockHash::extend_chain(keys.salt, &mut self.block_keys, &self.tokens[..known], keys.block_size);
    }

    /// Registers its full computed blocks in the pool's prefix cache.
    pub fn register_computed_blocks(&mut self, keys: PrefixKeys) {
        let full = (self.num_computed / keys.block_size).min(self.blocks.len());
        if full <= self.num_registered {
            return;
        }
        self.extend_block_keys(keys);
        let upto = full.min(self.block_keys.len());
        for i in self.num_registered..upto {
            self.blocks.register(i, self.block_keys[i]);
        }
        self.num_registered = self.num_registered.max(upto);
    }

    pub fn num_output_tokens(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
}
