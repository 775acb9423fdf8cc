//! A side-channel connection's bytes: plain TCP, or TLS over it (`--tls-cert`, `--tls-key`,
//! `--tls-ca`: both ends present a certificate of the deployment's CA and verify the other's).
//!
//! The agent reads a connection on one thread and writes it on others, so a TLS stream splits
//! like a `TcpStream` does ([`KvStream::try_clone`]): the halves share the TLS state behind a
//! lock held only to encrypt or decrypt, never across socket I/O, so a writer blocked on a full
//! socket never holds up the reader (which is what lets the peer drain it). Only writers send
//! TLS records; the reader never does.
//!
//! Layer: beside `channel`; calls `error`.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rustls::pki_types::ServerName;

use crate::error::KvError;

/// TLS for a side channel: this engine's certificate and key, and the CA its peers' must chain
/// to, as a client and as a server config.
#[derive(Clone)]
pub struct KvTls {
    client: Arc<rustls::ClientConfig>,
    server: Arc<rustls::ServerConfig>,
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
        let provider = tandem_tls::provider();
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
            .build()
            .map_err(|e| format!("the CA: {e}"))?;
        let server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs.clone(), key.clone_key())
            .map_err(|e| format!("the certificate and key: {e}"))?;
        let client = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots)
            .with_client_auth_cert(certs, key)
            .map_err(|e| format!("the certificate and key: {e}"))?;
        Ok(Self { client: Arc::new(client), server: Arc::new(server) })
    }
}

/// One connection's bytes, either way.
pub enum KvStream {
    /// No TLS.
    Plain(TcpStream),
    /// TLS over the socket, its state shared with the stream's clones.
    Tls {
        /// This handle's clone of the socket.
        sock: TcpStream,
        /// What every handle on the connection shares.
        tls: Arc<Mutex<TlsState>>,
        /// This handle's socket reads land here first (kept, so that no read allocates).
        scratch: Vec<u8>,
        /// Records this handle encrypted, to be written (kept, so that no write allocates).
        records: Vec<u8>,
    },
}

/// A TLS connection's state: rustls', and ciphertext read from the socket that rustls has not
/// taken yet (its plaintext buffer holds 16 KiB). Shared, so that a reading handle dropped
/// with ciphertext left over (a striped receive's clone) loses none of the stream.
pub struct TlsState {
    conn: rustls::Connection,
    unfed: Vec<u8>,
    unfed_at: usize,
}

impl TlsState {
    /// Gives rustls `bytes` as far as its plaintext buffer takes them; how many it took.
    fn feed(&mut self, mut bytes: &[u8]) -> std::io::Result<usize> {
        let total = bytes.len();
        while !bytes.is_empty() {
            // About one record at a time: rustls moves what it holds past the record it
            // decrypted to the front of its buffer, so feeding more costs copies.
            let mut record = &bytes[..bytes.len().min(ONE_RECORD)];
            let before = record.len();
            match self.conn.read_tls(&mut record) {
                Ok(0) => break,
                Ok(_) => bytes = &bytes[before - record.len()..],
                // Its plaintext buffer is full: that is read out first.
                Err(e) if e.kind() == std::io::ErrorKind::Other => break,
                Err(e) => return Err(e),
            }
            self.conn.process_new_packets().map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
        }
        Ok(total - bytes.len())
    }

    /// Feeds what was left over from an earlier read.
    fn feed_left_over(&mut self) -> std::io::Result<()> {
        let unfed = std::mem::take(&mut self.unfed);
        let taken = self.feed(&unfed[self.unfed_at..]);
        self.unfed = unfed;
        self.unfed_at += taken?;
        if self.unfed_at == self.unfed.len() {
            self.unfed.clear();
            self.unfed_at = 0;
        }
        Ok(())
    }
}

/// A TLS record's largest ciphertext (16 KiB of plaintext and its overhead).
const ONE_RECORD: usize = (16 << 10) + 256;

/// Plaintext handed to the TLS state at once by a write. rustls allocates each record it
/// encrypts; kept below glibc's trim threshold (128 KiB) the records' memory is reused from one
/// write to the next, where 1 MiB at once was handed back to the kernel and faulted in again
/// each time (measured: 64 KiB carries 1.2-1.3x the bytes a second of 1 MiB).
const TLS_CHUNK: usize = 64 << 10;

/// Ciphertext read from the socket at once.
const SOCKET_READ: usize = 256 << 10;

