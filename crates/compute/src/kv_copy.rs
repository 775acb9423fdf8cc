//! A request's KV moved between two caches as a few large copies: the plan, by byte offsets,
//! that a copy engine (CUDA's, or `memcpy` on the host) then runs.
//!
//! Both caches are block-major ([`KvLayout`]): a block is `planes` rows (one per layer, K|V and
//! KV head, in that order), each row `block_size` tokens of `head_dim` elements. With equal
//! block sizes a run of consecutive source blocks that lands on consecutive destination blocks
//! is one linear copy. With different block sizes a token segment that stays inside one source
//! block and one destination block is one pitched copy: `planes` rows of the segment's bytes,
//! each row at the block's row pitch on either side.

use std::ops::Range;

use crate::KvLayout;

/// One copy of a plan, in bytes from the start of each cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvCopy {
    /// `bytes` contiguous bytes.
    Linear {
        /// Source offset.
        src: usize,
        /// Destination offset.
        dst: usize,
        /// Length.
        bytes: usize,
    },
    /// `rows` rows of `width` bytes; row `r` starts at `src + r * src_pitch` and lands at
    /// `dst + r * dst_pitch`.
    Pitched {
        /// Source offset of row 0.
        src: usize,
        /// Source row pitch.
        src_pitch: usize,
        /// Destination offset of row 0.
        dst: usize,
        /// Destination row pitch.
        dst_pitch: usize,
        /// Bytes per row.
        width: usize,
        /// Rows.
        rows: usize,
    },
}

impl KvCopy {
    /// Bytes this copy moves.
    pub fn bytes(&self) -> usize {
        match *self {
            KvCopy::Linear { bytes, .. } => bytes,
            KvCopy::Pitched { width, rows, .. } => width * rows,
        }
    }

    /// One past the last byte read and written: (source end, destination end).
    fn ends(&self) -> (usize, usize) {
        match *self {
            KvCopy::Linear { src, dst, bytes } => (src + bytes, dst + bytes),
            KvCopy::Pitched { src, src_pitch, dst, dst_pitch, width, rows } => {
                (src + (rows - 1) * src_pitch + width, dst + (rows - 1) * dst_pitch + width)
            }
        }
    }
}

/// The copies that move the KV of tokens `0..num_tokens` from `src_blocks` of a cache laid out
/// as `src` into `dst_blocks` of one laid out as `dst` (both of `elem_bytes`-byte elements).
/// Every copy lies inside both caches: a plan is safe to run on their allocations.
///
/// Errors (a request's block tables are the peer's to get wrong) when the two layouts differ
/// in anything but block size and block count, a list is too short for the tokens, or a block
/// id is outside its cache.
pub fn plan_kv_copy(
    src: &KvLayout,
    dst: &KvLayout,
    elem_bytes: usize,
    src_blocks: &[u32],
    dst_blocks: &[u32],
    num_tokens: usize,
) -> Result<Vec<KvCopy>, String> {
    plan_kv_copy_layers(src, dst, elem_bytes, src_blocks, dst_blocks, num_tokens, 0..src.num_layers)
}

