//! The transfer table: every transfer this engine takes part in, by transfer id, with its
//! deadline: decode's waiting requests, prefill's registrations (push) and produced KV (push
//! rendezvous, pull leases), and the tombstones of transfers given up or released. Data and
//! the rules of its entries' lifetimes: no threads, no I/O. The agent holds it behind one
//! mutex, never across socket I/O.
//!
//! Entries name their connection as an `L` (the agent's link; anything in tests) and a push
//! registration its writer as a `W`, so that the table knows nothing of either.
//!
//! Layer: under `protocol`. Owns the entries; calls only the ground floor (`events`).

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::time::{Duration, Instant};

use tandem_core::{RequestId, TransferId};

use crate::events::{HeldBlocks, TransferTimeline};

/// Where a decode-side transfer's bytes stand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Landing {
    /// Nothing written yet (or a write failed).
    Waiting,
    /// A bulk write into the blocks is in progress on a reader thread, or (`direct`) the peer
    /// may be writing them from its side until it says the write ended.
    Writing,
    /// The request was aborted during a write: released when the write ends.
    WritingAborted,
    /// The bytes are in the blocks (push: waiting for `Done`).
    Landed,
}

/// Decode side: a request waiting for its KV.
pub(crate) struct Incoming<L> {
    pub request_id: RequestId,
    /// The connection to the prefill engine, once made.
    pub conn: Option<L>,
    pub blocks: Vec<u32>,
    pub num_tokens: usize,
    pub deadline: Instant,
    pub landing: Landing,
    /// How far each of the writer's tensor-parallel ranks has landed its KV heads (one entry
    /// for a writer of one rank, or one that writes every head at once).
    pub ranks: Vec<RankLanding>,
    /// Where the write in progress ends, and whose it is.
    pub writing_upto: usize,
    pub writing_rank: usize,
    /// The write in progress is a group that leaves layers from this one on still to come.
    pub writing_group_end: Option<usize>,
    /// Pull: known from the params. Push: comes with `Done`.
    pub first_token: Option<u32>,
    /// Pull (decode reads) rather than push (prefill writes).
    pub pull: bool,
    /// The peer writes the blocks directly (cuda-ipc): from the moment they are named to it
    /// until it reports the write's end, a write may land in them.
    pub direct: bool,
    /// Why the last write into the blocks did not land (a checksum mismatch), for the
    /// completion that follows it.
    pub failure: Option<String>,
    /// When the engine asked, and the stages since (for the timeline).
    pub started: Instant,
    pub timeline: TransferTimeline,
}

/// Decode side: how far one of the writer's ranks has landed its KV (writes come in order: a
/// push over tcp in parts while the prompt computes, each part group of layers by group while
/// its step computes).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct RankLanding {
    /// Tokens from the first wanted one whose KV (the rank's heads) has landed.
    pub landed_upto: usize,
    /// A span of tokens landing group of layers by group: where it ends, and how many layers
    /// from the first have landed (`landed_upto` moves to its end once the last group has).
    pub partial: Option<(usize, usize)>,
    /// The rank's `Done` has come.
    pub done: bool,
}

/// The most tensor-parallel ranks a writer may say it has.
pub(crate) const MAX_RANKS: usize = 64;

impl<L> Incoming<L> {
    /// Tokens whose KV every rank has landed.
    pub fn landed_upto(&self) -> usize {
        self.ranks.iter().map(|r| r.landed_upto).min().unwrap_or(0)
    }

    /// The writer says it has `ranks` ranks: from its first word on, the entry follows that many
    /// (a count that changes once something landed is refused).
    fn expect_ranks(&mut self, ranks: usize) -> bool {
        if self.ranks.len() == ranks {
            return true;
        }
        let fresh = self.ranks.iter().all(|r| *r == RankLanding::default());
        if !fresh || ranks == 0 || ranks > MAX_RANKS {
            return false;
        }
        self.ranks = vec![RankLanding::default(); ranks];
        true
    }

