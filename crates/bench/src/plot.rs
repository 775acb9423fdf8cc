//! `tandem bench plot`: figures from a sweep's result files.
//!
//! - [`four_panel`]: one panel per input length, the chosen metric against request rate, one
//!   line per mode (median), with a shaded band from the median up to p99.
//! - [`ttft_breakdown`]: for the disaggregated modes, where the time to the first token went,
//!   from the per-request `kv_timeline`s the decode engine reports: waiting for blocks,
//!   registration until the first KV byte (prefill compute included), the KV transfer itself,
//!   and the rest (completion, first decode step, network).
//!
//! - [`ttft_by_turn`]: multi-turn runs (`bench serve --dataset-name multi-turn`), the median
//!   TTFT of each turn, one line per result file (say, KV-aware routing against round-robin).
//! - [`ttft_by_link`]: P/D between two hosts at several link rates (`scripts/two_hosts.sh` with
//!   `LINK_RATES`), the long prompt's TTFT against the rate, push, pull and colocated.
//!
//! All are written as PNG and SVG. Text uses the bundled DejaVu Sans, so figures look the same
//! on any machine.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use plotters::coord::Shift;
use plotters::prelude::*;
use serde_json::Value;

static FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");

fn font() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT);
    });
}

/// A latency metric of the sweep.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Metric {
    /// Time to first token.
    Ttft,
    /// Time per output token.
    Tpot,
    /// Inter-token latency.
    Itl,
    /// End-to-end latency.
    E2el,
}

impl Metric {
    /// Parses `ttft|tpot|itl|e2el`.
    pub fn parse(s: &str) -> Result<Self, String> {
        Ok(match s {
            "ttft" => Metric::Ttft,
            "tpot" => Metric::Tpot,
            "itl" => Metric::Itl,
            "e2el" => Metric::E2el,
            other => return Err(format!("unknown metric `{other}` (ttft, tpot, itl, e2el)")),
        })
    }

    fn key(self) -> &'static str {
        match self {
            Metric::Ttft => "ttft",
            Metric::Tpot => "tpot",
            Metric::Itl => "itl",
            Metric::E2el => "e2el",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Metric::Ttft => "TTFT",
            Metric::Tpot => "TPOT",
            Metric::Itl => "ITL",
            Metric::E2el => "E2E latency",
        }
    }
}

/// One result file, identified by its name (`<mode>_qps<q>_in<in>_out<out>_iter<i>.json`).
#[derive(Clone, Debug)]
struct ResultFile {
    mode: String,
    qps: f64,
    input_len: usize,
    json: Value,
}

fn parse_name(name: &str) -> Option<(String, f64, usize)> {
    let stem = name.strip_suffix(".json")?;
    let parts: Vec<&str> = stem.split('_').collect();
    if parts.len() < 5 {
        return None;
    }
    let n = parts.len();
    let qps = parts[n - 4].strip_prefix("qps")?;
    let qps = if qps == "inf" { f64::INFINITY } else { qps.parse().ok()? };
    let input_len = parts[n - 3].strip_prefix("in")?.parse().ok()?;
    parts[n - 2].strip_prefix("out")?;
    parts[n - 1].strip_prefix("iter")?;
    Some((parts[..n - 4].join("_"), qps, input_len))
}

fn load(dir: &Path) -> Result<Vec<ResultFile>, String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut out = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let Some((mode, qps, input_len)) = parse_name(&name) else { continue };
        if qps.is_infinite() {
            continue; // no position on a request-rate axis
        }
        let text = std::fs::read_to_string(e.path()).map_err(|err| format!("{name}: {err}"))?;
        let json = serde_json::from_str(&text).map_err(|err| format!("{name}: {err}"))?;
        out.push(ResultFile { mode, qps, input_len, json });
    }
    if out.is_empty() {
        // Only the sweep's summary (the per-point files stayed elsewhere): its medians and p99s
        // draw the metric panels; the TTFT breakdown needs the per-request timelines.
        if let Ok(text) = std::fs::read_to_string(dir.join("summary.csv")) {
            out = from_summary(&text)?;
        }
    }
    if out.is_empty() {
        return Err(format!(
            "{}: no sweep results (<mode>_qps<q>_in<in>_out<out>_iter<i>.json, or summary.csv)",
            dir.display()
        ));
    }
    Ok(out)
}

