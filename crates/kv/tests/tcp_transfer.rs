//! The TCP data path between two endpoints over loopback: handshake, block bytes landing in
//! the right place for equal and different block sizes, refusals and bounded waits.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use tandem_compute::{KvCache, KvLayout};
use tandem_core::{EngineId, TransferId};
use tandem_kv::blocks::KvSlice;
use tandem_kv::channel::{accept_handshake, connect, handshake, Picked, Timeouts};
use tandem_kv::tcp::{recv_blocks, send_blocks};
use tandem_kv::wire::{read_message, write_message, Message};
use tandem_kv::{AgentInfo, KvError, KvMode, Role};

fn infos(block_p: usize, block_d: usize) -> (AgentInfo, AgentInfo) {
    let p = AgentInfo { block_size: block_p, ..AgentInfo::example() };
    let d = AgentInfo { engine_id: EngineId("decode-0".into()), role: Role::Decode, block_size: block_d, ..p.clone() };
    (p, d)
}

fn layout(bs: usize) -> KvLayout {
    KvLayout { num_layers: 4, num_kv_heads: 2, head_dim: 32, block_size: bs, num_blocks: 64 }
}

fn fill(cache: &mut KvCache, table: &[u32], tokens: usize) {
    let l = *cache.layout();
    for t in 0..tokens {
        for layer in 0..l.num_layers {
            let k: Vec<f32> = (0..64).map(|i| (t * 7 + layer * 3 + i) as f32).collect();
            let v: Vec<f32> = (0..64).map(|i| -((t * 5 + layer + i) as f32)).collect();
            cache.write_token(layer, table[t / l.block_size] as usize, t % l.block_size, &k, &v);
        }
    }
}

#[test]
fn a_checksummed_send_detects_one_flipped_bit_in_data_or_checksum_for_either_block_size() {
    let tokens = 40;
    let mut p_cache = KvCache::new(layout(16));
    let p_table: Vec<u32> = (0..layout(16).blocks_for(tokens) as u32).map(|b| b * 5).collect();
    fill(&mut p_cache, &p_table, tokens);
    let mut wire = Vec::new();
    // Safety: the test owns every block of this cache.
    let bytes = unsafe { send_blocks(&mut wire, &p_cache.region(), &p_table, tokens, true).unwrap() };
    assert_eq!(wire.len() as u64, bytes + tandem_kv::tcp::CHECKSUM_BYTES, "the checksum follows the data");
    for bs_d in [16, 8] {
        let d_table: Vec<u32> = (0..layout(bs_d).blocks_for(tokens) as u32).collect();
        let recv = |w: &[u8]| {
            let d_cache = KvCache::new(layout(bs_d));
            let region = d_cache.region();
            // Safety: the test owns every block of this cache.
            unsafe { recv_blocks(&mut &w[..], bytes, 16, &region, &d_table, tokens, true) }
        };
        recv(&wire).unwrap();
        for at in [0, wire.len() / 2, wire.len() - 1] {
            let mut bad = wire.clone();
            bad[at] ^= 0x10;
            let e = recv(&bad).unwrap_err();
            assert!(matches!(e, KvError::Corrupt(_)), "bit flipped at {at} of {} (bs {bs_d}): {e}", wire.len());
            assert!(e.to_string().contains("checksum mismatch"), "{e}");
        }
    }
}

