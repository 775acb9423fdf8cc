//! The model's weights on the device: uploaded (or generated, for a preset) once at load and
//! never written again. Q/k/v and gate/up are stacked row-wise, as on the CPU backend; bf16
//! gate/up rows are then interleaved for the fused decode projection (FP8 ones stay stacked,
//! so that their 128 x 128 blocks keep one scale each).

use std::collections::HashMap;

use tandem_compute::cpu::RopeTable;
use tandem_compute::cuda::{ops, CudaDevice, DevBuf};

use crate::config::ModelConfig;
use crate::presets::{tensor_stream, uniform_amplitude};
use crate::source::{ModelSource, ModelSpec, Quantization};
use crate::ModelError;

/// A `[out, in]` bf16 or FP8 weight with an optional bias.
pub(super) struct Linear {
    /// The bf16 weight (one unused element when the weight is [`Linear::fp8`]).
    pub weight: DevBuf<u16>,
    /// The weight in FP8 (`--quantization fp8`): e4m3 bytes and a scale per row and 128 columns.
    pub fp8: Option<Fp8Weight>,
    pub bias: Option<DevBuf<u16>>,
    pub out_dim: usize,
    pub in_dim: usize,
}

/// An FP8 weight's buffers ([`ops::Fp8Matrix`]).
pub(super) struct Fp8Weight {
    pub q: DevBuf<u8>,
    pub scales: DevBuf<f32>,
    /// One scale per 128 x 128 block, where every stacked part starts on a block's first row.
    pub block_scales: Option<DevBuf<f32>>,
}

impl Linear {
    /// The FP8 weight as the kernels take it, if the weight is FP8.
    pub fn fp8_matrix(&self) -> Option<ops::Fp8Matrix> {
        let f = self.fp8.as_ref()?;
        let block_scales = f.block_scales.as_ref().map_or(0, DevBuf::ptr);
        Some(ops::Fp8Matrix { q: f.q.ptr(), scales: f.scales.ptr(), block_scales, n: self.out_dim, k: self.in_dim })
    }

    /// The weight quantized to FP8 on the device as an FP8 checkpoint holds it
    /// ([`ops::quantize_fp8`]), each stacked part of `parts` rows on its own (its 128 x 128
    /// blocks start at its first row, as in the part's own checkpoint tensor); the bf16 weight
    /// is freed.
    fn into_fp8(self, dev: &CudaDevice, parts: &[usize]) -> Result<Self, ModelError> {
        let (n, k) = (self.out_dim, self.in_dim);
        let kb = ops::Fp8Matrix::scale_cols(k);
        let (q, scales) = (dev.zeros::<u8>(n * k)?, dev.zeros::<f32>(n * kb)?);
        let mut row = 0;
        for &rows in parts {
            let part =
                ops::Fp8Matrix { q: q.ptr_at(row * k), scales: scales.ptr_at(row * kb), block_scales: 0, n: rows, k };
            // Safety: the part's rows lie within both buffers (the parts sum to `n`), and the bf16
            // weight holds them; it is freed only after the synchronize below.
            unsafe { ops::quantize_fp8(dev, self.weight.ptr_at(row * k), part)? };
            row += rows;
        }
        dev.synchronize()?;
        // Every part's 128-row blocks start on the matrix's: each block's rows share one scale,
        // which the block-scaled GEMM reads once a block.
        let block_scales = match parts.iter().all(|p| p.is_multiple_of(ops::FP8_BLOCK)) {
            true => {
                let rows = dev.read(&scales, n * kb)?;
                let blocks: Vec<f32> = rows.chunks(kb).step_by(ops::FP8_BLOCK).flatten().copied().collect();
                Some(dev.upload(&blocks)?)
            }
            false => None,
        };
        Ok(Self { weight: dev.zeros(0)?, fp8: Some(Fp8Weight { q, scales, block_scales }), ..self })
    }

    /// Bytes of weight one product reads.
    fn bytes(&self) -> usize {
        match &self.fp8 {
            Some(_) => self.out_dim * self.in_dim + self.out_dim * ops::Fp8Matrix::scale_cols(self.in_dim) * 4,
            None => self.out_dim * self.in_dim * 2,
        }
    }

