//! `tandem bench sweep`: push vs pull vs colocated across request rates and prompt lengths.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::bench::link;
use crate::bench::plot::{bench_plot, PlotArgs};
use crate::up::{self, Netns};

#[derive(Args, Debug, Clone)]
pub struct SweepArgs {
    /// Sent as `Authorization: Bearer KEY` on every request (engines started with --api-key;
    /// with --launch, the engines it starts are given it).
    #[arg(long, env = "TANDEM_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// With --launch: every process started takes this --cluster-secret-file (its KV side
    /// channels authenticated; see `tandem serve --help`).
    #[arg(long, value_name = "PATH")]
    pub cluster_secret_file: Option<PathBuf>,
    /// The CA (PEM) https:// servers' certificates must chain to (--url servers started with
    /// --tls-cert).
    #[arg(long, value_name = "PATH")]
    pub tls_ca: Option<PathBuf>,
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
    /// With --launch: the log filter of the processes it starts, whose lines come out here
    /// (e.g. `warn,tandem_kv=debug`: each push group's hand-over, sends and landings, with
    /// their times, for scripts/gpu/push_tail.py).
    #[arg(long, default_value = "warn")]
    pub engine_log: String,
    /// With --launch: run the prefill engine in this network namespace, reached at this address
    /// (NAMESPACE=ADDRESS, e.g. tandem-p=10.77.0.1 as scripts/two_hosts.sh makes it): another
    /// host on this machine, its KV crossing a virtual link.
    #[arg(long)]
    pub prefill_netns: Option<Netns>,
    /// With --launch: run the decode engine in this network namespace (as --prefill-netns).
    #[arg(long)]
    pub decode_netns: Option<Netns>,
    /// With --prefill-netns and --decode-netns: run push and pull at each of these link rates
    /// (tc's syntax: 50mbit, 1gbit), every link of both namespaces held to it with a token bucket
    /// (tc tbf; each namespace's sending side, so both ways); colocated runs once. Each rate's
    /// points go to RESULT_DIR/link-RATE/ with its ttft.json (the longest prompt at the lowest
    /// request rate), and --plot draws TTFT against the rate (ttft_by_link.png): where push
    /// stops hiding the transfer. Needs root and tc; the links are freed at the end.
    #[arg(long, value_delimiter = ',')]
    pub link_rates: Vec<String>,
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
        tls_ca: a
            .tls_ca
            .as_ref()
            .map(|p| std::fs::read(p).with_context(|| format!("reading --tls-ca {}", p.display())))
            .transpose()?,
    };
    let namespaces: Vec<&Netns> = a.prefill_netns.iter().chain(a.decode_netns.iter()).collect();
    if !namespaces.is_empty() && !a.launch {
        bail!("--prefill-netns and --decode-netns place the engines --launch starts: add --launch");
    }
    if !a.link_rates.is_empty() && namespaces.len() < 2 {
        bail!("--link-rates holds the link between two namespaces: give --prefill-netns and --decode-netns");
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the async runtime")?;
    let rates: Vec<Option<&str>> =
        if a.link_rates.is_empty() { vec![None] } else { a.link_rates.iter().map(|r| Some(r.as_str())).collect() };
    let disaggregated = a.modes.iter().filter(|m| *m != "colocated").count();
    let points_per_mode = a.qps.len() * a.input_lens.len() * cfg.iterations;
    let total = (disaggregated * rates.len() + a.modes.len() - disaggregated) * points_per_mode;
    eprintln!("bench sweep: {total} points ({} modes x {} rates x {} input lengths x {} iterations{}), {} prompts each, results in {}",
        a.modes.len(), a.qps.len(), a.input_lens.len(), cfg.iterations,
        if a.link_rates.is_empty() { String::new() } else { format!(", push and pull at {} link rates", rates.len()) },
        cfg.num_prompts, a.result_dir.display());
    let outcome = (|| -> Result<()> {
        for mode in &a.modes {
            let (url, mut procs) = if a.launch {
                eprintln!("... starting {mode} servers ({})", a.model);
                let launch = up::Launch {
                    model: &a.model,
                    base_port: a.base_port,
                    log: &a.engine_log,
                    prefill_device: &a.prefill_device,
                    decode_device: &a.decode_device,
                    colocated_device: &a.colocated_device,
                    num_kv_blocks: a.num_kv_blocks,
                    engine_args: &a.engine_args,
                    api_key: a.api_key.as_deref(),
                    cluster_secret_file: a.cluster_secret_file.as_deref(),
                    prefill_netns: a.prefill_netns.as_ref(),
                    decode_netns: a.decode_netns.as_ref(),
                };
                up::launch_mode(mode, &launch)?
            } else {
                let url = a.urls.iter().find(|(m, _)| m == mode).map(|(_, u)| u.clone());
                (url.with_context(|| format!("no --url {mode}=URL given (or use --launch)"))?, Vec::new())
            };
            // Colocated crosses no link: it runs once, and each rate's results take its rows.
            let mode_rates = if mode == "colocated" { &[None][..] } else { &rates[..] };
            let mut result = Ok(Vec::new());
            for (i, rate) in mode_rates.iter().enumerate() {
                let mut cfg = cfg.clone();
                // Each rate its own prompts, past the last rate's seeds: the engines stay up across
                // rates, and decode's prefix cache would hold the last rate's.
                cfg.seed += (i * tandem_bench::sweep::points(&cfg)) as u64;
                if let Some(rate) = rate {
                    link::hold(&namespaces, rate)?;
                    eprintln!("... {mode} with the link held to {rate}");
                    cfg.result_dir = a.result_dir.join(format!("link-{rate}"));
                }
                result = rt.block_on(tandem_bench::sweep::run_mode(&cfg, mode, &url, |line| eprintln!("{line}")));
                if result.is_err() {
                    break;
                }
            }
            up::stop_all(&mut procs, std::time::Duration::from_secs(10));
            result.map_err(anyhow::Error::msg)?;
        }
        Ok(())
    })();
    if !a.link_rates.is_empty() {
        link::release(&namespaces);
    }
    outcome?;
    println!("{}", std::fs::read_to_string(a.result_dir.join("summary.csv")).unwrap_or_default());
    for rate in rates.iter().flatten() {
        let dir = a.result_dir.join(format!("link-{rate}"));
        if a.modes.iter().any(|m| m == "colocated") {
            link::take_colocated(&a.result_dir, &dir)?;
        }
        tandem_bench::sweep::write_link_ttft(&dir, rate).map_err(anyhow::Error::msg)?;
        println!("link {rate}:\n{}", std::fs::read_to_string(dir.join("summary.csv")).unwrap_or_default());
    }
    if a.plot {
        let plot = |dir: &std::path::Path, link: bool| {
            bench_plot(PlotArgs {
                results_dir: dir.to_path_buf(),
                metric: vec!["ttft".into(), "tpot".into()],
                out_dir: None,
                turns_only: false,
                link,
            })
        };
        if a.link_rates.is_empty() {
            plot(&a.result_dir, false)?;
        } else {
            for rate in &a.link_rates {
                plot(&a.result_dir.join(format!("link-{rate}")), false)?;
            }
            plot(&a.result_dir, true)?;
        }
    }
    Ok(())
}
