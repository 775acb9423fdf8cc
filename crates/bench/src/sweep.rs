//! `tandem bench sweep`: the experiment users judge P/D systems by: TTFT and TPOT for each
//! mode (push, pull, and colocated as a baseline) across request rate x input length, with a
//! fixed output length, repeated. One vLLM-style JSON per point, named
//! `<mode>_qps<q>_in<in>_out<out>_iter<i>.json`, and a CSV summary of all points.
//!
//! This module runs the points against URLs it is given; starting and stopping the servers for
//! each mode (`--launch`) is the binary's job.

use std::path::{Path, PathBuf};

use crate::serve::{run, Dataset, ServeConfig};

/// The grid.
#[derive(Clone, Debug)]
pub struct SweepConfig {
    /// Request rates (req/s).
    pub qps: Vec<f64>,
    /// Prompt lengths.
    pub input_lens: Vec<usize>,
    /// Output length.
    pub output_len: usize,
    /// Repetitions of each point.
    pub iterations: usize,
    /// Requests per point.
    pub num_prompts: usize,
    /// Token ids are drawn below this.
    pub vocab_size: u32,
    /// Percentiles reported.
    pub percentiles: Vec<f64>,
    /// Where results go.
    pub result_dir: PathBuf,
    /// The first point's seed (see [`point_seed`]).
    pub seed: u64,
    /// Sent as `Authorization: Bearer` on every request.
    pub api_key: Option<String>,
    /// The CA (PEM) `https://` servers' certificates must chain to.
    pub tls_ca: Option<Vec<u8>>,
}

/// The seed of one point's prompts: a different one for every (input length, rate, iteration)
/// of the grid, and the same for every mode. A mode's engines stay up across its points, so a
/// point sending an earlier point's prompts would find their KV in the prefix cache and measure
/// no prefill; every mode sends the same prompts, so push, pull and colocated are compared on
/// the same work. Seeds run from `cfg.seed` to `cfg.seed + points(cfg) - 1`.
pub fn point_seed(cfg: &SweepConfig, input_index: usize, qps_index: usize, iter: usize) -> u64 {
    let point = (input_index * cfg.qps.len() + qps_index) * cfg.iterations + iter;
    cfg.seed + point as u64
}

/// The points of the grid: one prompt set each.
pub fn points(cfg: &SweepConfig) -> usize {
    cfg.input_lens.len() * cfg.qps.len() * cfg.iterations
}

/// One point's file name (the sweep's naming contract; `bench plot` reads it back).
pub fn point_file(mode: &str, qps: f64, input_len: usize, output_len: usize, iter: usize) -> String {
    format!("{mode}_qps{}_in{input_len}_out{output_len}_iter{iter}.json", fmt_qps(qps))
}

fn fmt_qps(q: f64) -> String {
    if q.is_infinite() {
        "inf".into()
    } else if q.fract() == 0.0 {
        format!("{}", q as i64)
    } else {
        format!("{q}")
    }
}

/// The CSV header of `summary.csv`.
pub const CSV_HEADER: &str = "mode,qps,input_len,output_len,iter,completed,failed,mean_ttft_ms,median_ttft_ms,p99_ttft_ms,mean_tpot_ms,median_tpot_ms,p99_tpot_ms,mean_itl_ms,mean_e2el_ms,output_throughput,median_kv_transfer_ms,median_produced_to_ready_ms,median_handover_backlog_ms";

/// Disaggregated points, in ms, from the decode engine's per-request timelines (`None` where no
/// request carries them): the median KV transfer (first byte to last, or a direct write's
/// copies), the median from prefill handing the KV over to decode applying it (push, one host),
/// and of that the median time prefill's writer was still sending earlier steps' KV.
fn kv_medians(outcomes: &[crate::metrics::RequestOutcome]) -> KvMedians {
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        (!v.is_empty()).then(|| crate::metrics::percentile(&v, 50.0))
    };
    let timelines = || outcomes.iter().filter_map(|o| o.kv_timeline.as_ref());
    let ms = |v: &serde_json::Value| v.as_f64().map(|us| us / 1000.0);
    let transfer = timelines()
        .filter_map(|t| Some(ms(&t["transfer"]["data_end_us"])? - ms(&t["transfer"]["data_start_us"])?))
        .collect();
    let handover: Vec<f64> = timelines().filter_map(|t| ms(&t["produced_to_ready_us"])).collect();
    // Only where the hand-over was timed (push): a pull's timeline carries a 0.
    let backlog = match handover.is_empty() {
        true => Vec::new(),
        false => timelines().filter_map(|t| ms(&t["transfer"]["handover_backlog_us"])).collect(),
    };
    KvMedians { transfer: median(transfer), handover: median(handover), backlog: median(backlog) }
}

