//! The engine core: one step = schedule, run the model, update requests from its output.
//!
//! [`EngineCore`] is synchronous and single-threaded; [`crate::spawn`] runs it on its own OS
//! thread. Tests drive it directly, step by step.

use std::collections::HashMap;

use rand::Rng;
use tandem_core::{FinishReason, InvalidSampling, RemoteKv, RequestId, TokenLogprobs, TransferId};
use tandem_kv::{AgentInfo, ConnectorConfig, ConnectorEvent, EventSink, KvConnector, KvError, KvFences};
use tandem_model::{carried_token, CpuRunner, ModelRunner, SampleSpec, SeqBatch, Transformer};
use tokio::sync::mpsc::UnboundedSender;

use crate::block_pool::{BlockAllocation, BlockPool, PrefixCacheStats};
use crate::request::{EngineEvent, EngineRequest, KvLoadTimeline, PrefixKeys, Request, RequestStatus};
use crate::scheduler::{PushAdmission, Scheduler, SchedulerOutput};
use crate::EngineConfig;

/// Facts about an engine that callers need to validate requests before sending them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineLimits {
    /// Token ids must be below this.
    pub vocab_size: usize,
    /// Prompt plus output may not exceed this.
    pub max_model_len: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Blocks in the KV pool.
    pub num_blocks: usize,
    /// Whether the model's runner reports log-probabilities (`logprobs`).
    pub logprobs: bool,
}

/// Why a request was refused before it ran. Each maps to an HTTP 400.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum RequestRejected {
    /// No prompt tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// A prompt token id outside the vocabulary.
    #[error("token id {id} is out of range (vocabulary size {vocab_size})")]
    TokenOutOfRange {
        /// The id.
        id: u32,
        /// The vocabulary size.
        vocab_size: usize,
    },
    /// The prompt alone leaves no room for output.
    #[error("the prompt has {prompt_len} tokens; this model's maximum context length is {max_model_len}")]
    PromptTooLong {
        /// Prompt tokens.
        prompt_len: usize,
        /// The limit.
        max_model_len: usize,
    },
    /// Prompt plus max_tokens exceeds the context.
    #[error("max_tokens {max_tokens} plus the prompt's {prompt_len} tokens exceeds the maximum context length {max_model_len}")]
    ExceedsContext {
        /// Prompt tokens.
        prompt_len: usize,
        /// Requested output tokens.
        max_tokens: usize,
        /// The limit.
        max_model_len: usize,
    },
    /// The request could never fit in the KV cache, even alone.
    #[error(
        "the request needs {needed} KV blocks but the cache has {total}; lower max_tokens or raise --kv-cache-memory"
    )]
    ExceedsKvCapacity {
        /// Blocks the full sequence needs.
        needed: usize,
        /// Blocks in the pool.
        total: usize,
    },
    /// A sampling parameter is out of range.
    #[error(transparent)]
    Sampling(#[from] InvalidSampling),
    /// Another live request has the same id.
    #[error("request id `{0}` is already in use")]
    DuplicateId(RequestId),
    /// `kv_transfer_params` asks for a remote prefill or decode, but this engine has no KV
    /// connector (it was started with `--role both`) or has the other role.
    #[error("this engine cannot take part in disaggregated serving this way: {0}")]
    NotDisaggregated(&'static str),
    /// `logprobs` where they cannot be given.
    #[error("logprobs are not available {0}")]
    Logprobs(&'static str),
}

/// What a decode engine does when a request's KV cannot be loaded from prefill.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum KvLoadFailure {
    /// Compute the prompt locally instead (same tokens, later).
    #[default]
    Recompute,
    /// End the request with an error.
    Fail,
}

/// Everything needed to attach a KV connector to an engine.
#[derive(Clone, Debug)]
pub struct KvSetup {
    /// The connector's configuration (role, mode, listen address, timeouts...).
    pub connector: ConnectorConfig,
    /// Decode: what to do when KV cannot be loaded.
    pub load_failure: KvLoadFailure,
}

impl EngineLimits {
    /// Checks everything about `req` that can be known before it runs.
    pub fn check(&self, req: &EngineRequest) -> Result<(), RequestRejected> {
        req.params.validate()?;
        // Disaggregated legs give them too: a decode leg samples its first token itself (see
        // `ConnectorEvent::Ready`).
        if req.params.logprobs.is_some() && !self.logprobs {
            return Err(RequestRejected::Logprobs("on this backend"));
        }
        let prompt_len = req.prompt_token_ids.len();
        if prompt_len == 0 {
            return Err(RequestRejected::EmptyPrompt);
        }
        if let Some(&id) = req.prompt_token_ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            return Err(RequestRejected::TokenOutOfRange { id, vocab_size: self.vocab_size });
        }
        if prompt_len >= self.max_model_len {
            return Err(RequestRejected::PromptTooLong { prompt_len, max_model_len: self.max_model_len });
        }
        let max_tokens = req.params.max_tokens;
        // Saturating: max_tokens comes from the client and may be near usize::MAX.
        let total = prompt_len.saturating_add(max_tokens);
        if total > self.max_model_len {
            return Err(RequestRejected::ExceedsContext { prompt_len, max_tokens, max_model_len: self.max_model_len });
        }
        // The last sampled token is never fed back, so the cache holds at most len - 1 tokens.
        let needed = (total - 1).div_ceil(self.block_size);
        if needed > self.num_blocks {
            return Err(RequestRejected::ExceedsKvCapacity { needed, total: self.num_blocks });
        }
        Ok(())
    }
}

/// Counts a step reports (pipelined: of the step or steps it collected).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepReport {
    /// Tokens computed.
    pub num_tokens: usize,
    /// Requests in the batch.
    pub num_seqs: usize,
    /// Requests that finished.
    pub num_finished: usize,
}