#[test]
fn block_writes_land_exactly_for_equal_and_different_block_sizes() {
    // With and without a checksum after the bytes (`--kv-verify`).
    for (bs_p, bs_d, tokens, checksum) in
        [(16, 16, 100, false), (16, 8, 77, true), (8, 16, 5, false), (16, 16, 33, true)]
    {
        let (p_info, d_info) = infos(bs_p, bs_d);
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let d_table: Vec<u32> = (0..layout(bs_d).blocks_for(tokens) as u32).map(|b| 63 - b * 2).collect();
        let d_table2 = d_table.clone();
        // Decode side: accepts, checks the handshake, receives one write into its blocks.
        let decode = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            tandem_kv::channel::configure(&s, Timeouts::default()).unwrap();
            let (peer, _, _) = accept_handshake(&mut s, &d_info, None, |_, _| Ok(Picked::tcp())).unwrap();
            assert_eq!(peer.engine_id.0, "prefill-0");
            let cache = KvCache::new(layout(bs_d));
            match read_message(&mut s).unwrap() {
                Message::WriteBlocks { transfer_id, blocks, src_block_size, num_tokens, bytes, checksum, .. } => {
                    assert_eq!(blocks, d_table2);
                    let region = cache.region();
                    // Safety: the test owns every block of this cache.
                    unsafe {
                        recv_blocks(&mut s, bytes, src_block_size, &region, &blocks, num_tokens, checksum).unwrap()
                    };
                    write_message(&mut s, &Message::WriteAck { transfer_id, error: None }).unwrap();
                }
                other => panic!("unexpected {other:?}"),
            }
            cache
        });
        // Prefill side: fills scattered blocks, connects, writes them.
        let mut p_cache = KvCache::new(layout(bs_p));
        let p_table: Vec<u32> = (0..layout(bs_p).blocks_for(tokens) as u32).map(|b| (b * 3) % 64).collect();
        fill(&mut p_cache, &p_table, tokens);
        let mut s = connect(&addr, Timeouts::default()).unwrap();
        let (peer, picked, _) = handshake(&mut s, &p_info, None).unwrap();
        assert_eq!((peer.role, picked), (Role::Decode, Picked::tcp()));
        let region = p_cache.region();
        let bytes = tandem_kv::blocks::wire_bytes(region.layout(), region.dtype(), tokens);
        let t = TransferId("t".into());
        write_message(
            &mut s,
            &Message::WriteBlocks {
                transfer_id: t.clone(),
                blocks: d_table.clone(),
                src_block_size: bs_p,
                num_tokens: tokens,
                from_token: 0,
                last: true,
                layers: None,
                rank: 0,
                ranks: 1,
                streams: 1,
                bytes,
                checksum,
            },
        )
        .unwrap();
        // Safety: the test owns every block of this cache.
        let sent = unsafe { send_blocks(&mut s, &region, &p_table, tokens, checksum).unwrap() };
        assert_eq!(sent, bytes);
        assert_eq!(read_message(&mut s).unwrap(), Message::WriteAck { transfer_id: t, error: None });
        let d_cache = decode.join().unwrap();
        let (lp, ld) = (layout(bs_p), layout(bs_d));
        for tok in 0..tokens {
            for layer in 0..4 {
                for kv in 0..2 {
                    for h in 0..2 {
                        let a = &p_cache.plane(p_table[tok / lp.block_size] as usize, layer, kv, h)
                            [(tok % bs_p) * 32..][..32];
                        let b = &d_cache.plane(d_table[tok / ld.block_size] as usize, layer, kv, h)
                            [(tok % bs_d) * 32..][..32];
                        assert_eq!(a, b, "bs {bs_p}->{bs_d}, token {tok} layer {layer}");
                    }
                }
            }
        }
    }
}

#[test]
fn incompatible_peers_are_refused_at_handshake_with_the_reason() {
    let (p_info, d_info) = infos(16, 16);
    let d_info = AgentInfo { kv_mode: KvMode::Pull, ..d_info };
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        accept_handshake(&mut s, &d_info, None, |_, _| Ok(Picked::tcp())).unwrap_err().to_string()
    });
    let mut s = connect(&addr, Timeouts::default()).unwrap();
    let err = handshake(&mut s, &p_info, None).unwrap_err();
    assert!(matches!(err, KvError::Refused(_)), "{err}");
    assert!(err.to_string().contains("kv_mode differs"), "{err}");
    assert!(server.join().unwrap().contains("kv_mode differs"));
}

