//! What the client gets: a leg's answer streamed through, or read whole first (a request that
//! is not streamed); why a leg gave none, with the engine to try instead; the router's own
//! OpenAI-shaped errors; and the release of prefill's KV as a request ends.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use futures::StreamExt;
use serde_json::{json, Map, Value};

use crate::backend::{Backend, BackendState, InFlight};

/// Whether the client asked for its answer streamed (`stream: true`).
pub(crate) fn is_streamed(orig: &Map<String, Value>) -> bool {
    orig.get("stream").and_then(Value::as_bool).unwrap_or(false)
}

/// The decode engine's answer for the client: streamed through as it comes, or, for a request
/// that is not streamed, read whole first. A decode engine that dies before its whole answer
/// is read (killed, its connection reset) then fails only this attempt: nothing reached the
/// client yet, so the request goes to another pair ([`decode_lost`]) instead of being lost.
pub(crate) async fn answer(
    resp: reqwest::Response,
    streamed: bool,
    d: &Arc<Backend>,
    in_flight: Option<InFlight>,
    legs: Legs,
    abort: tokio::sync::watch::Receiver<bool>,
) -> Result<Response, LegError> {
    if streamed {
        return Ok(passthrough(resp, in_flight, legs, abort));
    }
    let status = StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::OK);
    let headers: Vec<(&'static str, Vec<u8>)> = ["content-type", "x-request-id", "cache-control"]
        .into_iter()
        .filter_map(|name| resp.headers().get(name).map(|v| (name, v.as_bytes().to_vec())))
        .collect();
    let mut abort = abort;
    let body = tokio::select! {
        body = resp.bytes() => body.map_err(|e| decode_lost(d, &e))?,
        _ = abort.wait_for(|a| *a) => return Err(error(StatusCode::SERVICE_UNAVAILABLE, "the router is shutting down").into()),
    };
    // The answer is whole: the legs' guards go (prefill frees anything it still holds).
    drop((in_flight, legs));
    let mut out = Response::builder().status(status);
    for (name, value) in headers {
        out = out.header(name, value);
    }
    Ok(out.body(Body::from(body)).unwrap_or_else(|e| error(StatusCode::BAD_GATEWAY, e.to_string())))
}

/// A decode engine that took a request not streamed and died while its answer was read: marked
/// down until a check finds it again, and the request tried on another pair.
pub(crate) fn decode_lost(d: &Arc<Backend>, e: &reqwest::Error) -> LegError {
    let cause = describe(e);
    tracing::warn!(url = %d.url, %cause, "decode engine lost a request before answering it; trying another pair");
    d.set_state(BackendState::Down(cause.clone()));
    let response = error(StatusCode::BAD_GATEWAY, format!("decode leg to {} failed: {cause}", d.url));
    LegError { response, engine: Some(d.clone()) }
}

/// Why a leg gave no answer: the response for the client, and the engine to try another
/// one instead of when the request never reached it or it refused before computing.
pub(crate) struct LegError {
    pub(crate) response: Response,
    pub(crate) engine: Option<Arc<Backend>>,
}

impl From<Response> for LegError {
    fn from(response: Response) -> Self {
        Self { response, engine: None }
    }
}

/// A leg could not be sent or its answer did not begin: a 502 naming the leg and the cause.
/// Unless it timed out, the engine is marked down until the next check finds it again, and the
/// request, none of whose answer reached the client, may go to another one.
pub(crate) fn leg_failed(b: &Arc<Backend>, leg: &str, e: &reqwest::Error) -> LegError {
    let cause = describe(e);
    let response = error(StatusCode::BAD_GATEWAY, format!("{leg} leg to {} failed: {cause}", b.url));
    if e.is_timeout() {
        return response.into();
    }
    // No answer began (no connection, or it broke before the response did: the engine died):
    // nothing reached the client, so the request may go to another engine.
    b.set_state(BackendState::Down(cause));
    LegError { response, engine: Some(b.clone()) }
}