    /// The weight as a decode projection ([`ops::Gemv`]) takes it: (bf16 weight, 0) or (FP8
    /// bytes, row scales).
    pub fn gemv_weight(&self) -> (u64, u64) {
        match &self.fp8 {
            Some(f) => (f.q.ptr(), f.scales.ptr()),
            None => (self.weight.ptr(), 0),
        }
    }

    /// The bias's address, or 0 without one (the kernels' convention).
    pub fn bias_ptr(&self) -> u64 {
        self.bias.as_ref().map_or(0, DevBuf::ptr)
    }

    /// How many K slices this projection's batch-invariant product is cut into when the
    /// residual add takes its output (o and down; `ops::invariant_slices`); 1 with a bias,
    /// which the slices' fold does not add.
    pub fn invariant_slices(&self, dev: &CudaDevice) -> usize {
        if self.bias.is_some() {
            return 1;
        }
        ops::invariant_slices(self.in_dim, dev.tuning().invariant_slice_cols)
    }
}

pub(super) struct Layer {
    pub input_norm: DevBuf<u16>,
    pub qkv: Linear,
    pub q_norm: Option<DevBuf<u16>>,
    pub k_norm: Option<DevBuf<u16>>,
    pub o: Linear,
    pub post_norm: DevBuf<u16>,
    /// Gate and up rows interleaved ([`ops::interleave_rows`]); FP8 ones stacked (gate, then up).
    pub gate_up: Linear,
    pub down: Linear,
}

/// Every weight of the model, and the RoPE tables.
pub(super) struct Weights {
    pub embed: DevBuf<u16>,
    pub layers: Vec<Layer>,
    pub norm: DevBuf<u16>,
    /// `None`: tied to `embed`.
    pub lm_head: Option<DevBuf<u16>>,
    pub rope_cos: DevBuf<f32>,
    pub rope_sin: DevBuf<f32>,
    /// Bytes of weights one forward reads (bf16), the numerator of the decode floor.
    pub bytes: usize,
    /// Names the weights for the KV handshake: architecture, shape and a hash of the embedding.
    pub fingerprint: String,
    /// With FP8 decoder weights: room for the largest one in bf16, for products of more rows
    /// than [`ops::FP8_GEMV_MAX_TOKENS`] ([`ops::matmul_t_fp8`]).
    pub fp8_scratch: Option<DevBuf<u16>>,
    /// With the block-scaled FP8 GEMM enabled ([`Weights::enable_fp8_block_gemm`]): room for a
    /// step's activations as e4m3 bytes and their scales, and its rows and columns.
    pub fp8_acts: Option<(DevBuf<u8>, DevBuf<f32>, usize, usize)>,
}

impl Weights {
    /// Whether the decoder's linear weights are FP8.
    pub fn fp8(&self) -> bool {
        self.fp8_scratch.is_some()
    }

    /// Where FP8 products of many rows work (zeros without FP8 weights).
    pub fn fp8_scratch(&self) -> ops::Fp8Scratch {
        let weight = self.fp8_scratch.as_ref().map_or(0, DevBuf::ptr);
        match &self.fp8_acts {
            Some((q, scales, tokens, cols)) => {
                ops::Fp8Scratch { weight, acts: q.ptr(), act_scales: scales.ptr(), tokens: *tokens, cols: *cols }
            }
            None => ops::Fp8Scratch { weight, ..Default::default() },
        }
    }

    /// Whether gate/up's product is stacked (gate, then up: FP8 weights) rather than interleaved.
    pub fn gate_up_stacked(&self) -> bool {
        self.fp8()
    }

    /// FP8 products of more than [`ops::FP8_GEMV_MAX_TOKENS`] rows, up to `max_tokens`, with FP8
    /// activations on cuBLASLt's block-scaled GEMM (`--cuda-tune fp8_block_gemm=1`): loads it
    /// and allocates the activations' room. Products without block scales keep the bf16 copy.
    pub fn enable_fp8_block_gemm(&mut self, dev: &CudaDevice, max_tokens: usize) -> Result<(), ModelError> {
        dev.enable_fp8_gemm()?;
        let cols = self.layers.iter().flat_map(|l| [&l.qkv, &l.o, &l.gate_up, &l.down]).map(|l| l.in_dim).max();
        let cols = cols.unwrap_or(0);
        let scales = ops::Fp8Scratch::act_scale_bytes(max_tokens, cols) / 4;
        self.fp8_acts = Some((dev.zeros::<u8>(max_tokens * cols)?, dev.zeros::<f32>(scales)?, max_tokens, cols));
        Ok(())
    }

