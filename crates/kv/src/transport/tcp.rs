//! The `tcp` transport: KV block bytes straight between a socket and the KV memory, on the
//! side channel after the frame that announces them.
//!
//! Sending reads the sender's blocks piece by piece ([`pieces`]: the contiguous runs, cut to
//! at most [`PIECE_BYTES`]) and writes them to the socket with no staging copy. Receiving
//! reads straight into the destination blocks when both sides use the same block size, and
//! through one staging buffer plus [`scatter_tokens`] when they differ. Around each piece a GPU
//! engine's memory copies between its device cache and host copy ([`send_staged`],
//! [`recv_staged`]), so those copies overlap the socket.
//!
//! A step still computing (its [`KvFences`] not complete) goes group of layers by group: each
//! group's slice of every block, announced as a write of its own once the group's fence is
//! set, so the KV crosses the network while the step's later layers compute.
//!
//! A pair with several streams (`--kv-tcp-streams`) stripes each write's bytes over them
//! ([`send_striped`], [`recv_striped`]): one TCP stream carries about 3 GB/s, less than a GPU's
//! prefill produces KV.

use std::io::{Read, Write};
use std::ops::Range;

use tandem_compute::{KvLayout, KvRegion};

use tandem_compute::cuda::{KvFence, KvFences};
use tandem_core::TransferId;

pub use super::stripes::{
    recv_striped, recv_striped_as_landed, send_striped, send_striped_as_ready, stripe_bytes, stripes_of, Crew, FRESH,
    STRIPE_BYTES,
};
use super::{Announce, Bulk, Ours, Runs, Transport, WriteError};
use crate::blocks::{coalesce, scatter_tokens, BlockRun, KvSlice};
use crate::error::KvError;
use crate::memory::StagedSend;

/// Bytes of the checksum that follows a bulk send's data when it is checksummed.
pub const CHECKSUM_BYTES: u64 = 4;

/// Bytes of KV a bulk transfer moves per piece at most. A GPU engine copies one piece
/// between its device cache and its host copy while the piece before it is on the socket, so
/// the copy hides behind the network but for one piece's worth.
pub const PIECE_BYTES: usize = 8 << 20;

/// The blocks `blocks` as a bulk transfer moves them: their contiguous runs, in order, each cut
/// into pieces of at most [`PIECE_BYTES`] (at least one block).
pub fn pieces(blocks: &[u32], block_bytes: usize) -> Vec<BlockRun> {
    pieces_of_at_most(blocks, block_bytes, PIECE_BYTES)
}

/// [`pieces`] of at most `piece_bytes` (at least one block), `block_bytes` moving per block.
fn pieces_of_at_most(blocks: &[u32], block_bytes: usize, piece_bytes: usize) -> Vec<BlockRun> {
    let most = (piece_bytes / block_bytes.max(1)).max(1) as u32;
    let mut out = Vec::new();
    for run in coalesce(blocks) {
        let mut start = run.start;
        let end = run.start + run.len;
        while start < end {
            let len = most.min(end - start);
            out.push(BlockRun { start, len });
            start += len;
        }
    }
    out
}

/// Writes the raw bytes of the blocks holding tokens `0..num_tokens` (whole blocks, in token
/// order) to `w`, then, with `checksum`, the CRC-32 of those bytes (little-endian,
/// [`CHECKSUM_BYTES`]). Returns the data bytes written ([`crate::blocks::wire_bytes`]).
///
/// # Safety
/// No other thread may write `blocks` while this runs (the caller holds them for the transfer).
pub unsafe fn send_blocks(
    w: &mut impl Write,
    region: &KvRegion,
    blocks: &[u32],
    num_tokens: usize,
    checksum: bool,
) -> Result<u64, KvError> {
    let pieces = send_pieces(region, blocks, num_tokens)?;
    let all = KvSlice::all(region.layout());
    // Safety: passed on from the caller.
    unsafe { send_staged(w, region, (&pieces, all), num_tokens, checksum, &mut |_| Ok(())) }
}

