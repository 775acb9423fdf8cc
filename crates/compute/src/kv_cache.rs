//! The paged KV cache storage, block-major.

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
        block * self.block_elems()
            + ((layer * 2 + kv) * self.num_kv_heads + head) * self.head_plane()
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }
}

/// Host storage for the paged KV cache: one `f32` allocation of `num_blocks` blocks.
///
/// The cache does not track which blocks are in use; the engine's block pool does. It is
/// plain memory addressed through [`KvLayout`].
pub struct KvCache {
    layout: KvLayout,
    data: Vec<f32>,
}

impl KvCache {
    /// Allocates a zeroed cache.
    pub fn new(layout: KvLayout) -> Self {
        let data = vec![0.0f32; layout.num_blocks * layout.block_elems()];
        Self { layout, data }
    }

    /// The cache's shape.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// All elements, block-major.
    pub fn data(&self) -> &[f32] {
        &self.data
    }

    /// All elements, block-major, writable.
    pub fn data_mut(&mut self) -> &mut [f32] {
        &mut self.data
    }

    /// One block's elements (all layers, K and V).
    pub fn block(&self, block: usize) -> &[f32] {
        let n = self.layout.block_elems();
        &self.data[block * n..(block + 1) * n]
    }

    /// One block's elements, writable.
    pub fn block_mut(&mut self, block: usize) -> &mut [f32] {
        let n = self.layout.block_elems();
        &mut self.data[block * n..(block + 1) * n]
    }

    /// Stores one token's keys and values for `layer` at `(block, slot)`. `k` and `v` hold
    /// `num_kv_heads * head_dim` elements, head-major.
    pub fn write_token(&mut self, layer: usize, block: usize, slot: usize, k: &[f32], v: &[f32]) {
        let l = self.layout;
        for h in 0..l.num_kv_heads {
            let src = h * l.head_dim..(h + 1) * l.head_dim;
            let kd = l.plane_offset(block, layer, 0, h) + slot * l.head_dim;
            self.data[kd..kd + l.head_dim].copy_from_slice(&k[src.clone()]);
            let vd = l.plane_offset(block, layer, 1, h) + slot * l.head_dim;
            self.data[vd..vd + l.head_dim].copy_from_slice(&v[src]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consecutive_blocks_are_one_region() {
        let l = KvLayout {
            num_layers: 3,
            num_kv_heads: 2,
            head_dim: 4,
            block_size: 8,
            num_blocks: 5,
        };
        // The last element of block 1 is immediately followed by the first of block 2.
        let end_of_1 = l.plane_offset(1, 2, 1, 1) + l.head_plane();
        assert_eq!(end_of_1, l.plane_offset(2, 0, 0, 0));
        assert_eq!(l.block_elems(), 3 * 2 * 2 * 8 * 4);
        assert_eq!(l.blocks_for(0), 0);
        assert_eq!(l.blocks_for(8), 1);
        assert_eq!(l.blocks_for(9), 2);
    }

    #[test]
    fn write_token_lands_in_its_plane() {
        let l = KvLayout {
            num_layers: 2,
            num_kv_heads: 2,
            head_dim: 2,
            block_size: 4,
            num_blocks: 3,
        };
        let mut c = KvCache::new(l);
        c.write_token(1, 2, 3, &[1.0, 2.0, 3.0, 4.0], &[5.0, 6.0, 7.0, 8.0]);
        let k1 = l.plane_offset(2, 1, 0, 1) + 3 * 2;
        assert_eq!(&c.data()[k1..k1 + 2], &[3.0, 4.0]);
        let v0 = l.plane_offset(2, 1, 1, 0) + 3 * 2;
        assert_eq!(&c.data()[v0..v0 + 2], &[5.0, 6.0]);
        assert_eq!(c.data().iter().filter(|x| **x != 0.0).count(), 8);
    }
}
