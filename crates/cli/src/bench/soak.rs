//! `tandem bench soak`: starts a reference engine and, for each mode, prefill + decode +
//! router; loads them past capacity while freezing an engine now and then; fails when an
//! answer is wrong, a request is lost or a KV block leaks (the checks are in
//! `tandem_bench::soak`).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use nix::sys::signal::Signal;

use crate::up::{self, Launch, Role};

#[derive(Args, Debug, Clone)]
pub struct SoakArgs {
    /// Modes to soak, one after the other: push, pull.
    #[arg(long, value_delimiter = ',', default_value = "push,pull")]
    pub modes: Vec<String>,
    /// Seconds of load per mode.
    #[arg(long, default_value_t = 120.0)]
    pub secs: f64,
    /// Requests per second; by default --overload times the capacity measured first.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Load as a multiple of the measured capacity (without --rate).
    #[arg(long, default_value_t = 2.0)]
    pub overload: f64,
    /// Fraction of requests the client abandons after up to 300 ms.
    #[arg(long, default_value_t = 0.15)]
    pub cancel_fraction: f64,
    /// Every this many seconds, freeze the prefill or the decode engine (in turn) with SIGSTOP
    /// for --freeze-secs, then let it go on (0: no freezes).
    #[arg(long, default_value_t = 20.0)]
    pub freeze_every_secs: f64,
    /// How long a freeze lasts (longer than the engines' --kv-liveness-secs 1).
    #[arg(long, default_value_t = 3.0)]
    pub freeze_secs: f64,
    /// A request with no answer after this many seconds counts as lost.
    #[arg(long, default_value_t = 60.0)]
    pub request_timeout_secs: f64,
    /// The model.
    #[arg(long, default_value = "preset:tiny-qwen3")]
    pub model: String,
    /// Router port; prefill +100, decode +200, KV +300/+301, the reference engine +400.
    #[arg(long, default_value_t = 19000)]
    pub base_port: u16,
    /// KV cache blocks per engine (small, so that requests are preempted and recomputed).
    #[arg(long, default_value_t = 512)]
    pub num_kv_blocks: usize,
    /// Token ids are drawn below this.
    #[arg(long, default_value_t = 500)]
    pub vocab_size: u32,
    /// Write the reports as JSON here too.
    #[arg(long)]
    pub json_out: Option<PathBuf>,
    /// Seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Where every engine runs (the reference too): `cpu` or `cuda:N`. Answers are compared
    /// with the reference's bit for bit, so a GPU soak needs --batch-invariant.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Every engine with --batch-invariant (see `tandem serve --help`).
    #[arg(long)]
    pub batch_invariant: bool,
    /// The engines' and router's log filter (their output joins this command's), e.g. `warn`
    /// to see why a request went wrong.
    #[arg(long, default_value = "error")]
    pub engine_log: String,
    /// One more argument for the prefill and decode engines' `serve` (not the reference's),
    /// e.g. --engine-arg=--kv-transport=tcp or --engine-arg=--async-scheduling=off to narrow
    /// down where a wrong answer comes from (repeatable).
    #[arg(long = "engine-arg", allow_hyphen_values = true)]
    pub engine_args: Vec<String>,
}

