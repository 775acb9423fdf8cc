//! The side channel's sockets: where an engine listens and what it tells peers to reach,
//! bounded connects, and the handshake that pairs two engines and names the transport their
//! KV takes. Every socket operation is bounded by [`Timeouts`].
//!
//! What the channel carries after the handshake is [`crate::wire`]'s; which transport is picked
//! is `transport::pick`'s (the acceptor's `pick` closure here).
//!
//! With a cluster secret the handshake is a mutual challenge-response ([`crate::seal`]): each
//! side proves it holds the secret over both sides' fresh nonces and names before the other
//! acts on anything it says, and the connection's later frames are authenticated.
//!
//! Layer: under `transport`. Owns nothing past a call; calls `wire`, `seal`, `agent_info` and
//! `error`.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpStream, ToSocketAddrs, UdpSocket};
use std::time::Duration;

use tandem_core::{hex, ClusterSecret};

use crate::agent_info::{AgentInfo, Incompatible};
use crate::error::KvError;
use crate::seal::{fresh_nonce, parse_nonce, End, JoinKey, Nonce, Session, Transcript};
use crate::wire::{read_message, write_message, Message, PROTOCOL_VERSION};

/// Timeouts for the side channel. Every socket operation is bounded by one of these.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    /// Establishing a TCP connection.
    pub connect: Duration,
    /// Any single read or write (a stalled peer fails the operation after this long).
    pub io: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self { connect: Duration::from_secs(5), io: Duration::from_secs(30) }
    }
}

/// `host:port`, with an IPv6 host in brackets.
pub fn host_port(host: &str, port: u16) -> String {
    match host.parse::<IpAddr>() {
        Ok(IpAddr::V6(ip)) => format!("[{ip}]:{port}"),
        _ => format!("{host}:{port}"),
    }
}

/// The host peers are told to reach a side channel bound to `bind_host` at: `bind_host` itself,
/// unless that is an unspecified address (`0.0.0.0`, `::`: every interface), which no peer can
/// connect to; then this host's address on its default route (a UDP socket routed towards a
/// documentation address, nothing sent), or an error saying to name one.
pub fn advertised_host(bind_host: &str) -> Result<String, String> {
    let probe: SocketAddr = match bind_host.trim_matches(['[', ']']).parse::<IpAddr>() {
        Ok(IpAddr::V4(ip)) if ip.is_unspecified() => "192.0.2.1:9".parse().expect("an IPv4 socket address"),
        Ok(IpAddr::V6(ip)) if ip.is_unspecified() => "[2001:db8::1]:9".parse().expect("an IPv6 socket address"),
        _ => return Ok(bind_host.to_string()),
    };
    routed_address(probe)
        .map(|ip| ip.to_string())
        .map_err(|why| format!("{bind_host} listens on every address, but peers need one to connect to, and {why}"))
}

/// This host's address on the route towards `probe` (not loopback, not unspecified).
fn routed_address(probe: SocketAddr) -> Result<IpAddr, String> {
    let any: SocketAddr = if probe.is_ipv4() { ([0, 0, 0, 0], 0).into() } else { (Ipv6Addr::UNSPECIFIED, 0).into() };
    let socket = UdpSocket::bind(any).map_err(|e| format!("no UDP socket could be opened to find it ({e})"))?;
    socket.connect(probe).map_err(|e| format!("this host has no route to pick it from ({e})"))?;
    let ip = socket.local_addr().map_err(|e| format!("its routed address is unknown ({e})"))?.ip();
    if ip.is_loopback() || ip.is_unspecified() {
        return Err(format!("the only route found leaves from {ip}"));
    }
    Ok(ip)
}

/// Opens a connection to `addr` with bounded connect, read and write times.
pub fn connect(addr: &str, t: Timeouts) -> Result<TcpStream, KvError> {
    let mut last = None;
    let addrs =
        addr.to_socket_addrs().map_err(|e| KvError::Unreachable { addr: addr.to_string(), reason: e.to_string() })?;
    for a in addrs {
        match TcpStream::connect_timeout(&a, t.connect) {
            Ok(s) => {
                configure(&s, t)?;
                return Ok(s);
            }
            Err(e) => last = Some(e.to_string()),
        }
    }
    Err(KvError::Unreachable { addr: addr.to_string(), reason: last.unwrap_or_else(|| "no address".into()) })
}

