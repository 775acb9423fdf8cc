//! The two-leg dispatch (see the crate docs for push vs pull).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Json;
use bytes::Bytes;
use futures::Stream;
use serde_json::{json, Map, Value};
use tandem_core::{KvTransferParams, TransferMode};

use crate::backend::{choose, Backend, InFlight, KvEndpoint};

/// How the router runs.
#[derive(Clone, Debug)]
pub struct RouterConfig {
    /// Push or pull.
    pub mode: TransferMode,
    /// Prefill engine base URLs.
    pub prefill: Vec<String>,
    /// Decode engine base URLs.
    pub decode: Vec<String>,
    /// Longest a prefill leg may take (the decode leg streams for as long as it generates).
    pub prefill_timeout: Duration,
}

/// Why the router could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RouterError {
    /// No prefill or no decode backend was given.
    #[error("need at least one --prefill and one --decode URL")]
    NoBackends,
    /// A backend did not become healthy in time.
    #[error("backend {url} not ready after {secs} s: {reason}")]
    NotReady {
        /// The backend.
        url: String,
        /// How long we waited.
        secs: u64,
        /// The last error.
        reason: String,
    },
    /// A prefill engine has no KV side channel, or another mode than the router's.
    #[error("prefill engine {url}: {reason}")]
    BadPrefill {
        /// The backend.
        url: String,
        /// What is wrong.
        reason: String,
    },
}

/// The router's state: backends, HTTP client, counters.
pub struct Router {
    cfg: RouterConfig,
    http: reqwest::Client,
    prefill: Vec<Arc<Backend>>,
    decode: Vec<Arc<Backend>>,
    turn: AtomicUsize,
    next_transfer: AtomicU64,
    id_prefix: String,
}

impl Router {
    /// A router over the configured backends (not yet checked; see [`Router::wait_ready`]).
    pub fn new(cfg: RouterConfig) -> Result<Self, RouterError> {
        if cfg.prefill.is_empty() || cfg.decode.is_empty() {
            return Err(RouterError::NoBackends);
        }
        Ok(Self {
            prefill: cfg.prefill.iter().map(|u| Arc::new(Backend::new(u))).collect(),
            decode: cfg.decode.iter().map(|u| Arc::new(Backend::new(u))).collect(),
            http: reqwest::Client::builder().connect_timeout(Duration::from_secs(5)).build().unwrap_or_default(),
            turn: AtomicUsize::new(0),
            next_transfer: AtomicU64::new(0),
            id_prefix: format!("{:08x}", rand::random::<u32>()),
            cfg,
        })
    }

