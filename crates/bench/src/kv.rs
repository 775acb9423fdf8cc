//! `tandem bench kv`: the TCP KV transport between two processes, against raw loopback TCP
//! measured in the same run.
//!
//! The peer process ([`serve_peer`]) accepts two connections. On the first it reads raw bytes
//! into a buffer: a reference for what TCP on this machine moves with no protocol, not an
//! upper bound (one `write_all` and one `read_exact` of the whole set at a time, into a
//! buffer the reader rewrites each time; the transport's framed, per-run copies into fixed KV
//! memory can beat it, and on some machines do by half again). On the
//! second it speaks the KV protocol: handshake, then `WriteBlocks` frames whose bytes land in
//! its KV memory, each acknowledged. [`measure`] drives both and times each transfer until its
//! acknowledgement.
//!
//! With a GPU (`--device cuda:N`) both sides' KV lives as a GPU engine's does: a device cache
//! with a page-locked host copy. A transfer then runs from the sender's device cache to the
//! receiver's, as the connector moves it: device-to-host copies piece by piece, each piece on
//! the socket as soon as it is copied, each landed piece copied up at once. The same transfer
//! with the copies not overlapped (all down, send, receive, all up: the path before pieces) is
//! measured beside it.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Instant;
use tandem_kv::stream::KvStream;

use serde::Serialize;
use tandem_compute::cuda::{CudaDevice, DevBuf, PinnedRegion};
use tandem_compute::{KvCache, KvDtype, KvLayout, KvRegion};
use tandem_core::{EngineId, Epoch, TransferId};
use tandem_kv::blocks::KvSlice;
use tandem_kv::channel::{accept_handshake, configure, connect, handshake, read_hello, Hello, Picked, Timeouts};
use tandem_kv::tcp::{
    recv_blocks, recv_staged, recv_striped_blocks, send_blocks, send_pieces, send_staged, send_striped_staged, Crew,
    Destination,
};
use tandem_kv::wire::{read_message, write_message, Message};
use tandem_kv::{AgentInfo, KvError, KvMemory, KvMode, Role, TransportOffer};

/// What to move.
#[derive(Clone, Debug)]
pub struct KvBenchConfig {
    /// Bytes of KV per transfer (rounded up to whole blocks), unless `tokens` is given.
    pub bytes: usize,
    /// Tokens of KV per transfer instead of `bytes` (rounded up to whole blocks): the bytes
    /// then follow the element type, so bf16 and FP8 caches move the same prompt.
    pub tokens: Option<usize>,
    /// Each side's cache element type (`--kv-cache-dtype`); `None` for the memory's own: f32
    /// in host memory (a CPU engine's cache), bf16 on a GPU. FP8 on either; bf16 only on a GPU.
    pub cache_dtype: Option<KvDtype>,
    /// Transfers of each kind; the best and the median are reported.
    pub repeats: usize,
    /// The KV shape (defaults to SmolLM2-135M's: 30 layers, 3 KV heads, head dim 64).
    pub layout: KvLayout,
    /// Contiguous runs the blocks are split into (a real request's blocks are scattered).
    pub runs: usize,
    /// Each transfer carries a CRC-32 of its bytes, checked by the peer (`--kv-verify`).
    pub verify: bool,
    /// Both sides' KV in this GPU's memory (a device cache and its page-locked host copy,
    /// bf16) instead of host memory (f32).
    pub device: Option<usize>,
    /// Where the GPU side keeps its compiled kernels between processes (see
    /// `CudaDevice::open_with`).
    pub kernel_cache: Option<std::path::PathBuf>,
    /// TCP streams both the raw reference and the KV transport use (`--kv-tcp-streams`): the
    /// raw set split evenly over them, the KV bytes striped as the connector stripes them.
    pub streams: usize,
    /// The KV transport's connection and streams over TLS (`--tls-cert`); the raw reference
    /// stays plain TCP, so the ratio is TLS's cost against the wire's floor.
    pub tls: Option<tandem_kv::stream::KvTls>,
}

impl Default for KvBenchConfig {
    fn default() -> Self {
        let layout = KvLayout { num_layers: 30, num_kv_heads: 3, head_dim: 64, block_size: 16, num_blocks: 0 };
        Self {
            bytes: 256 << 20,
            tokens: None,
            cache_dtype: None,
            repeats: 5,
            layout,
            runs: 8,
            verify: false,
            device: None,
            kernel_cache: None,
            streams: 1,
            tls: None,
        }
    }
}

/// The transfer id prefix that asks the peer to receive without overlapping its copies up.
const SERIAL: &str = "serial-";

impl KvBenchConfig {
    /// The GPU variant: Qwen3-4B's KV shape (36 layers, 8 KV heads, head dim 128, 16-token
    /// blocks) on `device`.
    pub fn on_gpu(self, device: usize) -> Self {
        let layout = KvLayout { num_layers: 36, num_kv_heads: 8, head_dim: 128, block_size: 16, num_blocks: 0 };
        Self { layout, device: Some(device), ..self }
    }

