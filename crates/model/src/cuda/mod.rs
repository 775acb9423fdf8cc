//! The transformer on an NVIDIA GPU: bf16 weights and KV cache in device memory, cuBLAS for
//! the projections, this project's kernels for the rest, sampling on the device, and decode
//! steps replayed from CUDA graphs.
//!
//! The model is split by lifetime; each part owns its device memory:
//! - [`weights`]: written once at load, read by every forward;
//! - [`kv_cache`]: the KV cache and its host copy, written by forwards and (through the host
//!   copy) by the KV connector, block by block as the engine hands blocks over;
//! - [`step`]: activations and step metadata, rewritten every step;
//! - [`plan`]: which decode kernels run, chosen once at load;
//! - [`graphs`]: captured decode steps;
//! - [`forward`]: the forward pass over them, `forward(&weights, &plan, &mut step, &mut kv)`.
//!
//! [`CudaModel`] ties them together and implements [`ModelRunner`].

mod forward;
mod graphs;
mod kv_cache;
mod plan;
#[cfg(feature = "profile")]
mod profile;
mod step;
mod weights;

use std::sync::Arc;

use tandem_compute::cuda::{Communicator, CudaDevice, CudaError, CudaTuning, KvFences};
use tandem_compute::{KvDtype, KvLayout, KvRegion};
use tandem_core::TokenLogprobs;

use self::forward::forward;
use self::graphs::DecodeGraphs;
use self::kv_cache::DeviceKv;
use self::plan::DecodePlan;
use self::step::{StepBuffers, StepCounts};
use self::weights::Weights;
use crate::config::ModelConfig;
use crate::runner::{check_carried, ModelRunner, RowLogprobs, SampleSpec};
use crate::source::ModelSpec;
use crate::transformer::SeqBatch;
use crate::ModelError;

