//! OpenAI request and response bodies (and vLLM's extensions), as typed structs.
//!
//! Unknown request fields are ignored; known ones with the wrong type are a 400 naming the
//! field.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Which OpenAI endpoint a request came through (the bodies and their logprobs differ).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Api {
    /// `/v1/completions`.
    Completion,
    /// `/v1/chat/completions`.
    Chat,
}

/// A completions prompt: text, token ids, or a one-element batch of either.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    /// Plain text.
    Text(String),
    /// Token ids.
    Ids(Vec<u32>),
    /// A batch of texts (only one is supported).
    Texts(Vec<String>),
    /// A batch of id lists (only one is supported).
    IdLists(Vec<Vec<u32>>),
}

/// `stop`: one string or a list.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// One stop string.
    One(String),
    /// Several.
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a final chunk with `usage`.
    #[serde(default)]
    pub include_usage: bool,
}

/// Sampling and stopping fields shared by completions and chat.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct SamplingFields {
    /// Output cap.
    pub max_tokens: Option<i64>,
    /// Chat's newer name for `max_tokens`.
    pub max_completion_tokens: Option<i64>,
    /// Softmax temperature; 0 is greedy.
    pub temperature: Option<f64>,
    /// Nucleus mass.
    pub top_p: Option<f64>,
    /// Top-k; -1 or 0 disables.
    pub top_k: Option<i64>,
    /// Per-request seed.
    pub seed: Option<i64>,
    /// Stop strings.
    pub stop: Option<Stop>,
    /// Stop token ids (vLLM).
    pub stop_token_ids: Option<Vec<u32>>,
    /// Keep going past EOS (vLLM).
    pub ignore_eos: Option<bool>,
    /// Minimum output tokens (vLLM).
    pub min_tokens: Option<i64>,
    /// Choices per request; only 1 is supported.
    pub n: Option<i64>,
    /// Stream the answer as SSE.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// P/D transfer parameters (vLLM's field names); validated by the P/D roles.
    pub kv_transfer_params: Option<Value>,
    /// tandem: this request's output so far, streamed by an engine that failed (a router
    /// resuming the request elsewhere); they follow the prompt. The answer is the whole output
    /// as one engine would have given it, these tokens first: their text comes out as it would
    /// have (a character split across the seam, stop strings reaching into it) and usage counts
    /// them as completion tokens; `max_tokens` and `min_tokens` count new tokens. Logprobs, when
    /// asked for, are the new tokens' only (their text offsets run on from these tokens').
    pub resume_output_token_ids: Option<Vec<u32>>,
    /// Chat: each chunk's and choice's `token_ids` too (vLLM's `return_token_ids`; completions
    /// always carry them).
    pub return_token_ids: Option<bool>,
    /// Completions: log-probabilities of each token and this many alternatives (0-20); chat:
    /// whether to return log-probabilities (true/false).
    pub logprobs: Option<Value>,
    /// Chat: alternatives per token with `logprobs: true` (0-20).
    pub top_logprobs: Option<i64>,
    /// vLLM: the prompt tokens' log-probabilities (not supported: must be absent or null).
    pub prompt_logprobs: Option<Value>,
}

/// `POST /v1/completions`.
#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    /// Served model name.
    pub model: Option<String>,
    /// The prompt.
    pub prompt: Prompt,
    /// Echo the prompt before the completion (not supported: must be absent or false).
    pub echo: Option<bool>,
    /// Sampling and stopping.
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

/// A chat message's `content`: text or a list of typed parts.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    /// Plain text.
    Text(String),
    /// `[{"type": "text", "text": ...}, ...]`.
    Parts(Vec<ContentPart>),
}

/// One part of a multi-part message.
#[derive(Clone, Debug, Deserialize)]
pub struct ContentPart {
    /// Only `text` is supported.
    #[serde(rename = "type")]
    pub kind: String,
    /// The text of a text part.
    pub text: Option<String>,
}

/// An incoming chat message.
#[derive(Clone, Debug, Deserialize)]
pub struct ChatMessageIn {
    /// Speaker.
    pub role: String,
    /// Content; may be null for some assistant messages.
    pub content: Option<MessageContent>,
}

/// `POST /v1/chat/completions`.
#[derive(Clone, Debug, Deserialize)]
pub struct ChatCompletionRequest {
    /// Served model name.
    pub model: Option<String>,
    /// The conversation.
    pub messages: Vec<ChatMessageIn>,
    /// Append the assistant turn opener (vLLM; default true).
    pub add_generation_prompt: Option<bool>,
    /// Sampling and stopping.
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

/// Token counts.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
    /// Their sum.
    pub total_tokens: usize,
}

impl Usage {
    /// Usage for a prompt and an output length.
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Self { prompt_tokens, completion_tokens, total_tokens: prompt_tokens + completion_tokens }
    }
}

