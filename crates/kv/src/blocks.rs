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

/// Bytes a sender sends for `num_tokens` tokens of the layers `layers` only (a group of a
/// step still computing): each whole block's slice of those layers, in block order. A group's
/// bytes are whole blocks of [`group_layout`].
pub fn group_wire_bytes(layout: &KvLayout, dtype: KvDtype, num_tokens: usize, layers: &Range<usize>) -> u64 {
    wire_bytes(&group_layout(layout, layers), dtype, num_tokens)
}

/// `layout` cut to the layers `layers`: how a group's bytes are laid out on the wire.
pub fn group_layout(layout: &KvLayout, layers: &Range<usize>) -> KvLayout {
    KvLayout { num_layers: layers.len(), ..*layout }
}

/// Copies the KV of tokens `0..num_tokens` of the layers `layers` from `src`, the raw bytes of
/// whole blocks of `src_block_size` tokens in token order (the sender's layout cut to those
/// layers, [`group_layout`]; same heads/head_dim and element type as `dst`), into the
/// destination blocks `dst_blocks` of `dst`.
///
/// # Safety
/// The caller must own `dst_blocks` exclusively (no other thread reads or writes them).
///
/// # Panics
/// If `src` or `dst_blocks` is too short for `num_tokens`, or `layers` lies outside `dst`.
pub unsafe fn scatter_tokens(
    src: &[u8],
    src_block_size: usize,
    dst: &KvRegion,
    dst_blocks: &[u32],
    num_tokens: usize,
    layers: Range<usize>,
) {
    let dl = *dst.layout();
    assert!(layers.end <= dl.num_layers, "layers outside the destination");
    let sl = KvLayout { block_size: src_block_size, num_blocks: num_tokens.div_ceil(src_block_size), ..dl };
    let sl = group_layout(&sl, &layers);
    let eb = dst.dtype().bytes();
    assert!(src.len() >= sl.num_blocks * sl.block_elems() * eb, "source too short");
    assert!(dst_blocks.len() >= dl.blocks_for(num_tokens), "too few destination blocks");
    // Bytes of one token's row in a (layer, k|v, head) plane.
    let hd = dl.head_dim * eb;
    for layer in layers.clone() {
        for kv in 0..2 {
            for head in 0..dl.num_kv_heads {
                let mut t = 0;
                while t < num_tokens {
                    let (sb, ss) = (t / sl.block_size, t % sl.block_size);
                    let (db, ds) = (t / dl.block_size, t % dl.block_size);
                    let n = (sl.block_size - ss).min(dl.block_size - ds).min(num_tokens - t);
                    let s = sl.plane_offset(sb, layer - layers.start, kv, head) * eb + ss * hd;
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
        unsafe { scatter_tokens(&staging, sl.block_size, dst, dst_blocks, num_tokens, 0..dl.num_layers) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tandem_compute::KvCache;

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
            unsafe { scatter_tokens(src_bytes, src_bs, &dst.region(), &dst_table, tokens, 0..2) };
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
