//! A stranger's first bytes on a KV side channel that takes only its cluster's secret: the
//! accepting side must never panic and never let them in (crates/kv/tests/handshake_fuzz.rs
//! runs the same check over mutations of a plausible opening on every `cargo test`).
//!
//! `cargo +nightly fuzz run handshake_frames` (cargo install cargo-fuzz).
#![no_main]

use std::io::{Read, Write};

use libfuzzer_sys::fuzz_target;
use tandem_core::{ClusterSecret, EngineId};
use tandem_kv::channel::{answer_handshake, read_hello, Hello, Picked};
use tandem_kv::{AgentInfo, Role};

struct Replay<'a> {
    input: &'a [u8],
}

impl Read for Replay<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.input.read(buf)
    }
}

impl Write for Replay<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fuzz_target!(|input: &[u8]| {
    let secret = ClusterSecret::new(b"this deployment's cluster secret").unwrap();
    let ours = AgentInfo { engine_id: EngineId("decode-0".into()), role: Role::Decode, ..AgentInfo::example() };
    let mut conn = Replay { input };
    if let Ok(Hello::Open(opening)) = read_hello(&mut conn) {
        let accepted = answer_handshake(&mut conn, opening, &ours, Some(&secret), |_, _| Ok(Picked::tcp()));
        assert!(accepted.is_err(), "a stranger's bytes passed the cluster secret's handshake");
    }
});