/// The points of a sweep's `summary.csv` (header `mode,qps,input_len,...`; every other column
/// a number).
fn from_summary(text: &str) -> Result<Vec<ResultFile>, String> {
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let header: Vec<&str> = lines.next().unwrap_or_default().split(',').collect();
    let col = |name: &str| header.iter().position(|h| *h == name).ok_or(format!("summary.csv has no `{name}` column"));
    let (m, q, i) = (col("mode")?, col("qps")?, col("input_len")?);
    let mut out = Vec::new();
    for (n, line) in lines.enumerate() {
        let cells: Vec<&str> = line.split(',').collect();
        let bad = || format!("summary.csv row {}: `{line}`", n + 2);
        let qps: f64 = cells.get(q).and_then(|c| c.parse().ok()).ok_or_else(bad)?;
        let input_len = cells.get(i).and_then(|c| c.parse().ok()).ok_or_else(bad)?;
        let mode = cells.get(m).ok_or_else(bad)?.to_string();
        let json: serde_json::Map<String, Value> = header
            .iter()
            .zip(&cells)
            .filter_map(|(h, c)| c.parse::<f64>().ok().map(|v| (h.to_string(), Value::from(v))))
            .collect();
        if qps.is_finite() {
            out.push(ResultFile { mode, qps, input_len, json: Value::Object(json) });
        }
    }
    Ok(out)
}

fn mode_color(mode: &str) -> RGBColor {
    match mode {
        "push" => RGBColor(31, 119, 180),
        "pull" => RGBColor(255, 127, 14),
        "colocated" => RGBColor(100, 100, 100),
        _ => RGBColor(44, 160, 44),
    }
}

/// (input_len -> mode -> [(qps, median, p99)]), iterations averaged.
type Panels = BTreeMap<usize, BTreeMap<String, Vec<(f64, f64, f64)>>>;

fn panels(files: &[ResultFile], metric: Metric) -> Panels {
    let mut acc: BTreeMap<(usize, String, u64), (f64, f64, usize)> = BTreeMap::new();
    for f in files {
        let get = |k: String| f.json.get(&k).and_then(Value::as_f64).unwrap_or(0.0);
        let (med, p99) = (get(format!("median_{}_ms", metric.key())), get(format!("p99_{}_ms", metric.key())));
        let e = acc.entry((f.input_len, f.mode.clone(), f.qps.to_bits())).or_insert((0.0, 0.0, 0));
        e.0 += med;
        e.1 += p99.max(med);
        e.2 += 1;
    }
    let mut out: Panels = BTreeMap::new();
    for ((input_len, mode, qbits), (med, p99, n)) in acc {
        out.entry(input_len).or_default().entry(mode).or_default().push((
            f64::from_bits(qbits),
            med / n as f64,
            p99 / n as f64,
        ));
    }
    for modes in out.values_mut() {
        for pts in modes.values_mut() {
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        }
    }
    out
}

fn err<E: std::fmt::Debug>(e: E) -> String {
    format!("drawing: {e:?}")
}

