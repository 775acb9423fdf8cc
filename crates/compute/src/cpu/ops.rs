//! Elementwise pieces of a transformer block.

use super::math::{exp, isa_dispatch};

/// `out[r] = (x[r] · rsqrt(mean(x[r]²) + eps)) · weight` for each row of `dim` elements, as HF's
/// `RMSNorm` computes it in f32.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let dim = weight.len();
    for (xr, or) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        let inv = inv_rms(xr, eps);
        for ((o, &v), &w) in or.iter_mut().zip(xr).zip(weight) {
            *o = (v * inv) * w;
        }
    }
}

/// [`rms_norm`] in place, row by row (used for Qwen3's per-head q/k norms).
pub fn rms_norm_inplace(x: &mut [f32], weight: &[f32], eps: f32) {
    let dim = weight.len();
    for xr in x.chunks_exact_mut(dim) {
        let inv = inv_rms(xr, eps);
        for (v, &w) in xr.iter_mut().zip(weight) {
            *v = (*v * inv) * w;
        }
    }
}

fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let mut acc = [0.0f32; 8];
    let (chunks, rest) = x.as_chunks::<8>();
    for c in chunks {
        for l in 0..8 {
            acc[l] += c[l] * c[l];
        }
    }
    let mut ss = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for v in rest {
        ss += v * v;
    }
    1.0 / (ss / x.len() as f32 + eps).sqrt()
}

/// `a += b`.
pub fn add_inplace(a: &mut [f32], b: &[f32]) {
    for (x, y) in a.iter_mut().zip(b) {
        *x += *y;
    }
}

/// For rows laid out `[gate (n) | up (n)]`, writes `silu(gate) · up` (`n` per row) to `out`,
/// rows in parallel.
pub fn silu_mul(gate_up: &[f32], n: usize, out: &mut [f32]) {
    use rayon::prelude::*;
    // About 64 KiB of gate and up a task.
    let rows_per_task = (8192 / n.max(1)).max(1);
    out.par_chunks_mut(rows_per_task * n)
        .zip(gate_up.par_chunks(rows_per_task * 2 * n))
        .for_each(|(o, gu)| silu_mul_rows(gu, n, o));
}

isa_dispatch!(fn silu_mul_rows(gate_up: &[f32], n: usize, out: &mut [f32]) => silu_mul_body);

#[inline(always)]
fn silu_mul_body(gate_up: &[f32], n: usize, out: &mut [f32]) {
    for (gu, o) in gate_up.chunks_exact(2 * n).zip(out.chunks_exact_mut(n)) {
        let (g, u) = gu.split_at(n);
        for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
            *o = (g / (1.0 + exp(-g))) * u;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_unit_rows() {
        let x = [3.0, 4.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0];
        let mut out = [0.0; 8];
        rms_norm(&x, &[1.0, 1.0, 1.0, 2.0], 0.0, &mut out);
        // rms of the first row is 2.5.
        assert!((out[0] - 1.2).abs() < 1e-6 && (out[1] - 1.6).abs() < 1e-6);
        assert!((out[7] - 2.0).abs() < 1e-6);
    }

    #[test]
    fn silu_mul_matches_definition() {
        let gu = [1.0, -2.0, 3.0, 0.5];
        let mut out = [0.0; 2];
        silu_mul(&gu, 2, &mut out);
        let silu = |v: f32| v / (1.0 + (-v).exp());
        assert!((out[0] - silu(1.0) * 3.0).abs() < 1e-6);
        assert!((out[1] - silu(-2.0) * 0.5).abs() < 1e-6);
    }
}