/// [`kv_medians`]'s three.
struct KvMedians {
    transfer: Option<f64>,
    handover: Option<f64>,
    backlog: Option<f64>,
}

/// Runs every point of the grid for one mode against `base_url`, writing each result, and
/// appends the points' rows to `<result_dir>/summary.csv`. `progress` gets one line per point.
pub async fn run_mode(
    cfg: &SweepConfig,
    mode: &str,
    base_url: &str,
    mut progress: impl FnMut(&str),
) -> Result<Vec<PathBuf>, String> {
    std::fs::create_dir_all(&cfg.result_dir).map_err(|e| format!("{}: {e}", cfg.result_dir.display()))?;
    let csv = cfg.result_dir.join("summary.csv");
    if !csv.exists() {
        std::fs::write(&csv, format!("{CSV_HEADER}\n")).map_err(|e| format!("{}: {e}", csv.display()))?;
    }
    let mut written = Vec::new();
    for (input_index, &input_len) in cfg.input_lens.iter().enumerate() {
        for (qps_index, &qps) in cfg.qps.iter().enumerate() {
            for iter in 0..cfg.iterations {
                let sc = ServeConfig {
                    base_url: base_url.to_string(),
                    endpoint: "/v1/completions".into(),
                    model: None,
                    backend: mode.to_string(),
                    dataset: Dataset::Random {
                        input_len,
                        output_len: cfg.output_len,
                        range_ratio: 0.0,
                        vocab_size: cfg.vocab_size,
                        as_text: false,
                    },
                    num_prompts: cfg.num_prompts,
                    request_rate: qps,
                    burstiness: 1.0,
                    seed: point_seed(cfg, input_index, qps_index, iter),
                    max_concurrency: None,
                    num_warmups: 1,
                    ignore_eos: true,
                    percentiles: cfg.percentiles.clone(),
                    slo: None,
                    progress: false,
                    api_key: cfg.api_key.clone(),
                    tls_ca: cfg.tls_ca.clone(),
                };
                let r = run(&sc).await?;
                let path = cfg.result_dir.join(point_file(mode, qps, input_len, cfg.output_len, iter));
                let json = serde_json::to_string_pretty(&r.result_json(&sc, true)).map_err(|e| e.to_string())?;
                std::fs::write(&path, json).map_err(|e| format!("{}: {e}", path.display()))?;
                let s = &r.summary;
                let p = |stat: &crate::metrics::Stat| {
                    stat.percentiles.iter().find(|(q, _)| *q == 99.0).map(|x| x.1).unwrap_or(0.0)
                };
                let KvMedians { transfer: kv_transfer, handover, backlog } = kv_medians(&r.outcomes);
                let opt = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v:.3}"));
                let row = format!(
                    "{mode},{},{input_len},{},{iter},{},{},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3},{},{},{}\n",
                    fmt_qps(qps),
                    cfg.output_len,
                    s.completed,
                    s.failed,
                    s.ttft.mean,
                    s.ttft.median,
                    p(&s.ttft),
                    s.tpot.mean,
                    s.tpot.median,
                    p(&s.tpot),
                    s.itl.mean,
                    s.e2el.mean,
                    s.output_throughput,
                    opt(kv_transfer),
                    opt(handover),
                    opt(backlog)
                );
                append(&csv, &row)?;
                progress(&format!(
                    "{mode:>10} qps {:>5} in {input_len:>6} iter {iter}: {} ok, {} failed, median TTFT {:.1} ms, median TPOT {:.2} ms{}",
                    fmt_qps(qps),
                    s.completed,
                    s.failed,
                    s.ttft.median,
                    s.tpot.median,
                    match (kv_transfer, handover) {
                        (Some(t), Some(h)) => format!(
                            ", KV transfer {t:.2} ms, handed over -> ready {h:.2} ms (still sending earlier steps' KV {:.2})",
                            backlog.unwrap_or(0.0)
                        ),
                        (Some(t), None) => format!(", KV transfer {t:.2} ms"),
                        _ => String::new(),
                    }
                ));
                written.push(path);
            }
        }
    }
    Ok(written)
}