/// How to size a [`CudaModel`].
#[derive(Clone, Debug)]
pub struct CudaOptions {
    /// GPU index.
    pub ordinal: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Most tokens in one forward (the engine's `max_num_batched_tokens`).
    pub max_tokens: usize,
    /// Most sequences in one forward (the engine's `max_num_seqs`).
    pub max_seqs: usize,
    /// Fraction of the GPU's memory this instance may use in total (weights, activations and
    /// KV cache), like vLLM's `--gpu-memory-utilization`.
    pub memory_utilization: f64,
    /// Use exactly this many KV blocks instead of sizing from memory.
    pub num_blocks: Option<usize>,
    /// Replay decode steps from CUDA graphs, captured at load for every batch bucket (off:
    /// launch every kernel each step).
    pub cuda_graphs: bool,
    /// Run decode steps of up to 8 tokens through the fused decode projections (RMSNorm,
    /// SiLU and the residual add folded into hand-written GEMV kernels) instead of cuBLAS and
    /// separate kernels. Off only to compare the two paths.
    pub fused_decode: bool,
    /// Keep a host copy of the KV cache for the KV connector (prefill and decode roles), of at
    /// most this many bytes (bf16, as on the device): the device cache is capped to the blocks
    /// the copy can hold. `None`: no copy, and no KV transfer.
    pub host_kv_bytes: Option<usize>,
    /// Kernel choices (defaults: the fastest measured).
    pub tuning: CudaTuning,
    /// Batch-invariant serving: every step runs kernels whose per-row arithmetic does not
    /// depend on the batch (cuBLASLt products that split no reduction over blocks, one
    /// attention kernel for prefill and decode tokens, no fused decode projections), so a
    /// request's output is the same whatever else shares its steps.
    pub batch_invariant: bool,
    /// A directory to keep the compiled kernels in between processes (`None`: compiled once
    /// per process).
    pub kernel_cache: Option<std::path::PathBuf>,
    /// Run the all-reduces a tensor-parallel rank makes after its row-parallel products (o and
    /// down) through a one-rank NCCL communicator, an identity: one GPU runs that code path
    /// (tests; the steps then take no fused decode projections and no CUDA graphs, and it is
    /// not combined with `batch_invariant`).
    pub nccl_one_rank: bool,
    /// The KV cache's element type: bf16, or FP8 e4m3 (`--kv-cache-dtype fp8`: half the bytes
    /// a token's KV takes and a transfer moves; head sizes 64 and 128, not batch invariant).
    pub kv_dtype: KvDtype,
}

impl Default for CudaOptions {
    fn default() -> Self {
        Self {
            ordinal: 0,
            block_size: 16,
            max_tokens: 2048,
            max_seqs: 64,
            memory_utilization: 0.9,
            num_blocks: None,
            cuda_graphs: true,
            fused_decode: true,
            host_kv_bytes: None,
            tuning: CudaTuning::default(),
            batch_invariant: false,
            kernel_cache: None,
            nccl_one_rank: false,
            kv_dtype: KvDtype::Bf16,
        }
    }
}

/// Whether the GPU builds `opts.kv_dtype`'s cache for `cfg`: bf16 always; FP8 for head sizes 64
/// and 128 (the row kernel's FP8 builds), without batch invariance (whose kernels read bf16).
fn check_kv_dtype(cfg: &ModelConfig, opts: &CudaOptions) -> Result<(), ModelError> {
    match opts.kv_dtype {
        KvDtype::Bf16 => Ok(()),
        KvDtype::Fp8E4m3 if opts.batch_invariant => Err(ModelError::UnsupportedConfig(
            "--kv-cache-dtype fp8 with --batch-invariant on a GPU is not built yet (its attention kernels read bf16 KV)"
                .into(),
        )),
        KvDtype::Fp8E4m3 if ![64, 128].contains(&cfg.head_dim) => Err(ModelError::UnsupportedConfig(format!(
            "--kv-cache-dtype fp8 on a GPU takes head sizes 64 and 128, not {}",
            cfg.head_dim
        ))),
        KvDtype::Fp8E4m3 => Ok(()),
        other => Err(ModelError::UnsupportedConfig(format!("a GPU KV cache holds bf16 or fp8, not {}", other.name()))),
    }
}

impl From<CudaError> for ModelError {
    fn from(e: CudaError) -> Self {
        ModelError::Device(e.to_string())
    }
}

/// The transformer on one GPU, with its KV cache.
pub struct CudaModel {
    dev: CudaDevice,
    cfg: ModelConfig,
    weights: Weights,
    kv: DeviceKv,
    step: StepBuffers,
    plan: DecodePlan,
    graphs: DecodeGraphs,
    max_positions: usize,
    /// Record [`KvFences`] in every plain (prefill) step (see [`ModelRunner::fence_kv_writes`]).
    fence_kv: bool,
    /// The fences of the step last launched, until taken.
    fences: Option<KvFences>,
    /// The log-probabilities of the step last read or collected, until taken.
    step_logprobs: RowLogprobs,
    /// The tensor-parallel group the row-parallel products are summed over (`nccl_one_rank`).
    comm: Option<Communicator>,
}

impl CudaModel {
    /// Builds the model on GPU `opts.ordinal`: a `preset:` model's seeded weights are generated
    /// on the device; a checkpoint is read on the host, converted to bf16 and uploaded. Then
    /// activations are allocated and the KV cache takes what `memory_utilization` leaves.
    pub fn load(spec: &ModelSpec, opts: &CudaOptions) -> Result<Self, ModelError> {
        Weights::check_config(&spec.config)?;
        check_kv_dtype(&spec.config, opts)?;
        let dev = CudaDevice::open_with(opts.ordinal, opts.tuning.clone(), opts.kernel_cache.as_deref())?;
        let cfg = spec.config.clone();
        let mut weights = Weights::load(&dev, spec)?;
        if weights.fp8() && dev.tuning().fp8_block_gemm {
            if let Err(e) = weights.enable_fp8_block_gemm(&dev, opts.max_tokens) {
                tracing::warn!("fp8_block_gemm is off: {e}");
            }
        }
        if weights.fp8() && opts.batch_invariant {
            return Err(ModelError::UnsupportedConfig(
                "--batch-invariant with FP8 weights on the GPU is not built yet (their products sum in another order)"
                    .into(),
            ));
        }
        let comm = match opts.nccl_one_rank {
            true if opts.batch_invariant => {
                return Err(ModelError::UnsupportedConfig(
                    "batch-invariant steps sum their o and down products in slices, which the NCCL all-reduce does not take yet".into(),
                ))
            }
            true => Some(Communicator::one_rank(&dev)?),
            false => None,
        };
        if opts.batch_invariant {
            dev.enable_batch_invariant()?;
            weights.verify_skinny(&dev, &cfg)?;
        }
        // The fused decode projections fold the norm and residual add in with other rounding
        // than the prefill path: a batch-invariant model runs every step unfused.
        // The fused decode projections add o and down into the residual inside the GEMV, where
        // no all-reduce can come between.
        // FP8 weights have their own build of them (`fp8_fused_decode`).
        let fp8_unfused = weights.fp8() && !dev.tuning().fp8_fused_decode;
        let fused = opts.fused_decode && !opts.batch_invariant && comm.is_none() && !fp8_unfused;
        let plan = DecodePlan::choose(&dev, &cfg, fused, weights.fp8(), dev.tuning());
        let step = StepBuffers::new(
            &dev,
            &cfg,
            opts.max_tokens,
            opts.max_seqs,
            opts.block_size,
            spec.max_model_len,
            opts.batch_invariant,
        )?;
        let kv = DeviceKv::allocate(&dev, &cfg, opts)?;
        let graphs = DecodeGraphs::new(opts.cuda_graphs && comm.is_none(), step.max_seqs, step.max_tokens);
        tracing::debug!(?plan, "decode plan");
        let mut model = Self {
            dev,
            cfg,
            weights,
            kv,
            step,
            plan,
            graphs,
            max_positions: spec.max_model_len,
            fence_kv: false,
            fences: None,
            step_logprobs: Vec::new(),
            comm,
        };
        model.capture_decode_graphs()?;
        Ok(model)
    }

