//! The KV block pool: which blocks are free, and who holds the rest.
//!
//! Blocks are handed out as a [`BlockAllocation`], a value that owns its blocks and returns
//! them to the pool when dropped. A request that finishes, is aborted or is preempted simply
//! drops (or replaces) its allocation, so a leak needs a leaked value, not a forgotten call.
//! Tests check the free count returns to its starting value after every run.
//!
//! Block tables are append-only while a request runs: a sequence only grows, so blocks are
//! only added at the end, and a block's position in the table is its position range in the
//! sequence.
//!
//! Prefix caching: a full block whose KV is computed may be registered under its
//! [`BlockHash`] (a hash chained over every token up to the block's end). Freed, it stays
//! free but keeps its KV and its key until it is handed out fresh (the least recently freed
//! first, and a request's tail blocks before its head), so a later prompt with the same
//! leading tokens takes it back instead of recomputing it. A full block is never written
//! again, so several requests may hold one at once (a count per block); the pool frees it
//! when the last lets go.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use tandem_core::BlockId;

/// A full KV block's key: its tokens and every token before them (and the salt the chain
/// starts from), so equal keys mean equal KV.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockHash(pub u128);

impl BlockHash {
    /// The keys of the full blocks of `tokens`, `block_size` tokens each, chained from `salt`
    /// (say, the model's fingerprint), after `done`: the keys already made for its leading
    /// blocks. Extends `done` to every full block.
    pub fn extend_chain(salt: u128, done: &mut Vec<BlockHash>, tokens: &[u32], block_size: usize) {
        let mut bytes = Vec::with_capacity(16 + 4 * block_size);
        for block in tokens.chunks_exact(block_size).skip(done.len()) {
            let parent = done.last().map_or(salt, |h| h.0);
            bytes.clear();
            bytes.extend_from_slice(&parent.to_le_bytes());
            block.iter().for_each(|t| bytes.extend_from_slice(&t.to_le_bytes()));
            done.push(BlockHash(xxhash_rust::xxh3::xxh3_128(&bytes)));
        }
    }
}

#[derive(Debug)]
struct PoolInner {
    /// Free blocks, oldest-freed first, with the generation they were freed in; an entry whose
    /// block was taken back from the cache since is stale and skipped. FIFO keeps recently
    /// freed blocks (and their cached KV) out of immediate reuse, which also makes
    /// use-after-free bugs show up instead of hiding.
    free: VecDeque<(BlockId, u64)>,
    num_free: usize,
    /// Per block: holders (0 = free), the generation of its latest free-list entry, and its
    /// key while its KV is registered.
    holders: Vec<u32>,
    freed_in: Vec<u64>,
    key: Vec<Option<BlockHash>>,
    cached: HashMap<BlockHash, BlockId>,
    generation: u64,
    stats: PrefixCacheStats,
}

/// Prefix-cache counters since the pool was made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Prompt tokens looked up (whole blocks).
    pub queried_tokens: u64,
    /// Of those, tokens whose KV was found.
    pub hit_tokens: u64,
    /// Cached blocks handed out fresh (their KV dropped).
    pub evicted_blocks: u64,
}

impl PoolInner {
    fn take_fresh(&mut self) -> Option<BlockId> {
        while let Some((b, generation)) = self.free.pop_front() {
            let i = b.0 as usize;
            if self.holders[i] != 0 || self.freed_in[i] != generation {
                continue; // taken back from the cache since it was freed
            }
            if let Some(key) = self.key[i].take() {
                self.cached.remove(&key);
                self.stats.evicted_blocks += 1;
            }
            self.holders[i] = 1;
            self.num_free -= 1;
            return Some(b);
        }
        None
    }

    fn let_go(&mut self, b: BlockId) {
        let i = b.0 as usize;
        self.holders[i] -= 1;
        if self.holders[i] == 0 {
            self.generation += 1;
            self.freed_in[i] = self.generation;
            self.free.push_back((b, self.generation));
            self.num_free += 1;
        }
    }
}

/// A fixed set of `num_blocks` KV blocks. Cheap to clone (shared).
#[derive(Clone, Debug)]
pub struct BlockPool {
    inner: Arc<Mutex<PoolInner>>,
}

/// Not enough free blocks for an allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("needed {needed} free KV blocks, {free} free")]
pub struct NoFreeBlocks {
    /// Blocks asked for.
    pub needed: usize,
    /// Blocks free at the time.
    pub free: usize,
}

