//! A TLS connection's socket I/O on threads of its own, so that the record layer's cipher and
//! the socket work at once.
//!
//! Serially a stream's sender seals a batch of records and then writes it, and its receiver
//! reads what the socket has and then opens it: each byte waits for the cipher and the socket
//! in turn, so a stream carries 1 / (1/cipher + 1/socket) (on the H200's host, AES-GCM at about
//! 6 GB/s a core beside 3-4 GB/s of loopback TCP a stream: ~60-80% of the plain transport).
//! With a [`SendPipe`] the caller seals the next batch while a thread writes the one before; with
//! a [`RecvPipe`] a thread reads the socket ahead, cut at record boundaries, while the caller
//! opens the records it already has. Either carries what the slower of the two carries.
//!
//! A pipe starts with a connection's first large write or read (control frames alone never
//! start one), holds at most [`DEPTH`] batches, and its waits keep the socket's bounds: the
//! writer's socket write times out as a serial write would, and a read waits for the next
//! batch no longer than the socket's read timeout.
//!
//! Layer: under `tls_records`; calls nothing of the crate's.

use std::io::{self, ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, sync_channel, Receiver, RecvTimeoutError, Sender, SyncSender};
use std::sync::{Arc, Mutex};

/// Batches a pipe holds: one being sealed or opened by the caller, the rest on the thread's side.
pub(crate) const DEPTH: usize = 3;

/// Why a pipe's thread stopped, for every later call.
type Failure = Arc<Mutex<Option<(ErrorKind, String)>>>;

fn failed(failure: &Failure, what: &str) -> io::Error {
    match failure.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
        Some((kind, why)) => io::Error::new(*kind, format!("{what}: {why}")),
        None => io::Error::new(ErrorKind::BrokenPipe, format!("{what} stopped")),
    }
}

fn record_failure(failure: &Failure, e: &io::Error) {
    *failure.lock().unwrap_or_else(|p| p.into_inner()) = Some((e.kind(), e.to_string()));
}

/// Sealed batches on their way to the socket, written in order by a thread of the pipe's own.
pub(crate) struct SendPipe {
    /// To the thread; dropped with the pipe, after which the thread writes what it holds and
    /// ends (as a socket's close sends what was written before it).
    full: SyncSender<Vec<u8>>,
    /// Buffers back from the thread once written.
    empty: Receiver<Vec<u8>>,
    /// Buffers at hand, and how many are with the thread.
    spare: Vec<Vec<u8>>,
    away: usize,
    failure: Failure,
}

impl SendPipe {
    /// A thread writing to a clone of `sock`.
    pub(crate) fn start(sock: &TcpStream) -> io::Result<Self> {
        let mut sock = sock.try_clone()?;
        let (full, batches) = sync_channel::<Vec<u8>>(DEPTH);
        let (written, empty) = channel();
        let failure = Failure::default();
        let theirs = failure.clone();
        std::thread::Builder::new().name("tandem-kv-tls-tx".into()).spawn(move || {
            for batch in batches {
                if let Err(e) = sock.write_all(&batch) {
                    record_failure(&theirs, &e);
                    return;
                }
                // The pipe may be gone (its connection dropped): the rest is written all the same.
                let _ = written.send(batch);
            }
        })?;
        Ok(Self { full, empty, spare: Vec::with_capacity(DEPTH), away: 0, failure })
    }

    /// An empty buffer for the next batch: one at hand, else a new one while fewer than
    /// [`DEPTH`] exist, else the next the thread gives back once written.
    pub(crate) fn buffer(&mut self) -> io::Result<Vec<u8>> {
        if let Some(mut b) = self.spare.pop() {
            b.clear();
            return Ok(b);
        }
        if self.away + self.spare.len() < DEPTH {
            return Ok(Vec::new());
        }
        let mut b = self.empty.recv().map_err(|_| failed(&self.failure, "the TLS stream's writer"))?;
        self.away -= 1;
        b.clear();
        Ok(b)
    }

    /// Hands a sealed batch to the thread (waiting while it holds [`DEPTH`] already).
    pub(crate) fn send(&mut self, batch: Vec<u8>) -> io::Result<()> {
        self.full.send(batch).map_err(|_| failed(&self.failure, "the TLS stream's writer"))?;
        self.away += 1;
        Ok(())
    }

    /// Waits until every batch handed over is on the socket.
    pub(crate) fn flush(&mut self) -> io::Result<()> {
        while self.away > 0 {
            let b = self.empty.recv().map_err(|_| failed(&self.failure, "the TLS stream's writer"))?;
            self.away -= 1;
            self.spare.push(b);
        }
        Ok(())
    }
}

