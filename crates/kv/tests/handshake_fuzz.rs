//! A stranger's handshake frames, mutated at random: an accepting side with a cluster secret
//! never panics, never waits past its input, and never lets one in. (`fuzz/` holds the same
//! harness as a cargo-fuzz target for longer runs.)

use std::io::{Read, Write};

use tandem_core::{ClusterSecret, EngineId, Epoch};
use tandem_kv::channel::{answer_handshake, read_hello, Hello, Picked};
use tandem_kv::wire::{write_message, Message, PROTOCOL_VERSION};
use tandem_kv::{AgentInfo, Role};

/// A connection whose peer sent exactly `input` and then hung up.
struct Replay<'a> {
    input: &'a [u8],
    output: Vec<u8>,
}

impl Read for Replay<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.input.read(buf)
    }
}

impl Write for Replay<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.output.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Whether the accepting side (a decode engine, with `secret`) let the bytes in.
fn accepted(input: &[u8], secret: Option<&ClusterSecret>) -> bool {
    let ours = AgentInfo { engine_id: EngineId("decode-0".into()), role: Role::Decode, ..AgentInfo::example() };
    let mut conn = Replay { input, output: Vec::new() };
    match read_hello(&mut conn) {
        Ok(Hello::Open(opening)) => {
            answer_handshake(&mut conn, opening, &ours, secret, |_, _| Ok(Picked::tcp())).is_ok()
        }
        _ => false,
    }
}

/// A plausible stranger's opening: its Hello and a Handshake with a made-up proof.
fn transcript() -> Vec<u8> {
    let info = AgentInfo::example();
    let mut bytes = Vec::new();
    let hello = Message::Hello {
        version: PROTOCOL_VERSION,
        nonce: "ab".repeat(32),
        engine_id: info.engine_id.clone(),
        epoch: info.epoch,
    };
    write_message(&mut bytes, &hello).unwrap();
    write_message(&mut bytes, &Message::Handshake { version: PROTOCOL_VERSION, info, proof: Some("cd".repeat(32)) })
        .unwrap();
    bytes
}

/// xorshift64*: reproducible without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn mutate(rng: &mut Rng, base: &[u8]) -> Vec<u8> {
    let mut v = base.to_vec();
    for _ in 0..1 + rng.below(4) {
        match rng.below(6) {
            0 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] ^= 1 << rng.below(8);
            }
            1 if !v.is_empty() => {
                let i = rng.below(v.len());
                v[i] = rng.next() as u8;
            }
            2 => v.truncate(rng.below(v.len() + 1)),
            3 => {
                let i = rng.below(v.len() + 1);
                let junk: Vec<u8> = (0..rng.below(16)).map(|_| rng.next() as u8).collect();
                v.splice(i..i, junk);
            }
            4 if v.len() >= 4 => {
                // A frame length that lies.
                let len = [0u32, 1, 1 << 20, u32::MAX][rng.below(4)].to_be_bytes();
                v[..4].copy_from_slice(&len);
            }
            _ => v = (0..rng.below(200)).map(|_| rng.next() as u8).collect(),
        }
    }
    v
}

#[test]
fn mutated_handshakes_from_a_stranger_never_panic_and_never_pass() {
    let secret = ClusterSecret::new(b"this deployment's cluster secret").unwrap();
    let base = transcript();
    assert!(!accepted(&base, Some(&secret)), "a made-up proof");
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for case in 0..4000 {
        let input = mutate(&mut rng, &base);
        assert!(!accepted(&input, Some(&secret)), "case {case}: {:?}", String::from_utf8_lossy(&input));
        // Without a secret nothing is proved, but nothing may panic either.
        let _ = accepted(&input, None);
    }
    // Frames of every other kind as an opening.
    for msg in [
        Message::Challenge { nonce: "00".repeat(32), engine_id: EngineId("x".into()), epoch: Epoch(1), proof: None },
        Message::JoinStream { token: 1, index: 1, proof: None },
        Message::Heartbeat { transfer_ids: vec![] },
    ] {
        let mut bytes = Vec::new();
        write_message(&mut bytes, &msg).unwrap();
        assert!(!accepted(&bytes, Some(&secret)));
    }
}