/// A leg answered with an error. A 4xx passes through (the client's request is at fault;
/// a 429 with its `Retry-After`, and another engine may take the request instead), except one
/// about `kv_transfer_params`, which the router wrote: that is a misconfiguration between
/// router and engine, answered with a 502 that says so. A 503 with `Retry-After` (the request
/// waited past the engine's `--max-queue-secs` without running) passes through like a 429.
/// Anything else becomes a 502 naming the leg; after a 500 (the engine failed the request) the
/// request may go to another engine of the role.
pub(crate) async fn leg_error(leg: &str, b: &Arc<Backend>, resp: reqwest::Response) -> LegError {
    let (status, url) = (resp.status(), &b.url);
    let retry_after = resp.headers().get("retry-after").cloned();
    let body = resp.text().await.unwrap_or_default();
    if status == reqwest::StatusCode::SERVICE_UNAVAILABLE {
        if let Some(retry_after) = retry_after {
            let mut response =
                (StatusCode::SERVICE_UNAVAILABLE, [("content-type", "application/json")], body).into_response();
            response.headers_mut().insert("retry-after", retry_after);
            return LegError { response, engine: Some(b.clone()) };
        }
    }
    if status.is_client_error() {
        let parsed: Option<Value> = serde_json::from_str(&body).ok();
        let param = parsed.as_ref().and_then(|v| v["error"]["param"].as_str());
        if param == Some("kv_transfer_params") {
            let message = parsed.as_ref().and_then(|v| v["error"]["message"].as_str()).unwrap_or(&body);
            return error(
                StatusCode::BAD_GATEWAY,
                format!("the {leg} engine {url} refused the router's KV transfer parameters ({message}): the engines and the router are set up inconsistently"),
            )
            .into();
        }
        let code = StatusCode::from_u16(status.as_u16()).unwrap_or(StatusCode::BAD_REQUEST);
        let mut response = (code, [("content-type", "application/json")], body).into_response();
        if code != StatusCode::TOO_MANY_REQUESTS {
            return response.into();
        }
        let retry_after = retry_after.unwrap_or(axum::http::HeaderValue::from_static("1"));
        response.headers_mut().insert("retry-after", retry_after);
        return LegError { response, engine: Some(b.clone()) };
    }
    let response = error(StatusCode::BAD_GATEWAY, format!("{leg} leg to {url} failed with HTTP {status}: {body}"));
    // The engine failed the request before any of its answer (its model failed the step: a
    // device error, a tensor-parallel rank that died): another engine of the role may answer
    // it. The engine stays up: it failed this step, and serves the next.
    if status == reqwest::StatusCode::INTERNAL_SERVER_ERROR {
        return LegError { response, engine: Some(b.clone()) };
    }
    response.into()
}

/// Aborts a spawned task when dropped (a leg whose response is gone, the engine checks).
pub(crate) struct AbortOnDrop<T>(pub(crate) tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What a passed-through decode answer keeps of its request's legs until its body ends.
#[derive(Default)]
pub(crate) struct Legs {
    /// Legs still running (push's prefill leg), aborted if the body ends first.
    pub(crate) _tasks: Vec<AbortOnDrop<Result<(), LegError>>>,
    /// Has prefill free the KV it may still hold as the body ends.
    pub(crate) _release: Option<ReleaseOnDrop>,
}

/// What the body of a passed-through response holds on to until it ends.
struct Held {
    _in_flight: Option<InFlight>,
    _legs: Legs,
}

/// The final SSE event of a stream the router ends during shutdown.
fn shutdown_chunk() -> Bytes {
    let err = json!({"error": {"message": "the router is shutting down; the stream was ended",
        "type": "ServiceUnavailableError", "param": null, "code": 503}});
    Bytes::from(format!("data: {err}\n\ndata: [DONE]\n\n"))
}

/// The decode engine's response streamed to the client, holding the legs' guards until the
/// body ends or the client goes away. [`Router::abort_all`] ends it with an error event (SSE)
/// or by closing it.
pub(crate) fn passthrough(
    resp: reqwest::Response,
    in_flight: Option<InFlight>,
    legs: Legs,
    abort: tokio::sync::watch::Receiver<bool>,
) -> Response {
    let status = StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::OK);
    let mut out = Response::builder().status(status);
    for name in ["content-type", "x-request-id", "cache-control"] {
        if let Some(v) = resp.headers().get(name) {
            out = out.header(name, v.as_bytes());
        }
    }
    let sse = resp.headers().get("content-type").is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    let held = Held { _in_flight: in_flight, _legs: legs };
    let state = (Box::pin(resp.bytes_stream()), abort, Some(held));
    let body = futures::stream::unfold(state, move |(mut inner, mut abort, held)| async move {
        let held = held?;
        let next = tokio::select! {
            biased;
            item = inner.next() => Ok(item),
            // (`Ref` is not `Send`: keep only whether it came.)
            a = abort.wait_for(|a| *a) => Err(a.is_ok()),
        };
        let aborted = match next {
            // The answer came whole; dropping `held` has prefill free anything it still holds.
            Ok(None) => return None,
            Ok(Some(item)) => return Some((item, (inner, abort, Some(held)))),
            Err(aborted) => aborted,
        };
        if !aborted {
            // The router is gone: pass the rest through unwatched.
            return inner.next().await.map(|i| (i, (inner, abort, Some(held))));
        }
        drop(held);
        sse.then(|| (Ok(shutdown_chunk()), (inner, abort, None)))
    });
    out.body(Body::from_stream(body)).unwrap_or_else(|e| error(StatusCode::BAD_GATEWAY, e.to_string()))
}

