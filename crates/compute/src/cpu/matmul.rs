//! `out = x · Wᵀ`, batch-invariant.
//!
//! Each output element `out[t][j]` is a dot product accumulated in 16 lanes, in order along
//! `k` (lane `l` sums elements `l, l + 16, ...`), then reduced by folding halves (lane `l` plus
//! lane `l + 8`, then `+ 4`, `+ 2`, `+ 1`) and finished with the `k % 16` tail. Tiles (how many
//! rows and tokens are computed together) and instruction sets (AVX-512, AVX2, portable Rust)
//! only change which dot products share loads, never the operations inside one dot product, so
//! a token's result is the same whether it is alone, in a batch of 16, or one of 512 prefill
//! tokens, and the same on any x86-64 CPU with FMA.

use rayon::prelude::*;

pub(super) const LANES: usize = 16;

/// The instruction set the kernels use, detected once per process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Isa {
    /// Plain Rust, multiply then add (no FMA on this CPU).
    Portable,
    /// x86-64 with AVX2 and FMA: each 16-lane accumulator is two 256-bit registers.
    Avx2,
    /// x86-64 with AVX-512F (and AVX2, FMA, F16C): one 512-bit register per accumulator.
    Avx512,
}

pub(super) fn isa() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        static DETECTED: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *DETECTED.get_or_init(|| {
            let avx2 = std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma");
            // F16C too (every AVX-512 CPU has it): the quantized kernels convert block scales.
            let avx512 = std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("f16c");
            if avx2 && avx512 {
                Isa::Avx512
            } else if avx2 {
                Isa::Avx2
            } else {
                Isa::Portable
            }
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        Isa::Portable
    }
}

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

/// The 16 lanes of one dot product summed by folding halves: `l + 8`, then `+ 4`, `+ 2`, `+ 1`.
#[inline(always)]
pub(super) fn fold_lanes(a: &[f32; LANES]) -> f32 {
    let s8: [f32; 8] = std::array::from_fn(|l| a[l] + a[l + 8]);
    fold8(&s8)
}

/// The last three levels of [`fold_lanes`], on lanes already folded once.
#[inline(always)]
fn fold8(s8: &[f32; 8]) -> f32 {
    ((s8[0] + s8[4]) + (s8[2] + s8[6])) + ((s8[1] + s8[5]) + (s8[3] + s8[7]))
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
        for r in 0..R {
            for c in 0..C {
                for l in 0..LANES {
                    acc[r][c][l] = M::mul_add(wc[r][i][l], xc[c][i][l], acc[r][c][l]);
                }
            }
        }
    }
    let mut out = [[0.0f32; C]; R];
    for r in 0..R {
        for c in 0..C {
            out[r][c] = tail::<M>(fold_lanes(&acc[r][c]), w[r], x[c], n * LANES, k);
        }
    }
    out
}

/// `s` plus the products of elements `from..k`, in order.
#[inline(always)]
fn tail<M: MulAdd>(mut s: f32, w: &[f32], x: &[f32], from: usize, k: usize) -> f32 {
    for kk in from..k {
        s = M::mul_add(w[kk], x[kk], s);
    }
    s
}

/// The most segments a dot product may be split into ([`matmul_t_segmented`]).
pub const MAX_SEGMENTS: usize = 8;

/// A tile of dot products each taken in `segments` equal parts along `k` (each part as
/// [`Kernel::tile`] takes a whole dot product), the parts summed pairwise as a balanced tree:
/// `(p0 + p1) + (p2 + p3)` for four. One segment is [`Kernel::tile`] itself.
#[inline(always)]
fn tile_segments<K: Kernel, const R: usize, const C: usize>(
    w: [&[f32]; R],
    x: [&[f32]; C],
    k: usize,
    segments: usize,
) -> [[f32; C]; R] {
    if segments == 1 {
        return K::tile::<R, C>(w, x, k);
    }
    let seg = k / segments;
    let mut parts = [[[0.0f32; C]; R]; MAX_SEGMENTS];
    for (g, part) in parts[..segments].iter_mut().enumerate() {
        *part = K::tile::<R, C>(w.map(|row| &row[g * seg..]), x.map(|row| &row[g * seg..]), seg);
    }
    let mut step = 1;
    while step < segments {
        for i in (0..segments).step_by(2 * step) {
            let right = parts[i + step];
            for (row, add) in parts[i].iter_mut().zip(&right) {
                for (a, b) in row.iter_mut().zip(add) {
                    *a += b;
                }
            }
        }
        step *= 2;
    }
    parts[0]
}

