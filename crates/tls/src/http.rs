//! The HTTP ports' listener: plain TCP, or TLS over it, with Nagle's algorithm off either way.
//!
//! TLS handshakes run in tasks of their own, bounded in time and in number, so a client that
//! opens a connection and sends nothing (or a plain-HTTP client on an HTTPS port) holds up
//! neither other clients nor the server.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::serve::ListenerExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};
use tokio_rustls::server::TlsStream;

use crate::HttpsConfig;

/// How long a client has to finish its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Handshakes in progress at once; accepting waits while this many are.
const HANDSHAKES_AT_ONCE: usize = 256;

/// Serves `app` on `listener` until `shutdown` resolves: over TLS when `tls` is given.
pub async fn serve(
    listener: TcpListener,
    tls: Option<HttpsConfig>,
    app: axum::Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    match tls {
        None => axum::serve(listener.tap_io(no_delay), app).with_graceful_shutdown(shutdown).await,
        Some(tls) => axum::serve(TlsListener::new(listener, tls), app).with_graceful_shutdown(shutdown).await,
    }
}

/// Streamed tokens are small writes: with Nagle's algorithm each waits for the peer's delayed
/// ACK of the one before (40 ms on Linux), which a router in front turned into 40 ms on a
/// request's first token and between tokens.
fn no_delay(tcp: &mut TcpStream) {
    if let Err(e) = tcp.set_nodelay(true) {
        tracing::warn!(error = %e, "could not set TCP_NODELAY; streamed tokens may wait on delayed ACKs");
    }
}

/// Accepts TCP connections and hands on those whose TLS handshake completed.
pub struct TlsListener {
    local: std::io::Result<SocketAddr>,
    ready: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    accepting: tokio::task::JoinHandle<()>,
}

impl TlsListener {
    /// Starts accepting on `listener` (in a task of the current runtime).
    pub fn new(listener: TcpListener, tls: HttpsConfig) -> Self {
        let local = listener.local_addr();
        let (tx, ready) = mpsc::channel(64);
        let accepting = tokio::spawn(accept_loop(listener, tokio_rustls::TlsAcceptor::from(tls.0), tx));
        Self { local, ready, accepting }
    }
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

async fn accept_loop(
    listener: TcpListener,
    acceptor: tokio_rustls::TlsAcceptor,
    ready: mpsc::Sender<(TlsStream<TcpStream>, SocketAddr)>,
) {
    let handshakes = Arc::new(Semaphore::new(HANDSHAKES_AT_ONCE));
    loop {
        let Ok(permit) = handshakes.clone().acquire_owned().await else { return };
        let (mut tcp, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of file descriptors and the like: pause rather than spin (as axum does).
                tracing::warn!(error = %e, "accepting a connection failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        no_delay(&mut tcp);
        let (acceptor, ready) = (acceptor.clone(), ready.clone());
        tokio::spawn(async move {
            let _permit = permit;
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(tls)) => {
                    let _ = ready.send((tls, peer)).await;
                }
                // Scanners and plain-HTTP clients land here: not worth more than a debug line.
                Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
            }
        });
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(accepted) => accepted,
            // The accepting task ended (its runtime is shutting down): nothing more will come.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        match &self.local {
            Ok(addr) => Ok(*addr),
            Err(e) => Err(std::io::Error::new(e.kind(), e.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A CA, and a server certificate it signed for 127.0.0.1 (PEM).
    fn material() -> (String, String, String) {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = ca.self_signed(&ca_key).unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()])
            .unwrap()
            .signed_by(&key, &ca, &ca_key)
            .unwrap();
        (ca.pem(), cert.pem(), key.serialize_pem())
    }

    async fn https_server(cert: &str, key: &str) -> SocketAddr {
        let tls = HttpsConfig::from_pem(cert.as_bytes(), key.as_bytes()).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = axum::Router::new().route("/hello", axum::routing::get(|| async { "hello over tls" }));
        tokio::spawn(serve(listener, Some(tls), app, std::future::pending()));
        addr
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn serves_https_to_a_client_trusting_the_ca_and_no_other() {
        let (ca, cert, key) = material();
        let addr = https_server(&cert, &key).await;
        let url = format!("https://{addr}/hello");

        let trusting = reqwest::Client::builder()
            .add_root_certificate(reqwest::Certificate::from_pem(ca.as_bytes()).unwrap())
            .build()
            .unwrap();
        let body = trusting.get(&url).send().await.unwrap().text().await.unwrap();
        assert_eq!(body, "hello over tls");

        // No roots: the certificate is not trusted, the request fails.
        let err = reqwest::Client::new().get(&url).send().await.unwrap_err();
        assert!(err.is_connect(), "{err:?}");
        // Plain HTTP on the TLS port gets no answer (the handshake fails, the port keeps serving).
        assert!(reqwest::Client::new().get(format!("http://{addr}/hello")).send().await.is_err());
        let body = trusting.get(&url).send().await.unwrap().text().await.unwrap();
        assert_eq!(body, "hello over tls");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_silent_client_holds_up_no_other() {
        let (ca, cert, key) = material();
        let addr = https_server(&cert, &key).await;
        // Connections that never start their handshake, more than a few.
        let mut silent = Vec::new();
        for _ in 0..8 {
            silent.push(TcpStream::connect(addr).await.unwrap());
        }
        let mut half = TcpStream::connect(addr).await.unwrap();
        half.write_all(&[0x16, 0x03, 0x01]).await.unwrap();

        let trusting = reqwest::Client::builder()
            .add_root_certificate(reqwest::Certificate::from_pem(ca.as_bytes()).unwrap())
            .build()
            .unwrap();
        let answered =
            tokio::time::timeout(Duration::from_secs(5), trusting.get(format!("https://{addr}/hello")).send())
                .await
                .expect("a client that handshakes is served while others stay silent")
                .unwrap();
        assert!(answered.status().is_success());
        // The half-sent handshake is still waiting, not answered or closed.
        let mut byte = [0u8; 1];
        let waited = tokio::time::timeout(Duration::from_millis(200), half.read(&mut byte)).await;
        assert!(waited.is_err(), "the server answered a handshake it had not got");
    }
}