impl StepReport {
    fn add(&mut self, other: StepReport) {
        self.num_tokens += other.num_tokens;
        self.num_seqs += other.num_seqs;
        self.num_finished += other.num_finished;
    }
}

/// The model an engine runs: the CPU transformer (the engine allocates its KV cache from the
/// config's block count) or a ready [`ModelRunner`] that owns its KV cache (a GPU model).
pub enum EngineModel {
    /// The f32 CPU transformer.
    Cpu(Box<Transformer>),
    /// Any runner; its KV layout must have the config's block size and block count.
    Runner(Box<dyn ModelRunner>),
}

impl From<Transformer> for EngineModel {
    fn from(t: Transformer) -> Self {
        Self::Cpu(Box::new(t))
    }
}

impl From<Box<dyn ModelRunner>> for EngineModel {
    fn from(r: Box<dyn ModelRunner>) -> Self {
        Self::Runner(r)
    }
}

/// Model (with its KV cache) and scheduler: everything one engine step touches.
pub struct EngineCore {
    model: Box<dyn ModelRunner>,
    scheduler: Scheduler,
    limits: EngineLimits,
    eos_token_ids: Vec<u32>,
    connector: Option<KvConnector>,
    load_failure: KvLoadFailure,
    /// Blocks of aborted decode legs that a prefill engine might still write, held until the
    /// connector reports them released.
    quarantine: HashMap<RequestId, BlockAllocation>,
    /// Blocks of failed decode legs that a direct writer's copy might still land in, each held
    /// until the moment the connector says no write can land any more.
    held_for_late_writes: Vec<(std::time::Instant, BlockAllocation)>,
    /// What the connector reported, in arrival order, applied at the start of the next step.
    connector_events: Vec<ConnectorEvent>,
    /// How long a decode leg may wait for its KV before the engine fails it itself: the
    /// connector's own bound plus slack, so that a connector that stopped answering cannot
    /// leave a request waiting forever.
    kv_wait_bound: std::time::Duration,
    /// `EngineConfig::max_queue_time`.
    max_queue_time: Option<std::time::Duration>,
    /// Async scheduling: the next step is planned and submitted before the previous one's
    /// tokens are back (see [`EngineCore::step`]).
    pipelined: bool,
    /// The submitted step whose tokens are not collected yet (pipelined only).
    in_flight: Option<InFlight>,
    /// Push, pipelined: the runner fences each submitted step's KV writes, so prompt progress
    /// is reported as a step is submitted (with its fences) rather than once it is done.
    fence_kv: bool,
    /// Push from a runner whose forward runs on this thread (a CPU engine's): each step's
    /// layer-group fences are had before it runs, and its prompt progress reported with them,
    /// so the connector sends the KV group by group while the forward computes.
    fence_kv_ahead: bool,
    /// Numbers requests in arrival order, so a collected token never lands in a later
    /// request that reuses an ended one's id.
    next_serial: u64,
}

/// Asks an engine's prefix cache how much of a prompt it holds, without the engine thread.
#[derive(Clone, Debug)]
pub struct PrefixProbe {
    pool: BlockPool,
    keys: PrefixKeys,
}

impl PrefixProbe {
    /// Leading tokens of `prompt` whose KV is cached now (whole blocks; it may be evicted the
    /// next moment, so this is a hint for routing, not a promise).
    pub fn cached_tokens(&self, prompt: &[u32]) -> usize {
        let mut keys = Vec::new();
        crate::BlockHash::extend_chain(self.keys.salt, &mut keys, prompt, self.keys.block_size);
        self.pool.count_cached_prefix(&keys) * self.keys.block_size
    }
}

/// A step submitted to the model whose tokens have not come back yet.
struct InFlight {
    plan: SchedulerOutput,
    /// Per sampled row: the request (id and serial) and the index in its tokens where the
    /// token goes (a placeholder holds it until then, unless the token is its last).
    rows: Vec<(RequestId, u64, usize)>,
    /// Prefill legs whose prompt this step advanced without finishing it.
    progress: Vec<PromptProgress>,
}

/// A prefill leg's prompt computed up to `upto` tokens into `blocks` by a step, as it stood
/// when the step was planned: reported to the connector once the step is done, unless the
/// request ended or was preempted meanwhile (its blocks may be another request's by then).
struct PromptProgress {
    id: RequestId,
    serial: u64,
    attempt: u32,
    transfer_id: TransferId,
    blocks: Vec<u32>,
    upto: usize,
}

impl EngineCore {
    /// Sets up an engine over `model`; a CPU transformer gets a KV cache of `config.num_blocks`
    /// blocks.
    ///
    /// # Panics
    /// If a runner's KV layout disagrees with `config` (a wiring error, not a request error).
    pub fn new(
        model: impl Into<EngineModel>,
        eos_token_ids: Vec<u32>,
        max_model_len: usize,
        config: &EngineConfig,
    ) -> Self {
        let model: Box<dyn ModelRunner> = match model.into() {
            EngineModel::Cpu(t) => Box::new(CpuRunner::new(*t, config.block_size, config.num_blocks)),
            EngineModel::Runner(r) => r,
        };
        let runner_pipelines = model.can_pipeline();
        let layout = model.kv_layout();
        assert!(
            layout.block_size == config.block_size && layout.num_blocks == config.num_blocks,
            "the model's KV cache ({} blocks of {}) does not match the engine config ({} of {})",
            layout.num_blocks,
            layout.block_size,
            config.num_blocks,
            config.block_size
        );
        let limits = EngineLimits {
            vocab_size: model.config().vocab_size,
            max_model_len: max_model_len.min(model.max_positions()),
            block_size: config.block_size,
            num_blocks: config.num_blocks,
            logprobs: model.supports_logprobs(),
        };
        let pool = BlockPool::new(config.num_blocks);
        let mut scheduler = Scheduler::new(pool, config.block_size, config.max_num_seqs, config.max_num_batched_tokens);
        // Keys chain from the model's fingerprint: equal keys on two engines mean equal KV.
        scheduler.prefix_keys = config.prefix_caching.then(|| PrefixKeys {
            salt: xxhash_rust::xxh3::xxh3_128(model.fingerprint().as_bytes()),
            block_size: config.block_size,
        });
        Self {
            scheduler,
            model,
            limits,
            eos_token_ids,
            connector: None,
            fence_kv: false,
            fence_kv_ahead: false,
            load_failure: KvLoadFailure::default(),
            quarantine: HashMap::new(),
            held_for_late_writes: Vec::new(),
            connector_events: Vec::new(),
            kv_wait_bound: std::time::Duration::MAX,
            max_queue_time: config.max_queue_time,
            pipelined: config.async_scheduling && runner_pipelines,
            in_flight: None,
            next_serial: 0,
        }
    }