    /// The caches' element type.
    pub fn dtype(&self) -> KvDtype {
        match (self.cache_dtype, self.device) {
            (Some(dtype), _) => dtype,
            (None, Some(_)) => KvDtype::Bf16,
            (None, None) => KvDtype::F32,
        }
    }

    /// An error for a cache the memory cannot hold: bf16 lives only in a GPU cache (a CPU
    /// engine's is f32 or FP8), f32 only in host memory.
    pub fn check(&self) -> Result<(), String> {
        match (self.dtype(), self.device) {
            (KvDtype::Bf16, None) => Err("a bf16 cache needs --device cuda:N (host memory holds f32 or fp8)".into()),
            (KvDtype::F32, Some(_)) => Err("a GPU cache is bf16 or fp8, not f32".into()),
            _ => Ok(()),
        }
    }

    fn blocks(&self) -> usize {
        match self.tokens {
            Some(tokens) => tokens.div_ceil(self.layout.block_size).max(1),
            None => self.bytes.div_ceil(self.layout.block_elems() * self.dtype().bytes()),
        }
    }

    /// The layout with enough blocks for the transfer plus the gaps between runs.
    pub fn pool_layout(&self) -> KvLayout {
        KvLayout { num_blocks: self.blocks() + 2 * self.runs + 2, ..self.layout }
    }

    fn agent(&self, role: Role) -> AgentInfo {
        let name = EngineId(format!("bench-{role:?}").to_lowercase());
        let transports = vec![TransportOffer::Tcp { addr: "127.0.0.1:0".into() }];
        let info = AgentInfo::for_layout(
            name,
            Epoch(1),
            role,
            KvMode::Push,
            "bench".into(),
            &self.pool_layout(),
            self.dtype(),
            transports,
        );
        AgentInfo { tcp_streams: self.streams.max(1), ..info }
    }

    /// Block ids split into `runs` contiguous runs with one-block gaps.
    pub(crate) fn table(&self) -> Vec<u32> {
        let n = self.blocks();
        let per = n.div_ceil(self.runs.max(1));
        (0..n).map(|i| (i + i / per) as u32).collect()
    }
}

/// One side's KV memory: a CPU engine's (the region is the cache) or a GPU engine's (a device
/// cache and its page-locked host copy). The fields keep the memory alive.
struct Side {
    region: Arc<KvRegion>,
    memory: KvMemory,
    _cpu: Option<KvCache>,
    _gpu: Option<(CudaDevice, DevBuf<u16>, PinnedRegion)>,
}

impl Side {
    fn new(cfg: &KvBenchConfig) -> Result<Self, KvError> {
        let layout = cfg.pool_layout();
        cfg.check().map_err(KvError::Unsupported)?;
        let dtype = cfg.dtype();
        let Some(ordinal) = cfg.device else {
            let mut cache = KvCache::of(layout, dtype);
            for (i, &b) in cfg.table().iter().enumerate() {
                let k = vec![i as f32; layout.num_kv_heads * layout.head_dim];
                cache.write_token(0, b as usize, 0, &k, &k);
            }
            let region = cache.region();
            return Ok(Self { memory: region.clone().into(), region, _cpu: Some(cache), _gpu: None });
        };
        let gpu = |e: tandem_compute::cuda::CudaError| KvError::Unsupported(format!("cuda:{ordinal}: {e}"));
        let dev = CudaDevice::open_with(ordinal, Default::default(), cfg.kernel_cache.as_deref()).map_err(gpu)?;
        let words = (layout.num_blocks * layout.block_elems() * dtype.bytes()).div_ceil(2);
        let cache = dev.zeros_exportable::<u16>(words).map_err(gpu)?;
        let device = dev.kv_memory(&cache, layout, dtype).map_err(gpu)?;
        let region = KvRegion::host_copy(layout, dtype);
        let pinned = dev.pin_region(&region).map_err(gpu)?;
        let memory = KvMemory::device(device, Some(region.clone()))?;
        Ok(Self { region, memory, _cpu: None, _gpu: Some((dev, cache, pinned)) })
    }
}

/// The measured rates.
#[derive(Clone, Debug, Serialize)]
pub struct KvBenchReport {
    /// Where each side's KV lives.
    pub memory: String,
    /// The caches' element type.
    pub dtype: String,
    /// Bytes per transfer.
    pub bytes: u64,
    /// Tokens per transfer (whole blocks).
    pub tokens: usize,
    /// Bytes a token of KV takes (every layer's keys and values).
    pub bytes_per_token: u64,
    /// Blocks per transfer.
    pub blocks: usize,
    /// Contiguous runs per transfer.
    pub runs: usize,
    /// TCP streams, raw and KV alike.
    pub streams: usize,
    /// The KV transport ran over TLS (the raw reference did not).
    pub tls: bool,
    /// Raw loopback TCP, best, GB/s.
    pub raw_best_gb_s: f64,
    /// Raw loopback TCP, median, GB/s.
    pub raw_median_gb_s: f64,
    /// KV transport, best, GB/s.
    pub kv_best_gb_s: f64,
    /// KV transport, median, GB/s.
    pub kv_median_gb_s: f64,
    /// KV transport, median time a transfer, ms.
    pub kv_median_ms: f64,
    /// kv_median / raw_median.
    pub ratio: f64,
    /// GPU: the same transfers with the copies to and from the host copy not overlapped with
    /// the socket, median GB/s.
    pub kv_unpipelined_median_gb_s: Option<f64>,
}