    /// Rank `rank` of `ranks` said `Done`: whether every rank has now, or why the word does
    /// not fit the transfer.
    pub fn rank_done(&mut self, rank: usize, ranks: usize) -> Result<bool, String> {
        if !self.expect_ranks(ranks) || rank >= ranks {
            return Err(format!("a completion from rank {rank} of {ranks}, where {} write", self.ranks.len()));
        }
        self.ranks[rank].done = true;
        Ok(self.ranks.iter().all(|r| r.done))
    }

    pub fn since(&self) -> u64 {
        self.started.elapsed().as_micros() as u64
    }

    /// A direct writer reported its copies' end, `copy_us` after it took the transfer on: the
    /// data arrived from then (never before the request went out: the times are the writer's).
    pub fn direct_write_reported(&mut self, copy_us: u64) {
        self.timeline.data_start_us = self.since().saturating_sub(copy_us).max(self.timeline.request_sent_us);
    }

    /// Whether a write into the blocks is in progress (nothing may end the entry under it).
    pub fn writing(&self) -> bool {
        matches!(self.landing, Landing::Writing | Landing::WritingAborted)
    }
}

/// Prefill side, push: decode's destination, waiting for the KV to be produced.
pub(crate) struct Registration<L, W> {
    pub conn: L,
    /// Decode's blocks from token `skip` on, and the tokens wanted after `skip`.
    pub blocks: Vec<u32>,
    pub num_tokens: usize,
    /// Leading prompt tokens whose KV decode holds (its prefix cache): never written.
    pub skip: usize,
    /// Direct transports: also the last moment a write may start (decode's deadline).
    pub deadline: Instant,
    /// Direct transports: the writer of the parts computed so far (`protocol::push`).
    pub parts: Option<W>,
}

/// Prefill side: finished KV waiting for its registration (push) or its reader (pull lease).
pub(crate) struct Produced {
    pub held: HeldBlocks,
    pub blocks: Vec<u32>,
    pub num_tokens: usize,
    pub first_token: u32,
    /// When the engine handed the KV over, on the wall clock (for the reader's timeline).
    pub produced_unix_us: u64,
    pub deadline: Instant,
    /// A pull read is sending these blocks now; the lease cannot expire under it.
    pub reading: bool,
    /// The engine's preemptions of the request before it computed this KV.
    pub attempt: u32,
}

#[cfg(test)]
impl Produced {
    /// 40 tokens of KV in blocks 1, 2 and 3, first token 7, held until `deadline`.
    pub(crate) fn example(deadline: Instant) -> Self {
        Produced {
            held: Box::new(()),
            blocks: vec![1, 2, 3],
            num_tokens: 40,
            first_token: 7,
            produced_unix_us: 0,
            deadline,
            reading: false,
            attempt: 0,
        }
    }
}

/// Prefill side, push: the latest report of a prompt still computing (`protocol::push`), kept
/// until decode's registration comes (or the prompt ends, or `since` is too long ago).
pub(crate) struct Computing {
    /// The request's block table.
    pub blocks: Vec<u32>,
    /// Tokens whose KV the step wrote (or is writing: `fences`).
    pub upto: usize,
    /// The engine's preemptions of the request before this step.
    pub attempt: u32,
    /// When each group of layers of the step has its KV in the cache.
    pub fences: tandem_compute::cuda::KvFences,
    pub since: Instant,
}

/// Which of a transfer's tokens, and of their layers, one write moves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct WriteSpan {
    /// The first, counted from the first wanted token.
    pub from: usize,
    pub num_tokens: usize,
    /// The transfer's last write: it must end at the last wanted token (and layer).
    pub last: bool,
    /// The layers it carries: all of them (`0..num_layers`), or a group of a step still
    /// computing, which follows the group before it over the same tokens.
    pub layers: Range<usize>,
    /// The layers there are.
    pub num_layers: usize,
    /// The writer's rank whose heads it carries, of its `ranks` (each lands in order on its own).
    pub rank: usize,
    pub ranks: usize,
}