/// The pieces [`send_staged`] sends for tokens `0..num_tokens` of `blocks`, or why they cannot
/// be sent.
pub fn send_pieces(region: &KvRegion, blocks: &[u32], num_tokens: usize) -> Result<Vec<BlockRun>, KvError> {
    let needed = region.layout().blocks_for(num_tokens);
    if blocks.len() < needed {
        return Err(KvError::Protocol(format!("{num_tokens} tokens need {needed} blocks, {} given", blocks.len())));
    }
    Ok(pieces(&blocks[..needed], region.block_bytes()))
}

/// The pieces a bulk transfer of `slice` of `blocks` moves, by the slice's bytes: about
/// [`PIPELINE_PIECES`] of them, none under [`MIN_PIECE_BYTES`] nor over [`PIECE_BYTES`]. Each
/// piece costs the sender a wait for its copy to the host copy and the receiver a copy of its
/// own, so a group of a few layers goes in few (by whole blocks, a one-layer group of a 1k
/// prompt went in 22 pieces of 0.2 MB, each send a chain of waits); and in more than one, so
/// that its copies at both ends overlap the socket (in one piece, a group's copy to the host,
/// its bytes and its copy to the device ran one after the other).
pub fn slice_pieces(region: &KvRegion, blocks: &[u32], slice: &KvSlice) -> Result<Vec<BlockRun>, KvError> {
    let per_block: usize = spans_of(region, slice)?.iter().map(|span| span.len()).sum();
    let piece = (blocks.len() * per_block / PIPELINE_PIECES).clamp(MIN_PIECE_BYTES, PIECE_BYTES);
    Ok(pieces_of_at_most(blocks, per_block, piece))
}

/// Pieces [`slice_pieces`] aims for in a transfer.
pub const PIPELINE_PIECES: usize = 4;

/// The least bytes [`slice_pieces`] puts in a piece (but the transfer's last).
pub const MIN_PIECE_BYTES: usize = 1 << 20;

/// [`send_blocks`] of the slice `what.1` of `what.0`'s pieces (from [`send_pieces`]; whole
/// blocks, or a group of layers or a rank's heads: then each block's part, [`KvSlice`]),
/// calling `ready(i)` before piece `i`'s bytes are read from `region`: a GPU engine waits there
/// for that piece's copy from its device cache, queued ahead.
///
/// # Safety
/// As [`send_blocks`], for the pieces' blocks.
pub unsafe fn send_staged(
    w: &mut impl Write,
    region: &KvRegion,
    what: (&[BlockRun], KvSlice),
    num_tokens: usize,
    checksum: bool,
    ready: &mut dyn FnMut(usize) -> Result<(), KvError>,
) -> Result<u64, KvError> {
    let (pieces, slice) = what;
    let layout = *region.layout();
    let mut crc = crc32fast::Hasher::new();
    let mut put = |w: &mut dyn Write, data: &[u8]| -> Result<(), KvError> {
        w.write_all(data)?;
        if checksum {
            crc.update(data);
        }
        Ok(())
    };
    let spans = spans_of(region, &slice)?;
    let whole = is_whole(region, &spans);
    // A part's spans are a fraction of a block's bytes each: gathered into larger socket writes.
    let mut out = std::io::BufWriter::with_capacity(if whole { 0 } else { 1 << 18 }, w);
    for (i, piece) in pieces.iter().enumerate() {
        ready(i)?;
        if whole {
            // Safety: caller holds these blocks; nobody writes them meanwhile.
            put(&mut out, unsafe { region.bytes(piece.start as usize, piece.len as usize) })?;
            continue;
        }
        for b in piece.start..piece.start + piece.len {
            // Safety: as above.
            let block = unsafe { region.bytes(b as usize, 1) };
            for span in &spans {
                put(&mut out, &block[span.clone()])?;
            }
        }
    }
    if checksum {
        out.write_all(&crc.finalize().to_le_bytes())?;
    }
    out.flush()?;
    Ok(slice.wire_bytes(&layout, region.dtype(), num_tokens))
}

