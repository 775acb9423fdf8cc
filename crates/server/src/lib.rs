//! The OpenAI-compatible HTTP API in front of one tandem engine.
//!
//! # Brief overview
//! [`AppState`] holds an [`EngineHandle`](tandem_engine::EngineHandle) (the only way in to the
//! engine), the tokenizer, the served model name and the [`Metrics`]. [`router`] builds the
//! axum routes and [`serve`] runs them:
//!
//! | route | what |
//! |---|---|
//! | `POST /v1/completions` | text or token-id prompts; streaming (SSE) or not |
//! | `POST /v1/chat/completions` | messages through the model's chat template |
//! | `GET /v1/models` | the served model |
//! | `GET /health` | 200 while the engine thread runs, 503 after |
//! | `GET /metrics` | Prometheus text |
//! | `POST /tokenize`, `POST /detokenize` | the model's tokenizer |
//! | `GET /kv/info` | the KV side channel of a prefill or decode engine and its open connections with their transports (404 colocated) |
//! | `POST /kv/release` | prefill: free the KV held for a transfer no decode will take |
//! | `POST /kv/prefix` | how much of a completion's or chat's prompt the prefix cache holds (for routing) |
//! | `GET /kv/prove` | with a cluster secret: the proof that answers a router's challenge (open: it reveals nothing) |
//!
//! Text lives here: prompts are tokenized and outputs detokenized (with stop strings) in the
//! handlers; the engine sees only token ids. Errors are OpenAI-shaped JSON ([`ApiError`]).
//! A client that disconnects cancels its request: the engine stream is dropped with the
//! response, which aborts the request and frees its KV blocks.
#![deny(missing_docs)]

mod error;
mod generate;
mod logprobs;
mod metrics;
pub mod protocol;

use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde_json::json;
use tandem_core::{ApiKeys, RequestId};
use tandem_engine::EngineHandle;
use tandem_model::TextTokenizer;

pub use error::ApiError;
pub use metrics::Metrics;

use protocol::{ChatCompletionRequest, CompletionRequest, DetokenizeRequest, PrefixRequest, TokenizeRequest};

/// Everything the handlers share.
pub struct AppState {
    /// The engine.
    pub engine: EngineHandle,
    /// `None` in token-ids mode.
    pub tokenizer: Option<Arc<TextTokenizer>>,
    /// The name clients must use in `model` (or omit).
    pub model_name: String,
    /// Longest prompt + output.
    pub max_model_len: usize,
    /// What a request that leaves a sampling field out gets instead of the API's default (the
    /// model's generation_config.json, unless `--generation-config vllm`).
    pub sampling_defaults: tandem_model::GenerationDefaults,
    /// Prometheus metrics.
    pub metrics: Metrics,
    next_id: AtomicU64,
    /// Random per-process prefix so ids do not repeat across restarts.
    id_prefix: String,
    /// Generation requests being answered now.
    in_flight: AtomicUsize,
    /// Most generations answered at once (0: no bound); more get a 429.
    max_in_flight: usize,
    /// Set once by [`AppState::abort_all`]; every generation watches it.
    abort: tokio::sync::watch::Sender<bool>,
    /// Keys the OpenAI routes (`/v1/*`, `/tokenize`, `/detokenize`) take; none: open.
    api_keys: ApiKeys,
    /// `/metrics` takes them too.
    metrics_need_key: bool,
    /// The deployment's secret: the KV endpoints (`/kv/*`) answer only its token
    /// ([`tandem_core::CLUSTER_TOKEN_HEADER`]); none: open.
    cluster_secret: Option<tandem_core::ClusterSecret>,
    /// Set when the engine starts to shut down: `/health` answers 503 "draining" from then on,
    /// so routers (and Kubernetes) send it nothing new while it finishes what it has.
    draining: std::sync::atomic::AtomicBool,
}

