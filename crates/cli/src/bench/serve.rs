//! `tandem bench serve`: vLLM's serving benchmark against a running server.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

#[derive(Args, Debug, Clone)]
pub struct BenchServeArgs {
    /// Server base URL.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub base_url: String,
    /// Sent as `Authorization: Bearer KEY` (a server started with --api-key).
    #[arg(long, env = "TANDEM_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// The CA (PEM) an https:// server's certificate must chain to (a server started with
    /// --tls-cert).
    #[arg(long, value_name = "PATH")]
    pub tls_ca: Option<PathBuf>,
    /// API path.
    #[arg(long, default_value = "/v1/completions")]
    pub endpoint: String,
    /// Model name (default: the first one /v1/models lists).
    #[arg(long)]
    pub model: Option<String>,
    /// Label stored as `backend` in the result.
    #[arg(long, default_value = "tandem")]
    pub backend: String,
    /// Where prompts come from.
    #[arg(long, value_enum, default_value = "random")]
    pub dataset_name: DatasetName,
    /// ShareGPT JSON file.
    #[arg(long)]
    pub dataset_path: Option<PathBuf>,
    /// Random dataset: prompt tokens.
    #[arg(long, default_value_t = 1024)]
    pub random_input_len: usize,
    /// Random dataset: output tokens (also the ShareGPT output length when given).
    #[arg(long, default_value_t = 128)]
    pub random_output_len: usize,
    /// Random dataset: lengths drawn from [len*(1-r), len*(1+r)].
    #[arg(long, default_value_t = 0.0)]
    pub random_range_ratio: f64,
    /// Random dataset: token ids are drawn below this (keep it within the model's vocabulary).
    #[arg(long, default_value_t = 256)]
    pub random_vocab_size: u32,
    /// Random dataset: send prompts as text (random words) instead of token ids.
    #[arg(long)]
    pub random_prompt_text: bool,
    /// Multi-turn dataset: tokens of the system prompt every conversation shares.
    #[arg(long, default_value_t = 4096)]
    pub multi_turn_shared_len: usize,
    /// Multi-turn dataset: each conversation opens with its own --multi-turn-shared-len tokens
    /// instead of one system prompt they all share (so only a conversation's own history
    /// repeats between its turns).
    #[arg(long)]
    pub multi_turn_distinct_openings: bool,
    /// Multi-turn dataset: new user tokens per turn.
    #[arg(long, default_value_t = 128)]
    pub multi_turn_user_len: usize,
    /// Multi-turn dataset: turns per conversation.
    #[arg(long, default_value_t = 4)]
    pub multi_turn_turns: usize,
    /// Requests to send.
    #[arg(long, default_value_t = 1000)]
    pub num_prompts: usize,
    /// Requests per second; `inf` sends all at once.
    #[arg(long, default_value = "inf")]
    pub request_rate: f64,
    /// Gamma shape of arrival gaps: 1 is Poisson, lower is burstier.
    #[arg(long, default_value_t = 1.0)]
    pub burstiness: f64,
    /// Seed for prompts and arrivals.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Most requests in flight.
    #[arg(long)]
    pub max_concurrency: Option<usize>,
    /// Unmeasured requests first.
    #[arg(long, default_value_t = 0)]
    pub num_warmups: usize,
    /// Do not ask the server to ignore end-of-sequence tokens (on by default, as vLLM's random
    /// dataset does, so outputs have the requested length).
    #[arg(long)]
    pub no_ignore_eos: bool,
    /// Percentiles to report, e.g. 50,90,99.
    #[arg(long, alias = "metric-percentiles", value_delimiter = ',', default_value = "99")]
    pub percentiles: Vec<f64>,
    /// SLOs for goodput, e.g. `--goodput ttft:500 tpot:50`.
    #[arg(long, num_args = 1..)]
    pub goodput: Vec<String>,
    /// Write the result JSON.
    #[arg(long)]
    pub save_result: bool,
    /// Add per-request arrays (input_lens, output_lens, ttfts, itls, errors) to the JSON.
    #[arg(long)]
    pub save_detailed: bool,
    /// Directory for the result JSON.
    #[arg(long, default_value = ".")]
    pub result_dir: PathBuf,
    /// File name for the result JSON (default: BACKEND-RATEqps-MODEL-DATE.json).
    #[arg(long)]
    pub result_filename: Option<String>,
    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,
}