impl std::fmt::Display for KvBenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "KV set: {:.1} MiB in {} blocks ({} tokens of {} bytes, {}), {} contiguous runs, {}, peer in another process",
            self.bytes as f64 / (1 << 20) as f64,
            self.blocks,
            self.tokens,
            self.bytes_per_token,
            self.dtype,
            self.runs,
            self.memory
        )?;
        writeln!(f, "{:<40} {:>10} {:>10}", format!("{} TCP stream(s)", self.streams), "best GB/s", "median")?;
        writeln!(
            f,
            "{:<40} {:>10.2} {:>10.2}",
            "raw loopback TCP (reference)", self.raw_best_gb_s, self.raw_median_gb_s
        )?;
        let kv = if self.tls { "tcp KV transport over TLS" } else { "tcp KV transport" };
        writeln!(f, "{:<40} {:>10.2} {:>10.2}", kv, self.kv_best_gb_s, self.kv_median_gb_s)?;
        if let Some(serial) = self.kv_unpipelined_median_gb_s {
            writeln!(f, "{:<40} {:>10} {:>10.2}", "  copies not overlapped (before pieces)", "", serial)?;
        }
        writeln!(
            f,
            "transport / raw (median): {:.0}%; a transfer {:.2} ms (median)",
            self.ratio * 100.0,
            self.kv_median_ms
        )?;
        writeln!(f, "(the raw figure is one unframed send of the whole set: a reference, not an upper bound)")
    }
}

