//! Two connectors (prefill and decode) over loopback, each with its own KV memory: push in
//! both rendezvous orders, pull with release, lease expiry refusing a late read, a dropped
//! completion notification, and abort. Then the same two over the local transport, where
//! prefill writes decode's blocks directly (the protocol cuda-ipc uses): an abort while
//! prefill may write, and a prefill that becomes ready only after decode's deadline. Every
//! wait is bounded.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_compute::cuda::HostSignal;
use tandem_compute::{KvCache, KvLayout};
use tandem_core::{EngineId, Epoch, RemoteKv, RequestId, TransferId};
use tandem_kv::channel::Timeouts;
use tandem_kv::{ConnectorConfig, ConnectorEvent, FaultInjection, KvConnector, KvFences, KvMode, Role};

fn layout(bs: usize) -> KvLayout {
    KvLayout { num_layers: 2, num_kv_heads: 2, head_dim: 8, block_size: bs, num_blocks: 32 }
}

fn config(role: Role, mode: KvMode) -> ConnectorConfig {
    ConnectorConfig {
        engine_id: EngineId(format!("{role:?}").to_lowercase()),
        role,
        mode,
        listen: "127.0.0.1:0".into(),
        advertise_host: "127.0.0.1".into(),
        model_fingerprint: "test".into(),
        timeouts: Timeouts { connect: Duration::from_secs(2), io: Duration::from_secs(2) },
        lease: Duration::from_millis(600),
        transfer_timeout: Duration::from_millis(800),
        liveness: Duration::from_secs(10),
        faults: FaultInjection::default(),
        local_transport: false,
        transport: tandem_kv::KvTransport::Auto,
        verify: false,
        // Every tcp pair here stripes its bytes over three streams (the tests' KV is a few
        // pages: each stream carries some).
        tcp_streams: 3,
        // The sends' copies queued ahead (on a CPU engine: each group's host fence waited for
        // in turn, as without it); router and process tests run the default.
        stage_ahead: true,
        tp_size: 1,
        nixl_min_gb_s: 0.0,
        nixl_pull: tandem_kv::NixlPull::Auto,
        ucx_log: None,
        cluster_secret: None,
        tls: None,
    }
}

/// Counts drops: stands in for the engine's block allocation.
struct Held(Arc<AtomicUsize>);
impl Drop for Held {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

struct Pair {
    p: KvConnector,
    d: KvConnector,
    p_cache: KvCache,
    d_cache: KvCache,
    freed: Arc<AtomicUsize>,
    events: std::sync::mpsc::Receiver<ConnectorEvent>,
}

fn pair(mode: KvMode, p_bs: usize, d_bs: usize, faults: FaultInjection) -> Pair {
    let p_cfg = ConnectorConfig { faults, ..config(Role::Prefill, mode) };
    pair_with(p_cfg, config(Role::Decode, mode), p_bs, d_bs)
}

/// Prefill (with `faults`) and decode over tcp or, with `local`, the local transport.
fn pair_over(local: bool, mode: KvMode, faults: FaultInjection, lease: Duration) -> Pair {
    let p_cfg = ConnectorConfig { local_transport: local, faults, lease, ..config(Role::Prefill, mode) };
    pair_with(p_cfg, ConnectorConfig { local_transport: local, lease, ..config(Role::Decode, mode) }, 16, 8)
}

/// Prefill and decode over the local transport (prefill copies into decode's blocks itself),
/// prefill waiting `p_timeout` for registrations.
fn local_pair(mode: KvMode, p_bs: usize, d_bs: usize, p_timeout: Duration) -> Pair {
    pair_via(true, mode, p_bs, d_bs, p_timeout)
}

/// As [`local_pair`], over the local transport or (`local` false) tcp.
fn pair_via(local: bool, mode: KvMode, p_bs: usize, d_bs: usize, p_timeout: Duration) -> Pair {
    let p_cfg = ConnectorConfig { local_transport: local, transfer_timeout: p_timeout, ..config(Role::Prefill, mode) };
    pair_with(p_cfg, ConnectorConfig { local_transport: local, ..config(Role::Decode, mode) }, p_bs, d_bs)
}

fn pair_with(p_cfg: ConnectorConfig, d_cfg: ConnectorConfig, p_bs: usize, d_bs: usize) -> Pair {
    let mut p_cache = KvCache::new(layout(p_bs));
    let d_cache = KvCache::new(layout(d_bs));
    for t in 0..40 {
        for l in 0..2 {
            let k: Vec<f32> = (0..16).map(|i| (t * 100 + l * 10 + i) as f32).collect();
            p_cache.write_token(l, 3 + t / p_bs, t % p_bs, &k, &k);
        }
    }
    // Prefill's events are none of these tests' business; decode's go to `events`.
    let p = KvConnector::start(p_cfg, p_cache.region(), Box::new(|_| {})).unwrap();
    let (tx, events) = std::sync::mpsc::channel();
    let sink = Box::new(move |ev| {
        let _ = tx.send(ev);
    });
    let d = KvConnector::start(d_cfg, d_cache.region(), sink).unwrap();
    Pair { p, d, p_cache, d_cache, freed: Arc::new(AtomicUsize::new(0)), events }
}

impl Pair {
    fn p_addr(&self) -> String {
        self.p.info().tcp_addr().unwrap().to_string()
    }

    fn produce(&self, tid: &str, tokens: usize) {
        self.produce_in(tid, tokens, 0);
    }

    /// Produces the prompt's 40 tokens of KV (blocks 3 on) computed in `attempt`.
    fn produce_in(&self, tid: &str, tokens: usize, attempt: u32) {
        let blocks = self.p_blocks(tokens);
        self.p.produced(TransferId(tid.into()), Box::new(Held(self.freed.clone())), blocks, tokens, 77, attempt);
    }

    /// Prefill's blocks holding the test KV (3 on).
    fn p_blocks(&self, tokens: usize) -> Vec<u32> {
        let bs = self.p_cache.layout().block_size;
        (0..tokens.div_ceil(bs) as u32).map(|b| b + 3).collect()
    }

    fn d_blocks(&self, tokens: usize) -> Vec<u32> {
        let bs = self.d_cache.layout().block_size;
        (0..tokens.div_ceil(bs) as u32).map(|b| 30 - b).collect()
    }

    fn wait_event(&self) -> ConnectorEvent {
        self.events.recv_timeout(Duration::from_secs(5)).expect("no connector event within 5 s")
    }

