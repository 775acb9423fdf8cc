//! Block lists as contiguous runs, and moving token ranges between block layouts.
//!
//! A request's blocks are listed in token order; consecutive ids form one contiguous region
//! of the KV memory (block-major layout), so a transfer is a handful of large copies. When the
//! two sides use different block sizes, the receiver scatters the sender's layout into its own
//! by token position ([`scatter_tokens`]).

use std::ops::Range;
pub use tandem_compute::{coalesce, BlockRun};

use tandem_compute::{KvDtype, KvLayout, KvRegion};

/// Bytes a sender with `layout` and `dtype` elements sends for `num_tokens` tokens: whole blocks.
pub fn wire_bytes(layout: &KvLayout, dtype: KvDtype, num_tokens: usize) -> u64 {
    (layout.blocks_for(num_tokens) * layout.block_elems() * dtype.bytes()) as u64
}

/// The part of every block a write carries: the layers `layers` of the KV heads `heads`. All of
/// both for whole KV; a group of layers of a step still computing; one tensor-parallel rank's
/// heads ([`KvSlice::of_rank`]). Its bytes go on the wire as whole blocks of the layout cut to
/// it ([`KvSlice::layout`]): per layer, the keys of its heads, then their values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvSlice {
    /// Layers `[start, end)`.
    pub layers: Range<usize>,
    /// KV heads `[start, end)`.
    pub heads: Range<usize>,
}

impl KvSlice {
    /// Every layer and head of `layout`.
    pub fn all(layout: &KvLayout) -> Self {
        Self::of_layers(layout, 0..layout.num_layers)
    }

    /// Every head of the layers `layers`.
    pub fn of_layers(layout: &KvLayout, layers: Range<usize>) -> Self {
        Self { layers, heads: 0..layout.num_kv_heads }
    }

    /// Rank `rank` of `ranks`' share of the slice's layers: as many of `layout`'s heads as
    /// every other rank, in rank order (rank 0 of 1: every head); or why the heads do not split
    /// so (a peer naming such a rank breaks the protocol).
    pub fn of_rank(mut self, layout: &KvLayout, rank: usize, ranks: usize) -> Result<Self, String> {
        let heads = layout.num_kv_heads;
        if ranks == 0 || rank >= ranks || !heads.is_multiple_of(ranks) {
            return Err(format!("{heads} KV heads do not split into rank {rank} of {ranks}"));
        }
        let per = heads / ranks;
        self.heads = rank * per..(rank + 1) * per;
        Ok(self)
    }

    /// Whether the slice is a non-empty part of `layout`'s blocks.
    pub fn check(&self, layout: &KvLayout) -> Result<(), String> {
        let (layers, heads) = (&self.layers, &self.heads);
        if layers.is_empty() || layers.end > layout.num_layers || heads.is_empty() || heads.end > layout.num_kv_heads {
            return Err(format!(
                "layers {layers:?} of {}, KV heads {heads:?} of {}",
                layout.num_layers, layout.num_kv_heads
            ));
        }
        Ok(())
    }

    /// Whether the slice is every head of its layers.
    pub fn all_heads(&self, layout: &KvLayout) -> bool {
        self.heads.len() == layout.num_kv_heads
    }

    /// `layout` cut to the slice: how its bytes lie on the wire.
    pub fn layout(&self, layout: &KvLayout) -> KvLayout {
        KvLayout { num_layers: self.layers.len(), num_kv_heads: self.heads.len(), ..*layout }
    }

    /// Bytes a sender with `layout` and `dtype` elements sends of the slice for `num_tokens`
    /// tokens: each whole block's part, in block order.
    pub fn wire_bytes(&self, layout: &KvLayout, dtype: KvDtype, num_tokens: usize) -> u64 {
        wire_bytes(&self.layout(layout), dtype, num_tokens)
    }

    /// The byte ranges of one block of `layout` (`elem` bytes an element) that hold the slice,
    /// in the wire's order: one range when it has every head (its layers lie together), else
    /// one per layer and K|V. Unchecked ([`KvSlice::check`]).
    pub fn spans(&self, layout: &KvLayout, elem: usize) -> Vec<Range<usize>> {
        let at = |layer: usize, kv: usize, head: usize| layout.plane_offset_in_block(layer, kv, head) * elem;
        if self.all_heads(layout) {
            let layers = at(self.layers.start, 0, 0)..at(self.layers.end, 0, 0);
            return std::iter::once(layers).collect();
        }
        let heads = self.heads.clone();
        self.layers.clone().flat_map(|l| (0..2).map(move |kv| at(l, kv, heads.start)..at(l, kv, heads.end))).collect()
    }
}

