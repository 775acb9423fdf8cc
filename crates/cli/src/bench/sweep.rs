//! `tandem bench sweep`: push vs pull vs colocated across request rates and prompt lengths.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::bench::plot::{bench_plot, PlotArgs};
use crate::up;

#[derive(Args, Debug, Clone)]
pub struct SweepArgs {
    /// Sent as `Authorization: Bearer KEY` on every request (engines started with --api-key;
    /// with --launch, the engines it starts are given it).
    #[arg(long, env = "TANDEM_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Modes to run: push, pull, colocated.
    #[arg(long, value_delimiter = ',', default_value = "push,pull,colocated")]
    pub modes: Vec<String>,
    /// Request rates (req/s).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub qps: Vec<f64>,
    /// Prompt lengths (one figure panel each).
    #[arg(long, value_delimiter = ',', default_value = "64,128,256,512")]
    pub input_lens: Vec<usize>,
    /// Output length.
    #[arg(long, default_value_t = 32)]
    pub output_len: usize,
    /// Repetitions of each point.
    #[arg(long, default_value_t = 1)]
    pub iterations: usize,
    /// Requests per point.
    #[arg(long, default_value_t = 20)]
    pub num_prompts: usize,
    /// Token ids are drawn below this (keep within the model's vocabulary).
    #[arg(long, default_value_t = 256)]
    pub vocab_size: u32,
    /// Where results go.
    #[arg(long, default_value = "results")]
    pub result_dir: PathBuf,
    /// Start the servers for each mode on this machine (and stop them after).
    #[arg(long)]
    pub launch: bool,
    /// With --launch: the model.
    #[arg(long, default_value = "preset:tiny-qwen3")]
    pub model: String,
    /// With --launch: router (or colocated server) port; prefill +100, decode +200, KV +300/+301.
    #[arg(long, default_value_t = 18000)]
    pub base_port: u16,
    /// With --launch: the prefill engine's device (cpu, cuda:N).
    #[arg(long, default_value = "cpu")]
    pub prefill_device: String,
    /// With --launch: the decode engine's device.
    #[arg(long, default_value = "cpu")]
    pub decode_device: String,
    /// With --launch: the colocated engine's device.
    #[arg(long, default_value = "cpu")]
    pub colocated_device: String,
    /// With --launch: KV cache blocks per engine (engines sharing a GPU each size their cache
    /// from what is free otherwise).
    #[arg(long)]
    pub num_kv_blocks: Option<usize>,
    /// With --launch: one more argument for every engine's `serve`, e.g.
    /// --engine-arg=--kv-transport=cuda-ipc (repeatable).
    #[arg(long = "engine-arg", allow_hyphen_values = true)]
    pub engine_args: Vec<String>,
    /// Without --launch: URL for each mode, e.g. push=http://127.0.0.1:8000 (repeatable).
    #[arg(long = "url", value_parser = parse_mode_url)]
    pub urls: Vec<(String, String)>,
    /// Seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Also draw the figures into the result directory at the end.
    #[arg(long)]
    pub plot: bool,
}

fn parse_mode_url(s: &str) -> Result<(String, String), String> {
    s.split_once('=').map(|(m, u)| (m.to_string(), u.to_string())).ok_or_else(|| format!("`{s}` is not MODE=URL"))
}

pub(crate) fn bench_sweep(a: SweepArgs) -> Result<()> {
    for m in &a.modes {
        if !["push", "pull", "colocated"].contains(&m.as_str()) {
            bail!("unknown mode `{m}` (push, pull, colocated)");
        }
    }
    let cfg = tandem_bench::sweep::SweepConfig {
        qps: a.qps.clone(),
        input_lens: a.input_lens.clone(),
        output_len: a.output_len,
        iterations: a.iterations.max(1),
        num_prompts: a.num_prompts,
        vocab_size: a.vocab_size,
        percentiles: vec![50.0, 90.0, 99.0],
        result_dir: a.result_dir.clone(),
        seed: a.seed,
        api_key: a.api_key.clone(),
    };
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the async runtime")?;
    let total = a.modes.len() * a.qps.len() * a.input_lens.len() * cfg.iterations;
    eprintln!("bench sweep: {total} points ({} modes x {} rates x {} input lengths x {} iterations), {} prompts each, results in {}",
        a.modes.len(), a.qps.len(), a.input_lens.len(), cfg.iterations, cfg.num_prompts, a.result_dir.display());
    for mode in &a.modes {
        let (url, mut procs) = if a.launch {
            eprintln!("... starting {mode} servers ({})", a.model);
            let launch = up::Launch {
                model: &a.model,
                base_port: a.base_port,
                log: "warn",
                prefill_device: &a.prefill_device,
                decode_device: &a.decode_device,
                colocated_device: &a.colocated_device,
                num_kv_blocks: a.num_kv_blocks,
                engine_args: &a.engine_args,
                api_key: a.api_key.as_deref(),
            };
            let (u, p) = up::launch_mode(mode, &launch)?;
            (u, p)
        } else {
            let url = a.urls.iter().find(|(m, _)| m == mode).map(|(_, u)| u.clone());
            (url.with_context(|| format!("no --url {mode}=URL given (or use --launch)"))?, Vec::new())
        };
        let result = rt.block_on(tandem_bench::sweep::run_mode(&cfg, mode, &url, |line| eprintln!("{line}")));
        up::stop_all(&mut procs, std::time::Duration::from_secs(10));
        result.map_err(anyhow::Error::msg)?;
    }
    println!("{}", std::fs::read_to_string(a.result_dir.join("summary.csv")).unwrap_or_default());
    if a.plot {
        bench_plot(PlotArgs {
            results_dir: a.result_dir.clone(),
            metric: vec!["ttft".into(), "tpot".into()],
            out_dir: None,
            turns_only: false,
            link: false,
        })?;
    }
    Ok(())
}
