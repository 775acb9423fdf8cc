//! Pull: the prefill engine holds, the decode engine drives.
//!
//! The sequence (shared/SEED.md's pull):
//! 1. register: prefill finishes the prompt and keeps its blocks under a lease (`Produced`, its
//!    deadline the lease time), answering the router with their ids;
//! 2. rendezvous: decode, given those ids, connects and checks prefill's epoch is the one that
//!    produced the KV ([`read_request`]), then sends `ReadBlocks`;
//! 3. read: prefill checks the read against the lease and marks it being read, so the lease
//!    cannot expire under it ([`begin_read`]); its transport answers (`BlockData` and the
//!    bytes, or a direct copy, or a grant for decode to read itself, [`grant`]);
//! 4. notify/release: decode lands the bytes and sends `Done` (the release), before its engine
//!    hears `Ready`; prefill frees the blocks on it ([`release`]), or on the router's word as the
//!    request ends, remembering the id so that decode's later release still counts;
//! 5. fail: a read of an expired or released lease is refused and counted, never served from
//!    reused blocks; decode's heartbeats ([`extend`]) keep a lease it still waits for alive.
//!
//! These are the rules alone, over the transfer table; the agent's threads carry them out.

use std::time::{Duration, Instant};

use tandem_core::{Epoch, TransferId};

use crate::table::Tables;

/// What decode knows of the KV it will read (from the prefill leg's `kv_transfer_params`).
pub(crate) struct Lease {
    pub epoch: Epoch,
    pub blocks: Vec<u32>,
    pub num_tokens: usize,
}

/// Decode: the holder's blocks a read of `lease` skipping `skip` cached tokens takes (the holder
/// cuts them at `skip` by its own block size `theirs`), or why the read cannot even be asked:
/// the holder restarted since it produced the KV (`now`: its epoch at handshake).
pub(crate) fn read_request(lease: &Lease, now: Epoch, theirs: usize, skip: usize) -> Result<Vec<u32>, String> {
    if now != lease.epoch {
        return Err(format!(
            "restarted (epoch {} now, the KV was produced under epoch {}): its blocks are gone",
            now.0, lease.epoch.0
        ));
    }
    let from = (skip / theirs.max(1)).min(lease.blocks.len());
    Ok(lease.blocks[from..].to_vec())
}

/// Why a read is refused.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Refusal {
    pub reason: String,
    /// No lease under the id (unknown, released or expired): counted.
    pub unknown: bool,
}

/// What a read asks of a lease: its blocks and tokens as decode was told them, the tokens it
/// holds already, and whether a direct writer would start after decode's deadline.
pub(crate) struct ReadAsk<'a> {
    pub blocks: &'a [u32],
    pub num_tokens: usize,
    pub skip: usize,
    pub too_late: bool,
}

/// Prefill: checks a read of `tid` against its lease and marks the lease being read (it cannot
/// expire until [`end_read`]); returns our blocks from the first one decode does not hold.
pub(crate) fn begin_read<L, W>(
    t: &mut Tables<L, W>,
    tid: &TransferId,
    ask: ReadAsk<'_>,
    ours: usize,
) -> Result<Vec<u32>, Refusal> {
    let ReadAsk { blocks, num_tokens, skip, too_late } = ask;
    let refuse = |reason: String| Err(Refusal { reason, unknown: false });
    match t.produced.get_mut(tid) {
        Some(_) if too_late => refuse("the decode engine's deadline has passed".into()),
        Some(_) if !skip.is_multiple_of(ours) || (skip > 0 && skip >= num_tokens) => {
            refuse(format!("{skip} cached tokens is not a whole number of {ours}-token blocks before the last"))
        }
        Some(p) if p.blocks.starts_with(blocks) && p.num_tokens == num_tokens && !p.reading => {
            p.reading = true;
            Ok(p.blocks.get(skip / ours..).map(<[u32]>::to_vec).unwrap_or_default())
        }
        Some(_) => refuse("blocks or token count do not match the lease".into()),
        None => Err(Refusal {
            reason: format!("no KV held for transfer `{tid}` (unknown, released or lease expired)"),
            unknown: true,
        }),
    }
}

/// Prefill: the answer to a read of `tid` has gone. A read that failed in-band (before a byte
/// was sent) ends the lease: decode fails the transfer and will not read again.
pub(crate) fn end_read<L, W>(t: &mut Tables<L, W>, tid: &TransferId, failed_in_band: bool) {
    if failed_in_band {
        t.produced.remove(tid);
    } else if let Some(p) = t.produced.get_mut(tid) {
        p.reading = false;
    }
}

/// How long a holder that grants a read keeps the lease from its answer: decode's read must
/// end within it of asking.
pub(crate) fn grant_validity(io: Duration, lease: Duration) -> Duration {
    io.min(lease)
}