/// The byte ranges of each block of `region` that hold `slice`, in wire order, or why the
/// slice is not part of its blocks.
fn spans_of(region: &KvRegion, slice: &KvSlice) -> Result<Vec<Range<usize>>, KvError> {
    slice.check(region.layout()).map_err(KvError::Protocol)?;
    Ok(slice.spans(region.layout(), region.dtype().bytes()))
}

/// Whether `spans` are every byte of a block of `region` (the slice is whole blocks).
fn is_whole(region: &KvRegion, spans: &[Range<usize>]) -> bool {
    matches!(spans, [only] if only.len() == region.block_bytes())
}

/// Reads `bytes` raw bytes (the sender's layout, `src_block_size` tokens per block, tokens
/// `0..num_tokens`) from `r` into the destination blocks; with `checksum`, then the sender's
/// CRC-32 of them, which must match the bytes as they landed ([`KvError::Corrupt`] if not:
/// the stream is still in step, but the blocks hold bad KV).
///
/// # Safety
/// The caller must own `dst_blocks` exclusively while this runs.
pub unsafe fn recv_blocks(
    r: &mut impl Read,
    bytes: u64,
    src_block_size: usize,
    region: &KvRegion,
    dst_blocks: &[u32],
    num_tokens: usize,
    checksum: bool,
) -> Result<(), KvError> {
    let into = Destination::all(region, dst_blocks, num_tokens);
    // Safety: passed on from the caller.
    unsafe { recv_staged(r, bytes, src_block_size, into, checksum, &mut |_| Ok(())) }
}

/// Where a bulk receive lands: tokens `0..num_tokens` of `slice` in `blocks` of `region`.
#[derive(Clone)]
pub struct Destination<'a> {
    /// The receiver's KV memory.
    pub region: &'a KvRegion,
    /// The destination blocks, in token order.
    pub blocks: &'a [u32],
    /// Tokens that land.
    pub num_tokens: usize,
    /// The part of the blocks the bytes carry (all of them; a group of layers of a step still
    /// computing; a tensor-parallel rank's heads).
    pub slice: KvSlice,
}

impl<'a> Destination<'a> {
    /// Whole blocks: tokens `0..num_tokens` in `blocks` of `region`.
    pub fn all(region: &'a KvRegion, blocks: &'a [u32], num_tokens: usize) -> Self {
        Self { region, blocks, num_tokens, slice: KvSlice::all(region.layout()) }
    }
}

/// [`recv_blocks`] into `into` (whole blocks, or a slice of them), calling `landed(run)` as each piece
/// of the destination blocks has its bytes (before the checksum is checked): a GPU engine
/// queues that piece's copy into its device cache there, while the next piece is still on the
/// socket.
///
/// # Safety
/// As [`recv_blocks`].
pub unsafe fn recv_staged(
    r: &mut impl Read,
    bytes: u64,
    src_block_size: usize,
    into: Destination<'_>,
    checksum: bool,
    landed: &mut dyn FnMut(BlockRun) -> Result<(), KvError>,
) -> Result<(), KvError> {
    let Destination { region, blocks: dst_blocks, num_tokens, slice } = into;
    let (dl, needed) = check_destination(region, bytes, src_block_size, dst_blocks, num_tokens, &slice)?;
    let spans = spans_of(region, &slice)?;
    let whole = is_whole(region, &spans);
    let mut crc = crc32fast::Hasher::new();
    if src_block_size == dl.block_size {
        // A part's spans are read in larger socket reads, never past the announced bytes.
        let cap = if whole { 0 } else { 1 << 18 };
        let mut data = std::io::BufReader::with_capacity(cap, r.by_ref().take(bytes));
        for piece in slice_pieces(region, &dst_blocks[..needed], &slice)? {
            if whole {
                // Safety: the caller owns the destination blocks exclusively.
                let dst = unsafe { region.bytes_mut(piece.start as usize, piece.len as usize) };
                data.read_exact(dst)?;
                if checksum {
                    crc.update(dst);
                }
            } else {
                for b in piece.start..piece.start + piece.len {
                    // Safety: as above.
                    let block = unsafe { region.bytes_mut(b as usize, 1) };
                    for span in &spans {
                        let dst = &mut block[span.clone()];
                        data.read_exact(dst)?;
                        if checksum {
                            crc.update(dst);
                        }
                    }
                }
            }
            landed(piece)?;
        }
        drop(data);
        if checksum {
            return check_crc(r, crc, &format!("the {bytes} bytes received"));
        }
    } else {
        let mut staging = vec![0u8; bytes as usize];
        r.read_exact(&mut staging)?;
        if checksum {
            crc.update(&staging);
        }
        // Safety: the caller owns the destination blocks exclusively.
        unsafe { scatter_tokens(&staging, src_block_size, region, dst_blocks, num_tokens, &slice) };
        for piece in slice_pieces(region, &dst_blocks[..needed], &slice)? {
            landed(piece)?;
        }
        if checksum {
            return check_crc(r, crc, &format!("the {bytes} bytes received"));
        }
    }
    Ok(())
}