/// `POST /tokenize`.
#[derive(Clone, Debug, Deserialize)]
pub struct TokenizeRequest {
    /// Served model name.
    pub model: Option<String>,
    /// Text to tokenize.
    pub prompt: Option<String>,
    /// Or a conversation, rendered with the chat template.
    pub messages: Option<Vec<ChatMessageIn>>,
    /// Apply the tokenizer's special-token post-processing (default true).
    pub add_special_tokens: Option<bool>,
    /// For messages: append the assistant opener (default true).
    pub add_generation_prompt: Option<bool>,
}

/// `POST /kv/prefix`: a completion's or a chat's body (its other fields are ignored).
#[derive(Clone, Debug, Deserialize)]
pub struct PrefixRequest {
    /// Served model name.
    pub model: Option<String>,
    /// A completion's prompt.
    pub prompt: Option<Prompt>,
    /// Or a chat's messages, rendered with the chat template.
    pub messages: Option<Vec<ChatMessageIn>>,
    /// For messages: append the assistant opener (default true).
    pub add_generation_prompt: Option<bool>,
}

/// `POST /kv/release`.
#[derive(Clone, Debug, Deserialize)]
pub struct KvReleaseRequest {
    /// The transfer whose KV no decode engine will take.
    pub transfer_id: String,
}

/// `POST /detokenize`.
#[derive(Clone, Debug, Deserialize)]
pub struct DetokenizeRequest {
    /// Served model name.
    pub model: Option<String>,
    /// Ids to turn back into text.
    pub tokens: Vec<u32>,
}

/// One choice of a completion response or stream chunk.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CompletionChoice {
    /// Always 0 (n = 1).
    pub index: u32,
    /// The text (whole answer, or this chunk's delta).
    pub text: String,
    /// Log-probabilities, when asked for (`logprobs: N`).
    pub logprobs: Option<Value>,
    /// Set on the last chunk / in a full response.
    pub finish_reason: Option<String>,
    /// The token ids behind `text` (always sent: token-ids-mode clients need them).
    pub token_ids: Vec<u32>,
}

/// `text_completion` body, full or one stream chunk.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CompletionResponse {
    /// `cmpl-...`.
    pub id: String,
    /// `text_completion`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// Served model name.
    pub model: String,
    /// One choice, or none in the final usage chunk.
    pub choices: Vec<CompletionChoice>,
    /// Token counts (full response; final chunk when asked).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub usage: Option<Usage>,
    /// Prefill leg: what the decode leg needs (vLLM's `kv_transfer_params`).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub kv_transfer_params: Option<tandem_core::KvTransferParams>,
    /// Decode leg: where the time to the first token went (queue, transfer, ready).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub kv_timeline: Option<tandem_engine::KvLoadTimeline>,
}

/// An assistant message in a full chat response.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ChatMessageOut {
    /// `assistant`.
    pub role: String,
    /// The answer.
    pub content: String,
}

/// One choice of a full chat response.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ChatChoice {
    /// Always 0.
    pub index: u32,
    /// The answer.
    pub message: ChatMessageOut,
    /// Log-probabilities, when asked for (`logprobs: true`).
    pub logprobs: Option<Value>,
    /// Why it ended.
    pub finish_reason: Option<String>,
}

/// `chat.completion` body.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ChatResponse {
    /// `chatcmpl-...`.
    pub id: String,
    /// `chat.completion`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// Served model name.
    pub model: String,
    /// One choice.
    pub choices: Vec<ChatChoice>,
    /// Token counts.
    pub usage: Usage,
    /// Prefill leg: what the decode leg needs (vLLM's `kv_transfer_params`).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub kv_transfer_params: Option<tandem_core::KvTransferParams>,
    /// Decode leg: where the time to the first token went (queue, transfer, ready).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub kv_timeline: Option<tandem_engine::KvLoadTimeline>,
}

/// The change a chat stream chunk carries.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ChatDelta {
    /// `assistant`, on the first chunk.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub role: Option<String>,
    /// New text.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub content: Option<String>,
}

/// One choice of a chat stream chunk.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ChatChunkChoice {
    /// Always 0.
    pub index: u32,
    /// The change.
    pub delta: ChatDelta,
    /// This chunk's tokens' log-probabilities, when asked for.
    pub logprobs: Option<Value>,
    /// Set on the last chunk.
    pub finish_reason: Option<String>,
    /// This chunk's token ids, when asked for (`return_token_ids`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// `chat.completion.chunk` body.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ChatChunk {
    /// `chatcmpl-...`.
    pub id: String,
    /// `chat.completion.chunk`.
    pub object: String,
    /// Unix seconds.
    pub created: u64,
    /// Served model name.
    pub model: String,
    /// One choice, or none in the final usage chunk.
    pub choices: Vec<ChatChunkChoice>,
    /// Token counts, final chunk only when asked.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub usage: Option<Usage>,
    /// Decode leg: where the time to the first token went (queue, transfer, ready).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub kv_timeline: Option<tandem_engine::KvLoadTimeline>,
}