    fn wait_freed(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.freed.load(Ordering::SeqCst) < n {
            assert!(Instant::now() < deadline, "prefill blocks not freed");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn assert_landed(&self, tokens: usize, d_blocks: &[u32]) {
        let (pb, db) = (self.p_cache.layout().block_size, self.d_cache.layout().block_size);
        for t in 0..tokens {
            for l in 0..2 {
                for kv in 0..2 {
                    let a = &self.p_cache.plane(3 + t / pb, l, kv, 1)[(t % pb) * 8..][..8];
                    let b = &self.d_cache.plane(d_blocks[t / db] as usize, l, kv, 1)[(t % db) * 8..][..8];
                    assert_eq!(a, b, "token {t}");
                }
            }
        }
    }
}

/// The event is `Ready` for `id` with prefill's first token, and its timeline is coherent:
/// bytes moved, at least one region, stages in order.
fn assert_ready(ev: ConnectorEvent, id: &str) {
    match ev {
        ConnectorEvent::Ready { request_id, first_token, timeline: t } => {
            assert_eq!((request_id, first_token), (RequestId::new(id), Some(77)));
            assert!(t.bytes > 0 && t.regions >= 1, "{t:?}");
            assert!(t.data_start_us <= t.data_end_us && t.data_end_us <= t.ready_us, "{t:?}");
        }
        other => panic!("expected Ready for {id}, got {other:?}"),
    }
}

impl Pair {
    /// Whether every element of decode's `blocks` is still zero (nothing landed there).
    fn untouched(&self, blocks: &[u32]) -> bool {
        blocks.iter().all(|&b| {
            (0..2).all(|l| {
                (0..2).all(|kv| (0..2).all(|h| self.d_cache.plane(b as usize, l, kv, h).iter().all(|&x| x == 0.0)))
            })
        })
    }
}

/// The pull lease for 40 tokens that [`Pair::produce`] holds under `tid`, produced in `epoch`.
fn pull_source(p: &Pair, tid: &str, epoch: Epoch) -> RemoteKv {
    let n = p.p_cache.layout().blocks_for(40) as u32;
    RemoteKv::PullFrom {
        transfer_id: TransferId(tid.into()),
        peer: p.p_addr(),
        peer_engine: None,
        epoch,
        blocks: (3..3 + n).collect(),
        num_tokens: 40,
        first_token: 77,
    }
}

fn push_source(p: &Pair, tid: &str) -> RemoteKv {
    RemoteKv::PushFrom { transfer_id: TransferId(tid.into()), peer: p.p_addr(), peer_engine: None }
}

#[test]
fn push_in_both_orders_with_different_block_sizes() {
    let p = pair(KvMode::Push, 16, 4, FaultInjection::default());
    let (tokens, blocks) = (37, p.d_blocks(37));
    // Registration first.
    p.d.expect(RequestId::new("r1"), push_source(&p, "t1"), blocks.clone(), tokens, 0);
    std::thread::sleep(Duration::from_millis(100));
    p.produce("t1", tokens);
    assert_ready(p.wait_event(), "r1");
    p.assert_landed(tokens, &blocks);
    p.wait_freed(1);
    // Produced first.
    p.produce("t2", tokens);
    std::thread::sleep(Duration::from_millis(100));
    p.d.expect(RequestId::new("r2"), push_source(&p, "t2"), blocks.clone(), tokens, 0);
    assert_ready(p.wait_event(), "r2");
    p.wait_freed(2);
    // Counted once decode has acknowledged the bytes.
    wait_until("both writes acknowledged", || p.p.stats().transfers_ok == 2);
    let s = p.p.stats();
    assert_eq!((s.transfers_ok, s.transfers_failed, s.regions), (2, 0, 2), "{s:?}");
}

#[test]
fn pull_reads_then_releases_and_an_expired_lease_refuses_a_late_read() {
    let p = pair(KvMode::Pull, 8, 8, FaultInjection::default());
    let epoch = p.p.info().epoch;
    let src = |tid: &str, epoch: Epoch| pull_source(&p, tid, epoch);
    p.produce("t1", 40);
    let blocks = p.d_blocks(40);
    p.d.expect(RequestId::new("r1"), src("t1", epoch), blocks.clone(), 40, 0);
    assert_ready(p.wait_event(), "r1");
    p.assert_landed(40, &blocks);
    p.wait_freed(1); // released by decode's Done
                     // A lease that expires before decode reads: the read is refused, the blocks were freed.
    p.produce("t2", 40);
    std::thread::sleep(Duration::from_millis(900));
    p.wait_freed(2);
    p.d.expect(RequestId::new("r2"), src("t2", epoch), blocks.clone(), 40, 0);
    match p.wait_event() {
        ConnectorEvent::Failed { request_id, reason } => {
            assert_eq!(request_id, RequestId::new("r2"));
            assert!(reason.contains("lease expired"), "{reason}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert!(p.p.stats().expired >= 1);
    // A stale epoch (prefill restarted) is refused before any read.
    p.produce("t3", 40);
    p.d.expect(RequestId::new("r3"), src("t3", Epoch(epoch.0 + 1)), blocks, 40, 0);
    match p.wait_event() {
        ConnectorEvent::Failed { reason, .. } => assert!(reason.contains("restarted"), "{reason}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn a_dropped_completion_fails_within_the_deadline_and_aborts_release() {
    let p = pair(KvMode::Push, 16, 16, FaultInjection { drop_done: true, ..FaultInjection::default() });
    let blocks = p.d_blocks(20);
    let start = Instant::now();
    p.d.expect(RequestId::new("r1"), push_source(&p, "t1"), blocks.clone(), 20, 0);
    p.produce("t1", 20);
    match p.wait_event() {
        ConnectorEvent::Failed { reason, .. } => assert!(reason.contains("timed out"), "{reason}"),
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(start.elapsed() < Duration::from_secs(3), "bounded by the transfer timeout");
    // Abort while waiting: released at once, and prefill's registration is dropped.
    p.d.expect(RequestId::new("r2"), push_source(&p, "t2"), blocks.clone(), 20, 0);
    std::thread::sleep(Duration::from_millis(100));
    p.d.abort(RequestId::new("r2"));
    assert_eq!(p.wait_event(), ConnectorEvent::Released { request_id: RequestId::new("r2") });
    // Unreachable prefill: a clear failure, not a hang.
    let gone =
        RemoteKv::PushFrom { transfer_id: TransferId("t3".into()), peer: "127.0.0.1:1".into(), peer_engine: None };
    p.d.expect(RequestId::new("r3"), gone, blocks, 20, 0);
    match p.wait_event() {
        ConnectorEvent::Failed { reason, .. } => {
            assert!(reason.contains("127.0.0.1:1"), "{reason}")
        }
        other => panic!("expected unreachable, got {other:?}"),
    }
}

/// The local transport writes decode's blocks directly, in both modes and across block sizes,
/// and reports `Ready` with the bytes in the host region (a GPU engine loads them from there).
#[test]
fn direct_writes_land_in_both_modes_across_block_sizes() {
    let p = local_pair(KvMode::Push, 16, 4, Duration::from_millis(800));
    let (tokens, blocks) = (37, p.d_blocks(37));
    p.d.expect(RequestId::new("r1"), push_source(&p, "t1"), blocks.clone(), tokens, 0);
    std::thread::sleep(Duration::from_millis(100));
    p.produce("t1", tokens);
    assert_ready(p.wait_event(), "r1");
    p.assert_landed(tokens, &blocks);
    p.wait_freed(1);
    assert_eq!((p.p.stats().links_local, p.d.stats().links_local), (1, 1));

    let p = local_pair(KvMode::Pull, 8, 16, Duration::from_millis(800));
    p.produce("t1", 40);
    let blocks = p.d_blocks(40);
    let src = pull_source(&p, "t1", p.p.info().epoch);
    p.d.expect(RequestId::new("r1"), src, blocks.clone(), 40, 0);
    assert_ready(p.wait_event(), "r1");
    p.assert_landed(40, &blocks);
    p.wait_freed(1);
}

/// Decode aborts after registering with a prefill that writes directly: prefill answers that
/// no write will come, so the blocks come back at once (not after the deadline and its
/// grace), and KV produced afterwards never lands in them.
#[test]
fn an_abort_while_prefill_may_write_directly_is_released_at_once_and_nothing_lands_after() {
    let p = local_pair(KvMode::Push, 16, 16, Duration::from_millis(800));
    let blocks = p.d_blocks(20);
    p.d.expect(RequestId::new("r1"), push_source(&p, "t1"), blocks.clone(), 20, 0);
    std::thread::sleep(Duration::from_millis(150)); // the registration has reached prefill
    let start = Instant::now();
    p.d.abort(RequestId::new("r1"));
    assert_eq!(p.wait_event(), ConnectorEvent::Released { request_id: RequestId::new("r1") });
    assert!(start.elapsed() < Duration::from_millis(600), "released in {:?}, not at the deadline", start.elapsed());
    p.produce("t1", 20);
    p.wait_freed(1); // decode gave the transfer up: prefill frees the KV as it comes
    assert!(p.untouched(&blocks), "KV landed in blocks given back");
}

/// Decode gives a push up before prefill has produced its KV, once with the registration on
/// its way (an open connection) and once before decode had even connected (the abort found no
/// connection to tell, and is sent once there is one): either way prefill frees the KV the
/// moment it is produced, not when its wait for a registration (30 s here) runs out, over tcp
/// and over a direct writer.
#[test]
fn kv_produced_after_decode_gave_the_transfer_up_is_freed_at_once() {
    for local in [false, true] {
        let p_cfg = ConnectorConfig {
            local_transport: local,
            transfer_timeout: Duration::from_secs(30),
            ..config(Role::Prefill, KvMode::Push)
        };
        let d_cfg = ConnectorConfig { local_transport: local, ..config(Role::Decode, KvMode::Push) };
        let p = pair_with(p_cfg, d_cfg, 16, 16);
        let blocks = p.d_blocks(20);
        // Before any connection: the abort comes while the connection is being made.
        p.d.expect(RequestId::new("r1"), push_source(&p, "t1"), blocks.clone(), 20, 0);
        p.d.abort(RequestId::new("r1"));
        assert_eq!(p.wait_event(), ConnectorEvent::Released { request_id: RequestId::new("r1") });
        // With the connection open: the registration, then its abort, reach prefill first.
        p.d.expect(RequestId::new("r2"), push_source(&p, "t2"), blocks.clone(), 20, 0);
        std::thread::sleep(Duration::from_millis(100));
        p.d.abort(RequestId::new("r2"));
        assert_eq!(p.wait_event(), ConnectorEvent::Released { request_id: RequestId::new("r2") });
        std::thread::sleep(Duration::from_millis(100)); // both aborts have reached prefill
        let start = Instant::now();
        p.produce("t1", 20);
        p.produce("t2", 20);
        p.wait_freed(2);
        assert!(start.elapsed() < Duration::from_secs(2), "local={local}: freed after {:?}", start.elapsed());
        assert_eq!(p.p.stats().expired, 0, "local={local}: freed by expiry, not by the aborts");
        assert!(p.untouched(&blocks), "local={local}: KV landed in blocks given back");
    }
}

/// A prefill that writes directly gets its KV only after decode's deadline has passed (decode
/// waits 0.8 s, prefill would wait 3 s for a registration): it must not write into blocks
/// decode is about to free. At decode's deadline prefill drops the registration and says so,
/// and decode fails the transfer (whichever comes first: prefill's notice, or decode's own
/// expiry, which holds the blocks through the grace), not after the grace; the blocks stay
/// untouched.
#[test]
fn a_direct_writer_starts_no_write_after_the_decode_deadline() {
    let p = local_pair(KvMode::Push, 16, 16, Duration::from_secs(3));
    let blocks = p.d_blocks(20);
    let start = Instant::now();
    p.d.expect(RequestId::new("r1"), push_source(&p, "t1"), blocks.clone(), 20, 0);
    std::thread::sleep(Duration::from_millis(1000));
    p.produce("t1", 20);
    match p.wait_event() {
        ConnectorEvent::Failed { request_id, reason } => {
            assert_eq!(request_id, RequestId::new("r1"));
            assert!(reason.contains("deadline"), "{reason}");
        }
        ConnectorEvent::FailedInFlight { request_id, reason, writes_until } => {
            assert_eq!(request_id, RequestId::new("r1"));
            assert!(reason.contains("timed out"), "{reason}");
            assert!(writes_until > Instant::now(), "the blocks must be held through the grace");
        }
        other => panic!("expected a failure, got {other:?}"),
    }
    assert!(start.elapsed() < Duration::from_millis(1500), "{:?}", start.elapsed());
    p.wait_freed(1); // at prefill's own deadline: nobody claims the KV
    assert!(p.untouched(&blocks), "a write landed after the deadline");
}

/// A slow write (0.5 s before the bytes move) keeps prefill's source blocks held until it has
/// ended, over tcp and over a direct writer: they are never back in the pool while a copy out
/// of them may still run.
#[test]
fn source_blocks_stay_held_until_a_slow_write_has_ended() {
    for local in [false, true] {
        let slow = FaultInjection { slow_write: Duration::from_millis(500), ..FaultInjection::default() };
        let p = pair_over(local, KvMode::Push, slow, Duration::from_millis(600));
        let blocks = p.d_blocks(40);
        p.d.expect(RequestId::new("r1"), push_source(&p, "t1"), blocks.clone(), 40, 0);
        std::thread::sleep(Duration::from_millis(100));
        p.produce("t1", 40);
        std::thread::sleep(Duration::from_millis(250));
        assert_eq!(p.freed.load(Ordering::SeqCst), 0, "local={local}: blocks freed while their write was pending");
        assert_ready(p.wait_event(), "r1");
        p.assert_landed(40, &blocks);
        p.wait_freed(1);
    }
}

/// Decode's timeline of a push tells where the time went although a direct writer's copies run
/// in prefill's process: the transfer leg spans the writer's time from taking the transfer on
/// (here 0.3 s of injected delay) to its copies' end, and both transports carry when prefill
/// handed the KV over (wall clock), which the engine times to its applying the KV.
#[test]
fn a_push_timeline_shows_a_direct_writers_copy_and_when_prefill_handed_the_kv_over() {
    let unix_us = || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_micros() as u64;
    for local in [false, true] {
        let slow = FaultInjection { slow_write: Duration::from_millis(300), ..FaultInjection::default() };
        let p = pair_over(local, KvMode::Push, slow, Duration::from_secs(5));
        let blocks = p.d_blocks(40);
        p.d.expect(RequestId::new("r1"), push_source(&p, "t1"), blocks.clone(), 40, 0);
        std::thread::sleep(Duration::from_millis(50));
        let before = unix_us();
        p.produce("t1", 40);
        let ev = p.wait_event();
        let after = unix_us();
        let ConnectorEvent::Ready { timeline: t, .. } = ev else { panic!("local={local}: expected Ready, got {ev:?}") };
        assert!(
            (before..=after).contains(&t.produced_unix_us),
            "local={local}: handed over at {} outside {before}..{after}",
            t.produced_unix_us
        );
        let leg = t.data_end_us - t.data_start_us;
        if local {
            assert!(leg >= 300_000, "local: the direct write's 0.3 s shows as a {leg} us transfer: {t:?}");
        }
        assert!(t.request_sent_us <= t.data_start_us && t.data_end_us <= t.ready_us, "local={local}: {t:?}");
        p.wait_freed(1);
    }
}

/// Decode's key for head 1 of `token` in layer `l` (its registered `blocks`).
fn d_key(p: &Pair, blocks: &[u32], token: usize, l: usize) -> Vec<f32> {
    let db = p.d_cache.layout().block_size;
    p.d_cache.plane(blocks[token / db] as usize, l, 0, 1)[(token % db) * 8..][..8].to_vec()
}

/// The key `pair_with` wrote for head 1 of `token` in layer `l`.
fn written_key(token: usize, l: usize) -> Vec<f32> {
    (8..16).map(|i| (token * 100 + l * 10 + i) as f32).collect()
}

/// Waits (bounded) until `cond` holds.
fn wait_until(what: &str, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !cond() {
        assert!(Instant::now() < deadline, "{what} never happened");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A prompt computed in chunks goes into decode's blocks as it is computed (copied by a direct
/// writer, or sent over tcp): each reported step's whole shared runs of tokens (8 here: 4-token
/// blocks into 8-token blocks) land before the prompt is complete, and the final write moves
/// only the rest. KV changed in prefill's blocks after its part was written is not written
/// again, which is how the test tells the final write started where the parts stopped.
#[test]
fn a_prompt_computed_in_chunks_lands_part_by_part_and_the_final_write_moves_only_the_rest() {
    for local in [true, false] {
        chunks_land_part_by_part(local);
    }
}

fn chunks_land_part_by_part(local: bool) {
    let mut p = pair_via(local, KvMode::Push, 4, 8, Duration::from_secs(3));
    let (tokens, blocks) = (37, p.d_blocks(37));
    let tid = TransferId("t1".into());
    p.d.expect(RequestId::new("r1"), push_source(&p, "t1"), blocks.clone(), tokens, 0);
    std::thread::sleep(Duration::from_millis(150)); // the registration has reached prefill
    p.p.computed(tid.clone(), p.p_blocks(tokens), 13, 0, KvFences::complete());
    wait_until("the first part landing", || (0..8).all(|t| d_key(&p, &blocks, t, 1) == written_key(t, 1)));
    assert!(p.untouched(&blocks[1..]), "tokens past the first whole run were written early");
    p.p.computed(tid.clone(), p.p_blocks(tokens), 30, 0, KvFences::complete());
    wait_until("the second part", || p.p.stats().parts_early == 2);
    assert!((8..24).all(|t| d_key(&p, &blocks, t, 1) == written_key(t, 1)));
    assert!(p.untouched(&blocks[3..]), "tokens 24.. were written before they were reported");
    for t in 0..24 {
        let k = vec![-1.0; 16];
        p.p_cache.write_token(1, 3 + t / 4, t % 4, &k, &k);
    }
    p.produce("t1", tokens);
    assert_ready(p.wait_event(), "r1");
    p.wait_freed(1);
    for t in 0..tokens {
        assert_eq!(d_key(&p, &blocks, t, 1), written_key(t, 1), "token {t}");
    }
    // Over tcp prefill counts the transfer when decode's acknowledgement comes, after Ready.
    wait_until("the write acknowledged", || p.p.stats().transfers_ok + p.p.stats().transfers_failed > 0);
    let s = p.p.stats();
    assert_eq!((s.parts_early, s.transfers_ok, s.transfers_failed), (2, 1, 0), "local {local}: {s:?}");
}

/// A step reported before decode's registration reaches prefill (the two legs start at once,
/// and a GPU engine reports a step as it submits it) is written as soon as the registration
/// comes, before the prompt is complete; a report for a transfer nobody registers for is
/// dropped once the prompt ends.
#[test]
fn a_step_reported_before_the_registration_is_written_when_it_comes() {
    for local in [true, false] {
        written_when_registered(local);
    }
}

fn written_when_registered(local: bool) {
    let p = pair_via(local, KvMode::Push, 4, 8, Duration::from_secs(3));
    let (tokens, blocks) = (37, p.d_blocks(37));
    let tid = TransferId("t1".into());
    p.p.computed(tid.clone(), p.p_blocks(tokens), 30, 0, KvFences::complete());
    std::thread::sleep(Duration::from_millis(100)); // prefill has the report, not the registration
    assert_eq!(p.p.stats().parts_early, 0);
    p.d.expect(RequestId::new("r1"), push_source(&p, "t1"), blocks.clone(), tokens, 0);
    wait_until("the part written on registration", || p.p.stats().parts_early == 1);
    // Over tcp prefill counts the part once sent; it lands on decode's side a moment later.
    wait_until("the part landed", || (0..24).all(|t| d_key(&p, &blocks, t, 1) == written_key(t, 1)));
    assert!(p.untouched(&blocks[3..]), "tokens 24.. were written before they were reported");
    p.produce("t1", tokens);
    assert_ready(p.wait_event(), "r1");
    p.assert_landed(tokens, &blocks);
    p.wait_freed(1);
    // Reported, then abandoned before any registration: a later registration gets no part.
    let other = TransferId("t2".into());
    p.p.computed(other.clone(), p.p_blocks(tokens), 30, 0, KvFences::complete());
    p.p.abandon(other, "prefill request aborted".into());
    std::thread::sleep(Duration::from_millis(100));
    p.d.expect(RequestId::new("r2"), push_source(&p, "t2"), blocks, tokens, 0);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(p.p.stats().parts_early, 1, "an abandoned prompt's report was written");
}

/// A part reported under an earlier attempt (before the request was preempted: its blocks may
/// have been reused and the copy read garbage) is written again: a later report, or the
/// final write, of another attempt starts over from the first token.
#[test]
fn kv_reported_before_a_preemption_is_written_again() {
    for (report_again, local) in [(false, true), (true, true), (false, false), (true, false)] {
        let p = pair_via(local, KvMode::Push, 4, 8, Duration::from_secs(3));
        let (tokens, blocks) = (37, p.d_blocks(37));
        let tid = TransferId("t1".into());
        p.d.expect(RequestId::new("r1"), push_source(&p, "t1"), blocks.clone(), tokens, 0);
        std::thread::sleep(Duration::from_millis(150));
        // Attempt 0 reports blocks holding zeros (what a reused block's copy could read).
        let stale: Vec<u32> = (20..30).collect();
        p.p.computed(tid.clone(), stale, 16, 0, KvFences::complete());
        wait_until("the stale part", || p.p.stats().parts_early == 1);
        if report_again {
            p.p.computed(tid.clone(), p.p_blocks(tokens), 16, 1, KvFences::complete());
            wait_until("the part written again", || p.p.stats().parts_early == 2);
        }
        p.produce_in("t1", tokens, 1);
        assert_ready(p.wait_event(), "r1");
        p.assert_landed(tokens, &blocks);
        p.wait_freed(1);
    }
}

/// Decode aborts, or prefill abandons the request, while an early part is being written
/// (0.4 s of injected delay before its copy): decode hears that nothing more will come only
/// after the part has ended, so its blocks come back with no copy into them left.
#[test]
fn an_end_during_an_early_part_is_reported_after_the_part_and_nothing_lands_after() {
    for decode_aborts in [true, false] {
        let slow = FaultInjection { slow_write: Duration::from_millis(400), ..FaultInjection::default() };
        let p_cfg = ConnectorConfig { local_transport: true, faults: slow, ..config(Role::Prefill, KvMode::Push) };
        let d_cfg = ConnectorConfig { local_transport: true, ..config(Role::Decode, KvMode::Push) };
        let p = pair_with(p_cfg, d_cfg, 4, 8);
        let blocks = p.d_blocks(37);
        let tid = TransferId("t1".into());
        p.d.expect(RequestId::new("r1"), push_source(&p, "t1"), blocks.clone(), 37, 0);
        std::thread::sleep(Duration::from_millis(150));
        let start = Instant::now();
        p.p.computed(tid.clone(), p.p_blocks(37), 16, 0, KvFences::complete());
        std::thread::sleep(Duration::from_millis(50));
        if decode_aborts {
            p.d.abort(RequestId::new("r1"));
        } else {
            p.p.abandon(tid.clone(), "prefill request aborted".into());
        }
        let ev = p.wait_event();
        let at = start.elapsed();
        match (&ev, decode_aborts) {
            (ConnectorEvent::Released { .. }, true) | (ConnectorEvent::Failed { .. }, false) => {}
            _ => panic!("decode_aborts={decode_aborts}: unexpected {ev:?}"),
        }
        assert!(at >= Duration::from_millis(380), "decode_aborts={decode_aborts}: ended at {at:?}, during the part");
        let snapshot: Vec<Vec<f32>> = (0..16).map(|t| d_key(&p, &blocks, t, 1).to_vec()).collect();
        std::thread::sleep(Duration::from_millis(300));
        let later: Vec<Vec<f32>> = (0..16).map(|t| d_key(&p, &blocks, t, 1).to_vec()).collect();
        assert_eq!(snapshot, later, "decode_aborts={decode_aborts}: a copy landed after the end");
    }
}

/// A pull read that takes longer than the lease (prefill answers 1.5 s after the request, the
/// lease is 0.5 s, and prefill reads no heartbeat meanwhile) still gets the KV: a lease being
/// read does not expire, so its blocks are not freed and reused under the read. (The read must
/// reach prefill within the lease: 0.5 s leaves room for a connection and handshake on a busy
/// machine.)
#[test]
fn a_lease_being_read_outlives_its_deadline() {
    for local in [false, true] {
        let slow = FaultInjection { slow_write: Duration::from_millis(1500), ..FaultInjection::default() };
        let lease = Duration::from_millis(500);
        let p_cfg =
            ConnectorConfig { local_transport: local, faults: slow, lease, ..config(Role::Prefill, KvMode::Pull) };
        let d_cfg = ConnectorConfig {
            local_transport: local,
            lease,
            transfer_timeout: Duration::from_secs(4),
            ..config(Role::Decode, KvMode::Pull)
        };
        let p = pair_with(p_cfg, d_cfg, 16, 8);
        p.produce("t1", 40);
        let blocks = p.d_blocks(40);
        let src = pull_source(&p, "t1", p.p.info().epoch);
        p.d.expect(RequestId::new("r1"), src, blocks.clone(), 40, 0);
        assert_ready(p.wait_event(), "r1");
        p.assert_landed(40, &blocks);
        p.wait_freed(1);
        assert_eq!(p.p.stats().expired, 0, "local={local}: the lease expired under its read");
    }
}

/// A peer that accepts the connection but never answers the handshake holds up only the
/// transfer that waits for it: another transfer, from a prefill engine that answers, lands at
/// once, and the stalled one fails at its own deadline rather than at the handshake's I/O
/// timeout.
#[test]
fn a_peer_stalling_its_handshake_holds_up_no_other_transfer() {
    let stalled = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let stalled_addr = stalled.local_addr().unwrap().to_string();
    let held = std::thread::spawn(move || stalled.accept().map(|(s, _)| s)); // accepts, says nothing
    let p = pair(KvMode::Push, 16, 16, FaultInjection::default());
    let start = Instant::now();
    let hung = RemoteKv::PushFrom { transfer_id: TransferId("t-hung".into()), peer: stalled_addr, peer_engine: None };
    p.d.expect(RequestId::new("hung"), hung, p.d_blocks(20), 20, 0);
    let blocks = vec![1, 2];
    p.d.expect(RequestId::new("r1"), push_source(&p, "t1"), blocks.clone(), 20, 0);
    p.produce("t1", 20);
    assert_ready(p.wait_event(), "r1");
    assert!(start.elapsed() < Duration::from_millis(600), "waited behind the stalled handshake: {:?}", start.elapsed());
    p.assert_landed(20, &blocks);
    match p.wait_event() {
        ConnectorEvent::Failed { request_id, reason } => {
            assert_eq!(request_id, RequestId::new("hung"));
            assert!(reason.contains("timed out"), "{reason}");
        }
        other => panic!("expected the stalled transfer to fail, got {other:?}"),
    }
    // The transfer timeout is 0.8 s; the handshake's I/O timeout 2 s.
    assert!(start.elapsed() < Duration::from_millis(1500), "{:?}", start.elapsed());
    drop(held);
}

/// The connection drops in the middle of a push write's bytes (a proxy between the engines
/// cuts it): decode learns at once, fails the transfer with the reason, and prefill's blocks go
/// back; a later transfer over a new connection lands.
#[test]
fn a_connection_cut_mid_write_fails_the_transfer_at_once_and_the_next_one_lands() {
    let p = pair(KvMode::Push, 16, 16, FaultInjection::default());
    let proxy = common::FaultProxy::start(p.p_addr());
    // Past the handshake reply and the write's header, inside its 12 KiB of block bytes.
    proxy.cut_after(4000);
    let via_proxy = |tid: &str| RemoteKv::PushFrom {
        transfer_id: TransferId(tid.into()),
        peer: proxy.addr().into(),
        peer_engine: None,
    };
    let blocks = p.d_blocks(40);
    let start = Instant::now();
    p.d.expect(RequestId::new("r1"), via_proxy("t1"), blocks.clone(), 40, 0);
    std::thread::sleep(Duration::from_millis(100));
    p.produce("t1", 40);
    match p.wait_event() {
        ConnectorEvent::Failed { request_id, reason } => {
            assert_eq!(request_id, RequestId::new("r1"));
            assert!(reason.contains("KV") || reason.contains("connection"), "{reason}");
        }
        other => panic!("expected a failure, got {other:?}"),
    }
    assert!(start.elapsed() < Duration::from_millis(700), "learned late: {:?}", start.elapsed());
    p.wait_freed(1);
    proxy.cut_after(u64::MAX);
    p.d.expect(RequestId::new("r2"), via_proxy("t2"), blocks.clone(), 40, 0);
    std::thread::sleep(Duration::from_millis(100));
    p.produce("t2", 40);
    assert_ready(p.wait_event(), "r2");
    p.assert_landed(40, &blocks);
    p.wait_freed(2);
}

/// The connection to a prefill engine that writes directly drops after decode registered: a
/// write could still be on its way (a device copy needs no socket), so decode fails the
/// transfer at once but holds its blocks for one I/O timeout (2 s here) from the loss
/// (`writes_until`), so the engine recomputes in other blocks without waiting; prefill drops
/// the registration with the connection, so KV it produces afterwards never lands.
#[test]
fn a_direct_writers_connection_lost_fails_at_once_with_its_blocks_held_and_nothing_lands() {
    let p = local_pair(KvMode::Push, 16, 16, Duration::from_secs(5));
    let proxy = common::FaultProxy::start(p.p_addr());
    let blocks = p.d_blocks(20);
    let src = RemoteKv::PushFrom { transfer_id: TransferId("t1".into()), peer: proxy.addr().into(), peer_engine: None };
    p.d.expect(RequestId::new("r1"), src, blocks.clone(), 20, 0);
    std::thread::sleep(Duration::from_millis(150)); // registered
    let cut = Instant::now();
    proxy.cut_now();
    std::thread::sleep(Duration::from_millis(100));
    p.produce("t1", 20);
    let until = match p.wait_event() {
        ConnectorEvent::FailedInFlight { request_id, writes_until, .. } => {
            assert_eq!(request_id, RequestId::new("r1"));
            writes_until
        }
        other => panic!("expected a failure with the blocks held, got {other:?}"),
    };
    assert!(cut.elapsed() < Duration::from_millis(600), "failed after {:?}, not at the loss", cut.elapsed());
    // The hold counts from the loss (cut + 2 s), not from the 0.8 s deadline (cut + 2.65 s).
    let held = until.duration_since(cut);
    assert!(held >= Duration::from_millis(1800) && held < Duration::from_millis(2400), "held for {held:?}");
    std::thread::sleep(until.saturating_duration_since(Instant::now()));
    assert!(p.untouched(&blocks), "KV landed after the connection was lost");
}

/// A prefill engine that freezes (the proxy stops forwarding and keeps the connection open, as
/// SIGSTOP would) after decode registered: decode hears no heartbeat for its liveness bound
/// (0.6 s here), declares the peer dead and fails the transfer then, not at its 5 s transfer
/// timeout.
#[test]
fn a_frozen_peer_is_declared_dead_within_the_liveness_bound() {
    let timeout = Duration::from_secs(5);
    let live = Duration::from_millis(600);
    let p_cfg = ConnectorConfig { transfer_timeout: timeout, liveness: live, ..config(Role::Prefill, KvMode::Push) };
    let d_cfg = ConnectorConfig { transfer_timeout: timeout, liveness: live, ..config(Role::Decode, KvMode::Push) };
    let p = pair_with(p_cfg, d_cfg, 16, 16);
    let proxy = common::FaultProxy::start(p.p_addr());
    let src = RemoteKv::PushFrom { transfer_id: TransferId("t1".into()), peer: proxy.addr().into(), peer_engine: None };
    p.d.expect(RequestId::new("r1"), src, p.d_blocks(20), 20, 0);
    // Idle but alive: the heartbeats keep the connection up past several liveness bounds.
    std::thread::sleep(Duration::from_millis(1500));
    assert!(p.events.try_recv().is_err(), "an idle, live peer was declared dead");
    let frozen = Instant::now();
    proxy.freeze();
    match p.wait_event() {
        ConnectorEvent::Failed { request_id, reason } => {
            assert_eq!(request_id, RequestId::new("r1"));
            assert!(reason.contains("connection"), "{reason}");
        }
        other => panic!("expected a failure, got {other:?}"),
    }
    assert!(frozen.elapsed() < Duration::from_millis(1500), "noticed after {:?}", frozen.elapsed());
}

/// Push over tcp in parts, with `--kv-verify` on both engines and every bulk send corrupted on
/// the way: the first part's checksum fails where it lands, so the transfer fails (decode would
/// recompute) instead of becoming ready on partial or bad KV, however the later parts and the
/// final write go; prefill counts one failed transfer, from decode's acknowledgement.
#[test]
fn a_corrupted_part_over_tcp_fails_the_transfer_and_never_makes_it_ready() {
    let corrupt = FaultInjection { corrupt_sends: true, ..FaultInjection::default() };
    let p_cfg = ConnectorConfig { verify: true, faults: corrupt, ..config(Role::Prefill, KvMode::Push) };
    let d_cfg = ConnectorConfig { verify: true, ..config(Role::Decode, KvMode::Push) };
    let p = pair_with(p_cfg, d_cfg, 4, 8);
    let (tokens, blocks) = (37, p.d_blocks(37));
    let tid = TransferId("t1".into());
    p.d.expect(RequestId::new("r1"), push_source(&p, "t1"), blocks, tokens, 0);
    std::thread::sleep(Duration::from_millis(150)); // the registration has reached prefill
    p.p.computed(tid.clone(), p.p_blocks(tokens), 16, 0, KvFences::complete());
    wait_until("the corrupted part", || p.d.stats().checksum_failures == 1);
    p.p.computed(tid, p.p_blocks(tokens), 30, 0, KvFences::complete());
    p.produce("t1", tokens);
    match p.wait_event() {
        ConnectorEvent::Failed { reason, .. } => assert!(reason.contains("checksum"), "{reason}"),
        other => panic!("expected the transfer to fail, got {other:?}"),
    }
    p.wait_freed(1);
    wait_until("prefill counting the failure", || p.p.stats().transfers_failed == 1);
    assert_eq!(p.p.stats().transfers_ok, 0);
}

/// Push over tcp in parts: decode aborts after the first part landed, with more of the prompt
/// still to come. The abort is released at once (no write was landing), and what prefill sends
/// for the transfer after it is drained, never written into the blocks.
#[test]
fn an_abort_between_parts_over_tcp_is_released_and_nothing_lands_after() {
    let p = pair_via(false, KvMode::Push, 4, 8, Duration::from_secs(3));
    let (tokens, blocks) = (37, p.d_blocks(37));
    let tid = TransferId("t1".into());
    p.d.expect(RequestId::new("r1"), push_source(&p, "t1"), blocks.clone(), tokens, 0);
    std::thread::sleep(Duration::from_millis(150));
    p.p.computed(tid.clone(), p.p_blocks(tokens), 8, 0, KvFences::complete());
    wait_until("the first part landing", || (0..8).all(|t| d_key(&p, &blocks, t, 1) == written_key(t, 1)));
    p.d.abort(RequestId::new("r1"));
    assert!(matches!(p.wait_event(), ConnectorEvent::Released { .. }));
    p.p.computed(tid, p.p_blocks(tokens), 30, 0, KvFences::complete());
    p.produce("t1", tokens);
    p.wait_freed(1);
    std::thread::sleep(Duration::from_millis(200));
    assert!(p.untouched(&blocks[1..]), "KV landed in the blocks after the abort");
}

/// Two host fences for the pair's two layers, and the signals that set them.
fn two_groups() -> (KvFences, HostSignal, HostSignal) {
    use tandem_compute::cuda::HostFence;
    let ((f0, s0), (f1, s1)) = (HostFence::pair(), HostFence::pair());
    (KvFences::host(vec![(0..1, f0), (1..2, f1)]), s0, s1)
}

/// Decode registers `request` for `tid` (37 tokens); prefill reports a step of 32 of them in two
/// groups of layers and the first group lands (decode's `groups_landed` reaching `landed`).
/// Returns decode's blocks and the second group's signal.
fn first_group_landed(p: &Pair, (request, tid): (&str, &str), landed: u64) -> (Vec<u32>, HostSignal) {
    let (tokens, blocks) = (37, p.d_blocks(37));
    p.d.expect(RequestId::new(request), push_source(p, tid), blocks.clone(), tokens, 0);
    std::thread::sleep(Duration::from_millis(150)); // the registration has reached prefill
    let (fences, first, second) = two_groups();
    p.p.computed(TransferId(tid.into()), p.p_blocks(tokens), 32, 0, fences);
    first.signal();
    wait_until("the first group", || p.d.stats().groups_landed == landed);
    (blocks, second)
}

/// Push over tcp, a step still computing (a GPU engine reports it as it submits it): its KV goes
/// group of layers by group, each once its fence says the group is written, and decode lands
/// and counts the groups; the tokens count as landed with the last group, and the final write
/// moves only the rest of the prompt.
#[test]
fn a_computing_step_goes_over_tcp_group_of_layers_by_group() {
    let p = pair_via(false, KvMode::Push, 4, 8, Duration::from_secs(3));
    let (tokens, blocks) = (37, p.d_blocks(37));
    let tid = TransferId("t1".into());
    p.d.expect(RequestId::new("r1"), push_source(&p, "t1"), blocks.clone(), tokens, 0);
    std::thread::sleep(Duration::from_millis(150)); // the registration has reached prefill
    let (fences, first, second) = two_groups();
    p.p.computed(tid.clone(), p.p_blocks(tokens), 32, 0, fences);
    std::thread::sleep(Duration::from_millis(100));
    assert!(p.untouched(&blocks), "KV went before its group's fence was set");
    first.signal();
    wait_until("layer 0 landing", || (0..32).all(|t| d_key(&p, &blocks, t, 0) == written_key(t, 0)));
    std::thread::sleep(Duration::from_millis(50));
    assert!((0..32).all(|t| d_key(&p, &blocks, t, 1) != written_key(t, 1)), "layer 1 went before its fence");
    assert_eq!(p.d.stats().groups_landed, 1);
    second.signal();
    wait_until("the second group", || p.d.stats().groups_landed == 2);
    assert!((0..32).all(|t| d_key(&p, &blocks, t, 1) == written_key(t, 1)));
    assert!(p.untouched(&blocks[4..]), "tokens 32.. were written before the prompt was complete");
    p.produce("t1", tokens);
    assert_ready(p.wait_event(), "r1");
    p.assert_landed(tokens, &blocks);
    p.wait_freed(1);
    wait_until("the write acknowledged", || p.p.stats().transfers_ok == 1);
    assert_eq!((p.p.stats().parts_early, p.d.stats().groups_landed), (1, 2));
    // The bytes went striped over the connection and the two further streams it opened.
    assert_eq!((p.p.stats().streams_joined, p.d.stats().streams_joined), (2, 2));
}

/// Decode's timeline of a push says how long after prefill's hand-over its writer was still
/// sending what the prompt's steps had computed: here the second group's fence is set 0.3 s
/// after the hand-over, so that much at least; a prompt whose groups all went before the
/// hand-over leaves next to nothing.
#[test]
fn a_push_timeline_counts_what_was_still_going_out_after_the_hand_over() {
    let p = pair_via(false, KvMode::Push, 4, 8, Duration::from_secs(3));
    let ready_backlog = |p: &Pair, request: &str| match p.wait_event() {
        ConnectorEvent::Ready { request_id, timeline, .. } if request_id == RequestId::new(request) => {
            timeline.handover_backlog_us
        }
        other => panic!("expected Ready for {request}, got {other:?}"),
    };
    let (blocks, second) = first_group_landed(&p, ("r1", "t1"), 1);
    p.produce("t1", 37);
    std::thread::sleep(Duration::from_millis(300));
    second.signal();
    let backlog = ready_backlog(&p, "r1");
    assert!(backlog >= 300_000, "the second group went 0.3 s after the hand-over: backlog {backlog} us");
    p.assert_landed(37, &blocks);
    p.wait_freed(1);

    // r1's two groups landed: r2's are the third and fourth.
    let (blocks, second) = first_group_landed(&p, ("r2", "t2"), 3);
    second.signal();
    wait_until("the second group", || p.d.stats().groups_landed == 4);
    p.produce("t2", 37);
    let backlog = ready_backlog(&p, "r2");
    assert!(backlog < 100_000, "every group went before the hand-over: backlog {backlog} us");
    p.assert_landed(37, &blocks);
    p.wait_freed(2);
}

/// Faults on the group-by-group path: decode aborts with a group landed and the next still
/// computing (released at once; the late group is drained, never written), and a group whose
/// computing step gave it up (the transfer fails rather than answer from half the layers).
/// Blocks come back on both sides.
#[test]
fn an_abort_between_groups_and_a_group_lost_end_the_transfer_cleanly() {
    let p = pair_via(false, KvMode::Push, 4, 8, Duration::from_secs(3));
    let tokens = 37;
    let (blocks, second) = first_group_landed(&p, ("r1", "t1"), 1);
    p.d.abort(RequestId::new("r1"));
    assert!(matches!(p.wait_event(), ConnectorEvent::Released { .. }));
    second.signal();
    p.produce("t1", tokens);
    p.wait_freed(1);
    std::thread::sleep(Duration::from_millis(200));
    assert!((0..32).all(|t| d_key(&p, &blocks, t, 1) != written_key(t, 1)), "a group landed after the abort");
    assert_eq!(p.d.stats().groups_landed, 1);

    // The second group's step failed (its signal dropped unset): decode hears the transfer
    // failed and recomputes; it never reports Ready on layer 0 alone.
    let (_, second) = first_group_landed(&p, ("r2", "t2"), 2);
    drop(second);
    p.produce("t2", tokens);
    match p.wait_event() {
        ConnectorEvent::Failed { reason, .. } => assert!(reason.contains("without writing"), "{reason}"),
        other => panic!("expected the transfer to fail, got {other:?}"),
    }
    p.wait_freed(2);
}

/// Push over tcp striped over three streams: one of the connection's further streams is cut
/// (as a dropped TCP connection would be) just before prefill's first send over them. The
/// transfer fails at once on both ends rather than waiting out a bound (decode recomputes),
/// prefill's blocks come back, and the next transfer opens a new connection and lands.
#[test]
fn a_stream_cut_under_a_striped_send_fails_the_transfer_at_once_and_the_next_one_lands() {
    let p = pair(KvMode::Push, 4, 8, FaultInjection { cut_a_stream: true, ..Default::default() });
    let (tokens, blocks) = (37, p.d_blocks(37));
    p.d.expect(RequestId::new("r1"), push_source(&p, "t1"), blocks.clone(), tokens, 0);
    std::thread::sleep(Duration::from_millis(100));
    let start = Instant::now();
    p.produce("t1", tokens);
    match p.wait_event() {
        ConnectorEvent::Failed { .. } => {}
        other => panic!("expected the transfer to fail, got {other:?}"),
    }
    assert!(start.elapsed() < Duration::from_secs(1), "failed only after {:?}", start.elapsed());
    p.wait_freed(1);
    p.d.expect(RequestId::new("r2"), push_source(&p, "t2"), blocks.clone(), tokens, 0);
    std::thread::sleep(Duration::from_millis(100));
    p.produce("t2", tokens);
    assert_ready(p.wait_event(), "r2");
    p.assert_landed(tokens, &blocks);
    assert_eq!(p.d.stats().streams_joined, 4, "decode opened a second connection's two streams");
}

/// A group late mid-stream: the step computing the second group of layers takes longer than
/// decode waits for the transfer. Decode gives the transfer up at its deadline (it never waits
/// on a fence), the late group is drained when it comes, never written, and blocks come back
/// on both sides.
#[test]
fn a_group_later_than_decodes_deadline_is_given_up_and_never_lands() {
    let p = pair_via(false, KvMode::Push, 4, 8, Duration::from_secs(3));
    let tokens = 37;
    let (blocks, second) = first_group_landed(&p, ("r1", "t1"), 1);
    let start = Instant::now();
    match p.wait_event() {
        ConnectorEvent::Failed { .. } => {}
        other => panic!("expected decode to give the transfer up, got {other:?}"),
    }
    // Decode's transfer timeout here is 800 ms from its request.
    assert!(start.elapsed() < Duration::from_secs(2), "given up only after {:?}", start.elapsed());
    second.signal();
    p.produce("t1", tokens);
    p.wait_freed(1);
    std::thread::sleep(Duration::from_millis(200));
    assert!((0..32).all(|t| d_key(&p, &blocks, t, 1) != written_key(t, 1)), "the late group landed");
    assert_eq!(p.d.stats().groups_landed, 1);
}

/// One prompt's KV (transfer t1) produced and expected in `mode`: it lands, prefill's blocks come
/// back; decode's blocks.
fn lands_once(mode: KvMode, p: &Pair) -> Vec<u32> {
    let blocks = p.d_blocks(40);
    p.produce("t1", 40);
    p.d.expect(RequestId::new("r1"), source_in(mode, p, "t1"), blocks.clone(), 40, 0);
    assert_ready(p.wait_event(), "r1");
    p.assert_landed(40, &blocks);
    p.wait_freed(1);
    blocks
}

/// Where decode takes transfer `tid`'s KV from in `mode` (prefill's current epoch for pull).
fn source_in(mode: KvMode, p: &Pair, tid: &str) -> RemoteKv {
    match mode {
        KvMode::Push => push_source(p, tid),
        KvMode::Pull => pull_source(p, tid, p.p.info().epoch),
    }
}

fn with_secret(cfg: ConnectorConfig, text: &str) -> ConnectorConfig {
    ConnectorConfig { cluster_secret: Some(tandem_core::ClusterSecret::new(text.as_bytes()).unwrap()), ..cfg }
}

const SECRET: &str = "this deployment's cluster secret";

#[test]
fn with_one_cluster_secret_push_and_pull_land_and_with_different_ones_nothing_moves() {
    for mode in [KvMode::Push, KvMode::Pull] {
        let pair_secrets = |p_secret: Option<&str>, d_secret: Option<&str>| {
            let (p_cfg, d_cfg) = (config(Role::Prefill, mode), config(Role::Decode, mode));
            let p_cfg = ConnectorConfig {
                transfer_timeout: Duration::from_millis(300),
                lease: Duration::from_millis(300),
                ..p_cfg
            };
            let p_cfg = p_secret.map_or(p_cfg.clone(), |s| with_secret(p_cfg, s));
            let d_cfg = d_secret.map_or(d_cfg.clone(), |s| with_secret(d_cfg, s));
            pair_with(p_cfg, d_cfg, 16, 8)
        };
        // The same secret: the KV lands over an authenticated connection and its streams.
        let p = pair_secrets(Some(SECRET), Some(SECRET));
        let blocks = lands_once(mode, &p);
        assert_eq!((p.p.stats().auth_refused, p.d.stats().auth_refused), (0, 0));
        assert_eq!(p.d.stats().streams_joined, 2, "both further streams proved themselves");
        // Different secrets, or a secret on one side only: no KV moves, decode hears why (it
        // recomputes), the refusal is counted, prefill's blocks come back.
        for (p_secret, d_secret) in
            [(Some(SECRET), Some("another deployment's secret")), (Some(SECRET), None), (None, Some(SECRET))]
        {
            let p = pair_secrets(p_secret, d_secret);
            p.produce("t2", 40);
            p.d.expect(RequestId::new("r2"), source_in(mode, &p, "t2"), blocks.clone(), 40, 0);
            match p.wait_event() {
                ConnectorEvent::Failed { reason, .. } => {
                    assert!(reason.contains("secret"), "{mode:?} {p_secret:?}/{d_secret:?}: {reason}")
                }
                other => panic!("{mode:?} {p_secret:?}/{d_secret:?}: expected a failure, got {other:?}"),
            }
            assert!(p.untouched(&blocks), "nothing landed");
            p.wait_freed(1);
            wait_until("the refusal counted", || p.p.stats().auth_refused + p.d.stats().auth_refused >= 1);
            let (ps, ds) = (p.p.stats(), p.d.stats());
            assert_eq!((ps.transfers_ok, ds.transfers_ok, ds.bytes_received), (0, 0, 0), "{ps:?} {ds:?}");
        }
    }
}

#[test]
fn a_forged_frame_on_an_authenticated_connection_ends_it_and_changes_nothing() {
    use tandem_kv::channel::{connect, handshake};
    use tandem_kv::wire::{write_message, DoneStatus, Message};
    let p_cfg = with_secret(config(Role::Prefill, KvMode::Pull), SECRET);
    let p = pair_with(p_cfg, with_secret(config(Role::Decode, KvMode::Pull), SECRET), 16, 8);
    p.produce("t1", 40);
    // An authenticated connection (as a party on the path sees one), then frames whose tags
    // are not this connection's: a release of the lease, and a forged read's answer.
    let mut s = connect(&p.p_addr(), Timeouts::default()).unwrap();
    let info = tandem_kv::AgentInfo { engine_id: EngineId("intruder".into()), tcp_streams: 1, ..p.d.info().clone() };
    let (_, _, _session) =
        handshake(&mut s, &info, Some(&tandem_core::ClusterSecret::new(SECRET.as_bytes()).unwrap())).unwrap();
    let release = Message::Done {
        transfer_id: TransferId("t1".into()),
        rank: 0,
        ranks: 1,
        first_token: None,
        status: DoneStatus::Ok,
        copy_us: 0,
        produced_unix_us: 0,
        backlog_us: 0,
        digest: None,
    };
    write_message(&mut s, &release).unwrap();
    std::io::Write::write_all(&mut s, &[0u8; tandem_core::MAC_BYTES]).unwrap();
    wait_until("the forged frame refused", || p.p.stats().auth_refused == 1);
    // The connection is over: prefill reads nothing more from it.
    let mut buf = [0u8; 1];
    let ended = std::io::Read::read(&mut s, &mut buf);
    assert!(matches!(ended, Ok(0) | Err(_)), "{ended:?}");
    // The lease is still held: the real decode engine reads it.
    let blocks = p.d_blocks(40);
    p.d.expect(RequestId::new("r1"), pull_source(&p, "t1", p.p.info().epoch), blocks.clone(), 40, 0);
    assert_ready(p.wait_event(), "r1");
    p.assert_landed(40, &blocks);
}

/// A CA and an engine certificate it signed for 127.0.0.1, as `--tls-cert`, `--tls-key` and
/// `--tls-ca` would give them.
fn tls_of_a_new_ca() -> tandem_kv::stream::KvTls {
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let cert =
        rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap().signed_by(&key, &ca, &ca_key).unwrap();
    tandem_kv::stream::KvTls::from_pem(cert.pem().as_bytes(), key.serialize_pem().as_bytes(), ca.pem().as_bytes())
        .unwrap()
}

#[test]
fn over_tls_push_and_pull_land_and_a_peer_without_it_or_of_another_ca_moves_nothing() {
    let tls = tls_of_a_new_ca();
    for mode in [KvMode::Push, KvMode::Pull] {
        let pair_tls = |p_tls: Option<tandem_kv::stream::KvTls>, d_tls: Option<tandem_kv::stream::KvTls>| {
            let p_cfg = ConnectorConfig {
                transfer_timeout: Duration::from_millis(300),
                lease: Duration::from_millis(300),
                tls: p_tls,
                ..config(Role::Prefill, mode)
            };
            pair_with(p_cfg, ConnectorConfig { tls: d_tls, ..config(Role::Decode, mode) }, 16, 8)
        };
        let p = pair_tls(Some(tls.clone()), Some(tls.clone()));
        let blocks = lands_once(mode, &p);
        assert_eq!(p.d.stats().streams_joined, 2, "both further streams over TLS too");
        for (p_tls, d_tls) in
            [(Some(tls.clone()), None), (None, Some(tls.clone())), (Some(tls.clone()), Some(tls_of_a_new_ca()))]
        {
            let with = (p_tls.is_some(), d_tls.is_some());
            let p = pair_tls(p_tls, d_tls);
            p.produce("t2", 40);
            p.d.expect(RequestId::new("r2"), source_in(mode, &p, "t2"), blocks.clone(), 40, 0);
            assert!(matches!(p.wait_event(), ConnectorEvent::Failed { .. }), "{mode:?} {with:?}");
            assert!(p.untouched(&blocks), "nothing landed");
            p.wait_freed(1);
            assert_eq!(p.d.stats().bytes_received, 0);
        }
    }
}
