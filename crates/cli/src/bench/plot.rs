//! `tandem bench plot`: the figures from a sweep's results.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

#[derive(Args, Debug, Clone)]
pub struct PlotArgs {
    /// A sweep's result directory.
    #[arg(long, default_value = "results")]
    pub results_dir: PathBuf,
    /// ttft, tpot, itl or e2el (repeat or comma-separate for several figures).
    #[arg(long, value_delimiter = ',', default_value = "ttft,tpot")]
    pub metric: Vec<String>,
    /// Where the figures go (default: the results directory).
    #[arg(long)]
    pub out_dir: Option<PathBuf>,
    /// Only the multi-turn figure (median TTFT by turn, one line per `bench serve
    /// --dataset-name multi-turn` result file in the directory); no sweep figures.
    #[arg(long)]
    pub turns_only: bool,
    /// Only the link figure: the long prompt's TTFT against the link's rate, push, pull and
    /// colocated, from `bench sweep --link-rates` or `scripts/two_hosts.sh` run with LINK_RATES
    /// (one `link-RATE/ttft.json` per rate in the directory).
    #[arg(long)]
    pub link: bool,
}

pub(crate) fn bench_plot(a: PlotArgs) -> Result<()> {
    let out = a.out_dir.clone().unwrap_or_else(|| a.results_dir.clone());
    if a.link {
        let drawn = tandem_bench::plot::ttft_by_link(&a.results_dir, &out).map_err(anyhow::Error::msg)?;
        let (png, svg) = drawn.with_context(|| format!("no link-RATE/ttft.json under {}", a.results_dir.display()))?;
        println!("{}\n{}", png.display(), svg.display());
        return Ok(());
    }
    // Multi-turn results (bench serve --dataset-name multi-turn) draw their own figure.
    if let Some((png, svg)) = tandem_bench::plot::ttft_by_turn(&a.results_dir, &out).map_err(anyhow::Error::msg)? {
        println!("{}\n{}", png.display(), svg.display());
        if a.turns_only {
            return Ok(());
        }
    }
    for m in &a.metric {
        let metric = tandem_bench::plot::Metric::parse(m).map_err(anyhow::Error::msg)?;
        let (png, svg) = tandem_bench::plot::four_panel(&a.results_dir, metric, &out).map_err(anyhow::Error::msg)?;
        println!("{}\n{}", png.display(), svg.display());
    }
    match tandem_bench::plot::ttft_breakdown(&a.results_dir, &out).map_err(anyhow::Error::msg)? {
        Some((png, svg)) => println!("{}\n{}", png.display(), svg.display()),
        None => eprintln!("no transfer timelines in the results (colocated only): no TTFT breakdown figure"),
    }
    Ok(())
}