impl BlockPool {
    /// A pool of blocks `0..num_blocks`, all free.
    pub fn new(num_blocks: usize) -> Self {
        let free = (0..num_blocks as u32).map(|b| (BlockId(b), 0)).collect();
        Self {
            inner: Arc::new(Mutex::new(PoolInner {
                free,
                num_free: num_blocks,
                holders: vec![0; num_blocks],
                freed_in: vec![0; num_blocks],
                key: vec![None; num_blocks],
                cached: HashMap::new(),
                generation: 0,
                stats: PrefixCacheStats::default(),
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, PoolInner> {
        // Each operation leaves the state whole before it can panic (the counts are checked
        // before they change), so a poisoned lock is safe to keep using.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Blocks free now (cached ones included: they are handed out when nothing else is).
    pub fn num_free(&self) -> usize {
        self.lock().num_free
    }

    /// Blocks in the pool.
    pub fn num_total(&self) -> usize {
        self.lock().holders.len()
    }

    /// Blocks whose KV is registered under a key now (held or free).
    pub fn num_cached(&self) -> usize {
        self.lock().cached.len()
    }

    /// How many of `keys`, from the first, have their KV cached now (taking nothing).
    pub fn count_cached_prefix(&self, keys: &[BlockHash]) -> usize {
        let inner = self.lock();
        keys.iter().take_while(|k| inner.cached.contains_key(k)).count()
    }

    /// Prefix-cache counters.
    pub fn stats(&self) -> PrefixCacheStats {
        self.lock().stats
    }

    /// An allocation holding no blocks yet.
    pub fn empty_allocation(&self) -> BlockAllocation {
        BlockAllocation { blocks: Vec::new(), pool: self.clone() }
    }
}

/// Blocks owned by one holder, in sequence order. Dropping it frees them.
#[derive(Debug)]
pub struct BlockAllocation {
    blocks: Vec<BlockId>,
    pool: BlockPool,
}

impl BlockAllocation {
    /// Appends `n` blocks, all or nothing. Blocks come fresh: whatever KV they cached is
    /// dropped.
    pub fn grow(&mut self, n: usize) -> Result<(), NoFreeBlocks> {
        let mut inner = self.pool.lock();
        if inner.num_free < n {
            return Err(NoFreeBlocks { needed: n, free: inner.num_free });
        }
        // `num_free` counts the live free-list entries, so each take finds one.
        let start = self.blocks.len();
        self.blocks.extend((0..n).map_while(|_| inner.take_fresh()));
        // In ascending order: a request's blocks, freed tail first, come back as the runs of
        // consecutive blocks they were rather than descending one by one, so the KV they will
        // hold moves in a few large copies (a transfer's regions), not one copy a block.
        self.blocks[start..].sort_unstable();
        Ok(())
    }

    /// Grows to at least `n` blocks.
    pub fn grow_to(&mut self, n: usize) -> Result<(), NoFreeBlocks> {
        self.grow(n.saturating_sub(self.blocks.len()))
    }

    /// Takes, for an empty allocation, the cached blocks of the longest prefix of `keys` whose
    /// KV is registered, cut to a multiple of `multiple` blocks; returns how many (counted as
    /// `tokens_per_block` tokens each in the pool's stats, against all of `keys`).
    pub fn take_cached_prefix(&mut self, keys: &[BlockHash], tokens_per_block: usize, multiple: usize) -> usize {
        debug_assert!(self.blocks.is_empty(), "a prefix is taken before any block");
        let mut inner = self.pool.lock();
        let found = keys.iter().take_while(|k| inner.cached.contains_key(k)).count();
        for key in &keys[..found / multiple.max(1) * multiple.max(1)] {
            let Some(&b) = inner.cached.get(key) else { break };
            let i = b.0 as usize;
            if inner.holders[i] == 0 {
                inner.num_free -= 1; // its free-list entry is now stale
            }
            inner.holders[i] += 1;
            self.blocks.push(b);
        }
        inner.stats.queried_tokens += (keys.len() * tokens_per_block) as u64;
        inner.stats.hit_tokens += (self.blocks.len() * tokens_per_block) as u64;
        self.blocks.len()
    }

    /// Registers the KV of block `index` (full and computed) under `key`, unless another
    /// block already holds that key (two requests computed the same prefix at once: the
    /// first stays) or this one is registered already.
    pub fn register(&self, index: usize, key: BlockHash) {
        let Some(&b) = self.blocks.get(index) else { return };
        let mut inner = self.pool.lock();
        let i = b.0 as usize;
        if inner.key[i].is_none() && !inner.cached.contains_key(&key) {
            inner.key[i] = Some(key);
            inner.cached.insert(key, b);
        }
    }

    /// Drops block `index`'s registration, if it has one: its KV is no longer what its key says
    /// (written again, or never landed).
    pub fn unregister_from(&self, index: usize) {
        let mut inner = self.pool.lock();
        for &b in self.blocks.iter().skip(index) {
            if let Some(key) = inner.key[b.0 as usize].take() {
                inner.cached.remove(&key);
            }
        }
    }

    /// The blocks, in sequence order.
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// Number of blocks held.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether no blocks are held.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Block indices as the model's block table wants them.
    pub fn table(&self) -> Vec<u32> {
        self.blocks.iter().map(|b| b.0).collect()
    }

    /// Lets go of every block now; each returns to the pool when no one else holds it. The
    /// tail goes first, so a prompt's last blocks are reused before its first (which more
    /// prompts share).
    pub fn release(&mut self) {
        if !self.blocks.is_empty() {
            let mut inner = self.pool.lock();
            for b in self.blocks.drain(..).rev() {
                inner.let_go(b);
            }
        }
    }
}

impl Drop for BlockAllocation {
    fn drop(&mut self) {
        self.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A prompt's blocks after other requests came and went are still runs of consecutive
    /// blocks (they were one block each, descending, before fresh blocks were sorted).
    #[test]
    fn fresh_blocks_come_as_ascending_runs_after_frees() {
        let pool = BlockPool::new(64);
        for _ in 0..3 {
            let mut a = pool.empty_allocation();
            a.grow(20).unwrap();
            let mut b = pool.empty_allocation();
            b.grow(30).unwrap();
            drop(a);
            drop(b);
        }
        let mut c = pool.empty_allocation();
        c.grow(40).unwrap();
        let runs = tandem_compute::coalesce(&c.table()).len();
        assert!(runs <= 3, "40 blocks in {runs} runs: {:?}", c.table());
    }

    #[test]
    fn allocations_return_blocks_on_drop_and_are_all_or_nothing() {
        let pool = BlockPool::new(10);
        let mut a = pool.empty_allocation();
        a.grow(4).unwrap();
        let mut b = pool.empty_allocation();
        assert_eq!(b.grow(7), Err(NoFreeBlocks { needed: 7, free: 6 }));
        assert_eq!(pool.num_free(), 6, "a failed grow takes nothing");
        b.grow_to(6).unwrap();
        assert_eq!(pool.num_free(), 0);
        let ids: std::collections::HashSet<_> = a.blocks().iter().chain(b.blocks()).collect();
        assert_eq!(ids.len(), 10, "no block handed out twice");
        drop(a);
        assert_eq!(pool.num_free(), 4);
        b.release();
        assert!(b.is_empty());
        drop(b);
        assert_eq!(pool.num_free(), 10);
    }

    /// Registered blocks stay cached while free, are shared by the prefixes that take them
    /// back, are never handed out fresh while held, and lose their KV (evicted) only when a
    /// fresh block is needed and nothing uncached is free.
    #[test]
    fn cached_blocks_are_shared_taken_back_and_evicted_only_when_needed() {
        let keys: Vec<BlockHash> = (0..3).map(|i| BlockHash(100 + i)).collect();
        let pool = BlockPool::new(8);
        let mut a = pool.empty_allocation();
        a.grow(3).unwrap();
        a.register(0, keys[0]);
        a.register(1, keys[1]);
        a.register(1, keys[2]); // already registered: keeps its key
        let cached: Vec<BlockId> = a.blocks()[..2].to_vec();
        drop(a);
        assert_eq!((pool.num_free(), pool.num_cached()), (8, 2), "free, and still cached");

        let mut b = pool.empty_allocation();
        assert_eq!(b.take_cached_prefix(&keys, 4, 1), 2, "the chain stops at the first unknown key");
        assert_eq!(b.blocks(), cached);
        let mut c = pool.empty_allocation();
        assert_eq!(c.take_cached_prefix(&keys[..1], 4, 1), 1);
        assert_eq!(c.blocks()[0], cached[0], "shared");
        assert_eq!(pool.num_free(), 6, "a shared block counts once");
        let stats = pool.stats();
        assert_eq!((stats.queried_tokens, stats.hit_tokens), (16, 12));

        let mut d = pool.empty_allocation();
        d.grow(6).unwrap();
        assert!(d.blocks().iter().all(|blk| !cached.contains(blk)), "a held block is never handed out");
        assert_eq!(d.grow(1), Err(NoFreeBlocks { needed: 1, free: 0 }));
        assert_eq!(pool.stats().evicted_blocks, 0);
        drop(b);
        assert_eq!(pool.num_free(), 1, "block 0 is still c's");
        drop(c);
        d.grow(2).unwrap();
        assert_eq!((pool.num_cached(), pool.stats().evicted_blocks), (0, 2), "taken fresh, their KV dropped");
        let mut e = pool.empty_allocation();
        assert_eq!(e.take_cached_prefix(&keys, 4, 1), 0);
        drop(d);
        assert_eq!(pool.num_free(), 8);
    }
}
