//! `tandem bench kv --transport nixl`: NIXL WRITEs of a request-shaped KV set (block runs with
//! gaps, as [`KvBenchConfig`] lays them out) from this process's host KV memory into a peer
//! process's, each with a notification, against a host `memcpy` of the same copies measured
//! in the same run (the floor on one machine: NIXL between processes of one host moves bytes
//! through shared memory at best).
//!
//! The peer ([`serve_peer`]) registers its KV memory, prints one line with its agent name,
//! region and metadata, waits for every transfer's notification, then prints the digest of
//! the blocks that landed; [`measure`] checks it against its own, so a fast write that did not
//! land is an error, not a number.

use std::time::{Duration, Instant};

use serde::Serialize;
use tandem_compute::kv_copy::{plan_kv_copy, run_kv_copy_on_host};
use tandem_compute::KvCache;
use tandem_kv::nixl::{NixlEndpoint, NixlPlace, NixlRegion, NixlRun, NixlScratch};
use tandem_kv::KvMemory;

use crate::kv::KvBenchConfig;

const PEER_AGENT: &str = "tandem-bench-kv-peer";
const DRIVER_AGENT: &str = "tandem-bench-kv-driver";

/// A host KV cache of the benchmark's layout, each block filled with its index (the peer's
/// stays zero until written), registered with NIXL.
struct Side {
    cache: KvCache,
    endpoint: NixlEndpoint,
}

impl Side {
    fn new(cfg: &KvBenchConfig, name: &str, fill: bool) -> Result<Self, String> {
        let layout = cfg.pool_layout();
        let mut cache = KvCache::new(layout);
        if fill {
            for (i, &b) in cfg.table().iter().enumerate() {
                let k = vec![i as f32 + 1.0; layout.num_kv_heads * layout.head_dim];
                for slot in 0..layout.block_size {
                    for layer in 0..layout.num_layers {
                        cache.write_token(layer, b as usize, slot, &k, &k);
                    }
                }
            }
        }
        let (addr, len) = cache.region().address_range();
        let endpoint = NixlEndpoint::open(name, NixlRegion { addr, len, place: NixlPlace::Dram }, NixlScratch::host())
            .map_err(|e| e.to_string())?;
        Ok(Self { cache, endpoint })
    }

    /// The digest of the table's blocks (what a `--kv-verify` transfer compares).
    fn digest(&self, cfg: &KvBenchConfig) -> Result<u64, String> {
        let table = cfg.table();
        let memory: KvMemory = self.cache.region().into();
        // Safety: this benchmark's memory; no writer is running (every transfer has landed).
        unsafe { memory.digest(&table, table.len() * cfg.layout.block_size) }.map_err(|e| e.to_string())
    }
}

/// The peer process: prints `AGENT ADDR LEN METADATA` (its endpoint), waits for the
/// notifications of `cfg.repeats` transfers, then prints `digest HEX` of what landed.
pub fn serve_peer(cfg: &KvBenchConfig, out: &mut dyn std::io::Write) -> Result<(), String> {
    let side = Side::new(cfg, PEER_AGENT, false)?;
    let r = side.endpoint.region();
    let metadata = side.endpoint.metadata_hex().map_err(|e| e.to_string())?;
    writeln!(out, "{PEER_AGENT} {} {} {metadata}", r.addr, r.len).map_err(|e| e.to_string())?;
    out.flush().map_err(|e| e.to_string())?;
    for i in 0..cfg.repeats {
        let message = format!("bench-{i}");
        side.endpoint
            .wait_notification(DRIVER_AGENT, message.as_bytes(), Duration::from_secs(120))
            .map_err(|e| e.to_string())?;
    }
    writeln!(out, "digest {:016x}", side.digest(cfg)?).map_err(|e| e.to_string())?;
    out.flush().map_err(|e| e.to_string())
}