/// [`plan_kv_copy`] for the KV of `layers` only (a group of layers whose keys and values a
/// step has written while later layers still compute). Inside a block a layer range is one
/// contiguous span, so with equal block sizes a run of blocks is one pitched copy of that
/// span per block, and with different ones each token segment covers the range's rows only.
pub fn plan_kv_copy_layers(
    src: &KvLayout,
    dst: &KvLayout,
    elem_bytes: usize,
    src_blocks: &[u32],
    dst_blocks: &[u32],
    num_tokens: usize,
    layers: Range<usize>,
) -> Result<Vec<KvCopy>, String> {
    if layers.is_empty() || layers.end > src.num_layers {
        return Err(format!("layers {layers:?} are not inside the {} layers", src.num_layers));
    }
    if (src.num_layers, src.num_kv_heads, src.head_dim) != (dst.num_layers, dst.num_kv_heads, dst.head_dim) {
        return Err(format!(
            "KV shapes differ: {} layers x {} KV heads x {} here, {} x {} x {} there",
            src.num_layers, src.num_kv_heads, src.head_dim, dst.num_layers, dst.num_kv_heads, dst.head_dim
        ));
    }
    let (n_src, n_dst) = (src.blocks_for(num_tokens), dst.blocks_for(num_tokens));
    if src_blocks.len() < n_src || dst_blocks.len() < n_dst {
        return Err(format!(
            "{num_tokens} tokens need {n_src} source and {n_dst} destination blocks; got {} and {}",
            src_blocks.len(),
            dst_blocks.len()
        ));
    }
    let outside =
        |blocks: &[u32], layout: &KvLayout| blocks.iter().find(|&&b| b as usize >= layout.num_blocks).copied();
    if let Some(b) = outside(&src_blocks[..n_src], src) {
        return Err(format!("source block {b} is outside the cache of {} blocks", src.num_blocks));
    }
    if let Some(b) = outside(&dst_blocks[..n_dst], dst) {
        return Err(format!("destination block {b} is outside the cache of {} blocks", dst.num_blocks));
    }
    let (src_block, dst_block) = (src.block_elems() * elem_bytes, dst.block_elems() * elem_bytes);
    let token_bytes = src.head_dim * elem_bytes;
    let planes_per_layer = 2 * src.num_kv_heads;
    let (first_plane, planes) = (layers.start * planes_per_layer, layers.len() * planes_per_layer);
    let whole_layers = layers.len() == src.num_layers;
    let mut copies = Vec::new();
    if src.block_size == dst.block_size {
        // Runs that are consecutive on both sides merged: whole blocks, or the range's span
        // of each.
        let span = planes * src.block_size * token_bytes;
        let skip = first_plane * src.block_size * token_bytes;
        let mut i = 0;
        while i < n_src {
            let mut n = 1;
            while i + n < n_src
                && src_blocks[i + n] == src_blocks[i] + n as u32
                && dst_blocks[i + n] == dst_blocks[i] + n as u32
            {
                n += 1;
            }
            let (s, d) = (src_blocks[i] as usize * src_block, dst_blocks[i] as usize * dst_block);
            copies.push(if whole_layers {
                KvCopy::Linear { src: s, dst: d, bytes: n * src_block }
            } else {
                KvCopy::Pitched {
                    src: s + skip,
                    src_pitch: src_block,
                    dst: d + skip,
                    dst_pitch: dst_block,
                    width: span,
                    rows: n,
                }
            });
            i += n;
        }
        return Ok(copies);
    }
    let mut t = 0;
    while t < num_tokens {
        let (sb, ss) = (t / src.block_size, t % src.block_size);
        let (db, ds) = (t / dst.block_size, t % dst.block_size);
        let n = (src.block_size - ss).min(dst.block_size - ds).min(num_tokens - t);
        let (src_row, dst_row) = (src.block_size * token_bytes, dst.block_size * token_bytes);
        copies.push(KvCopy::Pitched {
            src: src_blocks[sb] as usize * src_block + first_plane * src_row + ss * token_bytes,
            src_pitch: src_row,
            dst: dst_blocks[db] as usize * dst_block + first_plane * dst_row + ds * token_bytes,
            dst_pitch: dst_row,
            width: n * token_bytes,
            rows: planes,
        });
        t += n;
    }
    debug_assert!(copies.iter().all(|c| {
        let (s, d) = c.ends();
        s <= src.num_blocks * src_block && d <= dst.num_blocks * dst_block
    }));
    Ok(copies)
}

