//! Prometheus metrics, each described once here. Engine gauges are read from the engine's
//! live stats at scrape time; request metrics are recorded by the handlers through
//! [`Metrics::record_finished`]. Labels are low-cardinality constants (never request ids).

use prometheus::{Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry, TextEncoder};
use tandem_engine::StatsSnapshot;

/// All of the server's metrics and their registry.
pub struct Metrics {
    registry: Registry,
    running: IntGauge,
    waiting: IntGauge,
    kv_blocks_used: IntGauge,
    kv_blocks_free: IntGauge,
    kv_blocks_total: IntGauge,
    preemptions: IntGauge,
    kv_blocks_cached: IntGauge,
    prefix_queries: IntGauge,
    prefix_hits: IntGauge,
    prompt_tokens: IntCounter,
    generation_tokens: IntCounter,
    ttft: Histogram,
    tpot: Histogram,
    e2e: Histogram,
    finished: IntCounterVec,
    errors: IntCounterVec,
    kv: prometheus::IntGaugeVec,
    kv_queue: Histogram,
    kv_wait: Histogram,
    kv_transfer: Histogram,
    kv_bytes: IntCounter,
    /// `--discovery`: whether etcd answers and how often it did not (registered when set).
    discovery: std::sync::OnceLock<(IntGauge, IntGauge, std::sync::Arc<tandem_discovery::DiscoveryHealth>)>,
}

const LATENCY_BUCKETS: &[f64] =
    &[0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0];
