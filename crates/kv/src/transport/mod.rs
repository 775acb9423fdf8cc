//! How a transfer's bytes move once the protocol has said where from and where to.
//!
//! One [`Transport`] per connection, picked at handshake ([`pick`]). A transport moves block
//! runs between this engine's KV memory and the peer's, and knows nothing of transfers'
//! states, leases or messages other than the bytes it is handed: the protocol (`crate::protocol`)
//! decides what moves, the agent's threads call the transport and send the messages.
//!
//! Two families:
//! - inline ([`tcp`]): the bytes ride the side channel right after the frame that announces
//!   them ([`Announce`]); the reader takes them off its socket ([`Transport::receive`]) and
//!   acknowledges the write.
//! - direct ([`local`], [`cuda_ipc`], [`nixl`]): the writer puts the bytes straight into the
//!   reader's memory, with nothing on the socket and no call into the reader's table; the reader
//!   treats its blocks as being written from the moment it names them until the writer says the
//!   write ended, and confirms the landing itself where the network can lose it (a NIXL
//!   notification, [`Transport::confirm_landed`]).
//!
//! A new transport: an offer in `agent_info.rs`, a file here implementing [`Transport`], and
//! its cases in `pick.rs`.
//!
//! Layer: under `agent`, beside `protocol` (neither calls the other). Owns each connection's
//! means of moving bytes (mapped peer memory, NIXL endpoints, the local registry); calls `channel`
//! (its types), `memory`, `blocks`, `agent_info`, `config`, `error` and `tandem_compute`'s copies.

pub(crate) mod cuda_ipc;
pub(crate) mod local;
pub(crate) mod nixl;
pub(crate) mod pick;
pub(crate) mod stripes;
pub mod tcp;

use std::io::{Read, Write};
use std::time::Duration;

use tandem_compute::cuda::KvFences;
use tandem_compute::KvLayout;
use tandem_core::TransferId;

use crate::agent_info::AgentInfo;
use crate::blocks::KvSlice;
use crate::channel::Timeouts;
use crate::config::FaultInjection;
use crate::error::KvError;
use crate::memory::KvMemory;

/// What every transport of an engine works with: its KV memory and the settings that shape a
/// copy (checksums, injected faults, the I/O bound).
#[derive(Clone)]
pub(crate) struct Ours {
    pub memory: KvMemory,
    /// `--kv-verify`: inline bytes carry a CRC-32.
    pub verify: bool,
    pub faults: FaultInjection,
    /// `--kv-stage-ahead`: a GPU engine's tcp sends queue every group of layers' copies to the
    /// host copy at once, each behind its group's fence on the device.
    pub stage_ahead: bool,
    /// Bounds NIXL's waits.
    #[cfg_attr(not(feature = "nixl"), allow(dead_code))]
    pub timeouts: Timeouts,
}

/// What one write moves: tokens `0..num_tokens` of the writer's blocks `src` into the reader's
/// blocks `dst` (both in token order, each in its own engine's block size).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Runs<'a> {
    pub src: &'a [u32],
    pub dst: &'a [u32],
    pub num_tokens: usize,
    /// The writer's tensor-parallel ranks, each of which writes its own KV heads over an inline
    /// transport ([`Transport::writes_per_rank`]); 1: every head at once.
    pub ranks: usize,
}

impl<'a> Runs<'a> {
    /// Every head at once.
    pub fn whole(src: &'a [u32], dst: &'a [u32], num_tokens: usize) -> Self {
        Self { src, dst, num_tokens, ranks: 1 }
    }
}

/// How an inline transport's bytes were announced on the side channel: in which block size,
/// how many, whether their checksum follows them, which part of the blocks they carry (all; a
/// group of layers of a step still computing; a rank's heads), and which of the writer's
/// tensor-parallel ranks writes them.
#[derive(Clone, Debug)]
pub(crate) struct Bulk {
    pub src_block_size: usize,
    pub bytes: u64,
    pub checksum: bool,
    pub slice: KvSlice,
    pub rank: usize,
    pub ranks: usize,
    /// Streams the bytes are striped over (set by the announcement: the connection's count).
    pub streams: usize,
}

/// Where an inline transport's bytes go: the caller writes the frame that announces them (it
/// knows the message and the connection's streams; the transport knows how many bytes and
/// whether a checksum follows) and hands back the streams they follow on, the one the frame
/// went on first, striped over them all ([`tcp::send_striped`]) when there are several, held
/// for the caller's completion frame after them.
pub(crate) trait Announce {
    /// Writes the announcing frame; the bytes follow on the returned streams, each (when there
    /// are several) on a thread of the returned crew.
    fn announce(&mut self, bulk: Bulk) -> Result<Announced<'_>, KvError>;
}

/// The streams an announced write's bytes go on, and the threads that carry them.
pub(crate) type Announced<'a> = (Vec<&'a mut (dyn Write + Send)>, &'a stripes::Crew);

/// For direct transports, which never announce bytes on the side channel.
pub(crate) struct NoAnnounce;

