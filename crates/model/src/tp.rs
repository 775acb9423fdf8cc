//! Tensor parallelism on the CPU: one engine's model as `N` ranks, each holding its share of
//! every layer ([`Shard`]: attention heads, KV heads, the MLP's inner width) and a KV cache of
//! its own KV heads, running each forward at once on threads of their own and adding their
//! row-parallel products' sums through a shared-memory all-reduce ([`AllReduce`]).
//!
//! The sums go in one fixed order whatever the rank count (the model's reduction groups, summed
//! as a balanced tree: see [`Shard`]), so 2 or 4 ranks give the bits of one.

use std::panic::AssertUnwindSafe;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use tandem_compute::cpu::add_inplace;
use tandem_compute::{KvCache, KvDtype, KvLayout};

use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::transformer::{SeqBatch, Shard, Transformer};
use crate::weights::WeightMap;

/// What a rank that stopped because another failed says.
const OTHER_RANK: &str = "another rank failed";

/// The longest one rank waits at a reduce for the others (a rank stuck longer has failed).
const REDUCE_BOUND: Duration = Duration::from_secs(120);

/// One rank: its part of the model, its KV heads' cache, and the threads its products run on.
struct Rank {
    model: Transformer,
    kv: KvCache,
    pool: rayon::ThreadPool,
}

/// A model split over tensor-parallel ranks, with their KV caches.
pub struct TpModel {
    ranks: Vec<Rank>,
    reduce: AllReduce,
    /// The one KV region the ranks' caches are views of, each of its own heads, where every
    /// KV head belongs to one rank; `None` where heads repeat over ranks (each keeps a copy).
    shared: Option<std::sync::Arc<tandem_compute::KvRegion>>,
    /// Forwards run so far.
    forwards: u64,
    /// Fault injection: (forward, rank, reduce) at which that rank fails once, mid-forward.
    fail_at: Option<(u64, usize, usize)>,
}

impl TpModel {
    /// Splits `weights` (the whole model's) over `size` ranks, each with a KV cache of
    /// `num_blocks` blocks of `block_size` tokens of `kv_dtype` (f32 or FP8 e4m3) for its KV
    /// heads; the machine's cores are shared out among the ranks' threads. Where each KV head
    /// belongs to one rank, the caches are views of one region laid out as a one-rank engine's
    /// ([`TpModel::region`]).
    pub fn load(
        cfg: &ModelConfig,
        weights: WeightMap,
        max_positions: usize,
        size: usize,
        (block_size, num_blocks): (usize, usize),
        kv_dtype: KvDtype,
    ) -> Result<Self, ModelError> {
        Shard::check(size, cfg)?;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mut ranks = Vec::with_capacity(size);
        let whole = KvLayout {
            num_layers: cfg.num_layers,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            block_size,
            num_blocks,
        };
        if kv_dtype == KvDtype::Bf16 {
            return Err(ModelError::UnsupportedConfig("a CPU engine's KV cache is f32 or fp8, not bf16".into()));
        }
        let shared = (cfg.num_kv_heads >= size).then(|| KvCache::of(whole, kv_dtype).region());
        let mut weights = Some(weights);
        for rank in 0..size {
            // The last rank takes the map itself; the others a copy.
            let w = if rank + 1 == size { weights.take() } else { weights.clone() };
            let w = w.ok_or_else(|| ModelError::UnsupportedConfig("no weights".into()))?;
            let model = Transformer::from_weights_shard(cfg.clone(), w, max_positions, Shard { rank, size })?;
            let kv = match &shared {
                Some(region) => {
                    let per = cfg.num_kv_heads / size;
                    KvCache::heads_of(region.clone(), rank * per..(rank + 1) * per)
                }
                None => KvCache::of(model.kv_layout(block_size, num_blocks), kv_dtype),
            };
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads((cores / size).max(1))
                .thread_name(move |i| format!("tp{rank}-{i}"))
                .build()
                .map_err(|e| ModelError::UnsupportedConfig(format!("rank {rank}'s threads: {e}")))?;
            ranks.push(Rank { model, kv, pool });
        }
        Ok(Self { ranks, reduce: AllReduce::new(size), shared, forwards: 0, fail_at: None })
    }

    /// Ranks.
    pub fn size(&self) -> usize {
        self.ranks.len()
    }

    /// The whole model's shape.
    pub fn config(&self) -> &ModelConfig {
        self.ranks[0].model.config()
    }