fn draw_panels<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, metric: Metric, data: &Panels) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE).map_err(err)?;
    let area = root
        .titled(&format!("{} vs request rate (line: median, band: up to p99)", metric.label()), ("sans-serif", 26))
        .map_err(err)?;
    let rows = data.len().div_ceil(2).max(1);
    let cols = if data.len() == 1 { 1 } else { 2 };
    let cells = area.split_evenly((rows, cols));
    for ((input_len, modes), cell) in data.iter().zip(cells.iter()) {
        let xmax = modes.values().flatten().map(|p| p.0).fold(0.0, f64::max) * 1.08 + 1e-9;
        let ymax = modes.values().flatten().map(|p| p.2).fold(0.0, f64::max) * 1.12 + 1e-9;
        let mut chart = ChartBuilder::on(cell)
            .caption(format!("input {input_len} tokens"), ("sans-serif", 20))
            .margin(14)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d(0f64..xmax, 0f64..ymax)
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc("request rate (req/s)")
            .y_desc(format!("{} (ms)", metric.label()))
            .label_style(("sans-serif", 14))
            .axis_desc_style(("sans-serif", 15))
            .draw()
            .map_err(err)?;
        for (mode, pts) in modes {
            let color = mode_color(mode);
            let mut band: Vec<(f64, f64)> = pts.iter().map(|p| (p.0, p.1)).collect();
            band.extend(pts.iter().rev().map(|p| (p.0, p.2)));
            chart.draw_series(std::iter::once(Polygon::new(band, color.mix(0.18)))).map_err(err)?;
            chart
                .draw_series(LineSeries::new(pts.iter().map(|p| (p.0, p.1)), color.stroke_width(3)))
                .map_err(err)?
                .label(mode.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 22, y)], color.stroke_width(3)));
            chart.draw_series(pts.iter().map(|p| Circle::new((p.0, p.1), 4, color.filled()))).map_err(err)?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .label_font(("sans-serif", 15))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(err)?;
    }
    root.present().map_err(err)
}

/// Draws the four-panel figure for `metric` from the results in `dir`, as
/// `<out_dir>/<metric>.png` and `.svg`.
pub fn four_panel(dir: &Path, metric: Metric, out_dir: &Path) -> Result<(PathBuf, PathBuf), String> {
    font();
    let data = panels(&load(dir)?, metric);
    std::fs::create_dir_all(out_dir).map_err(|e| format!("{}: {e}", out_dir.display()))?;
    let (png, svg) = (out_dir.join(format!("{}.png", metric.key())), out_dir.join(format!("{}.svg", metric.key())));
    let size = (1400, if data.len() > 2 { 1000 } else { 560 });
    draw_panels(&BitMapBackend::new(&png, size).into_drawing_area(), metric, &data)?;
    draw_panels(&SVGBackend::new(&svg, size).into_drawing_area(), metric, &data)?;
    Ok((png, svg))
}

/// Mean TTFT components (ms) per (mode, input_len, qps).
type Breakdown = Vec<(String, [f64; 5])>;

const PARTS: [&str; 5] = [
    "decode: waiting for KV blocks",
    "KV requested -> first byte (push: prefill compute)",
    "KV transfer",
    "completion -> decode ready",
    "outside decode (router; pull: the prefill leg; network)",
];

fn breakdown(files: &[ResultFile]) -> Breakdown {
    let mut acc: BTreeMap<(String, usize, u64), ([f64; 5], usize)> = BTreeMap::new();
    for f in files {
        let (Some(tl), Some(ttfts)) =
            (f.json.get("kv_timelines").and_then(Value::as_array), f.json.get("ttfts").and_then(Value::as_array))
        else {
            continue;
        };
        for (t, ttft) in tl.iter().zip(ttfts) {
            let (Some(ttft), false) = (ttft.as_f64(), t.is_null()) else { continue };
            let us = |v: &Value| v.as_f64().unwrap_or(0.0) / 1000.0;
            let queue = us(&t["queued_us"]);
            let to_data = us(&t["transfer"]["data_start_us"]);
            let transfer = (us(&t["transfer"]["data_end_us"]) - to_data).max(0.0);
            let ready = us(&t["ready_us"]);
            let to_ready = (ready - queue - to_data - transfer).max(0.0);
            let outside = (ttft * 1000.0 - ready).max(0.0);
            let e = acc.entry((f.mode.clone(), f.input_len, f.qps.to_bits())).or_insert(([0.0; 5], 0));
            for (i, v) in [queue, to_data, transfer, to_ready, outside].into_iter().enumerate() {
                e.0[i] += v;
            }
            e.1 += 1;
        }
    }
    acc.into_iter()
        .map(|((mode, input_len, q), (sum, n))| {
            (format!("{mode} {input_len}/{}", f64::from_bits(q)), sum.map(|v| v / n as f64))
        })
        .collect()
}

