//! Push: the decode engine drives the rendezvous, the prefill engine drives the bytes.
//!
//! The sequence (shared/SEED.md's push):
//! 1. register: decode allocates the request's blocks and sends `Register` (its blocks, the
//!    tokens it wants, how long a direct writer may still start) as soon as it has them;
//! 2. rendezvous: prefill pairs the registration with the produced KV by transfer id, in either
//!    order ([`meet_registration`], [`meet_produced`]); a half that comes twice is a duplicate,
//!    KV produced for a transfer decode already gave up is freed at once;
//! 3. write: whichever half came second starts the write. Over a direct transport the KV of a
//!    prompt still computing goes in parts ([`Progress`], [`next_part`]): every whole run of
//!    tokens the two block sizes share, as soon as a step has computed it, so that once the
//!    prompt is done only its last part is left ([`rest_to_write`]);
//! 4. notify: `Done` with the first token after the data (tcp orders it after the bytes; a
//!    direct writer sends it once its copies have completed); decode reports `Ready` only on
//!    `Done` with its bytes landed ([`completion`]);
//! 5. release: prefill frees its blocks once the bytes have left its memory;
//! 6. fail: `Failed` either way ends the transfer; nothing is written after decode's deadline.
//!
//! These are the rules alone, over the transfer table: the agent's threads carry out what they
//! decide (sockets, copies, threads), so each race here is a unit test with no sockets.

use tandem_core::{Epoch, TransferId};

use crate::table::{Produced, Registration, Tables};
use crate::wire::DoneStatus;

/// What a push rendezvous found.
pub(crate) enum Rendezvous<L, W> {
    /// Both halves are here: start the write.
    Met(Registration<L, W>, Produced),
    /// Recorded; the other half has not come yet.
    Waiting,
    /// This half was already recorded under the id: the second is dropped.
    Duplicate,
    /// Decode gave the transfer up already: the produced KV is dropped (its blocks go back).
    Aborted,
}

/// Prefill: produced KV meets decode's registration, in either order.
pub(crate) fn meet_produced<L, W>(t: &mut Tables<L, W>, tid: TransferId, produced: Produced) -> Rendezvous<L, W> {
    if t.produced.contains_key(&tid) {
        return Rendezvous::Duplicate;
    }
    // The prompt is complete: the final write covers what its reports said.
    t.computing.remove(&tid);
    if t.aborted.remove(&tid).is_some() {
        return Rendezvous::Aborted;
    }
    match t.registrations.remove(&tid) {
        Some(reg) => {
            t.pushing.insert(tid);
            Rendezvous::Met(reg, produced)
        }
        None => {
            t.produced.insert(tid, produced);
            Rendezvous::Waiting
        }
    }
}

/// Prefill: decode's registration meets the produced KV, in either order.
pub(crate) fn meet_registration<L, W>(
    t: &mut Tables<L, W>,
    tid: TransferId,
    reg: Registration<L, W>,
) -> Rendezvous<L, W> {
    if t.registrations.contains_key(&tid) {
        return Rendezvous::Duplicate;
    }
    match t.produced.remove(&tid) {
        Some(produced) => {
            t.pushing.insert(tid);
            Rendezvous::Met(reg, produced)
        }
        None => {
            t.registrations.insert(tid, reg);
            Rendezvous::Waiting
        }
    }
}

/// Prefill: whether a registration from a peer of `peer_epoch` (as its handshake said),
/// skipping `skip` cached tokens, can be taken; why not otherwise.
pub(crate) fn check_registration(epoch: Epoch, peer_epoch: Epoch, skip: usize, ours: usize) -> Result<(), String> {
    if epoch != peer_epoch {
        return Err("registration epoch does not match the handshake".into());
    }
    if !skip.is_multiple_of(ours) {
        return Err(format!("{skip} cached tokens is not a whole number of {ours}-token blocks"));
    }
    Ok(())
}

/// The run of tokens that is a whole number of blocks in both block sizes.
pub(crate) fn shared_run(a: usize, b: usize) -> usize {
    let (mut x, mut y) = (a.max(1), b.max(1));
    while y != 0 {
        (x, y) = (y, x % y);
    }
    a.max(1) / x * b.max(1)
}

/// How far a registration's parts have been queued: tokens from the first one decode wants,
/// all computed in `attempt` (the engine's preemptions of the request so far).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Progress {
    pub sent: usize,
    pub attempt: u32,
}

impl Progress {
    /// Nothing queued yet, for KV computed in `attempt`.
    pub(crate) fn new(attempt: u32) -> Self {
        Self { sent: 0, attempt }
    }

