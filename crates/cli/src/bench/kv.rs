//! `tandem bench kv` and `bench kv-peer`: KV moved between two engines' caches by each
//! transport, against its floor (raw loopback TCP, device copies) in the same run.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::engine::{kernel_cache_dir, parse_bytes, KvCacheDtype};

#[derive(Args, Debug, Clone)]
pub struct BenchKvArgs {
    /// tcp: the TCP transport against raw loopback TCP (host memory, or with --device a GPU
    /// engine's cache and its host copy on each side); cuda-ipc: device copies into a peer
    /// process's GPU cache against the same copies inside one GPU; nixl: NIXL WRITEs into a
    /// peer process's host KV memory against a host memcpy of the same copies, or with
    /// --device between two processes' GPU caches beside cuda-ipc (the cuda-ipc table plus a
    /// nixl column).
    #[arg(long, value_enum, default_value = "tcp")]
    pub transport: BenchKvTransport,
    /// Size of the KV set moved per transfer (tcp, nixl), e.g. 256MiB.
    #[arg(long, default_value = "256MiB")]
    pub size: String,
    /// tcp: the KV of this many tokens per transfer instead of --size, so that caches of
    /// different element types (--kv-cache-dtype) move the same prompt.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub tokens: Option<u64>,
    /// tcp: each side's cache element type, one run each, compared in the last line (e.g.
    /// `auto,fp8` with --tokens: what an FP8 cache saves a transfer). auto: f32 in host
    /// memory (a CPU engine's cache), bf16 with --device.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "auto")]
    pub kv_cache_dtype: Vec<KvCacheDtype>,
    /// cuda-ipc, and nixl with --device: sizes moved, one row each.
    #[arg(long, value_delimiter = ',', default_value = "1MiB,16MiB,64MiB,256MiB,1GiB")]
    pub sizes: Vec<String>,
    /// The GPU of this (the writing) process. cuda-ipc: default cuda:0. tcp: both sides' KV
    /// in this GPU's memory, moved as a GPU engine's connector moves it (copies to and from the
    /// page-locked host copy overlapping the socket, piece by piece); default: host memory.
    #[arg(long)]
    pub device: Option<String>,
    /// cuda-ipc, nixl: the GPU of the peer process (default: the same as --device).
    #[arg(long)]
    pub peer_device: Option<String>,
    /// cuda-ipc: tokens per block in the peer's cache (ours is 16; another size makes every
    /// copy a pitched one, as between engines with different --block-size).
    #[arg(long, default_value_t = 16)]
    pub peer_block_size: usize,
    /// Transfers of each kind (raw and KV); median and best are reported.
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// tcp: every transfer carries a CRC-32 of its bytes, checked where they land
    /// (`--kv-verify`), to measure what verifying costs.
    #[arg(long)]
    pub verify: bool,
    /// tcp: TCP streams the KV bytes are striped over (`--kv-tcp-streams`), against raw TCP
    /// over as many streams (the set split evenly) in the same run.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub tcp_streams: u16,
    /// tcp: the KV transport's connection and streams over TLS (rustls, with a throwaway CA and
    /// certificate for 127.0.0.1 made for the run), against raw plain TCP in the same run: what
    /// `--tls-cert` costs.
    #[arg(long)]
    pub tls: bool,
    /// tcp over TLS: whether each connection's bulk bytes are written and read by threads of
    /// its own while the cipher works (`auto`: as an engine does, on machines of 8 cores or
    /// more and 4 for each stream), to measure what they give.
    #[arg(long, value_enum, default_value_t = TlsPipes::Auto)]
    pub tls_pipes: TlsPipes,
    /// The peer process: where the driver wrote the run's TLS material.
    #[arg(long, hide = true)]
    pub tls_dir: Option<PathBuf>,
    /// tcp: this process on the first half of the CPUs it may use and the peer on the other
    /// half (through `taskset`), as two hosts would each have their own cores: on one host both
    /// ends' copies (and with --tls both ends' ciphers) otherwise share them.
    #[arg(long)]
    pub split_cpus: bool,
    /// Write the report as JSON here too.
    #[arg(long)]
    pub json_out: Option<PathBuf>,
}

