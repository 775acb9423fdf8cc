//! The path every generation request takes: validate, build an engine request, then stream
//! SSE chunks or collect one response. Completions and chat differ only in how the prompt is
//! built and how chunks are shaped ([`Api`]).

use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures::stream::Stream;
use tandem_core::{
    FinishReason, InvalidSampling, KvTransferParams, RemoteKv, RequestId, SamplingParams, TokenLogprobs, TransferMode,
};
use tandem_engine::{EngineEvent, EngineRequest, KvLoadTimeline, RequestStream};
use tandem_model::{ChatMessage, IncrementalDetokenizer, StopMatcher, TextTokenizer};
use tokio::sync::mpsc;

use crate::protocol::*;
use crate::{ApiError, AppState};

/// A validated request, ready for the engine.
pub(crate) struct Prepared {
    api: Api,
    request_id: RequestId,
    prompt_ids: Vec<u32>,
    params: SamplingParams,
    stops: Vec<String>,
    stream: bool,
    include_usage: bool,
    remote: Option<RemoteKv>,
    /// Output from before a resume (`resume_output_token_ids`), after the prompt in `prompt_ids`.
    resumed: Vec<u32>,
    /// Chat chunks carry their token ids (`return_token_ids`).
    return_token_ids: bool,
}

pub(crate) fn check_model(state: &AppState, model: &Option<String>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != &state.model_name => Err(ApiError::ModelNotFound(m.clone())),
        _ => Ok(()),
    }
}

pub(crate) fn prepare_completion(
    state: &AppState,
    req: CompletionRequest,
    request_id: RequestId,
) -> Result<Prepared, ApiError> {
    check_model(state, &req.model)?;
    if req.echo == Some(true) {
        return Err(ApiError::bad("echo", "echo is not supported: send the prompt's text along yourself"));
    }
    let prompt_ids = completion_prompt_ids(state, req.prompt)?;
    prepare(state, Api::Completion, request_id, prompt_ids, req.sampling, Some(16))
}

/// A completion's prompt as token ids.
pub(crate) fn completion_prompt_ids(state: &AppState, prompt: Prompt) -> Result<Vec<u32>, ApiError> {
    Ok(match prompt {
        Prompt::Text(text) => state.tokenizer()?.encode(&text, true)?,
        Prompt::Ids(ids) => ids,
        Prompt::Texts(mut v) if v.len() == 1 => state.tokenizer()?.encode(&v.remove(0), true)?,
        Prompt::IdLists(mut v) if v.len() == 1 => v.remove(0),
        _ => return Err(ApiError::bad("prompt", "batched prompts are not supported: send one prompt per request")),
    })
}

/// A chat's prompt as token ids: the messages rendered with the chat template.
pub(crate) fn chat_prompt_ids(
    state: &AppState,
    messages: Vec<ChatMessageIn>,
    add_generation_prompt: Option<bool>,
) -> Result<Vec<u32>, ApiError> {
    let tok = state.tokenizer()?;
    let text = tok.apply_chat_template(&chat_messages(messages)?, add_generation_prompt.unwrap_or(true))?;
    Ok(tok.encode(&text, false)?)
}

pub(crate) fn chat_messages(messages: Vec<ChatMessageIn>) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad("messages", "messages must not be empty"));
    }
    messages
        .into_iter()
        .map(|m| {
            let content = match m.content {
                None => String::new(),
                Some(MessageContent::Text(t)) => t,
                Some(MessageContent::Parts(parts)) => {
                    let mut text = String::new();
                    for p in parts {
                        match (p.kind.as_str(), p.text) {
                            ("text", Some(t)) => text.push_str(&t),
                            (kind, _) => {
                                return Err(ApiError::bad(
                                    "messages",
                                    format!("content part type `{kind}` is not supported (text only)"),
                                ))
                            }
                        }
                    }
                    text
                }
            };
            Ok(ChatMessage { role: m.role, content })
        })
        .collect()
}

