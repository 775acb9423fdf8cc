//! The forward pass, queued on the device's stream: it mirrors [`crate::Transformer::forward`]
//! step for step (same weights layout with q/k/v and gate/up stacked, same RoPE table, same
//! block-major KV layout); the residual stream and all reductions stay in f32, storage is bf16.
//!
//! Everything it launches depends only on the token count, the logit rows and the step counts,
//! so a decode step of a given size can be captured once as a CUDA graph and replayed.

use tandem_compute::cuda::ops::{
    self, AttnShape, FlashSplit, Gemv, GemvBuild, GemvInput, GemvOutput, PrefillSeqs, QkvRope, ResidualDelta,
    SkinnyNormOutput,
};
use tandem_compute::cuda::{fp8_act_scale_ld, kv_fence_ends, Communicator, CudaDevice, CudaError, DevBuf, KvFences};
use tandem_compute::KvDtype;

use super::kv_cache::DeviceKv;
use super::plan::DecodePlan;
use super::step::{StepBuffers, StepCounts};
use super::weights::{Layer, Linear, Weights};
use crate::config::ModelConfig;
use crate::ModelError;

/// Queues the forward for `t` tokens (metadata already in `step`) up to the logits of `rows`
/// rows, writing the step's activations and the new tokens' keys and values. `counts`: the
/// step's work counts (default: the prepared step's). With `allow_fused` off the step never
/// takes the fused decode path (to compare the two). With `fences`, the plain (prefill) path
/// records there when each group of layers has written its KV (`--cuda-tune kv_fence_groups`
/// groups, default 8: each group's KV can be copied while the later layers compute, so only the
/// last group's is left when the forward ends); the fused decode path records none. With
/// `comm`, the o and down products are summed over its ranks before the residual takes them.
#[allow(clippy::too_many_arguments)]
pub(super) fn forward(
    dev: &CudaDevice,
    cfg: &ModelConfig,
    weights: &Weights,
    plan: &DecodePlan,
    step: &mut StepBuffers,
    kv: &mut DeviceKv,
    comm: Option<&Communicator>,
    (t, rows): (usize, usize),
    counts: Option<StepCounts>,
    allow_fused: bool,
    fences: Option<&mut KvFences>,
) -> Result<(), ModelError> {
    let counts = counts.unwrap_or(step.counts);
    let fused = plan.fused_for(t, counts).filter(|_| allow_fused);
    if t > step.max_tokens || rows > step.max_seqs {
        return Err(ModelError::Device(format!("a forward of {t} tokens and {rows} rows exceeds its buffers")));
    }
    let pass = Pass { dev, cfg, w: weights, step, kv, comm };
    // Safety: the pass's buffers are the model's, alive for its life, sized at load for
    // `max_tokens` tokens and `max_seqs` rows (checked above); the metadata the kernels index
    // by was checked against the cache and tables when it was filled (see `Pass`).
    unsafe { pass.run(t, rows, counts, fused, fences) }
}

/// Where the input of a qkv or gate/up product is ([`Pass::norm_for`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum NormedRows {
    /// bf16 rows in the step's `act.normed`.
    Bf16,
    /// Rows rounded to e4m3 with their block scales in the FP8 scratch (`fp8_fused_norm`).
    Fp8,
}

/// One forward's view of the model: what it reads (weights, metadata) and where it writes
/// (activations, the cache), as the kernels take them, by device address.
///
/// Its launching methods are `unsafe` (the contract of `tandem_compute::cuda::ops`): the caller
/// guarantees that `step` was filled for this step (`StepBuffers::fill` checks positions, slots
/// and block tables against the cache and the tables' width), that `t` and the rows are within
/// the step buffers' sizes, and that every buffer outlives the queued launches (the model owns
/// them for its life and synchronizes before it reads results or drops them).
pub(super) struct Pass<'a> {
    pub dev: &'a CudaDevice,
    pub cfg: &'a ModelConfig,
    pub w: &'a Weights,
    pub step: &'a StepBuffers,
    pub kv: &'a DeviceKv,
    /// The tensor-parallel group the row-parallel products are summed over, if any.
    pub comm: Option<&'a Communicator>,
}

