//! Measurement only (the `profile` feature, for `tandem bench engine --profile`): device time
//! per op of one forward.

use tandem_compute::cuda::ops::{self, Gemv, GemvBuild, GemvPlan, ResidualDelta, SkinnyNormOutput};
use tandem_compute::cuda::{CudaError, DevBuf};

use super::forward::{forward, Pass};
use super::weights::{Layer, Linear};
use super::CudaModel;
use crate::transformer::SeqBatch;
use crate::ModelError;

/// What each of a layer's decode projections computes, in `Pass::decode_projections` order.
const DECODE_PROJECTIONS: [&str; 4] = [
    "RMSNorm + qkv projection",
    "o projection + residual add",
    "RMSNorm + gate/up projection + SiLU x up",
    "down projection + residual add",
];

impl CudaModel {
    /// Device time per op of one forward over `seqs` sequences of `tokens_per_seq` tokens each,
    /// the first at position `ctx` (decode: `tokens_per_seq` 1), in milliseconds. Each op is
    /// timed alone, repeated between CUDA events, and per-layer ops are counted once per layer;
    /// the last rows time the whole forward launched op by op and, for decode, replayed from its
    /// CUDA graph. The difference between the sum and the whole is launch gaps. With
    /// `sweep_plans`, every decode projection also runs under other plans (to tune
    /// `ops::gemv_plan` on a new device). Overwrites KV blocks from 0 up: only for benchmarks,
    /// with no requests running.
    pub fn profile_ops(
        &mut self,
        seqs: usize,
        tokens_per_seq: usize,
        ctx: usize,
        sweep_plans: bool,
    ) -> Result<Vec<(String, f64)>, ModelError> {
        let bs = self.kv.layout.block_size;
        let per_seq = (ctx + tokens_per_seq).div_ceil(bs);
        if per_seq * seqs > self.kv.layout.num_blocks
            || seqs * tokens_per_seq > self.step.max_tokens
            || seqs > self.step.max_seqs
        {
            return Err(ModelError::Device("profile shape does not fit this instance".into()));
        }
        let tables: Vec<Vec<u32>> =
            (0..seqs).map(|s| (0..per_seq).map(|b| (s * per_seq + b) as u32).collect()).collect();
        let token_ids: Vec<u32> = (0..seqs * tokens_per_seq).map(|i| (i * 7919 % self.cfg.vocab_size) as u32).collect();
        let batch: Vec<SeqBatch<'_>> = tables
            .iter()
            .enumerate()
            .map(|(i, table)| SeqBatch {
                token_start: i * tokens_per_seq,
                num_tokens: tokens_per_seq,
                first_pos: ctx,
                block_table: table,
                want_logits: true,
            })
            .collect();
        let t = token_ids.len();
        self.step.fill(&self.dev, &token_ids, &batch, None, &[])?;
        let rows = seqs;
        let reps = if t > 256 { 3 } else { 20 };
        let counts = self.step.counts;
        let fused = self.plan.fused_for(t, counts);
        let pass = Pass {
            dev: &self.dev,
            cfg: &self.cfg,
            w: &self.weights,
            step: &self.step,
            kv: &self.kv,
            comm: self.comm.as_ref(),
        };
        // Safety: the pass is over the model's own buffers, filled above for a shape checked
        // against them (the `Pass` contract); every timed launch has run when this returns.
        let mut out = unsafe { op_times(&pass, t, rows, reps, fused, sweep_plans)? };
        let path_ops = |(name, _): &&(String, f64)| {
            let unfused_only = [
                "qkv projection",
                "o projection",
                "residual add",
                "gate/up projection",
                "SiLU x up",
                "down projection",
                "output projection",
            ];
            let rope_fused = fused.is_some() && counts.one_token_each;
            let other_path = (fused.is_some() && unfused_only.iter().any(|u| name.starts_with(u)))
                || (rope_fused && (name.starts_with("q/k norm") || name.starts_with("attention (row")));
            !other_path && !name.contains("(comparison)") && !name.starts_with("plan sweep")
        };
        let sum: f64 = out.iter().filter(path_ops).map(|(_, v)| v).sum();
        out.push(("sum of ops on this path".into(), sum));
        let (dev, cfg, w, plan, comm) = (&self.dev, &self.cfg, &self.weights, &self.plan, self.comm.as_ref());
        let (step, kv) = (&mut self.step, &mut self.kv);
        let mut whole = |allow_fused: bool| -> Result<f64, ModelError> {
            let mut run = || forward(dev, cfg, w, plan, step, kv, comm, (t, rows), None, allow_fused, None);
            run()?;
            let mut failed = None;
            let ms = dev.time_ms(|| {
                for _ in 0..reps {
                    if let Err(e) = run() {
                        failed = Some(e);
                        break;
                    }
                }
                Ok(())
            })?;
            failed.map_or(Ok(ms / reps as f64), Err)
        };
        out.push(("whole forward, launched op by op".into(), whole(true)?));
        if fused.is_some() {
            out.push(("whole forward, unfused path (cuBLAS), op by op".into(), whole(false)?));
        }
        if tokens_per_seq == 1 && self.graphs.enabled() {
            if let Some(bucket) = self.graphs.bucket_of(seqs) {
                self.step.fill(&self.dev, &token_ids, &batch, Some(bucket), &[])?;
                self.run_graph(bucket)?;
                if let Some(g) = self.graphs.get(bucket, self.step.counts.split) {
                    let ms = self.dev.time_ms(|| (0..reps).try_for_each(|_| g.launch()))? / reps as f64;
                    out.push((format!("whole forward, CUDA graph (bucket {bucket})"), ms));
                }
            }
        }
        Ok(out)
    }
}