    /// Whether steps are pipelined (async scheduling asked for and the runner supports it).
    pub fn pipelined(&self) -> bool {
        self.pipelined
    }

    /// Where the model runs (`cpu (f32)`, `cuda:0 (...) bf16`).
    pub fn device(&self) -> String {
        self.model.describe()
    }

    /// Starts a KV connector over this engine's KV memory (prefill or decode role); its events
    /// go to `sink`, which hands them back through [`EngineCore::connector_event`].
    pub fn attach_connector(&mut self, mut setup: KvSetup, sink: EventSink) -> Result<AgentInfo, KvError> {
        setup.connector.tp_size = self.model.tensor_parallel_size() as u32;
        let memory = match (self.model.kv_device(), self.model.kv_region()) {
            (Some(device), host) => tandem_kv::KvMemory::device(device, host)?,
            (None, Some(host)) => host.into(),
            (None, None) => {
                return Err(KvError::Unsupported(format!(
                    "this engine on {} offers its KV cache to no transport",
                    self.model.describe()
                )))
            }
        };
        // The connector fails a transfer within its timeout (plus one I/O timeout for a write
        // in flight) and checks deadlines every 50 ms.
        let cfg = &setup.connector;
        self.kv_wait_bound = cfg.transfer_timeout + cfg.timeouts.io + std::time::Duration::from_secs(1);
        let connector = KvConnector::start(setup.connector, memory, sink)?;
        let info = connector.info().clone();
        // A push writes a prompt's KV while it computes: a runner that can say when each step's
        // KV is final lets that start as the step is submitted rather than once it is done.
        let push = info.kv_mode == tandem_kv::KvMode::Push;
        self.fence_kv = push && self.pipelined && self.model.fence_kv_writes();
        self.fence_kv_ahead = push && info.role != tandem_kv::Role::Decode && self.model.fence_kv_ahead();
        self.connector = Some(connector);
        self.load_failure = setup.load_failure;
        Ok(info)
    }

    /// A view of the connector (its connections and counters) for other threads, if there is one.
    pub fn kv_view(&self) -> Option<tandem_kv::KvView> {
        self.connector.as_ref().map(KvConnector::view)
    }

    /// Queues an event from the connector for the next step.
    pub fn connector_event(&mut self, ev: ConnectorEvent) {
        self.connector_events.push(ev);
    }

    /// How long the loop may wait for input before it must step again: until the earliest
    /// decode leg's KV wait runs out (at most `idle`).
    pub fn idle_wait(&self, idle: std::time::Duration) -> std::time::Duration {
        let deadlines = self.scheduler.remote_waiting.iter().filter_map(|id| {
            let asked = self.scheduler.requests.get(id)?.kv_requested?;
            Some((asked + self.kv_wait_bound).saturating_duration_since(std::time::Instant::now()))
        });
        deadlines.fold(idle, std::cmp::min).max(std::time::Duration::from_millis(1))
    }

    /// The engine's limits.
    pub fn limits(&self) -> &EngineLimits {
        &self.limits
    }

    /// Queues a request; its events go to `events`.
    pub fn add_request(
        &mut self,
        mut req: EngineRequest,
        events: UnboundedSender<EngineEvent>,
    ) -> Result<(), RequestRejected> {
        if let Some(RemoteKv::Produce { .. }) = req.remote {
            // A prefill leg samples exactly one token; its KV then goes to the decoder.
            req.params.max_tokens = 1;
            req.params.min_tokens = 0;
        }
        self.limits.check(&req)?;
        if self.scheduler.requests.contains_key(&req.id) {
            return Err(RequestRejected::DuplicateId(req.id));
        }
        let role = self.connector.as_ref().map(|c| c.info().role);
        check_role(&req, role)?;
        let remote_decode = matches!(req.remote, Some(RemoteKv::PushFrom { .. } | RemoteKv::PullFrom { .. }));
        let blocks = self.scheduler.pool.empty_allocation();
        let mut request = Request::new(req, blocks, events);
        request.serial = self.next_serial;
        self.next_serial += 1;
        if remote_decode {
            self.scheduler.add_remote(request);
        } else {
            self.scheduler.add(request);
        }
        Ok(())
    }

    /// Ends a request now, freeing its blocks (or quarantining them while a prefill engine
    /// may still write them). Returns false if it was not live.
    pub fn abort(&mut self, id: &RequestId) -> bool {
        match self.scheduler.remove(id) {
            Some(mut req) => {
                if let Some(c) = &self.connector {
                    match (&req.remote, req.status) {
                        (Some(_), RequestStatus::WaitingForRemoteKvs) => {
                            let blocks = std::mem::replace(&mut req.blocks, self.scheduler.pool.empty_allocation());
                            self.quarantine.insert(req.id.clone(), blocks);
                            c.abort(req.id.clone());
                        }
                        (Some(RemoteKv::Produce { transfer_id }), _) => {
                            c.abandon(transfer_id.clone(), "prefill request aborted".into())
                        }
                        _ => {}
                    }
                }
                let _ = req.events.send(EngineEvent::Tokens {
                    token_ids: Vec::new(),
                    finish: Some(FinishReason::Abort),
                    logprobs: Vec::new(),
                });
                true
            }
            None => false,
        }
    }

