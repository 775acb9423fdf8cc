//! Scalar math written to vectorize: each function is a fixed sequence of IEEE operations
//! (fused where it says `mul_add`), with no branches on values, so a loop over it gives the
//! same bits whether the compiler vectorizes it for AVX-512, for AVX2 or not at all.
//!
//! [`isa_dispatch!`] compiles such a loop once per instruction set and runs the one the CPU
//! has.

use super::matmul::{fold_lanes, LANES};

/// Defines `fn $name(args) -> ret` that runs `$inner(args)` (an `#[inline(always)]` function)
/// compiled for the best instruction set the CPU has: AVX-512, AVX2 with FMA, or the baseline.
macro_rules! isa_dispatch {
    ($(#[$m:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? => $inner:path) => {
        $(#[$m])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                fn avx512($($arg: $ty),*) $(-> $ret)? {
                    $inner($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                #[allow(clippy::too_many_arguments)]
                fn avx2($($arg: $ty),*) $(-> $ret)? {
                    $inner($($arg),*)
                }
                match $crate::cpu::matmul::isa() {
                    // Safety: `isa()` detected every feature the function enables.
                    $crate::cpu::matmul::Isa::Avx512 => return unsafe { avx512($($arg),*) },
                    // Safety: as above.
                    $crate::cpu::matmul::Isa::Avx2 => return unsafe { avx2($($arg),*) },
                    $crate::cpu::matmul::Isa::Portable => {}
                }
            }
            $inner($($arg),*)
        }
    };
}
pub(crate) use isa_dispatch;

/// `e^x` to within about 2 ulp (Cephes' single-precision polynomial after reducing by
/// `ln 2`); 0 below -87 and infinity above 88.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 in two parts, the first with few enough bits that `n · LN2_HI` is exact.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 · 2^23: adding it rounds to an integer (ties to even) held in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let xc = x.clamp(-87.0, 88.0);
    let t = xc * LOG2E + ROUND;
    let n = t - ROUND;
    let r = n.mul_add(-LN2_HI, xc);
    let r = n.mul_add(-LN2_LO, r);
    let mut p = 1.987_569_2e-4f32;
    p = p.mul_add(r, 1.398_199_9e-3);
    p = p.mul_add(r, 8.333_452e-3);
    p = p.mul_add(r, 4.166_579_6e-2);
    p = p.mul_add(r, 1.666_666_5e-1);
    p = p.mul_add(r, 0.5);
    let y = p.mul_add(r * r, r) + 1.0;
    // 2^n from n's bits: t's low bits are n + 2^22.
    let n_int = t.to_bits() as i32 - 0x4B40_0000;
    let e = y * f32::from_bits(((n_int + 127) as u32) << 23);
    let e = if x < -87.0 { 0.0 } else { e };
    let e = if x > 88.0 { f32::INFINITY } else { e };
    if x.is_nan() {
        x
    } else {
        e
    }
}

/// `Σ a[i]` in 16 lanes, folded, then the tail in order.
#[inline(always)]
pub(crate) fn sum(a: &[f32]) -> f32 {
    let (ac, at) = a.as_chunks::<LANES>();
    let mut acc = [0.0f32; LANES];
    for x in ac {
        for l in 0..LANES {
            acc[l] += x[l];
        }
    }
    let mut s = fold_lanes(&acc);
    for x in at {
        s += x;
    }
    s
}

/// The largest of `a` (`-inf` when empty). Exact, so the lane split does not matter.
#[inline(always)]
pub(crate) fn max(a: &[f32]) -> f32 {
    let (ac, at) = a.as_chunks::<LANES>();
    let mut acc = [f32::NEG_INFINITY; LANES];
    for x in ac {
        for l in 0..LANES {
            acc[l] = if x[l] > acc[l] { x[l] } else { acc[l] };
        }
    }
    let mut m = acc.iter().fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    for &x in at {
        m = if x > m { x } else { m };
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp_of_libm_and_saturates() {
        let mut worst = 0u32;
        let mut x = -87.0f32;
        while x < 88.0 {
            let (got, want) = (exp(x), x.exp());
            worst = worst.max(got.to_bits().abs_diff(want.to_bits()));
            x += 0.0137;
        }
        assert!(worst <= 2, "{worst} ulp");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
    }

    isa_dispatch!(fn exp_all(x: &[f32], out: &mut [f32]) => exp_all_body);
    #[inline(always)]
    fn exp_all_body(x: &[f32], out: &mut [f32]) {
        for (o, &v) in out.iter_mut().zip(x) {
            *o = exp(v);
        }
    }

    #[test]
    fn a_vectorized_loop_gives_the_scalar_bits() {
        let x: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 0.2).collect();
        let mut out = vec![0.0; x.len()];
        exp_all(&x, &mut out);
        for (&v, &o) in x.iter().zip(&out) {
            assert_eq!(o.to_bits(), exp(v).to_bits(), "{v}");
        }
        let naive: f64 = x[..77].iter().map(|&v| v as f64).sum();
        assert!((sum(&x[..77]) as f64 - naive).abs() < 1e-3);
        assert_eq!(max(&x[..37]), x[36]);
    }
}
