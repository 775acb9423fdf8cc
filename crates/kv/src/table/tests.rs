//! The table's rules, each fed by hand: no threads, no sockets, no sleeps.

use super::*;
use std::time::Duration;

type Table = Tables<(), ()>;

fn incoming<L>(deadline: Instant) -> Incoming<L> {
    Incoming {
        request_id: RequestId::new("r"),
        conn: None,
        blocks: vec![4, 5],
        num_tokens: 20,
        deadline,
        landing: Landing::Waiting,
        ranks: vec![RankLanding::default()],
        writing_upto: 20,
        writing_rank: 0,
        writing_group_end: None,
        first_token: None,
        pull: false,
        direct: false,
        failure: None,
        started: Instant::now(),
        timeline: TransferTimeline::default(),
    }
}

#[test]
fn a_write_lands_once_and_an_abort_during_it_is_reported_at_its_end() {
    let tid = TransferId("t".into());
    let mut t = Table::default();
    t.incoming.insert(tid.clone(), incoming(Instant::now() + Duration::from_secs(9)));
    assert!(matches!(t.begin_write(&TransferId("x".into()), WriteSpan::whole(20, 2), None, 16), Err(NoWrite::Unknown)));
    assert!(
        matches!(t.begin_write(&tid, WriteSpan::whole(19, 2), None, 16), Err(NoWrite::Refused)),
        "token count must match"
    );
    assert!(
        matches!(t.begin_write(&tid, WriteSpan::whole(20, 2), Some(&[4, 6]), 16), Err(NoWrite::Refused)),
        "blocks must match"
    );
    assert_eq!(t.begin_write(&tid, WriteSpan::whole(20, 2), Some(&[4, 5]), 16).ok(), Some(vec![4, 5]));
    assert!(
        matches!(t.begin_write(&tid, WriteSpan::whole(20, 2), None, 16), Err(NoWrite::Refused)),
        "one write at a time"
    );
    assert!(!t.end_write(&tid, true, 100, 1));
    assert_eq!(t.incoming[&tid].landing, Landing::Landed);
    assert_eq!(t.incoming[&tid].timeline.bytes, 100);
    // Aborted while writing: the write's end says so, so the writer releases the request.
    t.begin_write(&tid, WriteSpan::whole(20, 2), None, 16).ok().unwrap();
    t.incoming.get_mut(&tid).unwrap().landing = Landing::WritingAborted;
    assert!(matches!(t.begin_write(&tid, WriteSpan::whole(20, 2), None, 16), Err(NoWrite::Refused)));
    assert!(t.end_write(&tid, false, 0, 0));
}

/// An abort releases at once what no write is landing in, and otherwise marks it so that
/// the write's end releases it; an unknown request is released as it is.
#[test]
fn an_abort_releases_at_once_unless_a_write_is_running_then_at_its_end() {
    let later = Instant::now() + Duration::from_secs(9);
    let mut t = Table::default();
    let (a, b) = (TransferId("a".into()), TransferId("b".into()));
    for (tid, request) in [(&a, "ra"), (&b, "rb")] {
        t.incoming.insert(tid.clone(), Incoming { request_id: RequestId::new(request), ..incoming(later) });
        t.by_request.insert(RequestId::new(request), tid.clone());
    }
    t.begin_write(&b, WriteSpan::whole(20, 2), None, 16).ok().unwrap();
    assert!(matches!(t.abort(&RequestId::new("ra")), Aborted::Now(inc) if inc.request_id == RequestId::new("ra")));
    assert!(!t.incoming.contains_key(&a) && !t.by_request.contains_key(&RequestId::new("ra")));
    assert!(matches!(t.abort(&RequestId::new("rb")), Aborted::AtWriteEnd(_)));
    assert_eq!(t.incoming[&b].landing, Landing::WritingAborted, "held until the write ends");
    assert!(t.end_write(&b, true, 0, 0), "the write's end says it was aborted");
    assert!(matches!(t.abort(&RequestId::new("nobody")), Aborted::Unknown));
}

