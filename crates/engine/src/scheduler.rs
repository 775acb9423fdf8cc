//! The scheduler: which requests run in the next step, and how many tokens each.
//!
//! There is no separate prefill or decode phase. Each request has tokens it knows (prompt plus
//! generated) and tokens whose keys and values are computed; each step gives every request
//! tokens so its computed count catches up with its known count, within a token budget
//! (`max_num_batched_tokens`). A new prompt is therefore prefilled in chunks across steps
//! while running requests keep decoding one token per step in the same batches (continuous
//! batching with chunked prefill).
//!
//! Order: running requests first, oldest first, each allocating the blocks its new tokens
//! need. When the pool is empty, the newest running request is preempted: its blocks are
//! freed and it goes back to the front of the waiting queue to recompute later (its tokens,
//! generated ones included, are kept). Then waiting requests are admitted in arrival order
//! while budget, `max_num_seqs` and blocks allow; none are admitted in a step that preempted.
//!
//! A push prefill engine also keeps room for the prompts decode has registered blocks for
//! ([`PushAdmission`]): a prompt not yet registered is passed over (it keeps its place) while
//! admitting it would leave less than one longest prompt's blocks outside unregistered work.
//! Otherwise the pool can fill with KV produced for requests decode has no blocks to register
//! yet, while decode's blocks wait in registrations for prompts prefill has no blocks to run:
//! each waiting for the other until the transfer timeout.
//!
//! The scheduler owns every live request. What it hands the model runner is a
//! [`SchedulerOutput`]: plain data, copied, so the runner needs no access to requests.

use std::collections::{HashMap, VecDeque};

use tandem_core::{RemoteKv, RequestId, TransferId};

use crate::block_pool::BlockPool;
use crate::request::{PrefixKeys, Request, RequestStatus};

/// One request's share of a step.
#[derive(Clone, Debug)]
pub struct ScheduledChunk {
    /// Whose tokens.
    pub id: RequestId,
    /// Position of the first token (= the request's computed count before this step).
    pub first_pos: usize,
    /// The tokens to compute, `tokens[first_pos..first_pos + len]`.
    pub token_ids: Vec<u32>,
    /// The request's blocks; covers every position up to `first_pos + token_ids.len()`.
    pub block_table: Vec<u32>,
    /// This chunk reaches the end of the known tokens, so a new token is sampled after it.
    pub sample: bool,
}

/// Everything the model runner needs for one step.
#[derive(Clone, Debug, Default)]
pub struct SchedulerOutput {
    /// Chunks in batch order.
    pub chunks: Vec<ScheduledChunk>,
    /// Requests preempted while scheduling this step.
    pub preempted: Vec<RequestId>,
}

impl SchedulerOutput {
    /// Tokens in the step.
    pub fn num_tokens(&self) -> usize {
        self.chunks.iter().map(|c| c.token_ids.len()).sum()
    }
}

/// What a push prefill engine's admission needs to know of its KV connector (see the module
/// docs).
pub(crate) struct PushAdmission<'a> {
    /// Blocks of prompts decode has not registered for yet: produced KV the connector holds,
    /// plus the whole prompts of running requests.
    pub unregistered_blocks: usize,
    /// Most blocks unregistered work may take (the pool less one longest prompt's blocks).
    pub limit: usize,
    /// Whether decode has registered blocks for a transfer.
    pub registered: &'a dyn Fn(&TransferId) -> bool,
}

impl PushAdmission<'_> {
    /// Whether `req` may be admitted now; counts it if it is admitted unregistered.
    fn admit(&mut self, req: &Request, blocks_for: impl Fn(usize) -> usize) -> bool {
        let Some(RemoteKv::Produce { transfer_id }) = &req.remote else { return true };
        if (self.registered)(transfer_id) {
            return true;
        }
        let whole = blocks_for(req.tokens.len());
        if self.unregistered_blocks + whole > self.limit {
            return false;
        }
        self.unregistered_blocks += whole;
        true
    }
}

/// Owns the live requests and decides each step's batch.
pub(crate) struct Scheduler {
    pub requests: HashMap<RequestId, Request>,
    pub waiting: VecDeque<RequestId>,
    pub running: Vec<RequestId>,
    /// Decode legs not yet given blocks (admitted in order as blocks free up).
    pub remote_queue: VecDeque<RequestId>,
    /// Decode legs whose blocks the connector is filling.
    pub remote_waiting: Vec<RequestId>,
    pub pool: BlockPool,
    block_size: usize,
    max_num_seqs: usize,
    max_num_batched_tokens: usize,
    pub num_preemptions: u64,
    /// Prefix caching, when on: how block keys are made.
    pub prefix_keys: Option<PrefixKeys>,
}

