//! Built-in model shapes with seeded random weights: tests, demos and benchmarks run without
//! downloading anything.
//!
//! `preset:NAME` builds a model in memory; `tandem model init --preset NAME --out DIR` writes
//! the same model as an HF directory (config.json, model.safetensors, tokenizer.json,
//! tokenizer_config.json, generation_config.json). Same name and seed give the same bytes.
//!
//! The tokenizer is a byte-level BPE whose merges are generated deterministically until the
//! vocabulary is full, so any text encodes and every id the model emits decodes to something.
//! It has ChatML special tokens and template.

use std::collections::HashSet;
use std::path::Path;

use rayon::prelude::*;
use serde_json::{json, Value};

use crate::config::Architecture;
use crate::weights::{Tensor, WeightMap};
use crate::ModelError;

/// A named model shape.
#[derive(Clone, Copy, Debug)]
pub struct Preset {
    /// The name after `preset:`.
    pub name: &'static str,
    /// What it is for.
    pub description: &'static str,
    /// Family.
    pub architecture: Architecture,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Residual width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// KV heads.
    pub num_kv_heads: usize,
    /// Head width.
    pub head_dim: usize,
    /// Context length.
    pub max_position_embeddings: usize,
    /// RoPE base.
    pub rope_theta: f64,
    /// Output projection tied to the embedding.
    pub tie_word_embeddings: bool,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// A mixture of experts in every layer's MLP (Qwen3-MoE), in place of the dense one.
    pub moe: Option<PresetMoe>,
}

/// A preset's experts: every layer sparse, the chosen experts' probabilities renormalised (as in
/// Qwen3-30B-A3B).
#[derive(Clone, Copy, Debug)]
pub struct PresetMoe {
    /// Experts in each layer.
    pub num_experts: usize,
    /// Experts each token goes through.
    pub num_experts_per_tok: usize,
    /// Each expert's inner width.
    pub moe_intermediate_size: usize,
}

const fn qwen3(
    name: &'static str,
    description: &'static str,
    hidden: usize,
    inter: usize,
    layers: usize,
    heads: usize,
    tie: bool,
) -> Preset {
    Preset {
        name,
        description,
        architecture: Architecture::Qwen3,
        vocab_size: 151_936,
        hidden_size: hidden,
        intermediate_size: inter,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: 8,
        head_dim: 128,
        max_position_embeddings: 40_960,
        rope_theta: 1_000_000.0,
        tie_word_embeddings: tie,
        rms_norm_eps: 1e-6,
        moe: None,
    }
}

/// A few-MB shape for tests: 4 layers of width 128 (MLP 384), heads of 32, a 512-token
/// vocabulary, tied embeddings; `heads` is (query heads, KV heads).
const fn tiny(
    name: &'static str,
    description: &'static str,
    architecture: Architecture,
    heads: (usize, usize),
    moe: Option<PresetMoe>,
) -> Preset {
    Preset {
        name,
        description,
        architecture,
        vocab_size: 512,
        hidden_size: 128,
        intermediate_size: 384,
        num_layers: 4,
        num_heads: heads.0,
        num_kv_heads: heads.1,
        head_dim: 32,
        max_position_embeddings: 4096,
        rope_theta: 1_000_000.0,
        tie_word_embeddings: true,
        rms_norm_eps: 1e-6,
        moe,
    }
}