/// The measured rates.
#[derive(Clone, Debug, Serialize)]
pub struct NixlBenchReport {
    /// Where each side's KV lives.
    pub memory: String,
    /// Bytes per transfer.
    pub bytes: u64,
    /// Blocks per transfer.
    pub blocks: usize,
    /// NIXL descriptors per transfer (the copy plan's copies).
    pub descriptors: usize,
    /// NIXL WRITE to completion, best, GB/s.
    pub nixl_best_gb_s: f64,
    /// NIXL WRITE to completion, median, GB/s.
    pub nixl_median_gb_s: f64,
    /// The same copies as a host memcpy in this process, median, GB/s.
    pub memcpy_median_gb_s: f64,
    /// nixl_median / memcpy_median.
    pub ratio: f64,
}

impl std::fmt::Display for NixlBenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "KV over NIXL ({}), {} bytes in {} blocks, {} descriptors",
            self.memory, self.bytes, self.blocks, self.descriptors
        )?;
        writeln!(f, "{:<44} {:>10} {:>10}", "", "median", "best")?;
        writeln!(
            f,
            "{:<44} {:>7.2} GB/s {:>7.2} GB/s",
            "NIXL WRITE + notification, to completion", self.nixl_median_gb_s, self.nixl_best_gb_s
        )?;
        writeln!(f, "{:<44} {:>7.2} GB/s", "host memcpy of the same copies (floor)", self.memcpy_median_gb_s)?;
        writeln!(f, "NIXL / memcpy: {:.0}%", 100.0 * self.ratio)
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The driving side: `peer_line` is the peer's first line; `peer_rest` reads its last.
pub fn measure(
    cfg: &KvBenchConfig,
    peer_line: &str,
    peer_rest: &mut dyn FnMut() -> Result<String, String>,
) -> Result<NixlBenchReport, String> {
    let parts: Vec<&str> = peer_line.split_whitespace().collect();
    let [agent, addr, len, metadata] = parts[..] else {
        return Err(format!("the peer said `{peer_line}`, not its NIXL endpoint"));
    };
    let peer_region = NixlRegion {
        addr: addr.parse().map_err(|_| "bad peer address")?,
        len: len.parse().map_err(|_| "bad peer length")?,
        place: NixlPlace::Dram,
    };
    let side = Side::new(cfg, DRIVER_AGENT, true)?;
    let loaded = side.endpoint.add_peer_hex(metadata).map_err(|e| e.to_string())?;
    if loaded != agent {
        return Err(format!("the peer's metadata names `{loaded}`, not `{agent}`"));
    }
    let layout = cfg.pool_layout();
    let table = cfg.table();
    let tokens = table.len() * layout.block_size;
    let plan = plan_kv_copy(&layout, &layout, 4, &table, &table, tokens)?;
    let runs = NixlRun::from_plan(&plan);
    let bytes: usize = runs.iter().map(|r| r.len).sum();
    let mut rates = Vec::new();
    for i in 0..cfg.repeats {
        let message = format!("bench-{i}");
        let start = Instant::now();
        side.endpoint
            .write(agent, peer_region, &runs, Some(message.as_bytes()), Duration::from_secs(120))
            .map_err(|e| e.to_string())?;
        rates.push(bytes as f64 / start.elapsed().as_secs_f64() / 1e9);
    }
    let want = format!("digest {:016x}", side.digest(cfg)?);
    let got = peer_rest()?;
    if got.trim() != want {
        return Err(format!(
            "the peer's blocks differ from what was written: it says `{}`, ours is `{want}`",
            got.trim()
        ));
    }
    // The floor, same copies, same machine, this process: into a second host cache.
    let target = KvCache::new(layout);
    let (region, target_region) = (side.cache.region(), target.region());
    let mut copy_rates = Vec::new();
    for _ in 0..cfg.repeats {
        // Safety: both caches belong to this benchmark and nothing else touches them.
        let (src, dst) = unsafe { (region.bytes(0, layout.num_blocks), target_region.bytes_mut(0, layout.num_blocks)) };
        let start = Instant::now();
        run_kv_copy_on_host(&plan, src, dst);
        copy_rates.push(bytes as f64 / start.elapsed().as_secs_f64() / 1e9);
    }
    let best = rates.iter().cloned().fold(0.0, f64::max);
    let (nixl_median, memcpy_median) = (median(rates), median(copy_rates));
    Ok(NixlBenchReport {
        memory: "host memory (f32), peer in another process".into(),
        bytes: bytes as u64,
        blocks: table.len(),
        descriptors: runs.len(),
        nixl_best_gb_s: best,
        nixl_median_gb_s: nixl_median,
        memcpy_median_gb_s: memcpy_median,
        ratio: nixl_median / memcpy_median,
    })
}

