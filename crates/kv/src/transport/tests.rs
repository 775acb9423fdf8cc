//! Each transport alone: two engines' KV memories, a run of scattered blocks written from one
//! into the other (equal and different block sizes), with no agent, table or protocol; what
//! landed is checked token by token through the `--kv-verify` digest, which does not depend
//! on the block size.

use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;

use tandem_compute::cuda::KvFences;
use tandem_compute::kv_digest::kv_digest_host;
use tandem_compute::{KvCache, KvLayout, KvRegion};

use super::local::{self, Local};
use super::stripes::FRESH;
use super::tcp::Tcp;
use super::{Announce, Announced, Bulk, NoAnnounce, Ours, Runs, Transport, WriteError};
use crate::blocks::KvSlice;
use crate::channel::Timeouts;
use crate::config::FaultInjection;
use crate::error::KvError;
use crate::memory::KvMemory;

fn layout(block_size: usize) -> KvLayout {
    KvLayout { num_layers: 3, num_kv_heads: 2, head_dim: 8, block_size, num_blocks: 48 }
}

/// A CPU engine's cache of `block_size`-token blocks with `tokens` of KV in `table` (blocks
/// scattered so that runs are short), or empty.
fn engine(block_size: usize, tokens: usize, stride: u32, filled: bool) -> (Arc<KvRegion>, Vec<u32>) {
    let l = layout(block_size);
    let table: Vec<u32> = (0..l.blocks_for(tokens) as u32).map(|b| (b * stride + 1) % l.num_blocks as u32).collect();
    let mut cache = KvCache::new(l);
    if filled {
        let plane = l.num_kv_heads * l.head_dim;
        for t in 0..tokens {
            for layer in 0..l.num_layers {
                let k: Vec<f32> = (0..plane).map(|i| (t * 31 + layer * 7 + i) as f32).collect();
                let v: Vec<f32> = (0..plane).map(|i| -((t * 17 + layer + i) as f32)).collect();
                cache.write_token(layer, table[t / block_size] as usize, t % block_size, &k, &v);
            }
        }
    }
    (cache.region(), table)
}

fn ours(region: &Arc<KvRegion>, verify: bool, faults: FaultInjection) -> Ours {
    Ours { memory: KvMemory::from(region.clone()), verify, faults, stage_ahead: false, timeouts: Timeouts::default() }
}

/// Tokens `0..tokens` of `table` in `region`, digested.
fn digest(region: &KvRegion, table: &[u32], tokens: usize) -> u64 {
    // Safety: the test owns every block.
    unsafe { kv_digest_host(region, table, tokens) }.unwrap()
}

/// An announcement as a 41-byte header on the first socket (the side channel's frame, reduced
/// to what the reader needs), the bytes striped over all of them.
struct ToSocket<'a>(&'a mut [TcpStream]);

const WORDS: usize = 9;
const HEADER: usize = WORDS * 8 + 1;

impl Announce for ToSocket<'_> {
    fn announce(&mut self, bulk: Bulk) -> Result<Announced<'_>, KvError> {
        use std::io::Write;
        let mut header = [0u8; HEADER];
        let (layers, heads) = (&bulk.slice.layers, &bulk.slice.heads);
        let words: [usize; WORDS] = [
            bulk.src_block_size,
            bulk.bytes as usize,
            layers.start,
            layers.end,
            heads.start,
            heads.end,
            bulk.rank,
            bulk.ranks,
            self.0.len(),
        ];
        for (i, w) in words.iter().enumerate() {
            header[i * 8..][..8].copy_from_slice(&(*w as u64).to_le_bytes());
        }
        header[WORDS * 8] = bulk.checksum as u8;
        self.0[0].write_all(&header)?;
        Ok((self.0.iter_mut().map(|s| s as &mut (dyn Write + Send)).collect(), &FRESH))
    }
}

fn read_announcement(s: &mut TcpStream) -> Bulk {
    let mut header = [0u8; HEADER];
    s.read_exact(&mut header).unwrap();
    let word = |i: usize| u64::from_le_bytes(header[i * 8..][..8].try_into().unwrap()) as usize;
    let slice = KvSlice { layers: word(2)..word(3), heads: word(4)..word(5) };
    let (src_block_size, bytes, checksum) = (word(0), word(1) as u64, header[WORDS * 8] == 1);
    Bulk { src_block_size, bytes, checksum, slice, rank: word(6), ranks: word(7), streams: word(8) }
}