/// Connection 1 is lost: what waits on it fails, a direct write possibly in flight fails
/// with its blocks held through the grace, one aborted mid-write ends once the grace has
/// passed; connection 2's transfers and registrations are untouched.
#[test]
fn a_lost_connection_fails_what_waits_on_it_and_holds_what_a_direct_writer_may_write() {
    let (now, grace) = (Instant::now(), Duration::from_secs(5));
    let later = now + Duration::from_secs(60);
    let on = |conn: u32, landing, direct| Incoming { conn: Some(conn), landing, direct, ..incoming(later) };
    let mut t: Tables<u32, ()> = Tables::default();
    let tid = |s: &str| TransferId(s.into());
    t.incoming.insert(tid("waiting"), on(1, Landing::Waiting, false));
    t.incoming.insert(tid("direct"), on(1, Landing::Writing, true));
    t.incoming.insert(tid("aborted"), on(1, Landing::WritingAborted, true));
    t.incoming.insert(tid("other"), on(2, Landing::Waiting, false));
    for conn in [1, 2] {
        let reg = Registration { conn, blocks: vec![1], num_tokens: 16, skip: 0, deadline: later, parts: None };
        t.registrations.insert(tid(&format!("reg{conn}")), reg);
    }
    let mut lost: Vec<(usize, Lost)> =
        t.lose_connection(|c| *c == 1, now, grace).into_iter().map(|(i, l)| (i.blocks.len(), l)).collect();
    lost.sort_by_key(|(_, l)| matches!(l, Lost::Failed));
    assert_eq!(lost, vec![(2, Lost::InFlight { writes_until: now + grace }), (2, Lost::Failed)]);
    assert!(t.incoming.contains_key(&tid("other")) && t.registrations.contains_key(&tid("reg2")));
    assert!(!t.registrations.contains_key(&tid("reg1")));
    assert_eq!(t.incoming[&tid("aborted")].deadline, now, "ends by expiry, after the grace");
    assert!(t.expire(now + grace / 2, grace).late.is_empty());
    assert_eq!(t.expire(now + grace, grace).late, vec![tid("aborted")]);
}

/// A push over tcp lands in parts, in order: a part out of order or past the end is
/// refused, a restart from the first token (a preemption) overwrites, and the transfer is
/// `Landed` only once its last write has landed every wanted token.
#[test]
fn parts_land_in_order_and_the_transfer_lands_only_with_the_last() {
    let tid = TransferId("t".into());
    let mut t = Table::default();
    t.incoming.insert(tid.clone(), incoming(Instant::now() + Duration::from_secs(9)));
    let part =
        |from, num_tokens, last| WriteSpan { from, num_tokens, last, layers: 0..2, num_layers: 2, rank: 0, ranks: 1 };
    // 20 tokens in blocks [4, 5] of 16: a part of 16, then the last 4.
    assert!(matches!(t.begin_write(&tid, part(16, 4, true), None, 16), Err(NoWrite::Refused)), "out of order");
    assert!(matches!(t.begin_write(&tid, part(8, 8, false), None, 16), Err(NoWrite::Refused)), "mid-block");
    assert_eq!(t.begin_write(&tid, part(0, 16, false), Some(&[4]), 16).ok(), Some(vec![4]));
    t.end_write(&tid, true, 100, 1);
    assert_eq!((t.incoming[&tid].landing, t.incoming[&tid].landed_upto()), (Landing::Waiting, 16));
    assert!(matches!(t.begin_write(&tid, part(16, 8, true), None, 16), Err(NoWrite::Refused)), "past the end");
    assert!(matches!(t.begin_write(&tid, part(16, 3, true), None, 16), Err(NoWrite::Refused)), "short of it");
    // A part that does not land leaves the transfer where it was.
    assert_eq!(t.begin_write(&tid, part(16, 4, true), None, 16).ok(), Some(vec![5]));
    t.end_write(&tid, false, 0, 0);
    assert_eq!((t.incoming[&tid].landing, t.incoming[&tid].landed_upto()), (Landing::Waiting, 16));
    // Computed again after a preemption: from the first token, over what landed.
    t.begin_write(&tid, part(0, 16, false), None, 16).ok().unwrap();
    t.end_write(&tid, true, 100, 1);
    t.begin_write(&tid, part(16, 4, true), None, 16).ok().unwrap();
    t.end_write(&tid, true, 25, 1);
    assert_eq!(t.incoming[&tid].landing, Landing::Landed);
    assert_eq!(t.incoming[&tid].timeline.bytes, 125, "counted from the restart");
}

