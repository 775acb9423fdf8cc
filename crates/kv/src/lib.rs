//! The KV connector: how a prefill engine and a decode engine move a request's KV cache.
//!
//! # Brief overview
//! [`KvConnector`] is the engine's handle (hooks in, events out) on a background agent that
//! owns all transfer state: push rendezvous in either order, pull leases with heartbeats,
//! deadlines on everything, dead-peer detection. The crate is built in layers that import only
//! downward (README.md draws them):
//! - [`KvConnector`] at the top edge, and the agent's threads under it, which own the sockets;
//! - the two protocols, push and pull, as rules over the transfer table with no I/O of their
//!   own, and the table itself (transfers, leases, deadlines, tombstones);
//! - one `Transport` per connection at the bottom edge (tcp, local, cuda-ipc, nixl), which
//!   moves block runs and knows nothing of transfers; [`tcp`] holds the socket data path;
//! - [`channel`] (bounded sockets, the handshake), [`seal`] (a cluster secret's
//!   challenge-response and authenticated frames), [`stream`] (plain TCP or TLS), [`wire`] (messages and framing, with a
//!   protocol version checked first), [`AgentInfo`] (what an engine says at handshake, and
//!   [`AgentInfo::check_pairing`]), [`blocks`] (block runs, re-layout between block sizes).
//!
//! This crate never runs on the engine loop: the engine only enqueues work for the agent and
//! receives its events on its own input channel.
#![deny(missing_docs)]

mod agent;
mod agent_info;
pub mod blocks;
pub mod channel;
mod config;
mod connector;
mod error;
mod events;
mod memory;
#[cfg(feature = "nixl")]
pub mod nixl;
mod protocol;
pub mod seal;
pub mod stream;
mod table;
mod tls_pipes;
mod tls_records;
mod transport;
pub mod ucx_log;
pub mod wire;

pub use transport::tcp;

pub use agent_info::{AgentInfo, Incompatible, KvMode, Role, TransportOffer};
pub use config::{ConnectorConfig, FaultInjection, KvTransport, NixlPull};
pub use connector::KvConnector;
pub use connector::KvView;
pub use error::KvError;
pub use events::{ConnectorEvent, ConnectorStats, EventSink, HeldBlocks, KvLink, TransferTimeline};
pub use memory::{KvMemory, StagedReceive, StagedSend};
pub use tandem_compute::cuda::KvFences;