/// Every preset, smallest first.
pub const PRESETS: &[Preset] = &[
    tiny(
        "tiny-qwen3",
        "a few MB Qwen3 for tests and the demo (the embedded default)",
        Architecture::Qwen3,
        (4, 2),
        None,
    ),
    Preset {
        rope_theta: 10_000.0,
        rms_norm_eps: 1e-5,
        ..tiny("tiny-llama", "a few MB Llama for tests", Architecture::Llama, (4, 2), None)
    },
    tiny("tiny-qwen2", "a few MB Qwen2 (biased q/k/v projections) for tests", Architecture::Qwen2, (4, 2), None),
    tiny(
        "tiny-qwen3-tp",
        "a few MB Qwen3 with 8 heads and 4 KV heads, for tensor parallelism",
        Architecture::Qwen3,
        (8, 4),
        None,
    ),
    tiny(
        "tiny-qwen3-moe",
        "a few MB Qwen3-MoE (8 experts, 2 a token) for tests",
        Architecture::Qwen3Moe,
        (4, 2),
        Some(PresetMoe { num_experts: 8, num_experts_per_tok: 2, moe_intermediate_size: 96 }),
    ),
    Preset {
        name: "smollm2-135m",
        description: "the SmolLM2-135M Llama shape, for CPU benchmarks",
        architecture: Architecture::Llama,
        vocab_size: 49_152,
        hidden_size: 576,
        intermediate_size: 1536,
        num_layers: 30,
        num_heads: 9,
        num_kv_heads: 3,
        head_dim: 64,
        max_position_embeddings: 8192,
        rope_theta: 100_000.0,
        tie_word_embeddings: true,
        rms_norm_eps: 1e-5,
        moe: None,
    },
    qwen3("qwen3-0.6b", "the Qwen3-0.6B shape", 1024, 3072, 28, 16, true),
    qwen3("qwen3-1.7b", "the Qwen3-1.7B shape", 2048, 6144, 28, 16, true),
    qwen3("qwen3-4b", "the Qwen3-4B shape", 2560, 9728, 36, 32, true),
    qwen3("qwen3-8b", "the Qwen3-8B shape", 4096, 12_288, 36, 32, false),
    Preset {
        name: "qwen3-30b-a3b",
        description: "the Qwen3-30B-A3B shape (128 experts, 8 a token)",
        architecture: Architecture::Qwen3Moe,
        vocab_size: 151_936,
        hidden_size: 2048,
        intermediate_size: 6144,
        num_layers: 48,
        num_heads: 32,
        num_kv_heads: 4,
        head_dim: 128,
        max_position_embeddings: 40_960,
        rope_theta: 1_000_000.0,
        tie_word_embeddings: false,
        rms_norm_eps: 1e-6,
        moe: Some(PresetMoe { num_experts: 128, num_experts_per_tok: 8, moe_intermediate_size: 768 }),
    },
    qwen3("qwen3-32b", "the Qwen3-32B shape", 5120, 25_600, 64, 64, false),
];

/// Special tokens every preset tokenizer has, at the top of the vocabulary.
pub const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// The ChatML template written to tokenizer_config.json.
pub const CHATML_TEMPLATE: &str = "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}";