pub(crate) fn prepare_chat(
    state: &AppState,
    req: ChatCompletionRequest,
    request_id: RequestId,
) -> Result<Prepared, ApiError> {
    check_model(state, &req.model)?;
    let prompt_ids = chat_prompt_ids(state, req.messages, req.add_generation_prompt)?;
    prepare(state, Api::Chat, request_id, prompt_ids, req.sampling, None)
}

/// Turns the OpenAI sampling fields into engine parameters. `default_max_tokens` of `None`
/// means "whatever room the context leaves", as vLLM does for chat.
fn prepare(
    state: &AppState,
    api: Api,
    request_id: RequestId,
    mut prompt_ids: Vec<u32>,
    f: SamplingFields,
    default_max_tokens: Option<usize>,
) -> Result<Prepared, ApiError> {
    let defaults = &state.sampling_defaults;
    let resumed = f.resume_output_token_ids.unwrap_or_default();
    prompt_ids.extend_from_slice(&resumed);
    if let Some(n) = f.n {
        if n != 1 {
            return Err(ApiError::bad("n", format!("only n=1 is supported, got {n}")));
        }
    }
    let max_tokens = match f.max_completion_tokens.or(f.max_tokens) {
        Some(m) if m < 1 => return Err(ApiError::bad("max_tokens", format!("max_tokens must be at least 1, got {m}"))),
        Some(m) => m as usize,
        None => {
            let room =
                default_max_tokens.unwrap_or_else(|| state.max_model_len.saturating_sub(prompt_ids.len()).max(1));
            // The model's max_new_tokens caps the API's default, as in vLLM.
            defaults.max_tokens.map_or(room, |m| m.min(room))
        }
    };
    let min_tokens = match f.min_tokens {
        Some(m) if m < 0 => return Err(ApiError::bad("min_tokens", format!("min_tokens must be >= 0, got {m}"))),
        Some(m) => m as usize,
        None => 0,
    };
    let top_k = match f.top_k.or(defaults.top_k) {
        None | Some(-1) | Some(0) => None,
        Some(k) if k < -1 => {
            return Err(ApiError::bad("top_k", format!("top_k must be -1 (disabled) or at least 1, got {k}")))
        }
        Some(k) => Some(k.min(u32::MAX as i64) as u32),
    };
    if f.prompt_logprobs.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(ApiError::bad(
            "prompt_logprobs",
            "prompt_logprobs is not supported: the engines compute logits for generated tokens only",
        ));
    }
    let logprobs = crate::logprobs::requested(api, f.logprobs.as_ref(), f.top_logprobs)?;
    let params = SamplingParams {
        logprobs,
        temperature: f.temperature.or(defaults.temperature).unwrap_or(1.0) as f32,
        top_p: f.top_p.or(defaults.top_p).unwrap_or(1.0) as f32,
        top_k,
        seed: f.seed.map(|s| s as u64),
        max_tokens,
        min_tokens,
        ignore_eos: f.ignore_eos.unwrap_or(false),
        stop_token_ids: f.stop_token_ids.unwrap_or_default(),
    };
    params.validate().map_err(|e| {
        let param = match e {
            InvalidSampling::Temperature(_) => "temperature",
            InvalidSampling::TopP(_) => "top_p",
            InvalidSampling::TopK => "top_k",
            InvalidSampling::MaxTokens => "max_tokens",
            InvalidSampling::Logprobs(_) => "logprobs",
            _ => "min_tokens",
        };
        ApiError::bad(param, e.to_string())
    })?;
    let stops = match f.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    if !stops.is_empty() && state.tokenizer.is_none() {
        return Err(ApiError::bad(
            "stop",
            "stop strings need a tokenizer; this model runs in token-ids mode (use stop_token_ids)",
        ));
    }
    let stream = f.stream.unwrap_or(false);
    let include_usage = f.stream_options.map(|o| o.include_usage).unwrap_or(false);
    let remote = match f.kv_transfer_params {
        None | Some(serde_json::Value::Null) => None,
        Some(v) => {
            let params: KvTransferParams = serde_json::from_value(v)
                .map_err(|e| ApiError::bad("kv_transfer_params", format!("invalid kv_transfer_params: {e}")))?;
            let mode = state.kv_mode().unwrap_or(TransferMode::Push);
            params.resolve(mode).map_err(|e| ApiError::bad("kv_transfer_params", e))?
        }
    };
    let return_token_ids = f.return_token_ids.unwrap_or(false);
    Ok(Prepared {
        api,
        request_id,
        prompt_ids,
        params,
        stops,
        stream,
        include_usage,
        remote,
        resumed,
        return_token_ids,
    })
}