    /// Waits (bounded by `timeout`) until every backend answers `/health`, and learns each
    /// prefill engine's KV side channel, checking its mode matches ours.
    pub async fn wait_ready(&self, timeout: Duration) -> Result<(), RouterError> {
        let start = Instant::now();
        for b in self.prefill.iter().chain(&self.decode) {
            loop {
                let r = self.http.get(format!("{}/health", b.url)).timeout(Duration::from_secs(2)).send().await;
                match r {
                    Ok(r) if r.status().is_success() => break,
                    other => {
                        if start.elapsed() > timeout {
                            let reason = match other {
                                Ok(r) => format!("HTTP {}", r.status()),
                                Err(e) => e.to_string(),
                            };
                            return Err(RouterError::NotReady { url: b.url.clone(), secs: timeout.as_secs(), reason });
                        }
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            }
        }
        for b in &self.prefill {
            self.refresh_kv(b).await?;
        }
        Ok(())
    }

    async fn refresh_kv(&self, b: &Backend) -> Result<KvEndpoint, RouterError> {
        let bad = |reason: String| RouterError::BadPrefill { url: b.url.clone(), reason };
        let r = self
            .http
            .get(format!("{}/kv/info", b.url))
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .map_err(|e| bad(e.to_string()))?;
        if !r.status().is_success() {
            return Err(bad("has no KV side channel (start it with --role prefill)".into()));
        }
        let info: tandem_kv::AgentInfo = r.json().await.map_err(|e| bad(format!("bad /kv/info: {e}")))?;
        let mode = match info.kv_mode {
            tandem_kv::KvMode::Push => TransferMode::Push,
            tandem_kv::KvMode::Pull => TransferMode::Pull,
        };
        if mode != self.cfg.mode {
            return Err(bad(format!("runs in {mode:?} mode, the router in {:?} mode", self.cfg.mode)));
        }
        let addr = info.tcp_addr().ok_or_else(|| bad("offers no TCP side channel".into()))?.to_string();
        let (host, port) = addr.rsplit_once(':').ok_or_else(|| bad(format!("bad address {addr}")))?;
        let kv = KvEndpoint {
            engine_id: info.engine_id.0,
            host: host.trim_matches(|c| c == '[' || c == ']').to_string(),
            port: port.parse().map_err(|_| bad(format!("bad port in {addr}")))?,
        };
        b.set_kv(kv.clone());
        Ok(kv)
    }

    fn pick(&self) -> (Arc<Backend>, Arc<Backend>) {
        let t = self.turn.fetch_add(1, Ordering::Relaxed);
        // `new` guarantees both lists are non-empty.
        let p = choose(&self.prefill, t).unwrap_or_else(|| self.prefill[0].clone());
        let d = choose(&self.decode, t).unwrap_or_else(|| self.decode[0].clone());
        (p, d)
    }

    fn transfer_id(&self) -> String {
        format!("tx-{}-{}", self.id_prefix, self.next_transfer.fetch_add(1, Ordering::Relaxed))
    }
}

/// The router's routes.
pub fn app(router: Arc<Router>) -> axum::Router {
    axum::Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .with_state(router)
}

/// Serves the router on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Arc<Router>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, app(router)).with_graceful_shutdown(shutdown).await
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    let kind = if status.is_client_error() { "BadRequestError" } else { "BadGatewayError" };
    (status, Json(json!({"error": {"message": message.into(), "type": kind, "param": null, "code": status.as_u16()}})))
        .into_response()
}

/// Cancel safety: dropping this future (client disconnect) drops both legs' requests, which
/// the engines see as disconnects and cancel.
async fn completions(State(r): State<Arc<Router>>, headers: HeaderMap, body: Bytes) -> Response {
    dispatch(r, "/v1/completions", headers, body).await
}

/// Cancel safety: as [`completions`].
async fn chat_completions(State(r): State<Arc<Router>>, headers: HeaderMap, body: Bytes) -> Response {
    dispatch(r, "/v1/chat/completions", headers, body).await
}

async fn models(State(r): State<Arc<Router>>) -> Response {
    match r.http.get(format!("{}/v1/models", r.decode[0].url)).send().await {
        Ok(resp) => passthrough(resp, None, Vec::new()),
        Err(e) => error(StatusCode::BAD_GATEWAY, format!("decode engine: {e}")),
    }
}

async fn health(State(r): State<Arc<Router>>) -> StatusCode {
    let mut all = true;
    for b in r.prefill.iter().chain(&r.decode) {
        let ok = matches!(r.http.get(format!("{}/health", b.url)).timeout(Duration::from_secs(2)).send().await, Ok(resp) if resp.status().is_success());
        b.set_healthy(ok);
        all &= ok;
    }
    if all {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

/// The prefill leg's body: one token, not streamed, marked as the prefill of `transfer_id`.
fn prefill_body(orig: &Map<String, Value>, transfer_id: &str) -> Value {
    let mut b = orig.clone();
    b.insert("max_tokens".into(), json!(1));
    if b.contains_key("max_completion_tokens") {
        b.insert("max_completion_tokens".into(), json!(1));
    }
    b.insert("stream".into(), json!(false));
    b.remove("stream_options");
    b.remove("min_tokens");
    let kv =
        KvTransferParams { do_remote_decode: true, transfer_id: Some(transfer_id.to_string()), ..Default::default() };
    b.insert("kv_transfer_params".into(), serde_json::to_value(kv).unwrap_or(Value::Null));
    Value::Object(b)
}

async fn dispatch(r: Arc<Router>, path: &'static str, headers: HeaderMap, body: Bytes) -> Response {
    let orig: Map<String, Value> = match serde_json::from_slice::<Value>(&body) {
        Ok(Value::Object(m)) => m,
        Ok(_) => return error(StatusCode::BAD_REQUEST, "invalid request body: expected a JSON object"),
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("invalid request body: {e}")),
    };
    let (p, d) = r.pick();
    let transfer_id = r.transfer_id();
    let request_id = headers.get("x-request-id").cloned();
    let post = |b: &Arc<Backend>, json: Value| {
        let mut req = r.http.post(format!("{}{path}", b.url)).json(&json);
        if let Some(id) = &request_id {
            req = req.header("x-request-id", id.clone());
        }
        req
    };
    let p_guard = p.start();
    let d_guard = d.start();
    let p_req = post(&p, prefill_body(&orig, &transfer_id)).timeout(r.cfg.prefill_timeout);
    match r.cfg.mode {
        TransferMode::Pull => {
            let presp = match p_req.send().await {
                Ok(x) => x,
                Err(e) => return error(StatusCode::BAD_GATEWAY, format!("prefill leg to {} failed: {e}", p.url)),
            };
            if !presp.status().is_success() {
                return leg_error("prefill", &p.url, presp).await;
            }
            let pjson: Value = match presp.json().await {
                Ok(v) => v,
                Err(e) => {
                    return error(StatusCode::BAD_GATEWAY, format!("prefill leg to {}: unreadable answer: {e}", p.url))
                }
            };
            drop(p_guard);
            let Some(kv) = pjson.get("kv_transfer_params").filter(|v| !v.is_null()).cloned() else {
                return error(
                    StatusCode::BAD_GATEWAY,
                    format!("prefill engine {} returned no kv_transfer_params", p.url),
                );
            };
            let mut db = orig.clone();
            db.insert("kv_transfer_params".into(), kv);
            match post(&d, Value::Object(db)).send().await {
                Ok(resp) if resp.status().is_success() => passthrough(resp, Some(d_guard), Vec::new()),
                Ok(resp) => leg_error("decode", &d.url, resp).await,
                Err(e) => error(StatusCode::BAD_GATEWAY, format!("decode leg to {} failed: {e}", d.url)),
            }
        }
        TransferMode::Push => {
            let kv = match p.kv() {
                Some(kv) => kv,
                None => match r.refresh_kv(&p).await {
                    Ok(kv) => kv,
                    Err(e) => return error(StatusCode::BAD_GATEWAY, e.to_string()),
                },
            };
            let d_kv = KvTransferParams {
                do_remote_prefill: true,
                remote_engine_id: Some(kv.engine_id),
                remote_host: Some(kv.host),
                remote_port: Some(kv.port),
                transfer_id: Some(transfer_id.clone()),
                remote_request_id: Some(transfer_id),
                tp_size: Some(1),
                pp_size: Some(1),
                ..Default::default()
            };
            let mut db = orig.clone();
            db.insert("kv_transfer_params".into(), serde_json::to_value(d_kv).unwrap_or(Value::Null));
            // Both legs at once: decode registers its blocks while prefill computes.
            let prefill_url = p.url.clone();
            let mut prefill_leg = AbortOnDrop(tokio::spawn(async move {
                let _guard = p_guard;
                match p_req.send().await {
                    Ok(resp) if resp.status().is_success() => {
                        let _ = resp.bytes().await;
                        Ok(())
                    }
                    Ok(resp) => Err(leg_error("prefill", &prefill_url, resp).await),
                    Err(e) => Err(error(StatusCode::BAD_GATEWAY, format!("prefill leg to {prefill_url} failed: {e}"))),
                }
            }));
            let decode_leg = post(&d, Value::Object(db)).send();
            tokio::pin!(decode_leg);
            let dresp = tokio::select! {
                d = &mut decode_leg => d,
                p = &mut prefill_leg.0 => match p {
                    // The prefill leg failed before decode answered: report it; dropping the
                    // decode leg cancels it on the decode engine.
                    Ok(Err(resp)) => return resp,
                    _ => decode_leg.await,
                },
            };
            match dresp {
                Ok(resp) if resp.status().is_success() => passthrough(resp, Some(d_guard), vec![prefill_leg]),
                Ok(resp) => leg_error("decode", &d.url, resp).await,
                Err(e) => error(StatusCode::BAD_GATEWAY, format!("decode leg to {} failed: {e}", d.url)),
            }
        }
    }
}

/// A leg answered with an error: a 4xx passes through (the client's request is at fault);
/// anything else becomes a 502 naming the leg.
async fn leg_error(leg: &str, url: &str, resp: reqwest::Response) -> Response {
    let status = resp.status();
    let body = resp.text().await.unwrap_or_default();
    if status.is_client_error() {
        let code = StatusCode::from_u16(status.as_u16()).unwrap_or(StatusCode::BAD_REQUEST);
        return (code, [("content-type", "application/json")], body).into_response();
    }
    error(StatusCode::BAD_GATEWAY, format!("{leg} leg to {url} failed with HTTP {status}: {body}"))
}

/// Aborts a spawned leg when the response that owns it is dropped (client gone).
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The decode engine's response streamed to the client, holding the legs' guards until the
/// body ends or the client goes away.
struct Guarded<S> {
    inner: Pin<Box<S>>,
    _in_flight: Option<InFlight>,
    _legs: Vec<AbortOnDrop<Result<(), Response>>>,
}

impl<S: Stream> Stream for Guarded<S> {
    type Item = S::Item;
    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<S::Item>> {
        self.inner.as_mut().poll_next(cx)
    }
}

fn passthrough(
    resp: reqwest::Response,
    in_flight: Option<InFlight>,
    legs: Vec<AbortOnDrop<Result<(), Response>>>,
) -> Response {
    let status = StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::OK);
    let mut out = Response::builder().status(status);
    for name in ["content-type", "x-request-id", "cache-control"] {
        if let Some(v) = resp.headers().get(name) {
            out = out.header(name, v.as_bytes());
        }
    }
    let body = Guarded { inner: Box::pin(resp.bytes_stream()), _in_flight: in_flight, _legs: legs };
    out.body(Body::from_stream(body)).unwrap_or_else(|e| error(StatusCode::BAD_GATEWAY, e.to_string()))
}