/// Writes `<dir>/ttft.json` for one link rate's sweep (`bench sweep --link-rates`), the file
/// `bench plot --link` reads: each mode's median TTFT at the longest prompt and the lowest
/// request rate of `<dir>/summary.csv` (the mean over iterations), with the rate's name.
pub fn write_link_ttft(dir: &Path, rate: &str) -> Result<PathBuf, String> {
    let csv = dir.join("summary.csv");
    let text = std::fs::read_to_string(&csv).map_err(|e| format!("{}: {e}", csv.display()))?;
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap_or_default().split(',').collect();
    let column = |name: &str| {
        header.iter().position(|h| *h == name).ok_or_else(|| format!("{}: no column {name}", csv.display()))
    };
    let (mode_c, qps_c, input_c, ttft_c) =
        (column("mode")?, column("qps")?, column("input_len")?, column("median_ttft_ms")?);
    let rows: Vec<(String, f64, usize, f64)> = lines
        .filter_map(|line| {
            let f: Vec<&str> = line.split(',').collect();
            let qps = f.get(qps_c)?.parse::<f64>().ok()?;
            Some((f.get(mode_c)?.to_string(), qps, f.get(input_c)?.parse().ok()?, f.get(ttft_c)?.parse().ok()?))
        })
        .collect();
    let longest = rows.iter().map(|r| r.2).max().ok_or_else(|| format!("{}: no points", csv.display()))?;
    let slowest = rows.iter().filter(|r| r.2 == longest).map(|r| r.1).fold(f64::INFINITY, f64::min);
    let mut ttft_ms = serde_json::Map::new();
    let mut modes: Vec<&str> = rows.iter().map(|r| r.0.as_str()).collect();
    modes.dedup();
    for mode in modes {
        let v: Vec<f64> =
            rows.iter().filter(|r| r.0 == mode && r.2 == longest && r.1 == slowest).map(|r| r.3).collect();
        if !v.is_empty() && !ttft_ms.contains_key(mode) {
            ttft_ms.insert(mode.to_string(), serde_json::json!(v.iter().sum::<f64>() / v.len() as f64));
        }
    }
    let json = serde_json::json!({"prompt_tokens": longest, "link": rate, "qps": slowest, "ttft_ms": ttft_ms});
    let path = dir.join("ttft.json");
    std::fs::write(&path, json.to_string()).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(path)
}

fn append(path: &Path, row: &str) -> Result<(), String> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new().append(true).open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    f.write_all(row.as_bytes()).map_err(|e| format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn point_files_follow_the_naming_contract() {
        assert_eq!(point_file("push", 8.0, 16384, 128, 0), "push_qps8_in16384_out128_iter0.json");
        assert_eq!(point_file("pull", 0.5, 1024, 128, 2), "pull_qps0.5_in1024_out128_iter2.json");
        assert_eq!(point_file("colocated", f64::INFINITY, 1, 1, 0), "colocated_qpsinf_in1_out1_iter0.json");
    }

    #[test]
    fn a_link_rate_is_summed_up_at_its_longest_prompt_and_lowest_rate() {
        let dir = std::env::temp_dir().join(format!("tandem-link-ttft-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let row = |mode: &str, qps: &str, input: usize, iter: usize, ttft: f64| {
            format!("{mode},{qps},{input},16,{iter},4,0,0,{ttft},0,0,0,0,0,0,0,,,\n")
        };
        let mut csv = format!("{CSV_HEADER}\n");
        for (mode, base) in [("push", 100.0), ("pull", 300.0), ("colocated", 90.0)] {
            csv += &row(mode, "1", 256, 0, base / 4.0);
            csv += &row(mode, "1", 1024, 0, base);
            csv += &row(mode, "1", 1024, 1, base + 10.0);
            csv += &row(mode, "4", 1024, 0, base * 3.0);
        }
        std::fs::write(dir.join("summary.csv"), csv).unwrap();
        let path = write_link_ttft(&dir, "200mbit").unwrap();
        let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        assert_eq!(json["prompt_tokens"], 1024);
        assert_eq!(json["link"], "200mbit");
        assert_eq!(json["ttft_ms"]["push"], 105.0);
        assert_eq!(json["ttft_ms"]["pull"], 305.0);
        assert_eq!(json["ttft_ms"]["colocated"], 95.0);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
