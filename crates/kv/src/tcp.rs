//! The TCP data path: connect with bounded waits, handshake, and move KV block bytes straight
//! between a socket and the KV memory.
//!
//! Sending reads the sender's blocks piece by piece ([`pieces`]: the contiguous runs, cut to
//! at most [`PIECE_BYTES`]) and writes them to the socket with no staging copy. Receiving
//! reads straight into the destination blocks when both sides use the same block size, and
//! through one staging buffer plus [`scatter_tokens`] when they differ. Around each piece a GPU
//! engine's memory copies between its device cache and host copy ([`send_staged`],
//! [`recv_staged`]), so those copies overlap the socket.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpStream, ToSocketAddrs, UdpSocket};
use std::time::Duration;

use tandem_compute::KvRegion;

use crate::agent_info::AgentInfo;
use crate::blocks::{coalesce, scatter_tokens, wire_bytes, BlockRun};
use crate::wire::{read_message, write_message, Message, PROTOCOL_VERSION};
use crate::KvError;

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
        Message::HandshakeOk { info, transport, note } => {
            ours.check_pairing(&info)?;
            Ok((info, Picked { transport, note }))
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
}

impl Picked {
    /// Plain tcp, nothing else considered.
    pub fn tcp() -> Self {
        Self { transport: "tcp".into(), note: None }
    }
}

