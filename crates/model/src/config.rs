//! `config.json` (the HF file format) to [`ModelConfig`] (what the runtime needs).
//!
//! Unsupported options are rejected here, in one place, so nothing later has to check.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;
use tandem_compute::cpu::RopeScaling;

use crate::ModelError;

/// Transformer families tandem runs. They differ only in a few switches, listed on
/// [`ModelConfig`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    /// `Qwen3ForCausalLM`: RMSNorm on each q and k head, no biases.
    Qwen3,
    /// `Qwen2ForCausalLM`: biases on q, k and v.
    Qwen2,
    /// `LlamaForCausalLM` (also SmolLM): optional biases, optional Llama 3 RoPE scaling.
    Llama,
    /// `Qwen3MoeForCausalLM`: Qwen3's attention; the MLP of most layers a mixture of experts
    /// ([`MoeConfig`]).
    Qwen3Moe,
}

impl Architecture {
    /// The HF class name.
    pub fn hf_name(self) -> &'static str {
        match self {
            Architecture::Qwen3 => "Qwen3ForCausalLM",
            Architecture::Qwen2 => "Qwen2ForCausalLM",
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Qwen3Moe => "Qwen3MoeForCausalLM",
        }
    }
}

/// A mixture-of-experts MLP (Qwen3-MoE): a router picks `num_experts_per_tok` of `num_experts`
/// small MLPs per token and sums their outputs weighted by the router's probabilities.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MoeConfig {
    /// Experts in each sparse layer.
    pub num_experts: usize,
    /// Experts each token goes through.
    pub num_experts_per_tok: usize,
    /// Each expert's inner width.
    pub moe_intermediate_size: usize,
    /// The chosen experts' probabilities are scaled to sum to one.
    pub norm_topk_prob: bool,
    /// Every this many layers is sparse (layer `i` when `(i + 1) % step == 0`).
    pub decoder_sparse_step: usize,
    /// Layers kept dense whatever the step.
    pub mlp_only_layers: Vec<usize>,
}

impl MoeConfig {
    /// Whether layer `layer`'s MLP is the mixture of experts (transformers' rule).
    pub fn is_sparse(&self, layer: usize) -> bool {
        !self.mlp_only_layers.contains(&layer)
            && self.num_experts > 0
            && (layer + 1).is_multiple_of(self.decoder_sparse_step)
    }
}

/// The runtime view of a model's shape.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// Family.
    pub architecture: Architecture,
    /// Rows of the embedding and output matrices.
    pub vocab_size: usize,
    /// Residual stream width.
    pub hidden_size: usize,
    /// MLP inner width (a mixture-of-experts model's dense layers).
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads (`num_heads` must be a multiple).
    pub num_kv_heads: usize,
    /// Elements per head (may differ from `hidden_size / num_heads`, as in Qwen3).
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// RoPE base.
    pub rope_theta: f32,
    /// RoPE frequency scaling.
    pub rope_scaling: RopeScaling,
    /// The output projection reuses the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Longest context the model supports.
    pub max_position_embeddings: usize,
    /// Biases on the q, k, v projections.
    pub qkv_bias: bool,
    /// Bias on the output projection.
    pub o_bias: bool,
    /// Biases on the MLP projections.
    pub mlp_bias: bool,
    /// Per-head RMSNorm on q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    /// End-of-sequence ids named by config.json.
    pub eos_token_ids: Vec<u32>,
    /// The checkpoint's linear weights are FP8 (e4m3) with one scale per block of this many
    /// `[rows, cols]` (`quantization_config.quant_method: fp8`, as Qwen and DeepSeek publish
    /// them); `None`: plain floating point.
    pub fp8_weight_block: Option<[usize; 2]>,
    /// The mixture of experts of a sparse model's MLPs; `None`: every MLP is dense.
    pub moe: Option<MoeConfig>,
    /// Parts the CPU engine sums the attention output and MLP down projections' inputs in (a
    /// balanced tree of per-part products): the most tensor-parallel ranks the model splits over
    /// with the same bits at every rank count (see `Transformer`). 1 for a GGUF file (its block
    /// formats are kept whole) and for a mixture of experts.
    pub reduction_groups: usize,
}

