//! Serving metrics as `vllm bench serve` defines and names them, computed from per-request
//! outcomes. Pure functions: the load generator records outcomes, this turns them into a
//! [`ServeSummary`] whose JSON keys match vLLM's, so results sit beside published ones.
//!
//! Definitions (times in seconds in, milliseconds out):
//! - TTFT: request sent -> first streamed chunk that has choices.
//! - ITL: gaps between successive chunks with choices, pooled over all requests.
//! - E2EL: request sent -> last chunk.
//! - TPOT per request: (E2EL - TTFT) / (output tokens - 1), for requests with more than one
//!   output token.
//! - Percentiles interpolate linearly between order statistics (numpy's default); std is the
//!   population standard deviation (numpy's default). Empty sets give 0.
//! - Throughputs divide by the benchmark's wall-clock duration; goodput counts requests that
//!   meet every SLO given (TPOT of a one-token request counts as 0).

use serde::Serialize;

/// One request's outcome, as the load generator saw it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RequestOutcome {
    /// Finished with HTTP 200 and no error chunk.
    pub success: bool,
    /// Prompt tokens (from the usage the server reported, else the dataset's length).
    pub prompt_len: usize,
    /// Output tokens (from usage, else the number of token chunks).
    pub output_len: usize,
    /// Seconds from send to the first chunk with choices.
    pub ttft: f64,
    /// Gaps between successive chunks with choices, seconds.
    pub itl: Vec<f64>,
    /// Seconds from send to the last chunk.
    pub latency: f64,
    /// The error, for failed requests.
    pub error: String,
    /// tandem decode engines: where the time to the first token went (`kv_timeline`).
    pub kv_timeline: Option<serde_json::Value>,
    /// The generated token ids, where the server streams them (tandem's `token_ids`): a
    /// multi-turn conversation sends them back in its next turn.
    pub token_ids: Vec<u32>,
    /// The generated text (a chat conversation sends it back as the assistant's turn).
    pub text: String,
}

/// Service-level objectives for goodput, milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Slo {
    /// Max TTFT.
    pub ttft_ms: Option<f64>,
    /// Max TPOT.
    pub tpot_ms: Option<f64>,
    /// Max E2EL.
    pub e2el_ms: Option<f64>,
}

impl Slo {
    /// Parses `ttft:500 tpot:50 e2el:2000` (any subset).
    pub fn parse(items: &[String]) -> Result<Self, String> {
        let mut s = Slo::default();
        for item in items {
            let (k, v) = item.split_once(':').ok_or_else(|| format!("goodput item `{item}` is not NAME:MS"))?;
            let ms: f64 = v.parse().map_err(|_| format!("goodput `{item}`: `{v}` is not a number of milliseconds"))?;
            match k {
                "ttft" => s.ttft_ms = Some(ms),
                "tpot" => s.tpot_ms = Some(ms),
                "e2el" => s.e2el_ms = Some(ms),
                other => return Err(format!("unknown goodput metric `{other}` (ttft, tpot, e2el)")),
            }
        }
        Ok(s)
    }
}

/// Mean, median, std and chosen percentiles of one metric, in milliseconds.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Stat {
    /// Mean.
    pub mean: f64,
    /// Median.
    pub median: f64,
    /// Population standard deviation.
    pub std: f64,
    /// (percentile, value) pairs.
    pub percentiles: Vec<(f64, f64)>,
}

/// numpy.percentile with linear interpolation; `sorted` must be ascending.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (sorted.len() - 1) as f64 * (p / 100.0).clamp(0.0, 1.0);
    let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}

/// Statistics of `values_s` (seconds), reported in milliseconds.
pub fn stat(values_s: &[f64], percentiles: &[f64]) -> Stat {
    let mut v: Vec<f64> = values_s.iter().map(|x| x * 1000.0).collect();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return Stat { percentiles: percentiles.iter().map(|p| (*p, 0.0)).collect(), ..Stat::default() };
    }
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    let std = (v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n).sqrt();
    Stat {
        mean,
        median: percentile(&v, 50.0),
        std,
        percentiles: percentiles.iter().map(|p| (*p, percentile(&v, *p))).collect(),
    }
}

