//! The vocabulary every tandem crate shares: request ids, sampling parameters, finish reasons.
//!
//! This crate holds plain data and validation only: no I/O, no threads, no model math. Types
//! here cross crate boundaries (server -> engine, engine -> server), so each one states its
//! invariants and is checked once, at the edge where it is built ([`SamplingParams::validate`]).
//!
//! Sibling crates: `tandem-compute` (CPU kernels and the paged KV storage), `tandem-model`
//! (loading and running transformers, tokenizers), `tandem-engine` (scheduler, block pool,
//! engine loop), `tandem-server` (the OpenAI HTTP API), `tandem-bench` (benchmarks) and the
//! `tandem` binary (wiring).
#![deny(missing_docs)]

mod api_keys;
mod cluster_secret;
mod ids;
mod kv_params;
mod sampling;

pub use api_keys::{ApiKeys, InvalidApiKey};
pub use cluster_secret::{
    constant_time_eq, hex, keyed, ClusterSecret, Mac, CLUSTER_CHALLENGE_HEADER, CLUSTER_TOKEN_HEADER, MAC_BYTES,
};
pub use ids::{BlockId, EngineId, Epoch, RequestId, TransferId};
pub use kv_params::{KvTransferParams, RemoteKv, TransferMode};
pub use sampling::{FinishReason, InvalidSampling, SamplingParams, TokenLogprobs, MAX_LOGPROBS};