/// Checks an announced receive of `bytes` (the sender's `src_block_size`-token blocks of
/// tokens `0..num_tokens`, of `slice`) against its destination; returns the destination's
/// layout and how many of `dst_blocks` the tokens use.
fn check_destination(
    region: &KvRegion,
    bytes: u64,
    src_block_size: usize,
    dst_blocks: &[u32],
    num_tokens: usize,
    slice: &KvSlice,
) -> Result<(KvLayout, usize), KvError> {
    let dl = *region.layout();
    if src_block_size == 0 {
        return Err(KvError::Protocol("source block size 0".into()));
    }
    slice.check(&dl).map_err(KvError::Protocol)?;
    let src_layout = KvLayout { block_size: src_block_size, ..dl };
    let expected = slice.wire_bytes(&src_layout, region.dtype(), num_tokens);
    if bytes != expected {
        return Err(KvError::Protocol(format!("{bytes} bytes announced for {num_tokens} tokens, expected {expected}")));
    }
    let needed = dl.blocks_for(num_tokens);
    if dst_blocks.len() < needed || dst_blocks.iter().any(|&b| b as usize >= dl.num_blocks) {
        return Err(KvError::Protocol(format!("destination blocks do not cover {num_tokens} tokens")));
    }
    Ok((dl, needed))
}

/// Reads the sender's CRC-32 after the data (`what` names it in the error) and checks it
/// against `crc`, the data's as landed.
pub(crate) fn check_crc(r: &mut impl Read, crc: crc32fast::Hasher, what: &str) -> Result<(), KvError> {
    let mut sent = [0u8; CHECKSUM_BYTES as usize];
    r.read_exact(&mut sent)?;
    let (sent, got) = (u32::from_le_bytes(sent), crc.finalize());
    if sent != got {
        return Err(KvError::Corrupt(format!(
            "KV checksum mismatch: the sender's CRC-32 is {sent:08x}, {what} give {got:08x}"
        )));
    }
    Ok(())
}

/// Reads `bytes` from the stream and throws them away (data for a transfer the reader refuses).
pub(crate) fn drain(stream: &mut dyn Read, mut bytes: u64) -> Result<(), KvError> {
    let mut sink = vec![0u8; 1 << 20];
    while bytes > 0 {
        let n = bytes.min(sink.len() as u64) as usize;
        stream.read_exact(&mut sink[..n])?;
        bytes -= n as u64;
    }
    Ok(())
}

/// The bytes on the side channel, between the frame that announces them and the completion
/// after them, straight between the socket and the host region (a GPU engine's host copy,
/// staged piece by piece to and from its device cache on the connector's stream).
pub(crate) struct Tcp {
    ours: Ours,
}

