//! CPU kernels over `f32` slices.
//!
//! - [`matmul_t`]: `x · Wᵀ` for HF `Linear` weights (`[out, in]` row-major), threaded with
//!   rayon, SIMD picked at run time (AVX-512, else AVX2+FMA, else portable Rust).
//! - [`matmul_t_quant`]: the same product on a [`QuantMatrix`] (ggml block formats), read as
//!   stored and giving the bits of [`matmul_t`] on its dequantized values.
//! - [`rms_norm`], [`add_inplace`], [`silu_mul`]: the elementwise pieces of a block.
//! - [`RopeTable`] and [`apply_rope`]: rotary embeddings (HF "rotate half" convention).
//! - [`paged_attention`]: causal attention of queries against keys/values read from the
//!   paged [`KvCache`](crate::KvCache).
//! - [`WeightMemory`]: where weights live (transparent huge pages).
//!
//! Every kernel computes each output element with a fixed sequence of operations, whatever
//! the batch size, thread split or instruction set, so results are batch-invariant (see the
//! crate docs) and the same on any x86-64 CPU with FMA.

mod attention;
mod math;
mod matmul;
mod memory;
mod ops;
mod quant;
mod rope;

pub use attention::{paged_attention, AttnSeq};
pub use matmul::{matmul_t, matmul_t_segmented, MAX_SEGMENTS};
pub use memory::{WeightElem, WeightMemory};
pub use ops::{add_inplace, rms_norm, rms_norm_inplace, silu_mul};
pub use quant::{dequantize_into, matmul_t_quant, QuantMatrix, QuantType};
pub use rope::{apply_rope, RopeScaling, RopeTable};

/// Best-of-`repeats` streaming read rate over a buffer of about `bytes`, in bytes/second,
/// using all rayon threads (as a decode step does) and the widest loads the CPU has.
pub(crate) fn measure_read_bandwidth(bytes: usize, repeats: usize) -> f64 {
    use rayon::prelude::*;
    let n = (bytes / 4).max(1 << 16);
    let buf: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
    let mut best = f64::INFINITY;
    let mut sink = 0.0f32;
    for _ in 0..repeats.max(1) {
        let start = std::time::Instant::now();
        let s: f32 = buf.par_chunks(1 << 16).map(sum_stream).sum();
        best = best.min(start.elapsed().as_secs_f64());
        sink += s;
    }
    std::hint::black_box(sink);
    (n * 4) as f64 / best
}

math::isa_dispatch!(fn sum_stream(c: &[f32]) -> f32 => sum_stream_body);

/// A sum in 64 lanes (four 512-bit registers' worth), so that the loop waits on memory, not on
/// its additions.
#[inline(always)]
fn sum_stream_body(c: &[f32]) -> f32 {
    let mut acc = [0.0f32; 64];
    let (chunks, rest) = c.as_chunks::<64>();
    for ch in chunks {
        for l in 0..64 {
            acc[l] += ch[l];
        }
    }
    acc.iter().sum::<f32>() + rest.iter().sum::<f32>()
}
