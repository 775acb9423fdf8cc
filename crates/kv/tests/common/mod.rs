//! A fault-injecting TCP proxy for side-channel tests: it sits between a decode engine and a
//! prefill engine (decode names the proxy as the prefill's address) and forwards both ways
//! until told to cut the connection after a number of bytes from prefill, in the middle of
//! whatever prefill was sending.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Forwards connections on [`FaultProxy::addr`] to `upstream`.
pub struct FaultProxy {
    addr: String,
    /// Bytes from upstream after which a connection is cut (u64::MAX: never).
    cut_after: Arc<AtomicU64>,
    /// Both ends of every connection so far, for [`FaultProxy::cut_now`].
    live: Arc<Mutex<Vec<TcpStream>>>,
    /// Forwarding paused, connections kept open: a frozen peer, as SIGSTOP makes one.
    frozen: Arc<AtomicBool>,
}

impl FaultProxy {
    pub fn start(upstream: String) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let cut_after = Arc::new(AtomicU64::new(u64::MAX));
        let (cut, live) = (cut_after.clone(), Arc::new(Mutex::new(Vec::new())));
        let (conns, frozen) = (live.clone(), Arc::new(AtomicBool::new(false)));
        let paused = frozen.clone();
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let Ok(server) = TcpStream::connect(&upstream) else { continue };
                let limit = cut.load(Ordering::SeqCst);
                let mut l = conns.lock().unwrap();
                l.extend([client.try_clone().unwrap(), server.try_clone().unwrap()]);
                drop(l);
                let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                let (f1, f2) = (paused.clone(), paused.clone());
                std::thread::spawn(move || pump(client, server, u64::MAX, f1)); // decode -> prefill
                std::thread::spawn(move || pump(s2, c2, limit, f2)); // prefill -> decode
            }
        });
        Self { addr, cut_after, live, frozen }
    }

    /// Stops forwarding in both directions, keeping every connection open.
    pub fn freeze(&self) {
        self.frozen.store(true, Ordering::SeqCst);
    }

    /// Cuts every connection made so far, both ways.
    pub fn cut_now(&self) {
        for s in self.live.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// Connections opened from now on are cut after `bytes` from upstream.
    pub fn cut_after(&self, bytes: u64) {
        self.cut_after.store(bytes, Ordering::SeqCst);
    }
}

/// Copies `from` into `to` until either closes or `limit` bytes have passed (holding still while
/// `frozen`); then closes both.
fn pump(mut from: TcpStream, mut to: TcpStream, limit: u64, frozen: Arc<AtomicBool>) {
    let mut buf = [0u8; 1024];
    let mut passed = 0u64;
    while passed < limit {
        while frozen.load(Ordering::SeqCst) {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let want = buf.len().min((limit - passed).min(buf.len() as u64) as usize);
        match from.read(&mut buf[..want]) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
                passed += n as u64;
            }
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}
