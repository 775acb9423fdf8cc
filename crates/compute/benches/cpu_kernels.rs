//! The CPU kernels on a small model's shapes (SmolLM2-135M: hidden 576, intermediate 1536,
//! 9 heads of 64 over 3 kv heads), against the machine's peak the FMA units allow.
//!
//! `cargo bench -p tandem-compute --bench cpu_kernels [-- TOKENS...]` (default 1 and 512).

use std::time::Instant;

use tandem_compute::cpu::{matmul_t, paged_attention, AttnSeq, WeightMemory};
use tandem_compute::{KvCache, KvLayout};

fn lcg(seed: &mut u64) -> f32 {
    *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    ((*seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
}

/// Median of `runs` timings of `f`, in seconds.
fn median(runs: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..runs)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[runs / 2]
}

/// A batch-1 decode step's products alone: every layer's four matrices (30 layers, each its own
/// weights, so they stream from memory) and the output projection, one token, inside the pool
/// as the model runs them. Prints the rate the weights stream at.
fn decode_chain(seed: &mut u64) {
    let layers = 30;
    let shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)];
    // In weight memory, as the model keeps them.
    let mut matrix = |n: usize| {
        WeightMemory::filled(n, |w| {
            for v in w {
                *v = lcg(seed);
            }
        })
    };
    let weights: Vec<WeightMemory<f32>> =
        (0..layers).flat_map(|_| shapes.iter().map(|&(m, k)| matrix(m * k)).collect::<Vec<_>>()).collect();
    let head = matrix(49152 * 576);
    let x: Vec<f32> = (0..1536).map(|_| lcg(seed)).collect();
    let mut out = vec![0.0f32; 49152];
    let bytes = (weights.iter().map(|w| w.len()).sum::<usize>() + head.len()) * 4;
    let s = median(21, || {
        rayon::scope(|_| {
            for (i, w) in weights.iter().enumerate() {
                let (m, k) = shapes[i % 4];
                matmul_t(&x[..k], 1, w, m, k, &mut out[..m]);
            }
            matmul_t(&x[..576], 1, &head, 49152, 576, &mut out);
        })
    });
    println!("decode chain: {:.3} ms for {:.0} MB: {:.1} GB/s", s * 1e3, bytes as f64 / 1e6, bytes as f64 / s / 1e9);
}

fn main() {
    if std::env::args().any(|a| a == "decode-chain") {
        decode_chain(&mut 1);
        return;
    }
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    // Non-numeric arguments name the kernels to run (default: all).
    let only: Vec<String> =
        std::env::args().skip(1).filter(|a| a.parse::<usize>().is_err() && !a.starts_with('-')).collect();
    let wanted = |name: &str| only.is_empty() || only.iter().any(|o| o == name);
    let token_counts = if args.is_empty() { vec![1, 512] } else { args };
    let mut seed = 1u64;
    let shapes =
        [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536), ("lm_head", 49152, 576)];
    println!("{:<10} {:>7} {:>10} {:>10} {:>9}", "product", "tokens", "ms", "GFLOP/s", "GB/s");
    for &tokens in &token_counts {
        for (name, m, k) in shapes.into_iter().filter(|s| wanted(s.0)) {
            let w: Vec<f32> = (0..m * k).map(|_| lcg(&mut seed)).collect();
            let x: Vec<f32> = (0..tokens * k).map(|_| lcg(&mut seed)).collect();
            let mut out = vec![0.0f32; tokens * m];
            let runs = if tokens == 1 { 200 } else { 11 };
            let s = median(runs, || matmul_t(&x, tokens, &w, m, k, &mut out));
            let flops = 2.0 * (m * k * tokens) as f64;
            println!(
                "{name:<10} {tokens:>7} {:>10.3} {:>10.1} {:>9.1}",
                s * 1e3,
                flops / s / 1e9,
                (m * k * 4) as f64 / s / 1e9
            );
        }
        if !wanted("attention") {
            continue;
        }
        // Causal attention of `tokens` queries after nothing (prefill) or after 512 (decode).
        let (heads, kv_heads, hd, bs) = (9, 3, 64, 16);
        let ctx = if tokens == 1 { 512 } else { tokens };
        let layout = KvLayout {
            num_layers: 1,
            num_kv_heads: kv_heads,
            head_dim: hd,
            block_size: bs,
            num_blocks: ctx.div_ceil(bs),
        };
        let mut cache = KvCache::new(layout);
        for p in 0..ctx {
            let kv: Vec<f32> = (0..kv_heads * hd).map(|_| lcg(&mut seed)).collect();
            cache.write_token(0, p / bs, p % bs, &kv, &kv);
        }
        let table: Vec<u32> = (0..ctx.div_ceil(bs) as u32).collect();
        let q: Vec<f32> = (0..tokens * heads * hd).map(|_| lcg(&mut seed)).collect();
        let seq = AttnSeq { query_start: 0, num_queries: tokens, first_pos: ctx - tokens, block_table: &table };
        let mut out = vec![0.0f32; q.len()];
        let runs = if tokens == 1 { 200 } else { 11 };
        let s = median(runs, || paged_attention(&q, heads, &cache, 0, &[seq], 0.125, &mut out));
        let pairs: f64 = (0..tokens).map(|i| (ctx - tokens + i + 1) as f64).sum();
        let flops = 4.0 * pairs * (heads * hd) as f64;
        println!("{:<10} {tokens:>7} {:>10.3} {:>10.1}", "attention", s * 1e3, flops / s / 1e9);
    }
}
