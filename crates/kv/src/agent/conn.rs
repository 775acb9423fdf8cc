//! One side-channel connection (either direction), once per peer: its writer, the peer's
//! handshake, the transport both ends agreed on, and whether it is still open.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use crate::agent_info::AgentInfo;
use crate::error::KvError;
use crate::seal::{JoinKey, Sealer};
use crate::stream::KvStream;
use crate::transport::stripes::{Crew, FRESH};
use crate::transport::{Announce, Announced, Bulk, Transport};
use crate::wire::Message;

pub(crate) struct Conn {
    writer: Mutex<FrameWriter>,
    pub peer: AgentInfo,
    alive: AtomicBool,
    pub transport: Arc<dyn Transport>,
    /// Why a faster transport is not used, as the acceptor said.
    pub note: Option<String>,
    /// The connection's further streams for bulk bytes (tcp, `--kv-tcp-streams` above 1).
    pub data: Arc<DataStreams>,
}

impl Conn {
    pub(crate) fn new(
        stream: &KvStream,
        sealer: Sealer,
        peer: AgentInfo,
        transport: Arc<dyn Transport>,
        note: Option<String>,
        data: Arc<DataStreams>,
    ) -> Result<Self, KvError> {
        let writer = Mutex::new(FrameWriter { stream: stream.try_clone()?, sealer });
        Ok(Self { writer, peer, alive: AtomicBool::new(true), transport, note, data })
    }

    pub(crate) fn send(&self, msg: &Message) -> Result<(), KvError> {
        self.writer().send(msg)
    }

    /// Sends `msg` unless the writer is busy (a bulk send in progress: the peer hears from us
    /// anyway). For liveness heartbeats, which must not hold up the control thread.
    pub(crate) fn try_send(&self, msg: &Message) {
        if let Ok(mut w) = self.writer.try_lock() {
            let _ = w.send(msg);
        }
    }

    /// The connection's writer: frames on one connection never interleave.
    pub(crate) fn writer(&self) -> MutexGuard<'_, FrameWriter> {
        self.writer.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn is_alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }

    /// The reader saw the connection end: nothing more goes on it, nor on its further streams.
    pub(crate) fn close(&self) {
        self.alive.store(false, Ordering::SeqCst);
        self.data.shut_down();
    }
}

/// The connection's socket for writing: frames go out sealed (tagged in sequence, with a
/// cluster secret), the bulk bytes they announce as they are.
pub(crate) struct FrameWriter {
    stream: KvStream,
    sealer: Sealer,
}

impl FrameWriter {
    /// Writes `msg` as the connection's next frame.
    pub(crate) fn send(&mut self, msg: &Message) -> Result<(), KvError> {
        self.sealer.write(&mut self.stream, msg)
    }

    /// Shuts the connection's socket down (both ways).
    pub(crate) fn shutdown(&self) {
        self.stream.shutdown();
    }
}

impl std::io::Write for FrameWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.stream.write(buf)
    }

    fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        self.stream.write_all(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.stream.flush()
    }
}

/// A connection's further TCP streams, over which its bulk bytes are striped with the
/// connection itself as stream 0: the connecting side opens them right after the handshake,
/// each announcing itself with [`Message::JoinStream`]; the accepting side attaches them as
/// they come. A striped send holds the write halves (under the connection's writer); receives
/// use clones of the read halves; closing shuts the sockets down through those clones, so it
/// never waits for a send in progress (which then fails at once).
pub(crate) struct DataStreams {
    /// Streams beyond the connection itself.
    expected: usize,
    /// How long a send or receive waits for the accepting side's streams to join.
    bound: Duration,
    /// Fault injection (`cut_a_stream`): the next striped send shuts the last stream down first.
    cut: AtomicBool,
    /// What a joining stream must prove (accepting side; with a cluster secret).
    join_key: JoinKey,
    /// The write halves, by stream (from 1), held whole by a striped send.
    writers: Mutex<Vec<Option<KvStream>>>,
    /// The read halves and whether the connection is done: never held during I/O.
    state: Mutex<Joined>,
    changed: Condvar,
    /// The threads that carry a striped send (one at a time: the writers are held through it)
    /// and a striped receive (one at a time: the connection's reader runs it), kept from the
    /// first of each for the connection's life.
    crews: [OnceLock<Crew>; 2],
}

struct Joined {
    readers: Vec<Option<KvStream>>,
    shut: bool,
}

/// The write halves of a connection's further streams, held for one striped send.
pub(crate) type Writers<'a> = MutexGuard<'a, Vec<Option<KvStream>>>;

