//! Bytes striped over several TCP streams of one connection (`--kv-tcp-streams`): stripe `i`
//! of a send's bytes, in wire order, goes on stream `i % n`, each stream on a thread of its own,
//! so a pair's transfer runs at several streams' rate (one loopback stream carries about 3
//! GB/s, four about 9 on the H200 machine). Only offsets and lengths are shared: the sender's
//! and receiver's memory layouts are theirs ([`super::tcp`] maps them to wire order).

use std::io::{Read, Write};
use std::ops::Range;

use super::tcp::check_crc;
use crate::error::KvError;

/// Bytes of one stripe of a large bulk send over several streams ([`send_striped`]): stripe
/// `i` of the bytes, in wire order, goes on stream `i % n`, so a receiver places each stripe by
/// its offset alone. A send of less than `n` stripes is cut into `n` smaller ones (whole pages),
/// so that every stream carries a share.
pub const STRIPE_BYTES: usize = 1 << 20;

/// The stripe size of `total` bytes over `n` streams: [`STRIPE_BYTES`], or less for a small send.
pub fn stripe_bytes(total: usize, n: usize) -> usize {
    total.div_ceil(n.max(1)).next_multiple_of(4096).clamp(4096, STRIPE_BYTES)
}

/// The stripes of `total` wire bytes that stream `k` of `n` carries, in order, as wire ranges.
pub fn stripes_of(total: usize, k: usize, n: usize) -> impl Iterator<Item = Range<usize>> {
    let stripe = stripe_bytes(total, n);
    (k * stripe..total).step_by(n.max(1) * stripe).map(move |at| at..(at + stripe).min(total))
}

/// The parts of segments of lengths `lens` (the wire bytes in order, as consecutive pieces of
/// memory) that the wire range `range` covers, each as (segment, range within it).
fn spans_of(lens: &[usize], range: Range<usize>) -> Vec<(usize, Range<usize>)> {
    let mut out = Vec::new();
    let mut start = 0;
    for (i, &len) in lens.iter().enumerate() {
        let (lo, hi) = (range.start.max(start), range.end.min(start + len));
        if lo < hi {
            out.push((i, lo - start..hi - start));
        }
        start += len;
        if start >= range.end {
            break;
        }
    }
    out
}

/// Sends the wire bytes `segments` (in order) striped over `streams` ([`STRIPE_BYTES`]), one
/// thread a stream, each stream's bytes followed by their CRC-32 when `checksum`. Returns the
/// bytes sent.
pub fn send_striped<W: Write + Send>(streams: &mut [W], segments: &[&[u8]], checksum: bool) -> Result<u64, KvError> {
    let lens: Vec<usize> = segments.iter().map(|s| s.len()).collect();
    let total: usize = lens.iter().sum();
    let n = streams.len();
    std::thread::scope(|scope| {
        let sends: Vec<_> = streams
            .iter_mut()
            .enumerate()
            .map(|(k, w)| {
                let lens = &lens;
                scope.spawn(move || -> Result<(), KvError> {
                    let mut crc = crc32fast::Hasher::new();
                    for stripe in stripes_of(total, k, n) {
                        for (seg, within) in spans_of(lens, stripe) {
                            let data = &segments[seg][within];
                            w.write_all(data)?;
                            if checksum {
                                crc.update(data);
                            }
                        }
                    }
                    if checksum {
                        w.write_all(&crc.finalize().to_le_bytes())?;
                    }
                    w.flush()?;
                    Ok(())
                })
            })
            .collect();
        let panicked = || KvError::Transfer("a stream's sender panicked".into());
        sends.into_iter().try_for_each(|s| s.join().unwrap_or_else(|_| Err(panicked())))
    })?;
    Ok(total as u64)
}

/// Receives wire bytes striped over `streams` (as [`send_striped`] sent them) straight into
/// `segments` (where the wire bytes go, in order), one thread a stream; with `checksum`, each
/// stream's CRC-32 must match what landed ([`KvError::Corrupt`] if not, after every stream
/// has been read, so the streams stay in step). A broken stream's error comes first.
pub fn recv_striped<R: Read + Send>(
    streams: &mut [R],
    segments: &mut [&mut [u8]],
    checksum: bool,
) -> Result<(), KvError> {
    let lens: Vec<usize> = segments.iter().map(|s| s.len()).collect();
    let total: usize = lens.iter().sum();
    let n = streams.len();
    // Each stream's thread writes only its own stripes: disjoint ranges of the segments.
    let bases: Vec<SendPtr> = segments.iter_mut().map(|s| SendPtr(s.as_mut_ptr())).collect();
    std::thread::scope(|scope| {
        let reads: Vec<_> = streams
            .iter_mut()
            .enumerate()
            .map(|(k, r)| {
                let (lens, bases) = (&lens, &bases);
                scope.spawn(move || -> Result<(), KvError> {
                    let mut crc = crc32fast::Hasher::new();
                    for stripe in stripes_of(total, k, n) {
                        for (seg, within) in spans_of(lens, stripe) {
                            // Safety: `within` lies inside segment `seg` (spans_of cuts it to
                            // the segment's length), the segments are borrowed mutably for the
                            // whole scope, and no two streams' stripes overlap, so this slice
                            // is written by this thread alone.
                            let dst =
                                unsafe { std::slice::from_raw_parts_mut(bases[seg].0.add(within.start), within.len()) };
                            r.read_exact(dst)?;
                            if checksum {
                                crc.update(dst);
                            }
                        }
                    }
                    if checksum {
                        check_crc(r, crc, &format!("the bytes received on stream {k}"))?;
                    }
                    Ok(())
                })
            })
            .collect();
        let panicked = || KvError::Transfer("a stream's receiver panicked".into());
        let errors: Vec<KvError> =
            reads.into_iter().filter_map(|r| r.join().unwrap_or_else(|_| Err(panicked())).err()).collect();
        // A broken stream first (the connection is done), then a corrupt one (still in step).
        let (corrupt, broken): (Vec<_>, Vec<_>) = errors.into_iter().partition(|e| matches!(e, KvError::Corrupt(_)));
        match broken.into_iter().chain(corrupt).next() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    })
}

/// A segment's base address, handed to the stream threads of [`recv_striped`].
#[derive(Clone, Copy)]
struct SendPtr(*mut u8);

// Safety: the pointer is only dereferenced for the disjoint stripes each thread owns, while
// the segments it points into are mutably borrowed by `recv_striped`'s caller.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}
