//! TLS 1.3's record layer for a side-channel stream once rustls has finished its handshake.
//!
//! rustls moves every byte through buffers of its own: a write copies the plaintext into a
//! record it allocates and then into the caller's output, a read copies the ciphertext into its
//! deframer and the plaintext out again. For the KV's gigabytes that was four copies a byte
//! besides the socket's and the cipher's. Both ends of a side channel are tandem, so after the
//! handshake each takes the session's traffic keys from rustls (`dangerous_extract_secrets`)
//! and runs the record layer itself (RFC 8446, section 5.2): a write encrypts in place in one
//! reused buffer and hands many records to the socket at once; a read takes what the socket
//! has into one buffer, decrypts each record where it lies and copies the plaintext out once.
//! On the wire nothing changes: these are the TLS 1.3 records rustls would have sent (a test
//! has rustls read them).
//!
//! Layer: under `stream`; calls `tls_pipes`.

use std::io::{self, Read, Write};
use std::net::TcpStream;

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_128_GCM, AES_256_GCM, CHACHA20_POLY1305, NONCE_LEN};
use rustls::ConnectionTrafficSecrets;

use crate::tls_pipes::{RecvPipe, SendPipe};

/// A record's most plaintext (2^14 bytes).
const MAX_PLAINTEXT: usize = 1 << 14;
/// A record's header: type, legacy version, length.
const HEADER: usize = 5;
/// The AEAD tag (every TLS 1.3 suite's is 16 bytes).
const TAG: usize = 16;
/// The most ciphertext a record may carry (RFC 8446: 2^14 + 256).
const MAX_CIPHERTEXT: usize = MAX_PLAINTEXT + 256;
/// Plaintext a write encrypts and hands to the socket at once.
const WRITE_BATCH: usize = 256 << 10;
/// Ciphertext a read takes from the socket at once (and room for one more whole record).
const READ_BUF: usize = (256 << 10) + HEADER + MAX_CIPHERTEXT;
/// Room in the caller's buffer from which a read takes the socket's bytes straight into it and
/// decrypts them there, rather than through `RecordReader`'s own buffer (a copy less a byte).
const DIRECT_MIN: usize = 4 * MAX_PLAINTEXT;
/// A write or read at least this large starts the connection's pipe ([`crate::tls_pipes`]):
/// the KV's bulk bytes, never a control frame.
const PIPE_MIN: usize = 64 << 10;
/// Records one key may seal: AES-GCM's bound is 2^24.5 full records (RFC 8446, section 5.5),
/// about 380 GB. TLS would renew the key with a KeyUpdate; this layer does not, and refuses to
/// write past it instead, which fails that transfer (decode recomputes) and the connection, so
/// the next transfer opens a new one with fresh keys.
const RECORDS_PER_KEY: u64 = 1 << 24;

const APPLICATION_DATA: u8 = 23;
const ALERT: u8 = 21;
const HANDSHAKE: u8 = 22;

/// One direction's key and sequence number.
struct Keys {
    key: LessSafeKey,
    iv: [u8; NONCE_LEN],
    seq: u64,
}

impl Keys {
    fn new(seq: u64, secrets: ConnectionTrafficSecrets) -> Result<Self, String> {
        let (algorithm, key, iv) = match &secrets {
            ConnectionTrafficSecrets::Aes128Gcm { key, iv } => (&AES_128_GCM, key, iv),
            ConnectionTrafficSecrets::Aes256Gcm { key, iv } => (&AES_256_GCM, key, iv),
            ConnectionTrafficSecrets::Chacha20Poly1305 { key, iv } => (&CHACHA20_POLY1305, key, iv),
            _ => return Err("the negotiated cipher suite is none this record layer runs".into()),
        };
        let key = UnboundKey::new(algorithm, key.as_ref()).map_err(|_| "a traffic key of the wrong length")?;
        let iv = iv.as_ref().try_into().map_err(|_| "a traffic IV of the wrong length")?;
        Ok(Self { key: LessSafeKey::new(key), iv, seq })
    }