    /// Prefill: the KV produced under `transfer_id` will not be taken (the router saw its
    /// decode leg fail). A prefill leg still computing is aborted; finished KV is freed now
    /// instead of when its registration wait or lease runs out. Returns whether a live
    /// request was aborted.
    pub fn release_kv(&mut self, transfer_id: &TransferId) -> bool {
        let leg = self.scheduler.requests.iter().find_map(|(id, r)| match &r.remote {
            Some(RemoteKv::Produce { transfer_id: t }) if t == transfer_id => Some(id.clone()),
            _ => None,
        });
        match (leg, &self.connector) {
            (Some(id), _) => self.abort(&id),
            (None, Some(c)) => {
                c.abandon(transfer_id.clone(), "released: the decode leg failed".into());
                false
            }
            (None, None) => false,
        }
    }

    /// Whether any request is live, any blocks are quarantined or held, or a step is in flight.
    pub fn has_work(&self) -> bool {
        self.scheduler.has_work()
            || !self.quarantine.is_empty()
            || !self.held_for_late_writes.is_empty()
            || self.in_flight.is_some()
    }

    /// Whether a step would compute, collect or apply something now (otherwise the loop may
    /// wait for connector events or commands).
    pub fn has_runnable(&self) -> bool {
        self.scheduler.has_runnable()
            || !self.scheduler.remote_queue.is_empty()
            || self.in_flight.is_some()
            // Events to apply: step now rather than wait for more input.
            || !self.connector_events.is_empty()
    }

    /// Requests running / waiting.
    pub fn num_running(&self) -> usize {
        self.scheduler.running.len()
    }

    /// Requests queued (including preempted ones).
    pub fn num_waiting(&self) -> usize {
        self.scheduler.waiting.len()
    }

    /// Free KV blocks.
    pub fn num_free_blocks(&self) -> usize {
        self.scheduler.pool.num_free()
    }

    /// Preemptions so far.
    pub fn num_preemptions(&self) -> u64 {
        self.scheduler.num_preemptions
    }

    /// A way to ask, from any thread, how much of a prompt this engine has cached (`None`
    /// without prefix caching).
    pub fn prefix_probe(&self) -> Option<PrefixProbe> {
        Some(PrefixProbe { pool: self.scheduler.pool.clone(), keys: self.scheduler.prefix_keys? })
    }

    /// Prefix-cache counters, and the blocks whose KV is cached now.
    pub fn prefix_cache(&self) -> (PrefixCacheStats, usize) {
        (self.scheduler.pool.stats(), self.scheduler.pool.num_cached())
    }

    /// Runs one step: apply connector events, start remote loads, schedule, forward, sample,
    /// emit.
    ///
    /// Pipelined (async scheduling), the forward of step N+1 is submitted before step N's
    /// tokens are collected, so the device goes from one step to the next without waiting
    /// for the host: scheduling N+1 treats N as done (computed counts advanced, a placeholder
    /// for each sampled token, which the runner resolves on the device), then N's tokens are
    /// collected and emitted. The report describes the collected step. A request whose
    /// sampled token ends it by length is not scheduled again; one ended by a stop token in N
    /// has run one more forward in N+1, whose output is dropped.
    pub fn step(&mut self) -> StepReport {
        self.apply_connector_events();
        self.fail_overdue_kv_loads();
        self.end_overdue_queued();
        self.start_remote_loads();
        let mut report = StepReport::default();
        let plan = self.schedule();
        if !self.pipelined {
            if plan.chunks.is_empty() {
                return StepReport::default();
            }
            let progress = match self.kv_fences_ahead(&plan) {
                Some(fences) => {
                    self.report_progress(self.prompt_progress(&plan, true), &fences);
                    Vec::new()
                }
                None => self.prompt_progress(&plan, false),
            };
            return match self.execute(&plan) {
                Ok(tokens) => {
                    let report = self.update(&plan, &tokens);
                    self.report_progress(progress, &KvFences::complete());
                    report
                }
                Err(e) => self.fail_batch(&plan, &e.to_string()),
            };
        }
        let submitted = if plan.chunks.is_empty() {
            None
        } else {
            let (token_ids, seqs, samples) = self.model_inputs(&plan);
            let ahead = self.kv_fences_ahead(&plan);
            if let Some(fences) = &ahead {
                self.report_progress(self.prompt_progress(&plan, true), fences);
            }
            match self.model.submit(&token_ids, &seqs, &samples) {
                Ok(()) if ahead.is_some() => Some(self.advance(plan)),
                Ok(()) => {
                    let fences = if self.fence_kv { self.model.take_kv_fences() } else { None };
                    // Fenced, the step's KV becomes final layer group by layer group as it
                    // runs: reported now, the chunk that completes a prompt too (its copies
                    // then overlap the step's later layers); else once the step is collected.
                    let progress = self.prompt_progress(&plan, fences.is_some());
                    let mut in_flight = self.advance(plan);
                    match fences {
                        Some(fences) => self.report_progress(progress, &fences),
                        None => in_flight.progress = progress,
                    }
                    Some(in_flight)
                }
                Err(e) => {
                    report.add(self.fail_batch(&plan, &e.to_string()));
                    None
                }
            }
        };
        let previous = std::mem::replace(&mut self.in_flight, submitted);
        if let Some(done) = previous {
            report.add(self.collect(done));
        }
        report
    }