impl DataStreams {
    /// `expected` further streams, none attached yet; a send or receive waits at most `bound`
    /// for them to join, each proving itself under `join_key`. `cut`: fault injection, the
    /// first striped send cuts one first.
    pub(crate) fn expecting(expected: usize, bound: Duration, cut: bool, join_key: JoinKey) -> Arc<Self> {
        let slots = || (0..expected).map(|_| None).collect::<Vec<_>>();
        let (cut, changed) = (AtomicBool::new(cut), Condvar::new());
        let state = Mutex::new(Joined { readers: slots(), shut: false });
        let crews = [OnceLock::new(), OnceLock::new()];
        Arc::new(Self { expected, bound, cut, join_key, writers: Mutex::new(slots()), state, changed, crews })
    }

    /// The threads of this connection's striped sends.
    pub(crate) fn send_crew(&self) -> &Crew {
        self.crews[0].get_or_init(|| Crew::kept(self.count(), "tandem-kv-send"))
    }

    /// The threads of this connection's striped receives.
    pub(crate) fn recv_crew(&self) -> &Crew {
        self.crews[1].get_or_init(|| Crew::kept(self.count(), "tandem-kv-recv"))
    }

    /// What a stream joining this connection must prove.
    pub(crate) fn join_key(&self) -> JoinKey {
        self.join_key
    }

    /// How many streams the connection's bulk bytes are striped over (itself included).
    pub(crate) fn count(&self) -> usize {
        self.expected + 1
    }

    fn state(&self) -> MutexGuard<'_, Joined> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Attaches `stream` as stream `index` (from 1).
    pub(crate) fn attach(&self, index: usize, stream: KvStream) -> Result<(), KvError> {
        let reader = stream.try_clone()?;
        let mut st = self.state();
        let open = !st.shut && index >= 1 && st.readers.get(index - 1).is_some_and(Option::is_none);
        if !open {
            return Err(KvError::Protocol(format!("stream {index} of {} joined twice or out of range", self.count())));
        }
        // No striped send holds the writers before every stream has joined.
        self.writers.lock().unwrap_or_else(|p| p.into_inner())[index - 1] = Some(stream);
        st.readers[index - 1] = Some(reader);
        self.changed.notify_all();
        Ok(())
    }

    /// Waits (boundedly) until every stream has joined; the state then, or an error if they
    /// have not or the connection is closed.
    fn wait_joined(&self) -> Result<MutexGuard<'_, Joined>, KvError> {
        let deadline = Instant::now() + self.bound;
        let mut st = self.state();
        loop {
            if st.shut {
                return Err(KvError::Transfer("the connection's streams are closed".into()));
            }
            if st.readers.iter().all(Option::is_some) {
                return Ok(st);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(KvError::Transfer(format!(
                    "the connection's {} further streams did not all join",
                    self.expected
                )));
            }
            st = self.changed.wait_timeout(st, left).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    /// The write halves for a striped send, once every stream has joined (the fault, if
    /// injected, cuts the last one first).
    fn writers(&self) -> Result<Writers<'_>, KvError> {
        drop(self.wait_joined()?);
        let writers = self.writers.lock().unwrap_or_else(|p| p.into_inner());
        if self.cut.swap(false, Ordering::SeqCst) {
            if let Some(last) = writers.iter().flatten().last() {
                last.shutdown();
            }
        }
        Ok(writers)
    }

    /// Clones of the further streams' read halves, once all have joined.
    pub(crate) fn readers(&self) -> Result<Vec<KvStream>, KvError> {
        let st = self.wait_joined()?;
        st.readers.iter().flatten().map(|s| s.try_clone().map_err(KvError::from)).collect()
    }

    /// Shuts every further stream down (the connection is done, or one of them broke): at
    /// once, a send in progress on them failing.
    pub(crate) fn shut_down(&self) {
        let mut st = self.state();
        st.shut = true;
        for s in st.readers.iter().flatten() {
            s.shutdown();
        }
        self.changed.notify_all();
    }
}

/// A write's frames on a connection: the frame announcing inline bytes (built by `header` from
/// what the transport says follows), the bytes, and the completion after them, all under one
/// hold of the writer (and of the further streams the bytes are striped over) once the
/// announcement is made, so nothing interleaves with them.
pub(crate) struct Frames<'a, H: FnMut(Bulk) -> Message> {
    conn: &'a Conn,
    header: H,
    held: Option<MutexGuard<'a, FrameWriter>>,
    data: Option<Writers<'a>>,
}

impl<'a, H: FnMut(Bulk) -> Message> Frames<'a, H> {
    pub(crate) fn new(conn: &'a Conn, header: H) -> Self {
        Self { conn, header, held: None, data: None }
    }

