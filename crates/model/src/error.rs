//! Errors from loading a model or using its tokenizer.

use std::path::PathBuf;

/// Everything that can go wrong between a model path and a runnable [`crate::Transformer`].
/// Every variant names the file, tensor or field at fault.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// A file could not be read or written.
    // (The OS error is in the message, not the error's source: a chain printed whole would say
    // it twice.)
    #[error("{path}: {error}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        error: std::io::Error,
    },
    /// A JSON file did not parse or lacked a required field.
    #[error("{path}: invalid JSON: {error}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The parse error.
        error: serde_json::Error,
    },
    /// `architectures` names a model tandem does not implement.
    #[error("unsupported architecture `{name}` (supported: Qwen3ForCausalLM, Qwen3MoeForCausalLM, Qwen2ForCausalLM, LlamaForCausalLM)")]
    UnsupportedArchitecture {
        /// The architecture from config.json.
        name: String,
    },
    /// A config option tandem does not implement (sliding window, other activations, ...).
    #[error("unsupported model config: {0}")]
    UnsupportedConfig(String),
    /// A tensor the architecture needs is absent from the checkpoint.
    #[error("missing tensor `{name}` in the checkpoint")]
    MissingTensor {
        /// The HF tensor name.
        name: String,
    },
    /// A tensor-parallel rank failed during a forward (the others stopped with it).
    #[error("a tensor-parallel rank failed: {0}")]
    Rank(String),
    /// A tensor has a different shape than config.json implies.
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?}")]
    ShapeMismatch {
        /// The HF tensor name.
        name: String,
        /// Shape implied by the config.
        expected: Vec<usize>,
        /// Shape in the file.
        found: Vec<usize>,
    },
    /// A tensor is stored in a dtype other than f32, bf16 or f16.
    #[error("tensor `{name}` has unsupported dtype {dtype} (supported: F32, BF16, F16, F8_E4M3 with block scales)")]
    UnsupportedDtype {
        /// The HF tensor name.
        name: String,
        /// The dtype found.
        dtype: String,
    },
    /// A safetensors file is malformed.
    #[error("{path}: {message}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What the safetensors reader said.
        message: String,
    },
    /// A model could not come from the Hugging Face Hub (unknown, refused, unreachable, or not
    /// a transformers model).
    #[error("{0}")]
    Hub(String),
    /// A GGUF file is malformed, truncated or holds something tandem does not read.
    #[error("{path}: {message}")]
    Gguf {
        /// The file.
        path: PathBuf,
        /// What is wrong, naming the tensor, type or metadata key.
        message: String,
    },
    /// No model files at the given path.
    #[error(
        "{path}: not a model directory (expected config.json and model.safetensors or model.safetensors.index.json)"
    )]
    NotAModel {
        /// The path given.
        path: PathBuf,
    },
    /// `preset:NAME` with an unknown name.
    #[error("unknown preset `{name}` (known: {known})")]
    UnknownPreset {
        /// The name asked for.
        name: String,
        /// Comma-separated known names.
        known: String,
    },
    /// The tokenizer failed to load, encode or decode.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template failed to compile or render.
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// The GPU backend failed (CUDA unavailable, out of memory, a launch error).
    #[error("GPU: {0}")]
    Device(String),
    /// A pipelined step was used wrongly: `collect` with nothing submitted, a carried token
    /// naming a row the previous step did not sample, a runner that does not pipeline.
    #[error("step pipeline: {0}")]
    Pipeline(String),
    /// Text input given to a model that has no tokenizer.
    #[error("this model has no tokenizer (token-ids mode): send prompts as token id lists")]
    NoTokenizer,
}

impl ModelError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io { path: path.into(), error: source }
    }
}