/// The CPUs this process may run on (Linux: `Cpus_allowed_list` of /proc/self/status).
fn allowed_cpus() -> Result<Vec<usize>> {
    let status = std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .context("/proc/self/status has no Cpus_allowed_list")?;
    let mut cpus = Vec::new();
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let (lo, hi): (usize, usize) = (lo.parse()?, hi.parse()?);
        cpus.extend(lo..=hi);
    }
    Ok(cpus)
}

/// `--split-cpus`: moves this process (every thread, and what it starts later) onto the first
/// half of its CPUs; returns the other half, as `taskset -c` takes it, for the peer.
fn split_cpus() -> Result<String> {
    let cpus = allowed_cpus()?;
    if cpus.len() < 2 {
        bail!("--split-cpus needs at least 2 CPUs; this process may use {}", cpus.len());
    }
    let list = |c: &[usize]| c.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
    let (ours, theirs) = cpus.split_at(cpus.len() / 2);
    let pinned = std::process::Command::new("taskset")
        .args(["-a", "-p", "-c", &list(ours), &std::process::id().to_string()])
        .stdout(std::process::Stdio::null())
        .status()
        .context("running taskset (util-linux) for --split-cpus")?;
    if !pinned.success() {
        bail!("taskset could not pin this process to CPUs {} ({pinned})", list(ours));
    }
    eprintln!("... this process on CPUs {}, the peer on {} (--split-cpus)", list(ours), list(theirs));
    Ok(list(theirs))
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum TlsPipes {
    Auto,
    On,
    Off,
}

impl TlsPipes {
    /// As `--tls-pipes` takes it (for the peer process).
    fn as_arg(self) -> &'static str {
        match self {
            TlsPipes::Auto => "auto",
            TlsPipes::On => "on",
            TlsPipes::Off => "off",
        }
    }
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BenchKvTransport {
    Tcp,
    CudaIpc,
    /// NIXL WRITEs with a notification into a peer process's KV memory: host memory against
    /// a host memcpy of the same copies, or with --device GPU memory beside cuda-ipc (a tandem
    /// built with `--features nixl`).
    Nixl,
}

/// The configuration of a tcp (or nixl) run with caches of `dtype`.
fn kv_bench_config(a: &BenchKvArgs, dtype: KvCacheDtype) -> Result<tandem_bench::kv::KvBenchConfig> {
    let bytes = parse_bytes(&a.size).map_err(anyhow::Error::msg)?;
    if bytes == 0 {
        bail!("--size must be more than 0 bytes");
    }
    let cfg = tandem_bench::kv::KvBenchConfig {
        bytes,
        tokens: a.tokens.map(|t| t as usize),
        cache_dtype: (dtype == KvCacheDtype::Fp8).then_some(tandem_compute::KvDtype::Fp8E4m3),
        repeats: a.repeats.max(1),
        verify: a.verify,
        kernel_cache: kernel_cache_dir(),
        streams: a.tcp_streams.into(),
        tls: match &a.tls_dir {
            Some(dir) => {
                let tls = tandem_bench::kv::read_bench_certificates(dir).map_err(anyhow::Error::msg)?;
                Some(match a.tls_pipes {
                    TlsPipes::Auto => tls.for_streams(a.tcp_streams.into()),
                    TlsPipes::On => tls.with_pipes(true),
                    TlsPipes::Off => tls.with_pipes(false),
                })
            }
            None => None,
        },
        ..Default::default()
    };
    match a.device.as_deref().map(str::parse::<tandem_compute::cuda::DeviceSpec>) {
        None | Some(Ok(tandem_compute::cuda::DeviceSpec::Cpu)) => Ok(cfg),
        Some(Ok(tandem_compute::cuda::DeviceSpec::Cuda(n))) => Ok(cfg.on_gpu(n)),
        Some(Err(e)) => bail!("--device: {e}"),
    }
}

/// Starts the peer as a second process (this same binary), reads its port, measures, and
/// waits for the peer to exit.
pub(crate) fn bench_kv(a: BenchKvArgs) -> Result<()> {
    if a.split_cpus && a.transport != BenchKvTransport::Tcp {
        bail!("--split-cpus is for --transport tcp (the other transports' copies are the devices' or UCX's)");
    }
    if a.transport != BenchKvTransport::Tcp && (a.tokens.is_some() || a.kv_cache_dtype != [KvCacheDtype::Auto]) {
        bail!("--tokens and --kv-cache-dtype are for --transport tcp (the others move bf16 bytes by --sizes)");
    }
    if a.transport == BenchKvTransport::CudaIpc {
        return bench_kv_cuda_ipc(a);
    }
    if a.transport == BenchKvTransport::Nixl {
        return bench_kv_nixl(a);
    }
    let mut a = a;
    if a.tls && a.tls_dir.is_none() {
        let dir = std::env::temp_dir().join(format!("tandem-bench-kv-tls-{}", std::process::id()));
        tandem_bench::kv::write_bench_certificates(&dir).map_err(anyhow::Error::msg)?;
        a.tls_dir = Some(dir);
    }
    let peer_cpus = if a.split_cpus { Some(split_cpus()?) } else { None };
    let mut reports = Vec::new();
    let mut failed = None;
    for &dtype in &a.kv_cache_dtype {
        match bench_kv_tcp_run(&a, dtype, peer_cpus.as_deref()) {
            Ok(report) => {
                print!("{report}");
                reports.push(report);
            }
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    if let Some(dir) = a.tls_dir.as_ref().filter(|_| a.tls) {
        let _ = std::fs::remove_dir_all(dir);
    }
    if let Some(e) = failed {
        return Err(e);
    }
    if let [first, rest @ ..] = &reports[..] {
        for r in rest {
            println!(
                "{} against {}: {:.2}x the bytes a token, a transfer of {} tokens {:.2}x the time (median)",
                r.dtype,
                first.dtype,
                r.bytes_per_token as f64 / first.bytes_per_token as f64,
                r.tokens,
                (r.kv_median_ms / r.tokens as f64) / (first.kv_median_ms / first.tokens as f64),
            );
        }
    }
    if let Some(path) = &a.json_out {
        // One run: its report, as before; several: a list of them.
        let json = match &reports[..] {
            [one] => serde_json::to_string_pretty(one)?,
            all => serde_json::to_string_pretty(all)?,
        };
        std::fs::write(path, json).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// One tcp run with caches of `dtype`: a peer process (on `peer_cpus` when given), measured,
/// then waited for.
fn bench_kv_tcp_run(
    a: &BenchKvArgs,
    dtype: KvCacheDtype,
    peer_cpus: Option<&str>,
) -> Result<tandem_bench::kv::KvBenchReport> {
    use std::io::BufRead;
    let cfg = kv_bench_config(a, dtype)?;
    cfg.check().map_err(anyhow::Error::msg)?;
    let exe = std::env::current_exe().context("locating the tandem binary")?;
    let mut peer = match peer_cpus {
        Some(cpus) => {
            let mut c = std::process::Command::new("taskset");
            c.args(["-c", cpus]).arg(exe);
            c
        }
        None => std::process::Command::new(exe),
    };
    let dtype_arg = match dtype {
        KvCacheDtype::Auto => "auto",
        KvCacheDtype::Fp8 => "fp8",
    };
    let mut child = peer
        .args(["--log", "warn", "bench", "kv-peer", "--size", &a.size, "--repeats", &a.repeats.to_string()])
        .args(["--tcp-streams", &a.tcp_streams.to_string(), "--kv-cache-dtype", dtype_arg])
        .args(a.tokens.map(|t| ["--tokens".to_string(), t.to_string()]).into_iter().flatten())
        .args(a.tls_dir.iter().flat_map(|d| ["--tls-dir".into(), d.display().to_string()]))
        .args(["--tls-pipes", a.tls_pipes.as_arg()])
        .args(a.device.as_ref().map(|d| ["--device", d.as_str()]).into_iter().flatten())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("starting the peer process")?;
    let stdout = child.stdout.take().context("peer stdout")?;
    let mut line = String::new();
    std::io::BufReader::new(stdout).read_line(&mut line).context("reading the peer's address")?;
    let addr = line.trim().to_string();
    let what = match a.tokens {
        Some(t) => format!("{t} tokens of {} KV", cfg.dtype().name()),
        None => a.size.clone(),
    };
    eprintln!("... peer process {} listening on {addr}; moving {} x {what} each way", child.id(), a.repeats);
    wait_peer(child, tandem_bench::kv::measure(&addr, &cfg).map_err(anyhow::Error::from))
}

/// Waits for the peer process, then gives the report: its error first, else the peer's failure.
fn wait_peer<R>(mut peer: std::process::Child, report: Result<R>) -> Result<R> {
    let status = peer.wait().context("waiting for the peer")?;
    let report = report?;
    if !status.success() {
        bail!("the peer process failed ({status})");
    }
    Ok(report)
}

/// One cache element type for the transports and the peer process, which run one at a time.
fn one_dtype(a: &BenchKvArgs) -> Result<KvCacheDtype> {
    match a.kv_cache_dtype[..] {
        [one] => Ok(one),
        _ => bail!("--kv-cache-dtype takes one type here (several only for bench kv --transport tcp)"),
    }
}

/// Waits for the peer process, then prints the report (and writes it as JSON to `json_out`).
fn finish_bench_kv<R: std::fmt::Display + serde::Serialize>(
    peer: std::process::Child,
    report: Result<R>,
    json_out: Option<std::path::PathBuf>,
) -> Result<()> {
    let report = wait_peer(peer, report)?;
    print!("{report}");
    if let Some(path) = json_out {
        std::fs::write(&path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

fn ipc_bench_config(a: &BenchKvArgs) -> Result<tandem_bench::kv::cuda_ipc::IpcBenchConfig> {
    let sizes = a.sizes.iter().map(|s| parse_bytes(s).map_err(anyhow::Error::msg)).collect::<Result<Vec<_>>>()?;
    if sizes.is_empty() || sizes.contains(&0) {
        bail!("--sizes must list sizes of more than 0 bytes");
    }
    if a.peer_block_size == 0 {
        bail!("--peer-block-size must be at least 1");
    }
    Ok(tandem_bench::kv::cuda_ipc::IpcBenchConfig {
        sizes,
        repeats: a.repeats.max(1),
        peer_block_size: a.peer_block_size,
        ..Default::default()
    })
}

fn open_gpu(spec: &str) -> Result<tandem_compute::cuda::CudaDevice> {
    match spec.parse::<tandem_compute::cuda::DeviceSpec>().map_err(anyhow::Error::msg)? {
        tandem_compute::cuda::DeviceSpec::Cuda(n) => {
            tandem_compute::cuda::CudaDevice::open_with(n, Default::default(), kernel_cache_dir().as_deref())
                .with_context(|| format!("opening {spec}"))
        }
        tandem_compute::cuda::DeviceSpec::Cpu => bail!("{spec} is not a GPU (cuda:N)"),
    }
}

/// cuda-ipc: the peer process allocates and exports its cache, prints the export, and lives
/// until we close its stdin; we map it, copy into it, and compare with copies inside our GPU.
fn bench_kv_cuda_ipc(a: BenchKvArgs) -> Result<()> {
    use std::io::BufRead;
    let cfg = ipc_bench_config(&a)?;
    let device = a.device.clone().unwrap_or_else(|| "cuda:0".into());
    let peer_device = a.peer_device.clone().unwrap_or_else(|| device.clone());
    for spec in [&device, &peer_device] {
        if !matches!(spec.parse(), Ok(tandem_compute::cuda::DeviceSpec::Cuda(_))) {
            bail!("cuda-ipc moves GPU memory: give a GPU (cuda:N), not {spec}");
        }
    }
    let exe = std::env::current_exe().context("locating the tandem binary")?;
    let mut child = std::process::Command::new(exe)
        .args(["--log", "warn", "bench", "kv-peer", "--transport", "cuda-ipc", "--device", &peer_device])
        .args(["--sizes", &a.sizes.join(","), "--peer-block-size", &a.peer_block_size.to_string()])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("starting the peer process")?;
    let stdout = child.stdout.take().context("peer stdout")?;
    let mut line = String::new();
    std::io::BufReader::new(stdout).read_line(&mut line).context("reading the peer's export")?;
    let report =
        tandem_bench::kv::cuda_ipc::parse_export_line(line.trim()).map_err(anyhow::Error::msg).and_then(|export| {
            eprintln!("... peer process {} on {peer_device} exported its cache; copying from {device}", child.id());
            let dev = open_gpu(&device)?;
            tandem_bench::kv::cuda_ipc::measure(&dev, &cfg, &export, None).map_err(anyhow::Error::msg)
        });
    drop(child.stdin.take());
    finish_bench_kv(child, report, a.json_out)
}

pub(crate) fn bench_kv_peer(a: BenchKvArgs) -> Result<()> {
    if a.transport == BenchKvTransport::CudaIpc {
        use std::io::Read;
        let cfg = ipc_bench_config(&a)?;
        let dev = open_gpu(a.device.as_deref().unwrap_or("cuda:0"))?;
        let (_memory, export) = tandem_bench::kv::cuda_ipc::peer_cache(&dev, &cfg).map_err(anyhow::Error::msg)?;
        println!("{}", tandem_bench::kv::cuda_ipc::export_line(&export));
        std::io::stdout().flush()?;
        // Alive (and the cache mapped) until the driving process closes our stdin.
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        return Ok(());
    }
    if a.transport == BenchKvTransport::Nixl {
        return bench_kv_nixl_peer(a);
    }
    let cfg = kv_bench_config(&a, one_dtype(&a)?)?;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").context("binding the peer listener")?;
    println!("{}", listener.local_addr()?);
    std::io::stdout().flush()?;
    tandem_bench::kv::serve_peer(listener, &cfg)?;
    Ok(())
}

/// `bench kv --transport nixl`: the peer is a second process (this binary) whose host KV
/// memory NIXL writes into.
#[cfg(feature = "nixl")]
fn bench_kv_nixl(a: BenchKvArgs) -> Result<()> {
    use std::io::BufRead;
    if a.device.as_deref().is_some_and(|d| d != "cpu") {
        return bench_kv_nixl_gpu(a);
    }
    let cfg = kv_bench_config(&a, one_dtype(&a)?)?;
    let exe = std::env::current_exe().context("locating the tandem binary")?;
    let mut child = std::process::Command::new(exe)
        .args(["--log", "warn", "bench", "kv-peer", "--transport", "nixl", "--size", &a.size])
        .args(["--repeats", &a.repeats.to_string()])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("starting the peer process")?;
    let mut lines = std::io::BufReader::new(child.stdout.take().context("peer stdout")?).lines();
    let first = lines.next().context("the peer exited before naming its NIXL endpoint")??;
    eprintln!("... peer process {} ready; {} NIXL writes of {}", child.id(), a.repeats, a.size);
    let mut rest = || match lines.next() {
        Some(Ok(line)) => Ok(line),
        _ => Err("the peer exited before reporting what landed".to_string()),
    };
    let report = tandem_bench::kv_nixl::measure(&cfg, &first, &mut rest).map_err(anyhow::Error::msg);
    finish_bench_kv(child, report, a.json_out)
}

#[cfg(not(feature = "nixl"))]
fn bench_kv_nixl(_: BenchKvArgs) -> Result<()> {
    bail!("this build has no NIXL (build tandem with `--features nixl`)")
}

/// `bench kv --transport nixl --device cuda:N`: NIXL WRITEs between two processes' GPU caches
/// (VRAM), beside cuda-ipc into the same peer cache, in one run.
#[cfg(feature = "nixl")]
fn bench_kv_nixl_gpu(a: BenchKvArgs) -> Result<()> {
    use std::io::BufRead;
    use tandem_bench::kv_nixl::gpu::NixlGpuWriter;
    let cfg = tandem_bench::kv::cuda_ipc::IpcBenchConfig { peer_sets: 2, ..ipc_bench_config(&a)? };
    let device = a.device.clone().unwrap_or_else(|| "cuda:0".into());
    let peer_device = a.peer_device.clone().unwrap_or_else(|| device.clone());
    let exe = std::env::current_exe().context("locating the tandem binary")?;
    let mut child = std::process::Command::new(exe)
        .args(["--log", "warn", "bench", "kv-peer", "--transport", "nixl", "--device", &peer_device])
        .args(["--sizes", &a.sizes.join(","), "--peer-block-size", &a.peer_block_size.to_string()])
        .args(["--repeats", &a.repeats.to_string()])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("starting the peer process")?;
    let mut lines = std::io::BufReader::new(child.stdout.take().context("peer stdout")?).lines();
    let mut next = |what: &str| match lines.next() {
        Some(Ok(line)) => Ok(line),
        _ => Err(anyhow::anyhow!("the peer exited before {what}")),
    };
    let report = (|| {
        let export = tandem_bench::kv::cuda_ipc::parse_export_line(next("exporting its cache")?.trim())
            .map_err(anyhow::Error::msg)?;
        let mut nixl = NixlGpuWriter::new(&cfg, &next("naming its NIXL endpoint")?).map_err(anyhow::Error::msg)?;
        eprintln!("... peer process {} on {peer_device} ready (cuda-ipc and NIXL); writing from {device}", child.id());
        let dev = open_gpu(&device)?;
        let report =
            tandem_bench::kv::cuda_ipc::measure(&dev, &cfg, &export, Some(&mut nixl)).map_err(anyhow::Error::msg)?;
        nixl.check_landed(&next("reporting what NIXL landed")?).map_err(anyhow::Error::msg)?;
        Ok(report)
    })();
    drop(child.stdin.take());
    finish_bench_kv(child, report, a.json_out)
}

#[cfg(feature = "nixl")]
fn bench_kv_nixl_peer(a: BenchKvArgs) -> Result<()> {
    if let Some(device) = a.device.as_ref().filter(|d| *d != "cpu") {
        use std::io::Read;
        let cfg = tandem_bench::kv::cuda_ipc::IpcBenchConfig { peer_sets: 2, ..ipc_bench_config(&a)? };
        let dev = open_gpu(device)?;
        tandem_bench::kv_nixl::gpu::serve_peer(&dev, &cfg, &mut std::io::stdout()).map_err(anyhow::Error::msg)?;
        // Alive (its cache mapped by the driver) until the driver closes our stdin.
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        return Ok(());
    }
    let cfg = kv_bench_config(&a, one_dtype(&a)?)?;
    tandem_bench::kv_nixl::serve_peer(&cfg, &mut std::io::stdout()).map_err(anyhow::Error::msg)
}

#[cfg(not(feature = "nixl"))]
fn bench_kv_nixl_peer(a: BenchKvArgs) -> Result<()> {
    bench_kv_nixl(a)
}
