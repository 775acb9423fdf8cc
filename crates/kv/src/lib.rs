//! The KV connector: how a prefill engine and a decode engine move a request's KV cache.
//!
//! # Brief overview
//! This crate grows in layers. Present now:
//! - [`wire`]: the side-channel messages (handshake, register, done, failed, heartbeat, abort,
//!   bulk block data) and their length-prefixed framing, with a protocol version checked
//!   first.
//! - [`AgentInfo`]: what an engine tells a peer at handshake, and [`AgentInfo::check_pairing`],
//!   which refuses incompatible peers naming the field that differs.
//! - [`blocks`]: block lists as contiguous runs (a request's KV moves as a few large copies)
//!   and the scatter between different block sizes.
//! - [`tcp`]: bounded connect/read/write, the handshake, and block bytes straight between a
//!   socket and the shared KV memory (`tandem_compute::KvRegion`).
//!
//! Coming next (issue 3): the background agent thread that owns transfer state (push
//! rendezvous, pull leases), the engine-side hooks, and the `local` transport.
//!
//! This crate never runs on the engine loop: the engine only enqueues work for the agent and
//! polls for results.
#![deny(missing_docs)]

mod agent_info;
pub mod blocks;
mod error;
pub mod tcp;
pub mod wire;

pub use agent_info::{AgentInfo, Incompatible, KvMode, Role, TransportOffer};
pub use error::KvError;
