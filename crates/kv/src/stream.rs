//! A side-channel connection's bytes: plain TCP, or TLS over it (`--tls-cert`, `--tls-key`,
//! `--tls-ca`: both ends present a certificate of the deployment's CA and verify the other's).
//!
//! rustls runs the handshake (TLS 1.3 only: both ends are tandem); then the connection's
//! records go through [`crate::tls_records`], which encrypts and decrypts in place with the
//! session's keys, and a connection's bulk bytes through [`crate::tls_pipes`]' threads, which
//! write and read the socket while the cipher works. The agent reads a connection on one thread and writes it on others, so a
//! TLS stream splits like a `TcpStream` does ([`KvStream::try_clone`]): the two directions
//! have separate state, each shared by the stream's handles behind a lock of its own, so a
//! writer blocked on a full socket never holds up the reader (which is what lets the peer
//! drain it).
//!
//! Layer: beside `channel`; calls `error` and `tls_records` (and `tls_pipes` through it).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rustls::pki_types::ServerName;

use crate::error::KvError;
use crate::tls_records::{RecordReader, RecordWriter};

/// TLS for a side channel: this engine's certificate and key, and the CA its peers' must chain
/// to, as a client and as a server config.
#[derive(Clone)]
pub struct KvTls {
    client: Arc<rustls::ClientConfig>,
    server: Arc<rustls::ServerConfig>,
    /// Whether a connection's bulk bytes go through [`crate::tls_pipes`]' threads: set, or
    /// (None) as [`KvTls::for_streams`] decides.
    pipes: Option<bool>,
}

impl std::fmt::Debug for KvTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KvTls(..)")
    }
}

impl KvTls {
    /// From PEM: this engine's certificate chain, its private key, and the CA certificates a
    /// peer's must chain to. An error says which part is wrong.
    pub fn from_pem(cert_chain: &[u8], key: &[u8], ca: &[u8]) -> Result<Self, String> {
        let tandem_tls::Identity { certs, key } = tandem_tls::Identity::from_pem(cert_chain, key)?;
        let roots = tandem_tls::roots_from_pem(ca)?;
        // TLS 1.3's suites only, AES-128-GCM first (the fastest here with AES-NI; all three
        // are sound): the record layer after the handshake runs exactly these.
        let mut provider = (*tandem_tls::provider()).clone();
        provider.cipher_suites = [
            rustls::CipherSuite::TLS13_AES_128_GCM_SHA256,
            rustls::CipherSuite::TLS13_AES_256_GCM_SHA384,
            rustls::CipherSuite::TLS13_CHACHA20_POLY1305_SHA256,
        ]
        .iter()
        .filter_map(|want| provider.cipher_suites.iter().find(|s| s.suite() == *want).copied())
        .collect();
        let provider = Arc::new(provider);
        let tls13: &[&rustls::SupportedProtocolVersion] = &[&rustls::version::TLS13];
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
            .build()
            .map_err(|e| format!("the CA: {e}"))?;
        let mut server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(tls13)
            .map_err(|e| e.to_string())?
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs.clone(), key.clone_key())
            .map_err(|e| format!("the certificate and key: {e}"))?;
        // The handshake's last record is the client's Finished: no session tickets after it,
        // so that nothing but the record layer's own records follows.
        server.send_tls13_tickets = 0;
        server.enable_secret_extraction = true;
        let mut client = rustls::ClientConfig::builder_with_provider(provider)
            .with_protocol_versions(tls13)
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots)
            .with_client_auth_cert(certs, key)
            .map_err(|e| format!("the certificate and key: {e}"))?;
        client.enable_secret_extraction = true;
        Ok(Self { client: Arc::new(client), server: Arc::new(server), pipes: None })
    }

    /// Whether a connection's bulk bytes are written and read by threads of its own while the
    /// cipher works ([`crate::tls_pipes`]), whatever [`KvTls::for_streams`] would pick.
    pub fn with_pipes(mut self, on: bool) -> Self {
        self.pipes = Some(on);
        self
    }

    /// The pipes' default for connections of `streams` streams to a peer, unless
    /// [`KvTls::with_pipes`] set them: on where the machine has 8 cores or more and 4 for each
    /// stream (a piped stream keeps two threads busy on each side). Measured on a 16-core
    /// machine, 256 MiB over loopback: one stream 119% of raw TCP with pipes against 87%
    /// without; eight streams 70% with against 95% without (the threads took turns). On 2
    /// cores they only take turns (1.13-1.30 against 1.29-1.37 GB/s serially, one stream).
    pub fn for_streams(mut self, streams: usize) -> Self {
        self.pipes = Some(self.pipes.unwrap_or_else(|| pipes_pay_for(streams)));
        self
    }

    fn pipes(&self) -> bool {
        self.pipes.unwrap_or_else(|| pipes_pay_for(1))
    }
}