/// Datasets for `bench serve`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum DatasetName {
    /// Random prompts of fixed length (see --random-*).
    Random,
    /// A local ShareGPT-format JSON file (--dataset-path).
    Sharegpt,
    /// ShareGPT conversations, turn by turn through the chat endpoint, each turn resending the
    /// conversation with the server's answers (--dataset-path; --multi-turn-turns at most).
    SharegptMultiTurn,
    /// Synthetic conversations sharing one system prompt, each turn resending the history
    /// (see --multi-turn-*; --num-prompts counts conversations; --random-output-len and
    /// --random-vocab-size apply).
    MultiTurn,
}

pub(crate) fn bench_serve(a: BenchServeArgs) -> Result<()> {
    use tandem_bench::serve::{Dataset, ServeConfig};
    let dataset = match a.dataset_name {
        DatasetName::Random => Dataset::Random {
            input_len: a.random_input_len,
            output_len: a.random_output_len,
            range_ratio: a.random_range_ratio,
            vocab_size: a.random_vocab_size,
            as_text: a.random_prompt_text,
        },
        DatasetName::Sharegpt => Dataset::ShareGpt {
            path: a.dataset_path.clone().context("--dataset-name sharegpt needs --dataset-path")?,
            output_len: None,
        },
        DatasetName::SharegptMultiTurn => Dataset::ShareGptMultiTurn {
            path: a.dataset_path.clone().context("--dataset-name sharegpt-multi-turn needs --dataset-path")?,
            turns: a.multi_turn_turns,
            output_len: None,
        },
        DatasetName::MultiTurn => Dataset::MultiTurn {
            shared_len: a.multi_turn_shared_len,
            distinct_openings: a.multi_turn_distinct_openings,
            turn_len: a.multi_turn_user_len,
            turns: a.multi_turn_turns,
            output_len: a.random_output_len,
            vocab_size: a.random_vocab_size,
        },
    };
    let slo = if a.goodput.is_empty() {
        None
    } else {
        Some(tandem_bench::metrics::Slo::parse(&a.goodput).map_err(anyhow::Error::msg)?)
    };
    let cfg = ServeConfig {
        base_url: a.base_url.clone(),
        endpoint: a.endpoint.clone(),
        model: a.model.clone(),
        backend: a.backend.clone(),
        dataset,
        num_prompts: a.num_prompts,
        request_rate: a.request_rate,
        burstiness: a.burstiness,
        seed: a.seed,
        max_concurrency: a.max_concurrency,
        num_warmups: a.num_warmups,
        ignore_eos: !a.no_ignore_eos,
        percentiles: a.percentiles.clone(),
        slo,
        progress: !a.no_progress,
        api_key: a.api_key.clone(),
        tls_ca: a
            .tls_ca
            .as_ref()
            .map(|p| std::fs::read(p).with_context(|| format!("reading --tls-ca {}", p.display())))
            .transpose()?,
    };
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the async runtime")?;
    eprintln!(
        "bench serve: {} prompts to {}{} at {} req/s",
        cfg.num_prompts, cfg.base_url, cfg.endpoint, cfg.request_rate
    );
    let run = rt.block_on(tandem_bench::serve::run(&cfg)).map_err(anyhow::Error::msg)?;
    print!("{}", run.summary.table(&cfg.percentiles));
    if !run.turns.is_empty() {
        let by_turn: Vec<String> = run.median_ttft_ms_by_turn().iter().map(|t| format!("{t:.1}")).collect();
        println!("Median TTFT by turn (ms):                {}", by_turn.join(" / "));
    }
    let failed: Vec<&String> = run.outcomes.iter().filter(|o| !o.success).map(|o| &o.error).collect();
    if let Some(first) = failed.first() {
        eprintln!("{} requests failed; first error: {first}", failed.len());
    }
    if a.save_result || a.save_detailed {
        let json = run.result_json(&cfg, a.save_detailed);
        let name = a.result_filename.clone().unwrap_or_else(|| {
            let rate = if cfg.request_rate.is_infinite() { "inf".to_string() } else { cfg.request_rate.to_string() };
            let model = run.model.rsplit('/').next().unwrap_or(&run.model).replace(':', "-");
            format!("{}-{rate}qps-{model}-{}.json", cfg.backend, tandem_bench::serve::utc_stamp())
        });
        std::fs::create_dir_all(&a.result_dir).with_context(|| format!("creating {}", a.result_dir.display()))?;
        let path = a.result_dir.join(name);
        std::fs::write(&path, serde_json::to_string_pretty(&json)?)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("result written to {}", path.display());
    }
    Ok(())
}