impl WriteSpan {
    /// All `num_tokens` in one write, every layer and head of them.
    pub(crate) fn whole(num_tokens: usize, num_layers: usize) -> Self {
        Self { from: 0, num_tokens, last: true, layers: 0..num_layers, num_layers, rank: 0, ranks: 1 }
    }
}

/// Why a write into a decode-side transfer's blocks cannot start.
pub(crate) enum NoWrite {
    /// No such transfer (late, finished or bogus).
    Unknown,
    /// Aborted, or the blocks or token count do not match.
    Refused,
}

/// How a decode-side transfer the engine aborted ends.
pub(crate) enum Aborted<L> {
    /// No such request (never registered, or already over): nothing can write its blocks.
    Unknown,
    /// Removed now: its blocks come back; its connection, if any, is told.
    Now(Box<Incoming<L>>),
    /// A write into its blocks is running: it ends, and its blocks come back, when the write
    /// does; its connection, if any, is told now.
    AtWriteEnd(Option<L>),
}

/// How a decode-side transfer on a lost connection ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lost {
    /// Nothing can write its blocks any more.
    Failed,
    /// A direct writer may still finish a copy into its blocks until `writes_until` (a device
    /// copy needs no socket): the engine holds them until then and recomputes in others.
    InFlight { writes_until: Instant },
}

/// What one expiry pass found.
pub(crate) struct Expired<L, W> {
    /// Prefill-side entries dropped.
    pub reclaimed: usize,
    /// Decode-side transfers past their deadline.
    pub late: Vec<TransferId>,
    /// Decode-side transfers past their deadline that a direct writer may still be writing
    /// (not aborted): they end now, their blocks held until the deadline plus the grace.
    pub late_in_flight: Vec<TransferId>,
    /// Prefill-side registrations dropped (a direct writer tells the decode engine, which
    /// otherwise holds its blocks until the grace has passed).
    pub registrations: Vec<(TransferId, Registration<L, W>)>,
}

/// Every transfer, by id.
pub(crate) struct Tables<L, W> {
    pub incoming: HashMap<TransferId, Incoming<L>>,
    pub by_request: HashMap<RequestId, TransferId>,
    pub registrations: HashMap<TransferId, Registration<L, W>>,
    pub produced: HashMap<TransferId, Produced>,
    /// Prefill side: push writes in progress (the rendezvous met; the write thread runs).
    pub pushing: HashSet<TransferId>,
    /// Prefill side, push: prompts computing whose registration has not come yet.
    pub computing: HashMap<TransferId, Computing>,
    /// Prefill side: transfers decode gave up on before their KV was produced, until when to
    /// remember that (the KV, once produced, is freed at once rather than kept for a
    /// registration or read that will not come).
    pub aborted: HashMap<TransferId, Instant>,
    /// Prefill side, pull: leases the engine freed on the router's word as their requests
    /// ended, until when to remember them: decode's own release may come after it (the two
    /// travel different paths) and is counted then, not taken for an unknown transfer.
    pub released: HashMap<TransferId, Instant>,
}

impl<L, W> Default for Tables<L, W> {
    fn default() -> Self {
        Self {
            incoming: HashMap::new(),
            by_request: HashMap::new(),
            registrations: HashMap::new(),
            produced: HashMap::new(),
            pushing: HashSet::new(),
            computing: HashMap::new(),
            aborted: HashMap::new(),
            released: HashMap::new(),
        }
    }
}

impl<L, W> Tables<L, W> {
    /// Decode side: removes `tid`'s entry and its request's index.
    pub fn remove_incoming(&mut self, tid: &TransferId) -> Option<Incoming<L>> {
        let inc = self.incoming.remove(tid)?;
        self.by_request.remove(&inc.request_id);
        Some(inc)
    }