/// Whether this machine has the cores for [`KvTls::with_pipes`] on `streams` streams.
fn pipes_pay_for(streams: usize) -> bool {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    cores >= 8 && cores >= 4 * streams.max(1)
}

/// One connection's bytes, either way.
pub enum KvStream {
    /// No TLS.
    Plain(TcpStream),
    /// TLS over the socket; each direction's record state shared with the stream's clones.
    Tls {
        /// This handle's clone of the socket.
        sock: TcpStream,
        /// What handles read: shared, so that a reading handle dropped with records left over
        /// (a striped receive's clone) loses none of the stream.
        rx: Arc<Mutex<RecordReader>>,
        /// What handles write, in the order their records must go.
        tx: Arc<Mutex<RecordWriter>>,
        /// Bulk bytes go through threads of the connection's own ([`KvTls::with_pipes`]).
        pipes: bool,
    },
}

impl KvStream {
    /// The connecting side of `sock` to `host` (whose certificate must name it), TLS when
    /// `tls` is given: the TLS handshake, bounded by the socket's timeouts.
    pub fn connect(sock: TcpStream, tls: Option<&KvTls>, host: &str) -> Result<Self, KvError> {
        let Some(tls) = tls else { return Ok(KvStream::Plain(sock)) };
        let name = ServerName::try_from(host.trim_matches(['[', ']']).to_string())
            .map_err(|e| KvError::Unsupported(format!("`{host}` is no name a certificate can carry: {e}")))?;
        let conn = rustls::ClientConnection::new(tls.client.clone(), name).map_err(tls_error)?;
        Self::handshake(sock, conn.into(), tls.pipes())
    }

    /// The accepting side of `sock`, TLS when `tls` is given.
    pub fn accept(sock: TcpStream, tls: Option<&KvTls>) -> Result<Self, KvError> {
        let Some(tls) = tls else { return Ok(KvStream::Plain(sock)) };
        let conn = rustls::ServerConnection::new(tls.server.clone()).map_err(tls_error)?;
        Self::handshake(sock, conn.into(), tls.pipes())
    }

    /// Runs the handshake one record at a time, so that nothing past its last record is taken
    /// from the socket (what follows belongs to the record layer), then takes the session's
    /// keys from rustls.
    fn handshake(mut sock: TcpStream, mut conn: rustls::Connection, pipes: bool) -> Result<Self, KvError> {
        let refused = |e: &dyn std::fmt::Display| KvError::Unauthenticated(format!("TLS handshake: {e}"));
        let mut record = Vec::new();
        loop {
            while conn.wants_write() {
                conn.write_tls(&mut sock)?;
            }
            if !conn.is_handshaking() {
                break;
            }
            read_record(&mut sock, &mut record)?;
            let mut rest = &record[..];
            while !rest.is_empty() {
                conn.read_tls(&mut rest)?;
            }
            if let Err(e) = conn.process_new_packets() {
                // The alert that says why, for the peer's log.
                let _ = conn.write_tls(&mut sock);
                return Err(refused(&e));
            }
        }
        let secrets = conn.dangerous_extract_secrets().map_err(|e| refused(&e))?;
        let (rx_seq, rx_secrets) = secrets.rx;
        let (tx_seq, tx_secrets) = secrets.tx;
        let rx = RecordReader::new(rx_seq, rx_secrets).map_err(|e| refused(&e))?;
        let tx = RecordWriter::new(tx_seq, tx_secrets).map_err(|e| refused(&e))?;
        Ok(KvStream::Tls { sock, rx: Arc::new(Mutex::new(rx)), tx: Arc::new(Mutex::new(tx)), pipes })
    }