#[derive(Deserialize)]
struct HfConfig {
    architectures: Option<Vec<String>>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    tie_word_embeddings: Option<bool>,
    max_position_embeddings: Option<usize>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    hidden_act: Option<String>,
    use_sliding_window: Option<bool>,
    eos_token_id: Option<Value>,
    quantization_config: Option<Value>,
    /// transformers 5 writes `num_local_experts`, older configs (and the Hub's) `num_experts`.
    #[serde(alias = "num_local_experts")]
    num_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    norm_topk_prob: Option<bool>,
    decoder_sparse_step: Option<usize>,
    mlp_only_layers: Option<Vec<usize>>,
}

impl ModelConfig {
    /// Reads and checks `dir/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
        Self::from_json(&text).map_err(|e| match e {
            ConfigParseError::Json(source) => ModelError::Json { path, error: source },
            ConfigParseError::Model(e) => e,
        })
    }

    /// The config of a built-in preset (parsed from the same JSON `model init` writes).
    pub fn from_preset(preset: &crate::Preset) -> Result<Self, ModelError> {
        Self::from_json(&preset.config_json().to_string()).map_err(|e| match e {
            ConfigParseError::Json(e) => ModelError::UnsupportedConfig(e.to_string()),
            ConfigParseError::Model(e) => e,
        })
    }

    /// Checks a config.json value (one rebuilt from a GGUF file's metadata).
    pub(crate) fn from_value(v: &Value) -> Result<Self, ModelError> {
        let hf: HfConfig =
            serde_json::from_value(v.clone()).map_err(|e| ModelError::UnsupportedConfig(e.to_string()))?;
        Self::from_hf(hf)
    }

    /// Parses and checks a config.json text.
    fn from_json(text: &str) -> Result<Self, ConfigParseError> {
        let hf: HfConfig = serde_json::from_str(text).map_err(ConfigParseError::Json)?;
        Ok(Self::from_hf(hf)?)
    }

    fn from_hf(hf: HfConfig) -> Result<Self, ModelError> {
        let arch_name = hf
            .architectures
            .as_ref()
            .and_then(|a| a.first().cloned())
            .ok_or_else(|| ModelError::UnsupportedConfig("config.json has no `architectures`".into()))?;
        let architecture = match arch_name.as_str() {
            "Qwen3ForCausalLM" => Architecture::Qwen3,
            "Qwen2ForCausalLM" => Architecture::Qwen2,
            "LlamaForCausalLM" => Architecture::Llama,
            "Qwen3MoeForCausalLM" => Architecture::Qwen3Moe,
            _ => return Err(ModelError::UnsupportedArchitecture { name: arch_name }),
        };
        if let Some(act) = &hf.hidden_act {
            if act != "silu" {
                return Err(ModelError::UnsupportedConfig(format!("hidden_act `{act}` (only silu)")));
            }
        }
        if hf.use_sliding_window == Some(true) {
            return Err(ModelError::UnsupportedConfig("use_sliding_window = true".into()));
        }
        let num_kv_heads = hf.num_key_value_heads.unwrap_or(hf.num_attention_heads);
        if num_kv_heads == 0 || !hf.num_attention_heads.is_multiple_of(num_kv_heads) {
            return Err(ModelError::UnsupportedConfig(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {num_kv_heads}",
                hf.num_attention_heads
            )));
        }
        let head_dim = hf.head_dim.unwrap_or(hf.hidden_size / hf.num_attention_heads.max(1));
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(ModelError::UnsupportedConfig(format!("head_dim {head_dim} must be even")));
        }
        let (rope_theta, rope_scaling) = parse_rope(&hf)?;
        let fp8_weight_block = hf.quantization_config.as_ref().map(parse_fp8).transpose()?;
        let attention_bias = hf.attention_bias.unwrap_or(false);
        let moe = match architecture {
            Architecture::Qwen3Moe => Some(parse_moe(&hf)?),
            _ => None,
        };
        let (qkv_bias, o_bias, qk_norm) = match architecture {
            Architecture::Qwen3 | Architecture::Qwen3Moe => (attention_bias, attention_bias, true),
            Architecture::Qwen2 => (true, false, false),
            Architecture::Llama => (attention_bias, attention_bias, false),
        };
        Ok(Self {
            architecture,
            vocab_size: hf.vocab_size,
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            num_layers: hf.num_hidden_layers,
            num_heads: hf.num_attention_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: hf.rms_norm_eps.unwrap_or(1e-6) as f32,
            rope_theta,
            rope_scaling,
            tie_word_embeddings: hf.tie_word_embeddings.unwrap_or(false),
            max_position_embeddings: hf.max_position_embeddings.unwrap_or(2048),
            qkv_bias,
            o_bias,
            mlp_bias: hf.mlp_bias.unwrap_or(false),
            qk_norm,
            eos_token_ids: token_id_list(hf.eos_token_id.as_ref()),
            fp8_weight_block,
            reduction_groups: match moe {
                Some(_) => 1,
                None => reduction_groups(hf.num_attention_heads, hf.intermediate_size),
            },
            moe,
        })
    }

    /// Whether layer `layer`'s MLP is a mixture of experts.
    pub fn is_sparse_layer(&self, layer: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| m.is_sparse(layer))
    }

    /// Parameters in the checkpoint (tied embeddings counted once).
    pub fn num_params(&self) -> usize {
        let (h, i, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let q = self.num_heads * self.head_dim;
        let kv = self.num_kv_heads * self.head_dim;
        let mut layer = h * (q + 2 * kv) + q * h + 2 * h;
        if self.qk_norm {
            layer += 2 * self.head_dim;
        }
        if self.qkv_bias {
            layer += q + 2 * kv;
        }
        let mlps: usize = (0..self.num_layers)
            .map(|l| match &self.moe {
                Some(m) if m.is_sparse(l) => m.num_experts * (3 * h * m.moe_intermediate_size + h),
                _ => 3 * h * i,
            })
            .sum();
        let head = if self.tie_word_embeddings { 0 } else { v * h };
        v * h + self.num_layers * layer + mlps + h + head
    }

    /// Parameters one token's forward multiplies by: all of a dense model's; of a mixture of
    /// experts, the routers and `num_experts_per_tok` experts a layer in place of every expert.
    pub fn active_params(&self) -> usize {
        let Some(m) = &self.moe else { return self.num_params() };
        let expert = 3 * self.hidden_size * m.moe_intermediate_size;
        let sparse = (0..self.num_layers).filter(|&l| m.is_sparse(l)).count();
        self.num_params() - sparse * (m.num_experts - m.num_experts_per_tok) * expert
    }

    /// KV cache bytes per token, stored as f32.
    pub fn kv_bytes_per_token_f32(&self) -> usize {
        self.num_layers * 2 * self.num_kv_heads * self.head_dim * 4
    }
}

