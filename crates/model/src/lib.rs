//! Models for tandem: load a Hugging Face checkpoint, run it over a paged KV cache, and turn
//! text into tokens and back.
//!
//! # Brief overview
//! [`LoadedModel::load`] takes a [`ModelSource`] (an HF directory, or `preset:NAME` for a
//! built-in shape with seeded random weights) and returns the [`Transformer`], its
//! [`TextTokenizer`] (absent in token-ids mode), the end-of-sequence ids and the max length.
//! [`Transformer::forward`] runs one batch of tokens from many sequences, reading and writing
//! keys and values in a `tandem_compute::KvCache` through each sequence's block table.
//!
//! Supported: Qwen3, Qwen3-MoE (CPU), Qwen2 and Llama (SmolLM too) with GQA, RoPE (plus Llama 3
//! scaling), tied embeddings, f32/bf16/f16 and block-scaled FP8 safetensors, single-file or
//! sharded, and GGUF files (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K; dequantized at
//! load). Anything else fails at load with a message naming what is unsupported
//! ([`ModelError`]).
//!
//! On the CPU a model may also run as tensor-parallel ranks ([`TpModel`]; each rank a
//! [`Transformer`] built for its [`Shard`]), giving one rank's bits.
//!
//! This crate owns no request state and does no scheduling: that is `tandem-engine`.
#![deny(missing_docs)]

mod config;
mod cuda;
mod detokenize;
mod error;
mod gguf;
pub mod hub;
mod presets;
mod runner;
mod source;
mod tokenizer;
mod tp;
mod transformer;
mod weights;

pub use config::{Architecture, ModelConfig, MoeConfig};
pub use cuda::{CudaModel, CudaOptions};
pub use detokenize::{IncrementalDetokenizer, StopMatcher, StopOutcome};
pub use error::ModelError;
pub use gguf::{dequantize as gguf_dequantize, GgufFile, GgufTensor};
pub use presets::{Preset, PRESETS};
pub use runner::{
    carried_row, carried_token, sample, token_logprobs, CpuRunner, ModelRunner, SampleSpec, CARRIED_TOKEN,
};
pub use source::{GenerationDefaults, LoadedModel, ModelSource, ModelSpec, Quantization};
pub use tokenizer::{ChatMessage, TextTokenizer};
pub use tp::TpModel;
pub use transformer::{SeqBatch, Shard, Transformer};
pub use weights::{Tensor, WeightMap};
