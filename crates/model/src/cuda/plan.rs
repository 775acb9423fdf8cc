//! Which kernels a decode step runs, chosen once at load from the device, the model's shape and
//! the tuning, so that a sequence's numbers never depend on anything chosen per step but its
//! own token count.

use tandem_compute::cuda::ops::{self, GemvBuild};
use tandem_compute::cuda::{CudaDevice, CudaTuning};

use super::step::StepCounts;
use crate::config::ModelConfig;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum DecodePlan {
    /// Every step through cuBLAS and separate norm / activation kernels.
    Unfused,
    /// Steps of at most `max_tokens` tokens with no prefill chunk run the fused decode
    /// projections (RMSNorm, SiLU and the residual add folded into hand-written GEMV kernels):
    /// `projections` for qkv, gate/up, down and the head, `o_projection` for o.
    Fused { max_tokens: usize, projections: GemvBuild, o_projection: GemvBuild },
}

impl DecodePlan {
    /// The plan for `cfg` on `dev`: fused unless `fused_decode` is off or the shape does not
    /// fit the fused kernels (8-element loads, 64-column pieces for `fp8` weights, up to 8
    /// input rows in shared memory).
    pub fn choose(dev: &CudaDevice, cfg: &ModelConfig, fused_decode: bool, fp8: bool, tuning: &CudaTuning) -> Self {
        let (h, q_dim, i) = (cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size);
        let align = if fp8 { 64 } else { 8 };
        if !fused_decode || ![h, q_dim, i].iter().all(|d| d.is_multiple_of(align)) {
            return Self::Unfused;
        }
        let max_tokens = ops::gemv_max_tokens(dev, h.max(q_dim).max(i));
        if max_tokens == 0 {
            return Self::Unfused;
        }
        let projections = if tuning.tensor_core_projections { GemvBuild::Mma } else { GemvBuild::Plain };
        // The same build for every token count, so a sequence's o sums do not depend on its batch.
        let o_projection = if projections == GemvBuild::Plain
            && tuning.bulk_o_projection
            && ops::gemv_bulk_supported(dev, q_dim, max_tokens)
        {
            GemvBuild::Bulk
        } else {
            projections
        };
        Self::Fused { max_tokens, projections, o_projection }
    }

    /// The builds (projections, o) if a step of `t` tokens with `counts` takes the fused path.
    pub fn fused_for(&self, t: usize, counts: StepCounts) -> Option<(GemvBuild, GemvBuild)> {
        match *self {
            Self::Fused { max_tokens, projections, o_projection } if counts.work == 0 && t <= max_tokens => {
                Some((projections, o_projection))
            }
            _ => None,
        }
    }
}