impl Tcp {
    pub(crate) fn new(ours: Ours) -> Self {
        Self { ours }
    }

    /// [`KvMemory::stage_send`](crate::memory::KvMemory::stage_send), or its injected failure.
    ///
    /// # Safety
    /// As `stage_send`.
    unsafe fn stage_send(&self, pieces: &[BlockRun], layers: Range<usize>) -> Result<StagedSend<'_>, KvError> {
        if self.ours.faults.fail_host_copies {
            return Err(KvError::Transfer("copying KV to the host copy failed: injected".into()));
        }
        // Safety: passed on from the caller.
        unsafe { self.ours.memory.stage_send(pieces, layers) }
    }

    /// [`KvMemory::stage_send_ahead`](crate::memory::KvMemory::stage_send_ahead), or its
    /// injected failure.
    ///
    /// # Safety
    /// As `stage_send_ahead`.
    unsafe fn stage_send_ahead(
        &self,
        pieces: &[Vec<BlockRun>],
        groups: &[(Range<usize>, Option<&KvFence>)],
    ) -> Result<StagedSend<'_>, KvError> {
        if self.ours.faults.fail_host_copies {
            return Err(KvError::Transfer("copying KV to the host copy failed: injected".into()));
        }
        // Safety: passed on from the caller.
        unsafe { self.ours.memory.stage_send_ahead(pieces, groups) }
    }

    /// Announces `what.1` of the pieces `what.0` as rank `rank.0` of `rank.1`'s write and sends
    /// its bytes, each piece `i` once `ready(i)` says it is in the host copy.
    ///
    /// # Safety
    /// As [`send_staged`], for the pieces' blocks.
    unsafe fn send_slice(
        &self,
        region: &KvRegion,
        what: (&[BlockRun], KvSlice),
        (rank, ranks): (usize, usize),
        num_tokens: usize,
        ready: &mut dyn FnMut(usize) -> Result<(), KvError>,
        out: &mut dyn Announce,
    ) -> Result<(), WriteError> {
        let (pieces, slice) = what;
        let (layout, checksum) = (region.layout(), self.ours.verify);
        let bytes = slice.wire_bytes(layout, region.dtype(), num_tokens);
        let bulk =
            Bulk { src_block_size: layout.block_size, bytes, checksum, slice: slice.clone(), rank, ranks, streams: 1 };
        let (announced, crew) = out.announce(bulk)?;
        let mut announced = announced.into_iter();
        let Some(first) = announced.next() else { return Err(WriteError::Failed("no stream to send on".into())) };
        // The injected corruption flips the first byte on the first stream; else it passes.
        let mut first = FlipFirstBit { inner: first, flipped: !self.ours.faults.corrupt_sends };
        let mut streams: Vec<&mut (dyn Write + Send)> = vec![&mut first];
        streams.extend(announced);
        match &mut streams[..] {
            // Safety (both): passed on from the caller.
            [w] => unsafe { send_staged(w, region, (pieces, slice), num_tokens, checksum, ready)? },
            several => unsafe { send_striped_staged(several, region, (pieces, slice), checksum, ready, crew)? },
        };
        Ok(())
    }
}

impl Transport for Tcp {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn acknowledges_writes(&self) -> bool {
        true
    }

    fn writes_per_rank(&self) -> bool {
        true
    }