/// Prefill: grants decode the read of `tid`, keeping the lease at least `validity` from `now`.
pub(crate) fn grant<L, W>(t: &mut Tables<L, W>, tid: &TransferId, validity: Duration, now: Instant) {
    if let Some(p) = t.produced.get_mut(tid) {
        p.deadline = p.deadline.max(now + validity);
    }
}

/// Prefill: decode released the lease of `tid`. Whether there was one (freed now, or already
/// on the router's word as the request ended).
pub(crate) fn release<L, W>(t: &mut Tables<L, W>, tid: &TransferId) -> bool {
    t.produced.remove(tid).is_some() || t.released.remove(tid).is_some()
}

/// Prefill: decode still waits for these transfers; their leases last at least until `until`.
pub(crate) fn extend<L, W>(t: &mut Tables<L, W>, tids: Vec<TransferId>, until: Instant) {
    for tid in tids {
        if let Some(p) = t.produced.get_mut(&tid) {
            p.deadline = p.deadline.max(until);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::Produced;

    type Table = Tables<(), ()>;

    fn lease(t: &mut Table, tid: &TransferId, deadline: Instant) {
        t.produced.insert(tid.clone(), Produced::example(deadline));
    }

    fn ask(blocks: &[u32], skip: usize) -> ReadAsk<'_> {
        ReadAsk { blocks, num_tokens: 40, skip, too_late: false }
    }

    #[test]
    fn a_read_after_a_restart_is_never_asked() {
        let l = Lease { epoch: Epoch(5), blocks: vec![1, 2, 3], num_tokens: 40 };
        assert_eq!(read_request(&l, Epoch(5), 16, 16), Ok(vec![2, 3]));
        assert!(read_request(&l, Epoch(6), 16, 0).unwrap_err().contains("restarted"));
    }

    /// A lease being read cannot be read twice or expire; one released (or never there) is
    /// refused and counted as unknown, so decode recomputes rather than reading reused blocks.
    #[test]
    fn a_lease_is_read_once_and_a_released_one_is_refused() {
        let tid = TransferId("t".into());
        let mut t = Table::default();
        lease(&mut t, &tid, Instant::now() - Duration::from_millis(1));
        assert_eq!(begin_read(&mut t, &tid, ask(&[1, 2, 3], 16), 16), Ok(vec![2, 3]));
        assert!(!begin_read(&mut t, &tid, ask(&[1, 2, 3], 0), 16).unwrap_err().unknown, "being read");
        assert!(t.expire(Instant::now(), Duration::ZERO).reclaimed == 0, "no expiry under a read");
        end_read(&mut t, &tid, false);
        assert!(release(&mut t, &tid));
        let refused = begin_read(&mut t, &tid, ask(&[1, 2, 3], 0), 16).unwrap_err();
        assert!(refused.unknown && refused.reason.contains("no KV held"), "{refused:?}");
        assert!(!release(&mut t, &tid), "released once");
    }

    #[test]
    fn a_read_that_does_not_match_its_lease_is_refused() {
        let tid = TransferId("t".into());
        let mut t = Table::default();
        lease(&mut t, &tid, Instant::now() + Duration::from_secs(9));
        let refused = |t: &mut Table, a| begin_read(t, &tid, a, 16).unwrap_err().reason;
        assert!(refused(&mut t, ask(&[1, 9], 0)).contains("do not match"));
        assert!(refused(&mut t, ask(&[1, 2, 3], 8)).contains("whole number"));
        assert!(refused(&mut t, ReadAsk { too_late: true, ..ask(&[1, 2, 3], 0) }).contains("deadline"));
        // A read that failed before a byte went ends the lease.
        begin_read(&mut t, &tid, ask(&[1, 2, 3], 0), 16).unwrap();
        end_read(&mut t, &tid, true);
        assert!(t.produced.is_empty());
    }

    /// Decode's release may come after the router had prefill free the lease: it still counts.
    #[test]
    fn a_release_after_the_routers_word_still_counts() {
        let tid = TransferId("t".into());
        let mut t = Table::default();
        t.released.insert(tid.clone(), Instant::now() + Duration::from_secs(30));
        assert!(release(&mut t, &tid));
        assert!(!release(&mut t, &tid));
    }

    #[test]
    fn heartbeats_and_grants_only_ever_lengthen_a_lease() {
        let tid = TransferId("t".into());
        let now = Instant::now();
        let mut t = Table::default();
        lease(&mut t, &tid, now + Duration::from_secs(10));
        extend(&mut t, vec![tid.clone(), TransferId("gone".into())], now + Duration::from_secs(5));
        assert_eq!(t.produced[&tid].deadline, now + Duration::from_secs(10));
        grant(&mut t, &tid, grant_validity(Duration::from_secs(30), Duration::from_secs(20)), now);
        assert_eq!(t.produced[&tid].deadline, now + Duration::from_secs(20));
    }
}