#[test]
fn a_silent_peer_times_out_within_the_bound_and_an_absent_one_is_unreachable() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let t = Timeouts { connect: Duration::from_millis(500), io: Duration::from_millis(200) };
    let mut s = connect(&addr, t).unwrap();
    let start = Instant::now();
    let err = handshake(&mut s, &AgentInfo::example(), None).unwrap_err();
    assert!(err.is_timeout(), "{err}");
    assert!(start.elapsed() < Duration::from_secs(2));
    drop(listener);
    let err = connect(&addr, t).unwrap_err();
    assert!(matches!(err, KvError::Unreachable { .. }), "{err}");
}

/// A bulk transfer in pieces, as a GPU engine's memory stages it: the sender reads a piece
/// only after its `ready` hook (where a device-to-host copy is waited for), so bytes the hook
/// puts there are the bytes that arrive; the receiver reports each piece once it has its bytes,
/// covering every destination block once, in order. Runs longer than a piece are cut.
#[test]
fn staged_pieces_are_read_after_their_hook_and_reported_as_they_land() {
    use tandem_kv::blocks::BlockRun;
    use tandem_kv::tcp::{pieces, recv_staged, send_pieces, send_staged, slice_pieces, Destination, PIECE_BYTES};
    // Blocks of 1 MiB, so a piece holds 8 of them.
    let l = KvLayout { num_layers: 8, num_kv_heads: 4, head_dim: 64, block_size: 64, num_blocks: 40 };
    let (src_cache, dst_cache) = (KvCache::new(l), KvCache::new(l));
    let (src, dst) = (src_cache.region(), dst_cache.region());
    assert_eq!(src.block_bytes(), 1 << 20);
    // One run of 19 blocks, one of 2: pieces of 8, 8, 3 and 2 blocks.
    let table: Vec<u32> = (3..22).chain([30, 31]).collect();
    let tokens = table.len() * 64 - 10;
    let p = send_pieces(&src, &table, tokens).unwrap();
    let lens: Vec<u32> = p.iter().map(|r| r.len).collect();
    assert_eq!(lens, [8, 8, 3, 2]);
    assert_eq!(p[0], BlockRun { start: 3, len: (PIECE_BYTES >> 20) as u32 });
    assert_eq!(pieces(&[5], usize::MAX), [BlockRun { start: 5, len: 1 }], "at least one block a piece");
    let mut wire = Vec::new();
    let mut readied = Vec::new();
    let mut ready = |i: usize| {
        // Stands in for the device copy landing: the piece's bytes appear only now.
        // Safety: the test owns every block of this cache.
        let bytes = unsafe { src.bytes_mut(p[i].start as usize, p[i].len as usize) };
        bytes.iter_mut().enumerate().for_each(|(j, b)| *b = (i * 31 + j % 251) as u8);
        readied.push(i);
        Ok(())
    };
    // Safety (both calls): the test owns every block of both caches.
    let bytes = unsafe { send_staged(&mut wire, &src, (&p, KvSlice::all(&l)), tokens, true, &mut ready).unwrap() };
    assert_eq!(readied, [0, 1, 2, 3]);
    let dst_table: Vec<u32> = (10..31).collect();
    let mut landed = Vec::new();
    let into = Destination::all(&dst, &dst_table, tokens);
    let mut report = |run| {
        landed.push(run);
        Ok(())
    };
    unsafe { recv_staged(&mut &wire[..], bytes, 64, into, true, &mut report).unwrap() };
    let covered: Vec<u32> = landed.iter().flat_map(|r| r.start..r.start + r.len).collect();
    assert_eq!(covered, dst_table, "every destination block reported once, in order");
    for (s, d) in table.iter().zip(&dst_table) {
        // Safety: the test owns every block of both caches.
        let (a, b) = unsafe { (src.bytes(*s as usize, 1), dst.bytes(*d as usize, 1)) };
        assert!(a == b && a.iter().any(|&x| x != 0), "block {s} -> {d}");
    }
    // A group of layers: each block's slice of layers 2..5 goes, and lands, alone.
    let group_cache = KvCache::new(l);
    let group = group_cache.region();
    let mut wire = Vec::new();
    let layers = KvSlice::of_layers(&l, 2..5);
    let bytes = unsafe { send_staged(&mut wire, &src, (&p, layers.clone()), tokens, true, &mut |_| Ok(())).unwrap() };
    assert_eq!(bytes, layers.wire_bytes(&l, src.dtype(), tokens));
    assert_eq!(wire.len() as u64, bytes + 4);
    let into = Destination { slice: layers.clone(), ..Destination::all(&group, &dst_table, tokens) };
    let mut group_landed = Vec::new();
    let mut report = |run: BlockRun| {
        group_landed.push(run.len);
        Ok(())
    };
    unsafe { recv_staged(&mut &wire[..], bytes, 64, into, true, &mut report).unwrap() };
    // Pieces by the group's bytes, a quarter of them each (5 blocks of 3/8 MiB), not by whole
    // blocks' (8 a piece): a few copies to wait for, each overlapping the socket.
    assert_eq!(group_landed, [5, 5, 5, 5, 1]);
    let lens = |slice: KvSlice| slice_pieces(&src, &table, &slice).unwrap().iter().map(|r| r.len).collect::<Vec<_>>();
    assert_eq!(lens(layers.clone()), [5, 5, 5, 4, 2], "runs are cut where they end");
    // One layer's slice (1/8 MiB a block): pieces of 1 MiB at least, so 8 blocks.
    assert_eq!(lens(KvSlice::of_layers(&l, 7..8)), [8, 8, 3, 2]);
    // A large transfer: pieces of at most PIECE_BYTES.
    let many: Vec<u32> = (0..40).collect();
    let whole = slice_pieces(&src, &many, &KvSlice::all(&l)).unwrap();
    assert_eq!(whole.iter().map(|r| r.len).collect::<Vec<_>>(), [8, 8, 8, 8, 8]);
    let layer_bytes = src.block_bytes() / 8;
    for (s, d) in table.iter().zip(&dst_table) {
        let (a, b) = unsafe { (src.bytes(*s as usize, 1), group.bytes(*d as usize, 1)) };
        let slice = 2 * layer_bytes..5 * layer_bytes;
        assert_eq!(a[slice.clone()], b[slice.clone()], "block {s} -> {d}: layers 2..5");
        assert!(b[..slice.start].iter().chain(&b[slice.end..]).all(|&x| x == 0), "block {d}: other layers written");
    }
}