/// Each op of the forward `pass` runs, timed alone over `reps` repeats.
///
/// # Safety
/// The [`Pass`] contract, for a step of `t` tokens and `rows` logit rows.
unsafe fn op_times(
    pass: &Pass<'_>,
    t: usize,
    rows: usize,
    reps: usize,
    fused: Option<(GemvBuild, GemvBuild)>,
    sweep_plans: bool,
) -> Result<Vec<(String, f64)>, ModelError> {
    let (dev, cfg, w) = (pass.dev, pass.cfg, pass.w);
    let step = pass.step;
    let (a, m) = (&step.act, step.layout);
    let counts = step.counts;
    let layers = cfg.num_layers as f64;
    let (h, inter, stacked) = (cfg.hidden_size, cfg.intermediate_size, w.gate_up_stacked());
    let meta = step.attn_meta();
    let cache = pass.kv.cache.ptr();
    let l0 = &w.layers[0];
    let shape = pass.attn_shape(0);
    let rope = pass.rope_args(l0);
    let prefill = step.prefill_seqs(counts);
    let time = |f: &dyn Fn() -> Result<(), CudaError>| -> Result<f64, ModelError> {
        f()?;
        Ok(dev.time_ms(|| (0..reps).try_for_each(|_| f()))? / reps as f64)
    };
    // Projections run over every layer's weights in turn, as in a step: one layer's alone
    // could be served from L2 on repeats.
    let time_layers = |f: &dyn Fn(&Layer) -> Result<(), CudaError>| time(&|| w.layers.iter().try_for_each(f));
    // What the residual add takes from the down projection (its K slices when batch invariant).
    let mlp_out = match pass.slices(&l0.down) {
        1 => ResidualDelta::Bf16(a.proj.ptr()),
        slices => ResidualDelta::Parts { ptr: a.parts.ptr(), slices, stride: t * h },
    };
    let matmul =
        |x: u64, wt: u64, y: u64, t: usize, n: usize, k: usize, f32_out: bool| pass.matmul(x, wt, y, t, n, k, f32_out);
    let mut out: Vec<(String, f64)> = vec![
        (
            "embedding gather".into(),
            time(&|| ops::embed_gather(dev, w.embed.ptr(), step.at(m.tokens), a.tokens.ptr(), a.x.ptr(), t, h))?,
        ),
        ("qkv projection".into(), time_layers(&|l| pass.product(&l.qkv, a.normed.ptr(), a.qkv.ptr(), t))?),
        ("q/k norm + RoPE + KV write".into(), layers * time(&|| ops::qkv_rope_cache(dev, &rope, &shape, t))?),
        (
            "attention (row kernel)".into(),
            layers
                * time(&|| {
                    let list = step.at(m.decode_list);
                    ops::attention_rows(
                        dev,
                        a.q.ptr(),
                        cache,
                        a.attn.ptr(),
                        &meta,
                        list,
                        counts.decode,
                        &shape,
                        None,
                        step.row_split(counts),
                    )
                })?,
        ),
        (
            "attention (tensor-core prefill)".into(),
            // (Over an FP8 cache, with its dequantization into the shadow.)
            layers * time(&|| pass.prefill_attention(&prefill, &shape, step.flash_split(counts)))?,
        ),
        ("o projection".into(), time_layers(&|l| pass.residual_projection(&l.o, a.attn.ptr(), t).map(|_| ()))?),
        (
            "residual add + RMSNorm (x2)".into(),
            2.0 * layers * time(&|| pass.add_norm(a.x.ptr(), mlp_out, 0, l0.post_norm.ptr(), a.normed.ptr(), t))?,
        ),
        ("gate/up projection".into(), time_layers(&|l| pass.product(&l.gate_up, a.normed.ptr(), a.gate_up.ptr(), t))?),
        ("SiLU x up".into(), layers * time(&|| ops::silu_mul(dev, a.gate_up.ptr(), a.act.ptr(), t, inter, stacked))?),
        ("down projection".into(), time_layers(&|l| pass.residual_projection(&l.down, a.act.ptr(), t).map(|_| ()))?),
        (
            "output projection".into(),
            time(&|| matmul(a.last.ptr(), w.head().ptr(), a.logits.ptr(), rows, cfg.vocab_size, h, true))?,
        ),
    ];
    if pass.fuse_norms(t) {
        // What this step runs instead of the norms, the qkv and gate/up products and SiLU.
        let fused_norm = |lin: &Linear, norm: &DevBuf<u16>, y: u64, output: SkinnyNormOutput| {
            pass.normed_product(lin, norm, a.x.ptr(), a.proj.ptr(), a.x_alt.ptr(), y, output, t)
        };
        out.push((
            "fused: residual add + RMSNorm + qkv projection (batch invariant)".into(),
            time_layers(&|l| fused_norm(&l.qkv, &l.input_norm, a.qkv.ptr(), SkinnyNormOutput::Product))?,
        ));
        out.push((
            "fused: residual add + RMSNorm + gate/up projection + SiLU x up (batch invariant)".into(),
            time_layers(&|l| fused_norm(&l.gate_up, &l.post_norm, a.act.ptr(), SkinnyNormOutput::SiluMul))?,
        ));
    }
    if dev.tuning().fp8_fused_norm && l0.gate_up.fp8_matrix().is_some() {
        // What this step runs instead of a norm and the gate/up product, where it takes it
        // (the norm before qkv likewise).
        out.push((
            "fused: residual add + RMSNorm rounded to FP8 + gate/up projection (fp8_fused_norm)".into(),
            time_layers(&|l| {
                let rows = pass.norm_for(&l.gate_up, a.x.ptr(), mlp_out, l.post_norm.ptr(), t)?;
                pass.product_of_normed(&l.gate_up, rows, (a.x.ptr(), l.post_norm.ptr()), a.gate_up.ptr(), t)
            })?,
        ));
    }
    if dev.tuning().fp8_fused_act && l0.down.fp8_matrix().is_some() {
        // What this step runs instead of SiLU and the down projection, where it takes it.
        out.push((
            "fused: SiLU x up rounded to FP8 + down projection (fp8_fused_act)".into(),
            time_layers(&|l| pass.fp8_silu_down(&l.down, t).map(|_| ()))?,
        ));
    }
    let Some((_, o_projection)) = fused else { return Ok(out) };
    // The decode path this step takes: cuBLAS and the separate norm / SiLU kernels above are
    // replaced by the fused projections below (and, on one-token-per-sequence steps, RoPE +
    // attention by the fused attention row). Each runs over every layer's weights in turn, as
    // in a step (one layer's would sit in L2).
    let layer_plans = |i: usize, plan: &dyn Fn(&Gemv) -> GemvPlan| {
        time_layers(&|l| {
            let p = pass.decode_projections(l)[i];
            p.launch_with(dev, t, plan(&p))
        })
    };
    if counts.one_token_each {
        let fused_rope = || {
            let (list, n) = (step.at(m.decode_list), counts.decode);
            let split = step.row_split(counts);
            ops::attention_rows(dev, 0, cache, a.attn.ptr(), &meta, list, n, &shape, Some(&rope), split)
        };
        out.push(("fused: q/k norm + RoPE + KV write + attention".into(), layers * time(&fused_rope)?));
    }
    let head_p = pass.head_projection();
    // The plan the step uses, then the pipelined and tensor-core builds for comparison.
    type PlanFn<'a> = &'a dyn Fn(usize, usize, usize) -> GemvPlan;
    let builds: [(&str, PlanFn<'_>); 3] = [
        ("fused", &|n, k, t| ops::gemv_plan(dev, n, k, t, GemvBuild::Plain)),
        ("fused, pipelined build (comparison)", &|n, k, t| ops::gemv_plan(dev, n, k, t, GemvBuild::Pipelined)),
        ("fused, tensor-core build (comparison)", &|n, k, t| ops::gemv_plan(dev, n, k, t, GemvBuild::Mma)),
    ];
    for (j, (build, plan_of)) in builds.into_iter().enumerate() {
        for (i, name) in DECODE_PROJECTIONS.iter().enumerate() {
            // The step's o projection may run in its own build (timed alone here, so without
            // the overlap with attention it gets in a step).
            let own = (j == 0 && i == 1 && o_projection == GemvBuild::Bulk).then_some(o_projection);
            let ms = layer_plans(i, &|p| match own {
                Some(b) => ops::gemv_plan(dev, p.n, p.k, t, b),
                None => plan_of(p.n, p.k, t),
            })?;
            out.push((format!("{build}: {name}"), ms));
        }
        let plan = plan_of(head_p.n, head_p.k, rows);
        out.push((format!("{build}: RMSNorm + output projection"), time(&|| head_p.launch_with(dev, rows, plan))?));
    }
    if sweep_plans {
        let sms = dev.sm_count() as usize;
        let p0 = pass.decode_projections(l0);
        for (i, name) in DECODE_PROJECTIONS.iter().enumerate() {
            let mut plans = vec![];
            for ksplit in [1, 2, 4, 8] {
                let needed = p0[i].n.div_ceil(16 / ksplit);
                let mut counts: Vec<usize> =
                    [needed, sms, 2 * sms, 4 * sms].into_iter().filter(|&b| b <= needed).collect();
                counts.dedup();
                plans.extend(counts.into_iter().map(|blocks| GemvPlan { build: GemvBuild::Plain, ksplit, blocks }));
            }
            for plan in plans {
                let ms = layer_plans(i, &|_| plan)?;
                out.push((format!("plan sweep: {name}, {plan:?}"), ms));
            }
        }
    }
    Ok(out)
}
