//! Bytes striped over several TCP streams of one connection (`--kv-tcp-streams`): stripe `i`
//! of a send's bytes, in wire order, goes on stream `i % n`, each stream on a thread of its own
//! (a connection's [`Crew`], kept from one send to the next), so a pair's transfer runs at
//! several streams' rate (one loopback stream carries about 3 GB/s, four about 9 on the H200
//! machine). Only offsets and lengths are shared: the sender's and receiver's memory layouts
//! are theirs ([`super::tcp`] maps them to wire order).
//!
//! A GPU engine's bytes pass through its host copy piece by piece, so both ends work in
//! pieces: the sender's streams put a piece's bytes on the wire as soon as it has reached the
//! host copy ([`send_striped_as_ready`]), and the receiver hears of each piece as soon as all
//! its bytes have landed ([`recv_striped_as_landed`]), each copy to or from the device
//! overlapping the sockets rather than coming before or after them.

use std::io::{Read, Write};
use std::ops::Range;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

use super::tcp::check_crc;
use crate::error::KvError;

/// Bytes of one stripe of a large bulk send over several streams ([`send_striped`]): stripe
/// `i` of the bytes, in wire order, goes on stream `i % n`, so a receiver places each stripe by
/// its offset alone. A send of less than `n` stripes is cut into `n` smaller ones (whole pages),
/// so that every stream carries a share.
pub const STRIPE_BYTES: usize = 1 << 20;

/// How often a thread waiting for another's progress looks again, besides being woken.
const RECHECK: Duration = Duration::from_secs(1);

/// The threads that carry a striped send's or receive's streams, one a stream.
pub enum Crew {
    /// Started for each call and ended with it.
    Fresh,
    /// Kept for a connection's life ([`Crew::kept`]): starting a thread a stream for every send
    /// and every receive cost 0.12 ms a side on a 16-core host (0.28 ms on 2 cores), on every
    /// group of layers a push writes, the last one included.
    Kept(rayon::ThreadPool),
}

/// A crew that starts its threads for each call (tests, benches, a connection whose kept
/// crew could not start).
pub static FRESH: Crew = Crew::Fresh;

impl Crew {
    /// `n` threads kept until the crew drops, named `name-K`; [`Crew::Fresh`] if they cannot
    /// start.
    pub fn kept(n: usize, name: &'static str) -> Crew {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(n.max(1)).thread_name(move |k| format!("{name}-{k}"));
        match pool.build() {
            Ok(pool) => Crew::Kept(pool),
            Err(e) => {
                tracing::warn!(error = %e, "cannot keep threads for a connection's streams: starting them per send");
                Crew::Fresh
            }
        }
    }

    /// Runs each of `jobs` on a thread of its own and `main` on this one meanwhile; once all
    /// have ended, each job's result (`None` where it panicked). A panic in `main` comes out
    /// here once the jobs have ended (`main` must make them end).
    fn run<'env, T: Send + 'env, J: FnOnce() -> T + Send + 'env>(
        &self,
        jobs: Vec<J>,
        main: impl FnOnce(),
    ) -> Vec<Option<T>> {
        match self {
            Crew::Fresh => std::thread::scope(|scope| {
                let running: Vec<_> = jobs.into_iter().map(|job| scope.spawn(job)).collect();
                main();
                running.into_iter().map(|job| job.join().ok()).collect()
            }),
            Crew::Kept(pool) => {
                let results: Vec<Mutex<Option<T>>> = jobs.iter().map(|_| Mutex::new(None)).collect();
                pool.in_place_scope(|scope| {
                    for (job, result) in jobs.into_iter().zip(&results) {
                        scope.spawn(move |_| {
                            let ended = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).ok();
                            *result.lock().unwrap_or_else(|p| p.into_inner()) = ended;
                        });
                    }
                    main();
                });
                results.into_iter().map(|r| r.into_inner().unwrap_or_else(|p| p.into_inner())).collect()
            }
        }
    }
}

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
    let total = lens.iter().sum();
    send_striped_as_ready(streams, (&lens, &|i| segments[i]), checksum, (&[total], &mut |_| Ok(())), &FRESH)
}

