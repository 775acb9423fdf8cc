//! Causal attention over the paged KV cache.

use rayon::prelude::*;

use super::math::{self, isa_dispatch};
use super::matmul::{dots, isa, Isa};
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
    let (hd, kv_heads) = (l.head_dim, l.num_kv_heads);
    let group = num_heads / kv_heads;
    // Tasks of up to `ROWS` rows of one sequence and one kv head: their queries (rows x the
    // group's heads) share each key's loads.
    const ROWS: usize = 16;
    let mut tasks = Vec::new();
    for (si, s) in seqs.iter().enumerate() {
        for i0 in (0..s.num_queries).step_by(ROWS) {
            for kv_head in 0..kv_heads {
                tasks.push((si, i0, ROWS.min(s.num_queries - i0), kv_head));
            }
        }
    }
    let isa = isa();
    let results: Vec<Vec<f32>> = tasks
        .par_iter()
        .map_init(
            || (Vec::new(), Vec::new()),
            |(queries, scores): &mut (Vec<f32>, Vec<f32>), &(si, i0, rows, kv_head)| {
                let s = &seqs[si];
                queries.clear();
                for r in 0..rows {
                    let first = ((s.query_start + i0 + r) * num_heads + kv_head * group) * hd;
                    queries.extend_from_slice(&q[first..first + group * hd]);
                }
                let first_pos = s.first_pos + i0;
                let keys = KeyRange { cache, layer, kv_head, table: s.block_table, len: first_pos + rows };
                let mut o = vec![0.0f32; queries.len()];
                attend(isa, queries, group, &keys, scale, scores, &mut o);
                o
            },
        )
        .collect();
    for (&(si, i0, rows, kv_head), o) in tasks.iter().zip(&results) {
        for r in 0..rows {
            let first = ((seqs[si].query_start + i0 + r) * num_heads + kv_head * group) * hd;
            out[first..first + group * hd].copy_from_slice(&o[r * group * hd..(r + 1) * group * hd]);
        }
    }
}

/// Positions `0..len` of one kv head in one layer of a sequence's blocks.
struct KeyRange<'a> {
    cache: &'a KvCache,
    layer: usize,
    kv_head: usize,
    table: &'a [u32],
    len: usize,
}