/// Computes rows `0..rows` of `w` (row `j` at `w[j * k..]`) against all `tokens` rows of `x`,
/// writing `out[t * ld + j]`, each dot product in `segments` parts ([`tile_segments`]).
///
/// Tokens go in blocks of 64 (their rows stay in L2); inside a block each group of `R` weight
/// rows stays in L1 while every group of `C` tokens passes over it, so weights are streamed from
/// memory once per 64 tokens. Tokens left over from the groups of `C` take one smaller tile per
/// row group (a batch-1 decode step is all such tiles: `R` rows of one token).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn rows_block<K: Kernel, const R: usize, const C: usize, const R1: usize>(
    x: &[f32],
    tokens: usize,
    w: &[f32],
    k: usize,
    rows: usize,
    out: &mut [f32],
    ld: usize,
    segments: usize,
) {
    const TOKEN_BLOCK: usize = 64;
    let wrow = |j: usize| &w[j * k..(j + 1) * k];
    let xrow = |t: usize| &x[t * k..(t + 1) * k];
    if tokens == 1 {
        // One token (a batch-1 decode step): the weights streamed in groups of `R1` rows.
        let mut j = 0;
        while j + R1 <= rows {
            let v = tile_segments::<K, R1, 1>(std::array::from_fn(|r| wrow(j + r)), [xrow(0)], k, segments);
            store(&v, out, ld, 0, j);
            j += R1;
        }
        while j < rows {
            store(&tile_segments::<K, 1, 1>([wrow(j)], [xrow(0)], k, segments), out, ld, 0, j);
            j += 1;
        }
        return;
    }
    let mut tb = 0;
    while tb < tokens {
        let te = (tb + TOKEN_BLOCK).min(tokens);
        let groups_end = tb + (te - tb) / C * C;
        let mut j = 0;
        while j < rows {
            if j + R <= rows {
                let ws: [&[f32]; R] = std::array::from_fn(|r| wrow(j + r));
                let mut t = tb;
                while t < groups_end {
                    let v = tile_segments::<K, R, C>(ws, std::array::from_fn(|c| xrow(t + c)), k, segments);
                    store(&v, out, ld, t, j);
                    t += C;
                }
                leftover::<K, R>(ws, x, k, groups_end, te, out, ld, j, segments);
                j += R;
            } else {
                let ws = [wrow(j)];
                let mut t = tb;
                while t < groups_end {
                    let v = tile_segments::<K, 1, C>(ws, std::array::from_fn(|c| xrow(t + c)), k, segments);
                    store(&v, out, ld, t, j);
                    t += C;
                }
                leftover::<K, 1>(ws, x, k, groups_end, te, out, ld, j, segments);
                j += 1;
            }
        }
        tb = te;
    }
}

/// Tokens `t0..t1` (fewer than a full group) against the rows `ws`, as one tile.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn leftover<K: Kernel, const R: usize>(
    ws: [&[f32]; R],
    x: &[f32],
    k: usize,
    t0: usize,
    t1: usize,
    out: &mut [f32],
    ld: usize,
    j: usize,
    segments: usize,
) {
    let xrow = |t: usize| &x[t * k..(t + 1) * k];
    macro_rules! tiles {
        ($($n:literal)*) => {
            match t1 - t0 {
                0 => {}
                $($n => store(&tile_segments::<K, R, $n>(ws, std::array::from_fn(|c| xrow(t0 + c)), k, segments), out, ld, t0, j),)*
                n => unreachable!("{n} leftover tokens"),
            }
        };
    }
    tiles!(1 2 3 4 5 6 7);
}

#[inline(always)]
fn store<const R: usize, const C: usize>(v: &[[f32; C]; R], out: &mut [f32], ld: usize, t: usize, j: usize) {
    for (r, row) in v.iter().enumerate() {
        for (c, &val) in row.iter().enumerate() {
            out[(t + c) * ld + j + r] = val;
        }
    }
}

/// Dot products of `w`'s rows (`rows` of them, `k` apart) with every token row of `x`, into
/// `out[t * ld + j]`, with the kernels of `isa` (which must be what [`isa`] detected, or a
/// lesser one).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn run_rows_on(
    isa: Isa,
    x: &[f32],
    tokens: usize,
    w: &[f32],
    k: usize,
    rows: usize,
    out: &mut [f32],
    ld: usize,
) {
    run_rows_segmented(isa, x, tokens, w, k, rows, out, ld, 1)
}