/// `n` loopback TCP connections: their sending ends and their receiving ends, which wait at
/// most 2 s for a read.
fn loopback_streams(n: usize) -> (Vec<std::net::TcpStream>, Vec<std::net::TcpStream>) {
    use std::net::{TcpListener, TcpStream};
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let out: Vec<TcpStream> = (0..n).map(|_| TcpStream::connect(addr).unwrap()).collect();
    let inn: Vec<TcpStream> = (0..n).map(|_| listener.accept().unwrap().0).collect();
    for s in &inn {
        s.set_read_timeout(Some(std::time::Duration::from_secs(2))).unwrap();
    }
    (out, inn)
}

/// Bytes striped over several TCP streams land where a single stream would put them, whatever
/// the streams' count and the segments' sizes; a flipped bit on one stream is caught by that
/// stream's checksum, and a stream cut mid-send fails the receive rather than hang it.
#[test]
fn bytes_striped_over_several_streams_land_in_order_and_a_bad_stream_is_caught() {
    use std::net::TcpStream;
    use tandem_kv::tcp::{recv_striped, send_striped, STRIPE_BYTES};
    let data: Vec<u8> = (0..(5 * STRIPE_BYTES + 12345)).map(|i| (i * 7 % 251) as u8).collect();
    // Segments of odd sizes, as a group's per-block slices are.
    let cuts = [0, 1000, STRIPE_BYTES + 3, 3 * STRIPE_BYTES, data.len()];
    let segments: Vec<&[u8]> = cuts.windows(2).map(|w| &data[w[0]..w[1]]).collect();
    for n in [1, 3, 4, 8] {
        let (mut out, mut inn) = loopback_streams(n);
        let mut got = vec![0u8; data.len()];
        let sent = std::thread::scope(|s| {
            let sender = s.spawn(|| send_striped(&mut out, &segments, true).unwrap());
            let (a, b) = got.split_at_mut(2 * STRIPE_BYTES + 7);
            recv_striped(&mut inn, &mut [a, b], true).unwrap();
            sender.join().unwrap()
        });
        assert_eq!(sent, data.len() as u64);
        assert!(got == data, "{n} streams");
    }
    // A bit flipped on the second stream, after the sender's checksum.
    struct FlipFirst(TcpStream, bool);
    impl std::io::Write for FlipFirst {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            match (self.1, buf.first()) {
                (false, Some(&b)) => {
                    self.1 = true;
                    self.0.write_all(&[b ^ 1]).map(|()| 1)
                }
                _ => self.0.write(buf),
            }
        }
        fn flush(&mut self) -> std::io::Result<()> {
            self.0.flush()
        }
    }
    let (out, mut inn) = loopback_streams(3);
    let mut out: Vec<FlipFirst> = out.into_iter().enumerate().map(|(i, s)| FlipFirst(s, i != 1)).collect();
    let mut got = vec![0u8; data.len()];
    let received = std::thread::scope(|s| {
        s.spawn(|| send_striped(&mut out, &[&data], true).unwrap());
        recv_striped(&mut inn, &mut [&mut got], true)
    });
    assert!(matches!(received, Err(tandem_kv::KvError::Corrupt(ref e)) if e.contains("stream 1")), "{received:?}");
    // One stream cut after its first stripe: the receive fails within its read bound.
    let (mut out, mut inn) = loopback_streams(2);
    let mut got = vec![0u8; data.len()];
    let received = std::thread::scope(|s| {
        s.spawn(|| {
            use std::io::Write;
            out[0].write_all(&data[..STRIPE_BYTES]).unwrap();
            out[0].shutdown(std::net::Shutdown::Both).unwrap();
            let _ = send_striped(&mut out[1..], &[&data[..STRIPE_BYTES]], false);
        });
        recv_striped(&mut inn, &mut [&mut got], false)
    });
    assert!(matches!(received, Err(ref e) if !matches!(e, tandem_kv::KvError::Corrupt(_))), "{received:?}");
}

