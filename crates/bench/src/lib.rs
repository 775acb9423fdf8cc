//! Benchmarks for tandem.
//!
//! [`engine::run`] measures one engine in-process: decode tokens/s at several batch sizes and
//! prefill tokens/s, each next to its floor measured in the same run (the weights must be read
//! once per decode step, so step time >= weight bytes / streaming-read bandwidth).
//! [`kv::measure`] measures the TCP KV transport between two processes against raw loopback
//! TCP in the same run. The serving
//! benchmark (`tandem bench serve`, vLLM's metrics) joins this crate later.
#![deny(missing_docs)]

pub mod engine;
pub mod kv;
pub mod metrics;
pub mod plot;
pub mod serve;
pub mod sweep;