/// [`run_rows_on`] with each dot product in `segments` parts ([`tile_segments`]).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn run_rows_segmented(
    isa: Isa,
    x: &[f32],
    tokens: usize,
    w: &[f32],
    k: usize,
    rows: usize,
    out: &mut [f32],
    ld: usize,
    segments: usize,
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // Safety: callers pass `Isa::Avx512` only when `isa()` detected AVX-512F, AVX2 and FMA.
        Isa::Avx512 => unsafe { x86::rows_avx512(x, tokens, w, k, rows, out, ld, segments) },
        #[cfg(target_arch = "x86_64")]
        // Safety: callers pass `Isa::Avx2` only when `isa()` detected AVX2 and FMA (or more).
        Isa::Avx2 => unsafe { x86::rows_avx2(x, tokens, w, k, rows, out, ld, segments) },
        _ => rows_block::<Portable, 2, 4, 4>(x, tokens, w, k, rows, out, ld, segments),
    }
}

/// `out[qi * ld + p] = queries_qi · keys_p` for every row of `queries` and of `keys` (`k`
/// long each): the bits of [`run_rows_on`] with the keys as weight rows, computed for short
/// rows (attention's heads) on AVX-512 by a kernel that folds 16 dot products at once.
pub(super) fn dots(isa: Isa, queries: &[f32], keys: &[f32], k: usize, out: &mut [f32], ld: usize) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        for (c, chunk) in keys.chunks(16 * k).enumerate() {
            // Safety: `Isa::Avx512` means `isa()` detected AVX-512F, AVX2 and FMA.
            unsafe { x86::dots_avx512(queries, chunk, k, &mut out[c * 16..], ld) };
        }
        return;
    }
    run_rows_on(isa, queries, queries.len() / k, keys, k, keys.len() / k, out, ld)
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
    matmul_t_segmented(x, tokens, w, m, k, 1, out)
}

/// [`matmul_t`] with each dot product taken in `segments` equal parts along `k` (a power of two
/// up to [`MAX_SEGMENTS`] dividing `k`), each part as [`matmul_t`] takes a whole one, the parts
/// summed pairwise as a balanced tree. A tensor-parallel rank holding `k / n` of the columns
/// computes `segments / n` parts so; adding the ranks' results in the tree's upper levels then
/// gives these bits at any `n`.
///
/// # Panics
/// If a slice is shorter than its stated shape, or `segments` is not such a count.
pub fn matmul_t_segmented(x: &[f32], tokens: usize, w: &[f32], m: usize, k: usize, segments: usize, out: &mut [f32]) {
    assert!(
        segments.is_power_of_two() && segments <= MAX_SEGMENTS && k.is_multiple_of(segments),
        "{segments} segments of {k}"
    );
    assert!(x.len() >= tokens * k && w.len() >= m * k && out.len() >= tokens * m);
    if tokens == 0 || m == 0 {
        return;
    }
    let isa = isa();
    let threads = rayon::current_num_threads().max(1);
    if tokens >= TOKEN_SPLIT * threads {
        // Many tokens (a prefill): each task takes a run of tokens and every row, writing its
        // own rows of the output; the weights (a few MB a matrix) are read once per task from
        // the last-level cache.
        let per_task = tokens.div_ceil(threads * 2).next_multiple_of(8);
        out[..tokens * m].par_chunks_mut(per_task * m).enumerate().for_each(|(i, part)| {
            let t0 = i * per_task;
            let n = part.len() / m;
            run_rows_segmented(isa, &x[t0 * k..(t0 + n) * k], n, &w[..m * k], k, m, part, m, segments)
        });
        return;
    }
    for_row_tasks(tokens, m, out, |j0, rows, part| {
        run_rows_segmented(isa, x, tokens, &w[j0 * k..(j0 + rows) * k], k, rows, part, rows, segments)
    });
}

/// Tokens per thread from which a product splits its tokens rather than its rows among tasks.
const TOKEN_SPLIT: usize = 32;

