//! From a `--model` argument to a [`LoadedModel`]: an HF directory, a GGUF file or `preset:NAME`.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::config::{token_id_list, ModelConfig};
use crate::gguf::GgufFile;
use crate::presets::Preset;
use crate::tokenizer::TextTokenizer;
use crate::transformer::Transformer;
use crate::weights::WeightMap;
use crate::ModelError;

/// Where a model comes from.
#[derive(Clone, Debug)]
pub enum ModelSource {
    /// A built-in shape with seeded random weights, built in memory.
    Preset {
        /// The preset.
        preset: &'static Preset,
        /// Weight seed.
        seed: u64,
    },
    /// An HF-layout directory.
    Dir(PathBuf),
    /// A GGUF file (llama.cpp's format; dequantized at load, see the `gguf` module).
    Gguf(PathBuf),
}

impl ModelSource {
    /// [`ModelSource::parse`], where `ORG/NAME` that is no local path is a Hugging Face Hub
    /// repository, downloaded (once, into the shared Hugging Face cache; see [`crate::hub`]) as
    /// `hub` says and then read from its snapshot directory.
    pub fn parse_or_fetch(spec: &str, seed: u64, hub: &crate::hub::HubConfig) -> Result<Self, ModelError> {
        if !spec.starts_with("preset:") && crate::hub::is_repo_id(spec) {
            return Ok(Self::Dir(crate::hub::fetch(spec, hub)?));
        }
        Self::parse(spec, seed)
    }

    /// Parses `preset:NAME` (seed from `seed`), a `.gguf` file or a directory path.
    pub fn parse(spec: &str, seed: u64) -> Result<Self, ModelError> {
        match spec.strip_prefix("preset:") {
            Some(name) => Ok(Self::Preset { preset: Preset::find(name)?, seed }),
            None if crate::gguf::is_gguf_path(Path::new(spec)) => Ok(Self::Gguf(PathBuf::from(spec))),
            None => Ok(Self::Dir(PathBuf::from(spec))),
        }
    }
}

/// Everything about a model except its weights: enough to size an engine and to build the
/// weights on either backend ([`LoadedModel`] on CPU, `CudaModel` on a GPU).
pub struct ModelSpec {
    /// Where it comes from.
    pub source: ModelSource,
    /// Its shape.
    pub config: ModelConfig,
    /// `None` in token-ids mode.
    pub tokenizer: Option<TextTokenizer>,
    /// Ids that end generation unless `ignore_eos` (config, generation_config and tokenizer).
    pub eos_token_ids: Vec<u32>,
    /// Longest prompt + output this instance accepts.
    pub max_model_len: usize,
    /// The sampling defaults the model's generation_config.json recommends.
    pub generation_defaults: GenerationDefaults,
    /// How the weights are rounded at load ([`ModelSpec::with_quantization`]); `None`: as read.
    pub quantization: Option<Quantization>,
}

/// A rounding of the weights at load (`--quantization`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Quantization {
    /// FP8 e4m3 in 128 x 128 blocks, each scaled by its largest magnitude over 448: the layout
    /// of the published FP8 checkpoints (Qwen3-32B-FP8 and the like), rounded as they were made
    /// ([`crate::WeightMap::quantize_fp8`]).
    Fp8,
}

impl Quantization {
    /// The block the published FP8 checkpoints use (`weight_block_size`).
    pub const FP8_BLOCK: [usize; 2] = [128, 128];

    /// Its name on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Quantization::Fp8 => "fp8",
        }
    }
}

impl std::str::FromStr for Quantization {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fp8" => Ok(Quantization::Fp8),
            other => Err(format!("unknown quantization `{other}` (known: fp8)")),
        }
    }
}

/// Sampling defaults from a model's `generation_config.json`, as vLLM applies them (its
/// `--generation-config auto`): a request that leaves a field out gets the model's value
/// instead of the API's. `max_tokens` (from `max_new_tokens`) caps the API's default length.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationDefaults {
    /// `temperature`.
    pub temperature: Option<f64>,
    /// `top_p`.
    pub top_p: Option<f64>,
    /// As the API takes it: -1 or 0 disable it.
    pub top_k: Option<i64>,
    /// `max_new_tokens`.
    pub max_tokens: Option<usize>,
    /// Fields the file sets that tandem does not sample with (`repetition_penalty`, `min_p`),
    /// for the start-up log.
    pub unsupported: Vec<String>,
}

