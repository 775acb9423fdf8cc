//! A mixture of experts' routing, grouping, per-expert products and combination (`kernels/moe.cu`):
//! each step's order is fixed by the entries themselves, never by timing or by what else the
//! step holds, and an expert no token chose reads none of its weights. Work in progress: the
//! model does not call these yet.

use cudarc::driver::PushKernelArg;

use super::{cfg, launch_programmatic, RawArg};
use crate::cuda::{CudaDevice, CudaError};

/// Most experts a layer may have (`moe_route` holds 8 logits a lane, `moe_group` a cursor a
/// thread).
pub const MOE_MAX_EXPERTS: usize = 256;
/// Most experts a token may go through (`moe_combine` sorts them in shared memory).
pub const MOE_MAX_TOP_K: usize = 16;

fn check_route(experts: usize, top_k: usize) -> Result<(), CudaError> {
    if experts == 0 || experts > MOE_MAX_EXPERTS || top_k == 0 || top_k > MOE_MAX_TOP_K.min(experts) {
        return Err(CudaError::Unavailable(format!(
            "{top_k} of {experts} experts a token (supported: up to {MOE_MAX_TOP_K} of up to {MOE_MAX_EXPERTS})"
        )));
    }
    Ok(())
}

/// Each of `t` tokens' `top_k` experts from the router's f32 `logits [t, experts]`: softmax,
/// the most probable first (the lower index among equals), into `ids [t, top_k]` (i32) and
/// `weights [t, top_k]` (f32; renormalised to sum to one when `norm_topk_prob`).
///
/// # Safety
/// See the module docs of [`super`]; the buffers hold the shapes named.
pub unsafe fn moe_route(
    dev: &CudaDevice,
    logits: u64,
    (ids, weights): (u64, u64),
    t: usize,
    experts: usize,
    top_k: usize,
    norm_topk_prob: bool,
) -> Result<(), CudaError> {
    check_route(experts, top_k)?;
    if t == 0 {
        return Ok(());
    }
    let blocks = t.div_ceil(8) as u32;
    launch!(
        dev,
        "moe_route",
        cfg((blocks, 1), 256),
        logits,
        ids,
        weights,
        t as i32,
        experts as i32,
        top_k as i32,
        norm_topk_prob as i32
    )
}

/// The `n` routed entries (`ids [n]`, entry `token * top_k + slot`) grouped by expert:
/// `offsets [experts + 1]` (expert e's entries are `order[offsets[e]..offsets[e + 1]]`),
/// `order [n]` (entry indices, each expert's in entry order) and `where_at [n]` (each entry's
/// place in `order`); all i32.
///
/// # Safety
/// See the module docs of [`super`]; the buffers hold the shapes named.
pub unsafe fn moe_group(
    dev: &CudaDevice,
    ids: u64,
    (offsets, order, where_at): (u64, u64, u64),
    n: usize,
    experts: usize,
) -> Result<(), CudaError> {
    check_route(experts, 1)?;
    launch!(dev, "moe_group", cfg((1, 1), 256), ids, offsets, order, where_at, n as i32, experts as i32)
}

/// Where an expert product's input rows come from.
#[derive(Clone, Copy, Debug)]
pub enum MoeRows {
    /// Row `order[p] / top_k` (the entry's token) for grouped place `p`: the layer's input.
    ByToken {
        /// Experts a token goes through (entries a token).
        top_k: usize,
    },
    /// Row `p`: inputs already in grouped order (the SiLU of the gate/up products).
    Grouped,
}

/// `y[p, :] = W[e] · x[row(p), :]` for every grouped place `p` of every expert `e`
/// ([`moe_group`]'s `offsets` and `order`): `w` holds `experts` bf16 matrices `[n, k]` one after
/// another, `x` bf16 rows of `k`, `y [entries, n]` bf16 or f32 (`f32_out`). Each sum runs over
/// the columns in one order whatever the step holds; an expert without entries reads nothing.
///
/// # Safety
/// See the module docs of [`super`]; `x` holds every row `rows` names.
#[allow(clippy::too_many_arguments)]
pub unsafe fn moe_expert_rows(
    dev: &CudaDevice,
    w: u64,
    (n, k): (usize, usize),
    experts: usize,
    (x, rows): (u64, MoeRows),
    (offsets, order): (u64, u64),
    (y, f32_out): (u64, bool),
) -> Result<(), CudaError> {
    check_route(experts, 1)?;
    if !k.is_multiple_of(8) || n == 0 {
        return Err(CudaError::Unavailable(format!("expert products of {n} rows by {k} columns (k % 8 != 0)")));
    }
    let slots = match rows {
        MoeRows::ByToken { top_k } => top_k as i32,
        MoeRows::Grouped => 0,
    };
    let grid = (experts as u32, n.div_ceil(8) as u32);
    launch!(dev, "moe_expert_rows", cfg(grid, 256), w, x, offsets, order, y, n as i32, k as i32, slots, f32_out as i32)
}

/// `out[token, :]` (f32, `hidden` wide) = the token's `top_k` expert outputs (`y [t * top_k,
/// hidden]` f32 in grouped order, entry i at `where_at[i]`) times their `weights`, summed into
/// zeros in ascending expert order (the CPU engine's order).
///
/// # Safety
/// See the module docs of [`super`]; the buffers hold the shapes named.
pub unsafe fn moe_combine(
    dev: &CudaDevice,
    y: u64,
    (where_at, ids, weights): (u64, u64, u64),
    out: u64,
    t: usize,
    top_k: usize,
    hidden: usize,
) -> Result<(), CudaError> {
    check_route(MOE_MAX_EXPERTS, top_k)?;
    if t == 0 {
        return Ok(());
    }
    launch!(dev, "moe_combine", cfg((t as u32, 1), 256), y, where_at, ids, weights, out, top_k as i32, hidden as i32)
}