impl AppState {
    /// State for one engine.
    pub fn new(engine: EngineHandle, tokenizer: Option<Arc<TextTokenizer>>, model_name: String) -> Self {
        let max_model_len = engine.limits().max_model_len;
        Self {
            engine,
            tokenizer,
            model_name,
            max_model_len,
            sampling_defaults: Default::default(),
            metrics: Metrics::new(),
            next_id: AtomicU64::new(0),
            id_prefix: format!("{:08x}", rand::random::<u32>()),
            in_flight: AtomicUsize::new(0),
            draining: std::sync::atomic::AtomicBool::new(false),
            max_in_flight: 0,
            abort: tokio::sync::watch::Sender::new(false),
            api_keys: ApiKeys::default(),
            metrics_need_key: false,
            cluster_secret: None,
        }
    }

    /// The KV endpoints (`/kv/info`, `/kv/release`, `/kv/prefix`: what the router asks of an
    /// engine) answer only requests carrying `secret`'s token in
    /// [`tandem_core::CLUSTER_TOKEN_HEADER`] (401 otherwise, counted).
    pub fn with_cluster_secret(mut self, secret: Option<tandem_core::ClusterSecret>) -> Self {
        self.cluster_secret = secret;
        self
    }

    /// The OpenAI routes answer only requests with one of `keys` as `Authorization: Bearer`
    /// (401 otherwise); `/health`, `/metrics` and the KV endpoints stay as they are.
    pub fn with_api_keys(mut self, keys: ApiKeys) -> Self {
        self.api_keys = keys;
        self
    }

    /// `/metrics` answers only with one of the API keys too (it names the model and shows the
    /// load; open by default, as Prometheus scrapers expect).
    pub fn with_metrics_needing_key(mut self, on: bool) -> Self {
        self.metrics_need_key = on;
        self
    }

    /// Answers at most `limit` generations at once (running and queued; 0: no bound): past it a
    /// request gets a 429 with `Retry-After` at once, instead of a queue that grows without
    /// limit.
    pub fn with_max_in_flight(mut self, limit: usize) -> Self {
        self.max_in_flight = limit;
        self
    }

    /// Requests that leave a sampling field out get `defaults`' value for it (see
    /// [`tandem_model::GenerationDefaults`]).
    pub fn with_sampling_defaults(mut self, defaults: tandem_model::GenerationDefaults) -> Self {
        self.sampling_defaults = defaults;
        self
    }

    /// Generation requests being answered now (streams included).
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// Marks the engine as shutting down (`/health` answers 503 "draining"); requests in
    /// flight go on.
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::SeqCst);
    }

    /// Ends every generation now, for a bounded shutdown: a stream gets a final error chunk,
    /// a waiting client a 503, and each engine request is aborted (its blocks freed). New
    /// requests are refused with 503 from here on.
    pub fn abort_all(&self) {
        self.abort.send_replace(true);
    }

    /// The engine's KV transfer mode, when it has a connector.
    pub(crate) fn kv_mode(&self) -> Option<tandem_core::TransferMode> {
        self.engine.kv_info().map(|i| match i.kv_mode {
            tandem_kv::KvMode::Push => tandem_core::TransferMode::Push,
            tandem_kv::KvMode::Pull => tandem_core::TransferMode::Pull,
        })
    }

    pub(crate) fn tokenizer(&self) -> Result<&TextTokenizer, ApiError> {
        self.tokenizer.as_deref().ok_or_else(|| {
            ApiError::bad(
                "prompt",
                "this model has no tokenizer (token-ids mode): send the prompt as a list of token ids",
            )
        })
    }

    /// A fresh engine-unique request id.
    fn new_request_id(&self) -> RequestId {
        RequestId::new(format!("{}-{}", self.id_prefix, self.next_id.fetch_add(1, Ordering::Relaxed)))
    }
}