/// Striped bytes move piece by piece: a stream sends a stripe once the pieces under it are
/// ready (a GPU engine's copies to its host copy), and the receiver hears of each piece as soon
/// as its stripes have landed. Here the sender's second piece becomes ready only once the
/// receiver has been told of the first, which deadlocks (and fails the bounded waits) if either
/// end waits for the whole send; a piece that fails stops the send with its error.
/// Both with threads started per send and receive and with a connection's kept ones (twice:
/// kept threads that saw a send fail carry the next).
#[test]
fn striped_bytes_go_out_as_their_pieces_are_ready_and_are_told_as_they_land() {
    use tandem_kv::tcp::{Crew, FRESH};
    striped_pieces_with(&FRESH, &FRESH);
    let (send, recv) = (Crew::kept(4, "test-send"), Crew::kept(4, "test-recv"));
    assert!(matches!((&send, &recv), (Crew::Kept(_), Crew::Kept(_))));
    striped_pieces_with(&send, &recv);
    striped_pieces_with(&send, &recv);
}

fn striped_pieces_with(send_crew: &tandem_kv::tcp::Crew, recv_crew: &tandem_kv::tcp::Crew) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Condvar, Mutex};
    use std::time::Duration;
    use tandem_kv::tcp::{recv_striped_as_landed, send_striped_as_ready, STRIPE_BYTES};
    let data: Vec<u8> = (0..6 * STRIPE_BYTES).map(|i| (i * 13 % 251) as u8).collect();
    // Segments of odd sizes on both ends, pieces ending where segments do (as a group's blocks
    // do), neither on a stripe's bounds.
    let segments: Vec<&[u8]> = data.chunks(STRIPE_BYTES / 2 + 7).collect();
    let lens: Vec<usize> = segments.iter().map(|s| s.len()).collect();
    let starts: Vec<usize> = lens.iter().scan(0, |at, len| Some(std::mem::replace(at, *at + len))).collect();
    let ends = [starts[5], starts[9], data.len()];
    // Pieces the receiver has been told of, and bytes the sender has made ready.
    let told = (Mutex::new(0usize), Condvar::new());
    let ready_upto = AtomicUsize::new(0);
    let wait_told = |piece: usize| {
        let (lock, cond) = &told;
        let guard = lock.lock().unwrap();
        let (guard, timeout) = cond.wait_timeout_while(guard, Duration::from_secs(5), |n| *n < piece).unwrap();
        assert!(!timeout.timed_out(), "piece {piece} waits for the receiver to hear of piece {}", piece - 1);
        drop(guard);
    };
    let segment = |i: usize| {
        assert!(starts[i] + lens[i] <= ready_upto.load(Ordering::SeqCst), "segment {i} read before it was ready");
        segments[i]
    };
    let (mut out, mut inn) = loopback_streams(4);
    let mut got = vec![0u8; data.len()];
    let (sent, received) = std::thread::scope(|s| {
        let sender = s.spawn(|| {
            let mut ready = |i: usize| {
                if i > 0 {
                    wait_told(i);
                }
                ready_upto.store(ends[i], Ordering::SeqCst);
                Ok(())
            };
            send_striped_as_ready(&mut out, (&lens, &segment), true, (&ends, &mut ready), send_crew)
        });
        let mut landed = |i: usize| {
            let (lock, cond) = &told;
            let mut n = lock.lock().unwrap();
            assert_eq!(*n, i, "pieces are told in order, once each");
            *n += 1;
            cond.notify_all();
            Ok(())
        };
        let mut into: Vec<&mut [u8]> = got.chunks_mut(STRIPE_BYTES / 2 + 7).collect();
        let received = recv_striped_as_landed(&mut inn, &mut into, true, (&ends, &mut landed), recv_crew);
        (sender.join().unwrap(), received)
    });
    assert_eq!(sent.unwrap(), data.len() as u64);
    received.unwrap();
    assert!(got == data);
    assert_eq!(*told.0.lock().unwrap(), 3);

    // The second piece's copy fails (once the receiver has heard of the first): the send stops
    // with that error, no byte past the first piece goes out, and the receiver, told of the
    // first piece only, fails within its bound.
    let (mut out, mut inn) = loopback_streams(4);
    ready_upto.store(0, Ordering::SeqCst);
    *told.0.lock().unwrap() = 0;
    let told_of = Mutex::new(Vec::new());
    let mut got = vec![0u8; data.len()];
    let (sent, received) = std::thread::scope(|s| {
        let sender = s.spawn(|| {
            let mut ready = |i: usize| match i {
                0 => {
                    ready_upto.store(ends[0], Ordering::SeqCst);
                    Ok(())
                }
                _ => {
                    wait_told(1);
                    Err(tandem_kv::KvError::Transfer("copying KV to the host copy failed".into()))
                }
            };
            let sent = send_striped_as_ready(&mut out, (&lens, &segment), false, (&ends, &mut ready), send_crew);
            drop(out);
            sent
        });
        let mut landed = |i: usize| {
            told_of.lock().unwrap().push(i);
            let (lock, cond) = &told;
            *lock.lock().unwrap() += 1;
            cond.notify_all();
            Ok(())
        };
        let mut into: Vec<&mut [u8]> = got.chunks_mut(STRIPE_BYTES / 2 + 7).collect();
        let received = recv_striped_as_landed(&mut inn, &mut into, false, (&ends, &mut landed), recv_crew);
        (sender.join().unwrap(), received)
    });
    assert!(matches!(sent, Err(tandem_kv::KvError::Transfer(ref e)) if e.contains("host copy")), "{sent:?}");
    assert!(received.is_err());
    assert_eq!(*told_of.lock().unwrap(), [0]);
}