    /// The shapes the kernels take; an error names what does not fit.
    pub fn check_config(cfg: &ModelConfig) -> Result<(), ModelError> {
        if cfg.moe.is_some() {
            return Err(ModelError::UnsupportedConfig(format!(
                "{} (a mixture of experts) does not run on CUDA yet; serve it with --device cpu",
                cfg.architecture.hf_name()
            )));
        }
        if !cfg.hidden_size.is_multiple_of(4) {
            return Err(ModelError::UnsupportedConfig(format!(
                "hidden size {} on CUDA (must be a multiple of 4)",
                cfg.hidden_size
            )));
        }
        if cfg.head_dim > 256 || !cfg.head_dim.is_multiple_of(32) {
            return Err(ModelError::UnsupportedConfig(format!(
                "head_dim {} on CUDA (supported: multiples of 32 up to 256)",
                cfg.head_dim
            )));
        }
        if !cfg.num_heads.is_multiple_of(cfg.num_kv_heads) {
            return Err(ModelError::UnsupportedConfig(format!(
                "{} query heads over {} KV heads on CUDA (must divide evenly)",
                cfg.num_heads, cfg.num_kv_heads
            )));
        }
        Ok(())
    }

    /// Puts `spec`'s weights on `dev`: a preset's generated there, a checkpoint's read on the
    /// host, converted to bf16 and uploaded.
    pub fn load(dev: &CudaDevice, spec: &ModelSpec) -> Result<Self, ModelError> {
        let cfg = &spec.config;
        Self::check_config(cfg)?;
        let started = std::time::Instant::now();
        // `--quantization fp8`: the decoder's linear weights are quantized here, on the device,
        // from the weights as read (not the host's rounding of them).
        let fp8 = spec.quantization == Some(Quantization::Fp8);
        let mut builder = WeightBuilder::new(dev, spec)?;
        let (h, hd, i) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
        let (q_dim, kv_dim) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
        let embed = builder.tensor(&["model.embed_tokens.weight"], &[cfg.vocab_size], h)?;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for l in 0..cfg.num_layers {
            let n = |s: &str| format!("model.layers.{l}.{s}");
            let linear = |b: &mut WeightBuilder<'_>, names: &[(&str, usize)], in_dim: usize, bias: bool| {
                let ws: Vec<String> = names.iter().map(|(s, _)| n(&format!("{s}.weight"))).collect();
                let rows: Vec<usize> = names.iter().map(|(_, r)| *r).collect();
                let wrefs: Vec<&str> = ws.iter().map(String::as_str).collect();
                let weight = b.tensor(&wrefs, &rows, in_dim)?;
                let bias = if bias {
                    let bs: Vec<String> = names.iter().map(|(s, _)| n(&format!("{s}.bias"))).collect();
                    let brefs: Vec<&str> = bs.iter().map(String::as_str).collect();
                    Some(b.tensor(&brefs, &rows, 1)?)
                } else {
                    None
                };
                let l = Linear { weight, fp8: None, bias, out_dim: rows.iter().sum(), in_dim };
                let l = if fp8 { l.into_fp8(dev, &rows)? } else { l };
                b.bytes = b.bytes + l.bytes() - l.out_dim * l.in_dim * 2;
                Ok::<_, ModelError>(l)
            };
            let qkv = linear(
                &mut builder,
                &[("self_attn.q_proj", q_dim), ("self_attn.k_proj", kv_dim), ("self_attn.v_proj", kv_dim)],
                h,
                cfg.qkv_bias,
            )?;
            let o = linear(&mut builder, &[("self_attn.o_proj", h)], q_dim, cfg.o_bias)?;
            let gate_up = linear(&mut builder, &[("mlp.gate_proj", i), ("mlp.up_proj", i)], h, cfg.mlp_bias)?;
            let gate_up = if fp8 { gate_up } else { interleave_gate_up(dev, gate_up)? };
            let down = linear(&mut builder, &[("mlp.down_proj", h)], i, cfg.mlp_bias)?;
            let (q_norm, k_norm) = if cfg.qk_norm {
                (
                    Some(builder.tensor(&[&n("self_attn.q_norm.weight")], &[hd], 1)?),
                    Some(builder.tensor(&[&n("self_attn.k_norm.weight")], &[hd], 1)?),
                )
            } else {
                (None, None)
            };
            layers.push(Layer {
                input_norm: builder.tensor(&[&n("input_layernorm.weight")], &[h], 1)?,
                qkv,
                q_norm,
                k_norm,
                o,
                post_norm: builder.tensor(&[&n("post_attention_layernorm.weight")], &[h], 1)?,
                gate_up,
                down,
            });
        }
        let norm = builder.tensor(&["model.norm.weight"], &[h], 1)?;
        let lm_head = if cfg.tie_word_embeddings && !builder.has("lm_head.weight") {
            None
        } else {
            Some(builder.tensor(&["lm_head.weight"], &[cfg.vocab_size], h)?)
        };
        let bytes = builder.bytes;
        drop(builder);
        let fp8_scratch = match fp8 {
            true => {
                let linears = layers.iter().flat_map(|l| [&l.qkv, &l.o, &l.gate_up, &l.down]);
                Some(dev.zeros::<u16>(linears.map(|l| l.out_dim * l.in_dim).max().unwrap_or(0))?)
            }
            false => None,
        };
        tracing::info!(
            device = %dev.describe(),
            weights_gib = format!("{:.2}", bytes as f64 / (1u64 << 30) as f64),
            secs = format!("{:.1}", started.elapsed().as_secs_f64()),
            "weights on the GPU"
        );
        let rope = RopeTable::new(hd, cfg.rope_theta, cfg.rope_scaling, spec.max_model_len);
        let fingerprint = fingerprint(dev, cfg, &embed, if fp8 { "fp8" } else { "bf16" })?;
        Ok(Self {
            embed,
            layers,
            norm,
            lm_head,
            rope_cos: dev.upload(rope.cos())?,
            rope_sin: dev.upload(rope.sin())?,
            bytes,
            fingerprint,
            fp8_scratch,
            fp8_acts: None,
        })
    }

    /// The output projection's weight (the embedding when tied).
    pub fn head(&self) -> &DevBuf<u16> {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Lets the skinny kernels serve batch-invariant products of few rows if they give
    /// cuBLASLt's bits for the first layer's projections on this GPU (every layer has the
    /// first's shapes): the K-sliced o and down products always (`slices`: how many each is cut
    /// into), the others and the head only when tuned so ([`tandem_compute::cuda::CudaTuning`]'s
    /// `invariant_skinny`). Warns saying why not otherwise.
    pub fn verify_skinny(&self, dev: &CudaDevice, cfg: &ModelConfig) -> Result<(), ModelError> {
        let mut shapes = vec![];
        let all = dev.tuning().invariant_skinny;
        let shape = |lin: &Linear, slices: usize| ops::SkinnyShape {
            weight: lin.weight.ptr(),
            n: lin.out_dim,
            k: lin.in_dim,
            f32_out: slices > 1,
            slices,
        };
        if let Some(l) = self.layers.first() {
            for (lin, sliced) in [(&l.qkv, false), (&l.o, true), (&l.gate_up, false), (&l.down, true)] {
                let s = if sliced { lin.invariant_slices(dev) } else { 1 };
                if s > 1 || all {
                    shapes.push(shape(lin, s));
                }
            }
        }
        if all {
            shapes.push(ops::SkinnyShape {
                weight: self.head().ptr(),
                n: cfg.vocab_size,
                k: cfg.hidden_size,
                f32_out: true,
                slices: 1,
            });
        }
        if !shapes.is_empty() {
            // Safety: every address is a live weight buffer of its [n, k] bf16 shape.
            match unsafe { ops::verify_skinny(dev, &shapes)? } {
                None => tracing::info!(
                    "batch-invariant products of up to {} rows on the skinny kernels",
                    ops::SKINNY_MAX_TOKENS
                ),
                Some(why) => tracing::warn!(
                    "batch-invariant products go to cuBLASLt at every row count (slower decode at small \
                     batches): the skinny kernels are off, {why}"
                ),
            }
        }
        if dev.tuning().invariant_fused_norm {
            self.verify_fused_norms(dev, cfg)?;
        }
        Ok(())
    }

    /// Lets batch-invariant steps of few tokens fold their norms into the qkv and gate/up
    /// products (`invariant_fused_norm`) if the fused kernel gives the unfused path's bits for
    /// the first layer's (every layer has the first's shapes); warns saying why not otherwise.
    fn verify_fused_norms(&self, dev: &CudaDevice, cfg: &ModelConfig) -> Result<(), ModelError> {
        let Some(l) = self.layers.first() else { return Ok(()) };
        let sliced = l.o.invariant_slices(dev) > 1 || l.down.invariant_slices(dev) > 1;
        let why = if sliced {
            Some("the o or down product is cut into K slices (invariant_slice_cols)".to_string())
        } else if l.gate_up.bias.is_some() {
            Some("the gate/up product has a bias".to_string())
        } else {
            let eps = cfg.rms_norm_eps;
            let shape = |lin: &Linear, norm: &DevBuf<u16>, output| ops::SkinnyNormShape {
                weight: lin.weight.ptr(),
                n: lin.out_dim,
                k: lin.in_dim,
                norm_weight: norm.ptr(),
                eps,
                output,
            };
            let shapes = [
                shape(&l.qkv, &l.input_norm, ops::SkinnyNormOutput::Product),
                shape(&l.gate_up, &l.post_norm, ops::SkinnyNormOutput::SiluMul),
            ];
            // The products of such a step without a norm in front, where the plain kernel serves
            // them (ops::skinny_wg_serves: the wide ones).
            let plain = |lin: &Linear| ops::SkinnyShape {
                weight: lin.weight.ptr(),
                n: lin.out_dim,
                k: lin.in_dim,
                f32_out: false,
                slices: 1,
            };
            let head = ops::SkinnyShape {
                weight: self.head().ptr(),
                n: cfg.vocab_size,
                k: cfg.hidden_size,
                f32_out: true,
                slices: 1,
            };
            let plain = [plain(&l.qkv), plain(&l.o), plain(&l.gate_up), plain(&l.down), head];
            // Safety: every address is a live weight buffer of its shape.
            unsafe { ops::verify_skinny_norm(dev, &shapes, &plain)? }
        };
        match why {
            None => tracing::info!(
                "batch-invariant steps of up to {} tokens take their norms inside the qkv and gate/up products",
                ops::SKINNY_NORM_MAX_TOKENS
            ),
            Some(why) => tracing::warn!("invariant_fused_norm is off: {why}"),
        }
        Ok(())
    }
}

