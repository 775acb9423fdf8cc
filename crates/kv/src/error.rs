//! Errors of the KV connector.

use crate::agent_info::Incompatible;

/// What can go wrong moving KV between engines. Every variant ends the transfer it concerns;
/// none of them may take an engine down.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KvError {
    /// A socket failed or a bounded wait ran out (`TimedOut` / `WouldBlock`).
    #[error("kv side channel I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The peer could not be reached.
    #[error("cannot reach KV peer at {addr}: {reason}")]
    Unreachable {
        /// Where we tried.
        addr: String,
        /// The OS error.
        reason: String,
    },
    /// The peer sent something that breaks the protocol.
    #[error("kv protocol error: {0}")]
    Protocol(String),
    /// The two engines cannot pair (checked at handshake).
    #[error("incompatible KV peer: {0}")]
    Incompatible(#[from] Incompatible),
    /// The peer refused the handshake.
    #[error("KV peer refused the handshake: {0}")]
    Refused(String),
    /// This engine cannot take part in KV transfer as configured.
    #[error("KV transfer unsupported: {0}")]
    Unsupported(String),
    /// The bytes that arrived are not the bytes that were sent (`--kv-verify`): the transfer
    /// fails, and the connection stays usable.
    #[error("{0}")]
    Corrupt(String),
    /// A peer or a frame failed authentication with the cluster secret (a handshake without
    /// the secret or with another one, a replayed handshake, a forged or altered frame): the
    /// connection ends.
    #[error("KV peer not authenticated: {0}")]
    Unauthenticated(String),
    /// A transfer failed on the peer's side.
    #[error("transfer failed: {0}")]
    Transfer(String),
}

impl KvError {
    /// Whether a bounded wait ran out.
    pub fn is_timeout(&self) -> bool {
        matches!(self, KvError::Io(e) if matches!(e.kind(), std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock))
    }
}
