//! A streamed answer whose engine dies mid-way, resumed on another engine.
//!
//! A request that is not streamed is simply tried again (nothing reached the client). A
//! streamed one has sent tokens already, so the router keeps what it passed on, each chunk's
//! token ids (chat chunks carry them when asked: the router asks) and the characters of its
//! text, and when the stream breaks before its last chunk (the connection reset, the engine's
//! error event) it routes the request again with those tokens as `resume_output_token_ids`:
//! the engine that takes it answers the whole output as one engine would have (the held-back
//! bytes of a split character, a stop string reaching back over the seam), and the router
//! leaves out of its chunks the tokens and characters the client has, keeping the first
//! answer's id. Greedy answers come out token for token as if nothing had failed; sampled ones
//! go on with fresh randomness.
//!
//! One choice. Logprobs go on: the engine that takes the request gives the new tokens' only,
//! their text offsets running on from what the client has.

use std::sync::Arc;

use axum::body::{Body, BodyDataStream};
use axum::http::HeaderMap;
use axum::response::Response;
use bytes::Bytes;
use futures::StreamExt;
use serde_json::{json, Map, Value};

use crate::answer::is_streamed;

/// What a resumable stream needs of the router (implemented by `crate::proxy::Router`, which
/// this module does not name, so that the dispatch can call it and not the other way round).
pub(crate) trait Reroute: Send + Sync + 'static {
    /// Routes a request, as the router routes a client's.
    fn reroute(
        self: Arc<Self>,
        path: &'static str,
        headers: HeaderMap,
        body: Map<String, Value>,
    ) -> futures::future::BoxFuture<'static, Response>;
    /// The router is ending every request: nothing is resumed.
    fn shutting_down(&self) -> bool;
    /// Counts a resumed stream.
    fn count_resume(&self);
}

/// Resumes of one request at most: an engine that fails every time is not the request's fault.
const MAX_RESUMES: usize = 3;

/// Whether a request's stream can be resumed (see the module docs).
pub(crate) fn resumable(path: &str, orig: &Map<String, Value>) -> bool {
    let absent = |k: &str| orig.get(k).is_none_or(|v| v.is_null() || *v == Value::Bool(false));
    matches!(path, "/v1/completions" | "/v1/chat/completions")
        && is_streamed(orig)
        && (absent("n") || orig.get("n").and_then(Value::as_i64) == Some(1))
        && absent("echo")
}

/// Has a chat stream's chunks carry their token ids; whether the client had not asked (the
/// router then takes them out again).
pub(crate) fn ask_token_ids(path: &str, orig: &mut Map<String, Value>) -> bool {
    if path != "/v1/chat/completions" || orig.get("return_token_ids") == Some(&Value::Bool(true)) {
        return false;
    }
    orig.insert("return_token_ids".into(), Value::Bool(true));
    true
}

/// The stream `resp` (the first answer to `orig`) passed to the client, resumed on another
/// engine if it breaks.
pub(crate) fn wrap(
    r: Arc<dyn Reroute>,
    path: &'static str,
    headers: HeaderMap,
    orig: Map<String, Value>,
    strip_ids: bool,
    resp: Response,
) -> Response {
    let (parts, body) = resp.into_parts();
    let state = Resuming {
        r,
        path,
        headers,
        orig,
        inner: Some(body.into_data_stream()),
        buf: Vec::new(),
        sent_ids: Vec::new(),
        sent_chars: 0,
        id: None,
        created: None,
        skip_ids: 0,
        skip_chars: 0,
        rewrite: false,
        strip_ids,
        chat: path == "/v1/chat/completions",
        finished: false,
        resumes: 0,
    };
    let body = futures::stream::unfold(state, |mut s| async move {
        let bytes = s.next_bytes().await?;
        Some((Ok::<_, std::convert::Infallible>(bytes), s))
    });
    Response::from_parts(parts, Body::from_stream(body))
}