    /// Another handle on the same connection (for another thread: one reads, one writes).
    pub fn try_clone(&self) -> std::io::Result<Self> {
        Ok(match self {
            KvStream::Plain(s) => KvStream::Plain(s.try_clone()?),
            KvStream::Tls { sock, rx, tx, pipes } => {
                KvStream::Tls { sock: sock.try_clone()?, rx: rx.clone(), tx: tx.clone(), pipes: *pipes }
            }
        })
    }

    /// The socket underneath.
    pub fn socket(&self) -> &TcpStream {
        match self {
            KvStream::Plain(s) | KvStream::Tls { sock: s, .. } => s,
        }
    }

    /// Bounds each read.
    pub fn set_read_timeout(&self, t: Option<Duration>) -> std::io::Result<()> {
        self.socket().set_read_timeout(t)
    }

    /// Whether the connection's writes and reads go through [`crate::tls_pipes`]' threads.
    #[cfg(test)]
    fn pipelined(&self) -> (bool, bool) {
        match self {
            KvStream::Plain(_) => (false, false),
            KvStream::Tls { rx, tx, .. } => (lock(tx).pipelined(), lock(rx).pipelined()),
        }
    }

    /// Ends the connection both ways, for every handle on it (a read or write in progress on
    /// another fails at once).
    pub fn shutdown(&self) {
        let _ = self.socket().shutdown(Shutdown::Both);
    }
}

fn tls_error(e: rustls::Error) -> KvError {
    KvError::Unsupported(format!("TLS: {e}"))
}

/// One TLS record of the handshake from `sock` into `record`: its header, then as many bytes as
/// the header says.
fn read_record(sock: &mut TcpStream, record: &mut Vec<u8>) -> Result<(), KvError> {
    record.resize(5, 0);
    sock.read_exact(record)?;
    let len = u16::from_be_bytes([record[3], record[4]]) as usize;
    if len > (1 << 14) + 256 {
        return Err(KvError::Unauthenticated(format!("TLS handshake: a record of {len} bytes (not TLS)")));
    }
    record.resize(5 + len, 0);
    sock.read_exact(&mut record[5..])?;
    Ok(())
}

fn lock<T>(state: &Mutex<T>) -> MutexGuard<'_, T> {
    state.lock().unwrap_or_else(|p| p.into_inner())
}

impl Read for KvStream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            KvStream::Plain(s) => s.read(buf),
            KvStream::Tls { sock, rx, pipes, .. } => lock(rx).read(&mut &*sock, pipes.then_some(&*sock), buf),
        }
    }
}

