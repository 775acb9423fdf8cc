//! A digest of a request's KV that both ends of a direct copy can compute from their own
//! memory, whatever their block sizes, so that `--kv-verify` checks copies that never pass
//! through a socket (the local and cuda-ipc transports) as it checks tcp's bytes.
//!
//! The digest of tokens `0..num_tokens` held in a list of blocks is the wrapping sum, over
//! every element, of `mix(index * GOLDEN ^ bits)`: `index` is the element's position in the
//! canonical order (block row `p` = (layer, K|V, KV head) as in [`KvLayout`], then token, then
//! element: `(p * num_tokens + t) * head_dim + e`), `bits` its bit pattern (an `f32`'s 32 bits, a
//! bf16's 16, an e4m3's 8), and `mix` the SplitMix64 finaliser. A sum commutes, so the GPU adds its terms
//! in any order (`kv_digest` in `kernels/elementwise.cu` defines the same digest); the index
//! in every term makes KV that lands in the wrong slot count as much as a flipped bit.

use crate::{KvDtype, KvLayout, KvRegion};

/// Multiplier spreading consecutive indices over the whole word (2^64 / the golden ratio).
pub(crate) const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's finaliser: every input bit moves every output bit.
pub(crate) fn mix(mut z: u64) -> u64 {
    z ^= z >> 30;
    z = z.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z ^= z >> 27;
    z = z.wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// One element's term of the digest.
fn term(index: u64, bits: u64) -> u64 {
    mix(index.wrapping_mul(GOLDEN) ^ bits)
}

/// The digest of tokens `0..num_tokens` of `region`, held in `blocks` (in token order).
///
/// # Safety
/// No thread writes these blocks meanwhile (the caller holds them for a transfer).
///
/// # Errors
/// If `blocks` do not cover the tokens or name a block outside the region.
pub unsafe fn kv_digest_host(region: &KvRegion, blocks: &[u32], num_tokens: usize) -> Result<u64, String> {
    let layout = *region.layout();
    let blocks = check_blocks(&layout, blocks, num_tokens)?;
    let (bs, dim) = (layout.block_size, layout.head_dim);
    let planes = layout.num_layers * 2 * layout.num_kv_heads;
    let elem = region.dtype().bytes();
    let mut sum = 0u64;
    for (i, &b) in blocks.iter().enumerate() {
        // Safety: passed on from the caller; `check_blocks` kept `b` inside the region.
        let bytes = unsafe { region.bytes(b as usize, 1) };
        let tokens = (i * bs)..(num_tokens.min((i + 1) * bs));
        for p in 0..planes {
            for t in tokens.clone() {
                let row = &bytes[((p * bs + t % bs) * dim) * elem..][..dim * elem];
                let first = ((p * num_tokens + t) * dim) as u64;
                for (e, x) in row.chunks_exact(elem).enumerate() {
                    let bits = match region.dtype() {
                        KvDtype::F32 => u32::from_le_bytes([x[0], x[1], x[2], x[3]]) as u64,
                        KvDtype::Bf16 => u16::from_le_bytes([x[0], x[1]]) as u64,
                        KvDtype::Fp8E4m3 => x[0] as u64,
                    };
                    sum = sum.wrapping_add(term(first + e as u64, bits));
                }
            }
        }
    }
    Ok(sum)
}

/// The blocks holding `num_tokens` tokens, each inside the cache.
pub(crate) fn check_blocks<'a>(layout: &KvLayout, blocks: &'a [u32], num_tokens: usize) -> Result<&'a [u32], String> {
    let needed = layout.blocks_for(num_tokens);
    let Some(blocks) = blocks.get(..needed) else {
        return Err(format!("{} blocks cannot hold {num_tokens} tokens", blocks.len()));
    };
    match blocks.iter().find(|&&b| b as usize >= layout.num_blocks) {
        Some(b) => Err(format!("block {b} is outside the cache's {} blocks", layout.num_blocks)),
        None => Ok(blocks),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::KvCache;

    fn layout(bs: usize) -> KvLayout {
        KvLayout { num_layers: 2, num_kv_heads: 2, head_dim: 4, block_size: bs, num_blocks: 16 }
    }

    /// A cache of block size `bs` holding token `t`'s KV (a function of its position alone)
    /// in the blocks `table` names.
    fn filled(bs: usize, table: &[u32], tokens: usize) -> KvCache {
        let mut cache = KvCache::new(layout(bs));
        for t in 0..tokens {
            for l in 0..2 {
                let k: Vec<f32> = (0..8).map(|i| (t * 100 + l * 10 + i) as f32 * 0.5).collect();
                let v: Vec<f32> = k.iter().map(|x| -x).collect();
                cache.write_token(l, table[t / bs] as usize, t % bs, &k, &v);
            }
        }
        cache
    }

    #[test]
    fn the_digest_follows_the_kv_not_the_block_size_or_block_ids() {
        let a = filled(4, &[9, 2, 5, 7], 13);
        let b = filled(8, &[3, 11], 13);
        // Safety: the caches are this test's alone.
        let (da, db) = unsafe {
            (
                kv_digest_host(&a.region(), &[9, 2, 5, 7], 13).unwrap(),
                kv_digest_host(&b.region(), &[3, 11], 13).unwrap(),
            )
        };
        assert_eq!(da, db);
        // Fewer tokens, one element changed, or two tokens swapped: another digest.
        let fewer = unsafe { kv_digest_host(&a.region(), &[9, 2, 5, 7], 12).unwrap() };
        assert_ne!(fewer, da);
        let mut c = filled(4, &[9, 2, 5, 7], 13);
        let k: Vec<f32> = (0..8).map(|i| if i == 5 { 1e-3 } else { (600 + 10 + i) as f32 * 0.5 }).collect();
        let v: Vec<f32> = (0..8).map(|i| -((600 + 10 + i) as f32 * 0.5)).collect();
        c.write_token(1, 5, 2, &k, &v); // token 6, layer 1
        assert_ne!(unsafe { kv_digest_host(&c.region(), &[9, 2, 5, 7], 13).unwrap() }, da);
        let swapped = filled(4, &[9, 2, 5, 7], 13);
        let row = |t: usize| -> Vec<f32> { (0..8).map(|i| (t * 100 + i) as f32 * 0.5).collect() };
        let mut s = swapped;
        s.write_token(0, 9, 0, &row(1), &row(1).iter().map(|x| -x).collect::<Vec<_>>());
        s.write_token(0, 9, 1, &row(0), &row(0).iter().map(|x| -x).collect::<Vec<_>>());
        assert_ne!(unsafe { kv_digest_host(&s.region(), &[9, 2, 5, 7], 13).unwrap() }, da);
    }

    #[test]
    fn blocks_that_do_not_hold_the_tokens_are_refused() {
        let a = filled(4, &[0, 1], 8);
        let r = a.region();
        // Safety: the cache is this test's alone.
        let e = unsafe { kv_digest_host(&r, &[0, 1], 9) }.unwrap_err();
        assert!(e.contains("cannot hold 9 tokens"), "{e}");
        let e = unsafe { kv_digest_host(&r, &[0, 16], 8) }.unwrap_err();
        assert!(e.contains("block 16 is outside"), "{e}");
    }
}
