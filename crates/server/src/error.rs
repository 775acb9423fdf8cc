//! API errors and their one mapping to HTTP: an OpenAI-shaped JSON body with a status.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;
use tandem_engine::SubmitError;
use tandem_model::ModelError;

/// An error a handler returns; becomes `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ApiError {
    /// The request is malformed or asks for something impossible (400).
    #[error("{message}")]
    BadRequest {
        /// What is wrong, for the client.
        message: String,
        /// The offending field, when one is to blame.
        param: Option<String>,
    },
    /// The `model` field names a model this server does not serve (404).
    #[error("The model `{0}` does not exist.")]
    ModelNotFound(String),
    /// The engine thread has stopped (503).
    #[error("the engine has stopped")]
    EngineStopped,
    /// The server is shutting down and ended this request (503).
    #[error("the server is shutting down; the request was ended before it finished")]
    ShuttingDown,
    /// This engine has no KV connector (404).
    #[error("{0}")]
    NotFound(String),
    /// The request body is larger than the server accepts (413).
    #[error("the request body is larger than the {limit_mib} MiB this server accepts")]
    BodyTooLarge {
        /// The limit in MiB.
        limit_mib: usize,
    },
    /// The engine failed while running the request (500).
    #[error("{0}")]
    Internal(String),
    /// As many requests as the server takes are being answered; retry shortly (429, with
    /// `Retry-After`).
    #[error("the server is answering {limit} requests, as many as it takes (--max-queued-requests); retry shortly")]
    Overloaded {
        /// Requests the server answers at once.
        limit: usize,
    },
    /// The request waited in the engine's queue past its bound without running (503, with
    /// `Retry-After`).
    #[error("the request waited {:.1} s in the queue without being served, past this server's --max-queue-secs {:.0}; it was not run, retry later", *waited_ms as f64 / 1e3, *bound_ms as f64 / 1e3)]
    QueueTimeout {
        /// How long it waited.
        waited_ms: u64,
        /// The bound.
        bound_ms: u64,
    },
    /// The server takes API keys (`--api-key`) and the request has none of them (401).
    #[error("this server needs an API key: send `Authorization: Bearer <key>` with one of its --api-key keys")]
    Unauthorized,
    /// An internal endpoint (`/kv/*`) without the deployment's cluster token (401).
    #[error("this endpoint is for the deployment's own router (--cluster-secret-file): the request carries no valid x-tandem-cluster-token")]
    NotClusterMember,
}

impl ApiError {
    /// A 400 blaming `param`.
    pub fn bad(param: &'static str, message: impl Into<String>) -> Self {
        Self::BadRequest { message: message.into(), param: Some(param.to_string()) }
    }

    /// A 400 blaming a field known only at run time (e.g. `messages[2].content`).
    pub fn bad_field(param: String, message: impl Into<String>) -> Self {
        Self::BadRequest { message: message.into(), param: Some(param) }
    }

    /// A 400 without a field to blame.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::BadRequest { message: message.into(), param: None }
    }

    /// HTTP status.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest { .. } => StatusCode::BAD_REQUEST,
            ApiError::ModelNotFound(_) => StatusCode::NOT_FOUND,
            ApiError::EngineStopped | ApiError::ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::Overloaded { .. } => StatusCode::TOO_MANY_REQUESTS,
            ApiError::QueueTimeout { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Unauthorized | ApiError::NotClusterMember => StatusCode::UNAUTHORIZED,
        }
    }

    /// Stable label for the JSON `type` field and for metrics.
    pub fn error_type(&self) -> &'static str {
        match self {
            ApiError::BadRequest { .. } => "BadRequestError",
            ApiError::ModelNotFound(_) | ApiError::NotFound(_) => "NotFoundError",
            ApiError::EngineStopped | ApiError::ShuttingDown => "ServiceUnavailableError",
            ApiError::BodyTooLarge { .. } => "BadRequestError",
            ApiError::Internal(_) => "InternalServerError",
            ApiError::Overloaded { .. } => "RateLimitError",
            ApiError::QueueTimeout { .. } => "ServiceUnavailableError",
            ApiError::Unauthorized | ApiError::NotClusterMember => "AuthenticationError",
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        let param = match self {
            ApiError::BadRequest { param, .. } => param.clone(),
            _ => None,
        };
        json!({"error": {"message": self.to_string(), "type": self.error_type(), "param": param, "code": self.status().as_u16()}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status(), axum::Json(self.body())).into_response();
        if matches!(self, ApiError::Overloaded { .. } | ApiError::QueueTimeout { .. }) {
            r.headers_mut().insert(axum::http::header::RETRY_AFTER, axum::http::HeaderValue::from_static("1"));
        }
        r
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::Rejected(r) => {
                use tandem_engine::RequestRejected as R;
                let param = match &r {
                    R::EmptyPrompt | R::TokenOutOfRange { .. } | R::PromptTooLong { .. } => Some("prompt"),
                    R::ExceedsContext { .. } | R::ExceedsKvCapacity { .. } => Some("max_tokens"),
                    R::Logprobs(_) => Some("logprobs"),
                    _ => None,
                };
                match param {
                    Some(p) => ApiError::bad(p, r.to_string()),
                    None => ApiError::invalid(r.to_string()),
                }
            }
            SubmitError::EngineStopped => ApiError::EngineStopped,
            other => ApiError::Internal(other.to_string()),
        }
    }
}

impl From<ModelError> for ApiError {
    fn from(e: ModelError) -> Self {
        // Tokenizer and template errors come from the request's text or messages.
        ApiError::invalid(e.to_string())
    }
}