/// `n` connected pairs of TCP streams: the writer's ends and the reader's.
fn streams(n: usize) -> (Vec<TcpStream>, Vec<TcpStream>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let out: Vec<TcpStream> = (0..n).map(|_| TcpStream::connect(addr).unwrap()).collect();
    let inn: Vec<TcpStream> = (0..n).map(|_| listener.accept().unwrap().0).collect();
    (out, inn)
}

/// What the reader's `receive` takes: its ends of the streams.
fn readers(inn: &mut [TcpStream]) -> Vec<&mut (dyn Read + Send)> {
    inn.iter_mut().map(|s| s as &mut (dyn Read + Send)).collect()
}

/// Writes `tokens` of KV from a `from`-token-block engine to a `to`-token-block one over tcp;
/// returns what the reader's `receive` said and the two digests.
/// Writes `tokens` of KV from a `from`-token-block engine to a `to`-token-block one over tcp,
/// striped over `n` streams; returns what the reader's `receive` said and the two digests.
fn over_tcp(
    (from, to, n): (usize, usize, usize),
    tokens: usize,
    verify: bool,
    faults: FaultInjection,
) -> (Result<(), KvError>, u64, u64) {
    let (src, src_table) = engine(from, tokens, 5, true);
    let (dst, dst_table) = engine(to, tokens, 7, false);
    let (mut out, mut inn) = streams(n);
    let reader = Tcp::new(ours(&dst, verify, FaultInjection::default()));
    let dst_blocks = dst_table.clone();
    let received = std::thread::spawn(move || {
        let bulk = read_announcement(&mut inn[0]);
        assert_eq!(bulk.streams, n);
        // Safety: the test owns every block of the reader's cache.
        unsafe { reader.receive((&mut readers(&mut inn), &FRESH), bulk, &dst_blocks, tokens) }
    });
    let writer = Tcp::new(ours(&src, verify, faults));
    let runs = Runs::whole(&src_table, &dst_table, tokens);
    writer.write(runs, &KvFences::complete(), None, &mut ToSocket(&mut out)).unwrap();
    let landed = received.join().unwrap();
    (landed, digest(&src, &src_table, tokens), digest(&dst, &dst_table, tokens))
}

#[test]
fn tcp_moves_block_runs_between_block_sizes() {
    for (from, to, tokens, verify) in [(16, 16, 100, false), (16, 8, 77, true), (8, 16, 5, false), (4, 12, 61, true)] {
        for n in [1, 3] {
            let (landed, sent, got) = over_tcp((from, to, n), tokens, verify, FaultInjection::default());
            landed.unwrap();
            assert_eq!(sent, got, "{tokens} tokens from {from}- into {to}-token blocks over {n} streams");
        }
    }
}