/// Ciphertext read ahead from the socket by a thread of the pipe's own, in batches of whole
/// records.
pub(crate) struct RecvPipe {
    full: Receiver<io::Result<(Vec<u8>, usize)>>,
    empty: Sender<Vec<u8>>,
    /// The thread's socket: its read timeout bounds a wait, and it is shut for reading when the
    /// pipe goes, which ends the thread's read at once.
    sock: TcpStream,
    stop: Arc<AtomicBool>,
    /// How the stream ended, for every later call.
    ended: Option<(ErrorKind, String)>,
}

impl RecvPipe {
    /// A thread reading a clone of `sock` into buffers of `size` bytes (room for one whole
    /// record at least), each handed over holding whole records only; `record_len` reads a
    /// record's length from its header (an error ends the stream).
    pub(crate) fn start(
        sock: &TcpStream,
        size: usize,
        header: usize,
        record_len: fn(&[u8]) -> io::Result<usize>,
    ) -> io::Result<Self> {
        let mut theirs = sock.try_clone()?;
        let (batches, full) = sync_channel(DEPTH - 1);
        let (empty, returned) = channel::<Vec<u8>>();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        std::thread::Builder::new().name("tandem-kv-tls-rx".into()).spawn(move || {
            // A record the last read cut short, carried to the front of the next buffer.
            let mut carry = Vec::new();
            loop {
                let mut buf = returned.try_recv().ok().filter(|b| b.len() == size).unwrap_or_else(|| vec![0; size]);
                buf[..carry.len()].copy_from_slice(&carry);
                let mut have = carry.len();
                carry.clear();
                let whole = loop {
                    let n = match theirs.read(&mut buf[have..]) {
                        Ok(0) => {
                            let why = if have == 0 {
                                "the peer closed without close_notify"
                            } else {
                                "the stream ended inside a TLS record"
                            };
                            let _ = batches.send(Err(io::Error::new(ErrorKind::UnexpectedEof, why)));
                            return;
                        }
                        Ok(n) => n,
                        // The socket's read timeout (set for the caller's waits) or a signal: the
                        // caller's own wait decides when that is an error.
                        Err(e)
                            if matches!(
                                e.kind(),
                                ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                            ) =>
                        {
                            if stopped.load(Ordering::Acquire) {
                                return;
                            }
                            continue;
                        }
                        Err(e) => {
                            let _ = batches.send(Err(e));
                            return;
                        }
                    };
                    have += n;
                    match whole_records(&buf[..have], header, record_len) {
                        Ok(0) => continue,
                        Ok(whole) => break whole,
                        Err(e) => {
                            let _ = batches.send(Err(e));
                            return;
                        }
                    }
                };
                carry.extend_from_slice(&buf[whole..have]);
                if batches.send(Ok((buf, whole))).is_err() || stopped.load(Ordering::Acquire) {
                    return;
                }
            }
        })?;
        Ok(Self { full, empty, sock: sock.try_clone()?, stop, ended: None })
    }

    /// The next batch of whole records (a buffer and how many of its bytes they are), waiting
    /// no longer than the socket's read timeout; `done` goes back to the thread for reuse.
    pub(crate) fn next(&mut self, done: Vec<u8>) -> io::Result<(Vec<u8>, usize)> {
        if let Some((kind, why)) = &self.ended {
            return Err(io::Error::new(*kind, why.clone()));
        }
        if !done.is_empty() {
            let _ = self.empty.send(done);
        }
        let got = match self.sock.read_timeout()? {
            Some(bound) => self.full.recv_timeout(bound),
            None => self.full.recv().map_err(|_| RecvTimeoutError::Disconnected),
        };
        let err = match got {
            Ok(Ok(batch)) => return Ok(batch),
            // As a socket read past its timeout says it.
            Err(RecvTimeoutError::Timeout) => {
                return Err(io::Error::new(ErrorKind::WouldBlock, "no TLS record within the read timeout"))
            }
            Ok(Err(e)) => e,
            Err(RecvTimeoutError::Disconnected) => {
                io::Error::new(ErrorKind::BrokenPipe, "the TLS stream's reader stopped")
            }
        };
        self.ended = Some((err.kind(), err.to_string()));
        Err(err)
    }
}

impl Drop for RecvPipe {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Ends a read the thread is waiting in; the write half is the writer's to close.
        let _ = self.sock.shutdown(Shutdown::Read);
    }
}

/// How many of `bytes`' first bytes are whole records.
fn whole_records(bytes: &[u8], header: usize, record_len: fn(&[u8]) -> io::Result<usize>) -> io::Result<usize> {
    let mut at = 0;
    while bytes.len() - at >= header {
        let end = at + header + record_len(&bytes[at..at + header])?;
        if end > bytes.len() {
            break;
        }
        at = end;
    }
    Ok(at)
}