/// `arch/shape/dtype-hash`: a hash of every 16th of the embedding's first 64 Ki values, so that
/// two engines serving different weights of the same shape refuse to pair (`dtype`, the decoder
/// weights' bf16 or fp8: so do a model and its FP8 rounding).
fn fingerprint(dev: &CudaDevice, cfg: &ModelConfig, embed: &DevBuf<u16>, dtype: &str) -> Result<String, ModelError> {
    let sample = dev.read(embed, embed.len().min(1 << 16))?;
    let mut hsh = 0xcbf29ce484222325u64;
    for x in sample.iter().step_by(16) {
        hsh = (hsh ^ *x as u64).wrapping_mul(0x100000001b3);
    }
    Ok(format!(
        "{}/l{}h{}kv{}d{}v{}/{dtype}-{hsh:016x}",
        cfg.architecture.hf_name(),
        cfg.num_layers,
        cfg.hidden_size,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.vocab_size
    ))
}

/// `l` (bf16 gate rows, then up rows) with its rows (and bias) interleaved: gate row i, up row
/// i, ... so that a decode projection's warp holds both and applies SiLU-and-multiply itself.
fn interleave_gate_up(dev: &CudaDevice, l: Linear) -> Result<Linear, ModelError> {
    let (half, k) = (l.out_dim / 2, l.in_dim);
    // Rows of `cols` bf16 elements from `src` into `dst`.
    let interleave = |src: u64, dst: u64, cols: usize| -> Result<(), ModelError> {
        // Safety: source and destination both hold out_dim rows of `cols` bf16 elements (the
        // callers' buffers below); the source lives until the copies are done (synchronized
        // below).
        unsafe { ops::interleave_rows(dev, src, dst, half, cols)? };
        Ok(())
    };
    let weight = dev.zeros::<u16>(l.out_dim * k)?;
    interleave(l.weight.ptr(), weight.ptr(), k)?;
    let bias = match &l.bias {
        Some(b) => {
            let out = dev.zeros::<u16>(l.out_dim)?;
            interleave(b.ptr(), out.ptr(), 1)?;
            Some(out)
        }
        None => None,
    };
    // The copies are queued on the device's stream; finish them before `l`'s buffers go.
    dev.synchronize()?;
    Ok(Linear { weight, fp8: None, bias, out_dim: l.out_dim, in_dim: l.in_dim })
}

