//! How a request wants its tokens chosen and when it wants them to stop.

use serde::{Deserialize, Serialize};

/// Sampling and stopping parameters for one request, in the engine's terms (token ids only:
/// stop *strings* are text and are handled where text exists, in the server).
///
/// Invariants after [`SamplingParams::validate`]: `temperature` is finite and >= 0,
/// `0 < top_p <= 1`, `top_k` is `None` or >= 1, `1 <= max_tokens`, `min_tokens <= max_tokens`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy (argmax, ties to the lowest id).
    pub temperature: f32,
    /// Nucleus sampling mass; 1.0 disables it.
    pub top_p: f32,
    /// Keep only the k most likely tokens; `None` disables it.
    pub top_k: Option<u32>,
    /// Seed for this request's own random stream: same seed, same prompt, same output.
    pub seed: Option<u64>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// End-of-sequence and stop tokens are suppressed until this many tokens exist.
    pub min_tokens: usize,
    /// Keep generating past end-of-sequence tokens.
    pub ignore_eos: bool,
    /// Extra token ids that end generation (vLLM's `stop_token_ids`).
    pub stop_token_ids: Vec<u32>,
    /// Report each generated token's log-probability and those of this many most likely
    /// alternatives (`Some(0)`: the token's own only); `None`: no log-probabilities.
    #[serde(default)]
    pub logprobs: Option<u32>,
}

/// Most alternatives a request may ask log-probabilities for (vLLM's default `max_logprobs`).
pub const MAX_LOGPROBS: u32 = 20;

/// One generated token's log-probabilities, from the model's raw distribution (the log-softmax
/// of its logits, before temperature, top-k, top-p or banned tokens), as vLLM reports them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprobs {
    /// The generated token's.
    pub logprob: f32,
    /// The most likely tokens' ids and log-probabilities, most likely first (ties by id).
    pub top: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: None,
            seed: None,
            max_tokens: 16,
            min_tokens: 0,
            ignore_eos: false,
            stop_token_ids: Vec::new(),
            logprobs: None,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding of at most `max_tokens` tokens.
    pub fn greedy(max_tokens: usize) -> Self {
        Self { temperature: 0.0, max_tokens, ..Self::default() }
    }

    /// True when sampling reduces to argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == Some(1)
    }

    /// Checks the invariants listed on the type.
    pub fn validate(&self) -> Result<(), InvalidSampling> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(InvalidSampling::Temperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(InvalidSampling::TopP(self.top_p));
        }
        if self.top_k == Some(0) {
            return Err(InvalidSampling::TopK);
        }
        if self.max_tokens == 0 {
            return Err(InvalidSampling::MaxTokens);
        }
        if self.min_tokens > self.max_tokens {
            return Err(InvalidSampling::MinTokens { min_tokens: self.min_tokens, max_tokens: self.max_tokens });
        }
        if let Some(n) = self.logprobs.filter(|&n| n > MAX_LOGPROBS) {
            return Err(InvalidSampling::Logprobs(n));
        }
        Ok(())
    }
}

/// A sampling parameter outside its valid range; the message names the field as clients
/// spell it.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidSampling {
    /// Negative or non-finite temperature.
    #[error("temperature must be a finite number >= 0, got {0}")]
    Temperature(f32),
    /// top_p outside (0, 1].
    #[error("top_p must be in (0, 1], got {0}")]
    TopP(f32),
    /// top_k of zero.
    #[error("top_k must be -1 (disabled) or at least 1")]
    TopK,
    /// max_tokens of zero.
    #[error("max_tokens must be at least 1")]
    MaxTokens,
    /// min_tokens above max_tokens.
    #[error("min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})")]
    MinTokens {
        /// Requested minimum.
        min_tokens: usize,
        /// Requested maximum.
        max_tokens: usize,
    },
    /// More log-probability alternatives than [`MAX_LOGPROBS`].
    #[error("logprobs must be at most {MAX_LOGPROBS} alternatives, got {0}")]
    Logprobs(u32),
}

/// Why a request stopped generating.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// An end-of-sequence token, a stop token or a stop string.
    Stop,
    /// `max_tokens` or the model's context length was reached.
    Length,
    /// The request was cancelled (client disconnect, abort) or failed.
    Abort,
}

impl FinishReason {
    /// The OpenAI `finish_reason` string.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validate_rejects_out_of_range_values() {
        let ok = SamplingParams::greedy(4);
        assert!(ok.validate().is_ok());
        let bad = [
            SamplingParams { temperature: -0.5, ..ok.clone() },
            SamplingParams { temperature: f32::NAN, ..ok.clone() },
            SamplingParams { top_p: 0.0, ..ok.clone() },
            SamplingParams { top_p: 1.5, ..ok.clone() },
            SamplingParams { top_k: Some(0), ..ok.clone() },
            SamplingParams { logprobs: Some(MAX_LOGPROBS + 1), ..ok.clone() },
            SamplingParams { max_tokens: 0, ..ok.clone() },
            SamplingParams { min_tokens: 5, ..ok.clone() },
        ];
        for p in bad {
            assert!(p.validate().is_err(), "{p:?} should be rejected");
        }
    }
}
