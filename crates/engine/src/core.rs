//! The engine core: one step = schedule, run the model, update requests from its output.
//!
//! [`EngineCore`] is synchronous and single-threaded; [`crate::spawn`] runs it on its own OS
//! thread. Tests drive it directly, step by step.

use tandem_compute::KvCache;
use tandem_core::{FinishReason, InvalidSampling, RequestId};
use tandem_model::{SeqBatch, Transformer};
use tokio::sync::mpsc::UnboundedSender;

use crate::block_pool::BlockPool;
use crate::request::{EngineEvent, EngineRequest, Request, RequestStatus};
use crate::sampler::sample;
use crate::scheduler::{Scheduler, SchedulerOutput};
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
    #[error("the request needs {needed} KV blocks but the cache has {total}; lower max_tokens or raise --kv-cache-memory")]
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
}

impl EngineLimits {
    /// Checks everything about `req` that can be known before it runs.
    pub fn check(&self, req: &EngineRequest) -> Result<(), RequestRejected> {
        req.params.validate()?;
        let prompt_len = req.prompt_token_ids.len();
        if prompt_len == 0 {
            return Err(RequestRejected::EmptyPrompt);
        }
        if let Some(&id) = req
            .prompt_token_ids
            .iter()
            .find(|&&id| id as usize >= self.vocab_size)
        {
            return Err(RequestRejected::TokenOutOfRange {
                id,
                vocab_size: self.vocab_size,
            });
        }
        if prompt_len >= self.max_model_len {
            return Err(RequestRejected::PromptTooLong {
                prompt_len,
                max_model_len: self.max_model_len,
            });
        }
        let max_tokens = req.params.max_tokens;
        // Saturating: max_tokens comes from the client and may be near usize::MAX.
        let total = prompt_len.saturating_add(max_tokens);
        if total > self.max_model_len {
            return Err(RequestRejected::ExceedsContext {
                prompt_len,
                max_tokens,
                max_model_len: self.max_model_len,
            });
        }
        // The last sampled token is never fed back, so the cache holds at most len - 1 tokens.
        let needed = (total - 1).div_ceil(self.block_size);
        if needed > self.num_blocks {
            return Err(RequestRejected::ExceedsKvCapacity {
                needed,
                total: self.num_blocks,
            });
        }
        Ok(())
    }
}

/// Counts a step reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepReport {
    /// Tokens computed.
    pub num_tokens: usize,
    /// Requests in the batch.
    pub num_seqs: usize,
    /// Requests that finished.
    pub num_finished: usize,
}

/// Model, KV cache and scheduler: everything one engine step touches.
pub struct EngineCore {
    model: Transformer,
    kv: KvCache,
    scheduler: Scheduler,
    limits: EngineLimits,
    eos_token_ids: Vec<u32>,
}

impl EngineCore {
    /// Allocates the KV cache (`config.num_blocks` blocks) for `model`.
    pub fn new(
        model: Transformer,
        eos_token_ids: Vec<u32>,
        max_model_len: usize,
        config: &EngineConfig,
    ) -> Self {
        let layout = model.kv_layout(config.block_size, config.num_blocks);
        let limits = EngineLimits {
            vocab_size: model.config().vocab_size,
            max_model_len: max_model_len.min(model.max_positions()),
            block_size: config.block_size,
            num_blocks: config.num_blocks,
        };
        let pool = BlockPool::new(config.num_blocks);
        Self {
            kv: KvCache::new(layout),
            scheduler: Scheduler::new(
                pool,
                config.block_size,
                config.max_num_seqs,
                config.max_num_batched_tokens,
            ),
            model,
            limits,
            eos_token_ids,
        }
    }

    /// The engine's limits.
    pub fn limits(&self) -> &EngineLimits {
        &self.limits
    }