/// One step of output, after detokenizing and stop strings.
struct Piece {
    text: String,
    token_ids: Vec<u32>,
    /// The tokens' log-probabilities, when the request asked for them (else empty).
    logprobs: Vec<TokenLogprobs>,
    finish: Option<FinishReason>,
}

/// Counts a generation in [`AppState::in_flight`] while it lives.
struct InFlight(Arc<AppState>);

impl InFlight {
    /// Counts one more generation, unless as many as the server takes are in flight.
    fn admit(state: Arc<AppState>) -> Result<Self, ApiError> {
        let limit = state.max_in_flight;
        let counted = state.in_flight.fetch_update(
            std::sync::atomic::Ordering::SeqCst,
            std::sync::atomic::Ordering::SeqCst,
            |n| (limit == 0 || n < limit).then_some(n + 1),
        );
        match counted {
            Ok(_) => Ok(Self(state)),
            Err(_) => Err(ApiError::Overloaded { limit }),
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// The next engine event, or `Err` once [`AppState::abort_all`] ended every generation.
async fn next_event(
    stream: &mut RequestStream,
    abort: &mut tokio::sync::watch::Receiver<bool>,
) -> Result<Option<EngineEvent>, ApiError> {
    let aborted = tokio::select! {
        biased;
        ev = stream.next() => return Ok(ev),
        // (`Ref` is not `Send`: keep only whether it came.)
        aborted = abort.wait_for(|a| *a) => aborted.is_ok(),
    };
    if aborted {
        return Err(ApiError::ShuttingDown);
    }
    // The state is gone, so nobody can abort any more: wait for the engine alone.
    Ok(stream.next().await)
}

/// Drives one request's engine stream and turns tokens into text.
struct Generation {
    state: Arc<AppState>,
    _in_flight: InFlight,
    abort: tokio::sync::watch::Receiver<bool>,
    stream: Option<RequestStream>,
    detok: IncrementalDetokenizer,
    stops: StopMatcher,
    start: Instant,
    first_token: Option<Instant>,
    prompt_tokens: usize,
    output_tokens: usize,
    /// Output tokens from before a resume, put in front of the first tokens the engine gives.
    resumed: Vec<u32>,
    /// Prefill leg: where the prompt's KV went (for the response's `kv_transfer_params`).
    produced: Option<Produced>,
    /// Decode leg: how the prompt's KV arrived.
    kv_timeline: Option<KvLoadTimeline>,
}

/// The engine's `KvProduced` event, kept for the response.
struct Produced {
    transfer_id: tandem_core::TransferId,
    block_ids: Vec<u32>,
    num_tokens: usize,
    first_token: u32,
}

impl Generation {
    /// The next piece; `None` after the last. Cancel safe: the only awaits are the engine
    /// stream's `next`, which keeps undelivered events queued, and the abort watch.
    async fn next_piece(&mut self) -> Option<Result<Piece, ApiError>> {
        let stream = self.stream.as_mut()?;
        let mut event = match next_event(stream, &mut self.abort).await {
            Ok(ev) => ev,
            Err(e) => return Some(Err(self.fail(e))),
        };
        loop {
            match event {
                Some(EngineEvent::KvProduced { transfer_id, block_ids, num_tokens, first_token }) => {
                    self.produced = Some(Produced { transfer_id, block_ids, num_tokens, first_token });
                }
                Some(EngineEvent::KvLoaded { timeline }) => {
                    self.state.metrics.record_kv_load(&timeline);
                    self.kv_timeline = Some(timeline);
                }
                _ => break,
            }
            event = match next_event(stream, &mut self.abort).await {
                Ok(ev) => ev,
                Err(e) => return Some(Err(self.fail(e))),
            };
        }
        Some(match event {
            Some(EngineEvent::Tokens { mut token_ids, finish, logprobs }) => {
                if self.first_token.is_none() && !token_ids.is_empty() {
                    self.first_token = Some(Instant::now());
                }
                self.state.metrics.record_generated(token_ids.len());
                if !self.resumed.is_empty() {
                    // Detokenized and matched against the stops as if generated here.
                    token_ids.splice(0..0, std::mem::take(&mut self.resumed));
                }
                self.output_tokens += token_ids.len();
                let mut text = String::new();
                let mut finish = finish;
                if let Some(tok) = self.state.tokenizer.as_deref() {
                    let detok = &mut self.detok;
                    let delta = detok.push(tok, &token_ids).and_then(|mut d| {
                        if finish.is_some() {
                            // The last token may leave a character incomplete: send what is held.
                            d.push_str(&detok.finish(tok)?);
                        }
                        Ok(d)
                    });
                    let delta = match delta {
                        Ok(d) => d,
                        Err(e) => return Some(Err(self.fail(ApiError::Internal(e.to_string())))),
                    };
                    let out = self.stops.feed(&delta);
                    text = out.emit;
                    if out.stopped {
                        finish = Some(FinishReason::Stop);
                    } else if finish.is_some() {
                        text.push_str(&self.stops.flush());
                    }
                }
                if let Some(reason) = finish {
                    // Dropping the engine stream aborts the request if it is still running
                    // (a stop string matched before the engine's own stop).
                    self.stream = None;
                    let e2e = self.start.elapsed().as_secs_f64();
                    let ttft = self.first_token.map(|t| (t - self.start).as_secs_f64());
                    self.state.metrics.record_finished(reason.as_str(), ttft, e2e, self.output_tokens);
                }
                Ok(Piece { text, token_ids, logprobs, finish })
            }
            Some(EngineEvent::Failed(msg)) => Err(self.fail(ApiError::Internal(msg))),
            Some(EngineEvent::QueueTimeout { waited_ms, bound_ms }) => {
                Err(self.fail(ApiError::QueueTimeout { waited_ms, bound_ms }))
            }
            Some(EngineEvent::KvProduced { .. } | EngineEvent::KvLoaded { .. }) => {
                Ok(Piece { text: String::new(), token_ids: Vec::new(), logprobs: Vec::new(), finish: None })
            }
            None => Err(self.fail(ApiError::EngineStopped)),
        })
    }

    /// Ends the generation with an error (counted by whoever reports it to the client).
    fn fail(&mut self, e: ApiError) -> ApiError {
        self.stream = None;
        e
    }

    fn usage(&self) -> Usage {
        Usage::new(self.prompt_tokens, self.output_tokens)
    }

    /// The prefill leg's answer for the decode leg, in vLLM's field names (plus tandem's).
    fn kv_transfer_params(&self) -> Option<KvTransferParams> {
        let p = self.produced.as_ref()?;
        let info = self.state.engine.kv_info()?;
        let addr = info.tcp_addr()?.to_string();
        let (host, port) = addr.rsplit_once(':')?;
        let tid = p.transfer_id.0.clone();
        Some(match info.kv_mode {
            tandem_kv::KvMode::Pull => KvTransferParams {
                do_remote_prefill: true,
                do_remote_decode: false,
                remote_engine_id: Some(info.engine_id.0.clone()),
                remote_block_ids: Some(p.block_ids.clone()),
                remote_host: Some(host.trim_matches(|c| c == '[' || c == ']').to_string()),
                remote_port: port.parse().ok(),
                remote_request_id: Some(tid.clone()),
                tp_size: Some(info.tp_size),
                pp_size: Some(1),
                transfer_id: Some(tid),
                remote_epoch: Some(info.epoch.0),
                remote_num_tokens: Some(p.num_tokens),
                first_token_id: Some(p.first_token),
            },
            tandem_kv::KvMode::Push => KvTransferParams {
                transfer_id: Some(tid),
                remote_engine_id: Some(info.engine_id.0.clone()),
                first_token_id: Some(p.first_token),
                ..Default::default()
            },
        })
    }
}

fn now_unix() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// Submits a prepared request and answers it, streaming or not.
pub(crate) async fn run(state: Arc<AppState>, p: Prepared) -> Result<Response, ApiError> {
    let abort = state.abort.subscribe();
    if *abort.borrow() {
        return Err(ApiError::ShuttingDown);
    }
    let in_flight = InFlight::admit(state.clone())?;
    let prompt_tokens = p.prompt_ids.len() - p.resumed.len();
    let engine_stream = state.engine.submit(EngineRequest {
        id: p.request_id.clone(),
        prompt_token_ids: p.prompt_ids,
        params: p.params,
        remote: p.remote,
    })?;
    state.metrics.record_admitted(prompt_tokens);
    tracing::debug!(request_id = %p.request_id, prompt_tokens, stream = p.stream, "admitted");
    let gen = Generation {
        state: state.clone(),
        _in_flight: in_flight,
        abort,
        stream: Some(engine_stream),
        detok: IncrementalDetokenizer::new(),
        stops: StopMatcher::new(p.stops),
        start: Instant::now(),
        first_token: None,
        prompt_tokens,
        output_tokens: 0,
        resumed: p.resumed,
        produced: None,
        kv_timeline: None,
    };
    let shape = ChunkShape {
        api: p.api,
        id: match p.api {
            Api::Completion => format!("cmpl-{}", p.request_id),
            Api::Chat => format!("chatcmpl-{}", p.request_id),
        },
        created: now_unix(),
        model: state.model_name.clone(),
        return_token_ids: p.return_token_ids,
    };
    if p.stream {
        Ok(Sse::new(sse_events(gen, shape, p.include_usage)).into_response())
    } else {
        collect(gen, shape).await
    }
}

/// Fields every chunk of one response shares.
struct ChunkShape {
    api: Api,
    id: String,
    created: u64,
    model: String,
    /// Chat chunks carry their token ids.
    return_token_ids: bool,
}

impl ChunkShape {
    /// One SSE chunk of `piece`; `text_offset` (characters streamed so far) places its
    /// tokens' log-probabilities.
    fn chunk(
        &self,
        piece: &Piece,
        first: bool,
        kv_timeline: Option<KvLoadTimeline>,
        tokenizer: Option<&TextTokenizer>,
        text_offset: &mut usize,
    ) -> serde_json::Result<String> {
        let finish_reason = piece.finish.map(|f| f.as_str().to_string());
        let logprobs = crate::logprobs::to_json(self.api, tokenizer, &piece.token_ids, &piece.logprobs, text_offset);
        match self.api {
            Api::Completion => serde_json::to_string(&CompletionResponse {
                id: self.id.clone(),
                object: "text_completion".into(),
                created: self.created,
                model: self.model.clone(),
                choices: vec![CompletionChoice {
                    index: 0,
                    text: piece.text.clone(),
                    logprobs,
                    finish_reason,
                    token_ids: piece.token_ids.clone(),
                }],
                usage: None,
                kv_transfer_params: None,
                kv_timeline,
            }),
            Api::Chat => serde_json::to_string(&ChatChunk {
                id: self.id.clone(),
                object: "chat.completion.chunk".into(),
                created: self.created,
                model: self.model.clone(),
                choices: vec![ChatChunkChoice {
                    index: 0,
                    delta: ChatDelta {
                        role: first.then(|| "assistant".to_string()),
                        content: Some(piece.text.clone()),
                    },
                    logprobs,
                    finish_reason,
                    token_ids: self.return_token_ids.then(|| piece.token_ids.clone()),
                }],
                usage: None,
                kv_timeline,
            }),
        }
    }

    fn usage_chunk(&self, usage: Usage) -> serde_json::Result<String> {
        match self.api {
            Api::Completion => serde_json::to_string(&CompletionResponse {
                id: self.id.clone(),
                object: "text_completion".into(),
                created: self.created,
                model: self.model.clone(),
                choices: Vec::new(),
                usage: Some(usage),
                kv_transfer_params: None,
                kv_timeline: None,
            }),
            Api::Chat => serde_json::to_string(&ChatChunk {
                id: self.id.clone(),
                object: "chat.completion.chunk".into(),
                created: self.created,
                model: self.model.clone(),
                choices: Vec::new(),
                usage: Some(usage),
                kv_timeline: None,
            }),
        }
    }
}

/// SSE events for one request. A task drives the generation and feeds a channel; the HTTP
/// body reads it. When the client goes away the body (and the channel's receiver) is dropped;
/// the task notices at once, even mid-prefill, and drops the engine stream, which aborts the
/// request and frees its blocks.
fn sse_events(
    mut gen: Generation,
    shape: ChunkShape,
    include_usage: bool,
) -> impl Stream<Item = Result<Event, std::convert::Infallible>> {
    let (tx, rx) = mpsc::channel::<Event>(64);
    tokio::spawn(async move {
        let mut first = true;
        let mut text_offset = 0;
        loop {
            let piece = tokio::select! {
                p = gen.next_piece() => p,
                _ = tx.closed() => return,
            };
            let event = match piece {
                None => break,
                Some(Ok(piece)) => {
                    // An empty interim piece (text held back, no finish) carries no news.
                    if piece.token_ids.is_empty() && piece.finish.is_none() {
                        continue;
                    }
                    let timeline = if piece.finish.is_some() { gen.kv_timeline } else { None };
                    let tokenizer = gen.state.tokenizer.clone();
                    match shape.chunk(&piece, first, timeline, tokenizer.as_deref(), &mut text_offset) {
                        Ok(json) => Event::default().data(json),
                        Err(e) => Event::default().data(ApiError::Internal(e.to_string()).body().to_string()),
                    }
                }
                Some(Err(e)) => {
                    // Headers are already sent: the error travels as a data chunk.
                    gen.state.metrics.record_error(e.error_type());
                    Event::default().data(e.body().to_string())
                }
            };
            first = false;
            if tx.send(event).await.is_err() {
                return;
            }
        }
        if include_usage {
            if let Ok(json) = shape.usage_chunk(gen.usage()) {
                let _ = tx.send(Event::default().data(json)).await;
            }
        }
        let _ = tx.send(Event::default().data("[DONE]")).await;
    });
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|e| (Ok(e), rx)) })
}

