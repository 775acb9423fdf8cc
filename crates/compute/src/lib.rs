//! Compute for tandem: the math kernels a transformer forward needs, and the paged KV cache
//! storage they read and write.
//!
//! # Brief overview
//! [`KvCache`] is one allocation per engine laid out block-major (see [`KvLayout`]): block `b`
//! is one contiguous range holding, for every layer, that block's keys and values. A run of
//! consecutive blocks is therefore one contiguous region, which is what lets the KV connector
//! move a request's cache in a few large transfers.
//!
//! The kernels in [`cpu`] work on `f32` slices. Every kernel is **batch-invariant**: the value
//! computed for one token does not depend on which other tokens share the batch, how a prompt
//! was chunked, or how the work was split across threads. That is what makes colocated,
//! chunked and (later) disaggregated runs agree bit for bit on CPU, and it is a property the
//! tests check, not an accident: each output element is produced by one fixed sequence of
//! floating-point operations.
//!
//! This crate does not know about requests, schedulers or models; it sees shapes and slices.
//! [`cuda`] is the GPU backend (bf16 storage, cuBLAS, kernels compiled with NVRTC); it keeps
//! the same block-major KV layout.
//!
//! Sibling crates: `tandem-core` (ids, sampling params), `tandem-model` (transformer forward
//! built on these kernels), `tandem-engine` (scheduling and the block pool).
#![deny(missing_docs)]

pub mod cpu;
pub mod cuda;
pub mod fp8;
mod kv_cache;
pub mod kv_copy;
pub mod kv_digest;

pub use kv_cache::{coalesce, BlockRun, KvCache, KvDtype, KvLayout, KvRegion};

/// Reads memory as fast as this machine streams it, over `bytes` of data, and returns the rate
/// in bytes per second. This is the floor decode on CPU is measured against: a decode step
/// must at least read every weight once.
pub fn measure_read_bandwidth(bytes: usize, repeats: usize) -> f64 {
    cpu::measure_read_bandwidth(bytes, repeats)
}