/// Runs `task(j0, rows, part)` on rayon tasks over the `m` rows of a product with `tokens`
/// tokens, each task writing its rows' outputs as `part[t * rows + j]`, and lays them out as
/// `out[t * m + j0 + j]`.
pub(super) fn for_row_tasks(tokens: usize, m: usize, out: &mut [f32], task: impl Fn(usize, usize, &mut [f32]) + Sync) {
    let per_task = rows_per_task(m);
    if tokens == 1 {
        // One token: each task's part is its slice of the output.
        out[..m].par_chunks_mut(per_task).enumerate().for_each(|(i, chunk)| task(i * per_task, chunk.len(), chunk));
        return;
    }
    thread_local! {
        // The calling thread's parts, kept between products (a fresh multi-megabyte buffer
        // would be page-faulted in each time).
        static PARTS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let mut run = |parts: &mut Vec<f32>| {
        parts.resize(m * tokens, 0.0);
        parts
            .par_chunks_mut(per_task * tokens)
            .enumerate()
            .for_each(|(i, chunk)| task(i * per_task, chunk.len() / tokens, chunk));
        // Task i's part holds its rows for every token, row-major by token: one copy per token
        // and task into the output row.
        out[..tokens * m].par_chunks_mut(m).enumerate().for_each(|(t, row)| {
            for (i, part) in parts.chunks(per_task * tokens).enumerate() {
                let rows = part.len() / tokens;
                row[i * per_task..i * per_task + rows].copy_from_slice(&part[t * rows..(t + 1) * rows]);
            }
        });
    };
    // A thread waiting inside the parallel loop above may take another product's task from the
    // pool and start that product: the buffer is then in use, and that product gets its own.
    PARTS.with(|cell| match cell.try_borrow_mut() {
        Ok(mut parts) => run(&mut parts),
        Err(_) => run(&mut Vec::new()),
    });
}

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use std::arch::x86_64::*;

    use super::{fold8, rows_block, tail, Fused, Kernel, LANES};

    /// AVX2+FMA: lanes 0-7 and 8-15 of each accumulator in two registers.
    struct Avx2Fma;
    impl Kernel for Avx2Fma {
        #[inline(always)]
        fn tile<const R: usize, const C: usize>(w: [&[f32]; R], x: [&[f32]; C], k: usize) -> [[f32; C]; R] {
            // Safety: `Avx2Fma` is used only by `rows_avx2`, compiled with AVX2 and FMA and
            // called only after detecting them.
            unsafe { tile_avx2::<R, C>(w, x, k) }
        }
    }

    /// AVX-512F: one register per accumulator.
    struct Avx512;
    impl Kernel for Avx512 {
        #[inline(always)]
        fn tile<const R: usize, const C: usize>(w: [&[f32]; R], x: [&[f32]; C], k: usize) -> [[f32; C]; R] {
            // Safety: `Avx512` is used only by `rows_avx512`, compiled with AVX-512F, AVX2 and
            // FMA and called only after detecting them.
            unsafe { tile_avx512::<R, C>(w, x, k) }
        }
    }

    /// [`rows_block`](super::rows_block) with the AVX2 kernel: 2 rows x 3 tokens (12
    /// accumulator registers of the 16), 4 rows for one token.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn rows_avx2(
        x: &[f32],
        tokens: usize,
        w: &[f32],
        k: usize,
        rows: usize,
        out: &mut [f32],
        ld: usize,
        segments: usize,
    ) {
        rows_block::<Avx2Fma, 2, 3, 4>(x, tokens, w, k, rows, out, ld, segments)
    }

    /// [`rows_block`](super::rows_block) with the AVX-512 kernel: 4 rows x 4 tokens (16
    /// accumulator registers of the 32: 4 x 6 spilled and ran slower), 8 rows for one token.
    ///
    /// # Safety
    /// The CPU must support AVX-512F, AVX2 and FMA.
    #[target_feature(enable = "avx512f,avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn rows_avx512(
        x: &[f32],
        tokens: usize,
        w: &[f32],
        k: usize,
        rows: usize,
        out: &mut [f32],
        ld: usize,
        segments: usize,
    ) {
        rows_block::<Avx512, 4, 4, 8>(x, tokens, w, k, rows, out, ld, segments)
    }

    /// `tile_avx2` compiled for its features, for tests.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[cfg(test)]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn test_tile_avx2<const R: usize, const C: usize>(
        w: [&[f32]; R],
        x: [&[f32]; C],
        k: usize,
    ) -> [[f32; C]; R] {
        unsafe { tile_avx2(w, x, k) }
    }

    /// `tile_avx512` compiled for its features, for tests.
    ///
    /// # Safety
    /// The CPU must support AVX-512F and FMA.
    #[cfg(test)]
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn test_tile_avx512<const R: usize, const C: usize>(
        w: [&[f32]; R],
        x: [&[f32]; C],
        k: usize,
    ) -> [[f32; C]; R] {
        unsafe { tile_avx512(w, x, k) }
    }

    fn check_operands(w: &[&[f32]], x: &[&[f32]], k: usize) {
        for row in w.iter().chain(x) {
            assert!(row.len() >= k, "tile operand shorter than k");
        }
    }

    /// The AVX2+FMA tile: the order of `tile_portable` with fused multiply-adds. Always inlined
    /// into its callers (`rows_avx2`, or a test compiled for the same features), whose
    /// features its intrinsics then compile with, and where its accumulators stay in
    /// registers across the driver's loops.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA, and the caller must be compiled with them.
    #[inline(always)]
    pub(super) unsafe fn tile_avx2<const R: usize, const C: usize>(
        w: [&[f32]; R],
        x: [&[f32]; C],
        k: usize,
    ) -> [[f32; C]; R] {
        check_operands(&w, &x, k);
        let n = k / LANES;
        let mut lo: [[__m256; C]; R] = [[_mm256_setzero_ps(); C]; R];
        let mut hi: [[__m256; C]; R] = [[_mm256_setzero_ps(); C]; R];
        for i in 0..n {
            let off = i * LANES;
            for (half, acc) in [(0, &mut lo), (8, &mut hi)] {
                // Safety: off + half + 8 <= n * 16 <= k <= every operand's length (checked).
                let wv: [__m256; R] =
                    std::array::from_fn(|r| unsafe { _mm256_loadu_ps(w[r].as_ptr().add(off + half)) });
                for c in 0..C {
                    let xv = unsafe { _mm256_loadu_ps(x[c].as_ptr().add(off + half)) };
                    for r in 0..R {
                        acc[r][c] = _mm256_fmadd_ps(wv[r], xv, acc[r][c]);
                    }
                }
            }
        }
        let mut out = [[0.0f32; C]; R];
        for r in 0..R {
            for c in 0..C {
                // The first fold (lane l plus lane l + 8) is the two halves' sum.
                let mut s8 = [0.0f32; 8];
                // Safety: `s8` holds exactly 8 f32s.
                unsafe { _mm256_storeu_ps(s8.as_mut_ptr(), _mm256_add_ps(lo[r][c], hi[r][c])) };
                out[r][c] = tail::<Fused>(fold8(&s8), w[r], x[c], n * LANES, k);
            }
        }
        out
    }

    /// The AVX-512 tile: the order of `tile_portable` with fused multiply-adds, the lanes of
    /// eight accumulators folded together ([`fold_eight`]). Always inlined, as `tile_avx2`.
    ///
    /// # Safety
    /// The CPU must support AVX-512F and FMA, and the caller must be compiled with them.
    #[inline(always)]
    pub(super) unsafe fn tile_avx512<const R: usize, const C: usize>(
        w: [&[f32]; R],
        x: [&[f32]; C],
        k: usize,
    ) -> [[f32; C]; R] {
        check_operands(&w, &x, k);
        let n = k / LANES;
        let mut acc: [[__m512; C]; R] = [[_mm512_setzero_ps(); C]; R];
        for i in 0..n {
            let off = i * LANES;
            // Safety: off + 16 <= n * 16 <= k <= every operand's length (checked).
            let wv: [__m512; R] = std::array::from_fn(|r| unsafe { _mm512_loadu_ps(w[r].as_ptr().add(off)) });
            for c in 0..C {
                let xv = unsafe { _mm512_loadu_ps(x[c].as_ptr().add(off)) };
                for r in 0..R {
                    acc[r][c] = _mm512_fmadd_ps(wv[r], xv, acc[r][c]);
                }
            }
        }
        let sums = fold_tile(acc);
        let mut out = [[0.0f32; C]; R];
        for r in 0..R {
            for c in 0..C {
                out[r][c] = tail::<Fused>(sums[r][c], w[r], x[c], n * LANES, k);
            }
        }
        out
    }

    /// Each of a tile's accumulators folded as [`fold_lanes`](super::fold_lanes) does, eight
    /// at a time ([`fold_eight`]; zero registers pad the last group).
    #[inline(always)]
    pub(in crate::cpu) unsafe fn fold_tile<const R: usize, const C: usize>(acc: [[__m512; C]; R]) -> [[f32; C]; R] {
        let mut sums = [[0.0f32; C]; R];
        let mut group = [_mm512_setzero_ps(); 8];
        let mut at = 0;
        let total = R * C;
        while at < total {
            for (g, slot) in group.iter_mut().enumerate() {
                let idx = at + g;
                *slot = if idx < total { acc[idx / C][idx % C] } else { _mm512_setzero_ps() };
            }
            let folded = unsafe { fold_eight(group) };
            for (g, &v) in folded.iter().enumerate().take(total - at) {
                sums[(at + g) / C][(at + g) % C] = v;
            }
            at += 8;
        }
        sums
    }

    /// `out[qi * ld + p] = q_qi · k_p` for the `nq` rows of `queries` and the `keys` rows
    /// (at most 16, `k` long each): the bits [`rows_block`](super::rows_block) gives for the
    /// same rows, one query at a time against every key, the 16 accumulators folded together
    /// ([`fold_sixteen`]). For attention, whose dot products are short (a head's 64 or 128
    /// values) and come 16 keys (a KV block) at a time.
    ///
    /// # Safety
    /// The CPU must support AVX-512F and FMA.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) unsafe fn dots_avx512(queries: &[f32], keys: &[f32], k: usize, out: &mut [f32], ld: usize) {
        let nk = keys.len() / k;
        let nq = queries.len() / k;
        assert!(nk <= 16 && nq > 0 && out.len() >= (nq - 1) * ld + nk, "dots: bad shapes");
        assert!(keys.len() == nk * k && queries.len() == nq * k, "dots: bad lengths");
        let n = k / LANES;
        // Sixteen key rows always (a short block padded with zero rows), so that the loop over
        // them unrolls and the accumulators stay in registers.
        let padded;
        let keys16 = if nk == 16 {
            keys
        } else {
            padded = [keys, &vec![0.0f32; (16 - nk) * k]].concat();
            &padded[..]
        };
        for (qi, q) in queries.chunks_exact(k).enumerate() {
            let mut acc = [_mm512_setzero_ps(); 16];
            for i in 0..n {
                // Safety: (i + 1) * 16 <= k, the length of q and of each of the 16 key rows.
                let qv = unsafe { _mm512_loadu_ps(q.as_ptr().add(i * LANES)) };
                for (p, a) in acc.iter_mut().enumerate() {
                    let kv = unsafe { _mm512_loadu_ps(keys16.as_ptr().add(p * k + i * LANES)) };
                    *a = _mm512_fmadd_ps(kv, qv, *a);
                }
            }
            let mut sums = [0.0f32; 16];
            // Safety: `sums` holds exactly 16 f32s.
            unsafe { _mm512_storeu_ps(sums.as_mut_ptr(), fold_sixteen(acc)) };
            let row = &mut out[qi * ld..qi * ld + nk];
            for (p, o) in row.iter_mut().enumerate() {
                *o = tail::<Fused>(sums[p], &keys[p * k..(p + 1) * k], q, n * LANES, k);
            }
        }
    }

    /// Sixteen accumulators folded as [`fold_eight`] folds eight: element `j` of the result is
    /// accumulator `j` folded.
    #[inline(always)]
    unsafe fn fold_sixteen(v: [__m512; 16]) -> __m512 {
        let halves = |a: __m512, b: __m512| {
            _mm512_add_ps(_mm512_shuffle_f32x4::<0b01_00_01_00>(a, b), _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b))
        };
        let p: [__m512; 8] = std::array::from_fn(|i| halves(v[2 * i], v[2 * i + 1]));
        let quarters = |p: __m512, q: __m512| {
            _mm512_add_ps(_mm512_shuffle_f32x4::<0b10_00_10_00>(p, q), _mm512_shuffle_f32x4::<0b11_01_11_01>(p, q))
        };
        let r: [__m512; 4] = std::array::from_fn(|i| quarters(p[2 * i], p[2 * i + 1]));
        // Quarter g of z0 holds accumulators g and 4 + g folded thrice (two lanes each), of z1
        // accumulators 8 + g and 12 + g.
        let thrice = |r: __m512, s: __m512| {
            _mm512_add_ps(_mm512_shuffle_ps::<0b01_00_01_00>(r, s), _mm512_shuffle_ps::<0b11_10_11_10>(r, s))
        };
        let (z0, z1) = (thrice(r[0], r[1]), thrice(r[2], r[3]));
        // Lanes 0 of z0 and z1 beside their lanes 1: quarter g becomes accumulators g, 4 + g,
        // 8 + g, 12 + g.
        let done =
            _mm512_add_ps(_mm512_shuffle_ps::<0b10_00_10_00>(z0, z1), _mm512_shuffle_ps::<0b11_01_11_01>(z0, z1));
        let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        _mm512_permutexvar_ps(order, done)
    }

    /// Eight 16-lane accumulators, each folded as [`fold_lanes`](super::fold_lanes) does (lane
    /// `l` plus `l + 8`, then `+ 4`, `+ 2`, `+ 1`), with shuffles that fold several at once.
    /// Every addition is one of `fold_lanes`'s (commuted at most), so the bits are its bits.
    ///
    /// # Safety
    /// The CPU must support AVX-512F.
    #[inline(always)]
    unsafe fn fold_eight(v: [__m512; 8]) -> [f32; 8] {
        // 1: [a0..a3 | a4..a7 | a8..a11 | a12..a15] (128-bit quarters): a's first two quarters
        // beside b's, plus their last two: [a + a>>8 (8 lanes) | b + b>>8 (8 lanes)].
        let halves = |a: __m512, b: __m512| {
            _mm512_add_ps(_mm512_shuffle_f32x4::<0b01_00_01_00>(a, b), _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b))
        };
        let p = [halves(v[0], v[1]), halves(v[2], v[3]), halves(v[4], v[5]), halves(v[6], v[7])];
        // 2: quarters 0 and 2 of p, q beside quarters 1 and 3: [a4 | b4 | c4 | d4], each the
        // four lanes of one accumulator folded twice.
        let quarters = |p: __m512, q: __m512| {
            _mm512_add_ps(_mm512_shuffle_f32x4::<0b10_00_10_00>(p, q), _mm512_shuffle_f32x4::<0b11_01_11_01>(p, q))
        };
        let (r, s) = (quarters(p[0], p[1]), quarters(p[2], p[3]));
        // 3: in each quarter, elements 0, 1 of r and of s plus elements 2, 3: quarter g holds
        // [acc g folded thrice (2 lanes) | acc 4 + g folded thrice (2 lanes)].
        let z = _mm512_add_ps(_mm512_shuffle_ps::<0b01_00_01_00>(r, s), _mm512_shuffle_ps::<0b11_10_11_10>(r, s));
        // 4: neighbours added: element 0 of quarter g is acc g, element 2 is acc 4 + g.
        let done = _mm512_add_ps(z, _mm512_shuffle_ps::<0b10_11_00_01>(z, z));
        let order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
        let mut out = [0.0f32; 8];
        // Safety: `out` holds exactly 8 f32s.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), _mm512_castps512_ps256(_mm512_permutexvar_ps(order, done))) };
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
            for tokens in [11, 70] {
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
    }

    /// A product in segments is the segments' own products (each `matmul_t` over its columns)
    /// summed pairwise, bit for bit, for one token, a few, and a prefill's many; one segment
    /// is `matmul_t`.
    #[test]
    fn segments_are_their_own_products_summed_as_a_tree() {
        let mut s = 5u64;
        for &(m, k) in &[(13usize, 64usize), (40, 256), (9, 8 * 37)] {
            for tokens in [1, 5, 70] {
                let x: Vec<f32> = (0..tokens * k).map(|_| lcg(&mut s)).collect();
                let w: Vec<f32> = (0..m * k).map(|_| lcg(&mut s)).collect();
                let mut whole = vec![0.0; tokens * m];
                matmul_t(&x, tokens, &w, m, k, &mut whole);
                let mut one = vec![0.0; tokens * m];
                matmul_t_segmented(&x, tokens, &w, m, k, 1, &mut one);
                assert_eq!(one, whole);
                for segments in [2, 4, 8] {
                    let seg = k / segments;
                    let columns = |v: &[f32], rows: usize, g: usize| -> Vec<f32> {
                        (0..rows).flat_map(|r| v[r * k + g * seg..r * k + (g + 1) * seg].to_vec()).collect()
                    };
                    let mut parts: Vec<Vec<f32>> = (0..segments)
                        .map(|g| {
                            let mut out = vec![0.0; tokens * m];
                            matmul_t(&columns(&x, tokens, g), tokens, &columns(&w, m, g), m, seg, &mut out);
                            out
                        })
                        .collect();
                    let mut step = 1;
                    while step < segments {
                        for i in (0..segments).step_by(2 * step) {
                            let right = parts[i + step].clone();
                            parts[i].iter_mut().zip(&right).for_each(|(a, b)| *a += b);
                        }
                        step *= 2;
                    }
                    let mut got = vec![0.0; tokens * m];
                    matmul_t_segmented(&x, tokens, &w, m, k, segments, &mut got);
                    assert!(
                        got.iter().zip(&parts[0]).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "m={m} k={k} tokens={tokens} segments={segments}"
                    );
                }
            }
        }
    }

    /// Every instruction set this CPU has gives the bits of the portable fused order, for
    /// every tile shape the drivers use and lengths with and without a tail.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_tiles_are_bit_identical_to_the_portable_fused_order() {
        let have = isa();
        if have == Isa::Portable {
            return;
        }
        let mut s = 11u64;
        for k in [1usize, 7, 16, 37, 576, 1000] {
            let w: Vec<Vec<f32>> = (0..4).map(|_| (0..k).map(|_| lcg(&mut s)).collect()).collect();
            let x: Vec<Vec<f32>> = (0..6).map(|_| (0..k).map(|_| lcg(&mut s)).collect()).collect();
            let wr: [&[f32]; 4] = std::array::from_fn(|i| &w[i][..]);
            let xr: [&[f32]; 6] = std::array::from_fn(|i| &x[i][..]);
            let want = tile_portable::<Fused, 4, 6>(wr, xr, k);
            // Safety: AVX2 and FMA were detected.
            let avx2 = unsafe { x86::test_tile_avx2(wr, xr, k) };
            assert_eq!(avx2, want, "avx2, k={k}");
            if have == Isa::Avx512 {
                // Safety: AVX-512F was detected.
                let avx512 = unsafe { x86::test_tile_avx512(wr, xr, k) };
                assert_eq!(avx512, want, "avx512, k={k}");
            }
        }
    }

    /// Attention's dot products ([`dots`]) give the driver's bits on every instruction set,
    /// for whole and partial blocks of keys.
    #[test]
    fn dots_are_the_products_bits() {
        let have = isa();
        let mut s = 5u64;
        for k in [64usize, 128, 40] {
            let queries: Vec<f32> = (0..5 * k).map(|_| lcg(&mut s)).collect();
            for nk in [16usize, 7, 20] {
                let keys: Vec<f32> = (0..nk * k).map(|_| lcg(&mut s)).collect();
                let ld = nk + 3;
                let mut want = vec![0.0; 5 * ld];
                run_rows_on(Isa::Portable, &queries, 5, &keys, k, nk, &mut want, ld);
                for isa in [Isa::Avx2, Isa::Avx512]
                    .into_iter()
                    .filter(|&i| i == have || (i == Isa::Avx2 && have == Isa::Avx512))
                {
                    let mut got = vec![0.0; 5 * ld];
                    dots(isa, &queries, &keys, k, &mut got, ld);
                    let mut driver = vec![0.0; 5 * ld];
                    run_rows_on(isa, &queries, 5, &keys, k, nk, &mut driver, ld);
                    assert_eq!(got, driver, "{isa:?}, k {k}, {nk} keys");
                    for (g, w) in got.iter().zip(&want) {
                        assert!((g - w).abs() < 1e-4, "{isa:?}, k {k}: {g} against {w}");
                    }
                }
            }
        }
    }

    /// The drivers of each instruction set give the same bits for every batch size, from one
    /// token (decode) past a 64-token block, and rows that are not whole tiles.
    #[test]
    fn every_instruction_set_gives_the_same_bits_at_every_batch_size() {
        let mut s = 3u64;
        let (m, k) = (23, 96);
        let w: Vec<f32> = (0..m * k).map(|_| lcg(&mut s)).collect();
        let x: Vec<f32> = (0..70 * k).map(|_| lcg(&mut s)).collect();
        let have = isa();
        let isas: Vec<Isa> = [Isa::Avx2, Isa::Avx512]
            .into_iter()
            .filter(|&i| have == Isa::Avx512 || (have == Isa::Avx2 && i == Isa::Avx2))
            .collect();
        for &isa in &isas {
            let mut all = vec![0.0; 70 * m];
            run_rows_on(isa, &x, 70, &w, k, m, &mut all, m);
            for tokens in [1, 2, 5, 6, 7, 13] {
                let mut part = vec![0.0; tokens * m];
                run_rows_on(isa, &x[..tokens * k], tokens, &w, k, m, &mut part, m);
                assert_eq!(&part[..], &all[..tokens * m], "{isa:?}, {tokens} tokens");
            }
            if let Some(&first) = isas.first() {
                let mut other = vec![0.0; 70 * m];
                run_rows_on(first, &x, 70, &w, k, m, &mut other, m);
                assert_eq!(other, all, "{first:?} against {isa:?}");
            }
        }
    }
}
