//! The paged KV cache storage, block-major, shared between the engine and the KV connector.
//!
//! # Ownership and soundness
//! The memory is one allocation ([`KvRegion`]) that two threads use at once: the engine loop
//! (forward passes write and read the blocks of the requests it schedules) and the KV
//! connector's background thread (transfers read or write the blocks of requests it has been
//! handed). Which blocks each side may touch is decided by block ownership, which the
//! engine's block pool tracks: a block belongs to exactly one request, and a request is either
//! schedulable (engine side) or in transfer (connector side), never both. So the two threads
//! always touch disjoint blocks.
//!
//! To keep that sound in Rust terms, nothing here ever forms a reference to the whole buffer:
//! the engine gets per-plane slices ([`KvCache::plane`]) and per-slot writes, the connector
//! gets slices of the block runs it names ([`KvRegion::blocks`]). The `unsafe` lives in this
//! module only.

use std::borrow::Cow;
use std::ptr::NonNull;
use std::sync::{Arc, LazyLock};

/// Shape of a paged KV cache. Block `b` occupies
/// `[b * block_elems, (b + 1) * block_elems)` and inside it the order is
/// `[layer][k|v][kv_head][slot][head_dim]`.
///
/// Keeping each block contiguous across all layers means consecutive blocks form one
/// contiguous region, so a request's KV moves as a handful of large copies rather than one
/// descriptor per (layer, block, K/V).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// Transformer layers.
    pub num_layers: usize,
    /// Key/value heads (after GQA grouping).
    pub num_kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks in the pool.
    pub num_blocks: usize,
}

impl KvLayout {
    /// Elements of one (layer, k-or-v, kv_head) plane inside a block.
    pub fn head_plane(&self) -> usize {
        self.block_size * self.head_dim
    }

    /// Elements of one block (all layers, K and V).
    pub fn block_elems(&self) -> usize {
        self.num_layers * 2 * self.num_kv_heads * self.head_plane()
    }

    /// Bytes of one block when stored as `f32`.
    pub fn block_bytes_f32(&self) -> usize {
        self.block_elems() * std::mem::size_of::<f32>()
    }

    /// Offset of the first element of `(block, layer, kv, head)`, where `kv` is 0 for keys and
    /// 1 for values. Slots follow at stride `head_dim`.
    #[inline]
    pub fn plane_offset(&self, block: usize, layer: usize, kv: usize, head: usize) -> usize {
        block * self.block_elems() + self.plane_offset_in_block(layer, kv, head)
    }

    /// Offset of `(layer, kv, head)` inside one block.
    #[inline]
    pub fn plane_offset_in_block(&self, layer: usize, kv: usize, head: usize) -> usize {
        ((layer * 2 + kv) * self.num_kv_heads + head) * self.head_plane()
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }
}

/// Element type of a [`KvRegion`]: `f32` for the CPU engine's cache, `bf16` for the host copy
/// of a GPU engine's cache (the GPU keeps bf16, and the copy moves its bytes unchanged), FP8
/// e4m3 for either with `--kv-cache-dtype fp8`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvDtype {
    /// 4-byte floats.
    F32,
    /// bfloat16, 2 bytes.
    Bf16,
    /// FP8 e4m3 (`float8_e4m3fn`), one byte: each key and value element rounded to the nearest
    /// e4m3 number of itself divided by [`KV_FP8_SCALE`] (saturating at 448), as vLLM's `fp8`
    /// KV cache holds them without calibrated scales.
    Fp8E4m3,
}

/// What an FP8 KV cache's bytes are multiplied by to give the keys and values: 1, the scale
/// vLLM's `fp8` KV cache uses where a checkpoint brings none (every engine of a deployment
/// must agree on it, so it is fixed rather than measured).
pub const KV_FP8_SCALE: f32 = 1.0;

/// Every e4m3 byte's value times [`KV_FP8_SCALE`], for reading an FP8 cache.
static FP8_VALUES: LazyLock<[f32; 256]> =
    LazyLock::new(|| std::array::from_fn(|b| crate::fp8::e4m3_to_f32(b as u8) * KV_FP8_SCALE));

impl KvDtype {
    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::Bf16 => 2,
            KvDtype::Fp8E4m3 => 1,
        }
    }

    /// Its name on the KV side channel's handshake.
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::Bf16 => "bf16",
            KvDtype::Fp8E4m3 => "fp8_e4m3",
        }
    }
}