/// TPOT of one request (seconds), if it has more than one output token.
pub fn tpot(o: &RequestOutcome) -> Option<f64> {
    (o.output_len > 1).then(|| (o.latency - o.ttft) / (o.output_len - 1) as f64)
}

/// The benchmark's result, with vLLM's JSON keys. The per-metric statistics are flattened to
/// keys like `mean_ttft_ms` and `p99_ttft_ms` by [`ServeSummary::to_json`].
#[derive(Clone, Debug, Default, Serialize)]
pub struct ServeSummary {
    /// Requests that succeeded.
    pub completed: usize,
    /// Requests that failed.
    pub failed: usize,
    /// Wall-clock seconds of the measured run.
    pub duration: f64,
    /// Prompt tokens of successful requests.
    pub total_input_tokens: usize,
    /// Output tokens of successful requests.
    pub total_output_tokens: usize,
    /// completed / duration.
    pub request_throughput: f64,
    /// Requests meeting every SLO / duration (present when SLOs were given).
    pub request_goodput: Option<f64>,
    /// Output tokens / duration.
    pub output_throughput: f64,
    /// (input + output tokens) / duration.
    pub total_token_throughput: f64,
    /// TTFT statistics (ms).
    #[serde(skip)]
    pub ttft: Stat,
    /// TPOT statistics (ms).
    #[serde(skip)]
    pub tpot: Stat,
    /// ITL statistics (ms).
    #[serde(skip)]
    pub itl: Stat,
    /// E2EL statistics (ms).
    #[serde(skip)]
    pub e2el: Stat,
}

/// Computes the summary of a run that took `duration` seconds.
pub fn summarize(outcomes: &[RequestOutcome], duration: f64, percentiles: &[f64], slo: Option<Slo>) -> ServeSummary {
    let ok: Vec<&RequestOutcome> = outcomes.iter().filter(|o| o.success).collect();
    let ttfts: Vec<f64> = ok.iter().map(|o| o.ttft).collect();
    let tpots: Vec<f64> = ok.iter().filter_map(|o| tpot(o)).collect();
    let itls: Vec<f64> = ok.iter().flat_map(|o| o.itl.iter().copied()).collect();
    let e2els: Vec<f64> = ok.iter().map(|o| o.latency).collect();
    let input: usize = ok.iter().map(|o| o.prompt_len).sum();
    let output: usize = ok.iter().map(|o| o.output_len).sum();
    let per_s = |x: f64| if duration > 0.0 { x / duration } else { 0.0 };
    let goodput = slo.map(|s| {
        let good = ok
            .iter()
            .filter(|o| {
                s.ttft_ms.is_none_or(|m| o.ttft * 1000.0 <= m)
                    && s.tpot_ms.is_none_or(|m| tpot(o).unwrap_or(0.0) * 1000.0 <= m)
                    && s.e2el_ms.is_none_or(|m| o.latency * 1000.0 <= m)
            })
            .count();
        per_s(good as f64)
    });
    ServeSummary {
        completed: ok.len(),
        failed: outcomes.len() - ok.len(),
        duration,
        total_input_tokens: input,
        total_output_tokens: output,
        request_throughput: per_s(ok.len() as f64),
        request_goodput: goodput,
        output_throughput: per_s(output as f64),
        total_token_throughput: per_s((input + output) as f64),
        ttft: stat(&ttfts, percentiles),
        tpot: stat(&tpots, percentiles),
        itl: stat(&itls, percentiles),
        e2el: stat(&e2els, percentiles),
    }
}