/// Accepting side: reads the peer's handshake, checks version and compatibility, asks `pick`
/// for the connection's transport (an error refuses the peer, saying why), answers.
pub fn accept_handshake(
    stream: &mut TcpStream,
    ours: &AgentInfo,
    pick: impl FnOnce(&AgentInfo) -> Result<Picked, String>,
) -> Result<(AgentInfo, Picked), KvError> {
    let (version, info) = match read_message(stream)? {
        Message::Handshake { version, info } => (version, info),
        other => return Err(KvError::Protocol(format!("expected a handshake, got {other:?}"))),
    };
    let verdict = if version != PROTOCOL_VERSION {
        Err(KvError::Incompatible(crate::Incompatible::Version { local: PROTOCOL_VERSION, remote: version }))
    } else {
        ours.check_pairing(&info).map_err(KvError::Incompatible).and_then(|()| pick(&info).map_err(KvError::Refused))
    };
    match verdict {
        Ok(picked) => {
            let reply = Message::HandshakeOk {
                info: ours.clone(),
                transport: picked.transport.clone(),
                note: picked.note.clone(),
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

/// Bytes of the checksum that follows a bulk send's data when it is checksummed.
pub const CHECKSUM_BYTES: u64 = 4;

/// Bytes of KV a bulk transfer moves per piece at most. A GPU engine copies one piece
/// between its device cache and its host copy while the piece before it is on the socket, so
/// the copy hides behind the network but for one piece's worth.
pub const PIECE_BYTES: usize = 8 << 20;

/// The blocks `blocks` as a bulk transfer moves them: their contiguous runs, in order, each cut
/// into pieces of at most [`PIECE_BYTES`] (at least one block).
pub fn pieces(blocks: &[u32], block_bytes: usize) -> Vec<BlockRun> {
    let most = (PIECE_BYTES / block_bytes.max(1)).max(1) as u32;
    let mut out = Vec::new();
    for run in coalesce(blocks) {
        let mut start = run.start;
        let end = run.start + run.len;
        while start < end {
            let len = most.min(end - start);
            out.push(BlockRun { start, len });
            start += len;
        }
    }
    out
}

/// Writes the raw bytes of the blocks holding tokens `0..num_tokens` (whole blocks, in token
/// order) to `w`, then, with `checksum`, the CRC-32 of those bytes (little-endian,
/// [`CHECKSUM_BYTES`]). Returns the data bytes written ([`wire_bytes`]).
///
/// # Safety
/// No other thread may write `blocks` while this runs (the caller holds them for the transfer).
pub unsafe fn send_blocks(
    w: &mut impl Write,
    region: &KvRegion,
    blocks: &[u32],
    num_tokens: usize,
    checksum: bool,
) -> Result<u64, KvError> {
    let pieces = send_pieces(region, blocks, num_tokens)?;
    // Safety: passed on from the caller.
    unsafe { send_staged(w, region, &pieces, num_tokens, checksum, &mut |_| Ok(())) }
}

/// The pieces [`send_staged`] sends for tokens `0..num_tokens` of `blocks`, or why they cannot
/// be sent.
pub fn send_pieces(region: &KvRegion, blocks: &[u32], num_tokens: usize) -> Result<Vec<BlockRun>, KvError> {
    let needed = region.layout().blocks_for(num_tokens);
    if blocks.len() < needed {
        return Err(KvError::Protocol(format!("{num_tokens} tokens need {needed} blocks, {} given", blocks.len())));
    }
    Ok(pieces(&blocks[..needed], region.block_bytes()))
}

/// [`send_blocks`] of `pieces` (from [`send_pieces`]), calling `ready(i)` before piece `i`'s
/// bytes are read from `region`: a GPU engine waits there for that piece's copy from its device
/// cache, queued ahead.
///
/// # Safety
/// As [`send_blocks`], for the pieces' blocks.
pub unsafe fn send_staged(
    w: &mut impl Write,
    region: &KvRegion,
    pieces: &[BlockRun],
    num_tokens: usize,
    checksum: bool,
    ready: &mut dyn FnMut(usize) -> Result<(), KvError>,
) -> Result<u64, KvError> {
    let mut crc = crc32fast::Hasher::new();
    for (i, piece) in pieces.iter().enumerate() {
        ready(i)?;
        // Safety: caller holds these blocks; nobody writes them meanwhile.
        let data = unsafe { region.bytes(piece.start as usize, piece.len as usize) };
        w.write_all(data)?;
        if checksum {
            crc.update(data);
        }
    }
    if checksum {
        w.write_all(&crc.finalize().to_le_bytes())?;
    }
    Ok(wire_bytes(region.layout(), region.dtype(), num_tokens))
}

/// Reads `bytes` raw bytes (the sender's layout, `src_block_size` tokens per block, tokens
/// `0..num_tokens`) from `r` into the destination blocks; with `checksum`, then the sender's
/// CRC-32 of them, which must match the bytes as they landed ([`KvError::Corrupt`] if not:
/// the stream is still in step, but the blocks hold bad KV).
///
/// # Safety
/// The caller must own `dst_blocks` exclusively while this runs.
pub unsafe fn recv_blocks(
    r: &mut impl Read,
    bytes: u64,
    src_block_size: usize,
    region: &KvRegion,
    dst_blocks: &[u32],
    num_tokens: usize,
    checksum: bool,
) -> Result<(), KvError> {
    let into = Destination { region, blocks: dst_blocks, num_tokens };
    // Safety: passed on from the caller.
    unsafe { recv_staged(r, bytes, src_block_size, into, checksum, &mut |_| Ok(())) }
}

/// Where a bulk receive lands: tokens `0..num_tokens` in `blocks` of `region`.
#[derive(Clone, Copy)]
pub struct Destination<'a> {
    /// The receiver's KV memory.
    pub region: &'a KvRegion,
    /// The destination blocks, in token order.
    pub blocks: &'a [u32],
    /// Tokens that land.
    pub num_tokens: usize,
}

/// [`recv_blocks`], calling `landed(run)` as each piece of the destination blocks has its
/// bytes (before the checksum is checked): a GPU engine queues that piece's copy into its
/// device cache there, while the next piece is still on the socket.
///
/// # Safety
/// As [`recv_blocks`].
pub unsafe fn recv_staged(
    r: &mut impl Read,
    bytes: u64,
    src_block_size: usize,
    into: Destination<'_>,
    checksum: bool,
    landed: &mut dyn FnMut(BlockRun) -> Result<(), KvError>,
) -> Result<(), KvError> {
    let Destination { region, blocks: dst_blocks, num_tokens } = into;
    let dl = *region.layout();
    if src_block_size == 0 {
        return Err(KvError::Protocol("source block size 0".into()));
    }
    let src_layout = tandem_compute::KvLayout { block_size: src_block_size, ..dl };
    let expected = wire_bytes(&src_layout, region.dtype(), num_tokens);
    if bytes != expected {
        return Err(KvError::Protocol(format!("{bytes} bytes announced for {num_tokens} tokens, expected {expected}")));
    }
    let needed = dl.blocks_for(num_tokens);
    if dst_blocks.len() < needed || dst_blocks.iter().any(|&b| b as usize >= dl.num_blocks) {
        return Err(KvError::Protocol(format!("destination blocks do not cover {num_tokens} tokens")));
    }
    let mut crc = crc32fast::Hasher::new();
    if src_block_size == dl.block_size {
        for piece in pieces(&dst_blocks[..needed], region.block_bytes()) {
            // Safety: the caller owns the destination blocks exclusively.
            let dst = unsafe { region.bytes_mut(piece.start as usize, piece.len as usize) };
            r.read_exact(dst)?;
            if checksum {
                crc.update(dst);
            }
            landed(piece)?;
        }
    } else {
        let mut staging = vec![0u8; bytes as usize];
        r.read_exact(&mut staging)?;
        if checksum {
            crc.update(&staging);
        }
        // Safety: the caller owns the destination blocks exclusively.
        unsafe { scatter_tokens(&staging, src_block_size, region, dst_blocks, num_tokens) };
        for piece in pieces(&dst_blocks[..needed], region.block_bytes()) {
            landed(piece)?;
        }
    }
    if checksum {
        let mut sent = [0u8; CHECKSUM_BYTES as usize];
        r.read_exact(&mut sent)?;
        let (sent, got) = (u32::from_le_bytes(sent), crc.finalize());
        if sent != got {
            return Err(KvError::Corrupt(format!(
                "KV checksum mismatch: the sender's CRC-32 is {sent:08x}, the {bytes} bytes received give {got:08x}"
            )));
        }
    }
    Ok(())
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