/// `bench kv --transport nixl --device cuda:N`: NIXL WRITEs from this process's GPU cache into
/// a peer process's (both registered as VRAM), measured beside cuda-ipc into the same peer
/// cache in the same run ([`crate::kv::cuda_ipc::measure`] with this as its other writer).
/// The peer ([`gpu::serve_peer`]) prints its cuda-ipc export and its NIXL endpoint, waits for
/// every write's notification, then prints the digest of the last size's blocks as they
/// landed in its second set, which [`gpu::NixlGpuWriter::check_landed`] compares with ours.
pub mod gpu {
    use std::sync::Arc;
    use std::time::Duration;

    use tandem_compute::cuda::{CudaDevice, DeviceKvMemory};
    use tandem_compute::kv_copy::plan_kv_copy;
    use tandem_kv::nixl::{NixlEndpoint, NixlPlace, NixlRegion, NixlRun};

    use super::{DRIVER_AGENT, PEER_AGENT};
    use crate::kv::cuda_ipc::{self, IpcBenchConfig, PeerWriter};

    /// How long one write or the wait for its notification may take.
    const BOUND: Duration = Duration::from_secs(120);

    /// How many writes the driver makes (and the peer waits for).
    fn writes(cfg: &IpcBenchConfig) -> usize {
        cfg.sizes.len() * (cfg.repeats.max(1) + 1)
    }

    /// The peer process: a cache on `dev` with two destination sets, exported for cuda-ipc and
    /// registered with NIXL; prints both (two lines), waits for every NIXL write's
    /// notification, then prints `digest HEX` of the last size's second set.
    pub fn serve_peer(dev: &CudaDevice, cfg: &IpcBenchConfig, out: &mut dyn std::io::Write) -> Result<(), String> {
        let (memory, export) = cuda_ipc::peer_cache(dev, cfg)?;
        let ep = NixlEndpoint::open_gpu(PEER_AGENT, &memory).map_err(|e| e.to_string())?;
        let metadata = ep.metadata_hex().map_err(|e| e.to_string())?;
        let r = ep.region();
        writeln!(out, "{}", cuda_ipc::export_line(&export)).map_err(|e| e.to_string())?;
        writeln!(out, "{PEER_AGENT} {} {} {} {metadata}", r.addr, r.len, memory.ordinal())
            .map_err(|e| e.to_string())?;
        out.flush().map_err(|e| e.to_string())?;
        for i in 0..writes(cfg) {
            ep.wait_notification(DRIVER_AGENT, format!("bench-{i}").as_bytes(), BOUND).map_err(|e| e.to_string())?;
        }
        let tokens = cfg.tokens_of(cfg.sizes.last().copied().unwrap_or(0));
        let digest = memory.digest(&cfg.peer_table(tokens, 1), tokens)?;
        writeln!(out, "digest {digest:016x}").map_err(|e| e.to_string())?;
        out.flush().map_err(|e| e.to_string())
    }

