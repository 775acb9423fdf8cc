//! A streamed completion whose engine dies mid-answer, resumed on another engine.
//!
//! A request that is not streamed is simply tried again (nothing reached the client). A
//! streamed one has sent tokens already, so the router keeps what it passed on, each chunk's
//! `token_ids` and the characters of its text, and when the stream breaks before its last
//! chunk (the connection reset, the engine's error event) it routes the request again with
//! those tokens after the prompt and `resume_output_tokens` saying they are output: the engine
//! that takes it answers the whole output as one engine would have (the held-back bytes of a
//! split character, a stop string reaching back over the seam), and the router leaves out of
//! its chunks the tokens and characters the client has, keeping the first answer's id. Greedy
//! answers come out token for token as if nothing had failed; sampled ones go on with fresh
//! randomness.
//!
//! Completions only (chat chunks carry no token ids), one choice, no logprobs (the resumed
//! tokens' were computed by the engine that died).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, BodyDataStream};
use axum::http::HeaderMap;
use axum::response::Response;
use bytes::Bytes;
use futures::StreamExt;
use serde_json::{json, Map, Value};

use crate::answer::is_streamed;
use crate::proxy::{route, Router};

/// Resumes of one request at most: an engine that fails every time is not the request's fault.
const MAX_RESUMES: usize = 3;

/// Whether a request's stream can be resumed (see the module docs).
pub(crate) fn resumable(path: &str, orig: &Map<String, Value>) -> bool {
    let absent = |k: &str| orig.get(k).is_none_or(Value::is_null);
    path == "/v1/completions"
        && is_streamed(orig)
        && (absent("n") || orig.get("n").and_then(Value::as_i64) == Some(1))
        && absent("logprobs")
        && absent("echo")
        && (prompt_ids(orig).is_some() || prompt_text(orig).is_some())
}

/// A completion's prompt as token ids, when it is given as ids.
fn prompt_ids(orig: &Map<String, Value>) -> Option<Vec<u64>> {
    let ids = match orig.get("prompt")? {
        Value::Array(items) if items.len() == 1 && items[0].is_array() => items[0].as_array()?,
        Value::Array(items) => items,
        _ => return None,
    };
    ids.iter().map(Value::as_u64).collect()
}

/// A completion's prompt as text, when it is given as text.
fn prompt_text(orig: &Map<String, Value>) -> Option<&str> {
    match orig.get("prompt")? {
        Value::String(s) => Some(s),
        Value::Array(items) if items.len() == 1 => items[0].as_str(),
        _ => None,
    }
}

/// The stream `resp` (the first answer to `orig`) passed to the client, resumed on another
/// engine if it breaks.
pub(crate) fn wrap(
    r: Arc<Router>,
    path: &'static str,
    headers: HeaderMap,
    orig: Map<String, Value>,
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
    r: Arc<Router>,
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
        let mut text = choice.get("text").and_then(Value::as_str).unwrap_or_default().to_string();
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
            choice["text"] = json!(text);
        }
        self.sent_ids.extend_from_slice(&ids);
        self.sent_chars += text.chars().count();
        self.finished |= finish;
        Event::Pass(Some(if self.rewrite { sse(&Value::Object(chunk)) } else { raw() }))
    }

    /// Routes the request again after what the client has; Err when it cannot be.
    async fn resume(&mut self) -> Result<(), ()> {
        self.buf.clear();
        self.inner = None;
        if self.finished || self.resumes == MAX_RESUMES || self.r.aborting() {
            return Err(());
        }
        let Some(body) = continuation(&self.r, &self.orig, &self.sent_ids).await else { return Err(()) };
        self.resumes += 1;
        let k = self.sent_ids.len();
        tracing::warn!(tokens = k, resume = self.resumes, "a streamed answer broke off; resuming it on another engine");
        let resp = route(&self.r, self.path, &self.headers, &body).await;
        let sse = resp.headers().get("content-type").is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
        if !resp.status().is_success() || !sse {
            tracing::warn!(status = %resp.status(), "the resumed request was not taken");
            return Err(());
        }
        self.r.resumed_streams.fetch_add(1, Ordering::Relaxed);
        self.inner = Some(resp.into_body().into_data_stream());
        self.rewrite = true;
        self.skip_ids = k;
        self.skip_chars = self.sent_chars;
        Ok(())
    }
}

/// The request that goes on from what the client has: the prompt and the output so far as
/// the prompt, that output marked as such, the output's limits less what it has.
async fn continuation(r: &Router, orig: &Map<String, Value>, sent_ids: &[u64]) -> Option<Map<String, Value>> {
    let int = |k: &str| orig.get(k).and_then(Value::as_i64);
    let resumed_before = int("resume_output_tokens").unwrap_or(0).max(0) as usize;
    let mut prompt = match prompt_ids(orig) {
        Some(ids) => ids,
        None => tokenize(r, prompt_text(orig)?).await?,
    };
    prompt.truncate(prompt.len().checked_sub(resumed_before)?);
    let k = sent_ids.len();
    // As the engine's default for a completion.
    let max_tokens = int("max_tokens").unwrap_or(16).max(1) as usize + resumed_before;
    let left = max_tokens.checked_sub(k).filter(|&n| n > 0)?;
    let mut body = orig.clone();
    prompt.extend_from_slice(sent_ids);
    body.insert("prompt".into(), json!(prompt));
    body.insert("resume_output_tokens".into(), json!(k));
    body.insert("max_tokens".into(), json!(left));
    if let Some(min) = int("min_tokens") {
        body.insert("min_tokens".into(), json!((min.max(0) as usize + resumed_before).saturating_sub(k)));
    }
    Some(body)
}

/// A text prompt's token ids, from the first engine that answers (every engine of a
/// deployment serves the same model).
async fn tokenize(r: &Router, text: &str) -> Option<Vec<u64>> {
    for engine in r.decode.list().iter().chain(r.prefill.list().iter()) {
        let req = r.http.post(format!("{}/tokenize", engine.url)).json(&json!({"prompt": text}));
        let Ok(resp) = req.timeout(Duration::from_secs(5)).send().await else { continue };
        if let Ok(v) = resp.json::<Value>().await {
            if let Some(ids) = v["tokens"].as_array().and_then(|t| t.iter().map(Value::as_u64).collect()) {
                return Some(ids);
            }
        }
    }
    None
}

/// One SSE data event.
fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}