    /// Rank 0's part: its shape limits and fingerprint are every rank's.
    pub fn rank0(&self) -> &Transformer {
        &self.ranks[0].model
    }

    /// The KV cache's layout: the shared region's (every head), or one rank's own.
    pub fn kv_layout(&self) -> KvLayout {
        self.shared.as_ref().map_or(*self.ranks[0].kv.layout(), |r| *r.layout())
    }

    /// The one KV region every rank's heads are in, laid out as a one-rank engine's cache (what
    /// a KV connector moves); `None` where KV heads repeat over ranks.
    pub fn region(&self) -> Option<std::sync::Arc<tandem_compute::KvRegion>> {
        self.shared.clone()
    }

    /// Fault injection (tests): rank `rank` fails at its `reduce`-th all-reduce of the next
    /// forward, mid-layer, as a rank that dies would; the others must end that forward with an
    /// error rather than wait.
    pub fn fail_rank_once(&mut self, rank: usize, reduce: usize) {
        self.fail_rank_at(self.forwards + 1, rank, reduce);
    }

    /// Fault injection (tests, and `serve`'s hidden `--fault-rank-fails-at-forward`): as
    /// [`TpModel::fail_rank_once`], at the `forward`-th forward from load (counting from 1).
    pub fn fail_rank_at(&mut self, forward: u64, rank: usize, reduce: usize) {
        self.fail_at = Some((forward, rank, reduce));
    }