fn draw_breakdown<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, data: &Breakdown) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE).map_err(err)?;
    let ymax = data.iter().map(|(_, p)| p.iter().sum::<f64>()).fold(0.0, f64::max) * 1.15 + 1e-9;
    let n = data.len();
    let labels: Vec<String> = data.iter().map(|(l, _)| l.clone()).collect();
    let mut chart = ChartBuilder::on(root)
        .caption("Where TTFT goes (decode's view, mean per point)", ("sans-serif", 26))
        .margin(16)
        .x_label_area_size(60)
        .y_label_area_size(70)
        .build_cartesian_2d(-0.5f64..(n as f64 - 0.5), 0f64..ymax)
        .map_err(err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n.max(1))
        .x_label_formatter(&|x| {
            let i = x.round();
            if (x - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < labels.len() {
                labels[i as usize].clone()
            } else {
                String::new()
            }
        })
        .x_label_style(("sans-serif", 13))
        .x_desc("mode input tokens / request rate")
        .y_desc("ms")
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(err)?;
    let colors = [
        RGBColor(160, 160, 160),
        RGBColor(31, 119, 180),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
        RGBColor(44, 160, 44),
    ];
    for (k, name) in PARTS.iter().enumerate() {
        let color = colors[k];
        chart
            .draw_series(data.iter().enumerate().map(|(i, (_, parts))| {
                let base: f64 = parts[..k].iter().sum();
                Rectangle::new([(i as f64 - 0.35, base), (i as f64 + 0.35, base + parts[k])], color.filled())
            }))
            .map_err(err)?
            .label(*name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], color.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font(("sans-serif", 15))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

/// Draws the TTFT breakdown (disaggregated modes only) as `<out_dir>/ttft_breakdown.png` and
/// `.svg`. `Ok(None)` when no result carries transfer timelines.
pub fn ttft_breakdown(dir: &Path, out_dir: &Path) -> Result<Option<(PathBuf, PathBuf)>, String> {
    font();
    let data = breakdown(&load(dir)?);
    if data.is_empty() {
        return Ok(None);
    }
    std::fs::create_dir_all(out_dir).map_err(|e| format!("{}: {e}", out_dir.display()))?;
    let (png, svg) = (out_dir.join("ttft_breakdown.png"), out_dir.join("ttft_breakdown.svg"));
    let size = ((260 + 95 * data.len() as u32).max(900), 680);
    draw_breakdown(&BitMapBackend::new(&png, size).into_drawing_area(), &data)?;
    draw_breakdown(&SVGBackend::new(&svg, size).into_drawing_area(), &data)?;
    Ok(Some((png, svg)))
}

/// One multi-turn result: its label (the file's name) and the median TTFT (ms) of each turn.
type TurnLine = (String, Vec<f64>);

/// The multi-turn results in `dir`: every JSON file with `median_ttft_ms_by_turn`.
fn turn_lines(dir: &Path) -> Result<Vec<TurnLine>, String> {
    let mut lines = Vec::new();
    for e in std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?.flatten() {
        let path = e.path();
        if path.extension().and_then(|x| x.to_str()) != Some("json") {
            continue;
        }
        let Ok(json) = std::fs::read_to_string(&path).map(|t| serde_json::from_str::<Value>(&t)) else { continue };
        let Some(turns) = json.ok().and_then(|j| j.get("median_ttft_ms_by_turn").and_then(Value::as_array).cloned())
        else {
            continue;
        };
        let label = path.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
        lines.push((label, turns.iter().map(|t| t.as_f64().unwrap_or(f64::NAN)).collect()));
    }
    lines.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(lines)
}

fn draw_turns<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, lines: &[TurnLine]) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE).map_err(err)?;
    let turns = lines.iter().map(|(_, t)| t.len()).max().unwrap_or(1);
    let ymax = lines.iter().flat_map(|(_, t)| t.iter().copied()).filter(|v| v.is_finite()).fold(0.0, f64::max) * 1.15;
    let mut chart = ChartBuilder::on(root)
        .caption("Multi-turn traffic: median TTFT by turn", ("sans-serif", 26))
        .margin(16)
        .x_label_area_size(50)
        .y_label_area_size(70)
        .build_cartesian_2d(0.8f64..(turns as f64 + 0.2), 0f64..ymax.max(1e-9))
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_labels(turns)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .x_desc("turn")
        .y_desc("median TTFT (ms)")
        .label_style(("sans-serif", 15))
        .draw()
        .map_err(err)?;
    for (i, (label, ttfts)) in lines.iter().enumerate() {
        let points: Vec<(f64, f64)> =
            ttfts.iter().enumerate().filter(|(_, v)| v.is_finite()).map(|(t, &v)| (t as f64 + 1.0, v)).collect();
        line_with_points(&mut chart, label, Palette99::pick(i).to_rgba(), points)?;
    }
    legend_and_present(root, &mut chart)
}

