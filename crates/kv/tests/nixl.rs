//! NIXL between two agents over host memory (the `nixl` feature; CI installs the library from
//! PyPI's nixl-cu13 wheel): block runs written into the peer's region land byte for byte,
//! nothing outside them changes, the notification arrives after the data, and bad runs and a
//! missing peer are errors, never a crash.
#![cfg(feature = "nixl")]

use std::time::{Duration, Instant};

use tandem_kv::nixl::{NixlEndpoint, NixlFailure, NixlPlace, NixlRegion, NixlRun, NixlScratch};

fn region(buf: &mut [u8]) -> NixlRegion {
    NixlRegion { addr: buf.as_mut_ptr() as usize, len: buf.len(), place: NixlPlace::Dram }
}

#[test]
fn block_runs_written_over_nixl_land_byte_for_byte_with_a_notification() {
    const SIZE: usize = 1 << 20;
    let mut prefill_kv: Vec<u8> = (0..SIZE).map(|i| (i * 7 % 251) as u8).collect();
    let mut decode_kv = vec![0u8; SIZE];
    let prefill =
        NixlEndpoint::open("test-prefill", region(&mut prefill_kv), NixlScratch::host()).expect("NIXL should open");
    let decode = NixlEndpoint::open("test-decode", region(&mut decode_kv), NixlScratch::host()).unwrap();
    let peer = prefill.add_peer(&decode.metadata().unwrap()).unwrap();
    assert_eq!(peer, "test-decode");
    // Loaded again, as a reconnect to the same peer does: accepted, and writes still land.
    assert_eq!(prefill.add_peer_hex(&decode.metadata_hex().unwrap()).unwrap(), "test-decode");
    // Three runs, as coalesced blocks would be: out of order, different lengths.
    let runs = [
        NixlRun { local_offset: 0, peer_offset: 65536, len: 4096 },
        NixlRun { local_offset: 131072, peer_offset: 0, len: 32768 },
        NixlRun { local_offset: 500000, peer_offset: 700000, len: 100000 },
    ];
    prefill.write(&peer, decode.region(), &runs, Some(b"transfer-1"), Duration::from_secs(10)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let notes = loop {
        let n = decode.notifications().unwrap();
        if !n.is_empty() || Instant::now() > deadline {
            break n;
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    assert_eq!(notes, vec![("test-prefill".to_string(), b"transfer-1".to_vec())]);
    let mut want = vec![0u8; SIZE];
    for r in &runs {
        want[r.peer_offset..r.peer_offset + r.len].copy_from_slice(&prefill_kv[r.local_offset..r.local_offset + r.len]);
    }
    assert!(decode_kv == want, "decode's region differs from the runs written into it");

    // A write given no time at all fails as overdue (or, small enough, completes at once);
    // NIXL keeps the overdue request until it ends, and the next write lands as ever.
    let big = [NixlRun { local_offset: 0, peer_offset: 0, len: SIZE }];
    let r = prefill.write(&peer, decode.region(), &big, None, Duration::ZERO);
    match r {
        Ok(()) | Err(NixlFailure::Timeout { .. }) => {}
        Err(e) => panic!("{e}"),
    }
    prefill.write(&peer, decode.region(), &big, None, Duration::from_secs(10)).unwrap();
    assert!(decode_kv == prefill_kv, "a whole-region write after an overdue one lands byte for byte");
    let deadline = Instant::now() + Duration::from_secs(10);
    while prefill.overdue_writes() > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(prefill.overdue_writes(), 0, "an overdue write NIXL finished is released");

    // Nothing left to write (a push whose parts all went ahead): the notification alone
    // arrives (NIXL refuses a transfer of no descriptors, which failed such pushes on a GPU).
    prefill.write(&peer, decode.region(), &[], Some(b"transfer-empty"), Duration::from_secs(10)).unwrap();
    decode.wait_notification("test-prefill", b"transfer-empty", Duration::from_secs(10)).unwrap();

    // A run past the peer's region is refused before anything moves.
    let past = [NixlRun { local_offset: 0, peer_offset: SIZE - 10, len: 20 }];
    let err = prefill.write(&peer, decode.region(), &past, Some(b"transfer-2"), Duration::from_secs(1)).unwrap_err();
    assert!(matches!(err, NixlFailure::OutOfRegion { side: "peer", .. }), "{err}");
    // An agent that was never introduced is an error.
    let err = prefill.write("nobody", decode.region(), &runs[..1], None, Duration::from_secs(1)).unwrap_err();
    assert!(matches!(err, NixlFailure::Call { .. }), "{err}");
    assert!(decode.notifications().unwrap().is_empty());
}