    /// The next step's plan; a push prefill engine's admissions keep room for prompts decode
    /// has registered (see `scheduler`).
    fn schedule(&mut self) -> SchedulerOutput {
        let Some(connector) = self.connector.as_ref().filter(|c| {
            let info = c.info();
            info.kv_mode == tandem_kv::KvMode::Push && info.role == tandem_kv::Role::Prefill
        }) else {
            return self.scheduler.schedule_with(None);
        };
        let s = &self.scheduler;
        let block_size = s.block_size();
        let registered = |tid: &TransferId| connector.is_registered(tid);
        let running: usize = s
            .running
            .iter()
            .filter_map(|id| s.requests.get(id))
            .filter(|r| matches!(&r.remote, Some(RemoteKv::Produce { transfer_id }) if !registered(transfer_id)))
            .map(|r| r.tokens.len().div_ceil(block_size))
            .sum();
        let total = s.pool.num_total();
        let longest = self.limits.max_model_len.div_ceil(block_size).min(total);
        let push = PushAdmission {
            unregistered_blocks: connector.unclaimed_blocks() + running,
            limit: total - longest,
            registered: &registered,
        };
        self.scheduler.schedule_with(Some(push))
    }

    /// Waits for `done`'s tokens and emits them (or fails its batch).
    fn collect(&mut self, mut done: InFlight) -> StepReport {
        match self.model.collect() {
            Ok(tokens) => {
                let report = self.update_collected(&done, &tokens);
                self.report_progress(std::mem::take(&mut done.progress), &KvFences::complete());
                report
            }
            Err(e) => self.fail_batch(&done.plan, &e.to_string()),
        }
    }

    /// Push, from a runner that fences ahead: the fences the step about to run sets as it
    /// writes its KV, when it computes a prompt whose KV goes to a decode engine.
    fn kv_fences_ahead(&mut self, plan: &SchedulerOutput) -> Option<KvFences> {
        let produces = |c: &crate::scheduler::ScheduledChunk| {
            let req = self.scheduler.requests.get(&c.id);
            matches!(req.and_then(|r| r.remote.as_ref()), Some(RemoteKv::Produce { .. }))
        };
        if !self.fence_kv_ahead || !plan.chunks.iter().any(produces) {
            return None;
        }
        self.model.kv_fences_ahead()
    }

    /// Push: the prefill legs in `plan` whose chunk does not finish their prompt (a finished
    /// one hands its KV over with its token), and with `with_last` those whose chunk does;
    /// taken before the step runs.
    fn prompt_progress(&self, plan: &SchedulerOutput, with_last: bool) -> Vec<PromptProgress> {
        // Only a push writes KV before the prompt is complete.
        if !self.connector.as_ref().is_some_and(|c| c.info().kv_mode == tandem_kv::KvMode::Push) {
            return Vec::new();
        }
        let progress = plan.chunks.iter().filter(|c| with_last || !c.sample).filter_map(|c| {
            let req = self.scheduler.requests.get(&c.id)?;
            let Some(RemoteKv::Produce { transfer_id }) = &req.remote else { return None };
            Some(PromptProgress {
                id: c.id.clone(),
                serial: req.serial,
                attempt: req.num_preemptions,
                transfer_id: transfer_id.clone(),
                blocks: c.block_table.clone(),
                upto: c.first_pos + c.token_ids.len(),
            })
        });
        progress.collect()
    }

    /// Tells the connector how far the prompts of a step got, for those still running as they
    /// were planned: the KV is final once `fences` say so (complete: the step's tokens are
    /// back) and no later step writes those positions.
    fn report_progress(&self, progress: Vec<PromptProgress>, fences: &KvFences) {
        let Some(connector) = &self.connector else { return };
        for p in progress {
            let same = self.scheduler.requests.get(&p.id).is_some_and(|r| {
                r.serial == p.serial && r.num_preemptions == p.attempt && r.status == RequestStatus::Running
            });
            if same {
                connector.computed(p.transfer_id, p.blocks, p.upto, p.attempt, fences.clone());
            }
        }
    }

    /// Pipelined: marks `plan` as computed the moment it is submitted, so the next schedule
    /// builds on it; each sampled token gets a placeholder naming its sample row, unless it
    /// ends its request by length (then the request has nothing more to schedule).
    fn advance(&mut self, plan: SchedulerOutput) -> InFlight {
        let mut rows = Vec::new();
        for c in &plan.chunks {
            let samples = c.sample && !c.token_ids.is_empty();
            let Some(req) = self.scheduler.requests.get_mut(&c.id) else {
                if samples {
                    rows.push((c.id.clone(), u64::MAX, 0)); // keeps the rows aligned; matches no request
                }
                continue;
            };
            req.num_computed += c.token_ids.len();
            if let Some(keys) = self.scheduler.prefix_keys {
                // Registered as submitted: a step that reads them is queued after this one.
                req.register_computed_blocks(keys);
            }
            if !samples {
                continue;
            }
            let index = req.tokens.len();
            let last_by_length = ends_by_length(req, index, self.limits.max_model_len);
            if !last_by_length {
                req.tokens.push(carried_token(rows.len()));
            }
            rows.push((c.id.clone(), req.serial, index));
        }
        InFlight { plan, rows, progress: Vec::new() }
    }

    fn execute(&mut self, plan: &SchedulerOutput) -> Result<Vec<u32>, tandem_model::ModelError> {
        let (token_ids, seqs, samples) = self.model_inputs(plan);
        self.model.execute(&token_ids, &seqs, &samples)
    }