/// Copies the KV of tokens `0..num_tokens` of `slice` from `src`, the raw bytes of whole blocks
/// of `src_block_size` tokens in token order (the sender's layout cut to the slice,
/// [`KvSlice::layout`]; same head_dim and element type as `dst`), into the destination blocks
/// `dst_blocks` of `dst`.
///
/// # Safety
/// The caller must own `dst_blocks` exclusively (no other thread reads or writes them).
///
/// # Panics
/// If `src` or `dst_blocks` is too short for `num_tokens`, or `slice` lies outside `dst`.
pub unsafe fn scatter_tokens(
    src: &[u8],
    src_block_size: usize,
    dst: &KvRegion,
    dst_blocks: &[u32],
    num_tokens: usize,
    slice: &KvSlice,
) {
    let dl = *dst.layout();
    assert!(slice.check(&dl).is_ok(), "slice outside the destination");
    let sl = KvLayout { block_size: src_block_size, num_blocks: num_tokens.div_ceil(src_block_size), ..dl };
    let sl = slice.layout(&sl);
    let eb = dst.dtype().bytes();
    assert!(src.len() >= sl.num_blocks * sl.block_elems() * eb, "source too short");
    assert!(dst_blocks.len() >= dl.blocks_for(num_tokens), "too few destination blocks");
    // Bytes of one token's row in a (layer, k|v, head) plane.
    let hd = dl.head_dim * eb;
    let (l0, h0) = (slice.layers.start, slice.heads.start);
    for layer in slice.layers.clone() {
        for kv in 0..2 {
            for head in slice.heads.clone() {
                let mut t = 0;
                while t < num_tokens {
                    let (sb, ss) = (t / sl.block_size, t % sl.block_size);
                    let (db, ds) = (t / dl.block_size, t % dl.block_size);
                    let n = (sl.block_size - ss).min(dl.block_size - ds).min(num_tokens - t);
                    let s = sl.plane_offset(sb, layer - l0, kv, head - h0) * eb + ss * hd;
                    // Safety: the caller owns the destination blocks exclusively.
                    let block = unsafe { dst.bytes_mut(dst_blocks[db] as usize, 1) };
                    let d = dl.plane_offset_in_block(layer, kv, head) * eb + ds * hd;
                    block[d..d + n * hd].copy_from_slice(&src[s..s + n * hd]);
                    t += n;
                }
            }
        }
    }
}