const SECRET: &str = "the secret of this cluster, 32 b";

fn secret(text: &str) -> Option<tandem_core::ClusterSecret> {
    Some(tandem_core::ClusterSecret::new(text.as_bytes()).unwrap())
}

type Accepted = Result<(AgentInfo, Picked, tandem_kv::seal::Session), KvError>;

/// A decode engine's side channel accepting one connection with `acceptor_secret`, then
/// `after` on what it accepted; `connector` runs on the connecting side's stream meanwhile.
/// Both results.
fn against_acceptor<A: Send + 'static, C: Send + 'static>(
    acceptor_secret: Option<&'static str>,
    after: impl FnOnce(&mut std::net::TcpStream, Accepted) -> A + Send + 'static,
    connector: impl FnOnce(&mut std::net::TcpStream) -> C,
) -> (A, C) {
    let (_, d_info) = infos(16, 16);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let acceptor = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        tandem_kv::channel::configure(&s, Timeouts::default()).unwrap();
        let secret = acceptor_secret.and_then(secret);
        let accepted = accept_handshake(&mut s, &d_info, secret.as_ref(), |_, _| Ok(Picked::tcp()));
        after(&mut s, accepted)
    });
    let mut s = connect(&addr, Timeouts::default()).unwrap();
    let c = connector(&mut s);
    drop(s);
    (acceptor.join().unwrap(), c)
}