/// [`send_striped`] of bytes that become ready piece by piece: `pieces.0[i]` is the wire
/// offset where piece `i` ends (ascending, each at a segment's end, the last one the total),
/// and `pieces.1(i)` returns once piece `i` is in memory (a GPU engine's copy to its host
/// copy). This thread waits for the pieces in order while the streams send, each stream a
/// segment's share of a stripe as soon as its piece is ready. The segments are given as their
/// lengths and a function returning segment `i`'s bytes, called only once they are ready. A
/// piece that fails stops every stream before its next bytes, and its error is returned. The
/// streams' threads are `crew`'s.
pub fn send_striped_as_ready<'a, W: Write + Send>(
    streams: &mut [W],
    (lens, segment): (&[usize], &(dyn Fn(usize) -> &'a [u8] + Sync)),
    checksum: bool,
    (ends, ready): (&[usize], &mut dyn FnMut(usize) -> Result<(), KvError>),
    crew: &Crew,
) -> Result<u64, KvError> {
    let total: usize = lens.iter().sum();
    if ends.last().is_some_and(|&end| end != total) || ends.windows(2).any(|w| w[0] > w[1]) {
        return Err(KvError::Protocol(format!("pieces ending at {ends:?} do not cover {total} bytes in order")));
    }
    let n = streams.len();
    let gate = Gate::new(if ends.is_empty() { total } else { 0 });
    let gate = &gate;
    let sends: Vec<_> = streams
        .iter_mut()
        .enumerate()
        .map(|(k, w)| {
            move || -> Result<(), KvError> {
                let mut crc = crc32fast::Hasher::new();
                for stripe in stripes_of(total, k, n) {
                    let mut at = stripe.start;
                    for (seg, within) in spans_of(lens, stripe) {
                        // A span lies inside one segment, so inside one piece.
                        at += within.len();
                        gate.wait_for(at)?;
                        let data = &segment(seg)[within];
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
            }
        })
        .collect();
    let mut failed = None;
    let sent = crew.run(sends, || {
        // Shuts the gate if this thread unwinds, so that no stream waits on it for ever.
        let opener = Opener(gate);
        for (i, &end) in ends.iter().enumerate() {
            match ready(i) {
                Ok(()) => opener.0.open_to(end),
                Err(e) => {
                    opener.0.shut();
                    failed = Some(e);
                    break;
                }
            }
        }
    });
    let panicked = || KvError::Transfer("a stream's sender panicked".into());
    let sent = sent.into_iter().map(|s| s.unwrap_or_else(|| Err(panicked()))).collect::<Vec<_>>();
    match failed {
        Some(e) => return Err(e),
        None => sent.into_iter().collect::<Result<(), _>>()?,
    }
    Ok(total as u64)
}

/// How far a striped send's bytes are ready: its streams wait here before each segment's share
/// of a stripe.
struct Gate {
    /// Wire bytes ready from the start; `None` once the send was given up.
    ready: Mutex<Option<usize>>,
    cond: Condvar,
}

impl Gate {
    fn new(ready: usize) -> Self {
        Self { ready: Mutex::new(Some(ready)), cond: Condvar::new() }
    }

    fn lock(&self) -> MutexGuard<'_, Option<usize>> {
        self.ready.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn open_to(&self, end: usize) {
        if let Some(ready) = self.lock().as_mut() {
            *ready = (*ready).max(end);
        }
        self.cond.notify_all();
    }

    fn shut(&self) {
        *self.lock() = None;
        self.cond.notify_all();
    }

    /// Waits until the bytes before `end` are ready, or the send is given up.
    fn wait_for(&self, end: usize) -> Result<(), KvError> {
        let mut ready = self.lock();
        loop {
            match *ready {
                Some(r) if r >= end => return Ok(()),
                Some(_) => ready = self.cond.wait_timeout(ready, RECHECK).unwrap_or_else(|p| p.into_inner()).0,
                None => return Err(KvError::Transfer("the striped send was given up".into())),
            }
        }
    }
}

/// Opens the gate piece by piece; shuts it if dropped while unwinding.
struct Opener<'a>(&'a Gate);

impl Drop for Opener<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.shut();
        }
    }
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
    recv_striped_as_landed(streams, segments, checksum, (&[], &mut |_| Ok(())), &FRESH)
}

