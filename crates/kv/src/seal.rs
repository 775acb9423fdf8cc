//! Authenticated side-channel frames and the keys of one connection, from a cluster secret
//! (`--cluster-secret-file`).
//!
//! The handshake (`channel`) proves both ends hold the secret over fresh nonces from each side
//! and both engines' names, then derives a session key from the same and a key per direction
//! from that. Every later frame carries an HMAC-SHA256 tag over its sequence number in its
//! direction and its body, so a frame cannot be forged, altered, dropped, reordered or replayed
//! without the reader noticing and ending the connection. Bulk bytes after a frame are not
//! tagged (`--kv-verify` checks their integrity; TLS would keep them from a party on the path).
//! Without a secret frames go untagged, as before.
//!
//! Layer: beside `wire`, whose framing it uses; calls `error` and tandem-core's HMAC.

use std::io::{Read, Write};

use tandem_core::{constant_time_eq, hex, keyed, ClusterSecret, Mac, MAC_BYTES};

use crate::error::KvError;
use crate::wire::{decode, encode, read_body, write_frame, Message};

/// Bytes of a handshake nonce.
pub const NONCE_BYTES: usize = 32;

/// A handshake nonce: fresh from the OS for every connection.
pub type Nonce = [u8; NONCE_BYTES];

/// A fresh nonce.
pub fn fresh_nonce() -> Result<Nonce, KvError> {
    let mut n = [0u8; NONCE_BYTES];
    getrandom::fill(&mut n).map_err(|e| KvError::Unsupported(format!("no randomness from the OS for a nonce: {e}")))?;
    Ok(n)
}

/// The nonce in a hex string, or a protocol error.
pub fn parse_nonce(text: &str) -> Result<Nonce, KvError> {
    parse_hex(text).ok_or_else(|| KvError::Protocol(format!("`{text}` is not a {NONCE_BYTES}-byte hex nonce")))
}

fn parse_hex<const N: usize>(text: &str) -> Option<[u8; N]> {
    if text.len() != 2 * N || !text.is_ascii() {
        return None;
    }
    let mut out = [0u8; N];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// What a connection's handshake binds: both nonces and both engines' names, the connecting
/// side's first.
pub struct Transcript<'a> {
    /// The connecting side's nonce (its `Hello`).
    pub connector_nonce: &'a Nonce,
    /// The accepting side's nonce (its `Challenge`).
    pub acceptor_nonce: &'a Nonce,
    /// The connecting engine's id and epoch.
    pub connector: (&'a str, u64),
    /// The accepting engine's id and epoch.
    pub acceptor: (&'a str, u64),
}

/// Which end of a connection proves or seals.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    /// The side that connected (sent `Hello`).
    Connector,
    /// The side that accepted (sent `Challenge`).
    Acceptor,
}

impl End {
    fn label(self) -> &'static str {
        match self {
            End::Connector => "connector",
            End::Acceptor => "acceptor",
        }
    }
}

impl Transcript<'_> {
    fn mac(&self, secret: &ClusterSecret, label: &str) -> Mac {
        let (c_epoch, a_epoch) = (self.connector.1.to_be_bytes(), self.acceptor.1.to_be_bytes());
        secret.mac(
            label,
            &[
                self.connector_nonce,
                self.acceptor_nonce,
                self.connector.0.as_bytes(),
                &c_epoch,
                self.acceptor.0.as_bytes(),
                &a_epoch,
            ],
        )
    }

    /// `end`'s proof that it holds the secret, hex.
    pub fn proof(&self, secret: &ClusterSecret, end: End) -> String {
        hex(&self.mac(secret, &format!("tandem-kv v10 proof {}", end.label())))
    }

    /// Whether `proof` is `end`'s proof (compared in constant time).
    pub fn check(&self, secret: &ClusterSecret, end: End, proof: &str) -> bool {
        constant_time_eq(proof.as_bytes(), self.proof(secret, end).as_bytes())
    }

    /// The connection's keys, as `end` uses them.
    pub fn session(&self, secret: &ClusterSecret, end: End) -> Session {
        let key = self.mac(secret, "tandem-kv v10 session");
        let way = |from: End| keyed(&key, &format!("frames from the {}", from.label()), &[]);
        let other = match end {
            End::Connector => End::Acceptor,
            End::Acceptor => End::Connector,
        };
        Session { sealer: Sealer::keyed(way(end)), opener: Opener::keyed(way(other)), join_key: Some(key) }
    }
}