    /// The runner's inputs for `plan`: all tokens concatenated, one `SeqBatch` per chunk, one
    /// `SampleSpec` per sampling chunk.
    fn model_inputs<'p>(&mut self, plan: &'p SchedulerOutput) -> (Vec<u32>, Vec<SeqBatch<'p>>, Vec<SampleSpec>) {
        let mut token_ids = Vec::with_capacity(plan.num_tokens());
        let mut seqs = Vec::with_capacity(plan.chunks.len());
        let mut samples = Vec::new();
        for c in &plan.chunks {
            seqs.push(SeqBatch {
                token_start: token_ids.len(),
                num_tokens: c.token_ids.len(),
                first_pos: c.first_pos,
                block_table: &c.block_table,
                want_logits: c.sample,
            });
            token_ids.extend_from_slice(&c.token_ids);
            if c.sample && !c.token_ids.is_empty() {
                samples.push(self.sample_spec(&c.id));
            }
        }
        (token_ids, seqs, samples)
    }

    /// How to pick `id`'s next token; draws its uniform from the request's own stream (one
    /// draw per non-greedy token, so a seed replays the same way on every backend).
    fn sample_spec(&mut self, id: &RequestId) -> SampleSpec {
        let Some(req) = self.scheduler.requests.get_mut(id) else { return SampleSpec::greedy() };
        let p = &req.params;
        let banned: Vec<u32> = if req.num_output_tokens() < p.min_tokens {
            let eos = if p.ignore_eos { &[][..] } else { &self.eos_token_ids[..] };
            eos.iter().chain(&p.stop_token_ids).copied().collect()
        } else {
            Vec::new()
        };
        let greedy = p.is_greedy();
        let (temperature, top_k, top_p) = (p.temperature, p.top_k.unwrap_or(0), p.top_p);
        let uniform = if greedy { 0.0 } else { req.rng.random::<f32>() };
        let logprobs = p.logprobs;
        SampleSpec { temperature: if greedy { 0.0 } else { temperature }, top_k, top_p, uniform, banned, logprobs }
    }

    /// A forward failed (a device error): every request in the batch ends with the error,
    /// the engine keeps serving.
    fn fail_batch(&mut self, plan: &SchedulerOutput, reason: &str) -> StepReport {
        tracing::error!(%reason, requests = plan.chunks.len(), "forward failed; failing the batch");
        let mut report = StepReport { num_tokens: 0, num_seqs: plan.chunks.len(), num_finished: 0 };
        for c in &plan.chunks {
            if let Some(req) = self.scheduler.remove(&c.id) {
                // What this step was to compute may be garbage: no later prompt may take it.
                req.blocks.unregister_from(c.first_pos / self.scheduler.block_size());
                let _ = req.events.send(EngineEvent::Failed(format!("the model failed: {reason}")));
                report.num_finished += 1;
            }
        }
        report
    }

    fn update(&mut self, plan: &SchedulerOutput, tokens: &[u32]) -> StepReport {
        let mut report = StepReport { num_tokens: plan.num_tokens(), num_seqs: plan.chunks.len(), num_finished: 0 };
        let mut logprobs = self.model.take_logprobs().into_iter();
        let mut sampled = tokens.iter();
        let mut finished = Vec::new();
        for c in &plan.chunks {
            // Rows follow the sampling chunks, whether or not their request is still here.
            let token = if c.sample && !c.token_ids.is_empty() {
                sampled.next().map(|&t| (t, logprobs.next().flatten()))
            } else {
                None
            };
            let Some(req) = self.scheduler.requests.get_mut(&c.id) else {
                continue;
            };
            req.num_computed += c.token_ids.len();
            if let Some(keys) = self.scheduler.prefix_keys {
                req.register_computed_blocks(keys);
            }
            if let Some((token, logprobs)) = token {
                let (index, serial) = (req.tokens.len(), req.serial);
                self.emit_token(&c.id, serial, index, (token, logprobs), &mut finished);
            }
        }
        report.num_finished = self.finish(finished);
        report
    }

    /// Pipelined: emits a collected step's tokens where `advance` reserved them.
    fn update_collected(&mut self, done: &InFlight, tokens: &[u32]) -> StepReport {
        let plan = &done.plan;
        let mut report = StepReport { num_tokens: plan.num_tokens(), num_seqs: plan.chunks.len(), num_finished: 0 };
        let mut logprobs = self.model.take_logprobs().into_iter();
        let mut finished = Vec::new();
        for ((id, serial, index), &token) in done.rows.iter().zip(tokens) {
            let logprobs = logprobs.next().flatten();
            self.emit_token(id, *serial, *index, (token, logprobs), &mut finished);
        }
        report.num_finished = self.finish(finished);
        report
    }

    /// Ends the requests in `finished` (their blocks go back to the pool); returns how many.
    fn finish(&mut self, finished: Vec<RequestId>) -> usize {
        finished.into_iter().filter(|id| self.scheduler.remove(id).is_some()).count()
    }

    /// Puts `token` at `index` of request `id`'s tokens (replacing the placeholder there, or
    /// appending), checks whether it ends the request, hands a finished prefill leg's KV to the
    /// connector and sends the token. `serial` guards against a request that ended meanwhile
    /// and a new one under the same id: such a token is dropped. The token comes with its
    /// log-probabilities when the request asked for them.
    fn emit_token(
        &mut self,
        id: &RequestId,
        serial: u64,
        index: usize,
        sampled: (u32, Option<TokenLogprobs>),
        finished: &mut Vec<RequestId>,
    ) {
        let (token, logprobs) = sampled;
        let Some(req) = self.scheduler.requests.get_mut(id).filter(|r| r.serial == serial) else { return };
        match index.cmp(&req.tokens.len()) {
            std::cmp::Ordering::Less => req.tokens[index] = token,
            std::cmp::Ordering::Equal => req.tokens.push(token),
            std::cmp::Ordering::Greater => {
                tracing::error!(request_id = %id, index, len = req.tokens.len(), "a sampled token lands past the request's tokens; dropped");
                return;
            }
        }
        let finish = finish_reason(req, token, index, &self.eos_token_ids, self.limits.max_model_len);
        if finish.is_some() {
            if let (Some(RemoteKv::Produce { transfer_id }), Some(connector)) = (&req.remote, &self.connector) {
                // The prompt's KV now belongs to the connector, which frees it after the
                // push write or when the pull lease ends.
                let blocks = std::mem::replace(&mut req.blocks, self.scheduler.pool.empty_allocation());
                // The step that computed them has completed (its token is here), so the
                // connector may copy them on its own stream at once.
                let table = blocks.table();
                let num_tokens = req.num_computed;
                let _ = req.events.send(EngineEvent::KvProduced {
                    transfer_id: transfer_id.clone(),
                    block_ids: table.clone(),
                    num_tokens,
                    first_token: token,
                });
                let attempt = req.num_preemptions;
                connector.produced(transfer_id.clone(), Box::new(blocks), table, num_tokens, token, attempt);
            }
        }
        let logprobs = logprobs.into_iter().collect();
        let delivered = req.events.send(EngineEvent::Tokens { token_ids: vec![token], finish, logprobs }).is_ok();
        if finish.is_some() || !delivered {
            // A closed receiver means the caller is gone: stop spending compute on it.
            finished.push(id.clone());
        }
    }
}

