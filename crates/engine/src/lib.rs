//! The tandem engine: turns queued requests into tokens, many at a time.
//!
//! # Brief overview
//! [`spawn`] starts the engine loop on its own thread and returns an [`EngineHandle`]. A
//! caller [`submit`](EngineHandle::submit)s an [`EngineRequest`] (token ids plus
//! [`SamplingParams`](tandem_core::SamplingParams)) and reads [`EngineEvent`]s from the
//! returned [`RequestStream`]; dropping the stream aborts the request.
//!
//! Each step of the loop: the scheduler picks tokens for running and waiting requests within
//! a token budget (continuous batching, chunked prefill, preemption by recompute), the model
//! runs one batched forward over the paged KV cache, the sampler picks tokens, events go out.
//! With async scheduling (GPUs), the next step is planned and submitted before the current
//! one's tokens reach the host, so the device never waits for the engine thread.
//! KV blocks are owned by values that return them on drop ([`BlockAllocation`]), so after any
//! run the free-block count returns to its starting value.
//!
//! This crate does not tokenize, detokenize or match stop strings: it sees token ids only.
//! Text lives in `tandem-server` (and `tandem-model`'s tokenizer). See README.md beside this
//! crate for a reading order.
#![deny(missing_docs)]

mod block_pool;
mod core;
mod handle;
mod request;
mod scheduler;

pub use block_pool::{BlockAllocation, BlockHash, BlockPool, NoFreeBlocks, PrefixCacheStats};
pub use core::{
    EngineCore, EngineLimits, EngineModel, KvLoadFailure, KvSetup, PrefixProbe, RequestRejected, StepReport,
};
pub use handle::{spawn, spawn_with, EngineHandle, EngineStats, RequestStream, StatsSnapshot, SubmitError};
pub use request::{EngineEvent, EngineRequest, KvLoadTimeline};
pub use scheduler::{ScheduledChunk, SchedulerOutput};

/// How an engine is sized. Resolved once from the command line (the KV block count already
/// computed from memory) and handed to [`spawn`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks in the pool.
    pub num_blocks: usize,
    /// Most requests running at once.
    pub max_num_seqs: usize,
    /// Most tokens in one step (prefill chunks plus decode tokens).
    pub max_num_batched_tokens: usize,
    /// Plan and submit each step before the previous one's tokens reach the host, where the
    /// model runner can (the CUDA one): the device never waits for the engine thread between
    /// decode steps. A request that stops on a stop token costs one discarded forward.
    pub async_scheduling: bool,
    /// Ends a request still queued this long after it arrived without having run (a prefill
    /// not begun, a decode leg whose KV load has not started) with [`EngineEvent::QueueTimeout`]
    /// (the server answers 503 with `Retry-After`): past capacity, a client hears at a bounded
    /// time that it was not served, instead of waiting behind a backlog. `None`: no bound.
    pub max_queue_time: Option<std::time::Duration>,
    /// Prefix caching: full blocks of computed KV stay cached (keyed by their tokens and every
    /// token before them) until their blocks are needed, and a prompt that begins with cached
    /// blocks computes only the rest (see [`BlockPool`]).
    pub prefix_caching: bool,
}

impl EngineConfig {
    /// Blocks that fit in `bytes` of KV cache memory for a model with `kv_bytes_per_token`.
    pub fn blocks_for_memory(bytes: usize, block_size: usize, kv_bytes_per_token: usize) -> usize {
        bytes / (block_size * kv_bytes_per_token).max(1)
    }

    /// Checks the sizes are usable.
    pub fn validate(&self) -> Result<(), String> {
        if self.block_size == 0 {
            return Err("--block-size must be at least 1".into());
        }
        if self.num_blocks == 0 {
            return Err("the KV cache has no blocks: raise --kv-cache-memory or --num-kv-blocks".into());
        }
        if self.max_num_seqs == 0 {
            return Err("--max-num-seqs must be at least 1".into());
        }
        if self.max_num_batched_tokens == 0 {
            return Err("--max-num-batched-tokens must be at least 1".into());
        }
        Ok(())
    }
}