    /// Sends `msg` after whatever was announced (on the writer still held, if it is).
    pub(crate) fn send(&mut self, msg: &Message) -> Result<(), KvError> {
        match &mut self.held {
            Some(w) => w.send(msg),
            None => self.conn.send(msg),
        }
    }
}

impl<H: FnMut(Bulk) -> Message> Announce for Frames<'_, H> {
    fn announce(&mut self, mut bulk: Bulk) -> Result<Announced<'_>, KvError> {
        // A write of several announcements (groups of layers, each once its step has computed
        // it) lets other frames through between them.
        self.held = None;
        self.data = None;
        let data = &self.conn.data;
        // Nothing to stripe (a push's final write when the parts carried every token): the
        // announcement alone, with no stream threads at either end.
        let striped = data.count() > 1 && bulk.bytes > 0;
        if striped {
            self.data = Some(data.writers()?);
        }
        bulk.streams = if striped { data.count() } else { 1 };
        let mut w = self.conn.writer();
        w.send(&(self.header)(bulk))?;
        let mut out: Vec<&mut (dyn std::io::Write + Send)> = vec![&mut **self.held.insert(w)];
        if let Some(writers) = &mut self.data {
            out.extend(writers.iter_mut().flatten().map(|s| s as &mut (dyn std::io::Write + Send)));
        }
        // A connection that never stripes (one stream, or nothing to send) keeps no threads.
        Ok((out, if striped { data.send_crew() } else { &FRESH }))
    }
}

#[cfg(test)]
mod tests {
    use std::net::{TcpListener, TcpStream};

    use tandem_compute::{KvCache, KvLayout};

    use super::*;
    use crate::agent_info::{KvMode, Role};
    use crate::blocks::KvSlice;
    use crate::channel::Timeouts;
    use crate::config::FaultInjection;
    use crate::memory::KvMemory;
    use crate::seal::Session;
    use crate::transport::tcp::Tcp;
    use crate::transport::Ours;
    use crate::wire::read_message;

    /// A connection of three streams whose two further ones never join (a send waiting for
    /// them gives up after 300 ms), and the peer's end of the connection itself.
    fn stranded() -> (Conn, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let ours = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let theirs = listener.accept().unwrap().0;
        let layout = KvLayout { num_layers: 2, num_kv_heads: 1, head_dim: 8, block_size: 4, num_blocks: 4 };
        let memory = KvMemory::from(KvCache::new(layout).region());
        let faults = FaultInjection::default();
        let tcp = Tcp::new(Ours { memory, verify: false, faults, stage_ahead: false, timeouts: Timeouts::default() });
        let data = DataStreams::expecting(2, Duration::from_millis(300), false, Session::plain().join_key());
        let (id, epoch) = (tandem_core::EngineId("peer".into()), tandem_core::Epoch(1));
        let info = AgentInfo::for_layout(
            id,
            epoch,
            Role::Decode,
            KvMode::Push,
            String::new(),
            &layout,
            tandem_compute::KvDtype::F32,
            Vec::new(),
        );
        let info = AgentInfo { tcp_streams: 3, ..info };
        let conn = Conn::new(&KvStream::Plain(ours), Session::plain().sealer, info, Arc::new(tcp), None, data);
        (conn.unwrap(), theirs)
    }

    fn bulk(bytes: u64) -> Bulk {
        let slice = KvSlice { layers: 0..2, heads: 0..1 };
        Bulk { src_block_size: 4, bytes, checksum: false, slice, rank: 0, ranks: 1, streams: 1 }
    }

    fn announcement(bulk: Bulk) -> Message {
        Message::WriteAck {
            transfer_id: tandem_core::TransferId(format!("{} bytes on {}", bulk.bytes, bulk.streams)),
            error: None,
        }
    }

    #[test]
    fn a_write_of_no_bytes_is_announced_on_the_connection_alone() {
        let (conn, mut peer) = stranded();
        let mut frames = Frames::new(&conn, announcement);
        // No stream thread, and no wait for the further streams: the push's final write when
        // its parts carried every token costs one frame.
        let at = Instant::now();
        assert_eq!(frames.announce(bulk(0)).unwrap().0.len(), 1);
        assert!(at.elapsed() < Duration::from_millis(200), "{:?}", at.elapsed());
        let Message::WriteAck { transfer_id, .. } = read_message(&mut peer).unwrap() else { panic!("not the header") };
        assert_eq!(transfer_id.0, "0 bytes on 1");
        // Bytes are striped over every stream, so they wait for the streams to join.
        let striped = frames.announce(bulk(4096)).map(|(w, _)| w.len());
        assert!(matches!(&striped, Err(KvError::Transfer(why)) if why.contains("did not all join")), "{striped:?}");
    }
}