/// Applies the bounded timeouts and disables Nagle (control frames are small and latency
/// matters).
pub fn configure(s: &TcpStream, t: Timeouts) -> Result<(), KvError> {
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(t.io))?;
    s.set_write_timeout(Some(t.io))?;
    Ok(())
}

/// Connecting side: the handshake (`Hello`, the acceptor's `Challenge` checked, our
/// `Handshake`), the peer's info and the transport it picked once it accepts, and the
/// connection's frame keys. With a `secret` the acceptor must prove it holds the same one
/// before we say anything about this engine; without one, an acceptor that wants a proof is
/// refused here, saying so.
pub fn handshake<S: Read + Write>(
    stream: &mut S,
    ours: &AgentInfo,
    secret: Option<&ClusterSecret>,
) -> Result<(AgentInfo, Picked, Session), KvError> {
    let nonce = fresh_nonce()?;
    let (engine_id, epoch) = (ours.engine_id.clone(), ours.epoch);
    write_message(stream, &Message::Hello { version: PROTOCOL_VERSION, nonce: hex(&nonce), engine_id, epoch })?;
    let (their_nonce, their_id, their_epoch, proof) = match read_message(stream)? {
        Message::Challenge { nonce, engine_id, epoch, proof } => (parse_nonce(&nonce)?, engine_id, epoch, proof),
        Message::HandshakeRefused { reason } => return Err(KvError::Refused(reason)),
        other => return Err(KvError::Protocol(format!("expected a challenge, got {other:?}"))),
    };
    let transcript = Transcript {
        connector_nonce: &nonce,
        acceptor_nonce: &their_nonce,
        connector: (&ours.engine_id.0, ours.epoch.0),
        acceptor: (&their_id.0, their_epoch.0),
    };
    let (proof, mut session) = match (secret, proof) {
        (Some(secret), Some(proof)) if transcript.check(secret, End::Acceptor, &proof) => {
            (Some(transcript.proof(secret, End::Connector)), transcript.session(secret, End::Connector))
        }
        (Some(_), Some(_)) => {
            return Err(KvError::Unauthenticated(format!(
                "`{}` could not prove it holds this cluster's secret (another --cluster-secret-file?)",
                their_id
            )))
        }
        (Some(_), None) => {
            return Err(KvError::Unauthenticated(format!(
                "`{their_id}` has no cluster secret, and this engine takes peers only with one (--cluster-secret-file)"
            )))
        }
        (None, Some(_)) => {
            return Err(KvError::Unauthenticated(format!(
            "`{their_id}` takes peers only with the cluster secret, and this engine has none (--cluster-secret-file)"
        )))
        }
        (None, None) => (None, Session::plain()),
    };
    write_message(stream, &Message::Handshake { version: PROTOCOL_VERSION, info: ours.clone(), proof })?;
    match session.opener.read(stream)? {
        Message::HandshakeOk { info, transport, note, join_token } => {
            if (&info.engine_id, info.epoch) != (&their_id, their_epoch) {
                return Err(KvError::Protocol(format!(
                    "the peer challenged as `{their_id}` but says it is `{}`",
                    info.engine_id
                )));
            }
            ours.check_pairing(&info)?;
            Ok((info, Picked { transport, note, join_token }, session))
        }
        Message::HandshakeRefused { reason } => Err(KvError::Refused(reason)),
        other => Err(KvError::Protocol(format!("expected a handshake reply, got {other:?}"))),
    }
}

/// The transport an accepting side picked for a connection, and why not a faster one both
/// ends offer, if it did not pick that.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Picked {
    /// `tcp`, `local` or `cuda-ipc`.
    pub transport: String,
    /// Why not faster.
    pub note: Option<String>,
    /// Over tcp with several streams: what the connecting side's further streams name when
    /// they join ([`Message::JoinStream`]).
    pub join_token: Option<u64>,
}

