//! The KV block pool: which blocks are free, and who holds the rest.
//!
//! Blocks are handed out as a [`BlockAllocation`], a value that owns its blocks and returns
//! them to the pool when dropped. A request that finishes, is aborted or is preempted simply
//! drops (or replaces) its allocation, so a leak needs a leaked value, not a forgotten call.
//! Tests check the free count returns to its starting value after every run.
//!
//! Block tables are append-only while a request runs: a sequence only grows, so blocks are
//! only added at the end, and a block's position in the table is its position range in the
//! sequence. That changes only when a prefix cache shares blocks between requests.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};

use tandem_core::BlockId;

#[derive(Debug)]
struct PoolInner {
    /// Free blocks, oldest-freed first (FIFO keeps recently freed blocks out of immediate
    /// reuse, which makes use-after-free bugs show up instead of hiding).
    free: VecDeque<BlockId>,
    total: usize,
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
        let free = (0..num_blocks as u32).map(BlockId).collect();
        Self { inner: Arc::new(Mutex::new(PoolInner { free, total: num_blocks })) }
    }

    fn lock(&self) -> MutexGuard<'_, PoolInner> {
        // The pool's state is a free list: a panic elsewhere while holding the lock cannot leave
        // it half-updated (each operation is a single push or pop), so a poisoned lock is safe
        // to keep using.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Blocks free now.
    pub fn num_free(&self) -> usize {
        self.lock().free.len()
    }

    /// Blocks in the pool.
    pub fn num_total(&self) -> usize {
        self.lock().total
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
    /// Appends `n` blocks, all or nothing.
    pub fn grow(&mut self, n: usize) -> Result<(), NoFreeBlocks> {
        let mut inner = self.pool.lock();
        if inner.free.len() < n {
            return Err(NoFreeBlocks { needed: n, free: inner.free.len() });
        }
        self.blocks.extend(inner.free.drain(..n));
        Ok(())
    }

    /// Grows to at least `n` blocks.
    pub fn grow_to(&mut self, n: usize) -> Result<(), NoFreeBlocks> {
        self.grow(n.saturating_sub(self.blocks.len()))
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

    /// Returns every block to the pool now.
    pub fn release(&mut self) {
        if !self.blocks.is_empty() {
            let mut inner = self.pool.lock();
            inner.free.extend(self.blocks.drain(..));
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
}