/// Refuses a request whose `kv_transfer_params` ask for a part this engine does not play.
pub(crate) fn check_role(req: &EngineRequest, role: Option<tandem_kv::Role>) -> Result<(), RequestRejected> {
    let remote_decode = matches!(req.remote, Some(RemoteKv::PushFrom { .. } | RemoteKv::PullFrom { .. }));
    match (&req.remote, role) {
        (None, _) => Ok(()),
        (Some(_), None) => {
            Err(RequestRejected::NotDisaggregated("no KV connector (start with --role prefill or decode)"))
        }
        (Some(RemoteKv::Produce { .. }), Some(tandem_kv::Role::Decode)) => {
            Err(RequestRejected::NotDisaggregated("a decode engine cannot serve a prefill leg (do_remote_decode)"))
        }
        (Some(_), Some(tandem_kv::Role::Prefill)) if remote_decode => {
            Err(RequestRejected::NotDisaggregated("a prefill engine cannot serve a decode leg (do_remote_prefill)"))
        }
        _ => Ok(()),
    }
}

/// Why generation ends after `token`, the request's token at `index`, if it does. (Pipelined,
/// a placeholder for the next token may already follow it, so lengths count from `index`.)
fn finish_reason(req: &Request, token: u32, index: usize, eos: &[u32], max_model_len: usize) -> Option<FinishReason> {
    if !req.params.ignore_eos && eos.contains(&token) || req.params.stop_token_ids.contains(&token) {
        Some(FinishReason::Stop)
    } else if ends_by_length(req, index, max_model_len) {
        Some(FinishReason::Length)
    } else {
        None
    }
}

/// Whether the request's token at `index` is its last by length (`max_tokens` or the context).
fn ends_by_length(req: &Request, index: usize, max_model_len: usize) -> bool {
    let len = index + 1;
    len.saturating_sub(req.prompt_len) >= req.params.max_tokens || len >= max_model_len
}

impl EngineCore {
    /// Gives queued decode legs their blocks and asks the connector for their KV.
    fn start_remote_loads(&mut self) {
        let Some(connector) = &self.connector else { return };
        let alignment = |source: &RemoteKv| match source {
            RemoteKv::PushFrom { peer, .. } | RemoteKv::PullFrom { peer, .. } => connector.transfer_alignment(peer),
            RemoteKv::Produce { .. } => None,
        };
        while let Some((id, cached)) = self.scheduler.start_next_remote_load(&alignment) {
            let Some(req) = self.scheduler.requests.get(&id) else { continue };
            if let Some(source) = req.remote.clone() {
                tracing::debug!(request_id = %id, transfer_id = %source.transfer_id(), cached, "waiting for remote KV");
                connector.expect(id, source, req.blocks.table(), req.prompt_len, cached);
            }
        }
    }

    /// Fails decode legs whose KV wait ran past [`EngineCore::kv_wait_bound`] without a word
    /// from the connector (its thread died, or is stuck). Their blocks stay out of use until
    /// the connector releases them, if it ever does: a late write can never land in a new
    /// owner's blocks.
    fn fail_overdue_kv_loads(&mut self) {
        let Some(connector) = &self.connector else { return };
        let bound = self.kv_wait_bound;
        let overdue: Vec<RequestId> = self
            .scheduler
            .remote_waiting
            .iter()
            .filter(|id| {
                let asked = self.scheduler.requests.get(*id).and_then(|r| r.kv_requested);
                asked.is_some_and(|t| t.elapsed() > bound)
            })
            .cloned()
            .collect();
        for id in overdue {
            let Some(mut req) = self.scheduler.remove(&id) else { continue };
            let blocks = std::mem::replace(&mut req.blocks, self.scheduler.pool.empty_allocation());
            self.quarantine.insert(id.clone(), blocks);
            connector.abort(id.clone());
            tracing::warn!(request_id = %id, bound_ms = bound.as_millis() as u64, "no word from the KV connector; failing the request");
            let reason = format!("the KV connector did not answer within {:.1} s", bound.as_secs_f64());
            let _ =
                req.events.send(EngineEvent::Failed(format!("loading the prompt's KV from prefill failed: {reason}")));
        }
    }

    /// Ends the requests that waited in the queue past `max_queue_time` without running: they
    /// hold no blocks and nothing of them was computed, so the client may send them again.
    fn end_overdue_queued(&mut self) {
        let Some(bound) = self.max_queue_time else { return };
        let s = &self.scheduler;
        let overdue: Vec<RequestId> = (s.waiting.iter().chain(&s.remote_queue))
            .filter(|id| s.requests.get(*id).is_some_and(|r| r.never_ran() && r.arrived.elapsed() > bound))
            .cloned()
            .collect();
        for id in overdue {
            let Some(req) = self.scheduler.remove(&id) else { continue };
            let waited_ms = req.arrived.elapsed().as_millis() as u64;
            tracing::info!(request_id = %id, waited_ms, "queued past --max-queue-secs without running; ended");
            let _ = req.events.send(EngineEvent::QueueTimeout { waited_ms, bound_ms: bound.as_millis() as u64 });
        }
    }