impl Preset {
    /// Looks a preset up by name.
    pub fn find(name: &str) -> Result<&'static Preset, ModelError> {
        PRESETS.iter().find(|p| p.name == name).ok_or_else(|| ModelError::UnknownPreset {
            name: name.to_string(),
            known: PRESETS.iter().map(|p| p.name).collect::<Vec<_>>().join(", "),
        })
    }

    fn special_id(&self, token: &str) -> u32 {
        let i = SPECIAL_TOKENS.iter().position(|t| *t == token).unwrap_or(0);
        (self.vocab_size - SPECIAL_TOKENS.len() + i) as u32
    }

    /// config.json contents.
    pub fn config_json(&self) -> Value {
        let mut config = self.dense_config_json();
        if let (Some(moe), Some(fields)) = (self.moe, config.as_object_mut()) {
            fields.extend([
                ("num_experts".to_string(), json!(moe.num_experts)),
                ("num_experts_per_tok".to_string(), json!(moe.num_experts_per_tok)),
                ("moe_intermediate_size".to_string(), json!(moe.moe_intermediate_size)),
                ("norm_topk_prob".to_string(), json!(true)),
                ("decoder_sparse_step".to_string(), json!(1)),
                ("mlp_only_layers".to_string(), json!([])),
            ]);
        }
        config
    }

    fn dense_config_json(&self) -> Value {
        let model_type = match self.architecture {
            Architecture::Qwen3 => "qwen3",
            Architecture::Qwen2 => "qwen2",
            Architecture::Llama => "llama",
            Architecture::Qwen3Moe => "qwen3_moe",
        };
        json!({
            "architectures": [self.architecture.hf_name()],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": false,
            "bos_token_id": self.special_id("<|endoftext|>"),
            "eos_token_id": self.special_id("<|endoftext|>"),
            "torch_dtype": "float32",
        })
    }

    /// generation_config.json contents: chat models stop at `<|im_end|>` too.
    pub fn generation_config_json(&self) -> Value {
        json!({
            "bos_token_id": self.special_id("<|endoftext|>"),
            "eos_token_id": [self.special_id("<|im_end|>"), self.special_id("<|endoftext|>")],
        })
    }

    /// tokenizer_config.json contents.
    pub fn tokenizer_config_json(&self) -> Value {
        json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": CHATML_TEMPLATE,
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "bos_token": null,
            "model_max_length": self.max_position_embeddings,
        })
    }

    /// Every tensor's HF name, shape and init standard deviation (0 means "all ones", for norms).
    ///
    /// Projections use 1/sqrt(fan_in) so each layer's output is as large as its input; with the
    /// tiny 0.02 of HF's init, a random model with tied embeddings only ever repeats its last
    /// input token. Embeddings use 3/sqrt(hidden) so logits spread over a few units and
    /// sampling parameters visibly matter.
    pub(crate) fn tensor_specs(&self) -> Vec<(String, Vec<usize>, f32)> {
        let (h, i, v, hd) = (self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim);
        let (q, kv) = (self.num_heads * hd, self.num_kv_heads * hd);
        let fan = |n: usize| 1.0 / (n as f32).sqrt();
        let mut specs = vec![("model.embed_tokens.weight".to_string(), vec![v, h], 3.0 * fan(h))];
        for l in 0..self.num_layers {
            let p = format!("model.layers.{l}");
            specs.extend([
                (format!("{p}.input_layernorm.weight"), vec![h], 0.0),
                (format!("{p}.post_attention_layernorm.weight"), vec![h], 0.0),
                (format!("{p}.self_attn.q_proj.weight"), vec![q, h], fan(h)),
                (format!("{p}.self_attn.k_proj.weight"), vec![kv, h], fan(h)),
                (format!("{p}.self_attn.v_proj.weight"), vec![kv, h], fan(h)),
                (format!("{p}.self_attn.o_proj.weight"), vec![h, q], fan(q)),
            ]);
            match self.moe {
                None => specs.extend([
                    (format!("{p}.mlp.gate_proj.weight"), vec![i, h], fan(h)),
                    (format!("{p}.mlp.up_proj.weight"), vec![i, h], fan(h)),
                    (format!("{p}.mlp.down_proj.weight"), vec![h, i], fan(i)),
                ]),
                Some(moe) => {
                    let (n, mi) = (moe.num_experts, moe.moe_intermediate_size);
                    // Router logits a few units apart, so tokens spread over the experts.
                    specs.push((format!("{p}.mlp.gate.weight"), vec![n, h], 3.0 * fan(h)));
                    for e in 0..n {
                        specs.extend([
                            (format!("{p}.mlp.experts.{e}.gate_proj.weight"), vec![mi, h], fan(h)),
                            (format!("{p}.mlp.experts.{e}.up_proj.weight"), vec![mi, h], fan(h)),
                            (format!("{p}.mlp.experts.{e}.down_proj.weight"), vec![h, mi], fan(mi)),
                        ]);
                    }
                }
            }
            if matches!(self.architecture, Architecture::Qwen3 | Architecture::Qwen3Moe) {
                specs.push((format!("{p}.self_attn.q_norm.weight"), vec![hd], 0.0));
                specs.push((format!("{p}.self_attn.k_norm.weight"), vec![hd], 0.0));
            }
            if self.architecture == Architecture::Qwen2 {
                // Qwen2 always has q/k/v biases; large enough to move every attention score.
                specs.push((format!("{p}.self_attn.q_proj.bias"), vec![q], 0.5));
                specs.push((format!("{p}.self_attn.k_proj.bias"), vec![kv], 0.5));
                specs.push((format!("{p}.self_attn.v_proj.bias"), vec![kv], 0.5));
            }
        }
        specs.push(("model.norm.weight".to_string(), vec![h], 0.0));
        if !self.tie_word_embeddings {
            specs.push(("lm_head.weight".to_string(), vec![v, h], fan(h)));
        }
        specs
    }

    /// Seeded random weights. Each tensor has its own random stream derived from the seed and
    /// its name, and element `i` depends only on that stream and `i` ([`preset_value`]), so
    /// tensors are generated in parallel, in any order, and the CUDA backend builds the very same
    /// values on the device.
    pub fn random_weights(&self, seed: u64) -> WeightMap {
        let tensors: Vec<(String, Tensor)> = self
            .tensor_specs()
            .into_par_iter()
            .map(|(name, shape, std)| {
                let n: usize = shape.iter().product();
                let data = if std == 0.0 {
                    vec![1.0f32; n]
                } else {
                    let (stream, amp) = (tensor_stream(seed, &name), uniform_amplitude(std));
                    (0..n as u64).into_par_iter().map(|i| preset_value(stream, i, amp)).collect()
                };
                (name, Tensor { shape, data })
            })
            .collect();
        let mut map = WeightMap::new();
        for (name, t) in tensors {
            map.insert(name, t);
        }
        map
    }

    /// The tokenizer.json text (see the module docs).
    pub fn tokenizer_json(&self) -> String {
        let byte_chars = bytes_to_unicode();
        let n_bpe = self.vocab_size - SPECIAL_TOKENS.len();
        let mut vocab: Vec<String> = byte_chars.iter().map(|c| c.to_string()).collect();
        let mut seen: HashSet<String> = vocab.iter().cloned().collect();
        let mut merges: Vec<String> = Vec::new();
        // Merge pieces from lowercase letters and the byte-level space marker, so the text of a
        // random model looks like words.
        let space = byte_chars[b' ' as usize].to_string();
        let mut pool: Vec<String> = (b'a'..=b'z').map(|b| byte_chars[b as usize].to_string()).collect();
        pool.push(space.clone());
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = |n: usize| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 33) as usize) % n
        };
        while vocab.len() < n_bpe {
            let left = pool[next(pool.len())].clone();
            let right = pool[next(pool.len())].clone();
            if right.starts_with(&space) {
                continue;
            }
            let merged = format!("{left}{right}");
            if merged.chars().count() > 12 || seen.contains(&merged) {
                continue;
            }
            merges.push(format!("{left} {right}"));
            seen.insert(merged.clone());
            vocab.push(merged.clone());
            pool.push(merged);
        }
        let vocab_obj: serde_json::Map<String, Value> =
            vocab.into_iter().enumerate().map(|(i, t)| (t, json!(i))).collect();
        let added: Vec<Value> = SPECIAL_TOKENS
            .iter()
            .map(|t| {
                json!({"id": self.special_id(t), "content": t, "single_word": false, "lstrip": false,
                       "rstrip": false, "normalized": false, "special": true})
            })
            .collect();
        let tok = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                      "ignore_merges": false, "vocab": vocab_obj, "merges": merges},
        });
        tok.to_string()
    }

    /// Writes the preset as an HF model directory.
    pub fn write_dir(&self, dir: &Path, seed: u64) -> Result<(), ModelError> {
        std::fs::create_dir_all(dir).map_err(|e| ModelError::io(dir, e))?;
        let write = |name: &str, text: String| {
            let p = dir.join(name);
            std::fs::write(&p, text).map_err(|e| ModelError::io(p, e))
        };
        let pretty = |v: Value| serde_json::to_string_pretty(&v).unwrap_or_else(|_| v.to_string());
        write("config.json", pretty(self.config_json()))?;
        write("generation_config.json", pretty(self.generation_config_json()))?;
        write("tokenizer_config.json", pretty(self.tokenizer_config_json()))?;
        write("tokenizer.json", self.tokenizer_json())?;
        let weights = self.random_weights(seed);
        let mut named: Vec<(String, Vec<usize>, Vec<u8>)> = weights
            .iter()
            .map(|(n, t)| (n.clone(), t.shape.clone(), t.data.iter().flat_map(|x| x.to_le_bytes()).collect()))
            .collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        let views = named
            .iter()
            .map(|(n, shape, bytes)| {
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes)
                    .map(|v| (n.clone(), v))
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| ModelError::Safetensors { path: dir.join("model.safetensors"), message: e.to_string() })?;
        let path = dir.join("model.safetensors");
        let mut meta = std::collections::HashMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        safetensors::tensor::serialize_to_file(views, Some(meta), &path)
            .map_err(|e| ModelError::Safetensors { path, message: e.to_string() })
    }
}