/// Blocks `start..start + len`, contiguous in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockRun {
    /// First block.
    pub start: u32,
    /// Blocks in the run.
    pub len: u32,
}

/// Merges consecutive ids (in the given order) into runs: `[4, 5, 6, 9, 10, 2]` becomes
/// `[4..7, 9..11, 2..3]`.
pub fn coalesce(blocks: &[u32]) -> Vec<BlockRun> {
    let mut runs: Vec<BlockRun> = Vec::new();
    for &b in blocks {
        match runs.last_mut() {
            Some(r) if r.start.checked_add(r.len) == Some(b) => r.len += 1,
            _ => runs.push(BlockRun { start: b, len: 1 }),
        }
    }
    runs
}

/// The KV cache memory (or a GPU cache's host copy): `num_blocks` blocks of `dtype` elements,
/// zero-initialised, shared by reference count between the engine and the KV connector. See
/// the module docs for who may touch what.
pub struct KvRegion {
    layout: KvLayout,
    dtype: KvDtype,
    /// 4-byte words (so every element type is aligned), `words` of them.
    ptr: NonNull<u32>,
    words: usize,
}

// Safety: the region is plain memory; concurrent use is governed by block ownership (module
// docs): each block is accessed by one thread at a time, through slices this module hands out
// for that block only.
unsafe impl Send for KvRegion {}
// Safety: as above; `&KvRegion` only gives out slices through `unsafe fn`s whose callers
// promise exclusive (or read-only) ownership of the blocks named.
unsafe impl Sync for KvRegion {}

impl KvRegion {
    fn new(layout: KvLayout, dtype: KvDtype) -> Self {
        let words = (layout.num_blocks * layout.block_elems() * dtype.bytes()).div_ceil(4);
        // Zeroed by the allocator: a large region's pages are only backed once written.
        let boxed: Box<[u32]> = vec![0u32; words].into_boxed_slice();
        // Box::into_raw never returns null.
        let ptr = NonNull::new(Box::into_raw(boxed) as *mut u32).unwrap_or(NonNull::dangling());
        Self { layout, dtype, ptr, words }
    }

    /// A zeroed region of `dtype` elements in `layout`, for the host copy of a cache that lives
    /// elsewhere (a GPU's), which the KV connector moves.
    pub fn host_copy(layout: KvLayout, dtype: KvDtype) -> Arc<Self> {
        Arc::new(Self::new(layout, dtype))
    }

    /// The whole allocation as (start, bytes), for page-locking it (`CudaDevice::pin_region`).
    /// Valid while the region lives.
    pub(crate) fn raw_bytes(&self) -> (*mut u8, usize) {
        (self.ptr.as_ptr() as *mut u8, self.words * 4)
    }

    /// The region's shape.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// The region's element type.
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Bytes of one block.
    pub fn block_bytes(&self) -> usize {
        self.layout.block_elems() * self.dtype.bytes()
    }

    /// Where the blocks start in this process and how many bytes they take: what a transfer
    /// library (NIXL) registers so a peer can write them. Blocks are at `block_bytes` strides.
    pub fn address_range(&self) -> (usize, usize) {
        (self.ptr.as_ptr() as usize, self.layout.num_blocks * self.block_bytes())
    }

    fn check_run(&self, first: usize, count: usize) -> (usize, usize) {
        let n = self.layout.block_elems();
        assert!(first + count <= self.layout.num_blocks, "block run {first}+{count} outside the cache");
        (first * n, count * n)
    }

    fn f32_ptr(&self) -> *mut f32 {
        assert_eq!(self.dtype, KvDtype::F32, "f32 access to a {} region", self.dtype.name());
        self.ptr.as_ptr() as *mut f32
    }

    /// Blocks `first..first + count` as raw bytes, read-only.
    ///
    /// # Safety
    /// As [`KvRegion::blocks`].
    ///
    /// # Panics
    /// If the run is outside the cache.
    pub unsafe fn bytes(&self, first: usize, count: usize) -> &[u8] {
        let (off, len) = self.check_run(first, count);
        let b = self.dtype.bytes();
        // Safety: in bounds (checked; the allocation holds num_blocks whole blocks); no
        // concurrent writer (caller's obligation).
        unsafe { std::slice::from_raw_parts((self.ptr.as_ptr() as *const u8).add(off * b), len * b) }
    }