    /// The device.
    pub fn device(&self) -> &CudaDevice {
        &self.dev
    }

    /// Bytes of weights one forward reads (bf16), the numerator of the decode floor.
    pub fn weight_bytes(&self) -> usize {
        self.weights.bytes
    }

    /// Runs a forward and returns the f32 logits of the sequences with `want_logits` (for
    /// tests and comparisons with the CPU backend; serving uses [`ModelRunner::execute`]).
    pub fn forward_logits(&mut self, token_ids: &[u32], seqs: &[SeqBatch<'_>]) -> Result<Vec<f32>, ModelError> {
        let rows = self.step.check_batch(token_ids, seqs)?;
        self.step.fill(&self.dev, token_ids, seqs, None, &[])?;
        self.forward(token_ids.len(), rows, None, true, None)?;
        Ok(self.dev.read(&self.step.act.logits, rows * self.cfg.vocab_size)?)
    }

    fn forward(
        &mut self,
        t: usize,
        rows: usize,
        counts: Option<StepCounts>,
        allow_fused: bool,
        fences: Option<&mut KvFences>,
    ) -> Result<(), ModelError> {
        forward(
            &self.dev,
            &self.cfg,
            &self.weights,
            &self.plan,
            &mut self.step,
            &mut self.kv,
            self.comm.as_ref(),
            (t, rows),
            counts,
            allow_fused,
            fences,
        )
    }

    /// Captures the decode graph of every batch bucket now. Capturing records launches without
    /// running them: nothing is read or written.
    fn capture_decode_graphs(&mut self) -> Result<(), ModelError> {
        if !self.graphs.enabled() {
            return Ok(());
        }
        // Weight generation and cache set-up finish first; captures then start on an idle stream.
        self.dev.synchronize()?;
        let started = std::time::Instant::now();
        let buckets = self.graphs.buckets();
        for &bucket in &buckets {
            self.capture_graph(bucket, false)?;
            if self.step.splits_at(bucket) {
                self.capture_graph(bucket, true)?;
            }
        }
        tracing::info!(buckets = ?buckets, ms = started.elapsed().as_millis() as u64, "captured the decode CUDA graphs");
        Ok(())
    }

    /// Captures the decode graph for `bucket` sequences, unless it exists.
    fn capture_graph(&mut self, bucket: usize, split: bool) -> Result<(), ModelError> {
        if self.graphs.get(bucket, split).is_some() {
            return Ok(());
        }
        // A batch-invariant step's tokens are each a packed prefill work item.
        let counts = if self.step.batch_invariant() {
            // As build_meta: a split step has no narrow items.
            let narrow = if self.step.narrow_decode() && !split { bucket } else { 0 };
            StepCounts { decode: 0, work: bucket, narrow, one_token_each: true, split }
        } else {
            StepCounts { decode: bucket, work: 0, narrow: 0, one_token_each: true, split }
        };
        let graph_layout = self.step.graph_layout(bucket);
        let step_layout = std::mem::replace(&mut self.step.layout, graph_layout);
        self.dev.begin_capture()?;
        let captured = self.forward(bucket, bucket, Some(counts), true, None);
        // End the capture even if a launch failed, so the stream is usable again.
        let graph = self.dev.end_capture();
        self.step.layout = step_layout;
        captured?;
        self.graphs.insert(bucket, split, graph?);
        Ok(())
    }

    /// Replays the decode graph for `bucket` and the prepared step's attention split.
    fn run_graph(&mut self, bucket: usize) -> Result<(), ModelError> {
        let split = self.step.counts.split;
        self.capture_graph(bucket, split)?;
        if let Some(g) = self.graphs.get(bucket, split) {
            g.launch()?;
        }
        Ok(())
    }

    /// Queues one step up to its sampling kernels: metadata upload, the forward (a decode
    /// graph where one fits) and the sampler writing the step's tokens. A carried token (see
    /// `crate::runner::CARRIED_TOKEN`) must name a row the previous step sampled.
    fn launch_step(
        &mut self,
        token_ids: &[u32],
        seqs: &[SeqBatch<'_>],
        samples: &[SampleSpec],
    ) -> Result<(), ModelError> {
        let rows = self.step.check_batch(token_ids, seqs)?;
        if rows != samples.len() {
            return Err(ModelError::Device(format!("{rows} sequences sample but {} sample specs", samples.len())));
        }
        check_carried(token_ids, self.step.last_rows)?;
        self.fences = None;
        match self.graphs.bucket_for(token_ids, seqs) {
            Some(bucket) => {
                self.step.fill(&self.dev, token_ids, seqs, Some(bucket), samples)?;
                self.run_graph(bucket)?;
            }
            None => {
                self.step.fill(&self.dev, token_ids, seqs, None, samples)?;
                let mut fences = self.fence_kv.then(KvFences::default);
                self.forward(token_ids.len(), rows, None, true, fences.as_mut())?;
                // A fused decode step records none: nothing for a connector to copy early.
                self.fences = fences.filter(|f| !f.is_complete());
            }
        }
        self.step.launch_sampling(&self.dev, self.cfg.vocab_size, samples)?;
        self.step.last_rows = rows;
        Ok(())
    }
}

impl ModelRunner for CudaModel {
    fn describe(&self) -> String {
        let invariant = if self.step.batch_invariant() { ", batch-invariant" } else { "" };
        format!("{} bf16{invariant}", self.dev.describe())
    }

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn max_positions(&self) -> usize {
        self.max_positions
    }

    fn kv_layout(&self) -> KvLayout {
        self.kv.layout
    }

    fn kv_region(&self) -> Option<Arc<KvRegion>> {
        self.kv.region()
    }

    fn kv_device(&self) -> Option<Arc<tandem_compute::cuda::DeviceKvMemory>> {
        Some(self.kv.memory.clone())
    }

    fn fingerprint(&self) -> String {
        self.weights.fingerprint.clone()
    }

    fn execute(
        &mut self,
        token_ids: &[u32],
        seqs: &[SeqBatch<'_>],
        samples: &[SampleSpec],
    ) -> Result<Vec<u32>, ModelError> {
        if self.step.has_pending() {
            return Err(ModelError::Pipeline("a step runs alone while submitted steps await collection".into()));
        }
        self.launch_step(token_ids, seqs, samples)?;
        let (tokens, logprobs) = self.step.read_tokens(&self.dev, self.cfg.vocab_size, samples.len())?;
        self.step_logprobs = logprobs;
        Ok(tokens)
    }

    fn supports_logprobs(&self) -> bool {
        true
    }

    fn take_logprobs(&mut self) -> Vec<Option<TokenLogprobs>> {
        std::mem::take(&mut self.step_logprobs)
    }

    fn can_pipeline(&self) -> bool {
        true
    }

    fn submit(&mut self, token_ids: &[u32], seqs: &[SeqBatch<'_>], samples: &[SampleSpec]) -> Result<(), ModelError> {
        if !self.step.can_queue() {
            return Err(ModelError::Pipeline("two steps are already outstanding".into()));
        }
        self.launch_step(token_ids, seqs, samples)?;
        self.step.queue_tokens(&self.dev, samples.len())
    }

    fn collect(&mut self) -> Result<Vec<u32>, ModelError> {
        let (tokens, logprobs) = self.step.collect_tokens(self.cfg.vocab_size)?;
        self.step_logprobs = logprobs;
        Ok(tokens)
    }

    fn fence_kv_writes(&mut self) -> bool {
        self.fence_kv = true;
        true
    }

    fn take_kv_fences(&mut self) -> Option<KvFences> {
        self.fences.take()
    }
}