/// The API routes over `state`.
pub fn router(state: Arc<AppState>) -> Router {
    let keyed = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize));
    let (keyed, open) = match state.metrics_need_key {
        true => (keyed.route("/metrics", get(metrics_text)), Router::new()),
        false => (keyed, Router::new().route("/metrics", get(metrics_text))),
    };
    let keyed = keyed.route_layer(axum::middleware::from_fn_with_state(state.clone(), require_api_key));
    let internal = Router::new()
        .route("/kv/info", get(kv_info))
        .route("/kv/release", post(kv_release))
        .route("/kv/prefix", post(kv_prefix))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), require_cluster_token));
    Router::new()
        .merge(keyed)
        .merge(open)
        .merge(internal)
        .route("/kv/prove", get(prove_membership))
        .route("/health", get(health))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(axum::middleware::map_response(json_body_limit))
        .with_state(state)
}

/// Lets a request through to the OpenAI routes only with one of the server's API keys.
async fn require_api_key(
    State(state): State<Arc<AppState>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let header = req.headers().get(axum::http::header::AUTHORIZATION).map(|v| v.as_bytes());
    if state.api_keys.allows(header) {
        return next.run(req).await;
    }
    let refused = ApiError::Unauthorized;
    state.metrics.record_error(refused.error_type());
    refused.into_response()
}

/// Lets a request through to the KV endpoints only with the cluster secret's token, when the
/// engine has a secret.
async fn require_cluster_token(
    State(state): State<Arc<AppState>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let Some(secret) = &state.cluster_secret else { return next.run(req).await };
    if secret.allows_token(req.headers().get(tandem_core::CLUSTER_TOKEN_HEADER).map(|v| v.as_bytes())) {
        return next.run(req).await;
    }
    let refused = ApiError::NotClusterMember;
    state.metrics.record_error(refused.error_type());
    refused.into_response()
}

/// `GET /kv/prove` with a challenge (8 to 128 bytes) in [`tandem_core::CLUSTER_CHALLENGE_HEADER`]:
/// `{"proof": ...}`, the keyed hash of it that only a holder of the cluster secret can make; 404
/// without a secret. Open to all: the answer serves only the challenger.
async fn prove_membership(State(state): State<Arc<AppState>>, headers: axum::http::HeaderMap) -> Response {
    let Some(secret) = &state.cluster_secret else {
        return (StatusCode::NOT_FOUND, Json(json!({"error": "this engine has no --cluster-secret-file"})))
            .into_response();
    };
    let challenge = headers.get(tandem_core::CLUSTER_CHALLENGE_HEADER).map(|v| v.as_bytes()).unwrap_or_default();
    if !(8..=128).contains(&challenge.len()) {
        return (StatusCode::BAD_REQUEST, Json(json!({"error": "a challenge of 8 to 128 bytes, please"})))
            .into_response();
    }
    Json(json!({"proof": secret.engine_proof(challenge)})).into_response()
}

/// Largest request body accepted: room for a token-id prompt of about a million tokens.
pub const MAX_BODY_BYTES: usize = 16 << 20;

/// axum answers an oversize body with plain text; clients of an OpenAI API expect its JSON.
async fn json_body_limit(resp: Response) -> Response {
    if resp.status() == StatusCode::PAYLOAD_TOO_LARGE {
        return ApiError::BodyTooLarge { limit_mib: MAX_BODY_BYTES >> 20 }.into_response();
    }
    resp
}

/// Serves the API on `listener` until `shutdown` resolves, over TLS when `tls` is given.
pub async fn serve(
    listener: tokio::net::TcpListener,
    tls: Option<tandem_tls::HttpsConfig>,
    state: Arc<AppState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    tandem_tls::http::serve(listener, tls, router(state), shutdown).await
}

