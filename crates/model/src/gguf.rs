//! GGUF checkpoints (llama.cpp's one-file format): the header, metadata and tensor table read
//! with every length checked against the file, the tensors dequantized to f32 under their
//! Hugging Face names, and the config and tokenizer rebuilt from the metadata, so that the rest
//! of the crate sees what an HF directory gives it.
//!
//! Architectures: `llama` (SmolLM too), `qwen2`, `qwen3`. Tensor types: F32, F16, BF16, Q8_0,
//! Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K. Tokenizers: `gpt2` (byte-level BPE) with the `smollm`,
//! `gpt-2`, `qwen2` and `llama-bpe` pre-tokenizers. Anything else is refused at load, naming the
//! tensor, type or field.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use tandem_compute::cpu::{dequantize_into, QuantMatrix, QuantType};

use crate::weights::{Tensor, WeightMap};
use crate::ModelError;

/// The file's magic, "GGUF" read as a little-endian u32.
const MAGIC: u32 = 0x4655_4747;
/// Alignment of the tensor data when `general.alignment` does not say.
const DEFAULT_ALIGNMENT: u64 = 32;
/// Most dimensions a GGUF tensor has.
const MAX_DIMS: u32 = 4;

/// ggml tensor types this reader dequantizes: (id, name, elements per block, bytes per block).
const TYPES: &[(u32, &str, usize, usize)] = &[
    (0, "F32", 1, 4),
    (1, "F16", 1, 2),
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24),
    (8, "Q8_0", 32, 34),
    (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176),
    (14, "Q6_K", 256, 210),
    (30, "BF16", 1, 2),
];

/// Names of the ggml types this reader does not take, for errors.
fn type_name(id: u32) -> String {
    let known = [
        (9, "Q8_1"),
        (10, "Q2_K"),
        (11, "Q3_K"),
        (15, "Q8_K"),
        (16, "IQ2_XXS"),
        (17, "IQ2_XS"),
        (18, "IQ3_XXS"),
        (19, "IQ1_S"),
        (20, "IQ4_NL"),
        (21, "IQ3_S"),
        (22, "IQ2_S"),
        (23, "IQ4_XS"),
        (24, "I8"),
        (25, "I16"),
        (26, "I32"),
        (27, "I64"),
        (28, "F64"),
        (29, "IQ1_M"),
    ];
    TYPES
        .iter()
        .map(|t| (t.0, t.1))
        .chain(known)
        .find(|t| t.0 == id)
        .map_or_else(|| format!("type {id}"), |t| t.1.to_string())
}

/// One entry of the tensor table.
#[derive(Clone, Debug)]
pub struct GgufTensor {
    /// The name in the file (llama.cpp's, e.g. `blk.0.attn_q.weight`).
    pub name: String,
    /// Dimensions, innermost (contiguous) first, as GGUF stores them.
    pub dims: Vec<u64>,
    /// The ggml type id.
    pub ggml_type: u32,
    /// Byte offset of the data from the start of the file.
    pub start: usize,
    /// Bytes of data.
    pub len: usize,
}

impl GgufTensor {
    /// The ggml type's name (`Q4_K`, ...).
    pub fn type_name(&self) -> String {
        type_name(self.ggml_type)
    }

