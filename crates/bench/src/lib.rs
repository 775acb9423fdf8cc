//! Benchmarks for tandem.
//!
//! [`engine::run`] measures one engine in-process: decode tokens/s at several batch sizes and
//! prefill tokens/s, each next to its floor measured in the same run (the weights must be read
//! once per decode step, so step time >= weight bytes / streaming-read bandwidth).
//! [`kv::measure`] measures the TCP KV transport between two processes against raw loopback
//! TCP in the same run. [`serve`] and [`sweep`] are the serving benchmark (vLLM's metrics);
//! [`soak`] checks a disaggregated system under overload and faults (nothing lost, nothing
//! wrong, no block leaked).
#![deny(missing_docs)]

pub mod engine;
pub mod fidelity;
pub mod kv;
#[cfg(feature = "nixl")]
pub mod kv_nixl;
pub mod metrics;
pub mod plot;
pub mod serve;
pub mod soak;
pub mod sweep;
