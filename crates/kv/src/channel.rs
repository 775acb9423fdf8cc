//! The side channel's sockets: where an engine listens and what it tells peers to reach,
//! bounded connects, and the handshake that pairs two engines and names the transport their
//! KV takes. Every socket operation is bounded by [`Timeouts`].
//!
//! What the channel carries after the handshake is [`crate::wire`]'s; which transport is picked
//! is `transport::pick`'s (the acceptor's `pick` closure here).
//!
//! Layer: under `transport`. Owns nothing past a call; calls `wire`, `agent_info` and `error`.

use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpStream, ToSocketAddrs, UdpSocket};
use std::time::Duration;

use crate::agent_info::AgentInfo;
use crate::error::KvError;
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

/// Connecting side: sends our info, returns the peer's once it accepts.
pub fn handshake(stream: &mut TcpStream, ours: &AgentInfo) -> Result<(AgentInfo, Picked), KvError> {
    write_message(stream, &Message::Handshake { version: PROTOCOL_VERSION, info: ours.clone() })?;
    match read_message(stream)? {
        Message::HandshakeOk { info, transport, note, join_token } => {
            ours.check_pairing(&info)?;
            Ok((info, Picked { transport, note, join_token }))
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
    /// A peer's handshake: its protocol version and metadata.
    Handshake(u32, AgentInfo),
    /// A further stream of an open connection ([`Message::JoinStream`]).
    Join {
        /// The connection's join token.
        token: u64,
        /// Which stream, from 1.
        index: usize,
    },
}

/// Accepting side: the first frame of a new connection.
pub fn read_hello(stream: &mut TcpStream) -> Result<Hello, KvError> {
    match read_message(stream)? {
        Message::Handshake { version, info } => Ok(Hello::Handshake(version, info)),
        Message::JoinStream { token, index } => Ok(Hello::Join { token, index }),
        other => Err(KvError::Protocol(format!("expected a handshake, got {other:?}"))),
    }
}

/// Accepting side: reads the peer's handshake, checks version and compatibility, asks `pick`
/// for the connection's transport (an error refuses the peer, saying why), answers.
pub fn accept_handshake(
    stream: &mut TcpStream,
    ours: &AgentInfo,
    pick: impl FnOnce(&AgentInfo) -> Result<Picked, String>,
) -> Result<(AgentInfo, Picked), KvError> {
    match read_hello(stream)? {
        Hello::Handshake(version, info) => answer_handshake(stream, (version, info), ours, pick),
        Hello::Join { .. } => Err(KvError::Protocol("expected a handshake, got a stream joining".into())),
    }
}

/// Accepting side: [`accept_handshake`] once the peer's handshake (`version`, `info`) has been
/// read.
pub fn answer_handshake(
    stream: &mut TcpStream,
    (version, info): (u32, AgentInfo),
    ours: &AgentInfo,
    pick: impl FnOnce(&AgentInfo) -> Result<Picked, String>,
) -> Result<(AgentInfo, Picked), KvError> {
    let verdict = if version != PROTOCOL_VERSION {
        Err(KvError::Incompatible(crate::agent_info::Incompatible::Version {
            local: PROTOCOL_VERSION,
            remote: version,
        }))
    } else {
        ours.check_pairing(&info).map_err(KvError::Incompatible).and_then(|()| pick(&info).map_err(KvError::Refused))
    };
    match verdict {
        Ok(picked) => {
            let reply = Message::HandshakeOk {
                info: ours.clone(),
                transport: picked.transport.clone(),
                note: picked.note.clone(),
                join_token: picked.join_token,
            };
            write_message(stream, &reply)?;
            Ok((info, picked))
        }
        Err(e) => {
            // The peer says "refused the handshake" itself (`KvError::Refused`): only the why.
            let reason = match &e {
                KvError::Refused(why) => why.clone(),
                other => other.to_string(),
            };
            let _ = write_message(stream, &Message::HandshakeRefused { reason });
            Err(e)
        }
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