fn heartbeat(id: &str) -> Message {
    Message::Heartbeat { transfer_ids: vec![TransferId(id.into())] }
}

#[test]
fn with_one_secret_both_ends_prove_it_and_their_frames_are_authenticated() {
    let (at_acceptor, at_connector) = against_acceptor(
        Some(SECRET),
        |s, accepted| {
            let (peer, _, mut session) = accepted.unwrap();
            assert!(session.authenticated());
            let got = session.opener.read(s).unwrap();
            session.sealer.write(s, &heartbeat("back")).unwrap();
            (peer.engine_id.0, got)
        },
        |s| {
            let (p_info, _) = infos(16, 16);
            let (peer, _, mut session) = handshake(s, &p_info, secret(SECRET).as_ref()).unwrap();
            session.sealer.write(s, &heartbeat("there")).unwrap();
            (peer.engine_id.0, session.opener.read(s).unwrap())
        },
    );
    assert_eq!(at_acceptor, ("prefill-0".to_string(), heartbeat("there")));
    assert_eq!(at_connector, ("decode-0".to_string(), heartbeat("back")));
}

#[test]
fn a_peer_without_the_secret_or_with_another_learns_nothing_and_is_refused() {
    let (p_info, _) = infos(16, 16);
    let accepted_err = |s: &mut std::net::TcpStream, a: Accepted| {
        // Nothing else comes from a refused peer's side: the acceptor's socket is closed.
        let _ = s;
        a.map(|_| ()).unwrap_err()
    };
    // No secret at a side that requires one: the connector is told why, and says nothing of
    // itself (no Handshake: the acceptor's read ends when it hangs up).
    let (acceptor, connector) = against_acceptor(Some(SECRET), accepted_err, |s| handshake(s, &p_info, None));
    let connector = connector.unwrap_err();
    assert!(matches!(connector, KvError::Unauthenticated(_)), "{connector}");
    assert!(connector.to_string().contains("has none"), "{connector}");
    assert!(acceptor.to_string().contains("left without proving"), "{acceptor}");
    // Another secret: the connector finds the acceptor's proof wrong and stops there.
    let p2 = p_info.clone();
    let (acceptor, connector) = against_acceptor(Some(SECRET), accepted_err, move |s| {
        handshake(s, &p2, secret("another cluster's secret").as_ref())
    });
    assert!(connector.unwrap_err().to_string().contains("could not prove it holds this cluster's secret"));
    assert!(matches!(acceptor, KvError::Unauthenticated(_)), "{acceptor}");
    // An intruder that ignores the challenge and answers with a made-up proof, or none: refused
    // before its info is looked at, with the reason.
    for proof in [Some("00".repeat(32)), None] {
        let p3 = p_info.clone();
        let (acceptor, refusal) = against_acceptor(Some(SECRET), accepted_err, move |s| {
            write_message(s, &hello(&p3)).unwrap();
            assert!(matches!(read_message(s).unwrap(), Message::Challenge { proof: Some(_), .. }));
            write_message(s, &Message::Handshake { version: tandem_kv::wire::PROTOCOL_VERSION, info: p3, proof })
                .unwrap();
            read_message(s).unwrap()
        });
        assert!(matches!(acceptor, KvError::Unauthenticated(_)), "{acceptor}");
        assert!(
            matches!(refusal, Message::HandshakeRefused { ref reason } if reason.contains("could not prove")),
            "{refusal:?}"
        );
    }
    // A secret on the connecting side only: it refuses an acceptor that proves none.
    let p4 = p_info.clone();
    let (_, connector) = against_acceptor(None, |_, a| a.is_ok(), move |s| handshake(s, &p4, secret(SECRET).as_ref()));
    assert!(connector.unwrap_err().to_string().contains("has no cluster secret"));
}