    /// The driver's NIXL side, from the peer's second line.
    pub struct NixlGpuWriter {
        cfg: IpcBenchConfig,
        peer_agent: String,
        peer_region: NixlRegion,
        peer_metadata: String,
        endpoint: Option<NixlEndpoint>,
        ours: Option<Arc<DeviceKvMemory>>,
        sent: usize,
        /// The last write's source blocks and tokens (what the peer's digest covers).
        last: Option<(Vec<u32>, usize)>,
    }

    impl NixlGpuWriter {
        /// Parses the peer's `AGENT ADDR LEN GPU METADATA` line.
        pub fn new(cfg: &IpcBenchConfig, peer_line: &str) -> Result<Self, String> {
            let parts: Vec<&str> = peer_line.split_whitespace().collect();
            let [agent, addr, len, gpu, metadata] = parts[..] else {
                return Err(format!("the peer said `{peer_line}`, not its NIXL endpoint"));
            };
            let number = |s: &str| s.parse::<usize>().map_err(|_| format!("bad number `{s}` in the peer's line"));
            let place = NixlPlace::Vram(number(gpu)? as u32);
            Ok(Self {
                cfg: cfg.clone(),
                peer_agent: agent.to_string(),
                peer_region: NixlRegion { addr: number(addr)?, len: number(len)?, place },
                peer_metadata: metadata.to_string(),
                endpoint: None,
                ours: None,
                sent: 0,
                last: None,
            })
        }

        /// Checks the peer's `digest HEX` line against the digest of what we last wrote.
        pub fn check_landed(&self, peer_line: &str) -> Result<(), String> {
            let (Some(ours), Some((src, tokens))) = (&self.ours, &self.last) else {
                return Err("nothing was written".into());
            };
            let want = format!("digest {:016x}", ours.digest(src, *tokens)?);
            if peer_line.trim() != want {
                return Err(format!(
                    "the peer's blocks differ from what NIXL wrote: it says `{}`, ours is `{want}`",
                    peer_line.trim()
                ));
            }
            Ok(())
        }
    }

    impl PeerWriter for NixlGpuWriter {
        fn name(&self) -> &'static str {
            "nixl"
        }

        fn attach(&mut self, ours: &Arc<DeviceKvMemory>) -> Result<(), String> {
            let ep = NixlEndpoint::open_gpu(DRIVER_AGENT, ours).map_err(|e| e.to_string())?;
            let loaded = ep.add_peer_hex(&self.peer_metadata).map_err(|e| e.to_string())?;
            if loaded != self.peer_agent {
                return Err(format!("the peer's metadata names `{loaded}`, not `{}`", self.peer_agent));
            }
            self.endpoint = Some(ep);
            self.ours = Some(ours.clone());
            Ok(())
        }

        fn write(&mut self, src: &[u32], dst: &[u32], tokens: usize) -> Result<(), String> {
            let (Some(ep), Some(ours)) = (&self.endpoint, &self.ours) else {
                return Err("write before attach".into());
            };
            let plan = plan_kv_copy(ours.layout(), &self.cfg.peer_layout(), ours.elem_bytes(), src, dst, tokens)?;
            let message = format!("bench-{}", self.sent);
            ep.write(&self.peer_agent, self.peer_region, &NixlRun::from_plan(&plan), Some(message.as_bytes()), BOUND)
                .map_err(|e| e.to_string())?;
            self.sent += 1;
            self.last = Some((src.to_vec(), tokens));
            Ok(())
        }

        fn read(&mut self, src: &[u32], dst: &[u32], tokens: usize) -> Result<(), String> {
            let (Some(ep), Some(ours)) = (&self.endpoint, &self.ours) else {
                return Err("read before attach".into());
            };
            // The plan's source is the peer's blocks, its destination ours.
            let plan = plan_kv_copy(&self.cfg.peer_layout(), ours.layout(), ours.elem_bytes(), src, dst, tokens)?;
            ep.read(&self.peer_agent, self.peer_region, &NixlRun::from_read_plan(&plan), BOUND)
                .map_err(|e| e.to_string())
        }
    }
}