impl Pass<'_> {
    unsafe fn run(
        &self,
        t: usize,
        rows: usize,
        counts: StepCounts,
        fused: Option<(GemvBuild, GemvBuild)>,
        mut fences: Option<&mut KvFences>,
    ) -> Result<(), ModelError> {
        let (dev, cfg, a, m) = (self.dev, self.cfg, &self.step.act, self.step.layout);
        let h = cfg.hidden_size;
        ops::embed_gather(dev, self.w.embed.ptr(), self.step.at(m.tokens), a.tokens.ptr(), a.x.ptr(), t, h)?;
        if let Some((projections, o_projection)) = fused {
            return self.decode_layers(t, rows, counts, projections, o_projection);
        }
        let meta = self.step.attn_meta();
        let layers = &self.w.layers;
        // A batch-invariant step of few tokens adds the residual and takes the norm inside its
        // qkv and gate/up products (SiLU too), which write the residual's sum to the other
        // buffer: `resid` is where it is now, `pending` the down product not yet added to it.
        let fuse_norms = self.fuse_norms(t);
        let (mut resid, mut spare, mut pending) = (a.x.ptr(), a.x_alt.ptr(), 0u64);
        // Where the next qkv or gate/up product finds its input (`Pass::norm_for`).
        let mut normed = NormedRows::Bf16;
        if !fuse_norms {
            normed = self.norm_for(&layers[0].qkv, resid, ResidualDelta::None, layers[0].input_norm.ptr(), t)?;
        }
        let prefill = self.step.prefill_seqs(counts);
        let tuning = dev.tuning();
        let fence_ends = kv_fence_ends(layers.len(), tuning.kv_fence_groups, tuning.kv_fence_taper);
        let mut group_start = 0;
        // A batch-invariant step of narrow work items only (decode): their attention kernel does
        // the RoPE kernel's work too. Not where fences mark when a layer's KV is written (the
        // attention would write it after the mark).
        let narrow_rope = self.step.narrow_decode()
            && fences.is_none()
            && counts.decode == 0
            && counts.work > 0
            && counts.narrow == counts.work;
        for (li, layer) in layers.iter().enumerate() {
            // The qkv bias is added by the RoPE kernel.
            if fuse_norms {
                let out = SkinnyNormOutput::Product;
                self.normed_product(&layer.qkv, &layer.input_norm, resid, pending, spare, a.qkv.ptr(), out, t)?;
                std::mem::swap(&mut resid, &mut spare);
            } else {
                let norm = (resid, layer.input_norm.ptr());
                self.product_of_normed(&layer.qkv, normed, norm, a.qkv.ptr(), t)?;
            }
            let shape = if narrow_rope {
                self.attn_shape(li)
            } else {
                self.rope_and_row_attention(li, layer, t, counts, false)?
            };
            // The RoPE kernel wrote this layer's keys and values into the cache.
            if let Some(fences) = fences.as_deref_mut() {
                if fence_ends.contains(&(li + 1)) {
                    fences.record(dev, group_start..li + 1)?;
                    group_start = li + 1;
                }
            }
            let split = self.step.flash_split(counts);
            if narrow_rope {
                let rope = self.rope_args(layer);
                ops::flash_prefill_narrow_rope(dev, &rope, a.attn.ptr(), &prefill, &meta, &shape, split)?;
            } else {
                self.prefill_attention(&prefill, &shape, split)?;
            }
            let attn_out = self.all_reduce(self.residual_projection(&layer.o, a.attn.ptr(), t)?, t)?;
            // Down's product, where SiLU already fed it (FP8 weights, `fp8_fused_act`).
            let mut down = None;
            match attn_out {
                ResidualDelta::Bf16(delta) if fuse_norms => {
                    let out = SkinnyNormOutput::SiluMul;
                    self.normed_product(&layer.gate_up, &layer.post_norm, resid, delta, spare, a.act.ptr(), out, t)?;
                    std::mem::swap(&mut resid, &mut spare);
                }
                _ => {
                    normed = self.norm_for(&layer.gate_up, resid, attn_out, layer.post_norm.ptr(), t)?;
                    let norm = (resid, layer.post_norm.ptr());
                    self.product_of_normed(&layer.gate_up, normed, norm, a.gate_up.ptr(), t)?;
                    if let Some(b) = &layer.gate_up.bias {
                        ops::add_bias(dev, a.gate_up.ptr(), b.ptr(), t, layer.gate_up.out_dim, false)?;
                    }
                    down = self.fp8_silu_down(&layer.down, t)?;
                    if down.is_none() {
                        let stacked = self.w.gate_up_stacked();
                        ops::silu_mul(dev, a.gate_up.ptr(), a.act.ptr(), t, cfg.intermediate_size, stacked)?;
                    }
                }
            }
            let mlp_out = match down {
                Some(delta) => delta,
                None => self.residual_projection(&layer.down, a.act.ptr(), t)?,
            };
            let mlp_out = self.all_reduce(mlp_out, t)?;
            match (layers.get(li + 1), mlp_out) {
                (Some(_), ResidualDelta::Bf16(delta)) if fuse_norms => pending = delta,
                (Some(next), _) => normed = self.norm_for(&next.qkv, resid, mlp_out, next.input_norm.ptr(), t)?,
                // Only the rows that sample need the last residual add, the final norm and
                // the (large) output projection.
                (None, _) => {
                    self.add_norm(resid, mlp_out, self.step.at(m.rows), self.w.norm.ptr(), a.last.ptr(), rows)?
                }
            }
        }
        self.matmul(a.last.ptr(), self.w.head().ptr(), a.logits.ptr(), rows, cfg.vocab_size, h, true)?;
        Ok(())
    }

    /// Whether a step of `t` tokens folds its norms into the qkv and gate/up products
    /// ([`ops::matmul_t_skinny_norm`]): batch invariant, tuned so and verified on this GPU, few
    /// enough tokens, and o and down products the residual takes as one bf16 delta.
    pub fn fuse_norms(&self, t: usize) -> bool {
        let l = &self.w.layers[0];
        self.invariant_norms()
            && t <= ops::SKINNY_NORM_MAX_TOKENS
            && self.comm.is_none()
            && self.slices(&l.o) == 1
            && self.slices(&l.down) == 1
            && l.gate_up.bias.is_none()
    }

    /// `lin`'s product of `rms_norm(x + delta)` (by `norm`'s weight) for `t` tokens in one kernel
    /// ([`ops::matmul_t_skinny_norm`]), `x + delta` written to `x_out`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn normed_product(
        &self,
        lin: &Linear,
        norm: &DevBuf<u16>,
        x: u64,
        delta: u64,
        x_out: u64,
        y: u64,
        output: SkinnyNormOutput,
        t: usize,
    ) -> Result<(), CudaError> {
        let (weight, n, k, norm_weight, eps) =
            (lin.weight.ptr(), lin.out_dim, lin.in_dim, norm.ptr(), self.cfg.rms_norm_eps);
        let p = ops::NormedProduct { weight, n, k, x, delta, x_out, norm_weight, eps, y, output };
        ops::matmul_t_skinny_norm(self.dev, &p, t)
    }

    /// Whether every norm sums in [`ops::matmul_t_skinny_norm`]'s order
    /// ([`ops::add_rms_norm_b128`]), so steps with and without the fused products agree.
    fn invariant_norms(&self) -> bool {
        self.step.batch_invariant() && self.dev.invariant_fused_norm()
    }

    /// `out[r] = rms_norm(x[rows[r]] + delta) * w` for `num_rows` rows ([`ops::add_rms_norm`]),
    /// in the batch-invariant order where the fused products are on.
    pub unsafe fn add_norm(
        &self,
        x: u64,
        delta: ResidualDelta,
        rows: u64,
        w: u64,
        out: u64,
        num_rows: usize,
    ) -> Result<(), CudaError> {
        let (h, eps) = (self.cfg.hidden_size, self.cfg.rms_norm_eps);
        let norm = if self.invariant_norms() { ops::add_rms_norm_b128 } else { ops::add_rms_norm };
        norm(self.dev, x, delta, rows, w, out, num_rows, h, eps)
    }

    /// `rms_norm(x + delta) * w` of the step's `t` rows as the input of `next`'s product: rounded
    /// to e4m3 in the same kernel ([`ops::add_rms_norm_fp8_rows`], into the FP8 scratch) where
    /// `fp8_fused_norm` is on and `next`'s block-scaled FP8 GEMM takes the rows, else as bf16
    /// rows in `act.normed`. Either way `x` holds `x + delta` after it.
    pub(super) unsafe fn norm_for(
        &self,
        next: &Linear,
        x: u64,
        delta: ResidualDelta,
        w: u64,
        t: usize,
    ) -> Result<NormedRows, CudaError> {
        let (dev, scratch) = (self.dev, self.w.fp8_scratch());
        let rounded = next.fp8_matrix().is_some_and(|m| {
            dev.tuning().fp8_fused_norm
                && !self.step.batch_invariant()
                && self.slices(next) == 1
                && ops::fp8_block_gemm_takes(dev, &m, t, &scratch)
        });
        if rounded {
            let (h, eps) = (self.cfg.hidden_size, self.cfg.rms_norm_eps);
            let into = (scratch.acts, scratch.act_scales, fp8_act_scale_ld(t));
            ops::add_rms_norm_fp8_rows(dev, x, delta, w, into, t, h, eps)?;
            return Ok(NormedRows::Fp8);
        }
        self.add_norm(x, delta, 0, w, self.step.act.normed.ptr(), t)?;
        Ok(NormedRows::Bf16)
    }

    /// `y = rows · lᵀ` (without `l`'s bias) of the rows [`Pass::norm_for`] made for it: from
    /// the e4m3 rows in the FP8 scratch, or `act.normed`. Where cuBLASLt turns the rounded rows
    /// down after all, the bf16 rows are made again from the residual and the norm's weight
    /// (`norm`: `x`, which already holds the delta, and `w`).
    pub(super) unsafe fn product_of_normed(
        &self,
        l: &Linear,
        rows: NormedRows,
        (x, w): (u64, u64),
        y: u64,
        t: usize,
    ) -> Result<(), CudaError> {
        let normed = self.step.act.normed.ptr();
        if let (NormedRows::Fp8, Some(m)) = (rows, l.fp8_matrix()) {
            if ops::matmul_t_fp8_rounded(self.dev, &self.w.fp8_scratch(), m, (y, false), t).is_ok() {
                return Ok(());
            }
            self.add_norm(x, ResidualDelta::None, 0, w, normed, t)?;
        }
        self.product(l, normed, y, t)
    }

    /// `y = x · wᵀ` through cuBLAS (cuBLASLt products that split no reduction when batch
    /// invariant). (A hand-written skinny GEMV for decode batches was tried
    /// and measured: it beat cuBLAS on 2 to 4 of 40 decode shapes, by less than the run-to-run
    /// spread, and choosing kernels by timing made greedy output depend on the run.)
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn matmul(
        &self,
        x: u64,
        w: u64,
        y: u64,
        t: usize,
        n: usize,
        k: usize,
        f32_out: bool,
    ) -> Result<(), CudaError> {
        // Every address here is the start of a weight or activation buffer (256-byte aligned,
        // as the invariant products require).
        if self.step.batch_invariant() {
            ops::matmul_t_invariant(self.dev, x, w, y, t, n, k, f32_out)
        } else {
            ops::matmul_t(self.dev, x, w, y, t, n, k, f32_out)
        }
    }

    /// A projection whose output the residual add takes (o and down): through `proj`, or when
    /// batch invariant with a long K, as the partial products of K slices ([`Pass::slices`]),
    /// which the residual add sums in order.
    pub unsafe fn residual_projection(&self, l: &Linear, x: u64, t: usize) -> Result<ResidualDelta, CudaError> {
        let slices = self.slices(l);
        if slices > 1 {
            let parts = self.step.act.parts.ptr();
            ops::matmul_t_invariant_sliced(self.dev, x, l.weight.ptr(), parts, t, l.out_dim, l.in_dim, slices)?;
            return Ok(ResidualDelta::Parts { ptr: parts, slices, stride: t * l.out_dim });
        }
        if let Some((m, slices)) = self.fp8_skinny_parts(l, t) {
            let scratch = self.w.fp8_scratch();
            ops::quantize_fp8_rows(self.dev, x, (scratch.acts, scratch.act_scales, fp8_act_scale_ld(t)), t, m.k)?;
            return self.fp8_skinny_into_parts(l, m, slices, t);
        }
        let proj = self.step.act.proj.ptr();
        self.linear(l, x, proj, t)?;
        Ok(ResidualDelta::Bf16(proj))
    }

    /// Whether a residual's projection `l` (o, down) of `t` rows goes to the skinny FP8 product
    /// in K slices (`fp8_skinny`, [`ops::fp8_skinny_slices`] > 1), the residual add summing its
    /// parts: its FP8 weight and slices. Not with a bias (the parts' sum adds none), nor across
    /// tensor-parallel ranks (no all-reduce of parts), nor batch invariant.
    fn fp8_skinny_parts(&self, l: &Linear, t: usize) -> Option<(ops::Fp8Matrix, usize)> {
        let m = l.fp8_matrix()?;
        let dev = self.dev;
        let slices = ops::fp8_skinny_slices(dev, &m);
        let usable = l.bias.is_none()
            && self.comm.is_none()
            && !self.step.batch_invariant()
            && slices > 1
            && self.step.act.parts.len() >= slices * t * l.out_dim
            && ops::fp8_skinny_takes(dev, &m, t)
            && ops::fp8_block_gemm_takes(dev, &m, t, &self.w.fp8_scratch());
        usable.then_some((m, slices))
    }

    /// `l`'s product ([`Pass::fp8_skinny_parts`] chose it) of the `t` rows rounded to e4m3 in the
    /// FP8 scratch, as `slices` f32 parts in `act.parts` for the residual add to sum.
    unsafe fn fp8_skinny_into_parts(
        &self,
        l: &Linear,
        m: ops::Fp8Matrix,
        slices: usize,
        t: usize,
    ) -> Result<ResidualDelta, CudaError> {
        let parts = self.step.act.parts.ptr();
        ops::matmul_t_fp8_skinny(self.dev, &self.w.fp8_scratch(), m, (parts, true), t, slices)?;
        Ok(ResidualDelta::Parts { ptr: parts, slices, stride: t * l.out_dim })
    }

    /// Down's product for `t` tokens from the step's gate/up rows, with SiLU-and-multiply
    /// rounding its output straight to e4m3 for the block-scaled GEMM
    /// ([`ops::silu_mul_fp8_rows`], the bits of SiLU then [`ops::quantize_fp8_rows`]): where
    /// `fp8_fused_act` is on, down's weight is FP8, the GEMM takes the shape and one slice
    /// serves. None (nothing to add, the bf16 path to run) otherwise, or where cuBLASLt has no
    /// kernel for it.
    pub unsafe fn fp8_silu_down(&self, down: &Linear, t: usize) -> Result<Option<ResidualDelta>, CudaError> {
        let (dev, inter, a) = (self.dev, self.cfg.intermediate_size, &self.step.act);
        let scratch = self.w.fp8_scratch();
        let Some(m) = down.fp8_matrix() else { return Ok(None) };
        if !dev.tuning().fp8_fused_act
            || self.slices(down) > 1
            || !inter.is_multiple_of(ops::FP8_BLOCK)
            || !ops::fp8_block_gemm_takes(dev, &m, t, &scratch)
        {
            return Ok(None);
        }
        let rounded = (scratch.acts, scratch.act_scales, fp8_act_scale_ld(t));
        ops::silu_mul_fp8_rows(dev, a.gate_up.ptr(), rounded, t, inter, self.w.gate_up_stacked())?;
        if let Some((m, slices)) = self.fp8_skinny_parts(down, t) {
            return self.fp8_skinny_into_parts(down, m, slices, t).map(Some);
        }
        let proj = a.proj.ptr();
        if ops::matmul_t_fp8_rounded(dev, &scratch, m, (proj, false), t).is_err() {
            return Ok(None);
        }
        if let Some(b) = &down.bias {
            ops::add_bias(dev, proj, b.ptr(), t, down.out_dim, false)?;
        }
        Ok(Some(ResidualDelta::Bf16(proj)))
    }

    /// A row-parallel product's output for `t` tokens (this rank's partial sums) summed over
    /// the tensor-parallel ranks, in place; as it is without tensor parallelism.
    unsafe fn all_reduce(&self, delta: ResidualDelta, t: usize) -> Result<ResidualDelta, ModelError> {
        let Some(comm) = self.comm else { return Ok(delta) };
        match delta {
            ResidualDelta::Bf16(ptr) => {
                // Safety: `ptr` is the step's projection buffer, `t` rows of `hidden` wide
                // (the `Pass` contract), alive for the model's life.
                unsafe { comm.all_reduce_bf16(ptr, t * self.cfg.hidden_size) }?;
                Ok(delta)
            }
            _ => Err(ModelError::Device("an all-reduce of a product summed in slices is not built".into())),
        }
    }

    /// How many K slices a batch-invariant model cuts `l`'s product into (1 otherwise, and for
    /// a projection with a bias, which the slices' fold does not add).
    pub fn slices(&self, l: &Linear) -> usize {
        if self.step.batch_invariant() {
            l.invariant_slices(self.dev)
        } else {
            1
        }
    }

    /// `y = x · lᵀ` (bf16) for `t` tokens, without `l`'s bias: its bf16 weight through
    /// [`Pass::matmul`], or its FP8 one ([`ops::matmul_t_fp8`]: up to 16 rows from its bytes,
    /// more through the model's bf16 scratch).
    pub unsafe fn product(&self, l: &Linear, x: u64, y: u64, t: usize) -> Result<(), CudaError> {
        match l.fp8_matrix() {
            Some(m) => ops::matmul_t_fp8(self.dev, x, m, y, t, false, &self.w.fp8_scratch()),
            None => self.matmul(x, l.weight.ptr(), y, t, l.out_dim, l.in_dim, false),
        }
    }

    unsafe fn linear(&self, l: &Linear, x: u64, y: u64, t: usize) -> Result<(), CudaError> {
        self.product(l, x, y, t)?;
        if let Some(b) = &l.bias {
            ops::add_bias(self.dev, y, b.ptr(), t, l.out_dim, false)?;
        }
        Ok(())
    }

    pub fn attn_shape(&self, layer: usize) -> AttnShape {
        AttnShape {
            num_heads: self.cfg.num_heads,
            num_kv_heads: self.cfg.num_kv_heads,
            head_dim: self.cfg.head_dim,
            layer,
            num_layers: self.cfg.num_layers,
            block_size: self.kv.layout.block_size,
            num_blocks: self.kv.layout.num_blocks,
            kv_fp8: self.kv.dtype == KvDtype::Fp8E4m3,
        }
    }

    /// The prefill attention of `prefill`'s work items for the layer `shape` describes: over
    /// the cache, or over an FP8 cache's bf16 shadow, into which the keys and values the items
    /// read are dequantized first ([`ops::kv_fp8_shadow`]).
    pub unsafe fn prefill_attention(
        &self,
        prefill: &PrefillSeqs,
        shape: &AttnShape,
        split: Option<FlashSplit>,
    ) -> Result<(), CudaError> {
        let a = &self.step.act;
        let meta = self.step.attn_meta();
        let (cache, shape) = match &self.kv.shadow {
            Some(shadow) if shape.kv_fp8 => {
                ops::kv_fp8_shadow(self.dev, self.kv.cache.ptr(), shadow.ptr(), prefill, &meta, shape)?;
                (shadow.ptr(), AttnShape { layer: 0, num_layers: 1, kv_fp8: false, ..*shape })
            }
            _ => (self.kv.cache.ptr(), *shape),
        };
        ops::flash_prefill(self.dev, a.q.ptr(), cache, a.attn.ptr(), prefill, &meta, &shape, split)
    }

    /// Arguments of the fused q/k-norm + RoPE + cache-write kernel for `layer`.
    pub fn rope_args(&self, layer: &Layer) -> QkvRope {
        let m = self.step.layout;
        QkvRope {
            qkv: self.step.act.qkv.ptr(),
            bias: layer.qkv.bias_ptr(),
            q_norm: layer.q_norm.as_ref().map_or(0, DevBuf::ptr),
            k_norm: layer.k_norm.as_ref().map_or(0, DevBuf::ptr),
            cos: self.w.rope_cos.ptr(),
            sin: self.w.rope_sin.ptr(),
            positions: self.step.at(m.positions),
            slots: self.step.at(m.slots),
            q_out: self.step.act.q.ptr(),
            cache: self.kv.cache.ptr(),
            eps: self.cfg.rms_norm_eps,
        }
    }

    /// Layer `li`'s q/k norm, RoPE and cache write for all `t` tokens, then attention for the
    /// tokens on the decode list (the row kernel). With `fuse_rope` (decode steps of one token
    /// per sequence only), the attention kernel does the first part itself: one launch, and
    /// the queries never go through memory. Returns the layer's attention shape.
    unsafe fn rope_and_row_attention(
        &self,
        li: usize,
        layer: &Layer,
        t: usize,
        counts: StepCounts,
        fuse_rope: bool,
    ) -> Result<AttnShape, ModelError> {
        let a = &self.step.act;
        let shape = self.attn_shape(li);
        let rope = self.rope_args(layer);
        let split = self.step.row_split(counts);
        // Long contexts go to the tensor-core build, which leaves RoPE to its own kernel.
        let fuse_rope = fuse_rope
            && counts.one_token_each
            && counts.work == 0
            && !ops::attention_mma_takes(self.dev, &shape, split.is_some());
        if !fuse_rope {
            ops::qkv_rope_cache(self.dev, &rope, &shape, t)?;
        }
        ops::attention_rows(
            self.dev,
            a.q.ptr(),
            self.kv.cache.ptr(),
            a.attn.ptr(),
            &self.step.attn_meta(),
            self.step.at(self.step.layout.decode_list),
            counts.decode,
            &shape,
            fuse_rope.then_some(&rope),
            split,
        )?;
        Ok(shape)
    }

    /// The layers and output head of a fused decode step (the embedding already in the
    /// residual stream): per layer, qkv (with the input RMSNorm), attention (with RoPE and the
    /// cache write on one-token-per-sequence steps), o (adding into the residual), gate/up (with
    /// the post-attention RMSNorm and SiLU-and-multiply) and down (adding into the residual).
    /// Five or six launches per layer instead of nine, and no deltas through memory.
    unsafe fn decode_layers(
        &self,
        t: usize,
        rows: usize,
        counts: StepCounts,
        projections: GemvBuild,
        o_projection: GemvBuild,
    ) -> Result<(), ModelError> {
        for (li, layer) in self.w.layers.iter().enumerate() {
            let [qkv, o, gate_up, down] = self.decode_projections(layer);
            self.project(&qkv, t, projections)?;
            self.rope_and_row_attention(li, layer, t, counts, true)?;
            self.project(&o, t, o_projection)?;
            self.project(&gate_up, t, projections)?;
            self.project(&down, t, projections)?;
        }
        self.project(&self.head_projection(), rows, projections)
    }

    /// Runs a fused decode projection for `t` tokens in `build`.
    pub unsafe fn project(&self, g: &Gemv, t: usize, build: GemvBuild) -> Result<(), ModelError> {
        g.launch_with(self.dev, t, ops::gemv_plan(self.dev, g.n, g.k, t, build))?;
        Ok(())
    }

    /// A decode projection's input: the RMSNorm (weight `weight`) of the residual stream's rows
    /// (`rows`: an index list, or 0 for rows 0..).
    fn residual_norm(&self, weight: &DevBuf<u16>, rows: u64) -> GemvInput {
        GemvInput::Norm { residual: self.step.act.x.ptr(), rows, weight: weight.ptr(), eps: self.cfg.rms_norm_eps }
    }

    /// A layer's qkv (with the input RMSNorm), o (adding into the residual), gate/up (with the
    /// post-attention RMSNorm, SiLU-and-multiply in its epilogue) and down (adding into the
    /// residual) projections of a decode step. The qkv bias is added by the RoPE kernel, as on
    /// the unfused path.
    pub fn decode_projections(&self, layer: &Layer) -> [Gemv; 4] {
        let a = &self.step.act;
        let h = self.cfg.hidden_size;
        let residual = GemvOutput::AddTo(a.x.ptr());
        let (qkv, o, gate_up, down) = (&layer.qkv, &layer.o, &layer.gate_up, &layer.down);
        // `l`'s product (bf16, or FP8 bytes and scales) of `k` columns into `n` rows.
        let of = |l: &Linear, n: usize, k: usize, input: GemvInput, output: GemvOutput, bias: u64| {
            let (weight, scales) = l.gemv_weight();
            Gemv { weight, scales, n, k, input, output, bias }
        };
        [
            of(qkv, qkv.out_dim, h, self.residual_norm(&layer.input_norm, 0), GemvOutput::Bf16(a.qkv.ptr()), 0),
            of(o, h, o.in_dim, GemvInput::Bf16(a.attn.ptr()), residual, o.bias_ptr()),
            of(
                gate_up,
                gate_up.out_dim,
                h,
                self.residual_norm(&layer.post_norm, 0),
                GemvOutput::SiluMul(a.act.ptr()),
                gate_up.bias_ptr(),
            ),
            of(down, h, down.in_dim, GemvInput::Bf16(a.act.ptr()), residual, down.bias_ptr()),
        ]
    }

    /// The output head of a decode step, with the final RMSNorm of the rows that want logits.
    pub fn head_projection(&self) -> Gemv {
        Gemv {
            weight: self.w.head().ptr(),
            scales: 0,
            n: self.cfg.vocab_size,
            k: self.cfg.hidden_size,
            input: self.residual_norm(&self.w.norm, self.step.at(self.step.layout.rows)),
            output: GemvOutput::F32(self.step.act.logits.ptr()),
            bias: 0,
        }
    }
}