/// The peer side: serves one raw connection, then one KV-protocol connection, then returns.
pub fn serve_peer(listener: TcpListener, cfg: &KvBenchConfig) -> Result<(), KvError> {
    let t = Timeouts::default();
    let side = Side::new(cfg)?;
    let n = cfg.streams.max(1);
    let raw: Vec<TcpStream> = (0..n).map(|_| listener.accept().map(|(s, _)| s)).collect::<Result<_, _>>()?;
    // Each raw stream: a length, that many bytes into a buffer, an acknowledgement; until 0.
    std::thread::scope(|scope| {
        let readers: Vec<_> = raw
            .into_iter()
            .map(|mut raw| {
                scope.spawn(move || -> Result<(), KvError> {
                    configure(&raw, t)?;
                    let mut buf = Vec::new();
                    loop {
                        let mut len = [0u8; 8];
                        if raw.read_exact(&mut len).is_err() {
                            return Ok(());
                        }
                        let len = u64::from_le_bytes(len) as usize;
                        if len == 0 {
                            return Ok(());
                        }
                        buf.resize(len, 0);
                        raw.read_exact(&mut buf)?;
                        raw.write_all(&[1])?;
                    }
                })
            })
            .collect();
        readers
            .into_iter()
            .try_for_each(|r| r.join().unwrap_or_else(|_| Err(KvError::Protocol("raw reader panicked".into()))))
    })?;
    let (s, _) = listener.accept()?;
    configure(&s, t)?;
    let mut s = KvStream::accept(s, cfg.tls.as_ref())?;
    // Several streams: the further ones join with the token the handshake hands out.
    let token = (n > 1).then_some(1);
    accept_handshake(&mut s, &cfg.agent(Role::Decode), None, |_, _| Ok(Picked { join_token: token, ..Picked::tcp() }))?;
    let mut further: Vec<Option<KvStream>> = (1..n).map(|_| None).collect();
    for _ in 1..n {
        let (joined, _) = listener.accept()?;
        configure(&joined, t)?;
        let mut joined = KvStream::accept(joined, cfg.tls.as_ref())?;
        match read_hello(&mut joined)? {
            Hello::Join { token: 1, index, .. } if (1..n).contains(&index) => further[index - 1] = Some(joined),
            other => return Err(KvError::Protocol(format!("bench peer expected a stream to join, got {other:?}"))),
        }
    }
    let mut further: Vec<KvStream> = further.into_iter().flatten().collect();
    // The stream threads kept across the transfers, as a connection keeps them.
    let crew = Crew::kept(further.len() + 1, "bench-kv-recv");
    loop {
        let msg = match read_message(&mut s) {
            Ok(m) => m,
            Err(KvError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        };
        match msg {
            Message::WriteBlocks {
                transfer_id, blocks, src_block_size, num_tokens, bytes, checksum, streams, ..
            } => {
                let region = &side.region;
                // Safety: this process's KV memory exists only for this benchmark; nothing else
                // touches its blocks.
                let result = unsafe {
                    if transfer_id.0.starts_with(SERIAL) {
                        recv_blocks(&mut s, bytes, src_block_size, region, &blocks, num_tokens, checksum)
                            .and_then(|()| side.memory.load_from_host(&blocks))
                    } else if streams > 1 {
                        let mut load = side.memory.receiver()?;
                        let into = Destination::all(region, &blocks, num_tokens);
                        let all = into.slice.layers.clone();
                        let mut all_streams: Vec<&mut KvStream> = vec![&mut s];
                        all_streams.extend(further.iter_mut());
                        let mut landed = |run| load.landed(run, all.clone());
                        recv_striped_blocks(&mut all_streams, bytes, src_block_size, into, checksum, &mut landed, &crew)
                            .and_then(|()| load.finish())
                    } else {
                        let mut load = side.memory.receiver()?;
                        let into = Destination::all(region, &blocks, num_tokens);
                        let all = into.slice.layers.clone();
                        recv_staged(&mut s, bytes, src_block_size, into, checksum, &mut |run| {
                            load.landed(run, all.clone())
                        })
                        .and_then(|()| load.finish())
                    }
                };
                write_message(&mut s, &Message::WriteAck { transfer_id, error: result.err().map(|e| e.to_string()) })?;
            }
            other => return Err(KvError::Protocol(format!("bench peer got {other:?}"))),
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The driving side: connects to a peer running [`serve_peer`] at `addr`.
pub fn measure(addr: &str, cfg: &KvBenchConfig) -> Result<KvBenchReport, KvError> {
    let t = Timeouts::default();
    let layout = cfg.pool_layout();
    let table = cfg.table();
    let tokens = table.len() * layout.block_size;
    let bytes = tandem_kv::blocks::wire_bytes(&layout, cfg.dtype(), tokens);
    let side = Side::new(cfg)?;

    let n = cfg.streams.max(1);
    let mut raw: Vec<TcpStream> = (0..n).map(|_| connect(addr, t)).collect::<Result<_, _>>()?;
    let payload = vec![7u8; bytes as usize];
    let share = (bytes as usize).div_ceil(n);
    let mut raw_rates = Vec::new();
    for _ in 0..cfg.repeats {
        let start = Instant::now();
        // The set split evenly over the streams, each share sent and acknowledged on its own.
        std::thread::scope(|scope| {
            let sends: Vec<_> = raw
                .iter_mut()
                .zip(payload.chunks(share))
                .map(|(raw, chunk)| {
                    scope.spawn(move || -> Result<(), KvError> {
                        raw.write_all(&(chunk.len() as u64).to_le_bytes())?;
                        raw.write_all(chunk)?;
                        raw.read_exact(&mut [0u8])?;
                        Ok(())
                    })
                })
                .collect();
            sends
                .into_iter()
                .try_for_each(|s| s.join().unwrap_or_else(|_| Err(KvError::Protocol("raw sender panicked".into()))))
        })?;
        raw_rates.push(bytes as f64 / start.elapsed().as_secs_f64() / 1e9);
    }
    for r in &mut raw {
        r.write_all(&0u64.to_le_bytes())?;
    }
    drop(raw);
    drop(payload);

    let region = &side.region;
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    let mut s = KvStream::connect(connect(addr, t)?, cfg.tls.as_ref(), host)?;
    let (_, picked, _) = handshake(&mut s, &cfg.agent(Role::Prefill), None)?;
    let mut further = Vec::new();
    if let Some(token) = picked.join_token {
        for index in 1..n {
            let mut joined = KvStream::connect(connect(addr, t)?, cfg.tls.as_ref(), host)?;
            write_message(&mut joined, &Message::JoinStream { token, index, proof: None })?;
            further.push(joined);
        }
    }
    let header = |transfer_id, streams| Message::WriteBlocks {
        transfer_id,
        blocks: table.clone(),
        src_block_size: layout.block_size,
        num_tokens: tokens,
        from_token: 0,
        last: true,
        layers: None,
        rank: 0,
        ranks: 1,
        streams,
        bytes,
        checksum: cfg.verify,
    };
    let acked = |s: &mut KvStream| match read_message(s)? {
        Message::WriteAck { error: None, .. } => Ok(()),
        Message::WriteAck { error: Some(e), .. } => Err(KvError::Transfer(e)),
        other => Err(KvError::Protocol(format!("expected WriteAck, got {other:?}"))),
    };
    let (mut kv_rates, mut serial_rates) = (Vec::new(), Vec::new());
    let crew = Crew::kept(further.len() + 1, "bench-kv-send");
    for i in 0..cfg.repeats {
        let start = Instant::now();
        let pieces = send_pieces(region, &table, tokens)?;
        // Safety (this and the sends below): this KV memory exists only for the benchmark;
        // nothing else touches its blocks.
        let all = KvSlice::all(&layout);
        let staged = unsafe { side.memory.stage_send(&pieces, all.layers.clone())? };
        write_message(&mut s, &header(TransferId(format!("bench-{i}")), further.len() + 1))?;
        let mut ready = |i| staged.ready(i);
        if further.is_empty() {
            unsafe { send_staged(&mut s, region, (&pieces, all), tokens, cfg.verify, &mut ready)? };
        } else {
            let mut streams: Vec<&mut KvStream> = vec![&mut s];
            streams.extend(further.iter_mut());
            unsafe { send_striped_staged(&mut streams, region, (&pieces, all), cfg.verify, &mut ready, &crew)? };
        }
        drop(staged);
        acked(&mut s)?;
        kv_rates.push(bytes as f64 / start.elapsed().as_secs_f64() / 1e9);
        if cfg.device.is_some() {
            let start = Instant::now();
            unsafe { side.memory.stage_to_host(&table)? };
            write_message(&mut s, &header(TransferId(format!("{SERIAL}{i}")), 1))?;
            unsafe { send_blocks(&mut s, region, &table, tokens, cfg.verify)? };
            acked(&mut s)?;
            serial_rates.push(bytes as f64 / start.elapsed().as_secs_f64() / 1e9);
        }
    }
    drop(s);
    let best = |v: &[f64]| v.iter().cloned().fold(0.0, f64::max);
    let (raw_median, kv_median) = (median(raw_rates.clone()), median(kv_rates.clone()));
    let dtype = cfg.dtype().name();
    let memory = match cfg.device {
        Some(n) => format!("each side a cuda:{n} cache with a page-locked host copy"),
        None => "host memory".into(),
    };
    Ok(KvBenchReport {
        memory,
        dtype: dtype.into(),
        bytes,
        tokens,
        bytes_per_token: bytes / tokens.max(1) as u64,
        blocks: table.len(),
        runs: tandem_kv::blocks::coalesce(&table).len(),
        streams: n,
        tls: cfg.tls.is_some(),
        raw_best_gb_s: best(&raw_rates),
        raw_median_gb_s: raw_median,
        kv_best_gb_s: best(&kv_rates),
        kv_median_gb_s: kv_median,
        kv_median_ms: bytes as f64 / kv_median / 1e6,
        ratio: kv_median / raw_median,
        kv_unpipelined_median_gb_s: (!serial_rates.is_empty()).then(|| median(serial_rates)),
    })
}

/// Throwaway TLS material for `bench kv --tls`: a CA and a certificate it signed for
/// 127.0.0.1, written to `dir` as `ca.pem`, `cert.pem` and `key.pem` (for the peer process).
pub fn write_bench_certificates(dir: &std::path::Path) -> Result<(), String> {
    let e = |e: rcgen::Error| e.to_string();
    let ca_key = rcgen::KeyPair::generate().map_err(e)?;
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(e)?;
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).map_err(e)?;
    let key = rcgen::KeyPair::generate().map_err(e)?;
    let params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()]).map_err(e)?;
    let cert = params.signed_by(&key, &ca, &ca_key).map_err(e)?;
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    for (name, pem) in [("ca.pem", ca.pem()), ("cert.pem", cert.pem()), ("key.pem", key.serialize_pem())] {
        std::fs::write(dir.join(name), pem).map_err(|e| format!("{}: {e}", dir.join(name).display()))?;
    }
    Ok(())
}

/// The TLS material [`write_bench_certificates`] wrote to `dir`.
pub fn read_bench_certificates(dir: &std::path::Path) -> Result<tandem_kv::stream::KvTls, String> {
    let read = |name: &str| std::fs::read(dir.join(name)).map_err(|e| format!("{}: {e}", dir.join(name).display()));
    tandem_kv::stream::KvTls::from_pem(&read("cert.pem")?, &read("key.pem")?, &read("ca.pem")?)
}

/// Used by tests: a small end-to-end run in one process with the peer on a thread.
pub fn measure_in_process(cfg: &KvBenchConfig) -> Result<KvBenchReport, KvError> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?.to_string();
    let peer_cfg = cfg.clone();
    let peer = std::thread::spawn(move || serve_peer(listener, &peer_cfg));
    let report = measure(&addr, cfg)?;
    match peer.join() {
        Ok(r) => r?,
        Err(_) => return Err(KvError::Protocol("bench peer thread panicked".into())),
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_run_completes_and_reports_sane_rates() {
        for streams in [1, 3] {
            let cfg = KvBenchConfig { bytes: 4 << 20, repeats: 2, streams, ..Default::default() };
            let r = measure_in_process(&cfg).unwrap();
            assert_eq!((r.runs, r.streams), (r.blocks.min(8), streams));
            assert!(r.bytes >= 4 << 20);
            assert!(r.raw_best_gb_s > 0.0 && r.kv_best_gb_s > 0.0);
        }
    }

    /// `--tokens` with `--kv-cache-dtype fp8`: the same blocks a prompt, a quarter of an f32
    /// cache's bytes a token, every byte landing (CRC checked) on the peer's FP8 cache.
    #[test]
    fn an_fp8_cache_moves_the_same_tokens_in_a_quarter_of_f32s_bytes() {
        let run = |cache_dtype| {
            let cfg = KvBenchConfig { tokens: Some(1000), cache_dtype, repeats: 2, verify: true, ..Default::default() };
            measure_in_process(&cfg).unwrap()
        };
        let (f32, fp8) = (run(None), run(Some(KvDtype::Fp8E4m3)));
        assert_eq!((f32.tokens, fp8.tokens, fp8.blocks), (1008, 1008, 63), "1000 tokens in 16-token blocks");
        assert_eq!((f32.dtype.as_str(), fp8.dtype.as_str()), ("f32", "fp8_e4m3"));
        // 30 layers x K and V x 3 heads x 64 dims.
        assert_eq!((f32.bytes_per_token, fp8.bytes_per_token), (4 * 11520, 11520));
        assert_eq!(fp8.bytes, 1008 * 11520);
        assert!(fp8.kv_median_ms > 0.0 && fp8.kv_median_ms.is_finite());
        let bf16_on_host = KvBenchConfig { cache_dtype: Some(KvDtype::Bf16), ..Default::default() };
        assert!(bf16_on_host.check().is_err() && measure_in_process(&bf16_on_host).is_err());
    }

    /// The tcp transport over TLS, its connections' bulk bytes through their threads
    /// (`tls_pipes`) or not, on one stream and striped: every transfer's CRC checks where it
    /// lands (a byte lost, doubled or reordered by a pipe fails the run).
    #[test]
    fn tls_runs_with_and_without_the_connections_threads_land_every_byte() {
        let dir = std::env::temp_dir().join(format!("tandem-bench-kv-tls-test-{}", std::process::id()));
        write_bench_certificates(&dir).unwrap();
        for (streams, pipes) in [(1, true), (3, true), (2, false)] {
            let tls = read_bench_certificates(&dir).unwrap().with_pipes(pipes);
            let cfg = KvBenchConfig {
                bytes: 8 << 20,
                repeats: 2,
                streams,
                verify: true,
                tls: Some(tls),
                ..Default::default()
            };
            let r = measure_in_process(&cfg).unwrap_or_else(|e| panic!("{streams} streams, pipes {pipes}: {e}"));
            assert!(r.tls && r.bytes >= 8 << 20 && r.kv_best_gb_s > 0.0);
        }
        std::fs::remove_dir_all(&dir).ok();
    }
}

/// `tandem bench kv --transport cuda-ipc`: the cuda-ipc transport's device copies into a peer
/// process's GPU cache, against the same copies inside this process's cache (the device-copy
/// floor), measured in the same run.
pub mod cuda_ipc {
    use std::time::Instant;

    use serde::Serialize;
    use tandem_compute::cuda::{CudaDevice, DeviceKvMemory, IpcExport, KvFences, PeerKvMemory};
    use tandem_compute::KvLayout;

    /// What to move.
    #[derive(Clone, Debug)]
    pub struct IpcBenchConfig {
        /// Bytes per transfer, one row each.
        pub sizes: Vec<usize>,
        /// Transfers per size; the median is reported.
        pub repeats: usize,
        /// Our KV shape (default: Qwen3-4B's, 16-token blocks, bf16).
        pub layout: KvLayout,
        /// The peer's block size (another one makes every copy a pitched one).
        pub peer_block_size: usize,
        /// Contiguous runs a transfer's blocks are split into.
        pub runs: usize,
        /// Destination sets in the peer's cache: 2 when another writer ([`PeerWriter`]) gets
        /// a set of its own, so that what it lands is told apart from cuda-ipc's.
        pub peer_sets: usize,
    }

    impl Default for IpcBenchConfig {
        fn default() -> Self {
            let layout = KvLayout { num_layers: 36, num_kv_heads: 8, head_dim: 128, block_size: 16, num_blocks: 0 };
            let sizes = [1usize << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30].to_vec();
            Self { sizes, repeats: 5, layout, peer_block_size: 16, runs: 8, peer_sets: 1 }
        }
    }

    impl IpcBenchConfig {
        fn max_tokens(&self) -> usize {
            let token_bytes = self.layout.block_elems() / self.layout.block_size * 2;
            self.sizes.iter().max().copied().unwrap_or(0).div_ceil(token_bytes)
        }

        /// Our cache: room for the largest transfer twice over (the floor copies inside it),
        /// plus the gaps between runs.
        pub fn layout(&self) -> KvLayout {
            let n = self.layout.blocks_for(self.max_tokens());
            KvLayout { num_blocks: 2 * (n + self.runs + 1), ..self.layout }
        }

        /// The peer's cache: [`Self::peer_sets`] sets of [`Self::peer_set_blocks`].
        pub fn peer_layout(&self) -> KvLayout {
            let l = KvLayout { block_size: self.peer_block_size, ..self.layout };
            KvLayout { num_blocks: self.peer_set_blocks() * self.peer_sets.max(1), ..l }
        }

        /// Blocks of one destination set in the peer's cache.
        pub fn peer_set_blocks(&self) -> usize {
            let l = KvLayout { block_size: self.peer_block_size, ..self.layout };
            l.blocks_for(self.max_tokens()) + self.runs + 1
        }

        /// Tokens of a transfer of `size` bytes.
        pub fn tokens_of(&self, size: usize) -> usize {
            size.div_ceil(self.layout.block_elems() / self.layout.block_size * 2)
        }

        /// Our blocks a transfer of `tokens` reads.
        pub fn source_table(&self, tokens: usize) -> Vec<u32> {
            table(self.layout.blocks_for(tokens), self.runs, 0)
        }

        /// The peer's blocks set `set` of a transfer of `tokens` writes.
        pub fn peer_table(&self, tokens: usize, set: usize) -> Vec<u32> {
            let l = KvLayout { block_size: self.peer_block_size, ..self.layout };
            table(l.blocks_for(tokens), self.runs, set * self.peer_set_blocks())
        }
    }

    /// A second way into the peer's cache, measured beside cuda-ipc on the same blocks
    /// (`bench kv --transport nixl`): it writes into the peer's destination set 1.
    pub trait PeerWriter {
        /// What the column is called.
        fn name(&self) -> &'static str;
        /// Once, before any write: our cache, as `measure` allocated and filled it.
        fn attach(&mut self, ours: &Arc<DeviceKvMemory>) -> Result<(), String>;
        /// Writes tokens `0..tokens` of our `src` blocks into the peer's `dst` blocks and
        /// returns once they have landed there.
        fn write(&mut self, src: &[u32], dst: &[u32], tokens: usize) -> Result<(), String>;
        /// Reads tokens `0..tokens` of the peer's `src` blocks into our `dst` blocks (a pull's
        /// direction) and returns once they are here.
        fn read(&mut self, src: &[u32], dst: &[u32], tokens: usize) -> Result<(), String>;
    }

    /// Block ids for `n` blocks in `runs` runs with one-block gaps, from `first`.
    fn table(n: usize, runs: usize, first: usize) -> Vec<u32> {
        let per = n.div_ceil(runs.max(1)).max(1);
        (0..n).map(|i| (first + i + i / per) as u32).collect()
    }

    /// One size's rates.
    #[derive(Clone, Debug, Serialize)]
    pub struct IpcRow {
        /// Bytes per transfer.
        pub bytes: usize,
        /// Copies per transfer.
        pub copies: usize,
        /// The same copies inside this GPU's own cache, median GB/s (the floor).
        pub device_copy_gb_s: f64,
        /// cuda-ipc into the peer process's cache, median GB/s.
        pub cuda_ipc_gb_s: f64,
        /// cuda_ipc / device_copy.
        pub ratio: f64,
        /// cuda-ipc as a push writes a prompt while its step runs: four layer groups, each
        /// queued behind its (here already complete) event, median GB/s.
        pub layer_groups_gb_s: f64,
        /// The other writer ([`PeerWriter`]), if any: median GB/s, and its share of cuda-ipc's.
        pub other: Option<(f64, f64)>,
        /// Its reads of the same blocks back from the peer, median GB/s.
        pub other_read_gb_s: Option<f64>,
    }

    /// The report.
    #[derive(Clone, Debug, Serialize)]
    pub struct IpcReport {
        /// Where each side's cache is.
        pub placement: String,
        /// Block sizes, ours and the peer's.
        pub block_sizes: (usize, usize),
        /// One row per size.
        pub rows: Vec<IpcRow>,
        /// The other writer's name, if one was measured.
        pub other: Option<String>,
    }

    impl std::fmt::Display for IpcReport {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            writeln!(
                f,
                "cuda-ipc into a peer process ({}), blocks of {} -> {} tokens",
                self.placement, self.block_sizes.0, self.block_sizes.1
            )?;
            let other = self.other.as_deref().map(|n| (format!("{n} GB/s"), format!("{n}/ipc")));
            write!(
                f,
                "{:>10} {:>7} {:>18} {:>16} {:>7} {:>22}",
                "size", "copies", "device copy GB/s", "cuda-ipc GB/s", "ratio", "4 layer groups GB/s"
            )?;
            match &other {
                Some((rate, share)) => writeln!(f, " {rate:>12} {share:>10} {:>12}", "read GB/s")?,
                None => writeln!(f)?,
            }
            for r in &self.rows {
                write!(
                    f,
                    "{:>9.1}M {:>7} {:>18.1} {:>16.1} {:>6.0}% {:>22.1}",
                    r.bytes as f64 / (1 << 20) as f64,
                    r.copies,
                    r.device_copy_gb_s,
                    r.cuda_ipc_gb_s,
                    r.ratio * 100.0,
                    r.layer_groups_gb_s
                )?;
                match r.other {
                    Some((gb_s, share)) => writeln!(
                        f,
                        " {gb_s:>12.1} {:>9.0}% {:>12.1}",
                        share * 100.0,
                        r.other_read_gb_s.unwrap_or(f64::NAN)
                    )?,
                    None => writeln!(f)?,
                }
            }
            Ok(())
        }
    }

    /// The peer's export as one line (what the peer process prints).
    pub fn export_line(export: &IpcExport) -> String {
        let (handle, device) = export.to_hex();
        format!("{handle} {} {device}", export.bytes)
    }

    /// Parses [`export_line`].
    pub fn parse_export_line(line: &str) -> Result<IpcExport, String> {
        let w: Vec<&str> = line.split_whitespace().collect();
        let parsed = match w[..] {
            [handle, bytes, device] => bytes.parse().ok().and_then(|b| IpcExport::from_hex(handle, b, device)),
            _ => None,
        };
        parsed.ok_or_else(|| format!("malformed peer export line `{line}`"))
    }

    /// The peer side: a cache on `dev` in the peer layout, exported. Keep the returned memory
    /// (and the device) alive while the driving side copies into it.
    pub fn peer_cache(dev: &CudaDevice, cfg: &IpcBenchConfig) -> Result<(Arc<DeviceKvMemory>, IpcExport), String> {
        let l = cfg.peer_layout();
        let cache = dev.zeros_exportable::<u16>(l.num_blocks * l.block_elems()).map_err(|e| e.to_string())?;
        let mem = dev.kv_memory(&cache, l, tandem_compute::KvDtype::Bf16).map_err(|e| e.to_string())?;
        let export = mem.export().map_err(|e| e.to_string())?;
        // The buffer's allocation lives on in `mem`.
        drop(cache);
        Ok((mem, export))
    }

    use std::sync::Arc;

    fn median(mut v: Vec<f64>) -> f64 {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    }

    /// Fences of four layer groups recorded on `dev`'s idle stream (complete at once).
    fn layer_group_fences(dev: &CudaDevice, num_layers: usize) -> Result<KvFences, String> {
        let mut fences = KvFences::complete();
        let per = num_layers.div_ceil(4).max(1);
        for start in (0..num_layers).step_by(per) {
            fences.record(dev, start..(start + per).min(num_layers)).map_err(|e| e.to_string())?;
        }
        Ok(fences)
    }

    /// The driving side: copies into the peer's exported cache, and the same copies inside our
    /// own, for each size; and `other`'s writes into the peer's second set, when given. Our
    /// cache holds seeded values, so what lands can be checked.
    pub fn measure(
        dev: &CudaDevice,
        cfg: &IpcBenchConfig,
        export: &IpcExport,
        mut other: Option<&mut dyn PeerWriter>,
    ) -> Result<IpcReport, String> {
        let l = cfg.layout();
        let cache = dev.zeros_exportable::<u16>(l.num_blocks * l.block_elems()).map_err(|e| e.to_string())?;
        // Safety: the buffer just allocated, `l.num_blocks * l.block_elems()` bf16.
        unsafe { tandem_compute::cuda::ops::preset_uniform(dev, cache.ptr(), cache.len() as u64, 0xb10c, 1.0) }
            .and_then(|()| dev.synchronize())
            .map_err(|e| e.to_string())?;
        let ours = dev.kv_memory(&cache, l, tandem_compute::KvDtype::Bf16).map_err(|e| e.to_string())?;
        let peer: PeerKvMemory = ours.open_peer(export, cfg.peer_layout())?;
        if let Some(w) = other.as_deref_mut() {
            w.attach(&ours)?;
        }
        let mut rows = Vec::new();
        for &size in &cfg.sizes {
            let tokens = cfg.tokens_of(size);
            let src = cfg.source_table(tokens);
            let floor_dst = table(src.len(), cfg.runs, l.num_blocks / 2);
            let peer_dst = cfg.peer_table(tokens, 0);
            let (mut floor, mut ipc, mut grouped, mut others, mut reads, mut copies) =
                (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new(), 0);
            let bytes = (tokens * l.block_elems() / l.block_size * 2) as f64;
            for _ in 0..cfg.repeats.max(1) + 1 {
                if let Some(w) = other.as_deref_mut() {
                    let dst = cfg.peer_table(tokens, 1);
                    let t = Instant::now();
                    w.write(&src, &dst, tokens)?;
                    others.push(bytes / t.elapsed().as_secs_f64() / 1e9);
                    // And back, into the floor's half of our cache (rewritten below anyway).
                    let t = Instant::now();
                    w.read(&dst, &floor_dst, tokens)?;
                    reads.push(bytes / t.elapsed().as_secs_f64() / 1e9);
                }
                let t = Instant::now();
                let moved = ours.copy_within(&src, &floor_dst, tokens)?;
                floor.push(moved as f64 / t.elapsed().as_secs_f64() / 1e9);
                let t = Instant::now();
                let (moved, n) = ours.write_to_peer(&peer, &src, &peer_dst, tokens, &KvFences::complete())?;
                ipc.push(moved as f64 / t.elapsed().as_secs_f64() / 1e9);
                copies = n;
                let fences = layer_group_fences(dev, l.num_layers)?;
                let t = Instant::now();
                let (moved, _) = ours.write_to_peer(&peer, &src, &peer_dst, tokens, &fences)?;
                grouped.push(moved as f64 / t.elapsed().as_secs_f64() / 1e9);
            }
            // The first round warms the mapping and the copy engines up.
            let (floor, ipc) = (median(floor[1..].to_vec()), median(ipc[1..].to_vec()));
            let layer_groups_gb_s = median(grouped[1..].to_vec());
            let other = (!others.is_empty()).then(|| median(others[1..].to_vec())).map(|gb_s| (gb_s, gb_s / ipc));
            let other_read_gb_s = (!reads.is_empty()).then(|| median(reads[1..].to_vec()));
            rows.push(IpcRow {
                bytes: tokens * l.block_elems() / l.block_size * 2,
                copies,
                device_copy_gb_s: floor,
                cuda_ipc_gb_s: ipc,
                ratio: ipc / floor,
                layer_groups_gb_s,
                other,
                other_read_gb_s,
            });
        }
        Ok(IpcReport {
            placement: format!("{} -> {}", ours.describe(), peer.place()),
            block_sizes: (l.block_size, cfg.peer_block_size),
            rows,
            other: other.map(|w| w.name().to_string()),
        })
    }
}
