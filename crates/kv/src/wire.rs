//! The side channel's messages and their framing.
//!
//! Every message is one frame: a 4-byte big-endian length, then that many bytes of JSON.
//! Frames that announce bulk data (`WriteBlocks`, `BlockData`) are followed on the same stream
//! by exactly the announced number of raw bytes (little-endian `f32`s of KV blocks). TCP keeps
//! order, so a notification sent after a data frame is delivered after the data has landed.
//!
//! # Versions
//! [`PROTOCOL_VERSION`] is checked first in every handshake; peers with another version are
//! refused before anything else is decoded. Bump it when a message changes shape or meaning.
//! - 1: first version (handshake, register, done, failed, heartbeat, abort, block data).
//! - 2: `BlockData.local` (the holder copied the blocks directly; no bytes follow).
//! - 3: `HandshakeOk.transport` (the acceptor picks the connection's transport) and `.note`;
//!   `Register.write_within_ms` and `ReadBlocks.dst_blocks`/`.write_within_ms` (a peer that
//!   writes the blocks directly must not start after the reader's deadline);
//!   `BlockData.local` renamed `direct`.
//! - 4: `WriteBlocks.checksum` and `BlockData.checksum` (the data is followed by its CRC-32,
//!   `--kv-verify`); `AgentInfo.kv_verify`.
//! - 6: `Done.digest` and `BlockData.digest` (`--kv-verify` over a direct transport: the
//!   writer's digest of the KV it copied, which the reader checks against its blocks).
//! - 8: `WriteBlocks.from_token` and `.last`: a push over tcp writes a prompt's KV in parts while
//!   it is computed, in order, the last write followed by `Done`; decode acknowledges the last.
//! - 9: `WriteBlocks.layers`: a part goes group of layers by group as its step computes them;
//!   `AgentInfo.tcp_streams`, `HandshakeOk.join_token`, `JoinStream` and `.streams` on the bulk
//!   frames: tcp bytes striped over several connections of one pair.
//! - 10: `Hello` and `Challenge` before `Handshake`, `.proof` on `Handshake` and `JoinStream`:
//!   with a cluster secret a mutual challenge-response, then every frame authenticated
//!   ([`crate::seal`]).
//! - 11: `WriteBlocks.rank` and `.ranks`, `Done.ranks`, `BlockData.rank` and `.ranks`: a
//!   tensor-parallel prefill engine's ranks each write (push) or answer a read of (pull) their own
//!   KV heads over tcp, and each send a `Done` (push); decode counts them.
//!
//! Layer: the ground floor but for `agent_info` and `error`, which it calls.

use std::io::{Read, Write};

use serde::{Deserialize, Serialize};
use tandem_core::{EngineId, Epoch, TransferId};

use crate::agent_info::AgentInfo;
use crate::error::KvError;

/// The side-channel protocol version.
pub const PROTOCOL_VERSION: u32 = 11;

/// Largest control frame accepted (a block-id list for a very long prompt fits easily).
pub const MAX_FRAME_BYTES: usize = 16 << 20;

/// How a transfer ended, as told by `Done`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum DoneStatus {
    /// The data landed.
    Ok,
    /// The sender gave up; the receiver must not use the blocks.
    Failed(String),
}