/// Parses a JSON body into `T`; malformed JSON or a wrongly typed field is a 400 that says so,
/// naming the field (`param`) in words a client can act on.
fn parse_body<T: DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.inner();
        if inner.is_syntax() || inner.is_eof() {
            return ApiError::invalid(format!("invalid request body (not valid JSON): {inner}"));
        }
        // serde's position counts in the body as parsed, which a proxy may have rewritten;
        // the field's path says where the problem is.
        let text = inner.to_string();
        let what = text.rsplit_once(" at line ").map_or(text.as_str(), |(m, _)| m);
        if path == "." {
            return ApiError::invalid(format!("invalid request body: {what}"));
        }
        let field = path.rsplit('.').next().unwrap_or(&path);
        let field = field.split('[').next().unwrap_or(field);
        let message = if what.contains("untagged enum") {
            match field {
                "prompt" => "must be a string, a list of token ids (integers >= 0), or a one-element list of either",
                "stop" => "must be a string or a list of strings",
                "content" => "must be a string or a list of content parts ({\"type\": \"text\", \"text\": ...})",
                _ => "has an unsupported shape",
            }
            .to_string()
        } else {
            what.to_string()
        };
        ApiError::bad_field(path.clone(), format!("invalid `{path}`: {message}"))
    })
}

/// [`parse_body`] for a completions or chat request. Their sampling fields are flattened into
/// the request, and serde loses the path of an error inside flattened fields: parse those
/// alone to name the field.
fn parse_generation<T: DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    let req = parse_body::<T>(body);
    if let Err(ApiError::BadRequest { param: None, .. }) = &req {
        parse_body::<protocol::SamplingFields>(body)?;
    }
    req
}

/// The client's `X-Request-Id`, echoed on the response; generated when absent.
fn request_id_header(headers: &HeaderMap, generated: &RequestId) -> HeaderValue {
    headers
        .get("x-request-id")
        .cloned()
        .unwrap_or_else(|| HeaderValue::from_str(generated.as_str()).unwrap_or(HeaderValue::from_static("tandem")))
}

fn with_request_id(mut resp: Response, value: HeaderValue) -> Response {
    resp.headers_mut().insert("x-request-id", value);
    resp
}

fn record(state: &AppState, r: Result<Response, ApiError>) -> Response {
    match r {
        Ok(resp) => resp,
        Err(e) => {
            state.metrics.record_error(e.error_type());
            tracing::info!(error = %e, status = %e.status(), "request refused");
            e.into_response()
        }
    }
}

/// Cancel safety: dropping this future (client disconnect) drops the engine stream it holds,
/// which aborts the request in the engine.
async fn completions(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    let id = state.new_request_id();
    let header = request_id_header(&headers, &id);
    let result = match parse_generation::<CompletionRequest>(&body)
        .and_then(|req| generate::prepare_completion(&state, req, id))
    {
        Ok(p) => generate::run(state.clone(), p).await,
        Err(e) => Err(e),
    };
    with_request_id(record(&state, result), header)
}

/// Cancel safety: as [`completions`].
async fn chat_completions(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Bytes) -> Response {
    let id = state.new_request_id();
    let header = request_id_header(&headers, &id);
    let result = match parse_generation::<ChatCompletionRequest>(&body)
        .and_then(|req| generate::prepare_chat(&state, req, id))
    {
        Ok(p) => generate::run(state.clone(), p).await,
        Err(e) => Err(e),
    };
    with_request_id(record(&state, result), header)
}

async fn models(State(state): State<Arc<AppState>>) -> Json<serde_json::Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": state.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "tandem",
            "root": state.model_name,
            "max_model_len": state.max_model_len,
        }]
    }))
}

/// The KV side channel of this engine (404 when it has none): what a router needs to send
/// decode legs to this prefill engine.
async fn kv_info(State(state): State<Arc<AppState>>) -> Response {
    match state.engine.kv_info() {
        Some(info) => {
            // The handshake metadata, plus the open connections and the transport of each.
            let mut v = serde_json::to_value(info).unwrap_or_default();
            if let Some(obj) = v.as_object_mut() {
                obj.insert("links".into(), serde_json::to_value(state.engine.kv_links()).unwrap_or_default());
            }
            Json(v).into_response()
        }
        None => {
            ApiError::NotFound("this engine has no KV connector (it serves with --role both)".into()).into_response()
        }
    }
}