    /// The tokens `from..to` a report of `attempt` computing up to `to` makes new, if any. A
    /// report of another attempt (the prompt computed again after a preemption: what was sent
    /// may be garbage) starts over from the first token.
    pub(crate) fn advance(&mut self, attempt: u32, to: usize) -> Option<(usize, usize)> {
        if attempt != self.attempt {
            *self = Self::new(attempt);
        }
        if to <= self.sent {
            return None;
        }
        let from = std::mem::replace(&mut self.sent, to);
        Some((from, to))
    }

    /// The token the final write starts from for KV produced in `attempt`: where the parts
    /// stopped, unless the prompt was computed again since (then from the start).
    pub(crate) fn resume_at(&self, attempt: u32) -> usize {
        if attempt == self.attempt {
            self.sent
        } else {
            0
        }
    }
}

/// What a step's report can go as a part of: our blocks from the first one decode wants, and
/// the tokens after decode's cached ones that are computed and whole shared runs.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Computed {
    pub src: Vec<u32>,
    pub to: usize,
}

/// The part-writable KV of a step that computed `upto` tokens of the prompt into our `blocks`
/// (its whole table), for a registration that skips `skip` cached tokens and wants `wanted`
/// after them; `ours` and `theirs` are the two block sizes. An error says the report is wrong.
pub(crate) fn next_part(
    blocks: &[u32],
    upto: usize,
    (skip, wanted): (usize, usize),
    (ours, theirs): (usize, usize),
) -> Result<Option<Computed>, String> {
    // Decode holds the first `skip` tokens' KV: parts count from there.
    let Some(src) = blocks.get(skip / ours..) else { return Ok(None) };
    let step = shared_run(ours, theirs);
    let to = upto.saturating_sub(skip).min(wanted) / step * step;
    if to / ours > src.len() {
        return Err(format!("a computed step's {} blocks do not cover its {upto} tokens", blocks.len()));
    }
    Ok(Some(Computed { src: src.to_vec(), to }))
}

/// Produced KV as a registration that skips `skip` cached tokens wants it: what is written
/// (and checked) starts after them.
pub(crate) fn skip_cached(produced: &mut Produced, skip: usize, ours: usize) {
    if skip > 0 {
        produced.blocks = produced.blocks.get(skip / ours..).map(<[u32]>::to_vec).unwrap_or_default();
        produced.num_tokens = produced.num_tokens.saturating_sub(skip);
    }
}

/// The final write: our blocks `src` and decode's `dst` from token `from` on (the parts before
/// it are in place), or why the transfer fails instead. `produced` and `wanted` are the tokens
/// prefill produced and decode registered for; `failed`, why a part did not land; `late`,
/// whether a direct writer's deadline has passed.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rest_to_write<'a>(
    (src, dst): (&'a [u32], &'a [u32]),
    (ours, theirs): (usize, usize),
    from: usize,
    produced: usize,
    wanted: usize,
    failed: Option<String>,
    late: bool,
) -> Result<(&'a [u32], &'a [u32]), String> {
    if wanted != produced {
        return Err(format!("decode registered {wanted} tokens, prefill produced {produced}"));
    }
    if let Some(why) = failed {
        return Err(why);
    }
    if late {
        return Err("the decode engine's deadline passed before the KV was ready".into());
    }
    match (src.get(from / ours..), dst.get(from / theirs.max(1)..)) {
        (Some(src), Some(dst)) if from <= produced => Ok((src, dst)),
        _ => Err("the blocks do not cover the KV written so far".into()),
    }
}