/// Copies the KV of tokens `0..num_tokens` from `src_blocks` of `src` into `dst_blocks` of
/// `dst` (the local transport): block by block when the block sizes match, through one
/// staging buffer and [`scatter_tokens`] when they differ.
///
/// # Safety
/// The caller must hold `src_blocks` (nobody writes them) and own `dst_blocks` exclusively.
///
/// # Panics
/// If a block list is too short for `num_tokens`, or the element types differ (the handshake
/// refuses such peers).
pub unsafe fn copy_tokens(src: &KvRegion, src_blocks: &[u32], dst: &KvRegion, dst_blocks: &[u32], num_tokens: usize) {
    assert_eq!(src.dtype(), dst.dtype(), "KV element types differ");
    let (sl, dl) = (*src.layout(), *dst.layout());
    let n_src = sl.blocks_for(num_tokens);
    if sl.block_size == dl.block_size {
        for (&s, &d) in src_blocks[..n_src].iter().zip(&dst_blocks[..n_src]) {
            // Safety: the caller holds the source blocks and owns the destination blocks.
            let from = unsafe { src.bytes(s as usize, 1) };
            let to = unsafe { dst.bytes_mut(d as usize, 1) };
            to.copy_from_slice(from);
        }
    } else {
        let mut staging = Vec::with_capacity(n_src * src.block_bytes());
        for &s in &src_blocks[..n_src] {
            // Safety: the caller holds the source blocks.
            staging.extend_from_slice(unsafe { src.bytes(s as usize, 1) });
        }
        // Safety: the caller owns the destination blocks exclusively.
        unsafe { scatter_tokens(&staging, sl.block_size, dst, dst_blocks, num_tokens, &KvSlice::all(&dl)) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_compute::KvCache;

    /// A slice's spans are the bytes its wire layout says, in the block's order; ranks split the
    /// heads evenly or not at all.
    #[test]
    fn slices_cut_blocks_into_their_layers_and_ranks_heads() {
        let l = KvLayout { num_layers: 3, num_kv_heads: 4, head_dim: 2, block_size: 2, num_blocks: 1 };
        let plane = l.head_plane() * 4; // bytes of one (layer, k|v, head) plane, f32
        let all = KvSlice::all(&l);
        assert_eq!(all.spans(&l, 4), vec![0..l.block_elems() * 4]);
        assert_eq!(KvSlice::of_layers(&l, 1..3).spans(&l, 4), vec![8 * plane..24 * plane]);
        let rank1 = KvSlice::of_layers(&l, 1..2).of_rank(&l, 1, 2).unwrap();
        assert_eq!(rank1.heads, 2..4);
        assert_eq!(rank1.spans(&l, 4), vec![10 * plane..12 * plane, 14 * plane..16 * plane]);
        let bytes: usize = rank1.spans(&l, 4).iter().map(|s| s.len()).sum();
        assert_eq!(bytes as u64, rank1.wire_bytes(&l, KvDtype::F32, 2));
        assert!(all.clone().of_rank(&l, 0, 3).is_err(), "4 heads do not split into 3 ranks");
        assert!(all.clone().of_rank(&l, 2, 2).is_err() && all.clone().of_rank(&l, 0, 0).is_err());
        assert!(KvSlice { layers: 2..4, heads: 0..4 }.check(&l).is_err());
        assert!(KvSlice { layers: 0..1, heads: 1..1 }.check(&l).is_err());
    }

    /// Fills a source cache with a value unique to (token, layer, kv, head, d), moves it into a
    /// destination with another block size and scattered blocks, and checks every element.
    #[test]
    fn scatter_between_block_sizes_preserves_every_token() {
        for (src_bs, dst_bs, tokens) in [(16, 16, 40), (16, 5, 37), (4, 16, 33), (7, 3, 1)] {
            let base = KvLayout { num_layers: 2, num_kv_heads: 2, head_dim: 3, block_size: src_bs, num_blocks: 20 };
            let val = |t: usize, l: usize, kv: usize, h: usize, d: usize| {
                (t * 1000 + l * 100 + kv * 10 + h) as f32 + d as f32 / 10.0
            };
            let mut src = KvCache::new(base);
            let src_table: Vec<u32> = (0..base.blocks_for(tokens) as u32).collect();
            for t in 0..tokens {
                for l in 0..2 {
                    let k: Vec<f32> = (0..6).map(|i| val(t, l, 0, i / 3, i % 3)).collect();
                    let v: Vec<f32> = (0..6).map(|i| val(t, l, 1, i / 3, i % 3)).collect();
                    src.write_token(l, src_table[t / src_bs] as usize, t % src_bs, &k, &v);
                }
            }
            let dl = KvLayout { block_size: dst_bs, ..base };
            let dst = KvCache::new(dl);
            let dst_table: Vec<u32> = (0..dl.blocks_for(tokens) as u32).rev().map(|b| b + 2).collect();
            let region = src.region();
            // Safety: single-threaded test owns every block.
            let src_bytes = unsafe { region.bytes(0, src_table.len()) };
            unsafe { scatter_tokens(src_bytes, src_bs, &dst.region(), &dst_table, tokens, &KvSlice::all(&base)) };
            for t in 0..tokens {
                for l in 0..2 {
                    for kv in 0..2 {
                        for h in 0..2 {
                            let plane = dst.plane(dst_table[t / dst_bs] as usize, l, kv, h);
                            for d in 0..3 {
                                assert_eq!(
                                    plane[(t % dst_bs) * 3 + d],
                                    val(t, l, kv, h, d),
                                    "bs {src_bs}->{dst_bs} token {t}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// The same move between bf16 regions (a GPU engine's host copy): 2-byte elements, each
    /// tagged with its (token, layer, kv, head, d), land at the destination's positions, through
    /// the local transport's copy with matching and with different block sizes.
    #[test]
    fn bf16_regions_move_every_token_between_block_sizes() {
        let tag = |t: usize, l: usize, kv: usize, h: usize, d: usize| (t * 64 + l * 16 + kv * 8 + h * 4 + d) as u16;
        for (src_bs, dst_bs, tokens) in [(16, 16, 40), (16, 5, 37), (4, 16, 33)] {
            let sl = KvLayout { num_layers: 2, num_kv_heads: 2, head_dim: 3, block_size: src_bs, num_blocks: 20 };
            let dl = KvLayout { block_size: dst_bs, ..sl };
            let (src, dst) = (KvRegion::host_copy(sl, KvDtype::Bf16), KvRegion::host_copy(dl, KvDtype::Bf16));
            let src_table: Vec<u32> = (0..sl.blocks_for(tokens) as u32).map(|b| b + 1).collect();
            let dst_table: Vec<u32> = (0..dl.blocks_for(tokens) as u32).rev().map(|b| b + 2).collect();
            let at = |layout: &KvLayout, table: &[u32], t: usize, l: usize, kv: usize, h: usize, d: usize| {
                let b = table[t / layout.block_size] as usize;
                (b, layout.plane_offset_in_block(l, kv, h) + (t % layout.block_size) * 3 + d)
            };
            for t in 0..tokens {
                for (l, kv, h, d) in (0..24).map(|i| (i / 12, i / 6 % 2, i / 3 % 2, i % 3)) {
                    let (b, off) = at(&sl, &src_table, t, l, kv, h, d);
                    // Safety: single-threaded test owns every block.
                    let block: &mut [u16] = bytemuck::cast_slice_mut(unsafe { src.bytes_mut(b, 1) });
                    block[off] = tag(t, l, kv, h, d);
                }
            }
            // Safety: single-threaded test owns every block.
            unsafe { copy_tokens(&src, &src_table, &dst, &dst_table, tokens) };
            for t in 0..tokens {
                for (l, kv, h, d) in (0..24).map(|i| (i / 12, i / 6 % 2, i / 3 % 2, i % 3)) {
                    let (b, off) = at(&dl, &dst_table, t, l, kv, h, d);
                    let block: &[u16] = bytemuck::cast_slice(unsafe { dst.bytes(b, 1) });
                    assert_eq!(block[off], tag(t, l, kv, h, d), "bs {src_bs}->{dst_bs} token {t}");
                }
            }
        }
    }
}