/// Prefill: frees the KV held under `transfer_id` (a router whose decode leg failed says so,
/// instead of leaving the blocks pinned until the lease or registration wait runs out).
async fn kv_release(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let result = (|| {
        let req: protocol::KvReleaseRequest = parse_body(&body)?;
        match state.engine.kv_info() {
            Some(info) if info.role == tandem_kv::Role::Prefill => {}
            Some(_) => return Err(ApiError::invalid("only a prefill engine holds KV for others to release")),
            None => {
                return Err(ApiError::NotFound("this engine has no KV connector (it serves with --role both)".into()))
            }
        }
        tracing::debug!(transfer_id = %req.transfer_id, "KV release asked for");
        state.engine.release_kv(tandem_core::TransferId(req.transfer_id.clone()));
        Ok(Json(json!({"transfer_id": req.transfer_id, "released": true})).into_response())
    })();
    record(&state, result)
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    if state.draining.load(Ordering::SeqCst) {
        (StatusCode::SERVICE_UNAVAILABLE, "draining").into_response()
    } else if state.engine.is_alive() {
        StatusCode::OK.into_response()
    } else {
        StatusCode::SERVICE_UNAVAILABLE.into_response()
    }
}

async fn metrics_text(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    let text = state.metrics.render(&state.engine.stats());
    ([("content-type", "text/plain; version=0.0.4")], text)
}

async fn tokenize(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let result = (|| {
        let req: TokenizeRequest = parse_body(&body)?;
        generate::check_model(&state, &req.model)?;
        let tok = state.tokenizer()?;
        let tokens = match (req.prompt, req.messages) {
            (Some(p), None) => tok.encode(&p, req.add_special_tokens.unwrap_or(true))?,
            (None, Some(m)) => {
                let text =
                    tok.apply_chat_template(&generate::chat_messages(m)?, req.add_generation_prompt.unwrap_or(true))?;
                tok.encode(&text, false)?
            }
            _ => return Err(ApiError::invalid("give exactly one of `prompt` or `messages`")),
        };
        Ok(Json(json!({"count": tokens.len(), "max_model_len": state.max_model_len, "tokens": tokens})).into_response())
    })();
    record(&state, result)
}

/// How much of a completion's or chat's prompt this engine holds in its prefix cache now:
/// `{"num_tokens", "cached_tokens"}`. A router asks it to route by cached prefix and to run a
/// prompt whose uncached part is short without disaggregating it.
async fn kv_prefix(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let result = (|| {
        let req: PrefixRequest = parse_body(&body)?;
        generate::check_model(&state, &req.model)?;
        let ids = match (req.prompt, req.messages) {
            (Some(p), None) => generate::completion_prompt_ids(&state, p)?,
            (None, Some(m)) => generate::chat_prompt_ids(&state, m, req.add_generation_prompt)?,
            _ => return Err(ApiError::invalid("give exactly one of `prompt` or `messages`")),
        };
        let cached = state.engine.cached_prefix_tokens(&ids);
        Ok(Json(json!({"num_tokens": ids.len(), "cached_tokens": cached})).into_response())
    })();
    record(&state, result)
}

async fn detokenize(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let result = (|| {
        let req: DetokenizeRequest = parse_body(&body)?;
        generate::check_model(&state, &req.model)?;
        let tok = state.tokenizer()?;
        let vocab = state.engine.limits().vocab_size;
        if let Some(bad) = req.tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::bad("tokens", format!("token id {bad} is out of range (vocabulary size {vocab})")));
        }
        Ok(Json(json!({"prompt": tok.decode(&req.tokens, false)?})).into_response())
    })();
    record(&state, result)
}