    /// Blocks `first..first + count` as raw bytes, writable.
    ///
    /// # Safety
    /// As [`KvRegion::blocks_mut`].
    ///
    /// # Panics
    /// If the run is outside the cache.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn bytes_mut(&self, first: usize, count: usize) -> &mut [u8] {
        let (off, len) = self.check_run(first, count);
        let b = self.dtype.bytes();
        // Safety: in bounds (checked); exclusive (caller's obligation).
        unsafe { std::slice::from_raw_parts_mut((self.ptr.as_ptr() as *mut u8).add(off * b), len * b) }
    }

    /// Blocks `first..first + count` of an `f32` region, read-only.
    ///
    /// # Safety
    /// No other thread may write these blocks while the slice lives (the caller owns them,
    /// or holds them for a transfer the engine will not schedule).
    ///
    /// # Panics
    /// If the run is outside the cache, or the region is not `f32`.
    pub unsafe fn blocks(&self, first: usize, count: usize) -> &[f32] {
        let (off, len) = self.check_run(first, count);
        // Safety: in bounds (checked); no concurrent writer (caller's obligation).
        unsafe { std::slice::from_raw_parts(self.f32_ptr().add(off), len) }
    }

    /// Blocks `first..first + count` of an `f32` region, writable.
    ///
    /// # Safety
    /// No other thread may read or write these blocks while the slice lives, and the caller
    /// holds no other slice overlapping them.
    ///
    /// # Panics
    /// If the run is outside the cache, or the region is not `f32`.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn blocks_mut(&self, first: usize, count: usize) -> &mut [f32] {
        let (off, len) = self.check_run(first, count);
        // Safety: in bounds (checked); exclusive (caller's obligation).
        unsafe { std::slice::from_raw_parts_mut(self.f32_ptr().add(off), len) }
    }
}

impl Drop for KvRegion {
    fn drop(&mut self) {
        // Safety: `ptr`/`words` came from `Box::<[u32]>::into_raw` in `new` and are freed once.
        unsafe { drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr.as_ptr(), self.words))) };
    }
}

/// The engine's view of the KV cache: writes of new tokens and reads of attention planes, for
/// the blocks of scheduled requests only.
pub struct KvCache {
    region: Arc<KvRegion>,
    /// The region's KV heads this cache reads and writes (all of them, or a tensor-parallel
    /// rank's), and its shape as its user sees it (those heads only).
    first_head: usize,
    view: KvLayout,
}

impl KvCache {
    /// Allocates a zeroed f32 cache.
    pub fn new(layout: KvLayout) -> Self {
        Self::of(layout, KvDtype::F32)
    }

    /// Allocates a zeroed cache of `dtype` elements: f32, or FP8 e4m3 (a quarter of the bytes;
    /// each value written is rounded so, [`KvDtype::Fp8E4m3`]).
    ///
    /// # Panics
    /// If `dtype` is bf16 (only a GPU cache's host copy holds bf16; [`KvRegion::host_copy`]).
    pub fn of(layout: KvLayout, dtype: KvDtype) -> Self {
        assert_ne!(dtype, KvDtype::Bf16, "an engine's own cache on the host is f32 or fp8");
        Self { region: Arc::new(KvRegion::new(layout, dtype)), first_head: 0, view: layout }
    }

    /// The KV heads `heads` of an f32 or fp8 `region` that several caches share
    /// (tensor-parallel ranks of one engine, each with its own heads): each reads and writes
    /// only its heads' planes, so the views may be written from as many threads at once.
    ///
    /// # Panics
    /// If `heads` lies outside the region or the region is bf16.
    pub fn heads_of(region: Arc<KvRegion>, heads: std::ops::Range<usize>) -> Self {
        let full = *region.layout();
        assert!(heads.end <= full.num_kv_heads && !heads.is_empty(), "heads {heads:?} outside the region");
        assert_ne!(region.dtype(), KvDtype::Bf16, "an engine's own cache on the host is f32 or fp8");
        Self { region, first_head: heads.start, view: KvLayout { num_kv_heads: heads.len(), ..full } }
    }

    /// The cache's element type.
    pub fn dtype(&self) -> KvDtype {
        self.region.dtype
    }

    /// The cache's shape (of its heads).
    pub fn layout(&self) -> &KvLayout {
        &self.view
    }

    /// The shared memory, for the KV connector.
    pub fn region(&self) -> Arc<KvRegion> {
        self.region.clone()
    }