    /// Decode side: the engine aborted `request_id`. Released at once unless a write into its
    /// blocks is running (then when that write ends: the writer reports it).
    pub fn abort(&mut self, request_id: &RequestId) -> Aborted<L>
    where
        L: Clone,
    {
        let Some(tid) = self.by_request.get(request_id).cloned() else { return Aborted::Unknown };
        match self.incoming.get_mut(&tid) {
            Some(inc) if inc.writing() => {
                inc.landing = Landing::WritingAborted;
                Aborted::AtWriteEnd(inc.conn.clone())
            }
            _ => self.remove_incoming(&tid).map_or(Aborted::Unknown, |inc| Aborted::Now(Box::new(inc))),
        }
    }

    /// The connection `on` picks was lost at `now`: every decode-side transfer waiting on it ends
    /// now rather than at its deadline, a direct writer's possibly still in flight with its blocks
    /// held for `grace` more (a frozen writer may resume and finish a copy it started); one the
    /// engine aborted mid-write ends after that grace (by expiry). Prefill's registrations from
    /// it are dropped. Returns the ended transfers and how each ended.
    pub fn lose_connection(
        &mut self,
        on: impl Fn(&L) -> bool,
        now: Instant,
        grace: Duration,
    ) -> Vec<(Incoming<L>, Lost)> {
        let on_conn = |i: &Incoming<L>| i.conn.as_ref().is_some_and(&on);
        for inc in self.incoming.values_mut().filter(|i| on_conn(i) && i.landing == Landing::WritingAborted) {
            inc.deadline = inc.deadline.min(now);
        }
        let ended: Vec<TransferId> = self
            .incoming
            .iter()
            .filter(|(_, i)| on_conn(i) && i.landing != Landing::WritingAborted)
            .map(|(tid, _)| tid.clone())
            .collect();
        self.registrations.retain(|_, r| !on(&r.conn));
        let lost = |inc: &Incoming<L>| match inc.direct && inc.writing() {
            true => Lost::InFlight { writes_until: now + grace },
            false => Lost::Failed,
        };
        let removed: Vec<Incoming<L>> = ended.iter().filter_map(|tid| self.remove_incoming(tid)).collect();
        removed
            .into_iter()
            .map(|inc| {
                let how = lost(&inc);
                (inc, how)
            })
            .collect()
    }

    /// Decode side: marks `tid`'s blocks as being written for `span` (from a whole
    /// `block_size`-token block in: where the last write ended, or 0 to start over; the last
    /// write ends at the last wanted token), exactly into the blocks `dst` when the writer names
    /// them (they must be the registered ones from `span.from` on); returns the blocks to write.
    pub fn begin_write(
        &mut self,
        tid: &TransferId,
        span: WriteSpan,
        dst: Option<&[u32]>,
        block_size: usize,
    ) -> Result<Vec<u32>, NoWrite> {
        let WriteSpan { from, num_tokens, last, layers, num_layers, rank, ranks } = span;
        let inc = self.incoming.get_mut(tid).ok_or(NoWrite::Unknown)?;
        let open = matches!(inc.landing, Landing::Waiting | Landing::Landed);
        if !open || !inc.expect_ranks(ranks) || rank >= ranks {
            return Err(NoWrite::Refused);
        }
        let end = from + num_tokens;
        let r = &inc.ranks[rank];
        // A span's first group (or all its layers) starts where the rank's landed KV ends, or
        // over it from the first token; a later group continues the span where its last ended.
        let in_order = match layers.start {
            0 => from == 0 || from == r.landed_upto,
            l => from == r.landed_upto && r.partial == Some((end, l)),
        };
        let grouped = layers.start < layers.end && layers.end <= num_layers && (!last || layers.end == num_layers);
        let fits = from.is_multiple_of(block_size.max(1)) && end <= inc.num_tokens && (!last || end == inc.num_tokens);
        let ours = inc.blocks.get(from / block_size.max(1)..).unwrap_or_default();
        if !in_order || !grouped || !fits || dst.is_some_and(|d| !ours.starts_with(d)) {
            return Err(NoWrite::Refused);
        }
        if from == 0 && layers.start == 0 && rank == 0 {
            // The first write, or the prompt computed again (its first rank's first write comes
            // first): what landed before is overwritten.
            inc.ranks.iter_mut().for_each(|r| *r = RankLanding::default());
            inc.failure = None;
            inc.timeline.data_start_us = inc.since();
            (inc.timeline.bytes, inc.timeline.regions) = (0, 0);
        }
        let r = &mut inc.ranks[rank];
        if layers.start == 0 {
            r.partial = None;
        }
        if from == 0 && layers.start == 0 {
            r.landed_upto = 0;
        }
        inc.landing = Landing::Writing;
        inc.writing_upto = end;
        inc.writing_rank = rank;
        inc.writing_group_end = (layers.end < num_layers).then_some(layers.end);
        Ok(dst.unwrap_or(ours).to_vec())
    }