/// One labelled line through `points`, each point marked.
fn line_with_points<'a, DB: DrawingBackend + 'a, X, Y>(
    chart: &mut ChartContext<'a, DB, Cartesian2d<X, Y>>,
    label: &str,
    color: RGBAColor,
    points: Vec<(f64, f64)>,
) -> Result<(), String>
where
    DB::ErrorType: 'static,
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    chart
        .draw_series(LineSeries::new(points.clone(), color.stroke_width(3)))
        .map_err(err)?
        .label(label)
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3)));
    chart.draw_series(points.into_iter().map(|p| Circle::new(p, 4, color.filled()))).map_err(err)?;
    Ok(())
}

/// The lines' legend, top right, then the figure out.
fn legend_and_present<'a, DB: DrawingBackend + 'a, X, Y>(
    root: &DrawingArea<DB, Shift>,
    chart: &mut ChartContext<'a, DB, Cartesian2d<X, Y>>,
) -> Result<(), String>
where
    DB::ErrorType: 'static,
    X: Ranged<ValueType = f64>,
    Y: Ranged<ValueType = f64>,
{
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font(("sans-serif", 15))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

/// Draws a figure with `draw` as `<out_dir>/<name>.png` and `.svg`.
fn png_and_svg(
    out_dir: &Path,
    name: &str,
    draw: impl Fn(&DrawingArea<BitMapBackend<'_>, Shift>) -> Result<(), String>,
    draw_svg: impl Fn(&DrawingArea<SVGBackend<'_>, Shift>) -> Result<(), String>,
) -> Result<(PathBuf, PathBuf), String> {
    std::fs::create_dir_all(out_dir).map_err(|e| format!("{}: {e}", out_dir.display()))?;
    let (png, svg) = (out_dir.join(format!("{name}.png")), out_dir.join(format!("{name}.svg")));
    draw(&BitMapBackend::new(&png, (1000, 620)).into_drawing_area())?;
    draw_svg(&SVGBackend::new(&svg, (1000, 620)).into_drawing_area())?;
    Ok((png, svg))
}

/// Draws the multi-turn figure as `<out_dir>/ttft_by_turn.png` and `.svg`. `Ok(None)` when no
/// result in `dir` is a multi-turn run.
pub fn ttft_by_turn(dir: &Path, out_dir: &Path) -> Result<Option<(PathBuf, PathBuf)>, String> {
    font();
    let lines = turn_lines(dir)?;
    if lines.is_empty() {
        return Ok(None);
    }
    png_and_svg(out_dir, "ttft_by_turn", |r| draw_turns(r, &lines), |r| draw_turns(r, &lines)).map(Some)
}

/// One link rate's long-prompt TTFTs (ms): the rate in Mbit/s, and each mode's.
#[derive(Clone, Debug, PartialEq)]
struct LinkPoint {
    mbit_s: f64,
    prompt_tokens: u64,
    ttft_ms: Vec<(String, f64)>,
}

/// A tc rate (`50mbit`, `1gbit`, `800kbit`) in Mbit/s.
fn rate_mbit_s(rate: &str) -> Option<f64> {
    let r = rate.trim().to_ascii_lowercase();
    let (num, scale) = [("gbit", 1e3), ("mbit", 1.0), ("kbit", 1e-3)]
        .iter()
        .find_map(|(suffix, scale)| r.strip_suffix(suffix).map(|n| (n.to_string(), *scale)))?;
    num.parse::<f64>().ok().map(|n| n * scale)
}

/// The link runs under `dir`: every `*/ttft.json` that names a link rate, by rate. A mode's
/// name is its setting's (`push_tcp_16_16` becomes `push`; several transports keep the name).
fn link_points(dir: &Path) -> Result<Vec<LinkPoint>, String> {
    let mut points = Vec::new();
    for e in std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?.flatten() {
        let Ok(text) = std::fs::read_to_string(e.path().join("ttft.json")) else { continue };
        let json: Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", e))?;
        let Some(mbit_s) = json.get("link").and_then(Value::as_str).and_then(rate_mbit_s) else { continue };
        let Some(modes) = json.get("ttft_ms").and_then(Value::as_object) else { continue };
        let tcp_only = modes.keys().filter(|k| k.contains('_')).all(|k| k.contains("_tcp_"));
        let ttft_ms = modes
            .iter()
            .filter_map(|(k, v)| {
                let name = if tcp_only { k.split('_').next().unwrap_or(k) } else { k.as_str() };
                v.as_f64().map(|ms| (name.to_string(), ms))
            })
            .collect();
        let prompt_tokens = json.get("prompt_tokens").and_then(Value::as_u64).unwrap_or(0);
        points.push(LinkPoint { mbit_s, prompt_tokens, ttft_ms });
    }
    points.sort_by(|a, b| a.mbit_s.total_cmp(&b.mbit_s));
    Ok(points)
}

fn draw_link<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, points: &[LinkPoint]) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE).map_err(err)?;
    let mut modes: Vec<&str> = points.iter().flat_map(|p| p.ttft_ms.iter().map(|(m, _)| m.as_str())).collect();
    modes.sort();
    modes.dedup();
    let (lo, hi) = (points.first().map_or(1.0, |p| p.mbit_s), points.last().map_or(10.0, |p| p.mbit_s));
    let ymax = points.iter().flat_map(|p| p.ttft_ms.iter().map(|(_, v)| *v)).fold(0.0, f64::max) * 1.15;
    let tokens = points.first().map_or(0, |p| p.prompt_tokens);
    let mut chart = ChartBuilder::on(root)
        .caption(format!("TTFT of a {tokens}-token prompt against the link's rate"), ("sans-serif", 26))
        .margin(16)
        .x_label_area_size(50)
        .y_label_area_size(70)
        // Labelled at the rates measured (a log axis's own labels crowd at its top end).
        .build_cartesian_2d(
            (lo * 0.8..hi * 1.25).log_scale().with_key_points(points.iter().map(|p| p.mbit_s).collect()),
            0f64..ymax.max(1e-9),
        )
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("link between prefill and decode (Mbit/s, each way)")
        .y_desc("median TTFT (ms)")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .label_style(("sans-serif", 15))
        .draw()
        .map_err(err)?;
    for mode in modes {
        let line: Vec<(f64, f64)> = points
            .iter()
            .filter_map(|p| p.ttft_ms.iter().find(|(m, _)| m == mode).map(|(_, v)| (p.mbit_s, *v)))
            .collect();
        line_with_points(&mut chart, mode, mode_color(mode).to_rgba(), line)?;
    }
    legend_and_present(root, &mut chart)
}