    /// Queues a request; its events go to `events`.
    pub fn add_request(
        &mut self,
        req: EngineRequest,
        events: UnboundedSender<EngineEvent>,
    ) -> Result<(), RequestRejected> {
        self.limits.check(&req)?;
        if self.scheduler.requests.contains_key(&req.id) {
            return Err(RequestRejected::DuplicateId(req.id));
        }
        let blocks = self.scheduler.pool.empty_allocation();
        self.scheduler.add(Request::new(req, blocks, events));
        Ok(())
    }

    /// Ends a request now, freeing its blocks. Returns false if it was not live.
    pub fn abort(&mut self, id: &RequestId) -> bool {
        match self.scheduler.remove(id) {
            Some(req) => {
                let _ = req.events.send(EngineEvent::Tokens {
                    token_ids: Vec::new(),
                    finish: Some(FinishReason::Abort),
                });
                true
            }
            None => false,
        }
    }

    /// Whether any request is waiting or running.
    pub fn has_work(&self) -> bool {
        self.scheduler.has_work()
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

    /// Runs one step: schedule, forward, sample, emit.
    pub fn step(&mut self) -> StepReport {
        let plan = self.scheduler.schedule();
        if plan.chunks.is_empty() {
            return StepReport::default();
        }
        let logits = self.execute(&plan);
        self.update(&plan, &logits)
    }

    fn execute(&mut self, plan: &SchedulerOutput) -> Vec<f32> {
        let mut token_ids = Vec::with_capacity(plan.num_tokens());
        let mut seqs = Vec::with_capacity(plan.chunks.len());
        for c in &plan.chunks {
            seqs.push(SeqBatch {
                token_start: token_ids.len(),
                num_tokens: c.token_ids.len(),
                first_pos: c.first_pos,
                block_table: &c.block_table,
                want_logits: c.sample,
            });
            token_ids.extend_from_slice(&c.token_ids);
        }
        self.model.forward(&token_ids, &seqs, &mut self.kv)
    }

    fn update(&mut self, plan: &SchedulerOutput, logits: &[f32]) -> StepReport {
        let vocab = self.limits.vocab_size;
        let mut report = StepReport {
            num_tokens: plan.num_tokens(),
            num_seqs: plan.chunks.len(),
            num_finished: 0,
        };
        let mut row = 0;
        let mut finished = Vec::new();
        for c in &plan.chunks {
            let Some(req) = self.scheduler.requests.get_mut(&c.id) else {
                continue;
            };
            req.num_computed += c.token_ids.len();
            if !c.sample {
                continue;
            }
            let mut l = logits[row * vocab..(row + 1) * vocab].to_vec();
            row += 1;
            let banned: Vec<u32> = if req.num_output_tokens() < req.params.min_tokens {
                let eos = if req.params.ignore_eos {
                    &[][..]
                } else {
                    &self.eos_token_ids[..]
                };
                eos.iter()
                    .chain(&req.params.stop_token_ids)
                    .copied()
                    .collect()
            } else {
                Vec::new()
            };
            let token = sample(&mut l, &req.params, &banned, &mut req.rng);
            req.tokens.push(token);
            let finish = if !req.params.ignore_eos && self.eos_token_ids.contains(&token)
                || req.params.stop_token_ids.contains(&token)
            {
                Some(FinishReason::Stop)
            } else if req.num_output_tokens() >= req.params.max_tokens
                || req.tokens.len() >= self.limits.max_model_len
            {
                Some(FinishReason::Length)
            } else {
                None
            };
            let delivered = req
                .events
                .send(EngineEvent::Tokens {
                    token_ids: vec![token],
                    finish,
                })
                .is_ok();
            if finish.is_some() || !delivered {
                // A closed receiver means the caller is gone: stop spending compute on it.
                finished.push(c.id.clone());
            }
        }
        for id in finished {
            if let Some(req) = self.scheduler.remove(&id) {
                debug_assert!(matches!(req.status, RequestStatus::Running));
                report.num_finished += 1;
            }
        }
        report
    }
}