enum ConfigParseError {
    Json(serde_json::Error),
    Model(ModelError),
}

impl From<ModelError> for ConfigParseError {
    fn from(e: ModelError) -> Self {
        Self::Model(e)
    }
}

/// `eos_token_id` may be an int or a list of ints.
pub(crate) fn token_id_list(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32).collect(),
        _ => Vec::new(),
    }
}

/// `quantization_config`: block-scaled FP8 weights are read (dequantized at load); any other
/// method is refused by name. Activations are computed in full precision either way, so a
/// `static` activation scheme's input scales are not needed.
fn parse_fp8(q: &Value) -> Result<[usize; 2], ModelError> {
    let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("(none)");
    if method != "fp8" {
        return Err(ModelError::UnsupportedConfig(format!(
            "quantization_config.quant_method `{method}`: tandem reads fp8 (block-scaled e4m3) checkpoints, and GGUF files"
        )));
    }
    if let Some(fmt) = q.get("fmt").and_then(Value::as_str) {
        if fmt != "e4m3" {
            return Err(ModelError::UnsupportedConfig(format!("quantization_config.fmt `{fmt}` (only e4m3)")));
        }
    }
    // transformers' FineGrainedFP8Config defaults to 128 x 128 blocks.
    let Some(block) = q.get("weight_block_size") else { return Ok([128, 128]) };
    match block.as_array().map(|a| a.iter().map(Value::as_u64).collect::<Vec<_>>()).as_deref() {
        Some([Some(r), Some(c)]) if *r > 0 && *c > 0 => Ok([*r as usize, *c as usize]),
        _ => Err(ModelError::UnsupportedConfig(format!(
            "quantization_config.weight_block_size {block}: expected [rows, cols] of positive integers"
        ))),
    }
}

/// The most parts, a power of two up to 8, that split both the attention heads and the MLP's
/// inner width evenly.
fn reduction_groups(heads: usize, intermediate: usize) -> usize {
    [8, 4, 2].into_iter().find(|g| heads.is_multiple_of(*g) && intermediate.is_multiple_of(*g)).unwrap_or(1)
}