/// A side-channel message. Who sends each and what it means is on the variant.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum Message {
    /// Opens a connection, before anything about the engine is said: the connecting side's
    /// version, a fresh nonce, and who it says it is (proved in its `Handshake`).
    Hello {
        /// Sender's [`PROTOCOL_VERSION`].
        version: u32,
        /// 32 random bytes, hex.
        nonce: String,
        /// The connecting engine.
        engine_id: EngineId,
        /// Its incarnation.
        epoch: Epoch,
    },
    /// The accepting side's answer to `Hello`: its own nonce and name and, with a cluster
    /// secret, its proof of it over both nonces and names (the connecting side checks it before
    /// it says anything more).
    Challenge {
        /// 32 random bytes, hex.
        nonce: String,
        /// The accepting engine.
        engine_id: EngineId,
        /// Its incarnation.
        epoch: Epoch,
        /// HMAC of the cluster secret over both nonces and names, hex; none without a secret.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        proof: Option<String>,
    },
    /// The connecting side's metadata, after it checked the `Challenge`; with a cluster secret,
    /// its own proof (under another label than the acceptor's, so neither can stand for the
    /// other).
    Handshake {
        /// Sender's [`PROTOCOL_VERSION`].
        version: u32,
        /// Sender's metadata.
        info: AgentInfo,
        /// HMAC of the cluster secret over both nonces and names, hex; none without a secret.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        proof: Option<String>,
    },
    /// The accepting side agrees and sends its own metadata.
    HandshakeOk {
        /// Acceptor's metadata.
        info: AgentInfo,
        /// The transport the acceptor picked for this connection (`tcp`, `local`, `cuda-ipc`).
        transport: String,
        /// Why a faster transport both ends offer is not used, if one is not.
        note: Option<String>,
        /// Over tcp with several streams ([`AgentInfo::tcp_streams`] of both ends above 1): the
        /// token the connecting side's other streams name in their [`Message::JoinStream`].
        #[serde(default, skip_serializing_if = "Option::is_none")]
        join_token: Option<u64>,
    },
    /// The first and only frame of a connection that joins an open one as a further stream
    /// for its bulk bytes (`index` from 1; the connection itself is stream 0).
    JoinStream {
        /// The joined connection's `HandshakeOk.join_token`.
        token: u64,
        /// Which stream this is.
        index: usize,
        /// With a cluster secret: the HMAC of the token and index under the connection's
        /// session key, hex (a token seen on the wire does not let a stranger join).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        proof: Option<String>,
    },
    /// The accepting side refuses to pair; the reason names what differs.
    HandshakeRefused {
        /// Why.
        reason: String,
    },
    /// Push, decode -> prefill: "write transfer `transfer_id`'s KV into these blocks of mine".
    Register {
        /// The attempt.
        transfer_id: TransferId,
        /// The decode engine registering.
        decode_engine: EngineId,
        /// The decode engine's epoch; writes are void if it changes.
        epoch: Epoch,
        /// Destination blocks, in token order, from token `skip_tokens` on.
        block_ids: Vec<u32>,
        /// Tokens whose KV is wanted (after the skipped ones).
        num_tokens: usize,
        /// A direct transport must not start writing later than this after receipt (the
        /// decode engine's deadline for the transfer).
        write_within_ms: u64,
        /// Leading tokens of the prompt whose KV decode holds already (its prefix cache): not
        /// sent. A whole number of blocks in both engines' block sizes.
        #[serde(default)]
        skip_tokens: usize,
    },
    /// After a push write (prefill -> decode) the data landed; after a pull read
    /// (decode -> prefill) the source blocks may be released.
    Done {
        /// The attempt.
        transfer_id: TransferId,
        /// Producer tensor-parallel rank.
        rank: u32,
        /// The producer's ranks that each send a `Done` for this transfer (each writes its own
        /// KV heads, `WriteBlocks.rank`): decode's KV is complete once every one has.
        #[serde(default = "one_rank")]
        ranks: u32,
        /// The first token prefill sampled (push), so decode emits it without recomputing.
        first_token: Option<u32>,
        /// Outcome.
        status: DoneStatus,
        /// A direct write (cuda-ipc, local): how long the writer took from taking the transfer
        /// on to its copies' completion, so the reader's timeline shows the copy (0: the bytes
        /// came on the socket and the reader timed them itself).
        #[serde(default)]
        copy_us: u64,
        /// Push: when the prefill engine handed the KV over (its last step's end), in
        /// microseconds since the Unix epoch on the writer's clock (0: not known). On one host
        /// the reader measures from it to the KV being ready for its engine.
        #[serde(default)]
        produced_unix_us: u64,
        /// Push: how long the writer was still sending what the prompt's steps had computed
        /// before the hand-over, from the hand-over on, in microseconds (0: nothing was left).
        /// The reader's timeline splits the wait after prefill's last step with it.
        #[serde(default)]
        backlog_us: u64,
        /// A direct write under `--kv-verify`: the writer's digest of the KV it copied
        /// (`tandem_compute::kv_digest`), which the reader checks against its blocks.
        #[serde(default)]
        digest: Option<u64>,
    },
    /// Either way: the attempt failed; free what it holds.
    Failed {
        /// The attempt.
        transfer_id: TransferId,
        /// Why.
        reason: String,
    },
    /// Decode -> prefill (pull): still coming for these; extend their leases.
    Heartbeat {
        /// Attempts to keep.
        transfer_ids: Vec<TransferId>,
    },
    /// Either way: the request was cancelled; stop and release.
    Abort {
        /// The attempt.
        transfer_id: TransferId,
    },
    /// Bulk write into the receiver's blocks; followed by `bytes` raw bytes laid out as
    /// `src_block_size`-token blocks of the sender, covering `num_tokens` tokens.
    WriteBlocks {
        /// The attempt (the receiver checks the blocks are registered to it).
        transfer_id: TransferId,
        /// Receiver's destination blocks for these tokens, in token order (its registered blocks
        /// from the block holding `from_token` on).
        blocks: Vec<u32>,
        /// Tokens per block in the sender's layout of the bytes.
        src_block_size: usize,
        /// Tokens covered, from `from_token`.
        num_tokens: usize,
        /// Where these tokens start among the registered ones: a transfer's writes come in order,
        /// each from where the one before ended (or from 0 again: the prompt was computed again
        /// after a preemption), at a whole block on both sides.
        #[serde(default)]
        from_token: usize,
        /// The transfer's last write (`Done` follows; the receiver acknowledges it); earlier ones
        /// are parts of a prompt still being computed.
        #[serde(default = "yes")]
        last: bool,
        /// The layers `[start, end)` the bytes carry, when not all of them: a step still
        /// computing goes group by group of layers, in layer order, each group of a span of
        /// tokens after the one before it; the span's tokens have landed with its last group.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        layers: Option<[usize; 2]>,
        /// The writer's tensor-parallel rank whose KV heads the bytes carry (with `ranks` above 1:
        /// rank `rank` of `ranks` holds the `rank`-th of `ranks` equal shares of the heads). Each
        /// rank's writes come in order; the ranks' may interleave.
        #[serde(default)]
        rank: u32,
        /// The writer's ranks (1: the bytes carry every head).
        #[serde(default = "one_rank")]
        ranks: u32,
        /// The connection's streams the bytes are striped over (1: all on this one), each
        /// stream's share followed by its own CRC-32 when `checksum`.
        #[serde(default = "one")]
        streams: usize,
        /// Raw bytes that follow.
        bytes: u64,
        /// The bytes are followed by their CRC-32 (4 bytes, little-endian).
        #[serde(default)]
        checksum: bool,
    },
    /// Bulk read request (pull): send these blocks of yours.
    ReadBlocks {
        /// The attempt (the holder checks the blocks are leased to it).
        transfer_id: TransferId,
        /// Holder's source blocks, in token order (the whole lease).
        blocks: Vec<u32>,
        /// Tokens of the lease.
        num_tokens: usize,
        /// The reader's destination blocks from token `skip_tokens` on, for a holder that
        /// writes them directly (cuda-ipc, local); empty on tcp.
        dst_blocks: Vec<u32>,
        /// As in `Register`.
        write_within_ms: u64,
        /// As in `Register`: the first `skip_tokens` of the lease are not read.
        #[serde(default)]
        skip_tokens: usize,
    },
    /// Reply to `ReadBlocks`; followed by `bytes` raw bytes in the sender's block layout.
    BlockData {
        /// The attempt.
        transfer_id: TransferId,
        /// Tokens per block in the bytes' layout.
        src_block_size: usize,
        /// Raw bytes that follow (0 when refused).
        bytes: u64,
        /// Why the read was refused, if it was.
        error: Option<String>,
        /// The holder already copied the blocks into the reader's memory (a direct transport:
        /// local or cuda-ipc); no bytes follow.
        direct: bool,
        /// The bytes are followed by their CRC-32 (4 bytes, little-endian).
        #[serde(default)]
        checksum: bool,
        /// `direct`: how long the holder's copies took (as `Done`'s `copy_us`).
        #[serde(default)]
        copy_us: u64,
        /// `direct` under `--kv-verify`: as `Done`'s `digest`.
        #[serde(default)]
        digest: Option<u64>,
        /// `direct` to a reader that reads the blocks itself (NIXL pull): the answer grants the
        /// read, and the holder keeps the lease at least this many microseconds from sending it;
        /// the reader's read must end within it of asking.
        #[serde(default)]
        grant_us: u64,
        /// As `WriteBlocks.streams`.
        #[serde(default = "one")]
        streams: usize,
        /// As `WriteBlocks.rank`: a tensor-parallel holder's ranks each answer with their own
        /// heads; the read is whole once every rank's have landed.
        #[serde(default)]
        rank: u32,
        /// As `WriteBlocks.ranks`.
        #[serde(default = "one_rank")]
        ranks: u32,
    },
    /// Reply to `WriteBlocks`: the bytes were written (or why not).
    WriteAck {
        /// The attempt.
        transfer_id: TransferId,
        /// Why the write was refused, if it was.
        error: Option<String>,
    },
}