impl GenerationDefaults {
    /// The defaults in a generation_config.json value (none for anything else).
    pub fn from_json(v: &Value) -> Self {
        let num = |k: &str| v.get(k).and_then(Value::as_f64);
        let unsupported = ["repetition_penalty", "min_p"]
            .iter()
            .filter(|k| v.get(**k).is_some_and(|x| !x.is_null()))
            .map(|k| format!("{k}={}", v[*k]))
            .collect();
        Self {
            temperature: num("temperature"),
            top_p: num("top_p"),
            top_k: v.get("top_k").and_then(Value::as_i64),
            max_tokens: v.get("max_new_tokens").and_then(Value::as_u64).map(|n| n as usize).filter(|&n| n > 0),
            unsupported,
        }
    }

    /// Whether it sets anything a request would otherwise get from the API.
    pub fn is_empty(&self) -> bool {
        self.temperature.is_none() && self.top_p.is_none() && self.top_k.is_none() && self.max_tokens.is_none()
    }
}

impl ModelSpec {
    /// Reads the config and tokenizer. `max_model_len` overrides the config's
    /// `max_position_embeddings` downwards (a shorter limit means a smaller RoPE table and
    /// earlier rejection).
    pub fn load(source: &ModelSource, max_model_len: Option<usize>) -> Result<Self, ModelError> {
        Self::load_with(source, max_model_len, true)
    }

    /// Like [`ModelSpec::load`], but a preset's tokenizer is not built (for a large vocabulary
    /// that takes seconds): for looking at a model's shape. Its `tokenizer` is then `None`
    /// and its EOS ids are those of the config and generation config.
    pub fn load_shape(source: &ModelSource, max_model_len: Option<usize>) -> Result<Self, ModelError> {
        Self::load_with(source, max_model_len, false)
    }

    fn load_with(
        source: &ModelSource,
        max_model_len: Option<usize>,
        preset_tokenizer: bool,
    ) -> Result<Self, ModelError> {
        let (cfg, tokenizer, generation) = match source {
            ModelSource::Preset { preset, .. } => {
                let cfg = ModelConfig::from_preset(preset)?;
                let tok = preset_tokenizer
                    .then(|| {
                        TextTokenizer::from_parts(
                            preset.tokenizer_json().as_bytes(),
                            Some(&preset.tokenizer_config_json()),
                        )
                    })
                    .transpose()?;
                (cfg, tok, preset.generation_config_json())
            }
            ModelSource::Dir(dir) => {
                if !dir.join("config.json").is_file() {
                    return Err(ModelError::NotAModel { path: dir.clone() });
                }
                let cfg = ModelConfig::from_dir(dir)?;
                (cfg, TextTokenizer::from_dir(dir)?, generation_config(dir)?)
            }
            ModelSource::Gguf(path) => {
                let file = GgufFile::open(path)?;
                let mut cfg = ModelConfig::from_value(&file.config_json()?)?;
                // Its block formats are kept whole (a split product would need their blocks
                // split), so the CPU engine sums each product in one part.
                cfg.reduction_groups = 1;
                // A file without tokenizer metadata runs in token-ids mode, as a directory
                // without tokenizer.json does.
                let tok = match file.tokenizer_json()? {
                    Some((tokenizer, config)) => {
                        Some(TextTokenizer::from_parts(tokenizer.to_string().as_bytes(), Some(&config))?)
                    }
                    None => None,
                };
                (cfg, tok, Value::Object(Default::default()))
            }
        };
        let limit = cfg.max_position_embeddings;
        let max_model_len = match max_model_len {
            Some(n) if n > limit => {
                return Err(ModelError::UnsupportedConfig(format!(
                    "--max-model-len {n} exceeds the model's max_position_embeddings {limit}"
                )))
            }
            Some(0) => return Err(ModelError::UnsupportedConfig("--max-model-len must be at least 1".into())),
            Some(n) => n,
            None => limit,
        };
        let mut eos = cfg.eos_token_ids.clone();
        eos.extend(token_id_list(generation.get("eos_token_id")));
        eos.extend(tokenizer.as_ref().and_then(TextTokenizer::eos_token_id));
        let mut seen = std::collections::HashSet::new();
        eos.retain(|id| *id < cfg.vocab_size as u32 && seen.insert(*id));
        let generation_defaults = GenerationDefaults::from_json(&generation);
        Ok(Self {
            source: source.clone(),
            config: cfg,
            tokenizer,
            eos_token_ids: eos,
            max_model_len,
            generation_defaults,
            quantization: None,
        })
    }