/// A connection's frame keys (none without a cluster secret): the sealer for what this end
/// writes, the opener for what it reads, and the key further streams prove themselves with.
pub struct Session {
    /// Seals what this end writes.
    pub sealer: Sealer,
    /// Opens what this end reads.
    pub opener: Opener,
    join_key: Option<Mac>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.join_key.is_some() { "Session(authenticated)" } else { "Session(plain)" })
    }
}

impl Session {
    /// Whether the connection's frames are authenticated (a cluster secret).
    pub fn authenticated(&self) -> bool {
        self.join_key.is_some()
    }

    /// Untagged frames: no cluster secret.
    pub fn plain() -> Self {
        Self { sealer: Sealer { key: None, seq: 0 }, opener: Opener { key: None, seq: 0 }, join_key: None }
    }

    /// What a further stream `index` of the connection whose join token is `token` sends to
    /// prove it belongs to it (`None` without a secret).
    pub fn join_proof(&self, token: u64, index: usize) -> Option<String> {
        JoinKey(self.join_key).proof(token, index)
    }

    /// The key the accepting side checks joining streams with.
    pub fn join_key(&self) -> JoinKey {
        JoinKey(self.join_key)
    }
}

/// The key a connection's further streams prove themselves with (none without a secret).
#[derive(Clone, Copy)]
pub struct JoinKey(Option<Mac>);

impl JoinKey {
    fn proof(self, token: u64, index: usize) -> Option<String> {
        self.0.map(|k| hex(&keyed(&k, "join", &[&token.to_be_bytes(), &(index as u64).to_be_bytes()])))
    }

    /// Whether a stream joining as `index` of `token` with `proof` may: always without a
    /// secret; else only with the right proof.
    pub fn allows(self, token: u64, index: usize, proof: Option<&str>) -> bool {
        match (self.proof(token, index), proof) {
            (None, _) => true,
            (Some(want), Some(got)) => constant_time_eq(want.as_bytes(), got.as_bytes()),
            (Some(_), None) => false,
        }
    }
}

/// Writes one direction's frames, each tagged under its key with its sequence number.
pub struct Sealer {
    key: Option<Mac>,
    seq: u64,
}

impl Sealer {
    fn keyed(key: Mac) -> Self {
        Self { key: Some(key), seq: 0 }
    }

    /// Writes `msg` as the next frame.
    pub fn write(&mut self, w: &mut impl Write, msg: &Message) -> Result<(), KvError> {
        let body = encode(msg)?;
        let tag = self.key.map(|k| tag(&k, self.seq, &body));
        self.seq += 1;
        write_frame(w, &body, tag.as_ref().map(|t| &t[..]))
    }
}

/// Reads one direction's frames, checking each one's tag before its body is decoded.
pub struct Opener {
    key: Option<Mac>,
    seq: u64,
}

impl Opener {
    fn keyed(key: Mac) -> Self {
        Self { key: Some(key), seq: 0 }
    }

    /// Reads the next frame; an error if its tag is not the one its sequence number and body
    /// give (forged, altered, replayed, out of order or dropped before it).
    pub fn read(&mut self, r: &mut impl Read) -> Result<Message, KvError> {
        let body = read_body(r)?;
        if let Some(key) = &self.key {
            let mut got = [0u8; MAC_BYTES];
            r.read_exact(&mut got)?;
            if !constant_time_eq(&got, &tag(key, self.seq, &body)) {
                return Err(KvError::Unauthenticated(format!(
                    "frame {} failed authentication (forged, altered or replayed)",
                    self.seq
                )));
            }
        }
        self.seq += 1;
        decode(&body)
    }
}