    /// Runs one batched forward on every rank at once; rank 0's logits (as
    /// [`Transformer::forward`] returns them). A rank that fails ends the others' waits.
    pub fn forward(&mut self, token_ids: &[u32], seqs: &[SeqBatch<'_>]) -> Result<Vec<f32>, ModelError> {
        self.forward_with_kv_marks(token_ids, seqs, &mut |_| {})
    }

    /// [`TpModel::forward`], calling `kv_written(layer)` as each layer's keys and values for
    /// the step's tokens are in every rank's cache.
    pub fn forward_with_kv_marks(
        &mut self,
        token_ids: &[u32],
        seqs: &[SeqBatch<'_>],
        kv_written: &mut (dyn FnMut(usize) + Send),
    ) -> Result<Vec<f32>, ModelError> {
        self.reduce.reset();
        let mut kv_written = Some(kv_written);
        let reduce = &self.reduce;
        self.forwards += 1;
        let fail_at = match self.fail_at {
            Some((forward, rank, call)) if forward == self.forwards => {
                self.fail_at = None;
                Some((rank, call))
            }
            _ => None,
        };
        let results: Vec<Result<Vec<f32>, String>> = std::thread::scope(|scope| {
            let running: Vec<_> = self
                .ranks
                .iter_mut()
                .enumerate()
                .map(|(r, rank)| {
                    let mut marks = if r == 0 { kv_written.take() } else { None };
                    scope.spawn(move || {
                        let Rank { model, kv, pool } = rank;
                        let mut calls = 0;
                        let mut hook = |b: &mut [f32]| {
                            calls += 1;
                            assert!(fail_at != Some((r, calls)), "rank {r} failed (injected)");
                            reduce.reduce(r, b)
                        };
                        // Rank 0 passes a layer's first reduce only once every rank has
                        // written that layer's KV: it tells.
                        let mut written = |layer: usize| {
                            if let Some(mark) = marks.as_mut() {
                                mark(layer)
                            }
                        };
                        let run = || pool.install(|| model.forward_rank(token_ids, seqs, kv, &mut hook, &mut written));
                        std::panic::catch_unwind(AssertUnwindSafe(run)).map_err(|e| {
                            reduce.fail();
                            panic_message(&e)
                        })
                    })
                })
                .collect();
            running.into_iter().map(|h| h.join().map_err(|e| panic_message(&e)).and_then(|r| r)).collect()
        });
        // The rank that failed first says why; the others only stopped for it.
        let failures: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
        if let Some(first) = failures.iter().find(|why| !why.contains(OTHER_RANK)).or(failures.first()) {
            return Err(ModelError::Rank((*first).clone()));
        }
        results.into_iter().next().unwrap_or_else(|| Err("no rank".into())).map_err(ModelError::Rank)
    }
}

/// Sums equal-length `parts` pairwise, a balanced tree (`parts.len()` a power of two), into
/// `parts[0]`: `(p0 + p1) + (p2 + p3)` for four.
fn tree_sum(parts: &mut [Vec<f32>]) {
    let mut step = 1;
    while step < parts.len() {
        for i in (0..parts.len()).step_by(2 * step) {
            let (left, right) = parts.split_at_mut(i + step);
            add_inplace(&mut left[i], &right[0]);
        }
        step *= 2;
    }
}

fn panic_message(e: &Box<dyn std::any::Any + Send>) -> String {
    e.downcast_ref::<String>().cloned().or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default()
}

/// The ranks' sums of one product, added in [`tree_sum`]'s order over the ranks and handed back
/// to each: every rank calls [`AllReduce::reduce`] the same number of times per forward.
struct AllReduce {
    size: usize,
    state: Mutex<ReduceState>,
    turn: Condvar,
}

struct ReduceState {
    /// What each rank brought this round.
    parts: Vec<Vec<f32>>,
    arrived: usize,
    /// Rounds completed: a waiting rank's round is done when this moves on.
    round: u64,
    /// The last round's total.
    total: Vec<f32>,
    /// A rank failed: the others stop waiting.
    failed: bool,
}

impl AllReduce {
    fn new(size: usize) -> Self {
        let state =
            ReduceState { parts: vec![Vec::new(); size], arrived: 0, round: 0, total: Vec::new(), failed: false };
        Self { size, state: Mutex::new(state), turn: Condvar::new() }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ReduceState> {
        // A rank that panicked holding the lock left the state whole: every write is a whole
        // assignment or a sum into buffers rewritten before they are read again.
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Before a forward: no round is half done, and no failure is left over.
    fn reset(&self) {
        let mut s = self.lock();
        (s.arrived, s.failed) = (0, false);
    }

    /// A rank failed: the others' reduces end (they panic, and their forwards with them).
    fn fail(&self) {
        self.lock().failed = true;
        self.turn.notify_all();
    }

    /// Rank `rank`'s sum in `buf` becomes the total of every rank's.
    fn reduce(&self, rank: usize, buf: &mut [f32]) {
        let mut s = self.lock();
        assert!(!s.failed, "{OTHER_RANK}");
        s.parts[rank].clear();
        s.parts[rank].extend_from_slice(buf);
        s.arrived += 1;
        let round = s.round;
        if s.arrived == self.size {
            let ReduceState { parts, total, .. } = &mut *s;
            tree_sum(parts);
            std::mem::swap(total, &mut parts[0]);
            s.arrived = 0;
            s.round += 1;
            self.turn.notify_all();
        } else {
            let deadline = Instant::now() + REDUCE_BOUND;
            while s.round == round && !s.failed {
                let left = deadline.saturating_duration_since(Instant::now());
                assert!(!left.is_zero(), "the other ranks did not reach the reduce within {REDUCE_BOUND:?}");
                s = self.turn.wait_timeout(s, left).unwrap_or_else(std::sync::PoisonError::into_inner).0;
            }
            assert!(!s.failed, "{OTHER_RANK}");
        }
        buf.copy_from_slice(&s.total);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Four ranks' buffers come back as `(r0 + r1) + (r2 + r3)`, each rank's copy the same.
    #[test]
    fn a_reduce_hands_every_rank_the_tree_sum() {
        let reduce = AllReduce::new(4);
        let values = [1.0f32, 1e8, -1e8, 3.0];
        let got: Vec<f32> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|r| {
                    let reduce = &reduce;
                    s.spawn(move || {
                        let mut buf = [values[r], r as f32];
                        reduce.reduce(r, &mut buf);
                        buf
                    })
                })
                .collect();
            handles.into_iter().flat_map(|h| h.join().unwrap()).collect()
        });
        let want = [(values[0] + values[1]) + (values[2] + values[3]), (0.0 + 1.0) + (2.0 + 3.0)];
        assert_ne!(want[0], ((values[0] + values[1]) + values[2]) + values[3], "the test must tell the orders apart");
        for rank in got.chunks(2) {
            assert_eq!(rank, want);
        }
    }

    /// A rank that fails ends the others' wait at once rather than at the bound.
    #[test]
    fn a_failed_rank_ends_the_others_wait() {
        let reduce = AllReduce::new(2);
        let started = Instant::now();
        let waited = std::thread::scope(|s| {
            let waiter = s.spawn(|| std::panic::catch_unwind(AssertUnwindSafe(|| reduce.reduce(0, &mut [1.0]))));
            std::thread::sleep(Duration::from_millis(50));
            reduce.fail();
            waiter.join().unwrap()
        });
        assert!(waited.is_err(), "the waiting rank must give up");
        assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
        reduce.reset();
        assert!(!reduce.lock().failed, "the next forward starts afresh");
    }
}