isa_dispatch!(fn attend(isa: Isa, queries: &[f32], group: usize, keys: &KeyRange<'_>, scale: f32, scores: &mut Vec<f32>, out: &mut [f32]) => attend_rows);

/// Consecutive rows of one sequence against one kv head: `queries` is `[rows][group][head_dim]`,
/// the last row at position `keys.len - 1`. For each query, scores `(q · k_p) · scale` (the
/// matrix product's dot products) for the positions up to its row's, `e_p = exp(score - max)`,
/// then `out = Σ_p e_p v_p / Σ_p e_p`, the value sum in position order.
#[inline(always)]
fn attend_rows(
    isa: Isa,
    queries: &[f32],
    group: usize,
    keys: &KeyRange<'_>,
    scale: f32,
    scores: &mut Vec<f32>,
    out: &mut [f32],
) {
    let l = keys.cache.layout();
    let (bs, hd, n) = (l.block_size, l.head_dim, keys.len);
    let nq = queries.len() / hd;
    let first_pos = n - nq / group;
    let visible = |qi: usize| first_pos + qi / group + 1;
    let blocks = &keys.table[..n.div_ceil(bs)];
    scores.clear();
    scores.resize(nq * n, 0.0);
    for (bi, &block) in blocks.iter().enumerate() {
        let plane = keys.cache.plane(block as usize, keys.layer, 0, keys.kv_head);
        let slots = bs.min(n - bi * bs);
        // scores[qi * n + p] for this block's positions p (a row's later positions are
        // computed with the rest and never read).
        dots(isa, queries, &plane[..slots * hd], hd, &mut scores[bi * bs..], n);
    }
    let mut totals = vec![0.0f32; nq];
    for (qi, row) in scores.chunks_exact_mut(n).enumerate() {
        let row = &mut row[..visible(qi)];
        for s in row.iter_mut() {
            *s *= scale;
        }
        let max = math::max(row);
        for s in row.iter_mut() {
            *s = math::exp(*s - max);
        }
        totals[qi] = math::sum(row);
    }
    let planes: Vec<_> = blocks.iter().map(|&b| keys.cache.plane(b as usize, keys.layer, 1, keys.kv_head)).collect();
    let planes: Vec<&[f32]> = planes.iter().map(|p| &**p).collect();
    let rows: Vec<&[f32]> = scores.chunks_exact(n).collect();
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 && (hd == 64 || hd == 128) {
        let (mut qi, mut outs) = (0, out.chunks_exact_mut(hd));
        // Four queries at a time for 64-wide heads, two for 128 (16 accumulator registers).
        let step = if hd == 64 { 4 } else { 2 };
        while qi < nq {
            let q = step.min(nq - qi);
            let vis: Vec<usize> = (qi..qi + q).map(visible).collect();
            let group: Vec<&mut [f32]> = outs.by_ref().take(q).collect();
            let args = (&planes[..], bs, &rows[qi..qi + q], &vis[..], &totals[qi..qi + q], group);
            // Safety: `Isa::Avx512` means `isa()` detected AVX-512F, AVX2 and FMA.
            unsafe {
                match (hd, q) {
                    (64, 4) => x86::weighted_values::<4, 4>(args),
                    (64, 3) => x86::weighted_values::<3, 4>(args),
                    (64, 2) => x86::weighted_values::<2, 4>(args),
                    (128, 2) => x86::weighted_values::<2, 8>(args),
                    (64, _) => x86::weighted_values::<1, 4>(args),
                    _ => x86::weighted_values::<1, 8>(args),
                }
            }
            qi += q;
        }
        return;
    }
    for (qi, o) in out.chunks_exact_mut(hd).enumerate() {
        o.fill(0.0);
        for p in 0..visible(qi) {
            let (e, v) = (rows[qi][p], &planes[p / bs][(p % bs) * hd..(p % bs + 1) * hd]);
            for (o, &vd) in o.iter_mut().zip(v) {
                *o = e.mul_add(vd, *o);
            }
        }
        for o in o.iter_mut() {
            *o /= totals[qi];
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// `(value planes, block size, each query's weights, its visible positions, its weights'
    /// total, its output row)`.
    pub(super) type WeightedArgs<'a, 'b> =
        (&'a [&'a [f32]], usize, &'a [&'a [f32]], &'a [usize], &'a [f32], Vec<&'b mut [f32]>);

    /// For `Q` queries of `16 · NV`-wide heads: `out_q = Σ_{p < visible_q} e_q[p] · v_p / total_q`,
    /// each element summed in position order with fused multiply-adds (the portable loop's
    /// bits), the positions every query sees shared by all `Q` (one load of each value row).
    ///
    /// # Safety
    /// The CPU must support AVX-512F and FMA.
    #[target_feature(enable = "avx512f,avx2,fma")]
    #[allow(clippy::needless_range_loop)] // positions index each query's weights and the values
    pub(super) unsafe fn weighted_values<const Q: usize, const NV: usize>(args: WeightedArgs<'_, '_>) {
        let (planes, bs, e, visible, totals, mut out) = args;
        let hd = NV * 16;
        assert!(e.len() == Q && visible.len() == Q && totals.len() == Q && out.len() == Q);
        for q in 0..Q {
            assert!(e[q].len() >= visible[q] && out[q].len() == hd && visible[q] <= planes.len() * bs);
        }
        assert!(planes.iter().all(|p| p.len() >= bs * hd), "value plane shorter than a block");
        // Safety (every load and store below): row `r < bs` of a plane is within `bs * hd`
        // values (asserted), and each output row holds `hd` (asserted).
        let row = |p: usize, j: usize| unsafe { _mm512_loadu_ps(planes[p / bs].as_ptr().add((p % bs) * hd + j * 16)) };
        let common = visible.iter().copied().min().unwrap_or(0);
        let mut acc = [[_mm512_setzero_ps(); NV]; Q];
        for p in 0..common {
            let v: [__m512; NV] = std::array::from_fn(|j| row(p, j));
            for q in 0..Q {
                let w = _mm512_set1_ps(e[q][p]);
                for j in 0..NV {
                    acc[q][j] = _mm512_fmadd_ps(w, v[j], acc[q][j]);
                }
            }
        }
        for q in 0..Q {
            let mut a = acc[q];
            for p in common..visible[q] {
                let w = _mm512_set1_ps(e[q][p]);
                for (j, a) in a.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(w, row(p, j), *a);
                }
            }
            let t = _mm512_set1_ps(totals[q]);
            for (j, a) in a.iter().enumerate() {
                unsafe { _mm512_storeu_ps(out[q].as_mut_ptr().add(j * 16), _mm512_div_ps(*a, t)) };
            }
        }
    }
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

    /// A row's output has the same bits whether its sequence's rows are computed together (a
    /// prefill), one at a time (decode steps) or in chunks, beside another sequence or not, for
    /// head sizes with their own kernels (64, 128) and without (40).
    #[test]
    fn a_rows_result_does_not_depend_on_how_the_rows_are_batched() {
        for hd in [64, 128, 40] {
            let (heads, kv_heads, bs, len) = (6, 2, 16, 37);
            let layout =
                KvLayout { num_layers: 1, num_kv_heads: kv_heads, head_dim: hd, block_size: bs, num_blocks: 8 };
            let mut cache = KvCache::new(layout);
            let table = [3u32, 0, 5];
            let mut seed = 9u32;
            let mut next = || {
                seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (seed >> 8) as f32 / (1u32 << 24) as f32 - 0.5
            };
            for p in 0..len {
                let k: Vec<f32> = (0..kv_heads * hd).map(|_| next()).collect();
                let v: Vec<f32> = (0..kv_heads * hd).map(|_| next()).collect();
                cache.write_token(0, table[p / bs] as usize, p % bs, &k, &v);
            }
            let width = heads * hd;
            let q: Vec<f32> = (0..len * width).map(|_| next()).collect();
            let run = |rows: std::ops::Range<usize>| {
                let seq =
                    AttnSeq { query_start: 0, num_queries: rows.len(), first_pos: rows.start, block_table: &table };
                let mut out = vec![0.0; rows.len() * width];
                paged_attention(&q[rows.start * width..rows.end * width], heads, &cache, 0, &[seq], 0.3, &mut out);
                out
            };
            let whole = run(0..len);
            for r in 0..len {
                assert_eq!(run(r..r + 1), whole[r * width..(r + 1) * width], "hd {hd}, row {r} alone");
            }
            let (a, b) = (run(0..20), run(20..len));
            assert_eq!([a, b].concat(), whole, "hd {hd}, two chunks");
            // Beside another sequence (rows 30.. again, as a second sequence in the batch).
            let seqs = [
                AttnSeq { query_start: 0, num_queries: 3, first_pos: 5, block_table: &table },
                AttnSeq { query_start: 3, num_queries: len - 30, first_pos: 30, block_table: &table },
            ];
            let batch_q = [&q[5 * width..8 * width], &q[30 * width..len * width]].concat();
            let mut out = vec![0.0; batch_q.len()];
            paged_attention(&batch_q, heads, &cache, 0, &seqs, 0.3, &mut out);
            assert_eq!(out[..3 * width], whole[5 * width..8 * width], "hd {hd}, first of two sequences");
            assert_eq!(out[3 * width..], whole[30 * width..], "hd {hd}, second of two sequences");
        }
    }
}