/// A resumable stream's state: what the client has, and the answer now streaming.
struct Resuming {
    r: Arc<dyn Reroute>,
    path: &'static str,
    headers: HeaderMap,
    orig: Map<String, Value>,
    /// The answer now streaming; `None` once the client has its last byte.
    inner: Option<BodyDataStream>,
    /// Bytes of an event not yet whole.
    buf: Vec<u8>,
    /// What the client has been sent: token ids, and characters of text.
    sent_ids: Vec<u64>,
    sent_chars: usize,
    /// The first answer's `id` and `created`, which every chunk keeps.
    id: Option<Value>,
    created: Option<Value>,
    /// Of a resumed answer: its first tokens and characters, which the client has.
    skip_ids: usize,
    skip_chars: usize,
    /// Chunks are rewritten (a resumed answer): ids kept, what the client has left out.
    rewrite: bool,
    /// Chat chunks' token ids are taken out (the client did not ask for them).
    strip_ids: bool,
    chat: bool,
    /// A chunk with a finish reason went out: the answer is whole.
    finished: bool,
    resumes: usize,
}

/// What one SSE event from the engine comes to.
enum Event {
    /// Bytes for the client (none: the event carried nothing new).
    Pass(Option<Bytes>),
    /// `[DONE]`.
    Done(Bytes),
    /// The engine's error event: the answer broke off.
    Failed(Bytes),
}

impl Resuming {
    /// The next bytes for the client; `None` at the end.
    async fn next_bytes(&mut self) -> Option<Bytes> {
        loop {
            if let Some(end) = self.buf.windows(2).position(|w| w == b"\n\n") {
                let event: Vec<u8> = self.buf.drain(..end + 2).collect();
                match self.event(&event) {
                    Event::Pass(None) => continue,
                    Event::Pass(Some(bytes)) => return Some(bytes),
                    Event::Done(bytes) => {
                        self.inner = None;
                        return Some(bytes);
                    }
                    Event::Failed(error_event) => match self.resume().await {
                        Ok(()) => continue,
                        Err(()) => return self.end(error_event),
                    },
                }
            }
            let inner = self.inner.as_mut()?;
            match inner.next().await {
                Some(Ok(bytes)) => self.buf.extend_from_slice(&bytes),
                // The connection broke, or ended before `[DONE]`.
                Some(Err(_)) | None => {
                    let why = "the engine streaming the answer failed";
                    let error_event =
                        sse(&json!({"error": {"message": why, "type": "BadGatewayError", "param": null, "code": 502}}));
                    match self.resume().await {
                        Ok(()) => continue,
                        Err(()) => return self.end(error_event),
                    }
                }
            }
        }
    }

    /// The last bytes of a stream that could not be resumed: the error event (none when the
    /// answer was whole) and `[DONE]`.
    fn end(&mut self, error_event: Bytes) -> Option<Bytes> {
        self.inner = None;
        let done = Bytes::from_static(b"data: [DONE]\n\n");
        if self.finished {
            return Some(done);
        }
        Some([error_event, done].concat().into())
    }