impl Scheduler {
    pub fn new(pool: BlockPool, block_size: usize, max_num_seqs: usize, max_num_batched_tokens: usize) -> Self {
        Self {
            requests: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            remote_queue: VecDeque::new(),
            remote_waiting: Vec::new(),
            pool,
            block_size,
            max_num_seqs,
            max_num_batched_tokens,
            num_preemptions: 0,
            prefix_keys: None,
        }
    }

    pub fn add(&mut self, req: Request) {
        self.waiting.push_back(req.id.clone());
        self.requests.insert(req.id.clone(), req);
    }

    /// Queues a decode leg whose KV comes from a prefill engine.
    pub fn add_remote(&mut self, req: Request) {
        self.remote_queue.push_back(req.id.clone());
        self.requests.insert(req.id.clone(), req);
    }

    /// Removes a request wherever it is; its blocks return to the pool.
    pub fn remove(&mut self, id: &RequestId) -> Option<Request> {
        let req = self.requests.remove(id)?;
        match req.status {
            RequestStatus::Waiting => {
                self.waiting.retain(|w| w != id);
                self.remote_queue.retain(|w| w != id);
            }
            RequestStatus::Running => self.running.retain(|r| r != id),
            RequestStatus::WaitingForRemoteKvs => self.remote_waiting.retain(|r| r != id),
        }
        Some(req)
    }

    /// Starts the next queued decode leg's KV load, if it may start now: gives it the blocks
    /// for its prompt and marks it waiting for them to be filled. Returns its id and how many
    /// leading prompt tokens' KV its blocks hold already (the caller asks the connector for the
    /// rest), or `None` while the queue's head must wait.
    ///
    /// With prefix caching, a leg takes the cached blocks of its prompt's longest cached prefix,
    /// cut to a whole number of `alignment(source)` tokens (runs that are whole blocks on both
    /// engines, so no transferred block is one of them: they may be shared) and short of the
    /// prompt's last token; no alignment (not connected to that prefill engine yet), nothing.
    ///
    /// A leg loading KV runs as soon as the KV lands, so it takes one of the `max_num_seqs`
    /// places now. And the blocks left free must cover what every running or loading request,
    /// this one included, will still need for its output ([`Self::growth_blocks`]): KV that has
    /// not arrived yet never pushes a decoding request into preemption (on a decode engine, a
    /// recompute of its whole prompt, which then waits behind those loads for blocks). Under a
    /// prefill backlog, push registrations hold blocks for seconds; with only one block kept
    /// per running request, 16k-token prompts at 2 req/s stalled decoding requests for up to
    /// 24 s on an H200 (`run.sh sweep`, push), while pull, whose loads start when the KV is
    /// ready, did not.
    pub fn start_next_remote_load(
        &mut self,
        alignment: &dyn Fn(&RemoteKv) -> Option<usize>,
    ) -> Option<(RequestId, usize)> {
        loop {
            let id = self.remote_queue.front()?.clone();
            let Some(req) = self.requests.get_mut(&id) else {
                self.remote_queue.pop_front();
                continue;
            };
            if self.running.len() + self.remote_waiting.len() >= self.max_num_seqs {
                return None;
            }
            let run = req.remote.as_ref().and_then(alignment);
            let cached = match (self.prefix_keys, run) {
                (Some(keys), Some(run)) if req.blocks.is_empty() => take_cached_prompt_prefix(req, keys, run),
                _ => 0,
            };
            let prompt_blocks = req.prompt_len.div_ceil(self.block_size);
            let need = prompt_blocks.saturating_sub(req.blocks.len());
            // Alone, a leg starts whenever its prompt fits: a pool smaller than a prompt and its
            // output's reserve must not hold it back forever.
            let alone = self.running.is_empty() && self.remote_waiting.is_empty();
            let reserve = if alone {
                0
            } else {
                let own = growth_end(req).div_ceil(self.block_size).saturating_sub(prompt_blocks);
                own + self.running.iter().chain(&self.remote_waiting).map(|r| self.growth_blocks(r)).sum::<usize>()
            };
            let req = self.requests.get_mut(&id)?;
            if self.pool.num_free() < need + reserve || req.blocks.grow(need).is_err() {
                req.blocks.release(); // the cached blocks too, until it can start
                return None; // wait for blocks to free up
            }
            self.remote_queue.pop_front();
            req.status = RequestStatus::WaitingForRemoteKvs;
            req.kv_requested = Some(std::time::Instant::now());
            self.remote_waiting.push(id.clone());
            return Some((id, cached));
        }
    }