impl Write for KvStream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            KvStream::Plain(s) => s.write(buf),
            KvStream::Tls { sock, tx, pipes, .. } => {
                let mut records = lock(tx);
                if *pipes && records.wants_pipe(buf.len()) {
                    records.pipe_to(sock);
                }
                records.write(sock, buf)
            }
        }
    }

    /// Returns once every byte written is on the socket (a TLS stream's pipe may hold some).
    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            KvStream::Plain(s) => s.flush(),
            KvStream::Tls { tx, .. } => lock(tx).flush(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    fn tls() -> KvTls {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = ca_params.self_signed(&ca_key).unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).unwrap();
        let cert = params.signed_by(&key, &ca, &ca_key).unwrap();
        KvTls::from_pem(cert.pem().as_bytes(), key.serialize_pem().as_bytes(), ca.pem().as_bytes())
            .unwrap()
            .with_pipes(true)
    }

    #[test]
    fn pipes_by_default_only_with_four_cores_a_stream_and_as_set_otherwise() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let auto = tls();
        let auto = KvTls { pipes: None, ..auto };
        // As many streams as cores: never 4 cores for each.
        assert!(!auto.clone().for_streams(cores).pipes());
        assert_eq!(auto.clone().for_streams(1).pipes(), cores >= 8);
        assert_eq!(auto.pipes(), cores >= 8, "unresolved: as for one stream");
        // Set, whatever the streams.
        assert!(tls().with_pipes(true).for_streams(cores).pipes());
        assert!(!tls().with_pipes(false).for_streams(1).pipes());
    }

    /// Two ends of one TLS connection over loopback: the connecting one, the accepting one.
    fn tls_pair() -> (KvStream, KvStream) {
        tls_pair_with(true)
    }

    /// As [`tls_pair`], the connection's bulk bytes through pipes or not.
    fn tls_pair_with(pipes: bool) -> (KvStream, KvStream) {
        let tls = tls().with_pipes(pipes);
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server_tls = tls.clone();
        let server = std::thread::spawn(move || {
            let (sock, _) = listener.accept().unwrap();
            KvStream::accept(sock, Some(&server_tls)).unwrap()
        });
        let client = KvStream::connect(TcpStream::connect(addr).unwrap(), Some(&tls), "127.0.0.1").unwrap();
        (client, server.join().unwrap())
    }

    /// Both ends write 8 MiB while their other halves read the peer's 8 MiB: a writer blocked
    /// on a full socket must not keep its reader from draining (which would wedge both).
    #[test]
    fn split_tls_halves_move_bytes_both_ways_at_once_without_wedging() {
        for pipes in [false, true] {
            split_halves_both_ways(pipes);
        }
    }

    fn split_halves_both_ways(pipes: bool) {
        let (client, server) = tls_pair_with(pipes);
        let payload = |seed: u8| (0..8 << 20).map(|i| (i as u8).wrapping_mul(seed)).collect::<Vec<u8>>();
        let start = std::time::Instant::now();
        let ends: Vec<_> = [(client, 3u8, 5u8), (server, 5, 3)]
            .into_iter()
            .map(|(stream, ours, theirs)| {
                let mut reader = stream.try_clone().unwrap();
                let mut writer = stream;
                let (sent, want) = (payload(ours), payload(theirs));
                let w = std::thread::spawn(move || writer.write_all(&sent).unwrap());
                let r = std::thread::spawn(move || {
                    let mut got = vec![0u8; want.len()];
                    reader.read_exact(&mut got).unwrap();
                    assert!(got == want, "the bytes read are the bytes the peer wrote");
                });
                (w, r)
            })
            .collect();
        for (w, r) in ends {
            w.join().unwrap();
            r.join().unwrap();
        }
        assert!(start.elapsed() < Duration::from_secs(20), "{:?}", start.elapsed());
    }

    /// A reading handle dropped after part of what the peer sent (a striped receive's clone)
    /// leaves the rest to the next handle: what one socket read took past its share is kept.
    #[test]
    fn a_reading_handle_dropped_midway_loses_none_of_the_stream() {
        for pipes in [false, true] {
            handles_dropped_midway(pipes);
        }
    }

    fn handles_dropped_midway(pipes: bool) {
        let (mut client, server) = tls_pair_with(pipes);
        server.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let sent: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        client.write_all(&sent).unwrap();
        let mut got = Vec::new();
        // Each share read through a handle of its own, dropped after it.
        for share in [1usize, 70_000, 1 << 20, 3_000_000 - 1 - 70_000 - (1 << 20)] {
            let mut handle = server.try_clone().unwrap();
            let mut part = vec![0u8; share];
            handle.read_exact(&mut part).unwrap();
            got.extend(part);
        }
        assert!(got == sent, "the stream read through several handles is the stream sent");
    }

    /// Small writes (serial) and large ones (through the writer's pipe) in any order arrive in
    /// order, and what the pipe still holds when every handle is dropped goes out before the
    /// connection closes, as a plain socket's close sends what was written before it.
    #[test]
    fn pipelined_writes_keep_their_order_and_are_sent_before_the_close() {
        let (client, server) = tls_pair();
        server.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut sent = Vec::new();
        let mut writer = client.try_clone().unwrap();
        for (i, size) in [10usize, 300_000, 1, 5000, 2 << 20, 17, 70_000].into_iter().enumerate() {
            let part: Vec<u8> = (0..size).map(|j| (j * 13 + i) as u8).collect();
            writer.write_all(&part).unwrap();
            sent.extend(part);
            assert_eq!(writer.pipelined().0, i > 0, "the first large write starts the pipe");
        }
        drop((writer, client));
        let mut reader = server;
        let mut got = vec![0u8; sent.len()];
        reader.read_exact(&mut got).unwrap();
        assert!(got == sent, "the bytes arrive as written");
        let end = reader.read(&mut [0u8; 100_000]);
        assert!(matches!(&end, Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof), "{end:?}");
    }

    /// A read through the reader's pipe waits no longer than the socket's read timeout, and a
    /// timeout is not the stream's end: what comes after it is read whole.
    #[test]
    fn a_pipelined_read_keeps_the_sockets_read_timeout() {
        let (mut client, mut server) = tls_pair();
        server.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
        let first: Vec<u8> = (0..1_000_000u32).map(|i| (i % 249) as u8).collect();
        client.write_all(&first).unwrap();
        let mut got = vec![0u8; first.len()];
        server.read_exact(&mut got).unwrap();
        assert!(got == first);
        assert_eq!(server.pipelined(), (false, true), "a large read starts the reader's pipe, not the writer's");
        let start = std::time::Instant::now();
        let idle = server.read(&mut got);
        assert!(
            matches!(&idle, Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)),
            "{idle:?}"
        );
        assert!(start.elapsed() < Duration::from_secs(3), "{:?}", start.elapsed());
        client.write_all(&first).unwrap();
        server.read_exact(&mut got).unwrap();
        assert!(got == first, "the stream goes on after a timeout");
    }

    /// Dropping every handle of a reading end ends its pipe's thread and closes the socket:
    /// the peer's writes then fail, where a thread left reading would keep them waiting.
    #[test]
    fn dropping_a_pipelined_reader_closes_its_socket() {
        let (mut client, server) = tls_pair();
        client.socket().set_write_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut reader = server.try_clone().unwrap();
        let mut got = vec![0u8; 200_000];
        client.write_all(&vec![7u8; got.len()]).unwrap();
        reader.read_exact(&mut got).unwrap();
        drop((reader, server));
        let start = std::time::Instant::now();
        let chunk = vec![1u8; 1 << 20];
        let failed = loop {
            if let Err(e) = client.write_all(&chunk).and_then(|()| client.flush()) {
                break e;
            }
            assert!(start.elapsed() < Duration::from_secs(10), "writes to a dropped reader kept succeeding");
        };
        assert!(!matches!(failed.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut), "{failed:?}");
    }

    /// After the handshake the records are TLS 1.3's as rustls itself writes and reads them: a
    /// peer that runs rustls all along (here the server) reads what this stream writes, and
    /// this stream reads what it writes back.
    #[test]
    fn records_after_the_handshake_are_what_rustls_reads_and_writes() {
        let tls = tls();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server_config = tls.server.clone();
        let sent: Vec<u8> = (0..200_000u32).map(|i| (i % 253) as u8).collect();
        let expect = sent.clone();
        let server = std::thread::spawn(move || {
            let (sock, _) = listener.accept().unwrap();
            let conn = rustls::ServerConnection::new(server_config).unwrap();
            let mut stream = rustls::StreamOwned::new(conn, sock);
            let mut got = vec![0u8; expect.len()];
            stream.read_exact(&mut got).unwrap();
            assert!(got == expect, "rustls read the bytes the record layer wrote");
            stream.write_all(b"and back").unwrap();
            stream.flush().unwrap();
        });
        let mut client = KvStream::connect(TcpStream::connect(addr).unwrap(), Some(&tls), "127.0.0.1").unwrap();
        client.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        client.write_all(&sent).unwrap();
        let mut back = [0u8; 8];
        client.read_exact(&mut back).unwrap();
        assert_eq!(&back, b"and back");
        server.join().unwrap();
    }

    #[test]
    fn bad_pem_is_refused_naming_the_part() {
        assert!(KvTls::from_pem(b"", b"", b"").unwrap_err().contains("certificate"));
    }
}