/// A Qwen3-MoE config's experts, with transformers' defaults for what it leaves out.
fn parse_moe(hf: &HfConfig) -> Result<MoeConfig, ModelError> {
    let moe = MoeConfig {
        num_experts: hf.num_experts.unwrap_or(128),
        num_experts_per_tok: hf.num_experts_per_tok.unwrap_or(8),
        moe_intermediate_size: hf.moe_intermediate_size.unwrap_or(768),
        norm_topk_prob: hf.norm_topk_prob.unwrap_or(false),
        decoder_sparse_step: hf.decoder_sparse_step.unwrap_or(1),
        mlp_only_layers: hf.mlp_only_layers.clone().unwrap_or_default(),
    };
    let bad = |what: String| Err(ModelError::UnsupportedConfig(what));
    if moe.num_experts_per_tok == 0 || moe.num_experts_per_tok > moe.num_experts {
        return bad(format!(
            "num_experts_per_tok {} with {} experts (need 1 to num_experts)",
            moe.num_experts_per_tok, moe.num_experts
        ));
    }
    if moe.decoder_sparse_step == 0 {
        return bad("decoder_sparse_step 0 (must be at least 1)".into());
    }
    if moe.moe_intermediate_size == 0 {
        return bad("moe_intermediate_size 0".into());
    }
    Ok(moe)
}

