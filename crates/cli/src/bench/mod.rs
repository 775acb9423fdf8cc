//! `tandem bench`: the load generator and the measurements behind docs/PERFORMANCE.md, one
//! module per benchmark, each owning its arguments.

mod engine;
mod fidelity;
mod kv;
mod link;
mod plot;
mod serve;
pub(crate) mod soak;
pub(crate) mod sweep;

use anyhow::Result;
use clap::Subcommand;

use crate::bench::engine::BenchEngineArgs;
use crate::bench::fidelity::BenchFidelityArgs;
use crate::bench::kv::BenchKvArgs;
use crate::bench::plot::PlotArgs;
use crate::bench::serve::BenchServeArgs;
use crate::bench::soak::SoakArgs;
use crate::bench::sweep::SweepArgs;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Decode and prefill throughput of one engine, against the memory-bandwidth floor
    /// measured in the same run.
    Engine(BenchEngineArgs),
    /// Load-test an OpenAI-compatible server (ours or vLLM's) and report vLLM's serving
    /// metrics (TTFT, TPOT, ITL, E2EL, throughput, goodput).
    Serve(Box<BenchServeArgs>),
    /// The P/D experiment: modes x request rates x input lengths, one vLLM-style JSON per point
    /// plus summary.csv, against given URLs or servers it launches itself (--launch).
    Sweep(Box<SweepArgs>),
    /// Figures from a sweep: the four-panel metric-vs-rate figure and the TTFT breakdown.
    Plot(PlotArgs),
    /// Throughput of a KV transport moving a KV set to another process: tcp against raw
    /// loopback TCP, cuda-ipc against device copies inside one GPU, each measured in the same
    /// run.
    Kv(BenchKvArgs),
    /// The peer process `bench kv` starts (internal).
    #[command(hide = true)]
    KvPeer(BenchKvArgs),
    /// Minutes of load past capacity through router + prefill + decode (each mode), with
    /// client cancellations and engines frozen now and then (SIGSTOP): every answer is checked
    /// against a colocated engine's, and the run fails if one is wrong, one is lost, or a KV
    /// block leaks.
    Soak(SoakArgs),
    /// A model with rounded weights (`--quantization fp8`) against the same model as read: how
    /// often greedy decoding picks the same token, where each prompt first diverges, and how
    /// far the log-probabilities move (CPU).
    Fidelity(BenchFidelityArgs),
}

/// Runs one benchmark.
pub(crate) fn run(c: BenchCommand) -> Result<()> {
    match c {
        BenchCommand::Engine(a) => engine::bench_engine(a),
        BenchCommand::Kv(a) => kv::bench_kv(a),
        BenchCommand::Serve(a) => serve::bench_serve(*a),
        BenchCommand::Sweep(a) => sweep::bench_sweep(*a),
        BenchCommand::Plot(a) => plot::bench_plot(a),
        BenchCommand::KvPeer(a) => kv::bench_kv_peer(a),
        BenchCommand::Soak(a) => soak::bench_soak(a),
        BenchCommand::Fidelity(a) => fidelity::bench_fidelity(a),
    }
}