    /// Tokens per KV block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn has_work(&self) -> bool {
        !self.requests.is_empty()
    }

    /// Whether a step could compute anything (requests waiting only for remote KV can't).
    pub fn has_runnable(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Blocks a request will still need for output it has not produced, up to its
    /// `max_tokens` and at most [`GROWTH_HORIZON_TOKENS`] ahead.
    fn growth_blocks(&self, id: &RequestId) -> usize {
        self.requests.get(id).map_or(0, |r| self.blocks_for(growth_end(r)).saturating_sub(r.blocks.len()))
    }

    /// Frees the newest running request's blocks and puts it at the front of the queue.
    fn preempt_last(&mut self, out: &mut SchedulerOutput) -> Option<RequestId> {
        let id = self.running.pop()?;
        if let Some(req) = self.requests.get_mut(&id) {
            req.blocks.release();
            req.num_computed = 0;
            req.num_registered = 0;
            req.status = RequestStatus::Waiting;
            req.num_preemptions += 1;
        }
        self.waiting.push_front(id.clone());
        self.num_preemptions += 1;
        tracing::debug!(request_id = %id, "preempted (recompute)");
        out.preempted.push(id.clone());
        Some(id)
    }

    /// Plans the next step (see the module docs for the algorithm).
    #[cfg(test)]
    pub fn schedule(&mut self) -> SchedulerOutput {
        self.schedule_with(None)
    }

    /// Plans the next step, a push prefill engine's admissions gated by `push`.
    pub fn schedule_with(&mut self, mut push: Option<PushAdmission<'_>>) -> SchedulerOutput {
        let mut out = SchedulerOutput::default();
        let mut budget = self.max_num_batched_tokens;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i].clone();
            let (computed, known, held) = match self.requests.get(&id) {
                Some(r) => (r.num_computed, r.tokens.len(), r.blocks.len()),
                None => {
                    self.running.remove(i);
                    continue;
                }
            };
            let n = (known - computed).min(budget);
            if n == 0 {
                // Pipelined: its last token is being sampled and ends it; nothing to run.
                i += 1;
                continue;
            }
            let need = self.blocks_for(computed + n).saturating_sub(held);
            let mut scheduled = true;
            while self.pool.num_free() < need {
                match self.preempt_last(&mut out) {
                    Some(victim) if victim == id => {
                        scheduled = false;
                        break;
                    }
                    Some(_) => {}
                    None => {
                        scheduled = false;
                        break;
                    }
                }
            }
            if !scheduled {
                break;
            }
            if let Some(req) = self.requests.get_mut(&id) {
                if req.blocks.grow(need).is_err() {
                    break;
                }
                out.chunks.push(chunk(req, n));
                budget -= n;
            }
            i += 1;
        }
        if out.preempted.is_empty() {
            let block_size = self.block_size;
            let mut next = 0;
            while budget > 0 && self.running.len() < self.max_num_seqs {
                let Some(id) = self.waiting.get(next).cloned() else {
                    break;
                };
                let Some(req) = self.requests.get_mut(&id) else {
                    self.waiting.remove(next);
                    continue;
                };
                if let Some(push) = push.as_mut() {
                    if !push.admit(req, |tokens| tokens.div_ceil(block_size)) {
                        next += 1;
                        continue;
                    }
                }
                let hit = match self.prefix_keys {
                    Some(keys) if req.blocks.is_empty() && req.num_computed == 0 => take_cached_prefix(req, keys),
                    _ => 0,
                };
                let n = (req.tokens.len() - req.num_computed).min(budget);
                let need = (req.num_computed + n).div_ceil(block_size).saturating_sub(req.blocks.len());
                if req.blocks.grow(need).is_err() {
                    if hit > 0 {
                        // It waits; the cached blocks go back (still cached) until it runs.
                        req.blocks.release();
                        (req.num_computed, req.num_registered) = (0, 0);
                    }
                    break;
                }
                req.status = RequestStatus::Running;
                out.chunks.push(chunk(req, n));
                budget -= n;
                self.waiting.remove(next);
                self.running.push(id);
            }
        }
        out
    }
}