    /// Rounds the weights at load as `quantization` says (`None`: as read). An FP8 checkpoint
    /// is so already (its weights are kept as its scales give them); a GGUF file has block
    /// formats of its own and is refused.
    pub fn with_quantization(mut self, quantization: Option<Quantization>) -> Result<Self, ModelError> {
        match (quantization, &self.source) {
            (Some(Quantization::Fp8), ModelSource::Gguf(path)) => {
                return Err(ModelError::UnsupportedConfig(format!(
                    "--quantization fp8: {} is a GGUF file, whose block formats are its own; give a safetensors \
                     checkpoint or a preset",
                    path.display()
                )))
            }
            (Some(Quantization::Fp8), _) if self.config.fp8_weight_block.is_some() => {
                tracing::info!("--quantization fp8: the checkpoint is FP8 already; its weights are kept as stored");
            }
            _ => self.quantization = quantization,
        }
        Ok(self)
    }

    /// The weights as f32 on the host (read from disk, or generated for a preset), rounded as
    /// [`ModelSpec::quantization`] says.
    pub fn host_weights(&self) -> Result<WeightMap, ModelError> {
        let mut weights = self.host_weights_as_read()?;
        if self.quantization == Some(Quantization::Fp8) {
            let names = weights.quantize_fp8(Quantization::FP8_BLOCK);
            tracing::info!(tensors = names.len(), "weights rounded to FP8 (e4m3, 128 x 128 blocks)");
        }
        Ok(weights)
    }

    /// [`ModelSpec::host_weights`] before any `--quantization` (an FP8 checkpoint's dequantized).
    pub fn host_weights_as_read(&self) -> Result<WeightMap, ModelError> {
        Ok(match &self.source {
            ModelSource::Preset { preset, seed } => preset.random_weights(*seed),
            ModelSource::Dir(dir) => {
                let mut weights = WeightMap::load_dir(dir)?;
                weights.dequantize_fp8(self.config.fp8_weight_block)?;
                weights
            }
            ModelSource::Gguf(path) => GgufFile::open(path)?.weights()?,
        })
    }

    /// The weights as the CPU engine holds them: [`ModelSpec::host_weights`], except that a
    /// GGUF file's matrices stay in their block formats (read as stored, the same numbers).
    pub fn cpu_weights(&self) -> Result<WeightMap, ModelError> {
        match &self.source {
            ModelSource::Gguf(path) => GgufFile::open(path)?.weights_quantized(),
            _ => self.host_weights(),
        }
    }
}

/// A model ready to serve on CPU: the transformer, its tokenizer (if any) and stopping ids.
pub struct LoadedModel {
    /// The transformer.
    pub transformer: Transformer,
    /// `None` in token-ids mode.
    pub tokenizer: Option<TextTokenizer>,
    /// Ids that end generation unless `ignore_eos` (config, generation_config and tokenizer).
    pub eos_token_ids: Vec<u32>,
    /// Longest prompt + output this instance accepts.
    pub max_model_len: usize,
    /// The sampling defaults the model's generation_config.json recommends.
    pub generation_defaults: GenerationDefaults,
}

impl LoadedModel {
    /// Loads a model for the CPU backend (see [`ModelSpec::load`] for `max_model_len`).
    pub fn load(source: &ModelSource, max_model_len: Option<usize>) -> Result<Self, ModelError> {
        Self::from_spec(ModelSpec::load(source, max_model_len)?)
    }

    /// Builds the CPU transformer for `spec`.
    pub fn from_spec(spec: ModelSpec) -> Result<Self, ModelError> {
        let weights = spec.cpu_weights()?;
        let transformer = Transformer::from_weights(spec.config, weights, spec.max_model_len)?;
        Ok(Self {
            transformer,
            tokenizer: spec.tokenizer,
            eos_token_ids: spec.eos_token_ids,
            max_model_len: spec.max_model_len,
            generation_defaults: spec.generation_defaults,
        })
    }
}

/// `dir/generation_config.json`, or null when there is none.
fn generation_config(dir: &Path) -> Result<Value, ModelError> {
    let path = dir.join("generation_config.json");
    if !path.is_file() {
        return Ok(Value::Null);
    }
    let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
    serde_json::from_str(&text).map_err(|source| ModelError::Json { path, error: source })
}
