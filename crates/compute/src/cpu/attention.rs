//! Causal attention over the paged KV cache.

use rayon::prelude::*;

use crate::KvCache;

/// One sequence's queries in a batch: rows `query_start..query_start + num_queries` of `q`,
/// at positions `first_pos..first_pos + num_queries`. Its keys and values for positions
/// `0..first_pos + num_queries` are already in the cache, in the blocks of `block_table`
/// (position `p` lives in block `block_table[p / block_size]`, slot `p % block_size`).
#[derive(Clone, Copy, Debug)]
pub struct AttnSeq<'a> {
    /// First row of this sequence in the batch.
    pub query_start: usize,
    /// Rows (tokens) of this sequence in the batch.
    pub num_queries: usize,
    /// Position of the first row.
    pub first_pos: usize,
    /// The sequence's blocks, in position order.
    pub block_table: &'a [u32],
}

/// For each query row and head, softmax-weighted sum of the values at positions `<=` the row's
/// position (causal). `q` and `out` are `[rows, num_heads * head_dim]`; query head `h` reads
/// kv head `h / (num_heads / num_kv_heads)` (grouped-query attention).
///
/// Each (row, head) is computed independently in key order, so a token's result is the same in
/// any batch and any prefill chunking.
pub fn paged_attention(
    q: &[f32],
    num_heads: usize,
    cache: &KvCache,
    layer: usize,
    seqs: &[AttnSeq<'_>],
    scale: f32,
    out: &mut [f32],
) {
    let l = *cache.layout();
    let hd = l.head_dim;
    let group = num_heads / l.num_kv_heads;
    // Row -> (sequence, position), so the parallel loop needs no search.
    let rows: usize = seqs.iter().map(|s| s.num_queries).sum();
    let mut row_info = vec![(0usize, 0usize); rows];
    for (si, s) in seqs.iter().enumerate() {
        for i in 0..s.num_queries {
            row_info[s.query_start + i] = (si, s.first_pos + i);
        }
    }
    out[..rows * num_heads * hd].par_chunks_mut(hd).enumerate().for_each_init(
        Vec::new,
        |scores: &mut Vec<f32>, (idx, o)| {
            let (row, head) = (idx / num_heads, idx % num_heads);
            let (si, pos) = row_info[row];
            let table = seqs[si].block_table;
            let kvh = head / group;
            let qv = &q[(row * num_heads + head) * hd..(row * num_heads + head + 1) * hd];
            let n = pos + 1;
            scores.clear();
            let mut max = f32::NEG_INFINITY;
            for p in 0..n {
                let plane = cache.plane(table[p / l.block_size] as usize, layer, 0, kvh);
                let slot = (p % l.block_size) * hd;
                let s = dot(qv, &plane[slot..slot + hd]) * scale;
                max = max.max(s);
                scores.push(s);
            }
            let mut sum = 0.0f32;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            o.fill(0.0);
            for (p, s) in scores.iter().enumerate() {
                let w = s / sum;
                let plane = cache.plane(table[p / l.block_size] as usize, layer, 1, kvh);
                let slot = (p % l.block_size) * hd;
                for (od, vd) in o.iter_mut().zip(&plane[slot..slot + hd]) {
                    *od += w * vd;
                }
            }
        },
    );
}

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ac, ar) = a.as_chunks::<8>();
    let (bc, br) = b.as_chunks::<8>();
    for (x, y) in ac.iter().zip(bc) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::KvLayout;

    /// Dense reference: keys/values given per position, no paging.
    fn reference(q: &[f32], k: &[Vec<f32>], v: &[Vec<f32>], scale: f32) -> Vec<f32> {
        let s: Vec<f32> = k.iter().map(|kk| kk.iter().zip(q).map(|(a, b)| a * b).sum::<f32>() * scale).collect();
        let m = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f32> = s.iter().map(|x| (x - m).exp()).collect();
        let z: f32 = e.iter().sum();
        let mut out = vec![0.0; q.len()];
        for (w, vv) in e.iter().zip(v) {
            for (o, x) in out.iter_mut().zip(vv) {
                *o += w / z * x;
            }
        }
        out
    }

    #[test]
    fn paged_matches_dense_with_gqa_and_scattered_blocks() {
        let (heads, kv_heads, hd, bs) = (4, 2, 8, 4);
        let layout = KvLayout { num_layers: 2, num_kv_heads: kv_heads, head_dim: hd, block_size: bs, num_blocks: 8 };
        let mut cache = KvCache::new(layout);
        let table = [5u32, 1, 6]; // non-contiguous on purpose
        let len = 10; // not a multiple of the block size
        let val =
            |p: usize, h: usize, d: usize, kv: usize| ((p * 31 + h * 7 + d * 3 + kv * 11) % 17) as f32 / 17.0 - 0.5;
        for p in 0..len {
            let k: Vec<f32> = (0..kv_heads * hd).map(|i| val(p, i / hd, i % hd, 0)).collect();
            let v: Vec<f32> = (0..kv_heads * hd).map(|i| val(p, i / hd, i % hd, 1)).collect();
            cache.write_token(1, table[p / bs] as usize, p % bs, &k, &v);
        }
        // Queries for the last 3 positions (a chunk that starts mid-sequence).
        let q: Vec<f32> = (0..3 * heads * hd).map(|i| (i % 13) as f32 / 13.0 - 0.4).collect();
        let seq = AttnSeq { query_start: 0, num_queries: 3, first_pos: len - 3, block_table: &table };
        let mut out = vec![0.0; q.len()];
        paged_attention(&q, heads, &cache, 1, &[seq], 0.35, &mut out);
        for r in 0..3 {
            let pos = len - 3 + r;
            for h in 0..heads {
                let g = h / (heads / kv_heads);
                let ks: Vec<Vec<f32>> = (0..=pos).map(|p| (0..hd).map(|d| val(p, g, d, 0)).collect()).collect();
                let vs: Vec<Vec<f32>> = (0..=pos).map(|p| (0..hd).map(|d| val(p, g, d, 1)).collect()).collect();
                let qi = &q[(r * heads + h) * hd..(r * heads + h + 1) * hd];
                let want = reference(qi, &ks, &vs, 0.35);
                let got = &out[(r * heads + h) * hd..(r * heads + h + 1) * hd];
                for (a, b) in want.iter().zip(got) {
                    assert!((a - b).abs() < 1e-5, "row {r} head {h}");
                }
            }
        }
    }
}