fn to_bf16_bits(xs: &[f32]) -> Vec<u16> {
    xs.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect()
}

/// Puts weights on the device: generated there for a preset, uploaded from the host for a
/// checkpoint. Tensors named together are stacked row-wise into one buffer.
struct WeightBuilder<'a> {
    dev: &'a CudaDevice,
    preset: Option<(u64, HashMap<String, f32>)>,
    host: Option<crate::WeightMap>,
    bytes: usize,
}

impl<'a> WeightBuilder<'a> {
    fn new(dev: &'a CudaDevice, spec: &ModelSpec) -> Result<Self, ModelError> {
        match &spec.source {
            ModelSource::Preset { preset, seed } => {
                let stds = preset.tensor_specs().into_iter().map(|(n, _, std)| (n, std)).collect();
                Ok(Self { dev, preset: Some((*seed, stds)), host: None, bytes: 0 })
            }
            // As read: `--quantization fp8` is done on the device (`Linear::into_fp8`).
            ModelSource::Dir(_) | ModelSource::Gguf(_) => {
                Ok(Self { dev, preset: None, host: Some(spec.host_weights_as_read()?), bytes: 0 })
            }
        }
    }

    fn has(&self, name: &str) -> bool {
        match (&self.preset, &self.host) {
            (Some((_, stds)), _) => stds.contains_key(name),
            (_, Some(w)) => w.contains(name),
            _ => false,
        }
    }