/// What went wrong with a request to an engine, with its cause (reqwest's own message is
/// "error sending request for url", which hides whether the engine refused or timed out).
pub(crate) fn describe(e: &reqwest::Error) -> String {
    let kind = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "could not connect"
    } else if e.is_body() || e.is_decode() {
        "the answer broke off or could not be read"
    } else {
        "the request failed"
    };
    // The innermost cause is the one that says what happened ("Connection refused").
    let mut cause = None;
    let mut next = std::error::Error::source(e);
    while let Some(c) = next {
        cause = Some(c.to_string());
        next = c.source();
    }
    match cause {
        Some(c) if !c.is_empty() => format!("{kind}: {c}"),
        _ => kind.to_string(),
    }
}

/// An OpenAI-shaped error answer.
pub(crate) fn error(status: StatusCode, message: impl Into<String>) -> Response {
    let kind = match status.as_u16() {
        401 => "AuthenticationError",
        400..=499 => "BadRequestError",
        503 => "ServiceUnavailableError",
        _ => "BadGatewayError",
    };
    (status, Json(json!({"error": {"message": message.into(), "type": kind, "param": null, "code": status.as_u16()}})))
        .into_response()
}

/// A 400 naming the request's field at fault.
pub(crate) fn bad_request(param: &str, message: impl Into<String>) -> Response {
    let body = json!({"error": {"message": message.into(), "type": "BadRequestError", "param": param, "code": 400}});
    (StatusCode::BAD_REQUEST, Json(body)).into_response()
}

/// Frees prefill's KV for a transfer when its request ends, however it ended. Where the decode
/// engine took the KV, prefill has let it go already and finds nothing to free. But a decode
/// leg may end without it: the leg failed, the client went away first, or decode could not
/// reach prefill's KV side channel (a partitioned KV network; the router still reaches both)
/// and recomputed the prompt. Decode cannot tell prefill so, and prefill would hold the
/// prompt's blocks until its registration wait (push) or lease (pull) ran out: under load,
/// long enough to fill its KV pool and stall every request behind it (measured: 23 s with
/// two hosts cut apart for 35 s). The drop posts `/kv/release` without making anyone wait
/// for the answer.
pub(crate) struct ReleaseOnDrop {
    pub(crate) http: reqwest::Client,
    pub(crate) url: String,
    pub(crate) transfer_id: String,
}

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        // Dropped outside a runtime only when the router itself is going away.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        let req = self
            .http
            .post(format!("{}/kv/release", self.url))
            .json(&json!({"transfer_id": self.transfer_id}))
            .timeout(Duration::from_secs(5));
        let (url, tid) = (std::mem::take(&mut self.url), std::mem::take(&mut self.transfer_id));
        runtime.spawn(async move {
            match req.send().await {
                Ok(r) if r.status().is_success() => tracing::debug!(%url, transfer_id = %tid, "prefill KV released"),
                Ok(r) => {
                    tracing::warn!(%url, transfer_id = %tid, status = %r.status(), "prefill refused the KV release")
                }
                Err(e) => tracing::warn!(%url, transfer_id = %tid, error = %describe(&e), "KV release not delivered"),
            }
        });
    }
}