    /// The next record's nonce: the IV XOR the sequence number (RFC 8446, section 5.3).
    fn next_nonce(&mut self) -> Nonce {
        let mut nonce = self.iv;
        for (n, s) in nonce[NONCE_LEN - 8..].iter_mut().zip(self.seq.to_be_bytes()) {
            *n ^= s;
        }
        self.seq += 1;
        Nonce::assume_unique_for_key(nonce)
    }
}

fn header(len: usize) -> [u8; HEADER] {
    [APPLICATION_DATA, 3, 3, (len >> 8) as u8, len as u8]
}

fn invalid(why: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why.to_string())
}

/// The sending direction.
pub struct RecordWriter {
    keys: Keys,
    /// Records encrypted and not yet written (kept, so that no write allocates).
    out: Vec<u8>,
    /// A write failed midway: the peer's view of the sequence is lost, so nothing more goes.
    broken: bool,
    /// Once started ([`RecordWriter::pipe_to`]), every batch goes to the socket through it.
    pipe: Option<SendPipe>,
}

impl RecordWriter {
    pub(crate) fn new(seq: u64, secrets: ConnectionTrafficSecrets) -> Result<Self, String> {
        Ok(Self { keys: Keys::new(seq, secrets)?, out: Vec::new(), broken: false, pipe: None })
    }

    /// Whether a write of `len` bytes should start a pipe: a large one, none running yet.
    pub(crate) fn wants_pipe(&self, len: usize) -> bool {
        self.pipe.is_none() && !self.broken && len >= PIPE_MIN
    }

    /// From now on batches are written to `sock` by a thread while the next is sealed
    /// ([`SendPipe`]); where no thread can start, writes stay serial.
    pub(crate) fn pipe_to(&mut self, sock: &TcpStream) {
        match SendPipe::start(sock) {
            Ok(pipe) => self.pipe = Some(pipe),
            Err(e) => tracing::debug!(error = %e, "no thread for a TLS stream's writes: they stay serial"),
        }
    }

    /// Encrypts up to [`WRITE_BATCH`] bytes of `data` into records and writes them all to
    /// `sock` (or hands them to the pipe's thread, which writes them in order); how many bytes
    /// of `data` that was.
    pub(crate) fn write(&mut self, sock: &mut impl Write, data: &[u8]) -> io::Result<usize> {
        if self.broken {
            return Err(io::Error::new(io::ErrorKind::BrokenPipe, "an earlier TLS write failed"));
        }
        let data = &data[..data.len().min(WRITE_BATCH)];
        if self.keys.seq + data.len().div_ceil(MAX_PLAINTEXT) as u64 > RECORDS_PER_KEY {
            self.broken = true;
            return Err(io::Error::other("this connection's TLS key sealed all the records it may (RFC 8446, 5.5)"));
        }
        let written = match &mut self.pipe {
            None => {
                self.out.clear();
                seal(&mut self.keys, data, &mut self.out).and_then(|()| sock.write_all(&self.out))
            }
            Some(pipe) => pipe.buffer().and_then(|mut batch| {
                seal(&mut self.keys, data, &mut batch)?;
                pipe.send(batch)
            }),
        };
        written.inspect_err(|_| self.broken = true)?;
        Ok(data.len())
    }

    /// Whether a pipe carries the writes.
    #[cfg(test)]
    pub(crate) fn pipelined(&self) -> bool {
        self.pipe.is_some()
    }

    /// Waits until every byte written is on the socket.
    pub(crate) fn flush(&mut self) -> io::Result<()> {
        match &mut self.pipe {
            Some(pipe) => pipe.flush().inspect_err(|_| self.broken = true),
            None => Ok(()),
        }
    }
}