impl Picked {
    /// Plain tcp, nothing else considered.
    pub fn tcp() -> Self {
        Self::named("tcp", None)
    }

    /// The transport `name`, and why not a faster one.
    pub fn named(name: &str, note: Option<String>) -> Self {
        Self { transport: name.into(), note, join_token: None }
    }
}

/// What a new connection to the side channel says first.
#[derive(Debug)]
pub enum Hello {
    /// A peer opening a connection.
    Open(Opening),
    /// A further stream of an open connection ([`Message::JoinStream`]).
    Join {
        /// The connection's join token.
        token: u64,
        /// Which stream, from 1.
        index: usize,
        /// Its proof, with a cluster secret.
        proof: Option<String>,
    },
}

/// A peer's `Hello`: its version, nonce and name.
#[derive(Debug)]
pub struct Opening {
    version: u32,
    nonce: Nonce,
    engine_id: tandem_core::EngineId,
    epoch: tandem_core::Epoch,
}

/// Accepting side: the first frame of a new connection. A peer of an older protocol that opens
/// with its `Handshake` is told which version this engine speaks.
pub fn read_hello<S: Read + Write>(stream: &mut S) -> Result<Hello, KvError> {
    match read_message(stream)? {
        Message::Hello { version, nonce, engine_id, epoch } => {
            let opening = Opening { version, nonce: parse_nonce(&nonce)?, engine_id, epoch };
            Ok(Hello::Open(opening))
        }
        Message::JoinStream { token, index, proof } => Ok(Hello::Join { token, index, proof }),
        Message::Handshake { version, .. } => {
            let e = KvError::Incompatible(Incompatible::Version { local: PROTOCOL_VERSION, remote: version });
            let _ = write_message(stream, &Message::HandshakeRefused { reason: e.to_string() });
            Err(e)
        }
        other => Err(KvError::Protocol(format!("expected a handshake, got {other:?}"))),
    }
}

/// Accepting side: [`read_hello`] and [`answer_handshake`] for a connection that must open.
pub fn accept_handshake<S: Read + Write>(
    stream: &mut S,
    ours: &AgentInfo,
    secret: Option<&ClusterSecret>,
    pick: impl FnOnce(&AgentInfo, JoinKey) -> Result<Picked, String>,
) -> Result<(AgentInfo, Picked, Session), KvError> {
    match read_hello(stream)? {
        Hello::Open(opening) => answer_handshake(stream, opening, ours, secret, pick),
        Hello::Join { .. } => Err(KvError::Protocol("expected a handshake, got a stream joining".into())),
    }
}

