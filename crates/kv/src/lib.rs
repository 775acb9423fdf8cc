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
//! - [`KvConnector`]: the engine's handle (hooks in, events out) on the background agent
//!   that owns all transfer state: push rendezvous in either order, pull leases with
//!   heartbeats, deadlines on everything, dead-peer detection.
//!
//! This crate never runs on the engine loop: the engine only enqueues work for the agent and
//! receives its events on its own input channel.
#![deny(missing_docs)]

mod agent;
mod agent_info;
pub mod blocks;
mod config;
mod connector;
mod error;
mod events;
mod memory;
#[cfg(feature = "nixl")]
pub mod nixl;
pub mod tcp;
pub mod ucx_log;
pub mod wire;

pub use agent_info::{AgentInfo, Incompatible, KvMode, Role, TransportOffer};
pub use config::{ConnectorConfig, FaultInjection, KvTransport, NixlPull};
pub use connector::KvConnector;
pub use connector::KvView;
pub use error::KvError;
pub use events::{ConnectorEvent, ConnectorStats, EventSink, HeldBlocks, KvLink, TransferTimeline};
pub use memory::{KvMemory, StagedReceive, StagedSend};
pub use tandem_compute::cuda::KvFences;