/// How far ahead [`Scheduler::start_next_remote_load`] keeps blocks for a request's output.
/// A request whose `max_tokens` is left to the server's default may run to the model's length;
/// reserving all of that for each one would hold most of a decode engine's pool back. Past
/// this many tokens a preemption is possible again, and only if loads still wait by then.
pub(crate) const GROWTH_HORIZON_TOKENS: usize = 512;

/// The token count a request's blocks must cover before it could need more than now:
/// its known tokens plus its remaining output, at most [`GROWTH_HORIZON_TOKENS`] of it.
fn growth_end(req: &Request) -> usize {
    let last = req.prompt_len + req.params.max_tokens;
    last.min(req.tokens.len() + GROWTH_HORIZON_TOKENS).max(req.tokens.len())
}

/// Gives a request about to run from scratch the cached KV of its prompt's longest cached
/// prefix of whole blocks, leaving at least its last token to compute (its logits sample the
/// next token); returns the blocks taken.
fn take_cached_prefix(req: &mut Request, keys: PrefixKeys) -> usize {
    req.extend_block_keys(keys);
    let most = (req.tokens.len().saturating_sub(1) / keys.block_size).min(req.block_keys.len());
    let hit = req.blocks.take_cached_prefix(&req.block_keys[..most], keys.block_size, 1);
    req.num_computed = hit * keys.block_size;
    req.num_registered = hit;
    hit
}

/// Gives a decode leg the cached KV of its prompt's longest cached prefix that is a whole
/// number of `run` tokens and leaves the last token to the transfer; returns its tokens.
fn take_cached_prompt_prefix(req: &mut Request, keys: PrefixKeys, run: usize) -> usize {
    req.extend_block_keys(keys);
    let most = (req.prompt_len.saturating_sub(1) / run * run / keys.block_size).min(req.block_keys.len());
    // `run` is a whole number of our blocks (the agent's shared run of both block sizes).
    let hit = req.blocks.take_cached_prefix(&req.block_keys[..most], keys.block_size, run / keys.block_size);
    req.num_registered = hit;
    hit * keys.block_size
}