/// Runs `plan` with `memcpy` between two host buffers (tests, and hosts without a copy engine).
///
/// # Panics
/// If a copy falls outside either buffer (a plan for other caches).
pub fn run_kv_copy_on_host(plan: &[KvCopy], src: &[u8], dst: &mut [u8]) {
    for c in plan {
        match *c {
            KvCopy::Linear { src: s, dst: d, bytes } => dst[d..d + bytes].copy_from_slice(&src[s..s + bytes]),
            KvCopy::Pitched { src: s, src_pitch, dst: d, dst_pitch, width, rows } => {
                for r in 0..rows {
                    let (s, d) = (s + r * src_pitch, d + r * dst_pitch);
                    dst[d..d + width].copy_from_slice(&src[s..s + width]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A value unique to every (token, row, element), at its place in a cache laid out as
    /// `layout` under `table`.
    fn fill(layout: &KvLayout, table: &[u32], tokens: usize) -> Vec<u8> {
        let mut bytes = vec![0u8; layout.num_blocks * layout.block_elems() * 2];
        let rows = layout.num_layers * 2 * layout.num_kv_heads;
        for t in 0..tokens {
            for r in 0..rows {
                for e in 0..layout.head_dim {
                    let at = at(layout, table, t, r, e);
                    let v = (t * 1000 + r * 10 + e) as u16;
                    bytes[at..at + 2].copy_from_slice(&v.to_le_bytes());
                }
            }
        }
        bytes
    }

    fn at(layout: &KvLayout, table: &[u32], t: usize, row: usize, e: usize) -> usize {
        let block = table[t / layout.block_size] as usize;
        let elem = block * layout.block_elems()
            + row * layout.block_size * layout.head_dim
            + (t % layout.block_size) * layout.head_dim
            + e;
        elem * 2
    }

    /// Every token's every element lands where the destination's layout puts it, for equal
    /// and unequal block sizes, scattered and consecutive tables; equal sizes on consecutive
    /// tables are one copy.
    #[test]
    fn plans_move_every_token_between_block_sizes() {
        for (src_bs, dst_bs, tokens) in [(16, 16, 40), (16, 32, 70), (32, 16, 70), (16, 5, 37), (4, 16, 33), (8, 8, 1)]
        {
            let sl = KvLayout { num_layers: 3, num_kv_heads: 2, head_dim: 4, block_size: src_bs, num_blocks: 40 };
            let dl = KvLayout { block_size: dst_bs, num_blocks: 30, ..sl };
            let src_table: Vec<u32> = (0..sl.blocks_for(tokens) as u32).map(|b| b * 2 + 1).collect();
            let dst_table: Vec<u32> = (0..dl.blocks_for(tokens) as u32).rev().map(|b| b + 3).collect();
            let src = fill(&sl, &src_table, tokens);
            let plan = plan_kv_copy(&sl, &dl, 2, &src_table, &dst_table, tokens).unwrap();
            let mut dst = vec![0u8; dl.num_blocks * dl.block_elems() * 2];
            run_kv_copy_on_host(&plan, &src, &mut dst);
            for t in 0..tokens {
                for r in 0..sl.num_layers * 2 * sl.num_kv_heads {
                    for e in 0..sl.head_dim {
                        let (s, d) = (at(&sl, &src_table, t, r, e), at(&dl, &dst_table, t, r, e));
                        assert_eq!(src[s..s + 2], dst[d..d + 2], "bs {src_bs}->{dst_bs} token {t} row {r}");
                    }
                }
            }
        }
        let l = KvLayout { num_layers: 2, num_kv_heads: 1, head_dim: 4, block_size: 16, num_blocks: 20 };
        let plan = plan_kv_copy(&l, &l, 2, &[3, 4, 5, 9], &[0, 1, 2, 3], 64).unwrap();
        assert_eq!(plan.len(), 2, "runs consecutive on both sides merge: {plan:?}");
        assert_eq!(plan.iter().map(KvCopy::bytes).sum::<usize>(), 4 * l.block_elems() * 2);
    }

    /// Layer group by layer group, the plans move exactly what the whole plan moves, and each
    /// group's plan touches only its own layers.
    #[test]
    fn layer_group_plans_together_move_the_whole_kv() {
        for (src_bs, dst_bs, tokens) in [(16, 16, 40), (16, 32, 70), (32, 16, 70), (4, 6, 23)] {
            let sl = KvLayout { num_layers: 5, num_kv_heads: 2, head_dim: 4, block_size: src_bs, num_blocks: 40 };
            let dl = KvLayout { block_size: dst_bs, num_blocks: 30, ..sl };
            let src_table: Vec<u32> = (0..sl.blocks_for(tokens) as u32).map(|b| b + 2).collect();
            let dst_table: Vec<u32> = (0..dl.blocks_for(tokens) as u32).map(|b| b + 5).collect();
            let src = fill(&sl, &src_table, tokens);
            let whole = plan_kv_copy(&sl, &dl, 2, &src_table, &dst_table, tokens).unwrap();
            let mut expected = vec![0u8; dl.num_blocks * dl.block_elems() * 2];
            run_kv_copy_on_host(&whole, &src, &mut expected);
            let mut grouped = vec![0u8; expected.len()];
            for layers in [0..2, 2..4, 4..5] {
                let plan = plan_kv_copy_layers(&sl, &dl, 2, &src_table, &dst_table, tokens, layers.clone()).unwrap();
                let mut alone = vec![0u8; expected.len()];
                run_kv_copy_on_host(&plan, &src, &mut alone);
                run_kv_copy_on_host(&plan, &src, &mut grouped);
                // Only this group's rows were written.
                for t in 0..tokens {
                    for r in 0..sl.num_layers * 2 * sl.num_kv_heads {
                        let d = at(&dl, &dst_table, t, r, 1);
                        let inside = layers.contains(&(r / (2 * sl.num_kv_heads)));
                        assert_eq!(alone[d..d + 2] != [0, 0], inside, "bs {src_bs}->{dst_bs} {layers:?} row {r}");
                    }
                }
            }
            assert!(grouped == expected, "bs {src_bs}->{dst_bs}: the groups differ from the whole copy");
        }
        let l = KvLayout { num_layers: 2, num_kv_heads: 1, head_dim: 4, block_size: 16, num_blocks: 8 };
        assert!(plan_kv_copy_layers(&l, &l, 2, &[0], &[0], 8, 1..3).is_err());
        assert!(plan_kv_copy_layers(&l, &l, 2, &[0], &[0], 8, 1..1).is_err());
    }

    #[test]
    fn plans_refuse_what_a_peer_could_get_wrong() {
        let l = KvLayout { num_layers: 2, num_kv_heads: 1, head_dim: 4, block_size: 16, num_blocks: 8 };
        let err = |r: Result<Vec<KvCopy>, String>| r.unwrap_err();
        assert!(err(plan_kv_copy(&l, &l, 2, &[0], &[0, 1], 20)).contains("need 2 source"));
        assert!(err(plan_kv_copy(&l, &l, 2, &[0, 8], &[0, 1], 20)).contains("source block 8 is outside"));
        assert!(err(plan_kv_copy(&l, &l, 2, &[0, 1], &[9, 1], 20)).contains("destination block 9"));
        let other = KvLayout { num_kv_heads: 2, ..l };
        assert!(err(plan_kv_copy(&l, &other, 2, &[0, 1], &[0, 1], 20)).contains("KV shapes differ"));
    }
}