/// `99.0` -> `"99"`, `99.9` -> `"99.9"` (vLLM's key spelling).
fn pct_key(p: f64) -> String {
    if p.fract() == 0.0 {
        format!("{}", p as i64)
    } else {
        format!("{p}")
    }
}

impl ServeSummary {
    /// The flat JSON object vLLM writes (without the run's identity fields, which the caller
    /// adds).
    pub fn to_json(&self) -> serde_json::Map<String, serde_json::Value> {
        let mut m = match serde_json::to_value(self) {
            Ok(serde_json::Value::Object(m)) => m,
            _ => serde_json::Map::new(),
        };
        for (name, s) in [("ttft", &self.ttft), ("tpot", &self.tpot), ("itl", &self.itl), ("e2el", &self.e2el)] {
            m.insert(format!("mean_{name}_ms"), s.mean.into());
            m.insert(format!("median_{name}_ms"), s.median.into());
            m.insert(format!("std_{name}_ms"), s.std.into());
            for (p, v) in &s.percentiles {
                m.insert(format!("p{}_{name}_ms", pct_key(*p)), (*v).into());
            }
        }
        m
    }

    /// vLLM's result table.
    pub fn table(&self, percentiles: &[f64]) -> String {
        use std::fmt::Write;
        let mut t = String::new();
        let line = |t: &mut String, k: &str, v: String| {
            let _ = writeln!(t, "{k:<40} {v:<10}");
        };
        let _ = writeln!(t, "{:=^50}", " Serving Benchmark Result ");
        line(&mut t, "Successful requests:", self.completed.to_string());
        line(&mut t, "Failed requests:", self.failed.to_string());
        line(&mut t, "Benchmark duration (s):", format!("{:.2}", self.duration));
        line(&mut t, "Total input tokens:", self.total_input_tokens.to_string());
        line(&mut t, "Total generated tokens:", self.total_output_tokens.to_string());
        line(&mut t, "Request throughput (req/s):", format!("{:.2}", self.request_throughput));
        if let Some(g) = self.request_goodput {
            line(&mut t, "Request goodput (req/s):", format!("{g:.2}"));
        }
        line(&mut t, "Output token throughput (tok/s):", format!("{:.2}", self.output_throughput));
        line(&mut t, "Total Token throughput (tok/s):", format!("{:.2}", self.total_token_throughput));
        for (title, short, s) in [
            ("Time to First Token", "TTFT", &self.ttft),
            ("Time per Output Token (excl. 1st token)", "TPOT", &self.tpot),
            ("Inter-token Latency", "ITL", &self.itl),
            ("End-to-end Latency", "E2EL", &self.e2el),
        ] {
            let _ = writeln!(t, "{:-^50}", title);
            line(&mut t, &format!("Mean {short} (ms):"), format!("{:.2}", s.mean));
            line(&mut t, &format!("Median {short} (ms):"), format!("{:.2}", s.median));
            for p in percentiles {
                let v = s.percentiles.iter().find(|(q, _)| q == p).map(|(_, v)| *v).unwrap_or(0.0);
                line(&mut t, &format!("P{} {short} (ms):", pct_key(*p)), format!("{v:.2}"));
            }
        }
        let _ = writeln!(t, "{}", "=".repeat(50));
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(ttft: f64, latency: f64, output_len: usize, itl: &[f64]) -> RequestOutcome {
        RequestOutcome {
            success: true,
            prompt_len: 10,
            output_len,
            ttft,
            itl: itl.to_vec(),
            latency,
            ..Default::default()
        }
    }

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&v, 50.0), 2.5);
        assert!((percentile(&v, 99.0) - 3.97).abs() < 1e-12);
        assert_eq!(percentile(&v, 0.0), 1.0);
        assert_eq!(percentile(&v, 100.0), 4.0);
        assert_eq!(percentile(&[7.0], 90.0), 7.0);
        assert_eq!(percentile(&[], 90.0), 0.0);
    }

    #[test]
    fn summary_matches_hand_computed_values() {
        // Three successful requests and one failure over 2 s.
        let outs = vec![
            outcome(0.100, 0.400, 4, &[0.1, 0.1, 0.1]),           // tpot = 0.3 / 3 = 0.1
            outcome(0.200, 0.700, 6, &[0.1, 0.1, 0.1, 0.1, 0.1]), // tpot = 0.5 / 5 = 0.1
            outcome(0.300, 0.300, 1, &[]),                        // one token: no tpot
            RequestOutcome { success: false, error: "boom".into(), ..Default::default() },
        ];
        let s = summarize(
            &outs,
            2.0,
            &[50.0, 90.0, 99.0],
            Some(Slo { ttft_ms: Some(250.0), tpot_ms: Some(100.5), e2el_ms: None }),
        );
        assert_eq!((s.completed, s.failed), (3, 1));
        assert_eq!((s.total_input_tokens, s.total_output_tokens), (30, 11));
        assert_eq!(s.request_throughput, 1.5);
        assert_eq!(s.output_throughput, 5.5);
        assert_eq!(s.total_token_throughput, 20.5);
        // TTFT: 100, 200, 300 ms.
        assert!((s.ttft.mean - 200.0).abs() < 1e-9);
        assert!((s.ttft.median - 200.0).abs() < 1e-9);
        assert!((s.ttft.std - (20000.0f64 / 3.0).sqrt()).abs() < 1e-9);
        assert!((s.ttft.percentiles[1].1 - 280.0).abs() < 1e-9, "p90 = 200 + 0.8 * 100");
        // TPOT: the two multi-token requests, 100 ms each (the one-token request has none).
        assert!((s.tpot.mean - 100.0).abs() < 1e-9 && s.tpot.std.abs() < 1e-9);
        // ITL pools 8 gaps of 100 ms.
        assert!((s.itl.mean - 100.0).abs() < 1e-9);
        // E2EL: 400, 700, 300 -> mean 466.67, median 400.
        assert!((s.e2el.mean - 1400.0 / 3.0).abs() < 1e-9 && (s.e2el.median - 400.0).abs() < 1e-9);
        // Goodput: requests 1 (ttft 100, tpot 100) and 2 (ttft 200, tpot 100) meet both SLOs;
        // request 3 (ttft 300) misses TTFT. 2 good / 2 s.
        assert_eq!(s.request_goodput, Some(1.0));
    }

    #[test]
    fn json_uses_vllm_key_names() {
        let s = summarize(&[outcome(0.1, 0.2, 2, &[0.1])], 1.0, &[99.0, 99.9], None);
        let m = s.to_json();
        for key in [
            "completed",
            "failed",
            "duration",
            "total_input_tokens",
            "total_output_tokens",
            "request_throughput",
            "request_goodput",
            "output_throughput",
            "total_token_throughput",
            "mean_ttft_ms",
            "median_ttft_ms",
            "std_ttft_ms",
            "p99_ttft_ms",
            "p99.9_ttft_ms",
            "mean_tpot_ms",
            "p99_tpot_ms",
            "mean_itl_ms",
            "median_itl_ms",
            "p99_itl_ms",
            "mean_e2el_ms",
            "std_e2el_ms",
            "p99_e2el_ms",
        ] {
            assert!(m.contains_key(key), "missing {key}");
        }
        assert!(s.table(&[99.0]).contains("Mean TTFT (ms):"));
    }

    #[test]
    fn slo_parsing() {
        let s = Slo::parse(&["ttft:500".into(), "tpot:50".into()]).unwrap();
        assert_eq!((s.ttft_ms, s.tpot_ms, s.e2el_ms), (Some(500.0), Some(50.0), None));
        assert!(Slo::parse(&["ttft".into()]).is_err());
        assert!(Slo::parse(&["speed:5".into()]).is_err());
    }
}
