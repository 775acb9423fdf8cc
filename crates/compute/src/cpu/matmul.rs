//! `out = x · Wᵀ`, batch-invariant.
//!
//! Each output element `out[t][j]` is a dot product accumulated in 8 lanes, in order along
//! `k`, then reduced in a fixed tree and finished with the `k % 8` tail. Tiles (how many rows
//! and tokens are computed together) only change which dot products share loads, never the
//! operations inside one dot product, so a token's result is the same whether it is alone,
//! in a batch of 16, or one of 512 prefill tokens.

use rayon::prelude::*;

const LANES: usize = 8;

/// How one multiply-accumulate is done. The fused form is used only inside functions compiled
/// with FMA enabled; the split form is the portable fallback. One process always uses one of
/// them, so results are stable within a run.
trait MulAdd {
    fn mul_add(a: f32, b: f32, acc: f32) -> f32;
}

struct Fused;
impl MulAdd for Fused {
    #[inline(always)]
    fn mul_add(a: f32, b: f32, acc: f32) -> f32 {
        a.mul_add(b, acc)
    }
}

struct Split;
impl MulAdd for Split {
    #[inline(always)]
    fn mul_add(a: f32, b: f32, acc: f32) -> f32 {
        a * b + acc
    }
}

/// Computes a tile of dot products: `R` weight rows against `C` token rows, each of length `k`.
/// Implementations differ in instructions only, never in the order of operations inside one
/// dot product.
trait Kernel {
    fn tile<const R: usize, const C: usize>(w: [&[f32]; R], x: [&[f32]; C], k: usize) -> [[f32; C]; R];
}

/// Any CPU: plain Rust, multiply then add.
struct Portable;
impl Kernel for Portable {
    #[inline(always)]
    fn tile<const R: usize, const C: usize>(w: [&[f32]; R], x: [&[f32]; C], k: usize) -> [[f32; C]; R] {
        tile_portable::<Split, R, C>(w, x, k)
    }
}

/// x86-64 with AVX2 and FMA: explicit 256-bit fused multiply-adds.
#[cfg(target_arch = "x86_64")]
struct Avx2Fma;
#[cfg(target_arch = "x86_64")]
impl Kernel for Avx2Fma {
    #[inline(always)]
    fn tile<const R: usize, const C: usize>(w: [&[f32]; R], x: [&[f32]; C], k: usize) -> [[f32; C]; R] {
        // Safety: `Avx2Fma` is used only by `rows_block_avx2`, which `run_rows` calls only after
        // detecting AVX2 and FMA at run time.
        unsafe { avx2::tile::<R, C>(w, x, k) }
    }
}

/// Dot products of `R` weight rows with `C` token rows, each of length `k`, in portable Rust.
/// The reference for the order of operations every kernel follows.
#[inline(always)]
fn tile_portable<M: MulAdd, const R: usize, const C: usize>(w: [&[f32]; R], x: [&[f32]; C], k: usize) -> [[f32; C]; R] {
    let n = k / LANES;
    // Every operand sliced to exactly `n` chunks, so the loop's index checks are provably
    // redundant and the compiler keeps the accumulators in registers.
    let wc: [&[[f32; LANES]]; R] = std::array::from_fn(|r| &w[r].as_chunks::<LANES>().0[..n]);
    let xc: [&[[f32; LANES]]; C] = std::array::from_fn(|c| &x[c].as_chunks::<LANES>().0[..n]);
    let mut acc = [[[0.0f32; LANES]; C]; R];
    for i in 0..n {
        let wv: [[f32; LANES]; R] = std::array::from_fn(|r| wc[r][i]);
        let xv: [[f32; LANES]; C] = std::array::from_fn(|c| xc[c][i]);
        for r in 0..R {
            for c in 0..C {
                for l in 0..LANES {
                    acc[r][c][l] = M::mul_add(wv[r][l], xv[c][l], acc[r][c][l]);
                }
            }
        }
    }
    let mut out = [[0.0f32; C]; R];
    for r in 0..R {
        for c in 0..C {
            let a = &acc[r][c];
            let mut s = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
            for kk in n * LANES..k {
                s = M::mul_add(w[r][kk], x[c][kk], s);
            }
            out[r][c] = s;
        }
    }
    out
}