/// `data` as TLS 1.3 records of at most [`MAX_PLAINTEXT`] bytes each, appended to `out`.
fn seal(keys: &mut Keys, data: &[u8], out: &mut Vec<u8>) -> io::Result<()> {
    out.reserve(data.len() + data.len().div_ceil(MAX_PLAINTEXT).max(1) * (HEADER + 1 + TAG));
    for piece in data.chunks(MAX_PLAINTEXT) {
        let start = out.len();
        let head = header(piece.len() + 1 + TAG);
        out.extend_from_slice(&head);
        out.extend_from_slice(piece);
        out.push(APPLICATION_DATA);
        let nonce = keys.next_nonce();
        let tag = keys
            .key
            .seal_in_place_separate_tag(nonce, Aad::from(head), &mut out[start + HEADER..])
            .map_err(|_| invalid("TLS record encryption failed"))?;
        out.extend_from_slice(tag.as_ref());
    }
    Ok(())
}

/// The receiving direction: ciphertext read from the socket and not yet given out.
pub struct RecordReader {
    keys: Keys,
    buf: Vec<u8>,
    /// The first byte of `buf` not yet opened as a record, and the end of what was read.
    start: usize,
    end: usize,
    /// The opened record's plaintext not yet given out, within `buf`.
    plain: (usize, usize),
    /// The peer said close_notify.
    closed: bool,
    /// Once started, the socket's bytes come through it, a batch of whole records at a time.
    pipe: Option<RecvPipe>,
}

impl RecordReader {
    pub(crate) fn new(seq: u64, secrets: ConnectionTrafficSecrets) -> Result<Self, String> {
        Ok(Self {
            keys: Keys::new(seq, secrets)?,
            buf: Vec::new(),
            start: 0,
            end: 0,
            plain: (0, 0),
            closed: false,
            pipe: None,
        })
    }