    /// One `(block, layer, kv, head)` plane: `block_size` slots of `head_dim`, as f32 (an FP8
    /// cache's decoded into a copy).
    ///
    /// The engine calls this only for blocks in the block tables of requests it is running,
    /// which the connector does not touch (module docs).
    #[inline]
    pub fn plane(&self, block: usize, layer: usize, kv: usize, head: usize) -> Cow<'_, [f32]> {
        let l = &self.region.layout;
        assert!(block < l.num_blocks && layer < l.num_layers && kv < 2 && head < self.view.num_kv_heads);
        let off = l.plane_offset(block, layer, kv, self.first_head + head);
        let base = self.region.ptr.as_ptr();
        match self.region.dtype {
            // Safety: in bounds (asserted; f32 elements at 4-byte words); the block belongs to a
            // running request, so the connector thread is not writing it, and the engine writes
            // only through `&mut self`.
            KvDtype::F32 => {
                Cow::Borrowed(unsafe { std::slice::from_raw_parts((base as *const f32).add(off), l.head_plane()) })
            }
            KvDtype::Fp8E4m3 => {
                // Safety: as above, one byte an element.
                let bytes = unsafe { std::slice::from_raw_parts((base as *const u8).add(off), l.head_plane()) };
                Cow::Owned(bytes.iter().map(|&b| FP8_VALUES[b as usize]).collect())
            }
            KvDtype::Bf16 => unreachable!("an engine's own cache is never bf16 (KvCache::of)"),
        }
    }

    /// Stores one token's keys and values for `layer` at `(block, slot)` (in an FP8 cache
    /// rounded to e4m3, [`KvDtype::Fp8E4m3`]). `k` and `v` hold `num_kv_heads * head_dim`
    /// elements, head-major.
    pub fn write_token(&mut self, layer: usize, block: usize, slot: usize, k: &[f32], v: &[f32]) {
        let l = self.region.layout;
        let (heads, dim) = (self.view.num_kv_heads, l.head_dim);
        assert!(block < l.num_blocks && layer < l.num_layers && slot < l.block_size);
        assert!(k.len() >= heads * dim && v.len() >= heads * dim);
        let base = self.region.ptr.as_ptr();
        for h in 0..heads {
            for (kv, src) in [(0, k), (1, v)] {
                let dst = l.plane_offset(block, layer, kv, self.first_head + h) + slot * dim;
                let src = &src[h * dim..(h + 1) * dim];
                // Safety (both arms): in bounds (asserted above); the block belongs to a running
                // request, so no other thread touches it, `&mut self` excludes engine-side
                // readers, and caches sharing the region write other heads' planes.
                match self.region.dtype {
                    KvDtype::F32 => unsafe {
                        std::ptr::copy_nonoverlapping(src.as_ptr(), (base as *mut f32).add(dst), dim)
                    },
                    KvDtype::Fp8E4m3 => {
                        let out = unsafe { std::slice::from_raw_parts_mut((base as *mut u8).add(dst), dim) };
                        for (o, &x) in out.iter_mut().zip(src) {
                            *o = crate::fp8::f32_to_e4m3(x / KV_FP8_SCALE);
                        }
                    }
                    KvDtype::Bf16 => unreachable!("an engine's own cache is never bf16 (KvCache::of)"),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coalesce_merges_only_ascending_neighbours() {
        let r = coalesce(&[4, 5, 6, 9, 10, 2, 3, 3]);
        assert_eq!(
            r,
            vec![
                BlockRun { start: 4, len: 3 },
                BlockRun { start: 9, len: 2 },
                BlockRun { start: 2, len: 2 },
                BlockRun { start: 3, len: 1 }
            ]
        );
        assert!(coalesce(&[]).is_empty());
        assert_eq!(coalesce(&[u32::MAX, 0]).len(), 2);
    }

    #[test]
    fn consecutive_blocks_are_one_region() {
        let l = KvLayout { num_layers: 3, num_kv_heads: 2, head_dim: 4, block_size: 8, num_blocks: 5 };
        // The last element of block 1 is immediately followed by the first of block 2.
        let end_of_1 = l.plane_offset(1, 2, 1, 1) + l.head_plane();
        assert_eq!(end_of_1, l.plane_offset(2, 0, 0, 0));
        assert_eq!(l.block_elems(), 3 * 2 * 2 * 8 * 4);
        assert_eq!(l.blocks_for(0), 0);
        assert_eq!(l.blocks_for(8), 1);
        assert_eq!(l.blocks_for(9), 2);
    }

    #[test]
    fn write_token_lands_in_its_plane_and_nowhere_else() {
        let l = KvLayout { num_layers: 2, num_kv_heads: 2, head_dim: 2, block_size: 4, num_blocks: 3 };
        let mut c = KvCache::new(l);
        c.write_token(1, 2, 3, &[1.0, 2.0, 3.0, 4.0], &[5.0, 6.0, 7.0, 8.0]);
        assert_eq!(&c.plane(2, 1, 0, 1)[6..8], &[3.0, 4.0]);
        assert_eq!(&c.plane(2, 1, 1, 0)[6..8], &[5.0, 6.0]);
        let region = c.region();
        // Safety: single-threaded test; nothing writes while we read.
        let all = unsafe { region.blocks(0, 3) };
        assert_eq!(all.iter().filter(|x| **x != 0.0).count(), 8);
        // The connector's view of block 2 sees the same bytes.
        let b2 = unsafe { region.blocks(2, 1) };
        assert_eq!(b2[l.plane_offset_in_block(1, 0, 1) + 6], 3.0);
    }

    /// Two caches over one region's heads 0 and 1 write and read their own heads' planes only,
    /// and the region holds both, as one cache of both heads would.
    #[test]
    fn head_views_of_one_region_keep_to_their_heads() {
        let l = KvLayout { num_layers: 2, num_kv_heads: 2, head_dim: 2, block_size: 4, num_blocks: 3 };
        let (mut whole, shared) = (KvCache::new(l), Arc::new(KvRegion::new(l, KvDtype::F32)));
        let mut views = [KvCache::heads_of(shared.clone(), 0..1), KvCache::heads_of(shared.clone(), 1..2)];
        assert_eq!(views[1].layout().num_kv_heads, 1);
        whole.write_token(1, 2, 3, &[1.0, 2.0, 3.0, 4.0], &[5.0, 6.0, 7.0, 8.0]);
        views[0].write_token(1, 2, 3, &[1.0, 2.0], &[5.0, 6.0]);
        views[1].write_token(1, 2, 3, &[3.0, 4.0], &[7.0, 8.0]);
        assert_eq!(&views[1].plane(2, 1, 0, 0)[6..8], &[3.0, 4.0]);
        assert_eq!(&views[0].plane(2, 1, 1, 0)[6..8], &[5.0, 6.0]);
        // Safety: single-threaded test; nothing writes while we read.
        let (a, b) = unsafe { (whole.region().blocks(0, 3).to_vec(), shared.blocks(0, 3).to_vec()) };
        assert_eq!(a, b);
    }

    /// An FP8 cache holds a byte an element, each the nearest e4m3 number (saturating at 448),
    /// and reads back as those numbers; its region's bytes are those e4m3 bytes.
    #[test]
    fn an_fp8_cache_rounds_each_value_to_e4m3() {
        let l = KvLayout { num_layers: 2, num_kv_heads: 2, head_dim: 4, block_size: 4, num_blocks: 3 };
        let mut c = KvCache::of(l, KvDtype::Fp8E4m3);
        assert_eq!((c.dtype(), c.region().block_bytes()), (KvDtype::Fp8E4m3, l.block_elems()));
        let k = [0.1f32, -1.0, 3.3, 1000.0, 0.0, 2.0f32.powi(-9), -448.0, 17.0];
        let v = [0.5f32; 8];
        c.write_token(1, 2, 3, &k, &v);
        let want: Vec<f32> = [0.1015625, -1.0, 3.25, 448.0].to_vec();
        assert_eq!(&c.plane(2, 1, 0, 0)[12..16], &want[..]);
        assert_eq!(&c.plane(2, 1, 0, 1)[12..16], &[0.0, 2.0f32.powi(-9), -448.0, 16.0]);
        assert_eq!(&c.plane(2, 1, 1, 1)[12..16], &[0.5; 4]);
        let region = c.region();
        // Safety: single-threaded test; nothing writes while we read.
        let bytes = unsafe { region.bytes(2, 1) };
        let at = l.plane_offset_in_block(1, 0, 0) + 12;
        assert_eq!(&bytes[at..at + 4], &[crate::fp8::f32_to_e4m3(0.1), 0xb8, 0x45, 0x7e]);
        assert_eq!(bytes.iter().filter(|&&b| b != 0).count(), 15, "only the token's 16 values, one of them 0");
    }

    #[test]
    #[should_panic(expected = "outside the cache")]
    fn runs_outside_the_cache_are_refused() {
        let l = KvLayout { num_layers: 1, num_kv_heads: 1, head_dim: 2, block_size: 2, num_blocks: 3 };
        let c = KvCache::new(l);
        // Safety: single-threaded test.
        let _ = unsafe { c.region().blocks(2, 2) };
    }
}