fn chunk(req: &Request, n: usize) -> ScheduledChunk {
    let first = req.num_computed;
    ScheduledChunk {
        id: req.id.clone(),
        first_pos: first,
        token_ids: req.tokens[first..first + n].to_vec(),
        block_table: req.blocks.table(),
        sample: first + n == req.tokens.len(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::EngineRequest;

    fn request(pool: &BlockPool, id: &str, prompt_len: usize) -> Request {
        let (events, _) = tokio::sync::mpsc::unbounded_channel();
        let req = EngineRequest::new(RequestId::new(id), vec![1; prompt_len], Default::default());
        Request::new(req, pool.empty_allocation(), events)
    }

    fn prefill_leg(pool: &BlockPool, id: &str, prompt_len: usize) -> Request {
        let (events, _) = tokio::sync::mpsc::unbounded_channel();
        let mut req = EngineRequest::new(RequestId::new(id), vec![1; prompt_len], Default::default());
        req.remote = Some(RemoteKv::Produce { transfer_id: TransferId(format!("t-{id}")) });
        Request::new(req, pool.empty_allocation(), events)
    }

    /// A push prefill engine passes over prompts decode has not registered while admitting
    /// them would leave less than the limit for registered work; a registered prompt behind
    /// them goes first, and the passed-over ones keep their places.
    #[test]
    fn push_admission_keeps_room_for_registered_prompts() {
        // 20 blocks of 4 tokens; unregistered work may take 8 of them (say, 12 are one
        // longest prompt).
        let pool = BlockPool::new(20);
        let mut s = Scheduler::new(pool.clone(), 4, 8, 1000);
        for (id, len) in [("u1", 16), ("u2", 16), ("r", 40), ("u3", 4)] {
            s.add(prefill_leg(&pool, id, len));
        }
        let registered = |t: &TransferId| t.0 == "t-r";
        // 3 blocks of produced KV wait for registrations already: u1 (4 blocks) fits under 8,
        // u2 would make 11 and is passed over, r is registered, u3 (1 block) makes 8.
        let push = PushAdmission { unregistered_blocks: 3, limit: 8, registered: &registered };
        let out = s.schedule_with(Some(push));
        let ids: Vec<&str> = out.chunks.iter().map(|c| c.id.as_str()).collect();
        assert_eq!(ids, ["u1", "r", "u3"]);
        assert_eq!(s.waiting.iter().map(|id| id.as_str()).collect::<Vec<_>>(), ["u2"]);
        // Without the gate (not a push prefill engine), arrival order and blocks alone decide.
        let pool = BlockPool::new(16);
        let mut s = Scheduler::new(pool.clone(), 4, 8, 1000);
        for (id, len) in [("u1", 16), ("u2", 16), ("r", 40)] {
            s.add(prefill_leg(&pool, id, len));
        }
        let out = s.schedule_with(None);
        let ids: Vec<&str> = out.chunks.iter().map(|c| c.id.as_str()).collect();
        assert_eq!(ids, ["u1", "u2"], "r's 10 blocks do not fit after u1 and u2's 8");
    }

    fn with_max_tokens(mut req: Request, max_tokens: usize) -> Request {
        req.params.max_tokens = max_tokens;
        req
    }

    /// Decode legs start loading KV only while a running place is left for each, and only
    /// while the blocks left cover the output every running and loading request may still
    /// produce; the running requests then generate to the end without a preemption.
    #[test]
    fn kv_loads_leave_running_requests_their_places_and_their_output_blocks() {
        // 14 blocks of 4 tokens, 4 places.
        let pool = BlockPool::new(14);
        let mut s = Scheduler::new(pool.clone(), 4, 4, 64);
        for id in ["a", "b"] {
            s.add(with_max_tokens(request(&pool, id, 8), 8)); // 2 blocks now, 4 at the end
        }
        s.schedule();
        for id in ["a", "b"] {
            s.requests.get_mut(&RequestId::new(id)).unwrap().num_computed = 8;
        }
        assert_eq!((s.running.len(), pool.num_free()), (2, 10));
        s.add_remote(with_max_tokens(request(&pool, "r1", 16), 4)); // 4 blocks, 5 at the end
        s.add_remote(with_max_tokens(request(&pool, "r2", 12), 4)); // 3 blocks, 4 at the end
                                                                    // r1: 4 blocks + 1 of its own output + 2 each for a and b = 9 of 10.
        assert_eq!(s.start_next_remote_load(&|_| None), Some((RequestId::new("r1"), 0)));
        assert_eq!(pool.num_free(), 6);
        // r2 would need 3 + 1 + 5: it waits, though a place and 3 blocks are free (keeping one
        // block per running request, it started here, and a and b were preempted below).
        assert_eq!(s.start_next_remote_load(&|_| None), None);
        // a and b generate their 8 tokens each; r1's KV has not landed.
        for _ in 0..8 {
            for id in ["a", "b"] {
                s.requests.get_mut(&RequestId::new(id)).unwrap().tokens.push(5);
            }
            let out = s.schedule();
            assert!(out.preempted.is_empty(), "a KV load pushed a decoding request out: {:?}", out.preempted);
            assert_eq!(out.chunks.len(), 2);
            for id in ["a", "b"] {
                let r = s.requests.get_mut(&RequestId::new(id)).unwrap();
                r.num_computed = r.tokens.len();
            }
        }
        assert_eq!(pool.num_free(), 2);
        // a ends: its 4 blocks cover r2's 3 and its output's 1, with r1's 1 still kept.
        drop(s.remove(&RequestId::new("a")));
        assert_eq!(s.start_next_remote_load(&|_| None), Some((RequestId::new("r2"), 0)));
        assert_eq!(pool.num_free(), 3);
    }

    /// The output reserve looks at most `GROWTH_HORIZON_TOKENS` ahead: a request left to run to
    /// the model's length does not hold back a whole pool. And a leg with nothing else running
    /// starts whenever its prompt fits, reserve or not.
    #[test]
    fn output_reserve_is_bounded_by_the_horizon() {
        let pool = BlockPool::new(10);
        let mut s = Scheduler::new(pool.clone(), 16, 4, 64);
        s.add_remote(with_max_tokens(request(&pool, "big", 150), 1000)); // 10 blocks, 42 with its output
        assert_eq!(s.start_next_remote_load(&|_| None), Some((RequestId::new("big"), 0)));

        let pool = BlockPool::new(1000);
        let mut s = Scheduler::new(pool.clone(), 16, 4, 64);
        s.add(with_max_tokens(request(&pool, "long", 10), 100_000));
        s.add(with_max_tokens(request(&pool, "short", 10), 30));
        s.schedule();
        assert_eq!(s.growth_blocks(&RequestId::new("long")), (10 + GROWTH_HORIZON_TOKENS).div_ceil(16) - 1);
        assert_eq!(s.growth_blocks(&RequestId::new("short")), 40usize.div_ceil(16) - 1);
    }
}
