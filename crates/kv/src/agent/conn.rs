//! One side-channel connection (either direction), once per peer: its writer, the peer's
//! handshake, the transport both ends agreed on, and whether it is still open.

use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::agent_info::AgentInfo;
use crate::error::KvError;
use crate::transport::{Announce, Bulk, Transport};
use crate::wire::{write_message, Message};

pub(crate) struct Conn {
    writer: Mutex<TcpStream>,
    pub peer: AgentInfo,
    alive: AtomicBool,
    pub transport: Arc<dyn Transport>,
    /// Why a faster transport is not used, as the acceptor said.
    pub note: Option<String>,
}

impl Conn {
    pub(crate) fn new(
        stream: &TcpStream,
        peer: AgentInfo,
        transport: Arc<dyn Transport>,
        note: Option<String>,
    ) -> Result<Self, KvError> {
        Ok(Self { writer: Mutex::new(stream.try_clone()?), peer, alive: AtomicBool::new(true), transport, note })
    }

    pub(crate) fn send(&self, msg: &Message) -> Result<(), KvError> {
        write_message(&mut *self.writer(), msg)
    }

    /// Sends `msg` unless the writer is busy (a bulk send in progress: the peer hears from us
    /// anyway). For liveness heartbeats, which must not hold up the control thread.
    pub(crate) fn try_send(&self, msg: &Message) {
        if let Ok(mut w) = self.writer.try_lock() {
            let _ = write_message(&mut *w, msg);
        }
    }

    /// The connection's writer: frames on one connection never interleave.
    pub(crate) fn writer(&self) -> MutexGuard<'_, TcpStream> {
        self.writer.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn is_alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }

    /// The reader saw the connection end: nothing more goes on it.
    pub(crate) fn close(&self) {
        self.alive.store(false, Ordering::SeqCst);
    }
}

/// A write's frames on a connection: the frame announcing inline bytes (built by `header` from
/// what the transport says follows), the bytes, and the completion after them, all under one
/// hold of the writer once the announcement is made, so nothing interleaves with them.
pub(crate) struct Frames<'a, H: FnMut(Bulk) -> Message> {
    conn: &'a Conn,
    header: H,
    held: Option<MutexGuard<'a, TcpStream>>,
}

impl<'a, H: FnMut(Bulk) -> Message> Frames<'a, H> {
    pub(crate) fn new(conn: &'a Conn, header: H) -> Self {
        Self { conn, header, held: None }
    }

    /// Sends `msg` after whatever was announced (on the writer still held, if it is).
    pub(crate) fn send(&mut self, msg: &Message) -> Result<(), KvError> {
        match &mut self.held {
            Some(w) => write_message(&mut **w, msg),
            None => self.conn.send(msg),
        }
    }
}

impl<H: FnMut(Bulk) -> Message> Announce for Frames<'_, H> {
    fn announce(&mut self, bulk: Bulk) -> Result<&mut dyn std::io::Write, KvError> {
        // A write of several announcements (groups of layers, each once its step has computed
        // it) lets other frames through between them.
        self.held = None;
        let mut w = self.conn.writer();
        write_message(&mut *w, &(self.header)(bulk))?;
        Ok(&mut **self.held.insert(w))
    }
}