    fn elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// A GGUF file mapped in memory, its metadata and tensor table parsed.
pub struct GgufFile {
    path: PathBuf,
    map: memmap2::Mmap,
    /// Metadata values by key (arrays as JSON arrays, integers as JSON integers).
    pub metadata: HashMap<String, Value>,
    /// The tensor table, in file order.
    pub tensors: Vec<GgufTensor>,
}

/// Whether `path` names a GGUF file (by its extension; the magic is checked at open).
pub fn is_gguf_path(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

impl GgufFile {
    /// Maps and parses `path`; a truncated or malformed file is refused naming what is wrong.
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let file = std::fs::File::open(path).map_err(|e| ModelError::io(path, e))?;
        // Safety: the map is read-only and tandem never writes checkpoint files; a file
        // truncated underneath us by another process is the one hazard, as for safetensors.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
        let (metadata, tensors) =
            parse(&map).map_err(|message| ModelError::Gguf { path: path.to_path_buf(), message })?;
        Ok(Self { path: path.to_path_buf(), map, metadata, tensors })
    }

    fn error(&self, message: impl Into<String>) -> ModelError {
        ModelError::Gguf { path: self.path.clone(), message: message.into() }
    }

    fn meta_str(&self, key: &str) -> Option<&str> {
        self.metadata.get(key).and_then(Value::as_str)
    }

    fn meta_u64(&self, key: &str) -> Option<u64> {
        self.metadata.get(key).and_then(Value::as_u64)
    }

    fn meta_f64(&self, key: &str) -> Option<f64> {
        self.metadata.get(key).and_then(Value::as_f64)
    }

    fn has_tensor(&self, name: &str) -> bool {
        self.tensors.iter().any(|t| t.name == name)
    }

    /// `general.architecture`, checked to be one tandem runs.
    pub fn architecture(&self) -> Result<&str, ModelError> {
        let arch = self.meta_str("general.architecture").ok_or_else(|| self.error("no general.architecture"))?;
        match arch {
            "llama" | "qwen2" | "qwen3" => Ok(arch),
            other => Err(ModelError::UnsupportedArchitecture {
                name: format!("{other} (GGUF; supported: llama, qwen2, qwen3)"),
            }),
        }
    }

    /// The model's shape as the config.json an HF directory would hold.
    pub fn config_json(&self) -> Result<Value, ModelError> {
        let arch = self.architecture()?;
        let key = |k: &str| format!("{arch}.{k}");
        let need = |k: &str| self.meta_u64(&key(k)).ok_or_else(|| self.error(format!("no {}", key(k))));
        let hidden = need("embedding_length")?;
        let heads = need("attention.head_count")?;
        let kv_heads = self.meta_u64(&key("attention.head_count_kv")).unwrap_or(heads);
        if heads == 0 {
            return Err(self.error(format!("{} is 0", key("attention.head_count"))));
        }
        let head_dim = self.meta_u64(&key("attention.key_length")).unwrap_or(hidden / heads);
        if let Some(rot) = self.meta_u64(&key("rope.dimension_count")) {
            if rot != head_dim {
                return Err(ModelError::UnsupportedConfig(format!(
                    "RoPE on {rot} of {head_dim} head dimensions (partial rotary)"
                )));
            }
        }
        if self.meta_str(&key("rope.scaling.type")).is_some_and(|t| t != "none") || self.has_tensor("rope_freqs.weight")
        {
            return Err(ModelError::UnsupportedConfig("RoPE scaling from GGUF metadata".into()));
        }
        // The vocabulary: the tokenizer's, else the key, else the embedding's rows (as llama.cpp).
        let embed_rows =
            self.tensors.iter().find(|t| t.name == "token_embd.weight").and_then(|t| t.dims.get(1).copied());
        let vocab = match self.metadata.get("tokenizer.ggml.tokens") {
            Some(Value::Array(tokens)) => tokens.len() as u64,
            _ => self
                .meta_u64(&key("vocab_size"))
                .or(embed_rows)
                .ok_or_else(|| self.error(format!("no {}", key("vocab_size"))))?,
        };
        let hf_arch = match arch {
            "qwen3" => "Qwen3ForCausalLM",
            "qwen2" => "Qwen2ForCausalLM",
            _ => "LlamaForCausalLM",
        };
        let mut cfg = json!({
            "architectures": [hf_arch],
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": need("feed_forward_length")?,
            "num_hidden_layers": need("block_count")?,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "rms_norm_eps": self.meta_f64(&key("attention.layer_norm_rms_epsilon")).unwrap_or(1e-6),
            "rope_theta": self.meta_f64(&key("rope.freq_base")).unwrap_or(10000.0),
            "max_position_embeddings": need("context_length")?,
            "tie_word_embeddings": !self.has_tensor("output.weight"),
            "attention_bias": self.has_tensor("blk.0.attn_q.bias") && arch != "qwen2",
            "hidden_act": "silu",
        });
        if let Some(eos) = self.meta_u64("tokenizer.ggml.eos_token_id") {
            cfg["eos_token_id"] = json!(eos);
        }
        Ok(cfg)
    }

    /// Every tensor dequantized to f32 under its HF name (Llama's q and k rows put back in
    /// HF's order: llama.cpp's converter interleaves each head's two rotary halves).
    pub fn weights(&self) -> Result<WeightMap, ModelError> {
        self.load_weights(false)
    }

    /// As [`GgufFile::weights`], but matrices stored in a block format stay in it
    /// ([`WeightMap::quantized`]; the CPU engine reads them as stored). Vectors are f32.
    pub fn weights_quantized(&self) -> Result<WeightMap, ModelError> {
        self.load_weights(true)
    }

    fn load_weights(&self, keep_quantized: bool) -> Result<WeightMap, ModelError> {
        let arch = self.architecture()?;
        let heads = self.meta_u64(&format!("{arch}.attention.head_count")).unwrap_or(1) as usize;
        let kv_heads = self.meta_u64(&format!("{arch}.attention.head_count_kv")).map_or(heads, |v| v as usize);
        let mut map = WeightMap::new();
        for t in &self.tensors {
            let name =
                hf_name(&t.name).ok_or_else(|| self.error(format!("tensor `{}` has no Hugging Face name", t.name)))?;
            let bytes = &self.map[t.start..t.start + t.len];
            let shape: Vec<usize> = t.dims.iter().rev().map(|&d| d as usize).collect();
            // Llama's q and k rows go back to HF's order.
            let rotary_heads = if arch != "llama" {
                None
            } else if name.ends_with("q_proj.weight") || name.ends_with("q_proj.bias") {
                Some(heads)
            } else if name.ends_with("k_proj.weight") || name.ends_with("k_proj.bias") {
                Some(kv_heads)
            } else {
                None
            };
            if let (true, Some(ty), &[rows, cols]) = (keep_quantized, QuantType::from_ggml(t.ggml_type), &shape[..]) {
                let what = |m: String| self.error(format!("{}: {m}", t.name));
                let mut matrix = QuantMatrix::new(ty, rows, cols, bytes.to_vec()).map_err(what)?;
                if let Some(h) = rotary_heads {
                    matrix = matrix.with_rows(&rotary_row_order(rows, h).map_err(what)?).map_err(what)?;
                }
                map.insert_quantized(name, matrix);
                continue;
            }
            let mut data = dequantize(t, bytes).map_err(|m| self.error(m))?;
            if let Some(h) = rotary_heads {
                data = unpermute_rotary_rows(&data, shape[0], h).map_err(|m| self.error(format!("{}: {m}", t.name)))?;
            }
            map.insert(name, Tensor { shape, data });
        }
        Ok(map)
    }

    /// The tokenizer.json and tokenizer_config.json an HF directory would hold, rebuilt from the
    /// `tokenizer.*` metadata; `None` when the file has none.
    pub fn tokenizer_json(&self) -> Result<Option<(Value, Value)>, ModelError> {
        let Some(model) = self.meta_str("tokenizer.ggml.model") else { return Ok(None) };
        if model != "gpt2" {
            return Err(self.error(format!(
                "tokenizer.ggml.model `{model}` (supported: gpt2, the byte-level BPE of Llama 3, Qwen and SmolLM)"
            )));
        }
        let strings = |key: &str| -> Result<Vec<&str>, ModelError> {
            match self.metadata.get(key) {
                Some(Value::Array(a)) => a
                    .iter()
                    .map(|v| v.as_str().ok_or_else(|| self.error(format!("{key} holds a non-string"))))
                    .collect(),
                _ => Err(self.error(format!("no {key} array"))),
            }
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        let merges = strings("tokenizer.ggml.merges")?;
        let types: Vec<u64> = match self.metadata.get("tokenizer.ggml.token_type") {
            Some(Value::Array(a)) => a.iter().map(|v| v.as_u64().unwrap_or(1)).collect(),
            _ => vec![1; tokens.len()],
        };
        let pre = self.meta_str("tokenizer.ggml.pre").unwrap_or("gpt-2");
        let byte_level = |regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": regex});
        let split = |pattern: &str| json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false});
        let pre_tokenizer = match pre {
            "gpt-2" => byte_level(true),
            "smollm" => json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
            "qwen2" => json!({"type": "Sequence", "pretokenizers": [
                split(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
                byte_level(false)]}),
            "llama-bpe" => json!({"type": "Sequence", "pretokenizers": [
                split(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
                byte_level(false)]}),
            other => {
                return Err(
                    self.error(format!("tokenizer.ggml.pre `{other}` (supported: gpt-2, smollm, qwen2, llama-bpe)"))
                )
            }
        };
        let vocab: serde_json::Map<String, Value> =
            tokens.iter().enumerate().map(|(i, t)| (t.to_string(), json!(i))).collect();
        // Control (3) and user-defined (4) tokens are matched whole before the BPE, as HF's
        // added tokens are; control ones are special (dropped when decoding with skip).
        let added: Vec<Value> = tokens
            .iter()
            .zip(&types)
            .enumerate()
            .filter(|(_, (_, &ty))| ty == 3 || ty == 4)
            .map(|(i, (t, &ty))| {
                json!({"id": i, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                       "normalized": false, "special": ty == 3})
            })
            .collect();
        let token_at = |key: &str| self.meta_u64(key).and_then(|id| tokens.get(id as usize)).map(|t| t.to_string());
        let bos = token_at("tokenizer.ggml.bos_token_id");
        let add_bos = self.metadata.get("tokenizer.ggml.add_bos_token").and_then(Value::as_bool).unwrap_or(false);
        let post_processor = match (&bos, self.meta_u64("tokenizer.ggml.bos_token_id")) {
            (Some(bos), Some(id)) if add_bos => json!({
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {bos.as_str(): {"id": bos, "ids": [id], "tokens": [bos]}},
            }),
            _ => Value::Null,
        };
        let tokenizer = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": if pre == "qwen2" { json!({"type": "NFC"}) } else { Value::Null },
            "pre_tokenizer": pre_tokenizer,
            "post_processor": post_processor,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                      "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                      "vocab": vocab, "merges": merges},
        });
        let mut config = json!({});
        if let Some(t) = bos {
            config["bos_token"] = json!(t);
        }
        if let Some(t) = token_at("tokenizer.ggml.eos_token_id") {
            config["eos_token"] = json!(t);
        }
        if let Some(t) = self.meta_str("tokenizer.chat_template") {
            config["chat_template"] = json!(t);
        }
        Ok(Some((tokenizer, config)))
    }
}