#[test]
fn a_spans_groups_of_layers_land_in_layer_order_and_its_tokens_count_with_the_last() {
    let tid = TransferId("t".into());
    let mut t = Table::default();
    t.incoming.insert(tid.clone(), incoming(Instant::now() + Duration::from_secs(9)));
    // 20 tokens of 3 layers in blocks [4, 5] of 16: tokens 0..16 in groups 0..1, 1..3.
    let group = |from, num_tokens, layers: Range<usize>, last| WriteSpan {
        from,
        num_tokens,
        last,
        layers,
        num_layers: 3,
        rank: 0,
        ranks: 1,
    };
    let refused = |t: &mut Table, span, why| {
        assert!(matches!(t.begin_write(&tid, span, None, 16), Err(NoWrite::Refused)), "{why}");
    };
    refused(&mut t, group(0, 16, 1..3, false), "a later group before the first");
    refused(&mut t, group(0, 16, 2..4, false), "past the last layer");
    refused(&mut t, group(0, 20, 0..1, true), "a last write short of the last layer");
    t.begin_write(&tid, group(0, 16, 0..1, false), None, 16).ok().unwrap();
    t.end_write(&tid, true, 10, 1);
    assert_eq!(t.incoming[&tid].landed_upto(), 0, "one group is not the tokens' KV");
    refused(&mut t, group(0, 16, 2..3, false), "a group skipped");
    refused(&mut t, group(0, 8, 1..3, false), "another span");
    refused(&mut t, group(16, 4, 0..3, true), "the next span before this one's groups");
    t.begin_write(&tid, group(0, 16, 1..3, false), None, 16).ok().unwrap();
    t.end_write(&tid, true, 20, 1);
    assert_eq!((t.incoming[&tid].landed_upto(), t.incoming[&tid].ranks[0].partial), (16, None));
    // A group that does not land: the span's later groups are refused, and the span is
    // written again from its first group (or the prompt from its first token).
    t.begin_write(&tid, group(16, 4, 0..2, false), None, 16).ok().unwrap();
    t.end_write(&tid, false, 0, 0);
    refused(&mut t, group(16, 4, 2..3, true), "the rest of a span whose first group failed");
    t.begin_write(&tid, group(16, 4, 0..3, true), None, 16).ok().unwrap();
    t.end_write(&tid, true, 5, 1);
    assert_eq!((t.incoming[&tid].landing, t.incoming[&tid].landed_upto()), (Landing::Landed, 20));
    // Computed again from the first token, group by group, over what landed.
    t.incoming.get_mut(&tid).unwrap().landing = Landing::Waiting;
    t.begin_write(&tid, group(0, 16, 0..2, false), None, 16).ok().unwrap();
    t.end_write(&tid, true, 10, 1);
    assert_eq!((t.incoming[&tid].landed_upto(), t.incoming[&tid].ranks[0].partial), (0, Some((16, 2))));
}

