//! Rotary position embeddings, HF "rotate half" convention: element `i` pairs with
//! `i + head_dim / 2`.

/// Frequency scaling of a RoPE table (HF `rope_type`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    /// Plain `theta^(-2i/d)` frequencies.
    None,
    /// Llama 3's piecewise rescaling of low frequencies.
    Llama3 {
        /// Divisor applied to low frequencies.
        factor: f32,
        /// Wavelengths above `original_max / low_freq_factor` are fully scaled.
        low_freq_factor: f32,
        /// Wavelengths below `original_max / high_freq_factor` are left alone.
        high_freq_factor: f32,
        /// Context length the model was pre-trained with.
        original_max_position_embeddings: f32,
    },
}

/// Precomputed cos/sin for positions `0..max_positions`, `head_dim / 2` of each per position.
#[derive(Clone, Debug)]
pub struct RopeTable {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    /// Builds the table the way HF does it in f32: `inv_freq = 1 / theta^(2i/d)`, then
    /// `angle = pos · inv_freq` rounded to f32, then cos/sin.
    pub fn new(head_dim: usize, theta: f32, scaling: RopeScaling, max_positions: usize) -> Self {
        let half = head_dim / 2;
        let mut inv_freq: Vec<f32> = (0..half).map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32)).collect();
        if let RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings: old,
        } = scaling
        {
            let low_wavelen = old / low_freq_factor;
            let high_wavelen = old / high_freq_factor;
            for f in inv_freq.iter_mut() {
                let wavelen = 2.0 * std::f32::consts::PI / *f;
                let scaled = if wavelen > low_wavelen { *f / factor } else { *f };
                let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
                *f = if medium {
                    let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                    (1.0 - smooth) * scaled / factor + smooth * scaled
                } else {
                    scaled
                };
            }
        }
        let mut cos = Vec::with_capacity(max_positions * half);
        let mut sin = Vec::with_capacity(max_positions * half);
        for p in 0..max_positions {
            for f in &inv_freq {
                let angle = p as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        Self { half, cos, sin }
    }

    /// `cos` table, `[position][head_dim / 2]`.
    pub fn cos(&self) -> &[f32] {
        &self.cos
    }

    /// `sin` table, same shape as [`Self::cos`].
    pub fn sin(&self) -> &[f32] {
        &self.sin
    }

    /// Positions the table covers.
    pub fn max_positions(&self) -> usize {
        self.cos.len() / self.half.max(1)
    }
}

/// Rotates every head of every row of `x` (`rows × num_heads × head_dim`) by its row's
/// position.
///
/// # Panics
/// If a position is outside the table (the engine never schedules past `max_model_len`).
pub fn apply_rope(x: &mut [f32], num_heads: usize, head_dim: usize, positions: &[usize], table: &RopeTable) {
    let half = table.half;
    debug_assert_eq!(half * 2, head_dim);
    for (row, &pos) in x.chunks_exact_mut(num_heads * head_dim).zip(positions) {
        let cos = &table.cos[pos * half..(pos + 1) * half];
        let sin = &table.sin[pos * half..(pos + 1) * half];
        for head in row.chunks_exact_mut(head_dim) {
            let (a, b) = head.split_at_mut(half);
            for i in 0..half {
                let (x1, x2) = (a[i], b[i]);
                a[i] = x1 * cos[i] - x2 * sin[i];
                b[i] = x2 * cos[i] + x1 * sin[i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotation_preserves_norm_and_position_zero_is_identity() {
        let t = RopeTable::new(8, 10_000.0, RopeScaling::None, 16);
        let orig: Vec<f32> = (0..16).map(|i| i as f32 * 0.1 - 0.7).collect();
        let mut x = orig.clone();
        apply_rope(&mut x, 2, 8, &[0], &t);
        assert_eq!(x, orig);
        apply_rope(&mut x, 2, 8, &[5], &t);
        let n0: f32 = orig.iter().map(|v| v * v).sum();
        let n1: f32 = x.iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-4);
    }

    #[test]
    fn llama3_scaling_only_slows_low_frequencies() {
        let plain = RopeTable::new(64, 500_000.0, RopeScaling::None, 2);
        let scaled = RopeTable::new(
            64,
            500_000.0,
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 64.0,
            },
            2,
        );
        // Position 1's angle is the frequency itself: the highest frequency is untouched, the
        // lowest is divided by the factor.
        assert_eq!(plain.sin[32], scaled.sin[32]);
        let lowest = |t: &RopeTable| t.sin[32 + 31].asin();
        assert!((lowest(&plain) / lowest(&scaled) - 8.0).abs() < 1e-3);
    }
}