/// Draws the long prompt's TTFT against the link's rate (`scripts/two_hosts.sh` with
/// `LINK_RATES`: one `link-RATE/ttft.json` per rate under `dir`) as `<out_dir>/ttft_by_link.png`
/// and `.svg`: where push stops hiding the transfer behind the prefill shows as push leaving
/// colocated's line. `Ok(None)` when `dir` holds no such run.
pub fn ttft_by_link(dir: &Path, out_dir: &Path) -> Result<Option<(PathBuf, PathBuf)>, String> {
    font();
    let points = link_points(dir)?;
    if points.is_empty() {
        return Ok(None);
    }
    png_and_svg(out_dir, "ttft_by_link", |r| draw_link(r, &points), |r| draw_link(r, &points)).map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_runs_draw_ttft_against_the_rate() {
        assert_eq!(
            (rate_mbit_s("50mbit"), rate_mbit_s("1gbit"), rate_mbit_s("800kbit")),
            (Some(50.0), Some(1e3), Some(0.8))
        );
        assert_eq!(rate_mbit_s("fast"), None);
        let dir = std::env::temp_dir().join(format!("tandem-link-plot-{}", std::process::id()));
        for (rate, push) in [("150mbit", 234.0), ("50mbit", 703.0)] {
            std::fs::create_dir_all(dir.join(format!("link-{rate}"))).unwrap();
            let json = format!(
                r#"{{"prompt_tokens": 2048, "link": "{rate}", "ttft_ms": {{"colocated": 180.0, "push_tcp_16_16": {push}, "pull_tcp_16_16": 379.0}}}}"#
            );
            std::fs::write(dir.join(format!("link-{rate}/ttft.json")), json).unwrap();
        }
        std::fs::create_dir_all(dir.join("other")).unwrap();
        let points = link_points(&dir).unwrap();
        assert_eq!(points.iter().map(|p| p.mbit_s).collect::<Vec<_>>(), [50.0, 150.0], "by rate, others skipped");
        assert!(points[0].ttft_ms.contains(&("push".to_string(), 703.0)), "{:?}", points[0]);
        let (png, _) = ttft_by_link(&dir, &dir).unwrap().unwrap();
        assert!(std::fs::metadata(png).unwrap().len() > 1000);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn multi_turn_results_draw_one_line_each() {
        let dir = std::env::temp_dir().join(format!("tandem-turn-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("kv-aware.json"), r#"{"median_ttft_ms_by_turn": [80.0, 20.0, 22.5]}"#).unwrap();
        std::fs::write(dir.join("round-robin.json"), r#"{"median_ttft_ms_by_turn": [81.0, 60.0, 64.0]}"#).unwrap();
        std::fs::write(dir.join("other.json"), r#"{"median_ttft_ms": 3}"#).unwrap();
        let lines = turn_lines(&dir).unwrap();
        assert_eq!(
            lines,
            [("kv-aware".to_string(), vec![80.0, 20.0, 22.5]), ("round-robin".into(), vec![81.0, 60.0, 64.0])]
        );
        let (png, svg) = ttft_by_turn(&dir, &dir).unwrap().unwrap();
        assert!(std::fs::metadata(png).unwrap().len() > 1000 && std::fs::metadata(svg).unwrap().len() > 1000);
        assert!(ttft_by_turn(&std::env::temp_dir().join("tandem-no-such-dir-x"), &dir).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn names_parse_back() {
        assert_eq!(parse_name("push_qps8_in16384_out128_iter0.json"), Some(("push".into(), 8.0, 16384)));
        assert_eq!(parse_name("my_mode_qps0.5_in4_out2_iter1.json"), Some(("my_mode".into(), 0.5, 4)));
        assert_eq!(parse_name("summary.csv"), None);
        assert_eq!(parse_name("push_qpsX_in1_out1_iter0.json"), None);
        let rows = from_summary("mode,qps,input_len,median_ttft_ms\npush,2,1024,18.5\ncolocated,inf,1024,3\n").unwrap();
        assert_eq!(rows.len(), 1, "the unthrottled point has no place on a rate axis");
        assert_eq!((rows[0].mode.as_str(), rows[0].qps, rows[0].input_len), ("push", 2.0, 1024));
        assert_eq!(rows[0].json["median_ttft_ms"], 18.5);
        assert!(from_summary("mode,qps,input_len\npush,x,1\n").unwrap_err().contains("row 2"));
    }
}