fn tag(key: &Mac, seq: u64, body: &[u8]) -> Mac {
    keyed(key, "frame", &[&seq.to_be_bytes(), body])
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_core::TransferId;

    fn secret(s: &str) -> ClusterSecret {
        ClusterSecret::new(s.as_bytes()).unwrap()
    }

    fn transcript<'a>(c: &'a Nonce, a: &'a Nonce) -> Transcript<'a> {
        Transcript { connector_nonce: c, acceptor_nonce: a, connector: ("decode", 1), acceptor: ("prefill", 2) }
    }

    #[test]
    fn proofs_hold_only_for_their_secret_end_and_nonces() {
        let (c, a) = (fresh_nonce().unwrap(), fresh_nonce().unwrap());
        assert_ne!(c, a, "fresh nonces");
        let (s, other) = (secret("a secret of this cluster"), secret("the secret of another one"));
        let t = transcript(&c, &a);
        let p = t.proof(&s, End::Connector);
        assert!(t.check(&s, End::Connector, &p));
        assert!(!t.check(&other, End::Connector, &p), "another secret");
        assert!(!t.check(&s, End::Acceptor, &p), "the acceptor's proof is not the connector's");
        let a2 = fresh_nonce().unwrap();
        assert!(!transcript(&c, &a2).check(&s, End::Connector, &p), "a replay under a fresh nonce");
        let renamed = Transcript { connector: ("intruder", 1), ..transcript(&c, &a) };
        assert!(!renamed.check(&s, End::Connector, &p), "bound to the engines' names");
        assert_eq!(parse_nonce(&hex(&c)).unwrap(), c);
        assert!(parse_nonce("abc").is_err() && parse_nonce(&"zz".repeat(32)).is_err());
    }

    #[test]
    fn sealed_frames_open_in_order_and_nothing_else_does() {
        let (c, a) = (fresh_nonce().unwrap(), fresh_nonce().unwrap());
        let s = secret("a secret of this cluster");
        let t = transcript(&c, &a);
        let (mut connector, mut acceptor) = (t.session(&s, End::Connector), t.session(&s, End::Acceptor));
        let msg = |n: u32| Message::Heartbeat { transfer_ids: vec![TransferId(format!("t{n}"))] };
        let mut wire = Vec::new();
        for n in 0..3 {
            connector.sealer.write(&mut wire, &msg(n)).unwrap();
        }
        let mut r = &wire[..];
        for n in 0..3 {
            assert_eq!(acceptor.opener.read(&mut r).unwrap(), msg(n));
        }
        // A frame written with the acceptor's own key (a reflection) does not open as the
        // connector's.
        let mut reflected = Vec::new();
        t.session(&s, End::Acceptor).sealer.write(&mut reflected, &msg(0)).unwrap();
        assert!(matches!(
            t.session(&s, End::Acceptor).opener.read(&mut &reflected[..]),
            Err(KvError::Unauthenticated(_))
        ));
        // Replayed: frame 0 again where frame 3 is due.
        let mut first = Vec::new();
        t.session(&s, End::Connector).sealer.write(&mut first, &msg(0)).unwrap();
        assert!(matches!(acceptor.opener.read(&mut &first[..]), Err(KvError::Unauthenticated(_))));
        // Altered: one body byte changed.
        let mut fresh = t.session(&s, End::Acceptor);
        let mut altered = wire.clone();
        altered[10] ^= 1;
        assert!(fresh.opener.read(&mut &altered[..]).is_err());
        // Untagged (a stranger without the secret).
        let mut plain = Vec::new();
        Session::plain().sealer.write(&mut plain, &msg(0)).unwrap();
        assert!(t.session(&s, End::Acceptor).opener.read(&mut &plain[..]).is_err());
        // Join proofs: only the connection's key, token and index.
        let key = acceptor.join_key();
        let proof = connector.join_proof(7, 1);
        assert!(key.allows(7, 1, proof.as_deref()));
        assert!(!key.allows(7, 2, proof.as_deref()) && !key.allows(8, 1, proof.as_deref()) && !key.allows(7, 1, None));
        assert!(Session::plain().join_key().allows(7, 1, None));
    }
}