/// GPT-2's reversible byte -> printable character map, indexed by byte.
fn bytes_to_unicode() -> Vec<char> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut extra = 0u32;
    (0u32..256)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap_or('?')
            } else {
                extra += 1;
                char::from_u32(255 + extra).unwrap_or('?')
            }
        })
        .collect()
}

/// SplitMix64 over the seed and an FNV-1a hash of the name.
/// The random stream of tensor `name` under `seed`.
pub(crate) fn tensor_stream(seed: u64, name: &str) -> u64 {
    mix(seed, name)
}

/// Half-width of the uniform distribution with standard deviation `std`.
pub(crate) fn uniform_amplitude(std: f32) -> f32 {
    std * 3.0f32.sqrt()
}

/// Element `i` of a preset tensor: the `i`-th output of a splitmix64 stream started at `stream`,
/// as a uniform value in `[-amp, amp)`. Mirrors `preset_uniform` in the CUDA kernels operation
/// for operation (integer hash, exact 24-bit conversion, then two rounded f32 operations).
pub(crate) fn preset_value(stream: u64, i: u64, amp: f32) -> f32 {
    let mut z = stream.wrapping_add((i + 1).wrapping_mul(0x9e3779b97f4a7c15));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
    z ^= z >> 31;
    let u = (z >> 40) as f32 * (1.0 / 16_777_216.0);
    (u * 2.0 - 1.0) * amp
}

