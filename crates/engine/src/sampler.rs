//! Picks the next token from a row of logits.

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use tandem_core::SamplingParams;

/// Chooses a token. `banned` ids (end-of-sequence while `min_tokens` is not met) are never
/// chosen. Greedy picks the highest logit, ties to the lowest id; otherwise temperature, then
/// top-k, then top-p, then one draw from `rng` (the request's own stream).
pub fn sample(logits: &mut [f32], params: &SamplingParams, banned: &[u32], rng: &mut ChaCha8Rng) -> u32 {
    for &id in banned {
        if let Some(l) = logits.get_mut(id as usize) {
            *l = f32::NEG_INFINITY;
        }
    }
    if params.is_greedy() {
        return argmax(logits);
    }
    let inv_t = 1.0 / params.temperature;
    // Candidates sorted by logit, descending; ties by id so the order is deterministic.
    let mut cand: Vec<(u32, f32)> =
        logits.iter().enumerate().filter(|(_, l)| l.is_finite()).map(|(i, l)| (i as u32, l * inv_t)).collect();
    if cand.is_empty() {
        return argmax(logits);
    }
    let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if let Some(k) = params.top_k {
        let k = (k as usize).min(cand.len());
        if k < cand.len() {
            cand.select_nth_unstable_by(k - 1, by_logit);
            cand.truncate(k);
        }
    }
    cand.sort_unstable_by(by_logit);
    let max = cand[0].1;
    let mut probs: Vec<f32> = cand.iter().map(|(_, l)| (l - max).exp()).collect();
    let total: f32 = probs.iter().sum();
    for p in probs.iter_mut() {
        *p /= total;
    }
    if params.top_p < 1.0 {
        let mut mass = 0.0;
        let mut keep = probs.len();
        for (i, p) in probs.iter().enumerate() {
            mass += p;
            if mass >= params.top_p {
                keep = i + 1;
                break;
            }
        }
        probs.truncate(keep);
    }
    let total: f32 = probs.iter().sum();
    let mut r = rng.random::<f32>() * total;
    for (i, p) in probs.iter().enumerate() {
        r -= p;
        if r <= 0.0 {
            return cand[i].0;
        }
    }
    cand[probs.len() - 1].0
}

fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in logits.iter().enumerate() {
        if *v > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn params(t: f32, top_k: Option<u32>, top_p: f32) -> SamplingParams {
        SamplingParams { temperature: t, top_k, top_p, ..SamplingParams::greedy(1) }
    }

    #[test]
    fn greedy_ties_to_lowest_id_and_respects_bans() {
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        assert_eq!(sample(&mut [1.0, 3.0, 3.0, 0.0], &params(0.0, None, 1.0), &[], &mut rng), 1);
        assert_eq!(sample(&mut [1.0, 3.0, 3.0, 0.0], &params(0.0, None, 1.0), &[1], &mut rng), 2);
    }

    #[test]
    fn top_k_and_top_p_limit_the_support() {
        let logits = [0.0, 1.0, 2.0, 3.0, 4.0];
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        for _ in 0..200 {
            let t = sample(&mut logits.clone(), &params(1.0, Some(2), 1.0), &[], &mut rng);
            assert!(t == 3 || t == 4);
            // p(4) ~ 0.64, p(3) ~ 0.24: top_p 0.5 keeps only token 4.
            assert_eq!(sample(&mut logits.clone(), &params(1.0, None, 0.5), &[], &mut rng), 4);
        }
    }

    #[test]
    fn same_seed_same_draws() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let draw = |seed| {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            (0..20).map(|_| sample(&mut logits.clone(), &params(1.0, None, 0.9), &[], &mut rng)).collect::<Vec<_>>()
        };
        assert_eq!(draw(5), draw(5));
        assert_ne!(draw(5), draw(6));
    }
}