/// Collects the whole answer. If the client disconnects, the server drops this future and
/// with it the engine stream, which aborts the request.
async fn collect(mut gen: Generation, shape: ChunkShape) -> Result<Response, ApiError> {
    let mut text = String::new();
    let mut token_ids = Vec::new();
    let mut lps = Vec::new();
    let mut finish = None;
    while let Some(piece) = gen.next_piece().await {
        let piece = piece?;
        text.push_str(&piece.text);
        token_ids.extend(piece.token_ids);
        lps.extend(piece.logprobs);
        finish = piece.finish.or(finish);
    }
    let logprobs = crate::logprobs::to_json(shape.api, gen.state.tokenizer.as_deref(), &token_ids, &lps, &mut 0);
    let finish_reason = finish.map(|f| f.as_str().to_string());
    let usage = gen.usage();
    let kv_transfer_params = gen.kv_transfer_params();
    Ok(match shape.api {
        Api::Completion => axum::Json(CompletionResponse {
            id: shape.id,
            object: "text_completion".into(),
            created: shape.created,
            model: shape.model,
            choices: vec![CompletionChoice { index: 0, text, logprobs, finish_reason, token_ids }],
            usage: Some(usage),
            kv_transfer_params,
            kv_timeline: gen.kv_timeline,
        })
        .into_response(),
        Api::Chat => axum::Json(ChatResponse {
            id: shape.id,
            object: "chat.completion".into(),
            created: shape.created,
            model: shape.model,
            choices: vec![ChatChoice {
                index: 0,
                message: ChatMessageOut { role: "assistant".into(), content: text },
                logprobs,
                finish_reason,
            }],
            usage,
            kv_transfer_params,
            kv_timeline: gen.kv_timeline,
        })
        .into_response(),
    })
}