/// A step still computing goes group of layers by group, each only once its fence is set, and
/// lands group by group between block sizes (with the copies staged ahead or not); groups set
/// while an earlier one waited go with it as one write; a group whose computing thread gave it
/// up fails the write with the groups before it sent.
#[test]
fn tcp_sends_a_computing_step_group_by_group_as_its_fences_are_set() {
    use std::time::Duration;
    use tandem_compute::cuda::HostFence;
    let tokens = 77;
    let (src, src_table) = engine(16, tokens, 5, true);
    for (n, stage_ahead) in [(1, false), (2, false), (1, true), (2, true)] {
        let (dst, dst_table) = engine(8, tokens, 7, false);
        let (mut out, mut inn) = streams(n);
        let (fences, mut signals): (Vec<_>, Vec<_>) = (0..3).map(|_| HostFence::pair()).unzip();
        let groups = KvFences::host(fences.into_iter().enumerate().map(|(l, f)| (l..l + 1, f)).collect());
        let writer = Tcp::new(Ours { stage_ahead, ..ours(&src, true, FaultInjection::default()) });
        let (src_blocks, dst_blocks) = (src_table.clone(), dst_table.clone());
        let written = std::thread::spawn(move || {
            let runs = Runs::whole(&src_blocks, &dst_blocks, tokens);
            writer.write(runs, &groups, None, &mut ToSocket(&mut out)).map_err(|e| e.to_string())
        });
        inn[0].set_read_timeout(Some(Duration::from_millis(200))).unwrap();
        let reader = Tcp::new(ours(&dst, true, FaultInjection::default()));
        let nothing_yet =
            |s: &mut TcpStream| matches!(s.peek(&mut [0u8; 1]), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
        for layer in 0..3 {
            assert!(nothing_yet(&mut inn[0]), "group {layer} went before its fence was set");
            signals.remove(0).signal();
            let bulk = read_announcement(&mut inn[0]);
            assert_eq!(bulk.slice.layers, layer..layer + 1);
            // Safety: the test owns every block of the reader's cache.
            unsafe { reader.receive((&mut readers(&mut inn), &FRESH), bulk, &dst_table, tokens) }.unwrap();
        }
        written.join().unwrap().unwrap();
        assert_eq!(digest(&src, &src_table, tokens), digest(&dst, &dst_table, tokens), "{n} streams, {stage_ahead}");
    }

    // Groups computed while an earlier one waited go with it as one write: the third group's
    // fence is set before the second's, so the second and third go together.
    let (dst, dst_table) = engine(8, tokens, 7, false);
    let (mut out, mut inn) = streams(2);
    let (fences, mut signals): (Vec<_>, Vec<_>) = (0..3).map(|_| HostFence::pair()).unzip();
    let groups = KvFences::host(fences.into_iter().enumerate().map(|(l, f)| (l..l + 1, f)).collect());
    let writer = Tcp::new(ours(&src, true, FaultInjection::default()));
    let (src_blocks, dst_blocks) = (src_table.clone(), dst_table.clone());
    let written = std::thread::spawn(move || {
        let runs = Runs::whole(&src_blocks, &dst_blocks, tokens);
        writer.write(runs, &groups, None, &mut ToSocket(&mut out)).map_err(|e| e.to_string())
    });
    let reader = Tcp::new(ours(&dst, true, FaultInjection::default()));
    signals.remove(0).signal();
    for (layers, set_next) in [(0..1, true), (1..3, false)] {
        let bulk = read_announcement(&mut inn[0]);
        assert_eq!(bulk.slice.layers, layers);
        if set_next {
            let second = signals.remove(0);
            signals.remove(0).signal();
            second.signal();
        }
        // Safety: the test owns every block of the reader's cache.
        unsafe { reader.receive((&mut readers(&mut inn), &FRESH), bulk, &dst_table, tokens) }.unwrap();
    }
    written.join().unwrap().unwrap();
    assert_eq!(digest(&src, &src_table, tokens), digest(&dst, &dst_table, tokens), "merged groups");

    // The computing thread drops the second group's signal: the first group went, then the
    // write fails (the caller tells the peer in-band).
    let (fences, mut signals): (Vec<_>, Vec<_>) = (0..3).map(|_| HostFence::pair()).unzip();
    let groups = KvFences::host(fences.into_iter().enumerate().map(|(l, f)| (l..l + 1, f)).collect());
    let writer = Tcp::new(ours(&src, false, FaultInjection::default()));
    let runs = Runs::whole(&src_table, &src_table, tokens);
    signals.remove(0).signal();
    drop(signals);
    let (mut sink, _keep) = streams(1);
    let result = writer.write(runs, &groups, None, &mut ToSocket(&mut sink));
    assert!(matches!(result, Err(WriteError::Failed(ref e)) if e.contains("without writing")), "{result:?}");
}

/// A tensor-parallel writer's ranks each write their own heads of every group of layers, rank
/// after rank within each group; between block sizes and over several streams the reader
/// lands each, the other ranks' heads untouched until theirs come, and all of them make the
/// whole KV.
#[test]
fn tcp_writes_each_ranks_heads_of_each_group_as_a_write_of_its_own() {
    use tandem_compute::cuda::HostFence;
    let tokens = 45;
    let (src, src_table) = engine(16, tokens, 5, true);
    for (to, n) in [(16, 1), (8, 3)] {
        let (dst, dst_table) = engine(to, tokens, 7, false);
        let (mut out, mut inn) = streams(n);
        let (fences, signals): (Vec<_>, Vec<_>) = (0..3).map(|_| HostFence::pair()).unzip();
        let groups = KvFences::host(fences.into_iter().enumerate().map(|(l, f)| (l..l + 1, f)).collect());
        // Each group's fence set once the one before has landed (set at once, they would go as
        // one write).
        let mut signals = signals.into_iter();
        signals.next().unwrap().signal();
        let writer = Tcp::new(ours(&src, true, FaultInjection::default()));
        let (src_blocks, dst_blocks) = (src_table.clone(), dst_table.clone());
        let written = std::thread::spawn(move || {
            let runs = Runs { ranks: 2, ..Runs::whole(&src_blocks, &dst_blocks, tokens) };
            writer.write(runs, &groups, None, &mut ToSocket(&mut out)).map_err(|e| e.to_string())
        });
        let reader = Tcp::new(ours(&dst, true, FaultInjection::default()));
        // A value of head 1 of the first token, layer 0 (keys), as the reader's blocks hold it.
        let head1 = |region: &KvRegion, table: &[u32], block_size: usize| {
            let l = layout(block_size);
            // Safety: the writer and reader are done with these blocks when it is read.
            let block: &[f32] = bytemuck::cast_slice(unsafe { region.bytes(table[0] as usize, 1) });
            block[l.plane_offset_in_block(0, 0, 1)]
        };
        for (layer, rank) in (0..3).flat_map(|l| [(l, 0), (l, 1)]) {
            let bulk = read_announcement(&mut inn[0]);
            assert_eq!((bulk.slice.layers.clone(), bulk.slice.heads.clone()), (layer..layer + 1, rank..rank + 1));
            assert_eq!((bulk.rank, bulk.ranks), (rank, 2));
            // Safety: the test owns every block of the reader's cache.
            unsafe { reader.receive((&mut readers(&mut inn), &FRESH), bulk, &dst_table, tokens) }.unwrap();
            if (layer, rank) == (0, 0) {
                assert_eq!(head1(&dst, &dst_table, to), 0.0, "rank 1's heads before rank 1 wrote them");
            }
            if rank == 1 {
                if let Some(next) = signals.next() {
                    next.signal();
                }
            }
        }
        written.join().unwrap().unwrap();
        assert_ne!(head1(&src, &src_table, 16), 0.0);
        assert_eq!(head1(&dst, &dst_table, to), head1(&src, &src_table, 16));
        assert_eq!(digest(&src, &src_table, tokens), digest(&dst, &dst_table, tokens), "16 -> {to}, {n} streams");
    }
}

#[test]
fn tcp_detects_a_flipped_bit_and_fails_before_announcing_when_staging_fails() {
    let corrupt = FaultInjection { corrupt_sends: true, ..Default::default() };
    for n in [1, 2] {
        let (landed, sent, got) = over_tcp((16, 8, n), 40, true, corrupt.clone());
        assert!(matches!(landed, Err(KvError::Corrupt(_))), "{n} streams: {landed:?}");
        assert_ne!(sent, got);
    }
    // A copy that fails before any byte leaves: nothing is announced, the caller tells the peer.
    let (src, table) = engine(16, 40, 5, true);
    let failing = Tcp::new(ours(&src, false, FaultInjection { fail_host_copies: true, ..Default::default() }));
    let runs = Runs::whole(&table, &table, 40);
    let written = failing.write(runs, &KvFences::complete(), None, &mut NoAnnounce);
    assert!(matches!(written, Err(WriteError::Failed(ref e)) if e.contains("injected")), "{written:?}");
}

#[test]
fn local_copies_block_runs_between_block_sizes_and_not_to_a_peer_gone() {
    for (from, to, tokens) in [(16, 16, 100), (16, 8, 77), (8, 16, 5), (4, 12, 61)] {
        let (src, src_table) = engine(from, tokens, 5, true);
        let (dst, dst_table) = engine(to, tokens, 7, false);
        let key = format!("local-test-{from}-{to}-{tokens}");
        let peer = Arc::new(KvMemory::from(dst.clone()));
        local::register(&key, &peer);
        let writer = Local::new(ours(&src, false, FaultInjection::default()), local::find(&key).unwrap());
        let runs = Runs::whole(&src_table, &dst_table, tokens);
        writer.write(runs, &KvFences::complete(), None, &mut NoAnnounce).unwrap();
        assert_eq!(digest(&src, &src_table, tokens), digest(&dst, &dst_table, tokens), "{from} -> {to}");
        // A block list that does not cover the tokens is refused before any copy.
        let short = Runs { dst: &dst_table[..dst_table.len() - 1], ..runs };
        assert!(writer.write(short, &KvFences::complete(), None, &mut NoAnnounce).is_err());
        drop(peer);
        let gone = writer.write(runs, &KvFences::complete(), None, &mut NoAnnounce);
        assert!(matches!(gone, Err(WriteError::Failed(ref e)) if e.contains("gone")), "{gone:?}");
    }
}

/// NIXL alone (the `nixl` feature, with the library CI installs): an endpoint on each of two
/// engines' host KV memory, the prefill side picking nixl for the decode side (with its probe)
/// and the decode side accepting; a push WRITE of scattered runs between block sizes with its
/// notification, which the reader's `confirm_landed` waits for; then a pull the reader READs
/// itself once granted. What landed is checked by digest each time.
#[cfg(feature = "nixl")]
#[test]
fn nixl_writes_and_reads_block_runs_between_block_sizes() {
    use std::time::Duration;

    use tandem_core::{EngineId, Epoch, TransferId};

    use super::nixl::{self, NixlSetup};
    use super::pick::Picker;
    use crate::agent_info::{AgentInfo, KvMode, Role};
    use crate::channel::Picked;
    use crate::config::{ConnectorConfig, KvTransport, NixlPull};

    let tokens = 77;
    let (src, src_table) = engine(16, tokens, 5, true);
    let (dst, dst_table) = engine(8, tokens, 7, false);
    let side = |name: &str, role: Role, region: &Arc<KvRegion>, epoch: u64| {
        let cfg = ConnectorConfig {
            engine_id: EngineId(format!("transport-test-{name}")),
            role,
            mode: KvMode::Pull,
            listen: "127.0.0.1:0".into(),
            advertise_host: "127.0.0.1".into(),
            model_fingerprint: "test".into(),
            timeouts: Timeouts::default(),
            lease: Duration::from_secs(30),
            transfer_timeout: Duration::from_secs(30),
            liveness: Duration::from_secs(10),
            faults: FaultInjection::default(),
            local_transport: false,
            transport: KvTransport::Nixl,
            verify: false,
            tcp_streams: 1,
            stage_ahead: false,
            tp_size: 1,
            nixl_min_gb_s: 0.0,
            nixl_pull: NixlPull::Read,
            ucx_log: None,
            cluster_secret: None,
            tls: None,
        };
        let memory = KvMemory::from(region.clone());
        let endpoint = nixl::open(&cfg, &memory, epoch).expect("NIXL should open");
        let setup = NixlSetup { endpoint, min_gb_s: 0.0, pull: NixlPull::Read, answers_pulls: role == Role::Prefill };
        let info = AgentInfo::for_layout(
            cfg.engine_id.clone(),
            Epoch(epoch),
            role,
            KvMode::Pull,
            "test".into(),
            region.layout(),
            region.dtype(),
            setup.offer().into_iter().collect(),
        );
        // Short bounds: the last check waits one out.
        let timeouts = Timeouts { connect: Duration::from_secs(2), io: Duration::from_secs(2) };
        let ours = Ours { timeouts, ..ours(region, false, FaultInjection::default()) };
        let picker = Picker { ours, policy: KvTransport::Nixl, local: false, nixl: setup };
        (picker, info)
    };
    let (prefill, prefill_info) = side("prefill", Role::Prefill, &src, 1);
    let (decode, decode_info) = side("decode", Role::Decode, &dst, 2);
    let (writer, picked) = prefill.pick(&decode_info).expect("prefill picks nixl");
    assert_eq!(picked, Picked::named("nixl", None));
    let reader = decode.accept(&prefill_info, &picked).expect("decode takes it");

    // Push: prefill WRITEs decode's blocks, then its notification; decode confirms the landing.
    let pushed = TransferId("pushed".into());
    let runs = Runs::whole(&src_table, &dst_table, tokens);
    writer.write(runs, &KvFences::complete(), Some(&pushed), &mut NoAnnounce).unwrap();
    reader.confirm_landed(&pushed).unwrap();
    assert_eq!(digest(&src, &src_table, tokens), digest(&dst, &dst_table, tokens), "pushed");

    // A step still computing: one WRITE per group of layers, each once its fence is set, the
    // notification after the last (here into other blocks of decode's).
    let (_, grouped_into) = engine(8, tokens, 5, false);
    let grouped_into: Vec<u32> = grouped_into.iter().map(|b| (b + 29) % 48).collect();
    let (fences, signals): (Vec<_>, Vec<_>) = (0..2).map(|_| tandem_compute::cuda::HostFence::pair()).unzip();
    let groups = KvFences::host(fences.into_iter().zip([0..1, 1..3]).map(|(f, l)| (l, f)).collect());
    let grouped = TransferId("grouped".into());
    signals.into_iter().for_each(|s| s.signal());
    let runs = Runs::whole(&src_table, &grouped_into, tokens);
    writer.write(runs, &groups, Some(&grouped), &mut NoAnnounce).unwrap();
    reader.confirm_landed(&grouped).unwrap();
    assert_eq!(digest(&src, &src_table, tokens), digest(&dst, &grouped_into, tokens), "pushed in groups");

    // Pull: decode READs prefill's blocks itself once granted (into other blocks of its own).
    assert!(writer.grants_reads(), "--kv-nixl-pull read: prefill grants the read");
    let (_, read_into) = engine(8, tokens, 3, false);
    let read_into: Vec<u32> = read_into.iter().map(|b| (b + 13) % 48).collect();
    let pulled = TransferId("pulled".into());
    reader.plan_read(&pulled, src_table.clone(), read_into.clone(), tokens);
    reader.granted(&pulled, Duration::from_secs(10));
    reader.confirm_landed(&pulled).unwrap();
    assert_eq!(digest(&src, &src_table, tokens), digest(&dst, &read_into, tokens), "pulled");
    // A landing no write announced times out within its bound, as a lost notification would.
    let none = TransferId("never-written".into());
    assert!(reader.confirm_landed(&none).is_err());
}

/// cuda-ipc alone, on a GPU (ignored elsewhere; `scripts/gpu/run.sh pd` and `ipc` run it): this
/// process writes scattered block runs of a seeded cache through the `CudaIpc` transport into a
/// cache another process exported (this test binary again, as [`cuda_ipc_peer`]), from 16-token
/// blocks into 16- and 32-token ones; the peer's digest of what landed equals ours, and a write
/// with the corruption fault is caught by it.
#[test]
#[ignore = "needs a GPU"]
fn cuda_ipc_writes_block_runs_into_another_process() {
    use std::io::{BufRead, BufReader, Write};
    use std::process::{Command, Stdio};

    use tandem_compute::cuda::{ops, CudaDevice};
    use tandem_core::{EngineId, Epoch};

    use super::cuda_ipc::{self, CudaIpc};
    use crate::agent_info::{AgentInfo, KvMode, Role, TransportOffer};

    let dev = CudaDevice::open(0).expect("a GPU");
    let ours_layout = KvLayout { num_layers: 4, num_kv_heads: 2, head_dim: 64, block_size: 16, num_blocks: 64 };
    let cache = dev.zeros_exportable::<u16>(ours_layout.num_blocks * ours_layout.block_elems()).unwrap();
    // Safety: the buffer just allocated, that many bf16.
    unsafe { ops::preset_uniform(&dev, cache.ptr(), cache.len() as u64, 0x1bc, 1.0) }.unwrap();
    dev.synchronize().unwrap();
    let device = dev.kv_memory(&cache, ours_layout, tandem_compute::KvDtype::Bf16).unwrap();
    let memory = KvMemory::device(device.clone(), None).unwrap();
    for peer_block in [16, 32] {
        let mut peer = Command::new(std::env::current_exe().unwrap())
            // The second filter matches no test: it tells the peer its block size.
            .args(["--exact", "transport::tests::cuda_ipc_peer", "--include-ignored", "--nocapture"])
            .arg(format!("{PEER_BLOCK_ARG}{peer_block}"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut said = BufReader::new(peer.stdout.take().unwrap()).lines().map_while(Result::ok);
        // The test harness may print its own words before ours on a line.
        let mut next = |tag: &str| said.find_map(|l| l.find(tag).map(|at| l[at + tag.len()..].to_string())).unwrap();
        let export: Vec<String> = next("peer-export ").split_whitespace().map(str::to_string).collect();
        let peer_layout = KvLayout { block_size: peer_block, ..ours_layout };
        let offer = TransportOffer::CudaIpc {
            host: cuda_ipc::host_id(),
            process: peer.id(),
            device: export[2].clone(),
            handle: export[0].clone(),
            bytes: export[1].parse().unwrap(),
        };
        let peer_info = AgentInfo::for_layout(
            EngineId("ipc-peer".into()),
            Epoch(1),
            Role::Decode,
            KvMode::Push,
            "test".into(),
            &peer_layout,
            tandem_compute::KvDtype::Bf16,
            vec![offer],
        );
        let ours = Ours {
            memory: memory.clone(),
            verify: false,
            faults: FaultInjection::default(),
            stage_ahead: false,
            timeouts: Timeouts::default(),
        };
        let mut stdin = peer.stdin.take().unwrap();
        for corrupt in [false, true] {
            let faults = FaultInjection { corrupt_sends: corrupt, ..Default::default() };
            let mapped = cuda_ipc::open(&ours, &peer_info).expect("the peer's cache maps");
            let writer = CudaIpc::writer(Ours { faults, ..ours.clone() }, mapped);
            let tokens = 150;
            let src: Vec<u32> = (0..ours_layout.blocks_for(tokens) as u32).map(|b| (b * 5 + 2) % 64).collect();
            let dst: Vec<u32> = (0..peer_layout.blocks_for(tokens) as u32).map(|b| (b * 7 + 3) % 64).collect();
            let runs = Runs::whole(&src, &dst, tokens);
            writer.write(runs, &KvFences::complete(), None, &mut NoAnnounce).unwrap();
            let blocks: Vec<String> = dst.iter().map(u32::to_string).collect();
            writeln!(stdin, "digest {tokens} {}", blocks.join(",")).unwrap();
            let theirs: u64 = next("peer-digest ").parse().unwrap();
            let ours_digest = device.digest(&src, tokens).unwrap();
            assert_eq!(theirs == ours_digest, !corrupt, "{peer_block}-token blocks, corrupted: {corrupt}");
        }
        drop(stdin);
        assert!(peer.wait().unwrap().success());
    }
}

/// How the GPU test tells its peer process (this binary again) the block size of its cache: a
/// second test-name filter on its command line.
const PEER_BLOCK_ARG: &str = "peer-block-size=";

/// The other process of [`cuda_ipc_writes_block_runs_into_another_process`] (a no-op unless
/// its command line carries [`PEER_BLOCK_ARG`]): exports a zeroed cache, then answers each
/// `digest TOKENS BLOCKS` line on its input with the digest of those blocks.
#[test]
#[ignore = "the peer process of a GPU test"]
fn cuda_ipc_peer() {
    use std::io::BufRead;

    use tandem_compute::cuda::CudaDevice;

    let asked = std::env::args().find_map(|a| a.strip_prefix(PEER_BLOCK_ARG).and_then(|b| b.parse().ok()));
    let Some(block_size) = asked else { return };
    let dev = CudaDevice::open(0).expect("a GPU");
    let layout = KvLayout { num_layers: 4, num_kv_heads: 2, head_dim: 64, block_size, num_blocks: 64 };
    let cache = dev.zeros_exportable::<u16>(layout.num_blocks * layout.block_elems()).unwrap();
    let memory = dev.kv_memory(&cache, layout, tandem_compute::KvDtype::Bf16).unwrap();
    let (handle, device) = memory.export().unwrap().to_hex();
    println!("peer-export {handle} {} {device}", memory.export().unwrap().bytes);
    for line in std::io::stdin().lock().lines().map_while(Result::ok) {
        let w: Vec<&str> = line.split_whitespace().collect();
        if let ["digest", tokens, blocks] = w[..] {
            let blocks: Vec<u32> = blocks.split(',').map(|b| b.parse().unwrap()).collect();
            println!("peer-digest {}", memory.digest(&blocks, tokens.parse().unwrap()).unwrap());
        }
    }
}