/// [`recv_striped`], telling `pieces.1(i)` as soon as every byte of piece `i` (wire bytes up to
/// `pieces.0[i]`, ascending, each at a segment's end) has landed, while the streams read on: a GPU engine queues that
/// piece's copy into its device cache there. Pieces are told in order, before the checksums
/// are checked, and not at all past a stream that broke. The first error `pieces.1` returns
/// stops the telling, and is returned once every stream has been read. The streams' threads
/// are `crew`'s.
pub fn recv_striped_as_landed<R: Read + Send>(
    streams: &mut [R],
    segments: &mut [&mut [u8]],
    checksum: bool,
    (ends, landed): (&[usize], &mut dyn FnMut(usize) -> Result<(), KvError>),
    crew: &Crew,
) -> Result<(), KvError> {
    let lens: Vec<usize> = segments.iter().map(|s| s.len()).collect();
    let total: usize = lens.iter().sum();
    let n = streams.len();
    let stripe = stripe_bytes(total, n);
    let progress = Progress::new(n, stripe, total);
    // Each stream's thread writes only its own stripes: disjoint ranges of the segments.
    let bases: Vec<SendPtr> = segments.iter_mut().map(|s| SendPtr(s.as_mut_ptr())).collect();
    let (lens, bases, progress) = (&lens, &bases, &progress);
    let reads: Vec<_> = streams
        .iter_mut()
        .enumerate()
        .map(|(k, r)| {
            move || -> Result<(), KvError> {
                // Counts this stream out however it ends, a panic too.
                let _ended = Ended(progress);
                let mut crc = crc32fast::Hasher::new();
                for range in stripes_of(total, k, n) {
                    let mut at = range.start;
                    for (seg, within) in spans_of(lens, range.clone()) {
                        at += within.len();
                        // Safety: `within` lies inside segment `seg` (spans_of cuts it to the
                        // segment's length), the segments are borrowed mutably until every
                        // stream has ended, and no two streams' stripes overlap, so this slice
                        // is written by this thread alone.
                        let dst =
                            unsafe { std::slice::from_raw_parts_mut(bases[seg].0.add(within.start), within.len()) };
                        r.read_exact(dst).inspect_err(|_| progress.broken())?;
                        if checksum {
                            crc.update(dst);
                        }
                        // Past a stripe's end, the stream's next byte is its next stripe's.
                        let next = if at == range.end { (range.start + n * stripe).min(total) } else { at };
                        progress.read_to(k, next);
                    }
                }
                if checksum {
                    check_crc(r, crc, &format!("the bytes received on stream {k}"))?;
                }
                Ok(())
            }
        })
        .collect();
    // Tell each piece as the stripes over it land, until every stream has ended.
    let mut refused = None;
    let read = crew.run(reads, || {
        let (mut told, mut seen) = (0, 0);
        loop {
            let (landed_bytes, ended) = progress.wait_change(&mut seen, total);
            while refused.is_none() && told < ends.len() && ends[told] <= landed_bytes {
                refused = landed(told).err();
                told += 1;
            }
            if ended {
                break;
            }
        }
    });
    let panicked = || KvError::Transfer("a stream's receiver panicked".into());
    let errors: Vec<KvError> = read.into_iter().filter_map(|r| r.unwrap_or_else(|| Err(panicked())).err()).collect();
    // A broken stream first (the connection is done), then a corrupt one (still in step).
    let (corrupt, broken): (Vec<_>, Vec<_>) = errors.into_iter().partition(|e| matches!(e, KvError::Corrupt(_)));
    match broken.into_iter().chain(corrupt).chain(refused).next() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// How far a striped receive's streams have read, for the thread that tells the pieces.
struct Progress {
    state: Mutex<ReadState>,
    cond: Condvar,
}

struct ReadState {
    /// Per stream, the wire offset of the next byte it reads (every byte of its stripes before
    /// it has landed).
    next: Vec<usize>,
    /// Streams that have ended (read all, or failed).
    ended: usize,
    /// A stream broke: no more bytes are told as landed.
    broken: bool,
    /// Bumped at every change, so the telling thread sleeps only while nothing moved.
    version: u64,
}

impl Progress {
    /// The progress of `n` streams carrying `total` bytes in stripes of `stripe`.
    fn new(n: usize, stripe: usize, total: usize) -> Self {
        let next = (0..n).map(|k| (k * stripe).min(total)).collect();
        let state = ReadState { next, ended: 0, broken: false, version: 0 };
        Self { state: Mutex::new(state), cond: Condvar::new() }
    }

    fn change(&self, f: impl FnOnce(&mut ReadState)) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut s);
        s.version += 1;
        self.cond.notify_all();
    }

    fn read_to(&self, k: usize, next: usize) {
        self.change(|s| s.next[k] = next);
    }

    fn broken(&self) {
        self.change(|s| s.broken = true);
    }

    /// Waits for a change since version `seen` (which it moves on), then returns the wire
    /// bytes that have all landed (none once a stream broke; `total` when there are no streams)
    /// and whether every stream has ended.
    fn wait_change(&self, seen: &mut u64, total: usize) -> (usize, bool) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        while s.version == *seen && s.ended < s.next.len() {
            s = self.cond.wait_timeout(s, RECHECK).unwrap_or_else(|p| p.into_inner()).0;
        }
        *seen = s.version;
        let prefix = s.next.iter().copied().min().unwrap_or(total);
        let landed = if s.broken { 0 } else { prefix };
        (landed, s.ended == s.next.len())
    }
}

/// Counts a stream's reader as ended when dropped.
struct Ended<'a>(&'a Progress);

impl Drop for Ended<'_> {
    fn drop(&mut self) {
        self.0.change(|s| s.ended += 1);
    }
}

/// A segment's base address, handed to the stream threads of [`recv_striped`].
#[derive(Clone, Copy)]
struct SendPtr(*mut u8);

// Safety: the pointer is only dereferenced for the disjoint stripes each thread owns, while
// the segments it points into are mutably borrowed by `recv_striped`'s caller.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}