    /// Applies what the connector reported since the last step (one fixed point per step).
    fn apply_connector_events(&mut self) {
        let now = std::time::Instant::now();
        self.held_for_late_writes.retain(|(until, _)| *until > now);
        for ev in std::mem::take(&mut self.connector_events) {
            let refused = matches!(ev, ConnectorEvent::Refused { .. });
            match ev {
                ConnectorEvent::Released { request_id } => {
                    self.quarantine.remove(&request_id);
                }
                ConnectorEvent::Ready { request_id, first_token, timeline } => {
                    let Some(req) = self.scheduler.requests.get_mut(&request_id) else { continue };
                    if req.status != RequestStatus::WaitingForRemoteKvs {
                        continue;
                    }
                    // The KV is in the cache (the connector loads a device cache before `Ready`)
                    // and the blocks are the engine's again.
                    self.scheduler.remote_waiting.retain(|r| r != &request_id);
                    req.status = RequestStatus::Running;
                    req.num_computed = req.prompt_len;
                    if let Some(keys) = self.scheduler.prefix_keys {
                        // Landed and checked: the loaded KV is as good as computed here.
                        req.register_computed_blocks(keys);
                    }
                    let us = |d: std::time::Duration| d.as_micros() as u64;
                    let queued = req.kv_requested.map(|t| t.duration_since(req.arrived)).unwrap_or_default();
                    let now_unix = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(us);
                    let produced_to_ready_us = match (timeline.produced_unix_us, now_unix) {
                        (0, _) | (_, Err(_)) => None,
                        (at, Ok(now)) => now.checked_sub(at),
                    };
                    let _ = req.events.send(EngineEvent::KvLoaded {
                        timeline: KvLoadTimeline {
                            queued_us: us(queued),
                            transfer: timeline,
                            ready_us: us(req.arrived.elapsed()),
                            produced_to_ready_us,
                        },
                    });
                    let mut finish = None;
                    // A request that wants log-probabilities samples its first token here, from
                    // its last prompt token recomputed over the loaded KV: the prefill engine's
                    // token comes without its distribution. On the CPU the logits are the bits
                    // prefill had (batch-invariant kernels), so the token is the same.
                    let first_token = first_token.filter(|_| req.params.logprobs.is_none());
                    match first_token {
                        Some(t) => {
                            // Prefill drew this token's uniform from the same seeded stream:
                            // take that draw too, so a seeded request continues as it would on
                            // one engine.
                            if !req.params.is_greedy() {
                                let _ = req.rng.random::<f32>();
                            }
                            req.tokens.push(t);
                            let index = req.tokens.len() - 1;
                            finish = finish_reason(req, t, index, &self.eos_token_ids, self.limits.max_model_len);
                            let _ = req.events.send(EngineEvent::Tokens {
                                token_ids: vec![t],
                                finish,
                                logprobs: Vec::new(),
                            });
                        }
                        // No token came with the KV: recompute the last prompt token to sample.
                        None => req.num_computed = req.prompt_len - 1,
                    }
                    if finish.is_some() {
                        self.scheduler.requests.remove(&request_id);
                    } else {
                        self.scheduler.running.push(request_id);
                    }
                }
                ConnectorEvent::FailedInFlight { request_id, reason, writes_until } => {
                    self.kv_load_failed(request_id, &reason, self.load_failure, Some(writes_until))
                }
                ConnectorEvent::Failed { request_id, reason } | ConnectorEvent::Refused { request_id, reason } => {
                    // A peer that cannot pair is a misconfiguration: recomputing would answer
                    // every request while hiding it, so such a request always fails.
                    let policy = if refused { KvLoadFailure::Fail } else { self.load_failure };
                    self.kv_load_failed(request_id, &reason, policy, None)
                }
            }
        }
    }

    /// The connector gave up on a decode leg's KV: the request goes on by `policy`. With
    /// `writes_until`, a late direct copy may still land in its blocks: those stay out of use
    /// until then and a recompute takes others.
    fn kv_load_failed(
        &mut self,
        request_id: RequestId,
        reason: &str,
        policy: KvLoadFailure,
        writes_until: Option<std::time::Instant>,
    ) {
        let Some(req) = self.scheduler.requests.get_mut(&request_id) else { return };
        if req.status != RequestStatus::WaitingForRemoteKvs {
            return;
        }
        if let Some(until) = writes_until {
            let blocks = std::mem::replace(&mut req.blocks, self.scheduler.pool.empty_allocation());
            self.held_for_late_writes.push((until, blocks));
        }
        self.scheduler.remote_waiting.retain(|r| r != &request_id);
        Self::remote_load_failed(&mut self.scheduler, policy, request_id, reason);
    }

    /// A decode leg's KV will not come (or could not be loaded): recompute the prompt here, or
    /// fail the request, as `--kv-load-failure` says. The connector no longer writes its blocks.
    fn remote_load_failed(scheduler: &mut Scheduler, policy: KvLoadFailure, request_id: RequestId, reason: &str) {
        let Some(req) = scheduler.requests.get_mut(&request_id) else { return };
        match policy {
            KvLoadFailure::Recompute => {
                tracing::warn!(request_id = %request_id, %reason, "remote KV failed; recomputing locally");
                req.blocks.release();
                req.num_computed = 0;
                req.remote = None;
                req.status = RequestStatus::Waiting;
                scheduler.waiting.push_back(request_id);
            }
            KvLoadFailure::Fail => {
                let _ = req
                    .events
                    .send(EngineEvent::Failed(format!("loading the prompt's KV from prefill failed: {reason}")));
                scheduler.requests.remove(&request_id);
            }
        }
    }
}