/// Resident memory of process `pid`, MiB (0 where /proc cannot say).
fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// Freezes the prefill and the decode process in turn (the seed picks which goes first) every
/// `every` for `hold`, until `stop`; returns how many freezes it made. A frozen process is
/// always let go on.
fn freezer(roles: &[Role], every: Duration, hold: Duration, seed: u64, stop: Arc<AtomicBool>) -> usize {
    let engines: Vec<(&'static str, u32)> =
        roles.iter().filter(|r| r.name() != "router").map(|r| (r.name(), r.pid())).collect();
    let mut freezes = 0;
    let mut next = Instant::now() + every;
    while !stop.load(Ordering::SeqCst) {
        if every.is_zero() || Instant::now() < next {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        }
        let turn = seed as usize + freezes;
        let (name, pid) = engines[turn % engines.len()];
        let pid = nix::unistd::Pid::from_raw(pid as i32);
        eprintln!("... freezing the {name} engine for {:.1} s", hold.as_secs_f64());
        let _ = nix::sys::signal::kill(pid, Signal::SIGSTOP);
        std::thread::sleep(hold);
        let _ = nix::sys::signal::kill(pid, Signal::SIGCONT);
        freezes += 1;
        next = Instant::now() + every;
    }
    freezes
}

pub(crate) fn bench_soak(a: SoakArgs) -> Result<()> {
    if a.device != "cpu" && !a.batch_invariant {
        bail!(
            "a soak on {} compares every answer with the reference engine's bit for bit, and on a GPU an \
             answer depends on its batch unless the engines run --batch-invariant: add --batch-invariant",
            a.device
        );
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting the async runtime")?;
    let mut engine_args: Vec<String> = [
        "--kv-liveness-secs",
        "1",
        "--kv-load-failure",
        "recompute",
        "--kv-verify",
        "--max-num-seqs",
        "32",
        "--max-queued-requests",
        "64",
        "--max-queue-secs",
        "15",
    ]
    .map(String::from)
    .to_vec();
    let mut plain = Vec::new();
    if a.batch_invariant {
        engine_args.push("--batch-invariant".into());
        plain.push("--batch-invariant".into());
    }
    engine_args.extend(a.engine_args.iter().cloned());
    fn launch<'a>(a: &'a SoakArgs, base_port: u16, args: &'a [String]) -> Launch<'a> {
        Launch {
            model: &a.model,
            base_port,
            log: &a.engine_log,
            prefill_device: &a.device,
            decode_device: &a.device,
            colocated_device: &a.device,
            num_kv_blocks: Some(a.num_kv_blocks),
            engine_args: args,
            // The soak's clients send no key: its engines take none.
            api_key: None,
            cluster_secret_file: None,
            prefill_netns: None,
            decode_netns: None,
        }
    }
    eprintln!("bench soak: starting the reference engine ({} on {})", a.model, a.device);
    let (ref_url, mut ref_procs) = up::launch_mode("colocated", &launch(&a, a.base_port + 400, &plain))?;
    let prompts = tandem_bench::soak::prompt_pool(56, a.vocab_size, a.seed);
    let pool = rt.block_on(tandem_bench::soak::references(&ref_url, prompts));
    up::stop_all(&mut ref_procs, Duration::from_secs(10));
    let pool = pool.map_err(anyhow::Error::msg)?;
    eprintln!("... {} reference answers", pool.len());

    let mut reports = Vec::new();
    let mut failed = Vec::new();
    for mode in &a.modes {
        if mode != "push" && mode != "pull" {
            bail!("unknown mode `{mode}` (push or pull)");
        }
        eprintln!("bench soak: starting {mode} (prefill, decode, router)");
        let (url, mut procs) = up::launch_mode(mode, &launch(&a, a.base_port, &engine_args))?;
        let engines =
            [format!("http://127.0.0.1:{}", a.base_port + 100), format!("http://127.0.0.1:{}", a.base_port + 200)];
        let rate = match a.rate {
            Some(r) => r,
            None => {
                let c = rt.block_on(tandem_bench::soak::capacity(&url, &pool, 16, Duration::from_secs(5)));
                eprintln!("... capacity {c:.1} req/s; soaking at {:.1}x = {:.1} req/s", a.overload, a.overload * c);
                a.overload * c
            }
        };
        let rss_before: Vec<f64> = procs.iter().map(|r| rss_mib(r.pid())).collect();
        let cfg = tandem_bench::soak::SoakConfig {
            base_url: url.clone(),
            duration: Duration::from_secs_f64(a.secs),
            rate,
            cancel_fraction: a.cancel_fraction,
            request_timeout: Duration::from_secs_f64(a.request_timeout_secs),
            seed: a.seed,
        };
        let stop = Arc::new(AtomicBool::new(false));
        let (every, hold) = (Duration::from_secs_f64(a.freeze_every_secs), Duration::from_secs_f64(a.freeze_secs));
        let report = std::thread::scope(|scope| {
            let (stop2, roles) = (stop.clone(), &procs);
            let freezes = scope.spawn(move || freezer(roles, every, hold, a.seed, stop2));
            let report = rt.block_on(tandem_bench::soak::run(&cfg, &pool, |line| eprintln!("{line}")));
            stop.store(true, Ordering::SeqCst);
            (report, freezes.join().unwrap_or(0))
        });
        let (report, freezes) = report;
        let held = rt.block_on(tandem_bench::soak::blocks_held_when_idle(&engines, Duration::from_secs(30)));
        let rss_growth: Vec<(String, f64)> = procs
            .iter()
            .zip(&rss_before)
            .map(|(r, before)| (r.name().to_string(), rss_mib(r.pid()) - before))
            .collect();
        // Both engines still serve a correct answer after the soak.
        let check =
            rt.block_on(tandem_bench::soak::references(&url, vec![(pool[0].prompt.clone(), pool[0].max_tokens)]));
        let serves = matches!(&check, Ok(p) if p[0].want == pool[0].want);
        let kv_info: Vec<serde_json::Value> =
            engines.iter().map(|e| rt.block_on(tandem_bench::soak::kv_info(e))).collect();
        // Whether the faults injected happened: each engine's transfers as its connector counts them.
        let kv_counts: Vec<serde_json::Map<String, serde_json::Value>> = engines
            .iter()
            .map(|e| {
                let mut counts: serde_json::Map<String, serde_json::Value> =
                    ["transfers_ok", "transfers_failed", "checksum_failures", "expired"]
                        .into_iter()
                        .map(|c| {
                            let name = format!("tandem:kv_connector{{counter=\"{c}\"}}");
                            (c.to_string(), serde_json::json!(rt.block_on(tandem_bench::soak::metric(e, &name))))
                        })
                        .collect();
                // Prompt tokens the engine's prefix cache supplied (decode: not transferred).
                let hits = rt.block_on(tandem_bench::soak::metric(e, "tandem:prefix_cache_hits_total"));
                counts.insert("prefix_hit_tokens".into(), serde_json::json!(hits));
                counts
            })
            .collect();
        up::stop_all(&mut procs, Duration::from_secs(10));
        let leaked: f64 = held.iter().map(|b| if b.is_nan() { 0.0 } else { *b }).sum();
        eprintln!(
            "{mode}: {:.0} req/s for {:.0} s, {freezes} freezes: sent {} completed {} cancelled {} errored {} refused(429/503) {} wrong {} lost {}; blocks held after {:?}; p50/p99 e2e {:.0}/{:.0} ms; RSS growth {}; KV transfers (prefill | decode) {}",
            rate, a.secs, report.sent, report.completed, report.cancelled, report.errored, report.refused,
            report.wrong, report.lost, held, report.p50_e2e_ms, report.p99_e2e_ms,
            rss_growth.iter().map(|(n, g)| format!("{n} {g:+.1} MiB")).collect::<Vec<_>>().join(", "),
            kv_counts
                .iter()
                .map(|c| c.iter().map(|(k, v)| format!("{k} {v}")).collect::<Vec<_>>().join(" "))
                .collect::<Vec<_>>()
                .join(" | ")
        );
        for e in &report.sample_errors {
            eprintln!("    error: {}", e.chars().take(200).collect::<String>());
        }
        for w in &report.sample_wrong {
            eprintln!("    wrong: {w}");
        }
        for l in &report.sample_lost {
            eprintln!("    lost: {l}");
        }
        if report.wrong > 0 || report.lost > 0 || leaked > 0.0 || held.iter().any(|b| b.is_nan()) || !serves {
            failed.push(mode.clone());
        }
        reports.push(serde_json::json!({
            "mode": mode, "rate": rate, "secs": a.secs, "freezes": freezes, "report": report,
            "blocks_held_after": held, "rss_growth_mib": rss_growth, "serves_after": serves,
            "kv_info": kv_info, "kv_counters": kv_counts,
        }));
    }
    let json = serde_json::to_string_pretty(&reports)?;
    println!("{json}");
    if let Some(path) = &a.json_out {
        std::fs::write(path, &json).with_context(|| format!("writing {}", path.display()))?;
    }
    if !failed.is_empty() {
        bail!(
            "soak failed for {}: a wrong answer, a lost request, a leaked block, or an engine that stopped serving",
            failed.join(", ")
        );
    }
    Ok(())
}