/// serde's default for fields that were always true before they existed.
fn yes() -> bool {
    true
}

/// serde's default for counts that were always one before they existed.
fn one() -> usize {
    1
}

/// serde's default for rank counts, one before tensor parallelism.
fn one_rank() -> u32 {
    1
}

/// Writes one frame.
pub fn write_message(w: &mut impl Write, msg: &Message) -> Result<(), KvError> {
    write_frame(w, &encode(msg)?, None)
}

/// Reads one frame. The reader's own timeout bounds the wait; an oversized or malformed
/// frame is a protocol error, never a panic.
pub fn read_message(r: &mut impl Read) -> Result<Message, KvError> {
    decode(&read_body(r)?)
}

/// A message's frame body (JSON), at most [`MAX_FRAME_BYTES`].
pub(crate) fn encode(msg: &Message) -> Result<Vec<u8>, KvError> {
    let body = serde_json::to_vec(msg).map_err(|e| KvError::Protocol(format!("encoding {e}")))?;
    if body.len() > MAX_FRAME_BYTES {
        return Err(KvError::Protocol(format!("frame of {} bytes exceeds {MAX_FRAME_BYTES}", body.len())));
    }
    Ok(body)
}

/// The message in a frame body.
pub(crate) fn decode(body: &[u8]) -> Result<Message, KvError> {
    serde_json::from_slice(body).map_err(|e| KvError::Protocol(format!("undecodable frame: {e}")))
}