    /// Stacks tensors `names` (with `rows[i]` rows of `cols` each) into one bf16 buffer.
    fn tensor(&mut self, names: &[&str], rows: &[usize], cols: usize) -> Result<DevBuf<u16>, ModelError> {
        let total: usize = rows.iter().sum::<usize>() * cols;
        let mut buf = self.dev.zeros::<u16>(total)?;
        let mut offset = 0;
        for (name, &r) in names.iter().zip(rows) {
            let n = r * cols;
            match (&self.preset, &mut self.host) {
                (Some((seed, stds)), _) => {
                    let std =
                        *stds.get(*name).ok_or_else(|| ModelError::MissingTensor { name: (*name).to_string() })?;
                    let ptr = buf.ptr_at(offset);
                    // Safety: `buf` holds `total` elements and `offset + n <= total`; it is
                    // returned to the model, which keeps it for its life.
                    if std == 0.0 {
                        unsafe { ops::fill_bf16(self.dev, ptr, n as u64, 1.0)? };
                    } else {
                        let (stream, amp) = (tensor_stream(*seed, name), uniform_amplitude(std));
                        unsafe { ops::preset_uniform(self.dev, ptr, n as u64, stream, amp)? };
                    }
                }
                (_, Some(w)) => {
                    let shape: Vec<usize> = if cols == 1 { vec![r] } else { vec![r, cols] };
                    let data = w.take(name, &shape)?;
                    self.dev.write(&mut buf, offset, &to_bf16_bits(&data))?;
                }
                _ => unreachable!("a builder has a preset or host weights"),
            }
            offset += n;
        }
        self.bytes += total * 2;
        Ok(buf)
    }
}