impl Announce for NoAnnounce {
    fn announce(&mut self, _: Bulk) -> Result<Announced<'_>, KvError> {
        Err(KvError::Protocol("a direct transport announced bytes on the side channel".into()))
    }
}

/// Why a write did not move its KV.
#[derive(Debug)]
pub(crate) enum WriteError {
    /// Nothing reached the peer, or a copy into its memory failed: the connection is in step,
    /// and the caller tells the peer in-band.
    Failed(String),
    /// The side channel broke mid-send (inline): the connection is done.
    Channel(KvError),
}

impl From<KvError> for WriteError {
    fn from(e: KvError) -> Self {
        WriteError::Channel(e)
    }
}

impl std::fmt::Display for WriteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WriteError::Failed(why) => f.write_str(why),
            WriteError::Channel(e) => e.fmt(f),
        }
    }
}

/// Moves KV between this engine's blocks and one peer's.
pub(crate) trait Transport: Send + Sync {
    /// The offer's name, for logs and `/kv/info`.
    fn name(&self) -> &'static str;

    /// Whether the writer puts the bytes straight into the reader's memory (direct), rather than
    /// on the side channel (inline).
    fn writes_directly(&self) -> bool {
        false
    }

    /// Whether a tensor-parallel writer's ranks each write their own heads
    /// ([`Runs::ranks`]), with a `Done` each; else one write moves every rank's heads.
    fn writes_per_rank(&self) -> bool {
        false
    }

    /// Whether the reader acknowledges each push write (`WriteAck`, inline): the writer counts
    /// the write's outcome then, once the reader has checked the bytes.
    fn acknowledges_writes(&self) -> bool {
        false
    }

    /// Writer: moves `runs`, each group of layers once `fences` say it is final, and waits for
    /// the copies. A direct transport copies into the peer's memory and, given `landed`, makes
    /// the transfer's landing known to the peer's transport after the bytes (a NIXL
    /// notification); an inline one puts the bytes on the side channel through `out`.
    fn write(
        &self,
        runs: Runs<'_>,
        fences: &KvFences,
        landed: Option<&TransferId>,
        out: &mut dyn Announce,
    ) -> Result<(), WriteError>;

    /// Reader, inline: takes the bytes `bulk` announced off `streams.0` (the one the frame came
    /// on first; `bulk.streams` of them, each when there are several on a thread of the crew
    /// `streams.1`) into tokens `0..num_tokens` of our blocks `dst` (a GPU engine's device cache
    /// included, before this returns). `Corrupt` and `Transfer` errors leave the streams in
    /// step; others do not.
    ///
    /// # Safety
    /// The caller owns `dst` exclusively while this runs (a transfer's destination, not yet
    /// reported).
    unsafe fn receive(
        &self,
        streams: (&mut [&mut (dyn Read + Send)], &stripes::Crew),
        bulk: Bulk,
        dst: &[u32],
        num_tokens: usize,
    ) -> Result<(), KvError> {
        let _ = (streams, bulk, dst, num_tokens);
        Err(KvError::Protocol(format!("KV bytes on the side channel of a {} connection", self.name())))
    }

    /// Reader of a direct write: waits (bounded) until the bytes the writer says it wrote for
    /// `tid` are known to be in our memory. Copies the writer waited for are (cuda-ipc, local);
    /// a NIXL write is once its notification has arrived, a granted NIXL read once it ended.
    fn confirm_landed(&self, _tid: &TransferId) -> Result<(), String> {
        Ok(())
    }

    /// Whether [`Self::confirm_landed`] waits on the network: the reader then lands each
    /// transfer on a thread of its own, so that one slow or lost landing holds up no other
    /// message on the connection.
    fn landing_waits(&self) -> bool {
        false
    }

    /// Pull, reader: whether it may move the bytes itself (NIXL READs) once the holder grants
    /// the read, rather than the holder copying them before it answers.
    fn reader_reads(&self) -> bool {
        false
    }

    /// Pull, holder: whether it grants reads (the reader moves the bytes) instead of writing.
    fn grants_reads(&self) -> bool {
        false
    }

    /// Pull, reader, when [`Self::reader_reads`]: the read it is about to ask for, tokens
    /// `0..num_tokens` of the holder's blocks `src` into our `dst` (both from the first block
    /// the reader does not hold).
    fn plan_read(&self, _tid: &TransferId, _src: Vec<u32>, _dst: Vec<u32>, _num_tokens: usize) {}

    /// Pull, reader, when [`Self::reader_reads`]: the holder granted the read of `tid`, keeping
    /// its lease for `validity` from its answer (zero: it wrote the blocks itself instead).
    fn granted(&self, _tid: &TransferId, _validity: Duration) {}
}

/// The KV layout an engine describes in its handshake.
pub(crate) fn peer_layout(peer: &AgentInfo) -> KvLayout {
    KvLayout {
        num_layers: peer.num_layers,
        num_kv_heads: peer.num_kv_heads,
        head_dim: peer.head_dim,
        block_size: peer.block_size,
        num_blocks: peer.num_blocks,
    }
}

#[cfg(test)]
mod tests;