    /// One whole event: tracked, and rewritten after a resume.
    fn event(&mut self, event: &[u8]) -> Event {
        let raw = || Bytes::copy_from_slice(event);
        let Some(data) = std::str::from_utf8(event).ok().and_then(|e| e.trim_end().strip_prefix("data: ")) else {
            return Event::Pass(Some(raw()));
        };
        if data == "[DONE]" {
            return Event::Done(raw());
        }
        let Ok(Value::Object(mut chunk)) = serde_json::from_str::<Value>(data) else { return Event::Pass(Some(raw())) };
        if chunk.contains_key("error") {
            return Event::Failed(raw());
        }
        if self.id.is_none() {
            self.id = chunk.get("id").cloned();
            self.created = chunk.get("created").cloned();
        }
        if self.rewrite {
            for (key, value) in [("id", &self.id), ("created", &self.created)] {
                if let Some(v) = value {
                    chunk.insert(key.into(), v.clone());
                }
            }
        }
        let Some(choice) = chunk.get_mut("choices").and_then(Value::as_array_mut).and_then(|c| c.first_mut()) else {
            // The usage chunk: it counts the whole output already.
            return Event::Pass(Some(if self.rewrite { sse(&Value::Object(chunk)) } else { raw() }));
        };
        let mut ids: Vec<u64> =
            choice.get("token_ids").and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_u64).collect();
        let text = if self.chat { choice["delta"]["content"].as_str() } else { choice["text"].as_str() };
        let mut text = text.unwrap_or_default().to_string();
        let finish = choice.get("finish_reason").is_some_and(|f| !f.is_null());
        if self.rewrite {
            let drop_ids = self.skip_ids.min(ids.len());
            ids.drain(..drop_ids);
            self.skip_ids -= drop_ids;
            let chars = text.chars().count();
            let drop_chars = self.skip_chars.min(chars);
            text = text.chars().skip(drop_chars).collect();
            self.skip_chars -= drop_chars;
            if ids.is_empty() && text.is_empty() && !finish {
                return Event::Pass(None);
            }
            choice["token_ids"] = json!(ids);
            if self.chat {
                // The client had the assistant's role with the first answer's first chunk.
                if let Some(delta) = choice.get_mut("delta").and_then(Value::as_object_mut) {
                    delta.remove("role");
                    delta.insert("content".into(), json!(text));
                }
            } else {
                choice["text"] = json!(text);
            }
        }
        if self.strip_ids {
            if let Some(c) = choice.as_object_mut() {
                c.remove("token_ids");
            }
        }
        self.sent_ids.extend_from_slice(&ids);
        self.sent_chars += text.chars().count();
        self.finished |= finish;
        Event::Pass(Some(if self.rewrite || self.strip_ids { sse(&Value::Object(chunk)) } else { raw() }))
    }

    /// Routes the request again after what the client has; Err when it cannot be.
    async fn resume(&mut self) -> Result<(), ()> {
        self.buf.clear();
        self.inner = None;
        if self.finished || self.resumes == MAX_RESUMES || self.r.shutting_down() {
            return Err(());
        }
        let Some(body) = continuation(&self.orig, self.chat, &self.sent_ids) else { return Err(()) };
        self.resumes += 1;
        let k = self.sent_ids.len();
        tracing::warn!(tokens = k, resume = self.resumes, "a streamed answer broke off; resuming it on another engine");
        let resp = self.r.clone().reroute(self.path, self.headers.clone(), body).await;
        let sse = resp.headers().get("content-type").is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
        if !resp.status().is_success() || !sse {
            tracing::warn!(status = %resp.status(), "the resumed request was not taken");
            return Err(());
        }
        self.r.count_resume();
        self.inner = Some(resp.into_body().into_data_stream());
        self.rewrite = true;
        self.skip_ids = k;
        self.skip_chars = self.sent_chars;
        Ok(())
    }
}

/// The request that goes on from what the client has: that output after the prompt, marked as
/// such, and the output's limits less what it has (a chat without a limit has the room its
/// context leaves, as before).
fn continuation(orig: &Map<String, Value>, chat: bool, sent_ids: &[u64]) -> Option<Map<String, Value>> {
    let count = |k: &str| orig.get(k).and_then(Value::as_i64).map(|n| n.max(0) as usize);
    let resumed_before = orig.get("resume_output_token_ids").and_then(Value::as_array).map_or(0, Vec::len);
    let k = sent_ids.len();
    let mut body = orig.clone();
    body.insert("resume_output_token_ids".into(), json!(sent_ids));
    let limit = ["max_completion_tokens", "max_tokens"].into_iter().find(|key| count(key).is_some());
    // A completion's default limit is 16, as the engine's.
    let max = limit.and_then(count).or((!chat).then_some(16));
    if let Some(max) = max {
        let left = (max + resumed_before).checked_sub(k).filter(|&n| n > 0)?;
        body.insert(limit.unwrap_or("max_tokens").into(), json!(left));
    }
    if let Some(min) = count("min_tokens") {
        body.insert("min_tokens".into(), json!((min + resumed_before).saturating_sub(k)));
    }
    Some(body)
}

/// One SSE data event.
fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}