/// A tensor-parallel writer's ranks each land their heads in order, interleaved with the
/// others': the tokens count once every rank has landed them, a rank count that changes midway
/// is refused, and the KV is complete only with every rank's `Done`.
#[test]
fn each_ranks_heads_land_in_order_and_the_transfer_with_every_rank() {
    let tid = TransferId("t".into());
    let mut t = Table::default();
    t.incoming.insert(tid.clone(), incoming(Instant::now() + Duration::from_secs(9)));
    let slice = |from, num_tokens, layers: Range<usize>, last, rank| WriteSpan {
        from,
        num_tokens,
        last,
        layers,
        num_layers: 2,
        rank,
        ranks: 2,
    };
    let refused = |t: &mut Table, span, why| {
        assert!(matches!(t.begin_write(&tid, span, None, 16), Err(NoWrite::Refused)), "{why}");
    };
    refused(&mut t, WriteSpan { ranks: 0, ..slice(0, 16, 0..2, false, 0) }, "no ranks");
    refused(
        &mut t,
        WriteSpan { ranks: MAX_RANKS + 1, ..slice(0, 16, 0..2, false, 0) },
        "more ranks than any engine has",
    );
    refused(&mut t, slice(0, 16, 0..2, false, 2), "a rank past the count");
    // Tokens 0..16 group by group, rank 0 then rank 1 each group; then the last 4 tokens.
    for (layers, rank) in [(0..1, 0), (0..1, 1), (1..2, 0)] {
        t.begin_write(&tid, slice(0, 16, layers, false, rank), None, 16).ok().unwrap();
        t.end_write(&tid, true, 10, 1);
    }
    assert_eq!(t.incoming[&tid].ranks[0].landed_upto, 16);
    assert_eq!(t.incoming[&tid].landed_upto(), 0, "rank 1 has not landed its last group");
    refused(&mut t, WriteSpan { ranks: 4, ..slice(0, 16, 1..2, false, 1) }, "the rank count changed");
    refused(&mut t, slice(16, 4, 0..2, false, 1), "rank 1's next span before its last group");
    t.begin_write(&tid, slice(0, 16, 1..2, false, 1), None, 16).ok().unwrap();
    t.end_write(&tid, true, 10, 1);
    assert_eq!(t.incoming[&tid].landed_upto(), 16);
    t.begin_write(&tid, slice(16, 4, 0..2, false, 0), None, 16).ok().unwrap();
    t.end_write(&tid, true, 5, 1);
    assert_eq!(t.incoming[&tid].landing, Landing::Waiting, "rank 1's last tokens are still to come");
    t.begin_write(&tid, slice(16, 4, 0..2, true, 1), None, 16).ok().unwrap();
    t.end_write(&tid, true, 5, 1);
    assert_eq!(t.incoming[&tid].landing, Landing::Landed);
    let inc = t.incoming.get_mut(&tid).unwrap();
    assert_eq!(inc.rank_done(1, 2), Ok(false), "rank 0's Done is still to come");
    assert!(inc.rank_done(0, 3).is_err(), "a Done of another rank count");
    assert_eq!(inc.rank_done(0, 2), Ok(true));
}

#[test]
fn expiry_spares_writes_and_reads_in_progress() {
    let past = Instant::now() - Duration::from_millis(1);
    let mut t = Table::default();
    let (a, b) = (TransferId("a".into()), TransferId("b".into()));
    t.incoming.insert(a.clone(), incoming(past));
    t.incoming.insert(b.clone(), incoming(past));
    t.begin_write(&b, WriteSpan::whole(20, 2), None, 16).ok().unwrap();
    t.produced.insert(a.clone(), Produced::example(past));
    t.produced.insert(b.clone(), Produced { reading: true, ..Produced::example(past) });
    let e = t.expire(Instant::now(), Duration::ZERO);
    assert_eq!((e.reclaimed, e.late), (1, vec![a.clone()]));
    assert!(t.produced.contains_key(&b) && !t.produced.contains_key(&a));
}

/// A peer that writes directly may still be writing at the deadline: such an entry ends at
/// the deadline as in flight (its blocks held through the grace); one the engine aborted
/// ends only after the grace, since its blocks are freed when it ends.
#[test]
fn expiry_holds_a_direct_writers_blocks_through_the_grace() {
    let past = Instant::now() - Duration::from_millis(5);
    let mut t = Table::default();
    let (c, d) = (TransferId("c".into()), TransferId("d".into()));
    t.incoming.insert(c.clone(), Incoming { direct: true, landing: Landing::Writing, ..incoming(past) });
    t.incoming.insert(d.clone(), Incoming { direct: true, landing: Landing::WritingAborted, ..incoming(past) });
    let within = t.expire(Instant::now(), Duration::from_secs(5));
    assert_eq!((within.late, within.late_in_flight), (vec![], vec![c.clone()]), "within the grace");
    t.incoming.remove(&c);
    assert_eq!(t.expire(Instant::now(), Duration::from_millis(1)).late, vec![d]);
}