impl KvStream {
    /// The connecting side of `sock` to `host` (whose certificate must name it), TLS when
    /// `tls` is given: the TLS handshake, bounded by the socket's timeouts.
    pub fn connect(sock: TcpStream, tls: Option<&KvTls>, host: &str) -> Result<Self, KvError> {
        let Some(tls) = tls else { return Ok(KvStream::Plain(sock)) };
        let name = ServerName::try_from(host.trim_matches(['[', ']']).to_string())
            .map_err(|e| KvError::Unsupported(format!("`{host}` is no name a certificate can carry: {e}")))?;
        let conn = rustls::ClientConnection::new(tls.client.clone(), name).map_err(tls_error)?;
        Self::handshake(sock, conn.into())
    }

    /// The accepting side of `sock`, TLS when `tls` is given.
    pub fn accept(sock: TcpStream, tls: Option<&KvTls>) -> Result<Self, KvError> {
        let Some(tls) = tls else { return Ok(KvStream::Plain(sock)) };
        let conn = rustls::ServerConnection::new(tls.server.clone()).map_err(tls_error)?;
        Self::handshake(sock, conn.into())
    }

    fn handshake(mut sock: TcpStream, mut conn: rustls::Connection) -> Result<Self, KvError> {
        conn.set_buffer_limit(Some(4 * TLS_CHUNK));
        while conn.is_handshaking() {
            conn.complete_io(&mut sock).map_err(|e| match e.kind() {
                std::io::ErrorKind::InvalidData => KvError::Unauthenticated(format!("TLS handshake: {e}")),
                _ => KvError::Io(e),
            })?;
        }
        let tls = Arc::new(Mutex::new(TlsState { conn, unfed: Vec::new(), unfed_at: 0 }));
        Ok(KvStream::Tls { sock, tls, scratch: Vec::new(), records: Vec::new() })
    }

    /// Another handle on the same connection (for another thread: one reads, one writes).
    pub fn try_clone(&self) -> std::io::Result<Self> {
        Ok(match self {
            KvStream::Plain(s) => KvStream::Plain(s.try_clone()?),
            KvStream::Tls { sock, tls, .. } => {
                KvStream::Tls { sock: sock.try_clone()?, tls: tls.clone(), scratch: Vec::new(), records: Vec::new() }
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

    /// Ends the connection both ways, for every handle on it (a read or write in progress on
    /// another fails at once).
    pub fn shutdown(&self) {
        let _ = self.socket().shutdown(Shutdown::Both);
    }
}

fn tls_error(e: rustls::Error) -> KvError {
    KvError::Unsupported(format!("TLS: {e}"))
}

fn lock(tls: &Mutex<TlsState>) -> MutexGuard<'_, TlsState> {
    tls.lock().unwrap_or_else(|p| p.into_inner())
}

impl Read for KvStream {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let (sock, tls, scratch) = match self {
            KvStream::Plain(s) => return s.read(buf),
            KvStream::Tls { sock, tls, scratch, .. } => (sock, tls, scratch),
        };
        loop {
            {
                let mut st = lock(tls);
                let left = st.unfed.len() - st.unfed_at;
                st.feed_left_over()?;
                match st.conn.reader().read(buf) {
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    done => return done,
                }
                match st.unfed.len() - st.unfed_at {
                    0 => {}
                    now if now < left => continue,
                    _ => {
                        let e = "the TLS state takes no more bytes and gives none out";
                        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, e));
                    }
                }
            }
            // Nothing decrypted yet: wait for the socket without holding the state.
            scratch.resize(SOCKET_READ, 0);
            let n = sock.read(scratch)?;
            if n == 0 {
                return Ok(0);
            }
            let mut st = lock(tls);
            let taken = st.feed(&scratch[..n])?;
            st.unfed.extend_from_slice(&scratch[taken..n]);
        }
    }
}

impl Write for KvStream {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let (sock, tls, records) = match self {
            KvStream::Plain(s) => return s.write(buf),
            KvStream::Tls { sock, tls, records, .. } => (sock, tls, records),
        };
        // Encrypted under the lock, sent without it.
        records.clear();
        let n = {
            let mut st = lock(tls);
            let n = st.conn.writer().write(&buf[..buf.len().min(TLS_CHUNK)])?;
            while st.conn.wants_write() {
                st.conn.write_tls(records)?;
            }
            n
        };
        sock.write_all(records)?;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
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
        KvTls::from_pem(cert.pem().as_bytes(), key.serialize_pem().as_bytes(), ca.pem().as_bytes()).unwrap()
    }

    /// Two ends of one TLS connection over loopback: the connecting one, the accepting one.
    fn tls_pair() -> (KvStream, KvStream) {
        let tls = tls();
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
        let (client, server) = tls_pair();
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
        let (mut client, server) = tls_pair();
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

    #[test]
    fn bad_pem_is_refused_naming_the_part() {
        assert!(KvTls::from_pem(b"", b"", b"").unwrap_err().contains("certificate"));
    }
}