    /// Plaintext into `out`: what is decrypted already, else as many whole records as `out`
    /// holds once the socket has brought one. Ok(0) only at the end of the stream.
    ///
    /// With room in `out` ([`DIRECT_MIN`]) and nothing buffered, the socket's bytes go straight
    /// into `out` and each record is decrypted where it landed, its plaintext moved up against
    /// the one before by the cipher itself (`open_within`): the KV's bytes are then never
    /// copied out of a buffer of ours. A record the read cut short waits in our buffer, and only
    /// its missing bytes are read before going direct again.
    ///
    /// Given `pipe_source` (the socket `sock` reads), the first read with that room and no
    /// partial record starts a [`RecvPipe`] on it: from then on a thread reads the socket ahead
    /// and each record is decrypted in the batch that brought it while the thread reads the
    /// next.
    pub(crate) fn read(
        &mut self,
        sock: &mut impl Read,
        pipe_source: Option<&TcpStream>,
        out: &mut [u8],
    ) -> io::Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        let mut given = 0;
        loop {
            let (from, to) = self.plain;
            let n = (to - from).min(out.len() - given);
            out[given..given + n].copy_from_slice(&self.buf[from..from + n]);
            self.plain.0 += n;
            given += n;
            if given == out.len() {
                return Ok(given);
            }
            if self.open_next()? {
                continue;
            }
            // No whole record is left: return what was given rather than wait for more.
            if given > 0 || self.closed {
                return Ok(given);
            }
            let room = out.len() - given >= PIPE_MIN.max(DIRECT_MIN);
            if let (None, Some(source), true) = (&self.pipe, pipe_source, room && self.start == self.end) {
                self.pipe = RecvPipe::start(source, READ_BUF, HEADER, header_len)
                    .inspect_err(
                        |e| tracing::debug!(error = %e, "no thread for a TLS stream's reads: they stay serial"),
                    )
                    .ok();
            }
            if let Some(pipe) = &mut self.pipe {
                // Every record of the last batch is opened and given out (a batch holds whole
                // records only): its buffer goes back.
                let done = std::mem::take(&mut self.buf);
                (self.start, self.end, self.plain) = (0, 0, (0, 0));
                let (batch, len) = pipe.next(done)?;
                (self.buf, self.end) = (batch, len);
                continue;
            }
            let room = out.len() - given >= DIRECT_MIN;
            if room && self.start == self.end {
                given += self.read_direct(sock, &mut out[given..])?;
                continue;
            }
            // With room for going direct after it, read only the rest of the partial record.
            let rest = if room { self.missing() } else { usize::MAX };
            self.fill(sock, rest)?;
        }
    }

    /// Whether a pipe brings the reads.
    #[cfg(test)]
    pub(crate) fn pipelined(&self) -> bool {
        self.pipe.is_some()
    }

    /// Bytes the partial record in the buffer still lacks (of its header, if that is partial).
    fn missing(&self) -> usize {
        let have = self.end - self.start;
        if have < HEADER {
            return HEADER - have;
        }
        let len = u16::from_be_bytes([self.buf[self.start + 3], self.buf[self.start + 4]]) as usize;
        (HEADER + len).saturating_sub(have).max(1)
    }

    /// Reads what the socket has into `out` and decrypts every whole record there, the
    /// plaintexts packed from `out`'s start; the partial record after them goes to our buffer.
    /// How much plaintext that was (0 when the read brought no whole record).
    fn read_direct(&mut self, sock: &mut impl Read, out: &mut [u8]) -> io::Result<usize> {
        let n = sock.read(out)?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the peer closed without close_notify"));
        }
        let (mut at, mut plain) = (0, 0);
        while !self.closed && n - at >= HEADER {
            let head: [u8; HEADER] = out[at..at + HEADER].try_into().unwrap_or_default();
            let len = record_len(&head)?;
            if n - at < HEADER + len {
                break;
            }
            let body = at + HEADER;
            let nonce = self.keys.next_nonce();
            let opened = self
                .keys
                .key
                .open_within(nonce, Aad::from(head), &mut out[plain..body + len], body - plain..)
                .map_err(|_| unauthentic())?;
            let content = inner_content(opened, &mut self.closed)?;
            plain += content;
            at = body + len;
        }
        if self.buf.is_empty() {
            self.buf = vec![0; READ_BUF];
        }
        // What follows close_notify is never read; a partial record waits for its rest.
        let rest = if self.closed { 0 } else { n - at };
        self.buf[..rest].copy_from_slice(&out[at..at + rest]);
        (self.start, self.end, self.plain) = (0, rest, (0, 0));
        Ok(plain)
    }

    /// Reads what the socket has (at most `limit` bytes), after what is left of a partial
    /// record.
    fn fill(&mut self, sock: &mut impl Read, limit: usize) -> io::Result<()> {
        if self.buf.is_empty() {
            self.buf = vec![0; READ_BUF];
        }
        // Nothing decrypted is left (only then does a read come here): move the partial record
        // to the front.
        self.buf.copy_within(self.start..self.end, 0);
        self.end -= self.start;
        self.start = 0;
        self.plain = (0, 0);
        let until = self.end.saturating_add(limit).min(self.buf.len());
        let n = sock.read(&mut self.buf[self.end..until])?;
        if n == 0 {
            return match self.end {
                0 => Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the peer closed without close_notify")),
                _ => Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the stream ended inside a TLS record")),
            };
        }
        self.end += n;
        Ok(())
    }

    /// Opens the next whole record in the buffer, if there is one: its plaintext becomes
    /// `plain`. False when the buffer holds no whole record.
    fn open_next(&mut self) -> io::Result<bool> {
        if self.closed || self.end - self.start < HEADER {
            return Ok(false);
        }
        let head: [u8; HEADER] = self.buf[self.start..self.start + HEADER].try_into().unwrap_or_default();
        let len = record_len(&head)?;
        if self.end - self.start < HEADER + len {
            return Ok(false);
        }
        let body = self.start + HEADER;
        let nonce = self.keys.next_nonce();
        let opened = self
            .keys
            .key
            .open_in_place(nonce, Aad::from(head), &mut self.buf[body..body + len])
            .map_err(|_| unauthentic())?;
        let content = inner_content(opened, &mut self.closed)?;
        self.start = body + len;
        self.plain = (body, body + content);
        Ok(true)
    }
}

/// [`record_len`] of a header given as a slice (of [`HEADER`] bytes), for the pipe's thread.
fn header_len(head: &[u8]) -> io::Result<usize> {
    record_len(&head.try_into().map_err(|_| invalid("a TLS record header cut short"))?)
}