    fn write(
        &self,
        runs: Runs<'_>,
        fences: &KvFences,
        _landed: Option<&TransferId>,
        out: &mut dyn Announce,
    ) -> Result<(), WriteError> {
        let Runs { src, num_tokens, ranks, .. } = runs;
        let ranks = ranks.max(1);
        let region = self.ours.memory.host_region().map_err(|e| WriteError::Failed(e.to_string()))?;
        let layout = region.layout();
        let failed = |e: KvError| WriteError::Failed(e.to_string());
        let blocks = match src.get(..layout.blocks_for(num_tokens)) {
            Some(blocks) => blocks,
            None => {
                return Err(failed(KvError::Protocol(format!(
                    "{num_tokens} tokens need more than {} blocks",
                    src.len()
                ))))
            }
        };
        // Each group (or merged run of groups) in pieces of its own bytes.
        let pieces_of =
            |layers: &Range<usize>| slice_pieces(region, blocks, &KvSlice::of_layers(layout, layers.clone()));
        // A step still computing goes group by group of layers, each as soon as its fence says
        // its KV is written (a GPU engine's copy to the host copy then reads final KV), on the
        // socket while later layers compute; KV already final goes as one write of all layers.
        // A tensor-parallel engine's ranks each write their own heads of each group.
        let groups = fences.groups(layout.num_layers);
        // `--kv-stage-ahead`: every group's copies to the host copy queued now, each behind its
        // group's fence on the device, so a group is copied as soon as it is computed while the
        // ones before it are on the socket (else each is copied once the one before has gone).
        // Safety (this and the copies below): the caller holds the source blocks (produced KV,
        // or a lease being read) for this call; the engine does not schedule them meanwhile.
        let ahead = match self.ours.stage_ahead && !fences.is_complete() {
            true => {
                let pieces = groups.iter().map(|(layers, _)| pieces_of(layers)).collect::<Result<Vec<_>, _>>();
                let pieces = pieces.map_err(failed)?;
                let staged = unsafe { self.stage_send_ahead(&pieces, &groups) }.map_err(failed)?;
                Some((staged, pieces))
            }
            false => None,
        };
        let mut g = 0;
        while g < groups.len() {
            let (mut layers, fence) = (groups[g].0.clone(), groups[g].1);
            let (staged_here, pieces_here);
            let (staged, pieces, first_piece) = match &ahead {
                Some((all, pieces)) => {
                    // A device fence is waited for by the copies; a host thread's, here.
                    if let Some(fence) = fence.filter(|f| f.event().is_none()) {
                        fence.wait().map_err(WriteError::Failed)?;
                    }
                    (all, &pieces[g], pieces[..g].iter().map(Vec::len).sum())
                }
                None => {
                    if let Some(fence) = fence {
                        fence.wait().map_err(WriteError::Failed)?;
                    }
                    // The groups the step has computed meanwhile go with this one, as one
                    // write: where the network fell behind the step, one copy and one
                    // announcement instead of several, and no pause between them.
                    while let Some((next, Some(f))) = groups.get(g + 1) {
                        if !f.is_set() {
                            break;
                        }
                        layers.end = next.end;
                        g += 1;
                    }
                    pieces_here = pieces_of(&layers).map_err(failed)?;
                    staged_here = unsafe { self.stage_send(&pieces_here, layers.clone()) }.map_err(failed)?;
                    (&staged_here, &pieces_here, 0)
                }
            };
            g += 1;
            // Timed at debug level: how far the socket trails the step (scripts/gpu/push_tail.py).
            tracing::debug!(layers = ?layers, "KV group computed");
            for rank in 0..ranks {
                let slice = KvSlice::of_layers(layout, layers.clone());
                let slice = slice.of_rank(layout, rank, ranks).map_err(WriteError::Failed)?;
                let mut ready = |i| staged.ready(first_piece + i);
                // Safety: as above.
                unsafe { self.send_slice(region, (pieces, slice), (rank, ranks), num_tokens, &mut ready, out)? };
            }
            tracing::debug!(layers = ?layers, "KV group sent");
        }
        Ok(())
    }