/// transformers 4.x writes `rope_theta` + `rope_scaling`; 5.x writes `rope_parameters`
/// holding both. Accept either.
fn parse_rope(hf: &HfConfig) -> Result<(f32, RopeScaling), ModelError> {
    let params = hf.rope_parameters.as_ref().or(hf.rope_scaling.as_ref());
    let field = |k: &str| params.and_then(|p| p.get(k)).and_then(Value::as_f64);
    let theta = field("rope_theta").or(hf.rope_theta).unwrap_or(10_000.0) as f32;
    let kind =
        params.and_then(|p| p.get("rope_type").or_else(|| p.get("type"))).and_then(Value::as_str).unwrap_or("default");
    let scaling = match kind {
        "default" => RopeScaling::None,
        "llama3" => {
            let need = |k: &str| {
                field(k)
                    .map(|v| v as f32)
                    .ok_or_else(|| ModelError::UnsupportedConfig(format!("llama3 rope scaling without `{k}`")))
            };
            RopeScaling::Llama3 {
                factor: need("factor")?,
                low_freq_factor: need("low_freq_factor")?,
                high_freq_factor: need("high_freq_factor")?,
                original_max_position_embeddings: need("original_max_position_embeddings")?,
            }
        }
        other => return Err(ModelError::UnsupportedConfig(format!("rope_type `{other}`"))),
    };
    Ok((theta, scaling))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<ModelConfig, ModelError> {
        ModelConfig::from_json(text).map_err(|e| match e {
            ConfigParseError::Json(e) => ModelError::UnsupportedConfig(e.to_string()),
            ConfigParseError::Model(e) => e,
        })
    }

    const BASE: &str = r#""vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1"#;

    #[test]
    fn old_and_new_rope_formats_agree() {
        let old = parse(&format!(r#"{{"architectures":["LlamaForCausalLM"], {BASE}, "rope_theta": 500000.0,
            "rope_scaling": {{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":64}}}}"#)).unwrap();
        let new = parse(&format!(r#"{{"architectures":["LlamaForCausalLM"], {BASE},
            "rope_parameters": {{"rope_theta": 500000.0, "rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":64}}}}"#)).unwrap();
        assert_eq!(old, new);
        assert_eq!(old.rope_theta, 500000.0);
        assert!(matches!(old.rope_scaling, RopeScaling::Llama3 { .. }));
    }

    #[test]
    fn fp8_quantization_is_read_and_other_methods_are_refused_by_name() {
        let with = |q: &str| {
            parse(&format!(r#"{{"architectures":["Qwen3ForCausalLM"], {BASE}, "quantization_config": {q}}}"#))
        };
        let published =
            with(r#"{"quant_method":"fp8","fmt":"e4m3","activation_scheme":"dynamic","weight_block_size":[128,128]}"#);
        assert_eq!(published.unwrap().fp8_weight_block, Some([128, 128]));
        assert_eq!(
            with(r#"{"quant_method":"fp8","weight_block_size":[64,32]}"#).unwrap().fp8_weight_block,
            Some([64, 32])
        );
        assert_eq!(with(r#"{"quant_method":"fp8"}"#).unwrap().fp8_weight_block, Some([128, 128]));
        assert_eq!(
            parse(&format!(r#"{{"architectures":["Qwen3ForCausalLM"], {BASE}}}"#)).unwrap().fp8_weight_block,
            None
        );
        for (q, named) in [
            (r#"{"quant_method":"awq","bits":4}"#, "awq"),
            (r#"{"quant_method":"fp8","fmt":"e5m2"}"#, "e5m2"),
            (r#"{"quant_method":"fp8","weight_block_size":[128]}"#, "weight_block_size"),
            (r#"{"quant_method":"fp8","weight_block_size":[0,128]}"#, "weight_block_size"),
        ] {
            let e = with(q).unwrap_err().to_string();
            assert!(e.contains(named), "{q}: {e}");
        }
    }

    #[test]
    fn rejects_unknown_architecture_and_options_by_name() {
        let e = parse(&format!(r#"{{"architectures":["GPT2LMHeadModel"], {BASE}}}"#)).unwrap_err();
        assert!(e.to_string().contains("GPT2LMHeadModel"), "{e}");
        let e =
            parse(&format!(r#"{{"architectures":["LlamaForCausalLM"], {BASE}, "hidden_act":"gelu"}}"#)).unwrap_err();
        assert!(e.to_string().contains("gelu"), "{e}");
        let e = parse(&format!(
            r#"{{"architectures":["LlamaForCausalLM"], {BASE}, "rope_scaling":{{"rope_type":"yarn","factor":4.0}}}}"#
        ))
        .unwrap_err();
        assert!(e.to_string().contains("yarn"), "{e}");
    }

    /// Qwen3-MoE's experts are read under both names the count goes by, with transformers'
    /// rule for which layers are sparse; impossible routing is refused by name.
    #[test]
    fn moe_configs_are_read_in_both_spellings_and_checked() {
        let moe = |fields: &str| {
            parse(&format!(
                r#"{{"architectures":["Qwen3MoeForCausalLM"], {BASE}, "moe_intermediate_size": 4,
                "num_experts_per_tok": 2, {fields}}}"#
            ))
        };
        let new = moe(r#""num_local_experts": 8, "norm_topk_prob": true, "mlp_only_layers": [0]"#).unwrap();
        let old = moe(r#""num_experts": 8, "norm_topk_prob": true, "mlp_only_layers": [0]"#).unwrap();
        assert_eq!(new, old);
        let m = new.moe.clone().unwrap();
        assert_eq!((m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size), (8, 2, 4));
        assert!(m.norm_topk_prob && new.qk_norm && new.architecture == Architecture::Qwen3Moe);
        assert!(!new.is_sparse_layer(0), "mlp_only_layers keeps layer 0 dense");
        let stepped = moe(r#""num_experts": 8, "decoder_sparse_step": 2"#).unwrap();
        let sparse: Vec<bool> = (0..4).map(|l| stepped.is_sparse_layer(l)).collect();
        assert_eq!(sparse, [false, true, false, true]);
        assert!(!stepped.moe.as_ref().unwrap().norm_topk_prob, "transformers' default");
        let dense = parse(&format!(r#"{{"architectures":["Qwen3ForCausalLM"], {BASE}}}"#)).unwrap();
        assert!(dense.moe.is_none() && !dense.is_sparse_layer(0));
        // One sparse layer of 8 experts (3 matrices of 8 x 4 each and a router row) in place of
        // the dense MLP (3 x 8 x 16).
        let one_layer = moe(r#""num_experts": 8"#).unwrap();
        assert_eq!(one_layer.num_params(), dense.num_params() - 3 * 8 * 16 + 8 * (3 * 8 * 4 + 8));
        assert_eq!(one_layer.active_params(), one_layer.num_params() - 6 * 3 * 8 * 4, "2 of 8 experts");
        assert_eq!(dense.active_params(), dense.num_params());
        for (fields, named) in [
            (r#""num_experts": 1"#, "num_experts_per_tok 2"),
            (r#""num_experts": 8, "decoder_sparse_step": 0"#, "decoder_sparse_step"),
        ] {
            let e = moe(fields).unwrap_err().to_string();
            assert!(e.contains(named), "{fields}: {e}");
        }
    }

    #[test]
    fn eos_may_be_int_or_list() {
        let c = parse(&format!(r#"{{"architectures":["Qwen2ForCausalLM"], {BASE}, "eos_token_id":[3,4]}}"#)).unwrap();
        assert_eq!(c.eos_token_ids, vec![3, 4]);
        assert!(c.qkv_bias && !c.o_bias && !c.qk_norm);
    }
}