/// Writes a frame (its length, `body`, and `tag` after it when the frame is authenticated) in
/// one write, so a small frame leaves in one segment.
pub(crate) fn write_frame(w: &mut impl Write, body: &[u8], tag: Option<&[u8]>) -> Result<(), KvError> {
    let tag = tag.unwrap_or_default();
    let mut frame = Vec::with_capacity(4 + body.len() + tag.len());
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(body);
    frame.extend_from_slice(tag);
    w.write_all(&frame)?;
    Ok(())
}

/// Reads a frame's length and body (not a tag after it).
pub(crate) fn read_body(r: &mut impl Read) -> Result<Vec<u8>, KvError> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_FRAME_BYTES {
        return Err(KvError::Protocol(format!("peer announced a {len}-byte frame (limit {MAX_FRAME_BYTES})")));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_message_round_trips() {
        let t = TransferId("t-1".into());
        let msgs = vec![
            Message::Hello {
                version: PROTOCOL_VERSION,
                nonce: "ab".into(),
                engine_id: EngineId("p".into()),
                epoch: Epoch(3),
            },
            Message::Challenge {
                nonce: "cd".into(),
                engine_id: EngineId("d".into()),
                epoch: Epoch(4),
                proof: Some("ef".into()),
            },
            Message::Handshake { version: PROTOCOL_VERSION, info: AgentInfo::example(), proof: None },
            Message::HandshakeOk {
                info: AgentInfo::example(),
                transport: "tcp".into(),
                note: Some("n".into()),
                join_token: Some(7),
            },
            Message::JoinStream { token: 7, index: 2, proof: Some("01".into()) },
            Message::HandshakeRefused { reason: "no".into() },
            Message::Register {
                transfer_id: t.clone(),
                decode_engine: EngineId("d".into()),
                epoch: Epoch(7),
                block_ids: vec![3, 4, 9],
                num_tokens: 40,
                write_within_ms: 900,
                skip_tokens: 0,
            },
            Message::Done {
                transfer_id: t.clone(),
                rank: 0,
                ranks: 1,
                first_token: Some(17),
                status: DoneStatus::Ok,
                copy_us: 0,
                produced_unix_us: 0,
                backlog_us: 0,
                digest: None,
            },
            Message::Done {
                transfer_id: t.clone(),
                rank: 1,
                ranks: 2,
                first_token: None,
                status: DoneStatus::Failed("x".into()),
                copy_us: 812,
                produced_unix_us: 1_790_000_000_000_000,
                backlog_us: 2_950,
                digest: Some(0xdead_beef_0123_4567),
            },
            Message::Failed { transfer_id: t.clone(), reason: "r".into() },
            Message::Heartbeat { transfer_ids: vec![t.clone()] },
            Message::Abort { transfer_id: t.clone() },
            Message::WriteBlocks {
                transfer_id: t.clone(),
                blocks: vec![1],
                src_block_size: 16,
                num_tokens: 9,
                from_token: 16,
                last: false,
                layers: Some([2, 4]),
                rank: 1,
                ranks: 4,
                streams: 3,
                bytes: 64,
                checksum: true,
            },
            Message::ReadBlocks {
                transfer_id: t.clone(),
                blocks: vec![2, 3],
                num_tokens: 20,
                dst_blocks: vec![5],
                write_within_ms: 10,
                skip_tokens: 16,
            },
            Message::BlockData {
                transfer_id: t.clone(),
                src_block_size: 8,
                bytes: 0,
                error: Some("expired".into()),
                direct: false,
                checksum: false,
                copy_us: 3,
                digest: None,
                grant_us: 0,
                streams: 1,
                rank: 0,
                ranks: 1,
            },
            Message::WriteAck { transfer_id: t, error: None },
        ];
        let mut buf = Vec::new();
        for m in &msgs {
            write_message(&mut buf, m).unwrap();
        }
        let mut r = &buf[..];
        for m in &msgs {
            assert_eq!(&read_message(&mut r).unwrap(), m);
        }
        assert!(r.is_empty());
    }

    /// Frames a peer could send: every valid message cut short, with bytes flipped, or with its
    /// length prefix changed (seeded, 20k tries). Each decodes to a message or an error; none
    /// panics, and a length prefix past the limit is refused before anything is allocated for it.
    #[test]
    fn mutated_frames_decode_or_fail_cleanly() {
        let t = TransferId("t-1".into());
        let msgs = [
            Message::HandshakeOk {
                info: AgentInfo::example(),
                transport: "cuda-ipc".into(),
                note: None,
                join_token: None,
            },
            Message::ReadBlocks {
                transfer_id: t.clone(),
                blocks: vec![2, 3],
                num_tokens: 20,
                dst_blocks: vec![5],
                write_within_ms: 9,
                skip_tokens: 0,
            },
            Message::BlockData {
                transfer_id: t.clone(),
                src_block_size: 8,
                bytes: 64,
                error: None,
                direct: true,
                checksum: false,
                copy_us: 0,
                digest: None,
                grant_us: 0,
                streams: 1,
                rank: 0,
                ranks: 1,
            },
            Message::Done {
                transfer_id: t,
                rank: 0,
                ranks: 1,
                first_token: Some(17),
                status: DoneStatus::Ok,
                copy_us: 0,
                produced_unix_us: 0,
                backlog_us: 0,
                digest: None,
            },
        ];
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let (mut ok, mut err) = (0, 0);
        for i in 0..20_000 {
            let mut frame = Vec::new();
            write_message(&mut frame, &msgs[i % msgs.len()]).unwrap();
            match next() % 3 {
                0 => frame.truncate((next() as usize) % frame.len()),
                1 => {
                    for _ in 0..1 + next() % 4 {
                        let at = (next() as usize) % frame.len();
                        frame[at] ^= 1 << (next() % 8);
                    }
                }
                _ => frame[..4].copy_from_slice(&(next() as u32).to_be_bytes()),
            }
            match read_message(&mut &frame[..]) {
                Ok(_) => ok += 1,
                Err(KvError::Protocol(_) | KvError::Io(_)) => err += 1,
                Err(other) => panic!("unexpected error kind {other:?}"),
            }
        }
        assert!(ok > 0 && err > 0, "{ok} decoded, {err} refused");
    }

    #[test]
    fn oversized_truncated_and_garbage_frames_are_errors() {
        let mut huge = Vec::new();
        huge.extend_from_slice(&(u32::MAX).to_be_bytes());
        assert!(matches!(read_message(&mut &huge[..]), Err(KvError::Protocol(_))));
        let mut garbage = Vec::new();
        garbage.extend_from_slice(&5u32.to_be_bytes());
        garbage.extend_from_slice(b"{{{{{");
        assert!(matches!(read_message(&mut &garbage[..]), Err(KvError::Protocol(_))));
        let truncated = [0u8, 0, 0, 9, b'{'];
        assert!(matches!(read_message(&mut &truncated[..]), Err(KvError::Io(_))));
    }
}