    unsafe fn receive(
        &self,
        (streams, crew): (&mut [&mut (dyn Read + Send)], &Crew),
        bulk: Bulk,
        dst: &[u32],
        num_tokens: usize,
    ) -> Result<(), KvError> {
        let memory = &self.ours.memory;
        let region = memory.host_region()?;
        let mut load = memory.receiver()?;
        let into = Destination { region, blocks: dst, num_tokens, slice: bulk.slice.clone() };
        // A failed copy into the device cache fails the transfer, but the bytes are still read,
        // so the connection stays in step.
        let mut failed = None;
        let mut landed = |run| {
            let copied = match self.ours.faults.fail_host_copies {
                true => Err(KvError::Transfer("copying KV into the device cache failed: injected".into())),
                // Safety: passed on from the caller (which owns `dst` until it reports).
                false => unsafe { load.landed(run, bulk.slice.layers.clone()) },
            };
            if let (Err(e), None) = (copied, &failed) {
                failed = Some(e);
            }
            Ok(())
        };
        let (bytes, from, checksum) = (bulk.bytes, bulk.src_block_size, bulk.checksum);
        let layers = bulk.slice.layers.clone();
        tracing::debug!(?layers, bytes, "KV group announced");
        match streams {
            // Safety (both): as above.
            [stream] => unsafe { recv_staged(stream, bytes, from, into, checksum, &mut landed)? },
            several => unsafe { recv_striped_blocks(several, bytes, from, into, checksum, &mut landed, crew)? },
        }
        let landed = match failed {
            Some(e) => Err(e),
            None => load.finish(),
        };
        tracing::debug!(?layers, ok = landed.is_ok(), "KV group landed");
        landed
    }
}

/// Fault injection: a writer that flips the lowest bit of the first byte written through it.
struct FlipFirstBit<'a> {
    inner: &'a mut (dyn Write + Send),
    flipped: bool,
}

impl Write for FlipFirstBit<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match buf.first() {
            Some(&b) if !self.flipped => {
                self.inner.write_all(&[b ^ 1])?;
                self.flipped = true;
                Ok(1)
            }
            _ => self.inner.write(buf),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Where the wire bytes of `slice` of `pieces` lie in `region`, in wire order: each piece whole
/// (its blocks, all their bytes), or each block's spans of the slice (one block, a span's bytes
/// in it).
fn wire_spans(
    region: &KvRegion,
    pieces: &[BlockRun],
    slice: &KvSlice,
) -> Result<Vec<(BlockRun, Range<usize>)>, KvError> {
    let block_bytes = region.block_bytes();
    let spans = spans_of(region, slice)?;
    let whole = is_whole(region, &spans);
    let mut out = Vec::new();
    for &piece in pieces {
        if whole {
            out.push((piece, 0..piece.len as usize * block_bytes));
            continue;
        }
        for b in piece.start..piece.start + piece.len {
            out.extend(spans.iter().map(|span| (BlockRun { start: b, len: 1 }, span.clone())));
        }
    }
    Ok(out)
}

/// `block`'s bytes at `spans` (ascending and disjoint), as slices of their own.
fn split_spans<'a>(mut block: &'a mut [u8], spans: &[Range<usize>]) -> Vec<&'a mut [u8]> {
    let (mut out, mut at) = (Vec::with_capacity(spans.len()), 0);
    for span in spans {
        let (_, rest) = std::mem::take(&mut block).split_at_mut(span.start - at);
        let (mine, rest) = rest.split_at_mut(span.len());
        out.push(mine);
        (block, at) = (rest, span.end);
    }
    out
}

/// Where each of `pieces` ends among the wire bytes of `slice` of them (every block of a piece
/// carries the same bytes of the slice).
fn piece_ends(region: &KvRegion, pieces: &[BlockRun], slice: &KvSlice) -> Result<Vec<usize>, KvError> {
    let per_block: usize = spans_of(region, slice)?.iter().map(|span| span.len()).sum();
    Ok(pieces
        .iter()
        .scan(0, |end, piece| {
            *end += piece.len as usize * per_block;
            Some(*end)
        })
        .collect())
}