/// Computes rows `j0..j0 + rows` of `W` against all tokens into `out_t` (`[rows][tokens]`).
#[inline(always)]
fn rows_block<K: Kernel>(x: &[f32], tokens: usize, w: &[f32], k: usize, j0: usize, rows: usize, out_t: &mut [f32]) {
    let wrow = |j: usize| &w[(j0 + j) * k..(j0 + j + 1) * k];
    let xrow = |t: usize| &x[t * k..(t + 1) * k];
    // Tokens in blocks of 64 (their rows stay in L2); inside a block, each pair of weight rows
    // is loaded once and stays in L1 while every group of four tokens passes over it. Weights
    // are therefore streamed from memory once per 64 tokens, which is what decode needs.
    const TOKEN_BLOCK: usize = 64;
    let mut tb = 0;
    while tb < tokens {
        let te = (tb + TOKEN_BLOCK).min(tokens);
        let groups_end = tb + (te - tb) / 4 * 4;
        let mut j = 0;
        while j < rows {
            let pair = j + 2 <= rows;
            let mut t = tb;
            while t < groups_end {
                let xs = [xrow(t), xrow(t + 1), xrow(t + 2), xrow(t + 3)];
                if pair {
                    let r = K::tile::<2, 4>([wrow(j), wrow(j + 1)], xs, k);
                    for (dr, vals) in r.iter().enumerate() {
                        out_t[(j + dr) * tokens + t..(j + dr) * tokens + t + 4].copy_from_slice(vals);
                    }
                } else {
                    let r = K::tile::<1, 4>([wrow(j)], xs, k);
                    out_t[j * tokens + t..j * tokens + t + 4].copy_from_slice(&r[0]);
                }
                t += 4;
            }
            j += if pair { 2 } else { 1 };
        }
        // Tokens left over from the groups of four, one at a time, eight weight rows at once
        // to keep the FMA units busy (this is the whole of a batch-1 decode step).
        for t in groups_end..te {
            let xs = [xrow(t)];
            let mut j = 0;
            while j + 8 <= rows {
                let r = K::tile::<8, 1>(std::array::from_fn(|i| wrow(j + i)), xs, k);
                for (dr, v) in r.iter().enumerate() {
                    out_t[(j + dr) * tokens + t] = v[0];
                }
                j += 8;
            }
            while j < rows {
                out_t[j * tokens + t] = K::tile::<1, 1>([wrow(j)], xs, k)[0][0];
                j += 1;
            }
        }
        tb = te;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn rows_block_avx2(x: &[f32], tokens: usize, w: &[f32], k: usize, j0: usize, rows: usize, out_t: &mut [f32]) {
    rows_block::<Avx2Fma>(x, tokens, w, k, j0, rows, out_t)
}

pub(super) fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static DETECTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *DETECTED
            .get_or_init(|| std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

fn run_rows(x: &[f32], tokens: usize, w: &[f32], k: usize, j0: usize, rows: usize, out_t: &mut [f32]) {
    run_rows_on(has_avx2_fma(), x, tokens, w, k, j0, rows, out_t)
}

/// [`rows_block`] with the AVX2+FMA kernel when `avx2` (which must mean the CPU has both:
/// [`has_avx2_fma`]), else the portable one.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn run_rows_on(
    avx2: bool,
    x: &[f32],
    tokens: usize,
    w: &[f32],
    k: usize,
    j0: usize,
    rows: usize,
    out_t: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        // Safety: callers pass `avx2` only after detecting AVX2 and FMA at run time, which is
        // the only requirement `rows_block_avx2` adds over a plain function.
        unsafe { rows_block_avx2(x, tokens, w, k, j0, rows, out_t) };
        return;
    }
    let _ = avx2;
    rows_block::<Portable>(x, tokens, w, k, j0, rows, out_t)
}

/// Rows of `W` a rayon task takes in a product of `m` rows (a multiple of 8, about four tasks a
/// thread).
pub(super) fn rows_per_task(m: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    m.div_ceil(threads * 4).next_multiple_of(8).max(8)
}

/// `out[t * m + j] = Σ_kk x[t * k + kk] · w[j * k + kk]` for `tokens` rows of `x` and the `m`
/// rows of `w` (`[m, k]`, the HF `Linear` layout).
///
/// # Panics
/// If a slice is shorter than its stated shape (a programming error, not a request error).
pub fn matmul_t(x: &[f32], tokens: usize, w: &[f32], m: usize, k: usize, out: &mut [f32]) {
    assert!(x.len() >= tokens * k && w.len() >= m * k && out.len() >= tokens * m);
    if tokens == 0 || m == 0 {
        return;
    }
    for_row_tasks(tokens, m, out, |j0, rows, out_t| run_rows(x, tokens, w, k, j0, rows, out_t));
}

/// Runs `task(j0, rows, out_t)` on rayon tasks over the `m` rows of a product with `tokens`
/// tokens, each task writing its rows' `[rows][tokens]` outputs, and lays them out as
/// `out[t * m + j]`.
pub(super) fn for_row_tasks(tokens: usize, m: usize, out: &mut [f32], task: impl Fn(usize, usize, &mut [f32]) + Sync) {
    let per_task = rows_per_task(m);
    if tokens == 1 {
        // One token: the transposed buffer is the output itself.
        out[..m].par_chunks_mut(per_task).enumerate().for_each(|(i, chunk)| task(i * per_task, chunk.len(), chunk));
        return;
    }
    let mut out_t = vec![0.0f32; m * tokens];
    out_t
        .par_chunks_mut(per_task * tokens)
        .enumerate()
        .for_each(|(i, chunk)| task(i * per_task, chunk.len() / tokens, chunk));
    for j in 0..m {
        for t in 0..tokens {
            out[t * m + j] = out_t[j * tokens + t];
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::{__m256, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_setzero_ps, _mm256_storeu_ps};

    use super::{Fused, MulAdd, LANES};

    /// The AVX2+FMA tile: lane `l` of each accumulator sums elements `l, l + 8, ...` with fused
    /// multiply-adds, then the lanes are reduced in the same tree as `tile_portable` and the
    /// `k % 8` tail is added with fused multiply-adds.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn tile<const R: usize, const C: usize>(
        w: [&[f32]; R],
        x: [&[f32]; C],
        k: usize,
    ) -> [[f32; C]; R] {
        for row in w.iter().chain(x.iter()) {
            assert!(row.len() >= k, "tile operand shorter than k");
        }
        let n = k / LANES;
        let mut acc: [[__m256; C]; R] = [[_mm256_setzero_ps(); C]; R];
        let mut xv: [__m256; C] = [_mm256_setzero_ps(); C];
        for i in 0..n {
            let off = i * LANES;
            for c in 0..C {
                // Safety: off + 8 <= n * 8 <= k <= x[c].len() (asserted above).
                xv[c] = unsafe { _mm256_loadu_ps(x[c].as_ptr().add(off)) };
            }
            for r in 0..R {
                // Safety: as above, for w[r].
                let wv = unsafe { _mm256_loadu_ps(w[r].as_ptr().add(off)) };
                for c in 0..C {
                    acc[r][c] = _mm256_fmadd_ps(wv, xv[c], acc[r][c]);
                }
            }
        }
        let mut out = [[0.0f32; C]; R];
        for r in 0..R {
            for c in 0..C {
                let mut a = [0.0f32; LANES];
                // Safety: `a` holds exactly 8 f32s.
                unsafe { _mm256_storeu_ps(a.as_mut_ptr(), acc[r][c]) };
                let mut s = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
                for kk in n * LANES..k {
                    s = Fused::mul_add(w[r][kk], x[c][kk], s);
                }
                out[r][c] = s;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    }

    #[test]
    fn matches_naive_and_is_batch_invariant() {
        let mut s = 7u64;
        for &(m, k) in &[(1usize, 1usize), (13, 37), (64, 64), (130, 203)] {
            let tokens = 11;
            let x: Vec<f32> = (0..tokens * k).map(|_| lcg(&mut s)).collect();
            let w: Vec<f32> = (0..m * k).map(|_| lcg(&mut s)).collect();
            let mut out = vec![0.0; tokens * m];
            matmul_t(&x, tokens, &w, m, k, &mut out);
            for t in 0..tokens {
                for j in 0..m {
                    let naive: f64 = (0..k).map(|i| x[t * k + i] as f64 * w[j * k + i] as f64).sum();
                    assert!((out[t * m + j] as f64 - naive).abs() < 1e-4, "m={m} k={k}");
                }
                // The same token alone, or in a batch of a different size, gives identical bits.
                let mut alone = vec![0.0; m];
                matmul_t(&x[t * k..(t + 1) * k], 1, &w, m, k, &mut alone);
                assert_eq!(&alone[..], &out[t * m..(t + 1) * m]);
                let first = t.min(tokens - 5);
                let mut five = vec![0.0; 5 * m];
                matmul_t(&x[first * k..(first + 5) * k], 5, &w, m, k, &mut five);
                assert_eq!(&five[(t - first) * m..(t - first + 1) * m], &out[t * m..(t + 1) * m]);
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_tile_is_bit_identical_to_the_portable_fused_order() {
        if !has_avx2_fma() {
            return;
        }
        let mut s = 11u64;
        for k in [1usize, 7, 8, 37, 576] {
            let w: Vec<Vec<f32>> = (0..2).map(|_| (0..k).map(|_| lcg(&mut s)).collect()).collect();
            let x: Vec<Vec<f32>> = (0..4).map(|_| (0..k).map(|_| lcg(&mut s)).collect()).collect();
            let wr = [&w[0][..], &w[1][..]];
            let xr = [&x[0][..], &x[1][..], &x[2][..], &x[3][..]];
            // Safety: AVX2 and FMA were detected above.
            let fast = unsafe { avx2::tile::<2, 4>(wr, xr, k) };
            assert_eq!(fast, tile_portable::<Fused, 2, 4>(wr, xr, k), "k={k}");
        }
    }
}