/// The HF name of a llama.cpp tensor name.
fn hf_name(gguf: &str) -> Option<String> {
    let fixed = match gguf {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(n) = fixed {
        return Some(n.to_string());
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (part, kind) = rest.rsplit_once('.')?;
    let hf = match part {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    matches!(kind, "weight" | "bias").then(|| format!("model.layers.{layer}.{hf}.{kind}"))
}

/// HF's row order of a Llama q or k projection from llama.cpp's: within each head, GGUF row
/// `2j + s` is HF row `s * head_dim / 2 + j` (s: which rotary half, j: the pair). Entry `i` is
/// the GGUF row that becomes HF row `i`.
fn rotary_row_order(rows: usize, heads: usize) -> Result<Vec<usize>, String> {
    if heads == 0 || !rows.is_multiple_of(heads) || !(rows / heads).is_multiple_of(2) {
        return Err(format!("{rows} rows do not split into {heads} heads of rotary pairs"));
    }
    let head_dim = rows / heads;
    let half = head_dim / 2;
    let mut order = vec![0; rows];
    for h in 0..heads {
        for s in 0..2 {
            for j in 0..half {
                order[h * head_dim + s * half + j] = h * head_dim + 2 * j + s;
            }
        }
    }
    Ok(order)
}

fn unpermute_rotary_rows(data: &[f32], rows: usize, heads: usize) -> Result<Vec<f32>, String> {
    let order = rotary_row_order(rows, heads)?;
    if !data.len().is_multiple_of(rows) {
        return Err(format!("{} values are not {rows} rows", data.len()));
    }
    let cols = data.len() / rows;
    Ok(order.iter().flat_map(|&r| &data[r * cols..(r + 1) * cols]).copied().collect())
}

/// A bounds-checked reader over the file's bytes.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], String> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        let end = end.ok_or_else(|| format!("truncated: {what} at byte {} runs past the end of the file", self.pos))?;
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], String> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32, String> {
        self.array::<4>(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64, String> {
        self.array::<8>(what).map(u64::from_le_bytes)
    }

    /// A length-prefixed string; the length is checked against what is left before anything
    /// is allocated.
    fn string(&mut self, what: &str) -> Result<String, String> {
        let len = self.u64(what)?;
        let len = usize::try_from(len).map_err(|_| format!("{what}: length {len} is too large"))?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| format!("{what} is not UTF-8"))
    }

    fn value(&mut self, ty: u32, what: &str, depth: usize) -> Result<Value, String> {
        Ok(match ty {
            0 => json!(self.array::<1>(what)?[0]),
            1 => json!(self.array::<1>(what)?[0] as i8),
            2 => json!(u16::from_le_bytes(self.array::<2>(what)?)),
            3 => json!(i16::from_le_bytes(self.array::<2>(what)?)),
            4 => json!(self.u32(what)?),
            5 => json!(i32::from_le_bytes(self.array::<4>(what)?)),
            6 => json!(f32::from_le_bytes(self.array::<4>(what)?) as f64),
            7 => json!(self.array::<1>(what)?[0] != 0),
            8 => json!(self.string(what)?),
            9 => {
                if depth > 2 {
                    return Err(format!("{what}: arrays nested too deep"));
                }
                let elem = self.u32(what)?;
                let count = self.u64(what)?;
                // Every element takes at least one byte: a count past what is left is a lie,
                // refused before the vector is sized by it.
                let left = (self.bytes.len() - self.pos) as u64;
                if count > left {
                    return Err(format!("{what}: {count} array elements in {left} bytes"));
                }
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(elem, what, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => json!(self.u64(what)?),
            11 => json!(i64::from_le_bytes(self.array::<8>(what)?)),
            12 => json!(f64::from_le_bytes(self.array::<8>(what)?)),
            other => return Err(format!("{what}: unknown metadata value type {other}")),
        })
    }
}

/// Parses the header, metadata and tensor table; checks every tensor's data lies in the file.
fn parse(bytes: &[u8]) -> Result<(HashMap<String, Value>, Vec<GgufTensor>), String> {
    let mut c = Cursor { bytes, pos: 0 };
    if c.u32("the magic")? != MAGIC {
        return Err("not a GGUF file (no GGUF magic)".into());
    }
    let version = c.u32("the version")?;
    if !(2..=3).contains(&version) {
        return Err(format!("GGUF version {version} (supported: 2 and 3)"));
    }
    let tensor_count = c.u64("the tensor count")?;
    let kv_count = c.u64("the metadata count")?;
    let left = bytes.len() as u64;
    if tensor_count > left || kv_count > left {
        return Err(format!("{tensor_count} tensors and {kv_count} metadata entries in a {left}-byte file"));
    }
    let mut metadata = HashMap::new();
    for i in 0..kv_count {
        let key = c.string(&format!("metadata key {i}"))?;
        let ty = c.u32(&key)?;
        let value = c.value(ty, &key, 0)?;
        metadata.insert(key, value);
    }
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => v.as_u64().filter(|a| a.is_power_of_two()).ok_or("general.alignment is not a power of two")?,
    };
    let mut infos = Vec::new();
    for i in 0..tensor_count {
        let name = c.string(&format!("tensor {i}'s name"))?;
        let n_dims = c.u32(&name)?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(format!("tensor `{name}` has {n_dims} dimensions"));
        }
        let dims = (0..n_dims).map(|_| c.u64(&name)).collect::<Result<Vec<_>, _>>()?;
        let ggml_type = c.u32(&name)?;
        let offset = c.u64(&name)?;
        infos.push((name, dims, ggml_type, offset));
    }
    let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
    let mut tensors = Vec::with_capacity(infos.len());
    for (name, dims, ggml_type, offset) in infos {
        let Some(&(_, tname, block, block_bytes)) = TYPES.iter().find(|t| t.0 == ggml_type) else {
            return Err(format!(
                "tensor `{name}` has type {} (supported: {})",
                type_name(ggml_type),
                TYPES.iter().map(|t| t.1).collect::<Vec<_>>().join(", ")
            ));
        };
        let elements =
            dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d)).ok_or(format!("tensor `{name}`: size overflows"))?;
        if !dims[0].is_multiple_of(block as u64) {
            return Err(format!("tensor `{name}` ({tname}): rows of {} are not whole {block}-element blocks", dims[0]));
        }
        let len = (elements / block as u64)
            .checked_mul(block_bytes as u64)
            .ok_or(format!("tensor `{name}`: size overflows"))?;
        let start = data_start.checked_add(offset).ok_or(format!("tensor `{name}`: offset overflows"))?;
        let end = start.checked_add(len).filter(|&e| e <= bytes.len() as u64);
        if end.is_none() {
            return Err(format!(
                "truncated: tensor `{name}` ({tname}, {len} bytes at {start}) runs past the end of the {}-byte file",
                bytes.len()
            ));
        }
        tensors.push(GgufTensor { name, dims, ggml_type, start: start as usize, len: len as usize });
    }
    Ok((metadata, tensors))
}

/// A tensor's values as f32, in its stored order. `bytes` is exactly its data.
pub fn dequantize(t: &GgufTensor, bytes: &[u8]) -> Result<Vec<f32>, String> {
    let n = t.elements() as usize;
    if t.ggml_type == 0 {
        return Ok(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect());
    }
    let ty = QuantType::from_ggml(t.ggml_type)
        .ok_or_else(|| format!("tensor `{}` has type {}", t.name, type_name(t.ggml_type)))?;
    if !(n.is_multiple_of(ty.block_elems()) && bytes.len() == n / ty.block_elems() * ty.block_bytes()) {
        return Err(format!("tensor `{}`: {} bytes do not hold {n} values of {}", t.name, bytes.len(), t.type_name()));
    }
    let mut out = vec![0.0f32; n];
    dequantize_into(ty, bytes, &mut out);
    Ok(out)
}