const TPOT_BUCKETS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.2, 0.5, 1.0, 2.5];

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Self {
        let registry = Registry::new();
        let gauge = |name: &str, help: &str| {
            let g = IntGauge::new(name, help).expect("metric definitions are static and valid");
            registry.register(Box::new(g.clone())).expect("each metric is registered once");
            g
        };
        let counter = |name: &str, help: &str| {
            let c = IntCounter::new(name, help).expect("metric definitions are static and valid");
            registry.register(Box::new(c.clone())).expect("each metric is registered once");
            c
        };
        let histogram = |name: &str, help: &str, buckets: &[f64]| {
            let h = Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec()))
                .expect("metric definitions are static and valid");
            registry.register(Box::new(h.clone())).expect("each metric is registered once");
            h
        };
        let counter_vec = |name: &str, help: &str, label: &str| {
            let c =
                IntCounterVec::new(Opts::new(name, help), &[label]).expect("metric definitions are static and valid");
            registry.register(Box::new(c.clone())).expect("each metric is registered once");
            c
        };
        Self {
            running: gauge("tandem:num_requests_running", "Requests in the engine's running set."),
            waiting: gauge("tandem:num_requests_waiting", "Requests queued in the engine (including preempted)."),
            kv_blocks_used: gauge("tandem:kv_blocks_used", "KV cache blocks held by requests."),
            kv_blocks_free: gauge("tandem:kv_blocks_free", "KV cache blocks free."),
            kv_blocks_total: gauge("tandem:kv_blocks_total", "KV cache blocks in the pool."),
            preemptions: gauge("tandem:num_preemptions_total", "Requests preempted (recomputed) so far."),
            kv_blocks_cached: gauge(
                "tandem:kv_blocks_cached",
                "KV cache blocks whose computed KV is kept for later prompts (held or free).",
            ),
            prefix_queries: gauge(
                "tandem:prefix_cache_queries_total",
                "Prompt tokens looked up in the prefix cache (whole blocks).",
            ),
            prefix_hits: gauge(
                "tandem:prefix_cache_hits_total",
                "Prompt tokens whose KV the prefix cache held (not computed).",
            ),
            prompt_tokens: counter("tandem:prompt_tokens_total", "Prompt tokens of admitted requests."),
            generation_tokens: counter("tandem:generation_tokens_total", "Tokens generated."),
            ttft: histogram("tandem:time_to_first_token_seconds", "Request arrival to first token.", LATENCY_BUCKETS),
            tpot: histogram(
                "tandem:time_per_output_token_seconds",
                "Mean gap between output tokens after the first, per request.",
                TPOT_BUCKETS,
            ),
            e2e: histogram("tandem:e2e_request_latency_seconds", "Request arrival to last token.", LATENCY_BUCKETS),
            finished: counter_vec(
                "tandem:request_success_total",
                "Requests finished, by finish reason.",
                "finished_reason",
            ),
            errors: counter_vec("tandem:request_errors_total", "Requests refused or failed, by error type.", "type"),
            kv_queue: histogram(
                "tandem:kv_load_queue_seconds",
                "Decode legs: arrival to KV requested from prefill (waiting for blocks).",
                LATENCY_BUCKETS,
            ),
            kv_wait: histogram(
                "tandem:kv_load_wait_seconds",
                "Decode legs: KV requested to KV ready (prefill time plus transfer).",
                LATENCY_BUCKETS,
            ),
            kv_transfer: histogram(
                "tandem:kv_transfer_seconds",
                "Decode legs: first to last KV byte landing.",
                LATENCY_BUCKETS,
            ),
            kv_bytes: counter("tandem:kv_load_bytes_total", "Decode legs: KV bytes received."),
            kv: {
                let g = prometheus::IntGaugeVec::new(
                    Opts::new("tandem:kv_connector", "KV connector counters (transfers, bytes, regions, expiries, unknown and duplicate ids, refused peers, checksum failures, connections by transport: links_tcp, links_local, links_cuda_ipc, links_nixl; rank_notices: tensor-parallel ranks' completions and answers), by counter."),
                    &["counter"],
                )
                .expect("metric definitions are static and valid");
                registry.register(Box::new(g.clone())).expect("each metric is registered once");
                g
            },
            discovery: std::sync::OnceLock::new(),
            registry,
        }
    }

    /// Shows discovery's state (`--discovery`): `tandem:discovery_connected` (1 while etcd
    /// answers) and `tandem:discovery_failures_total`.
    pub fn watch_discovery(&self, health: std::sync::Arc<tandem_discovery::DiscoveryHealth>) {
        let gauge = |name: &str, help: &str| {
            let g = IntGauge::new(name, help).expect("metric definitions are static and valid");
            self.registry.register(Box::new(g.clone())).map(|_| g)
        };
        let connected = gauge("tandem:discovery_connected", "1 while etcd answers this engine's registration, else 0.");
        let failures = gauge(
            "tandem:discovery_failures_total",
            "Times etcd could not be reached or a registration session with it broke.",
        );
        if let (Ok(c), Ok(f)) = (connected, failures) {
            let _ = self.discovery.set((c, f, health));
        }
    }

    /// Counts prompt tokens of an admitted request.
    pub fn record_admitted(&self, prompt_tokens: usize) {
        self.prompt_tokens.inc_by(prompt_tokens as u64);
    }

    /// Counts generated tokens as they stream.
    pub fn record_generated(&self, n: usize) {
        self.generation_tokens.inc_by(n as u64);
    }

    /// Records a finished request's latencies (seconds) and finish reason.
    pub fn record_finished(&self, reason: &'static str, ttft: Option<f64>, e2e: f64, output_tokens: usize) {
        self.finished.with_label_values(&[reason]).inc();
        if let Some(ttft) = ttft {
            self.ttft.observe(ttft);
            if output_tokens > 1 {
                self.tpot.observe((e2e - ttft) / (output_tokens - 1) as f64);
            }
        }
        self.e2e.observe(e2e);
    }

    /// Records how a decode leg's KV arrived.
    pub fn record_kv_load(&self, t: &tandem_engine::KvLoadTimeline) {
        let s = |us: u64| us as f64 / 1e6;
        self.kv_queue.observe(s(t.queued_us));
        self.kv_wait.observe(s(t.transfer.ready_us));
        self.kv_transfer.observe(s(t.transfer.data_end_us.saturating_sub(t.transfer.data_start_us)));
        self.kv_bytes.inc_by(t.transfer.bytes);
    }

    /// Counts a refused or failed request.
    pub fn record_error(&self, error_type: &'static str) {
        self.errors.with_label_values(&[error_type]).inc();
    }

    /// The Prometheus text exposition, with engine gauges from `stats`.
    pub fn render(&self, stats: &StatsSnapshot) -> String {
        self.running.set(stats.running as i64);
        self.waiting.set(stats.waiting as i64);
        self.kv_blocks_free.set(stats.free_blocks as i64);
        self.kv_blocks_total.set(stats.total_blocks as i64);
        self.kv_blocks_used.set(stats.total_blocks.saturating_sub(stats.free_blocks) as i64);
        self.preemptions.set(stats.preemptions as i64);
        self.kv_blocks_cached.set(stats.cached_blocks as i64);
        self.prefix_queries.set(stats.prefix_queried_tokens as i64);
        self.prefix_hits.set(stats.prefix_hit_tokens as i64);
        if let Some(kv) = &stats.kv {
            for (name, v) in [
                ("transfers_ok", kv.transfers_ok),
                ("transfers_failed", kv.transfers_failed),
                ("bytes_sent", kv.bytes_sent),
                ("bytes_received", kv.bytes_received),
                ("regions", kv.regions),
                ("expired", kv.expired),
                ("unknown_ids", kv.unknown_ids),
                ("duplicate_ids", kv.duplicate_ids),
                ("peers_refused", kv.peers_refused),
                ("auth_refused", kv.auth_refused),
                ("checksum_failures", kv.checksum_failures),
                ("links_tcp", kv.links_tcp),
                ("links_local", kv.links_local),
                ("links_cuda_ipc", kv.links_cuda_ipc),
                ("links_nixl", kv.links_nixl),
                ("rank_notices", kv.rank_notices),
            ] {
                self.kv.with_label_values(&[name]).set(v as i64);
            }
        }
        if let Some((connected, failures, health)) = self.discovery.get() {
            connected.set(i64::from(health.connected()));
            failures.set(health.failures() as i64);
        }
        let mut buf = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut buf) {
            tracing::warn!(error = %e, "metrics encoding failed");
        }
        String::from_utf8(buf).unwrap_or_default()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