/// [`send_staged`] striped over `streams` ([`send_striped_as_ready`], on `crew`'s threads):
/// the slice `what.1` of `what.0`'s pieces goes out over all the streams, each stream's share
/// of a piece as soon as that piece is `ready` (a GPU engine's copy to its host copy, waited
/// for in order here while the streams send). Returns the data bytes sent.
///
/// # Safety
/// As [`send_blocks`], for the pieces' blocks.
pub unsafe fn send_striped_staged<W: Write + Send>(
    streams: &mut [W],
    region: &KvRegion,
    what: (&[BlockRun], KvSlice),
    checksum: bool,
    ready: &mut dyn FnMut(usize) -> Result<(), KvError>,
    crew: &Crew,
) -> Result<u64, KvError> {
    let (pieces, slice) = what;
    let spans = wire_spans(region, pieces, &slice)?;
    let lens: Vec<usize> = spans.iter().map(|(_, within)| within.len()).collect();
    let ends = piece_ends(region, pieces, &slice)?;
    let segment = |i: usize| {
        let (run, within) = &spans[i];
        // Safety: passed on from the caller; the streams read a segment only once the pieces
        // under it are ready (their copies to the host copy have completed).
        let bytes = unsafe { region.bytes(run.start as usize, run.len as usize) };
        &bytes[within.clone()]
    };
    send_striped_as_ready(streams, (&lens, &segment), checksum, (&ends, ready), crew)
}

/// [`recv_staged`] of bytes striped over `streams` (on `crew`'s threads): straight into the
/// destination blocks when both sides use the same block size, `landed` hearing of each piece
/// of the destination as soon as its bytes are in (while the streams read on); else through one
/// staging buffer, `landed` hearing of every piece once all the bytes are in.
///
/// # Safety
/// As [`recv_blocks`].
pub unsafe fn recv_striped_blocks<R: Read + Send>(
    streams: &mut [R],
    bytes: u64,
    src_block_size: usize,
    into: Destination<'_>,
    checksum: bool,
    landed: &mut dyn FnMut(BlockRun) -> Result<(), KvError>,
    crew: &Crew,
) -> Result<(), KvError> {
    let Destination { region, blocks: dst_blocks, num_tokens, slice } = into;
    let (dl, needed) = check_destination(region, bytes, src_block_size, dst_blocks, num_tokens, &slice)?;
    let dst_pieces = slice_pieces(region, &dst_blocks[..needed], &slice)?;
    if src_block_size == dl.block_size {
        let spans = spans_of(region, &slice)?;
        let whole = is_whole(region, &spans);
        let mut segments: Vec<&mut [u8]> = Vec::new();
        for piece in &dst_pieces {
            // Safety: the caller owns the destination blocks exclusively; each block is taken
            // once (the destination's blocks are distinct), its spans split apart.
            if whole {
                segments.push(unsafe { region.bytes_mut(piece.start as usize, piece.len as usize) });
                continue;
            }
            for b in piece.start..piece.start + piece.len {
                segments.extend(split_spans(unsafe { region.bytes_mut(b as usize, 1) }, &spans));
            }
        }
        let ends = piece_ends(region, &dst_pieces, &slice)?;
        let mut tell = |i: usize| landed(dst_pieces[i]);
        return recv_striped_as_landed(streams, &mut segments, checksum, (&ends, &mut tell), crew);
    }
    let mut staging = vec![0u8; bytes as usize];
    recv_striped_as_landed(streams, &mut [&mut staging[..]], checksum, (&[], &mut |_| Ok(())), crew)?;
    // Safety: the caller owns the destination blocks exclusively.
    unsafe { scatter_tokens(&staging, src_block_size, region, dst_blocks, num_tokens, &slice) };
    dst_pieces.into_iter().try_for_each(landed)
}

/// Reads and throws away bytes striped over `streams` (data for a transfer the reader
/// refuses), each stream's checksum too.
pub(crate) fn drain_striped(streams: &mut [&mut (dyn Read + Send)], bytes: u64, checksum: bool) -> Result<(), KvError> {
    let n = streams.len();
    for (k, s) in streams.iter_mut().enumerate() {
        let share: usize = stripes_of(bytes as usize, k, n).map(|r| r.len()).sum();
        drain(*s, share as u64 + if checksum { CHECKSUM_BYTES } else { 0 })?;
    }
    Ok(())
}