fn hello(info: &AgentInfo) -> Message {
    let nonce = "11".repeat(32);
    Message::Hello {
        version: tandem_kv::wire::PROTOCOL_VERSION,
        nonce,
        engine_id: info.engine_id.clone(),
        epoch: info.epoch,
    }
}

#[test]
fn a_recorded_handshake_replayed_on_a_new_connection_is_refused() {
    let (p_info, _) = infos(16, 16);
    // A legitimate connector's frames, recorded on the way (its proof is over this
    // connection's nonces).
    let recorded = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let tape = recorded.clone();
    let p1 = p_info.clone();
    let (ok, _) = against_acceptor(
        Some(SECRET),
        |_, a| a.is_ok(),
        move |s| {
            let (nonce, engine_id, epoch) = ("22".repeat(32), p1.engine_id.clone(), p1.epoch);
            let hello =
                Message::Hello { version: tandem_kv::wire::PROTOCOL_VERSION, nonce: nonce.clone(), engine_id, epoch };
            write_message(s, &hello).unwrap();
            let Message::Challenge { nonce: theirs, engine_id, epoch, .. } = read_message(s).unwrap() else { panic!() };
            // The proof a real connector makes, the way `handshake` makes it.
            let n = |h: &str| tandem_kv::seal::parse_nonce(h).unwrap();
            let (c, a) = (n(&nonce), n(&theirs));
            let t = tandem_kv::seal::Transcript {
                connector_nonce: &c,
                acceptor_nonce: &a,
                connector: (&p1.engine_id.0, p1.epoch.0),
                acceptor: (&engine_id.0, epoch.0),
            };
            let proof = Some(t.proof(secret(SECRET).as_ref().unwrap(), tandem_kv::seal::End::Connector));
            let handshake = Message::Handshake { version: tandem_kv::wire::PROTOCOL_VERSION, info: p1, proof };
            write_message(s, &handshake).unwrap();
            tape.lock().unwrap().extend([hello, handshake]);
        },
    );
    assert!(ok, "the recorded connector was let in");
    // Replayed word for word: the acceptor's fresh nonce makes the old proof worthless.
    let replay = recorded.lock().unwrap().clone();
    let (acceptor, refusal) = against_acceptor(
        Some(SECRET),
        |_, a| a.map(|_| ()).unwrap_err(),
        move |s| {
            write_message(s, &replay[0]).unwrap();
            let _challenge = read_message(s).unwrap();
            write_message(s, &replay[1]).unwrap();
            read_message(s).unwrap()
        },
    );
    assert!(matches!(acceptor, KvError::Unauthenticated(_)), "{acceptor}");
    assert!(matches!(refusal, Message::HandshakeRefused { .. }), "{refusal:?}");
}