/// Decode: what prefill's `Done` with `status` means for a transfer whose bytes have landed
/// (`landed`) or not, the last write into its blocks having failed for `failure` if it did.
pub(crate) fn completion(status: DoneStatus, landed: bool, failure: Option<String>) -> Result<(), String> {
    match status {
        DoneStatus::Ok if landed => Ok(()),
        DoneStatus::Ok => Err(failure.unwrap_or_else(|| "completion arrived without data".into())),
        DoneStatus::Failed(reason) => Err(reason),
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    type Table = Tables<(), ()>;

    fn registration(deadline: Instant) -> Registration<(), ()> {
        Registration { conn: (), blocks: vec![4, 5, 6], num_tokens: 40, skip: 0, deadline, parts: None }
    }

    #[test]
    fn the_rendezvous_meets_in_either_order_and_drops_a_duplicate_half() {
        let later = Instant::now() + Duration::from_secs(9);
        let (a, b) = (TransferId("a".into()), TransferId("b".into()));
        let mut t = Table::default();
        // Produced first, then registered.
        assert!(matches!(meet_produced(&mut t, a.clone(), Produced::example(later)), Rendezvous::Waiting));
        assert!(matches!(meet_produced(&mut t, a.clone(), Produced::example(later)), Rendezvous::Duplicate));
        assert!(matches!(meet_registration(&mut t, a.clone(), registration(later)), Rendezvous::Met(..)));
        assert!(t.pushing.contains(&a) && t.produced.is_empty());
        // Registered first, then produced.
        assert!(matches!(meet_registration(&mut t, b.clone(), registration(later)), Rendezvous::Waiting));
        assert!(matches!(meet_registration(&mut t, b.clone(), registration(later)), Rendezvous::Duplicate));
        assert!(matches!(meet_produced(&mut t, b.clone(), Produced::example(later)), Rendezvous::Met(..)));
        assert!(t.registrations.is_empty() && t.pushing.contains(&b));
    }

    #[test]
    fn kv_produced_for_a_transfer_decode_gave_up_is_freed_on_arrival() {
        let later = Instant::now() + Duration::from_secs(9);
        let gone = TransferId("gone".into());
        let mut t = Table::default();
        t.aborted.insert(gone.clone(), later);
        assert!(matches!(meet_produced(&mut t, gone.clone(), Produced::example(later)), Rendezvous::Aborted));
        assert!(t.produced.is_empty() && t.aborted.is_empty() && t.pushing.is_empty());
    }

    #[test]
    fn a_shared_run_is_whole_blocks_in_both_sizes() {
        assert_eq!(shared_run(16, 16), 16);
        assert_eq!(shared_run(16, 32), 32);
        assert_eq!(shared_run(32, 16), 32);
        assert_eq!(shared_run(4, 6), 12);
        assert_eq!(shared_run(0, 8), 8);
    }

    /// Parts go in whole shared runs after decode's cached tokens; a report of a new attempt
    /// (a preemption) starts the parts over, and the final write resumes where the parts of its
    /// own attempt stopped.
    #[test]
    fn parts_advance_in_shared_runs_and_start_over_after_a_preemption() {
        let table: Vec<u32> = (10..20).collect();
        // 16-token blocks here, 32 there: parts in runs of 32 tokens; decode caches 32.
        let part = next_part(&table, 100, (32, 200), (16, 32)).unwrap().unwrap();
        assert_eq!((part.src.first(), part.to), (Some(&12), 64), "100 - 32 computed: two whole runs");
        let mut p = Progress::new(0);
        assert_eq!(p.advance(0, part.to), Some((0, 64)));
        assert_eq!(p.advance(0, 64), None, "nothing new");
        assert_eq!(p.advance(0, 96), Some((64, 96)));
        assert_eq!(p.resume_at(0), 96);
        assert_eq!(p.advance(1, 32), Some((0, 32)), "computed again: from the start");
        assert_eq!(p.resume_at(0), 0, "KV of another attempt than the parts': all of it");
        // The wanted tokens cap the parts; a table too short for its tokens is an error.
        assert_eq!(next_part(&table, 500, (0, 40), (16, 16)).unwrap().unwrap().to, 32);
        assert!(next_part(&table[..2], 100, (0, 200), (16, 16)).is_err());
    }

    #[test]
    fn the_final_write_is_refused_for_a_mismatch_a_failed_part_or_a_late_writer() {
        let (src, dst): (Vec<u32>, Vec<u32>) = ((0..4).collect(), (10..12).collect());
        let rest = rest_to_write((&src, &dst), (16, 32), 32, 64, 64, None, false).unwrap();
        assert_eq!(rest, (&src[2..], &dst[1..]));
        let err = |r: Result<_, String>| r.unwrap_err();
        assert!(err(rest_to_write((&src, &dst), (16, 32), 0, 64, 60, None, false)).contains("registered 60"));
        assert_eq!(err(rest_to_write((&src, &dst), (16, 32), 0, 64, 64, Some("bad part".into()), false)), "bad part");
        assert!(err(rest_to_write((&src, &dst), (16, 32), 0, 64, 64, None, true)).contains("deadline"));
        assert!(err(rest_to_write((&src, &dst), (16, 32), 96, 64, 64, None, false)).contains("do not cover"));
    }

    #[test]
    fn decode_is_ready_only_on_done_with_its_bytes_landed() {
        assert_eq!(completion(DoneStatus::Ok, true, None), Ok(()));
        assert_eq!(completion(DoneStatus::Ok, false, None), Err("completion arrived without data".into()));
        assert_eq!(completion(DoneStatus::Ok, false, Some("crc".into())), Err("crc".into()));
        assert_eq!(completion(DoneStatus::Failed("x".into()), true, None), Err("x".into()));
    }

    #[test]
    fn a_registration_from_another_epoch_or_off_block_is_refused() {
        assert!(check_registration(Epoch(1), Epoch(1), 32, 16).is_ok());
        assert!(check_registration(Epoch(1), Epoch(2), 0, 16).unwrap_err().contains("epoch"));
        assert!(check_registration(Epoch(1), Epoch(1), 8, 16).unwrap_err().contains("whole number"));
    }
}