/// A record header's ciphertext length, if the header is a TLS 1.3 application-data record's.
fn record_len(head: &[u8; HEADER]) -> io::Result<usize> {
    let len = u16::from_be_bytes([head[3], head[4]]) as usize;
    if head[0] != APPLICATION_DATA || head[1] != 3 || !(TAG + 1..=MAX_CIPHERTEXT).contains(&len) {
        return Err(invalid("not a TLS 1.3 application-data record"));
    }
    Ok(len)
}

fn unauthentic() -> io::Error {
    invalid("a TLS record failed authentication (altered, replayed or out of order)")
}

/// An opened record's application data: how many of its first bytes are content (its inner
/// plaintext is content, a content type, then zeros of padding). close_notify sets `closed` and
/// carries none; any other alert, a handshake message or an unknown type is an error.
fn inner_content(opened: &[u8], closed: &mut bool) -> io::Result<usize> {
    let Some(last) = opened.iter().rposition(|&b| b != 0) else {
        return Err(invalid("a TLS record without a content type"));
    };
    match opened[last] {
        APPLICATION_DATA => Ok(last),
        // close_notify (warning level 1, description 0) ends the stream.
        ALERT if last == 2 && opened[1] == 0 => {
            *closed = true;
            Ok(0)
        }
        ALERT => Err(invalid(&format!("the peer sent TLS alert {}", opened.get(1).copied().unwrap_or(0)))),
        HANDSHAKE => Err(invalid("a TLS handshake message after the handshake (key update)")),
        _ => Err(invalid("a TLS record of an unknown content type")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::crypto::cipher::{AeadKey, Iv};

    fn secrets(fill: u8) -> ConnectionTrafficSecrets {
        let mut key = [fill; 32];
        key[0] = 1;
        ConnectionTrafficSecrets::Aes256Gcm { key: AeadKey::from(key), iv: Iv::new([fill ^ 0x5a; NONCE_LEN]) }
    }

    fn pair() -> (RecordWriter, RecordReader) {
        (RecordWriter::new(7, secrets(3)).unwrap(), RecordReader::new(7, secrets(3)).unwrap())
    }

    fn read_all(reader: &mut RecordReader, mut wire: &[u8], want: usize, piece: usize) -> io::Result<Vec<u8>> {
        let mut got = Vec::new();
        let mut out = vec![0u8; piece];
        while got.len() < want {
            let n = reader.read(&mut wire, None, &mut out)?;
            got.extend_from_slice(&out[..n]);
        }
        Ok(got)
    }

    /// Writes of every size come back whole, read in pieces smaller and larger than a record;
    /// the wire holds records of at most 2^14 bytes of plaintext each.
    #[test]
    fn what_is_written_is_read_in_any_pieces() {
        let (mut writer, mut reader) = pair();
        let data: Vec<u8> = (0..700_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut wire = Vec::new();
        let mut at = 0;
        for size in [0, 1, 100, 16384, 16385, 300_000, 700_000].into_iter().cycle() {
            if at == data.len() {
                break;
            }
            at += writer.write(&mut wire, &data[at..(at + size).min(data.len())]).unwrap();
        }
        let records = wire.len() - data.len();
        assert!(records / (HEADER + 1 + TAG) >= data.len() / MAX_PLAINTEXT, "records of at most 2^14 bytes");
        for piece in [1, 1000, 16384, 1 << 20] {
            let (_, mut reader_again) = pair();
            assert!(read_all(&mut reader_again, &wire, data.len(), piece).unwrap() == data, "piece {piece}");
        }
        assert!(read_all(&mut reader, &wire, data.len(), 4096).unwrap() == data);
    }

    /// A socket that hands over at most a few bytes at a time, the sizes cycling: reads cut
    /// records anywhere (in headers, bodies and tags).
    struct Trickle<'a> {
        wire: &'a [u8],
        sizes: std::iter::Cycle<std::slice::Iter<'static, usize>>,
    }

    impl Read for Trickle<'_> {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = (*self.sizes.next().unwrap_or(&1)).min(buf.len()).min(self.wire.len());
            buf[..n].copy_from_slice(&self.wire[..n]);
            self.wire = &self.wire[n..];
            Ok(n)
        }
    }

    /// Reads into room enough to go straight into the caller's buffer, from a socket that cuts
    /// records anywhere, give the stream whole and in order, the direct reads and the buffered
    /// ones taking turns.
    #[test]
    fn direct_reads_cut_anywhere_give_the_stream_whole() {
        let (mut writer, _) = pair();
        let data: Vec<u8> = (0..2_000_000u32).map(|i| (i * 31 % 253) as u8).collect();
        let mut wire = Vec::new();
        let mut at = 0;
        while at < data.len() {
            at += writer.write(&mut wire, &data[at..]).unwrap();
        }
        static SIZES: [usize; 7] = [1, 3, 7000, 16389, 40_000, 100_003, 300_000];
        for piece in [DIRECT_MIN, 100_000, 1 << 20, 3 << 20] {
            let (_, mut reader) = pair();
            let mut sock = Trickle { wire: &wire, sizes: SIZES.iter().cycle() };
            let mut got = Vec::new();
            let mut out = vec![0u8; piece];
            while got.len() < data.len() {
                let n = reader.read(&mut sock, None, &mut out).unwrap();
                assert!(n > 0);
                got.extend_from_slice(&out[..n]);
            }
            assert!(got == data, "piece {piece}");
        }
    }

    /// A flipped bit anywhere in a record, a record dropped, two swapped, or another key: the
    /// read fails and gives out none of the record's bytes.
    #[test]
    fn altered_dropped_or_reordered_records_are_refused() {
        let (mut writer, _) = pair();
        let data = vec![9u8; 3 * MAX_PLAINTEXT];
        let mut wire = Vec::new();
        writer.write(&mut wire, &data).unwrap();
        let record = HEADER + MAX_PLAINTEXT + 1 + TAG;
        let refused = |wire: &[u8]| {
            let (_, mut reader) = pair();
            let mut out = vec![0u8; 4 * MAX_PLAINTEXT];
            let mut src = wire;
            let r = reader.read(&mut src, None, &mut out);
            assert!(matches!(&r, Err(e) if e.kind() == io::ErrorKind::InvalidData), "{r:?}");
        };
        for at in [HEADER, HEADER + 5000, record - 1] {
            let mut bad = wire.clone();
            bad[at] ^= 0x10;
            refused(&bad);
        }
        refused(&wire[record..]);
        let mut swapped = wire[record..2 * record].to_vec();
        swapped.extend_from_slice(&wire[..record]);
        refused(&swapped);
        let mut other = RecordReader::new(7, secrets(4)).unwrap();
        assert!(other.read(&mut &wire[..], None, &mut [0u8; 100]).is_err());
    }

    /// A key seals at most [`RECORDS_PER_KEY`] records; after that every write is refused.
    #[test]
    fn a_key_seals_no_more_than_its_records() {
        let mut writer = RecordWriter::new(RECORDS_PER_KEY - 2, secrets(3)).unwrap();
        let mut wire = Vec::new();
        assert!(writer.write(&mut wire, &[1u8; 2 * MAX_PLAINTEXT]).unwrap() == 2 * MAX_PLAINTEXT);
        assert!(writer.write(&mut wire, &[1u8; 1]).is_err());
        let mut writer = RecordWriter::new(RECORDS_PER_KEY - 2, secrets(3)).unwrap();
        assert!(writer.write(&mut wire, &[1u8; 2 * MAX_PLAINTEXT + 1]).is_err());
        assert!(writer.write(&mut wire, &[1u8; 1]).is_err(), "a refused writer stays refused");
    }

    /// A stream that ends inside a record is an error, not a short read.
    #[test]
    fn a_stream_cut_inside_a_record_is_an_error() {
        let (mut writer, mut reader) = pair();
        let mut wire = Vec::new();
        writer.write(&mut wire, &[1u8; 1000]).unwrap();
        let r = reader.read(&mut &wire[..500], None, &mut [0u8; 2000]);
        assert!(matches!(&r, Err(e) if e.kind() == io::ErrorKind::UnexpectedEof), "{r:?}");
    }
}