    /// Decode side: the write into `tid`'s blocks ended (`landed`: the bytes are in place),
    /// `bytes` over `regions` contiguous runs; the transfer's KV is `Landed` once every wanted
    /// token's is. Returns whether the request was aborted during the write (the caller then
    /// releases it).
    pub fn end_write(&mut self, tid: &TransferId, landed: bool, bytes: u64, regions: u32) -> bool {
        let Some(inc) = self.incoming.get_mut(tid) else { return false };
        let aborted = inc.landing == Landing::WritingAborted;
        let (upto, group_end) = (inc.writing_upto, inc.writing_group_end.take());
        if let Some(r) = inc.ranks.get_mut(inc.writing_rank) {
            match (landed, group_end) {
                // A group with more of its span's layers to come.
                (true, Some(layers)) => r.partial = Some((upto, layers)),
                (true, None) => {
                    r.landed_upto = upto;
                    r.partial = None;
                }
                // What landed of the span is not all its layers; its later groups are refused.
                (false, _) => r.partial = None,
            }
        }
        inc.landing = if inc.landed_upto() == inc.num_tokens { Landing::Landed } else { Landing::Waiting };
        inc.timeline.data_end_us = inc.since();
        inc.timeline.bytes += bytes;
        inc.timeline.regions += regions;
        aborted
    }

    /// Drops prefill-side entries past their deadline (a lease being read is kept) and returns
    /// how many went, and the decode-side transfers past theirs: none with a write in progress
    /// on a reader thread (its I/O timeout ends it); those a peer may be writing directly
    /// apart (`late_in_flight`: the engine holds their blocks until `grace` more has passed,
    /// since a peer starts no write after the deadline and a device copy that started before
    /// it has long ended by then), or, aborted already, only once the grace has passed (their
    /// blocks are freed when they end).
    pub fn expire(&mut self, now: Instant, grace: Duration) -> Expired<L, W> {
        let before = self.produced.len();
        self.produced.retain(|_, p| p.reading || p.deadline > now);
        self.aborted.retain(|_, until| *until > now);
        self.released.retain(|_, until| *until > now);
        let gone: Vec<TransferId> =
            self.registrations.iter().filter(|(_, r)| r.deadline <= now).map(|(k, _)| k.clone()).collect();
        let registrations: Vec<(TransferId, Registration<L, W>)> =
            gone.into_iter().filter_map(|k| self.registrations.remove(&k).map(|r| (k, r))).collect();
        let reclaimed = before - self.produced.len() + registrations.len();
        let (mut late, mut late_in_flight) = (Vec::new(), Vec::new());
        for (tid, i) in &self.incoming {
            match (i.landing, i.direct) {
                (Landing::Writing, true) if i.deadline <= now => late_in_flight.push(tid.clone()),
                (Landing::WritingAborted, true) if i.deadline + grace <= now => late.push(tid.clone()),
                (Landing::Waiting | Landing::Landed, _) if i.deadline <= now => late.push(tid.clone()),
                _ => {}
            }
        }
        Expired { reclaimed, late, late_in_flight, registrations }
    }
}

#[cfg(test)]
mod tests;
