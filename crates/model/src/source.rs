//! From a `--model` argument to a [`LoadedModel`]: an HF directory or `preset:NAME`.

use std::path::{Path, PathBuf};

use crate::config::{token_id_list, ModelConfig};
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
}

impl ModelSource {
    /// Parses `preset:NAME` (seed from `seed`) or a directory path.
    pub fn parse(spec: &str, seed: u64) -> Result<Self, ModelError> {
        match spec.strip_prefix("preset:") {
            Some(name) => Ok(Self::Preset { preset: Preset::find(name)?, seed }),
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
        let (cfg, tokenizer, gen_eos) = match source {
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
                let gen_eos = token_id_list(preset.generation_config_json().get("eos_token_id"));
                (cfg, tok, gen_eos)
            }
            ModelSource::Dir(dir) => {
                if !dir.join("config.json").is_file() {
                    return Err(ModelError::NotAModel { path: dir.clone() });
                }
                let cfg = ModelConfig::from_dir(dir)?;
                (cfg, TextTokenizer::from_dir(dir)?, generation_eos(dir)?)
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
        eos.extend(gen_eos);
        eos.extend(tokenizer.as_ref().and_then(TextTokenizer::eos_token_id));
        let mut seen = std::collections::HashSet::new();
        eos.retain(|id| *id < cfg.vocab_size as u32 && seen.insert(*id));
        Ok(Self { source: source.clone(), config: cfg, tokenizer, eos_token_ids: eos, max_model_len })
    }

    /// The weights as f32 on the host (read from disk, or generated for a preset).
    pub fn host_weights(&self) -> Result<WeightMap, ModelError> {
        match &self.source {
            ModelSource::Preset { preset, seed } => Ok(preset.random_weights(*seed)),
            ModelSource::Dir(dir) => WeightMap::load_dir(dir),
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
}

impl LoadedModel {
    /// Loads a model for the CPU backend (see [`ModelSpec::load`] for `max_model_len`).
    pub fn load(source: &ModelSource, max_model_len: Option<usize>) -> Result<Self, ModelError> {
        Self::from_spec(ModelSpec::load(source, max_model_len)?)
    }

    /// Builds the CPU transformer for `spec`.
    pub fn from_spec(spec: ModelSpec) -> Result<Self, ModelError> {
        let weights = spec.host_weights()?;
        let transformer = Transformer::from_weights(spec.config, weights, spec.max_model_len)?;
        Ok(Self {
            transformer,
            tokenizer: spec.tokenizer,
            eos_token_ids: spec.eos_token_ids,
            max_model_len: spec.max_model_len,
        })
    }
}

fn generation_eos(dir: &Path) -> Result<Vec<u32>, ModelError> {
    let path = dir.join("generation_config.json");
    if !path.is_file() {
        return Ok(Vec::new());
    }
    let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|source| ModelError::Json { path, source })?;
    Ok(token_id_list(v.get("eos_token_id")))
}