fn mix(seed: u64, name: &str) -> u64 {
    let mut h = 0xcbf29ce484222325u64;
    for b in name.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x100000001b3);
    }
    let mut z = seed ^ h;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn real_shapes_have_published_parameter_counts() {
        // Published sizes (embeddings included): 0.6B, 1.7B, 4B, 8B, 32B; SmolLM2 135M.
        let count = |name: &str| {
            let p = Preset::find(name).unwrap();
            crate::ModelConfig::from_preset(p).unwrap().num_params() as f64 / 1e9
        };
        assert!((count("smollm2-135m") - 0.1348).abs() < 0.002);
        assert!((count("qwen3-0.6b") - 0.596).abs() < 0.01);
        assert!((count("qwen3-1.7b") - 1.72).abs() < 0.02);
        assert!((count("qwen3-4b") - 4.02).abs() < 0.03);
        assert!((count("qwen3-8b") - 8.19).abs() < 0.05);
        assert!((count("qwen3-32b") - 32.76).abs() < 0.1);
        // Qwen3-30B-A3B: 30.5B in all.
        assert!((count("qwen3-30b-a3b") - 30.53).abs() < 0.1, "{}", count("qwen3-30b-a3b"));
        let active = crate::ModelConfig::from_preset(Preset::find("qwen3-30b-a3b").unwrap()).unwrap().active_params();
        assert!((active as f64 / 1e9 - 3.35).abs() < 0.05, "3.3B active: {active}");
    }

    #[test]
    fn same_seed_same_weights_other_seed_other_weights() {
        let p = Preset::find("tiny-llama").unwrap();
        let a = p.random_weights(3);
        let b = p.random_weights(3);
        let c = p.random_weights(4);
        let name = "model.layers.1.mlp.up_proj.weight";
        let get = |m: &WeightMap| m.iter().find(|(n, _)| *n == name).unwrap().1.data.clone();
        assert_eq!(get(&a), get(&b));
        assert_ne!(get(&a), get(&c));
    }

    #[test]
    fn preset_values_are_uniform_with_the_requested_spread() {
        // The CUDA kernel `preset_uniform` computes the same function; this pins its shape.
        let std = 0.05f32;
        let (stream, amp) = (tensor_stream(7, "model.layers.0.mlp.up_proj.weight"), uniform_amplitude(std));
        let xs: Vec<f64> = (0..200_000u64).map(|i| preset_value(stream, i, amp) as f64).collect();
        assert!(xs.iter().all(|x| x.abs() <= amp as f64));
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / xs.len() as f64;
        assert!(mean.abs() < 1e-3, "mean {mean}");
        assert!((var.sqrt() / std as f64 - 1.0).abs() < 0.01, "std {} for {std}", var.sqrt());
        // Element i depends on (stream, i) only: the same element twice, a different stream
        // differs.
        assert_eq!(preset_value(stream, 12_345, amp), xs[12_345] as f32);
        assert_ne!(preset_value(stream ^ 1, 12_345, amp), xs[12_345] as f32);
    }

    #[test]
    fn unknown_preset_lists_known_ones() {
        let e = Preset::find("gpt5").unwrap_err().to_string();
        assert!(e.contains("gpt5") && e.contains("tiny-qwen3"), "{e}");
    }
}