/// Accepting side, once the peer's `Hello` is read: our `Challenge` (with our proof, with a
/// secret), the peer's `Handshake` (its proof checked before its info is looked at), the
/// version and pairing checks, `pick` for the connection's transport (given the key its
/// further streams prove themselves with; an error refuses the peer, saying why), and the
/// answer; the peer's info, the pick and the connection's keys.
pub fn answer_handshake<S: Read + Write>(
    stream: &mut S,
    hello: Opening,
    ours: &AgentInfo,
    secret: Option<&ClusterSecret>,
    pick: impl FnOnce(&AgentInfo, JoinKey) -> Result<Picked, String>,
) -> Result<(AgentInfo, Picked, Session), KvError> {
    let refuse = |stream: &mut S, e: KvError| {
        let _ = write_message(stream, &Message::HandshakeRefused { reason: refusal(&e) });
        Err(e)
    };
    if hello.version != PROTOCOL_VERSION {
        let e = KvError::Incompatible(Incompatible::Version { local: PROTOCOL_VERSION, remote: hello.version });
        return refuse(stream, e);
    }
    let nonce = fresh_nonce()?;
    let transcript = Transcript {
        connector_nonce: &hello.nonce,
        acceptor_nonce: &nonce,
        connector: (&hello.engine_id.0, hello.epoch.0),
        acceptor: (&ours.engine_id.0, ours.epoch.0),
    };
    let challenge = Message::Challenge {
        nonce: hex(&nonce),
        engine_id: ours.engine_id.clone(),
        epoch: ours.epoch,
        proof: secret.map(|s| transcript.proof(s, End::Acceptor)),
    };
    write_message(stream, &challenge)?;
    let answer = read_message(stream).map_err(|e| match secret {
        // A peer asked to prove the secret that hangs up or goes quiet instead did not.
        Some(_) => {
            KvError::Unauthenticated(format!("`{}` left without proving the cluster secret ({e})", hello.engine_id))
        }
        None => e,
    })?;
    let (version, info, proof) = match answer {
        Message::Handshake { version, info, proof } => (version, info, proof),
        other => return Err(KvError::Protocol(format!("expected a handshake, got {other:?}"))),
    };
    let mut session = match (secret, proof.as_deref()) {
        (Some(secret), Some(proof)) if transcript.check(secret, End::Connector, proof) => {
            transcript.session(secret, End::Acceptor)
        }
        (Some(_), _) => {
            let why =
                format!("`{}` could not prove it holds this cluster's secret (--cluster-secret-file)", hello.engine_id);
            return refuse(stream, KvError::Unauthenticated(why));
        }
        (None, Some(_)) => {
            let why = format!("`{}` proves a cluster secret, and this engine has none", hello.engine_id);
            return refuse(stream, KvError::Unauthenticated(why));
        }
        (None, None) => Session::plain(),
    };
    let verdict = if (&info.engine_id, info.epoch) != (&hello.engine_id, hello.epoch) {
        let why = format!("the peer said hello as `{}` but says it is `{}`", hello.engine_id, info.engine_id);
        Err(KvError::Protocol(why))
    } else if version != PROTOCOL_VERSION {
        Err(KvError::Incompatible(Incompatible::Version { local: PROTOCOL_VERSION, remote: version }))
    } else {
        let join_key = session.join_key();
        ours.check_pairing(&info)
            .map_err(KvError::Incompatible)
            .and_then(|()| pick(&info, join_key).map_err(KvError::Refused))
    };
    match verdict {
        Ok(picked) => {
            let reply = Message::HandshakeOk {
                info: ours.clone(),
                transport: picked.transport.clone(),
                note: picked.note.clone(),
                join_token: picked.join_token,
            };
            session.sealer.write(stream, &reply)?;
            Ok((info, picked, session))
        }
        Err(e) => {
            // Past the proofs: the refusal is sealed like any later frame.
            let _ = session.sealer.write(stream, &Message::HandshakeRefused { reason: refusal(&e) });
            Err(e)
        }
    }
}

/// What a refused peer is told: the peer says "refused the handshake" itself
/// (`KvError::Refused`), so only the why.
fn refusal(e: &KvError) -> String {
    match e {
        KvError::Refused(why) => why.clone(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_named_host_is_advertised_as_given_and_ipv6_gets_brackets() {
        assert_eq!(advertised_host("10.0.0.7").unwrap(), "10.0.0.7");
        assert_eq!(advertised_host("prefill-0.internal").unwrap(), "prefill-0.internal");
        assert_eq!(host_port("::1", 5600), "[::1]:5600");
        assert_eq!(host_port("10.0.0.7", 5600), "10.0.0.7:5600");
        assert_eq!(host_port("prefill-0.internal", 5600), "prefill-0.internal:5600");
    }

    #[test]
    fn an_unspecified_host_is_never_advertised() {
        // Routed towards loopback, the only address found is loopback: refused, saying why.
        let err = routed_address("127.0.0.1:9".parse().unwrap()).unwrap_err();
        assert!(err.contains("127.0.0.1"), "{err}");
        // Whatever this machine's routes, peers are never told 0.0.0.0 or loopback.
        for any in ["0.0.0.0", "::", "[::]"] {
            match advertised_host(any) {
                Ok(host) => {
                    let ip: IpAddr = host.parse().unwrap();
                    assert!(!ip.is_unspecified() && !ip.is_loopback(), "{any}: {ip}");
                }
                Err(e) => assert!(e.contains("listens on every address"), "{any}: {e}"),
            }
        }
    }
}
