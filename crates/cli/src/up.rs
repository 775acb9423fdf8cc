//! `tandem up`: prefill, decode and router on this machine as three child processes of this
//! binary, their logs prefixed with the role, all stopped together on Ctrl-C.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::engine::{EngineArgs, ModelArgs};
use crate::serve::{KvModeArg, KvTransportArg};

#[derive(Args, Debug)]
pub struct UpArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Given to both engines.
    #[command(flatten)]
    pub engine: EngineArgs,
    /// push or pull.
    #[arg(long, value_enum, default_value = "push")]
    pub kv_mode: KvModeArg,
    /// What the KV bytes travel over between the two engines: auto, tcp, cuda-ipc or nixl.
    #[arg(long, value_enum, default_value = "auto")]
    pub kv_transport: KvTransportArg,
    /// Check every KV transfer where it lands (see `tandem serve --help`).
    #[arg(long)]
    pub kv_verify: bool,
    /// Conditional disaggregation: prompts decode would compute at most this many tokens of
    /// (short ones, or a turn over a history decode holds) run on decode alone (see `tandem
    /// router --help`).
    #[arg(long)]
    pub local_prefill_max_tokens: Option<usize>,
    /// Router port (the OpenAI endpoint).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Prefill engine port.
    #[arg(long, default_value_t = 8100)]
    pub prefill_port: u16,
    /// Decode engine port.
    #[arg(long, default_value_t = 8200)]
    pub decode_port: u16,
    /// KV side-channel port of prefill (decode uses the next one).
    #[arg(long, default_value_t = 5600)]
    pub kv_port: u16,
    /// Model name clients use.
    #[arg(long, default_value = "tandem")]
    pub served_model_name: String,
    /// Seconds to wait for all three to become healthy.
    #[arg(long, default_value_t = 120)]
    pub ready_timeout_secs: u64,
    /// Log filter for the three processes.
    #[arg(long = "child-log", default_value = "info")]
    pub log: String,
    /// Once up, run a short sweep against the router (this mode; 2 request rates x 2 input
    /// lengths), print the table and the figure paths, then stop.
    #[arg(long)]
    pub bench: bool,
    /// Where `--bench` writes its results and figures.
    #[arg(long, default_value = "results-up")]
    pub bench_dir: PathBuf,
    /// Keys the router and both engines take (the router's first one is what it sends them).
    #[command(flatten)]
    pub auth: crate::auth::ApiKeyArgs,
    /// Given to the router and both engines (see `tandem serve --help`).
    #[command(flatten)]
    pub cluster: crate::auth::ClusterSecretArgs,
    /// Given to both engines (see `tandem serve --help`).
    #[command(flatten)]
    pub tls: crate::auth::TlsArgs,
}

pub(crate) struct Role {
    name: &'static str,
    child: Child,
}

/// Starts one child with its output streamed to ours, each line prefixed with `[name]`; its
/// TANDEM_API_KEY is `api_keys` (its --api-key keys, comma-separated: in its environment, not
/// on a command line others can list), none when `None`.
fn start(name: &'static str, args: &[String], api_keys: Option<&str>) -> Result<Role> {
    start_in(None, name, args, api_keys)
}

/// As `start`, inside network namespace `netns` when one is given (`ip netns exec` execs the
/// binary, so the child is the tandem process itself).
fn start_in(netns: Option<&Netns>, name: &'static str, args: &[String], api_keys: Option<&str>) -> Result<Role> {
    let exe = std::env::current_exe().context("locating the tandem binary")?;
    let mut command = match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", &ns.name]).arg(exe);
            c
        }
        None => Command::new(exe),
    };
    match api_keys {
        Some(keys) => command.env("TANDEM_API_KEY", keys),
        None => command.env_remove("TANDEM_API_KEY"),
    };
    let mut child = command
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting the {name} process"))?;
    for pipe in [
        child.stdout.take().map(|p| Box::new(p) as Box<dyn std::io::Read + Send>),
        child.stderr.take().map(|p| Box::new(p) as Box<dyn std::io::Read + Send>),
    ]
    .into_iter()
    .flatten()
    {
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                eprintln!("[{name:>7}] {line}");
            }
        });
    }
    Ok(Role { name, child })
}

impl Role {
    /// The process id.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Which process this is (prefill, decode, router, serve).
    pub(crate) fn name(&self) -> &'static str {
        self.name
    }
}

pub(crate) fn signal(r: &Role, sig: nix::sys::signal::Signal) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(r.child.id() as i32), sig);
}

/// Stops every child: SIGINT (their graceful shutdown), then SIGKILL after `grace`.
pub(crate) fn stop_all(roles: &mut [Role], grace: Duration) {
    for r in roles.iter() {
        signal(r, nix::sys::signal::Signal::SIGINT);
    }
    let deadline = Instant::now() + grace;
    for r in roles.iter_mut() {
        loop {
            match r.child.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) if Instant::now() >= deadline => {
                    let _ = r.child.kill();
                    let _ = r.child.wait();
                    break;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}

/// The first child that has exited, and how.
fn exited(roles: &mut [Role]) -> Option<(&'static str, String)> {
    roles.iter_mut().find_map(|r| match r.child.try_wait() {
        Ok(Some(status)) => Some((r.name, status.to_string())),
        _ => None,
    })
}

pub(crate) fn healthy(url: &str) -> bool {
    healthy_with(&reqwest::blocking::Client::new(), url)
}

fn healthy_with(http: &reqwest::blocking::Client, url: &str) -> bool {
    matches!(http.get(format!("{url}/health")).timeout(Duration::from_secs(2)).send(), Ok(r) if r.status().is_success())
}

pub fn up(a: UpArgs) -> Result<()> {
    let mode = match a.kv_mode {
        KvModeArg::Push => "push",
        KvModeArg::Pull => "pull",
    };
    crate::engine::check_tensor_parallel_kv(&a.model, &a.engine)?;
    let host = "127.0.0.1";
    // Every port must be free now: a server already there would answer our health checks.
    for (port, what) in [
        (a.port, "router port (--port)"),
        (a.prefill_port, "prefill port (--prefill-port)"),
        (a.decode_port, "decode port (--decode-port)"),
        (a.kv_port, "prefill KV port (--kv-port)"),
        (a.kv_port.wrapping_add(1), "decode KV port (--kv-port + 1)"),
    ] {
        if let Err(e) = std::net::TcpListener::bind((host, port)) {
            bail!("{host}:{port}, the {what}, is not free ({e}): stop what uses it or pick another port");
        }
    }
    let common = |port: u16| {
        let mut v = vec!["--log".to_string(), a.log.clone(), "serve".into()];
        v.extend(a.model.to_args());
        v.extend(a.engine.to_args());
        v.extend(["--host".into(), host.into(), "--port".into(), port.to_string()]);
        v.extend(["--kv-mode".into(), mode.into(), "--served-model-name".into(), a.served_model_name.clone()]);
        v.extend(["--kv-transport".into(), a.kv_transport.name().into()]);
        if a.kv_verify {
            v.push("--kv-verify".into());
        }
        if a.auth.api_key_for_metrics {
            v.push("--api-key-for-metrics".into());
        }
        v.extend(a.cluster.to_args());
        v.extend(a.tls.to_args());
        v
    };
    let has_tokenizer = match crate::engine::model_source(&a.model.model, a.model.model_seed)? {
        tandem_model::ModelSource::Dir(dir) => dir.join("tokenizer.json").is_file(),
        _ => true,
    };
    let mut p_args = common(a.prefill_port);
    p_args.extend(["--role".into(), "prefill".into(), "--kv-port".into(), a.kv_port.to_string()]);
    let mut d_args = common(a.decode_port);
    d_args.extend(["--role".into(), "decode".into(), "--kv-port".into(), (a.kv_port + 1).to_string()]);
    // With --tls-cert every HTTP port is HTTPS too, the router's included.
    let scheme = if a.tls.tls_cert.is_some() { "https" } else { "http" };
    let (p_url, d_url, r_url) = (
        format!("{scheme}://{host}:{}", a.prefill_port),
        format!("{scheme}://{host}:{}", a.decode_port),
        format!("{scheme}://{host}:{}", a.port),
    );
    let mut r_args: Vec<String> = vec![
        "--log".into(),
        a.log.clone(),
        "router".into(),
        "--mode".into(),
        mode.into(),
        "--prefill".into(),
        p_url.clone(),
        "--decode".into(),
        d_url.clone(),
        "--host".into(),
        host.into(),
        "--port".into(),
        a.port.to_string(),
    ];
    if let Some(n) = a.local_prefill_max_tokens {
        r_args.extend(["--local-prefill-max-tokens".into(), n.to_string()]);
    }
    r_args.extend(a.cluster.to_args());
    r_args.extend(a.tls.to_args());
    // Read here first, so a bad secret file stops `up` before any process starts.
    a.cluster.load()?;
    a.tls.load()?;
    let ca = a.tls.ca_pem()?;
    let http = crate::auth::blocking_client(ca.as_deref())?;

    let interrupted = Arc::new(AtomicBool::new(false));
    let flag = interrupted.clone();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    std::thread::spawn(move || {
        // Ctrl-C in a terminal, or SIGTERM from a process manager.
        rt.block_on(crate::serve::stop_signal());
        flag.store(true, Ordering::SeqCst);
    });

    eprintln!("tandem up: model {}, {mode} mode: prefill {p_url}, decode {d_url}, router {r_url}", a.model.model);
    let keys = a.auth.child_env()?;
    let keys = keys.as_deref();
    let mut roles =
        vec![start("prefill", &p_args, keys)?, start("decode", &d_args, keys)?, start("router", &r_args, keys)?];
    let deadline = Instant::now() + Duration::from_secs(a.ready_timeout_secs);
    let mut ready = false;
    while !interrupted.load(Ordering::SeqCst) {
        if let Some((name, status)) = exited(&mut roles) {
            stop_all(&mut roles, Duration::from_secs(5));
            if ready {
                bail!("the {name} process stopped while serving ({status}; its log is above); stopped the others");
            }
            bail!("the {name} process exited during start-up ({status}; its log is above)");
        }
        if !ready && healthy_with(&http, &r_url) {
            ready = true;
            eprintln!();
            eprintln!(
                "tandem is up ({mode} mode). OpenAI API at {r_url}/v1 (model name `{}`). Try:",
                a.served_model_name
            );
            eprintln!();
            // A model without a tokenizer takes token ids only.
            let prompt = if has_tokenizer { "\"Once upon a time\"" } else { "[1, 2, 3, 4]" };
            // With --api-key the request needs one (the shell's TANDEM_API_KEY, if that is where it came from).
            let auth = if keys.is_some() { " -H \"Authorization: Bearer $TANDEM_API_KEY\"" } else { "" };
            let cacert = a.tls.tls_ca.as_ref().map(|p| format!(" --cacert {}", p.display())).unwrap_or_default();
            eprintln!(
                "  curl -s{cacert} {r_url}/v1/completions -H 'content-type: application/json'{auth} \\\n    -d '{{\"model\": \"{}\", \"prompt\": {prompt}, \"max_tokens\": 16}}'",
                a.served_model_name
            );
            if a.model.model.starts_with("preset:") {
                eprintln!(
                    "  (`{}` has seeded random weights: expect gibberish; --model DIR serves a real checkpoint)",
                    a.model.model
                );
            }
            eprintln!();
            eprintln!("Metrics: {p_url}/metrics (prefill), {d_url}/metrics (decode). Ctrl-C stops all three.");
            if a.bench {
                let result = short_bench(&a, mode, &r_url);
                stop_all(&mut roles, Duration::from_secs(10));
                return result;
            }
        }
        if !ready && Instant::now() > deadline {
            stop_all(&mut roles, Duration::from_secs(5));
            bail!("not healthy after {} s", a.ready_timeout_secs);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!("tandem up: stopping prefill, decode and router ...");
    stop_all(&mut roles, Duration::from_secs(10));
    eprintln!("tandem up: stopped");
    Ok(())
}

/// How `bench sweep --launch` starts a mode's servers.
pub(crate) struct Launch<'a> {
    pub model: &'a str,
    /// Router (or colocated server) port; prefill +100, decode +200, KV side channels +300/+301.
    pub base_port: u16,
    pub log: &'a str,
    pub prefill_device: &'a str,
    pub decode_device: &'a str,
    pub colocated_device: &'a str,
    pub num_kv_blocks: Option<usize>,
    /// Given to every engine's `serve` as they are.
    pub engine_args: &'a [String],
    /// The key every process started takes (`--api-key`).
    pub api_key: Option<&'a str>,
    /// `--cluster-secret-file` for every process started (engines and router).
    pub cluster_secret_file: Option<&'a std::path::Path>,
    /// The network namespaces the prefill and decode engines run in (another host each, on
    /// this machine); `None`: this one, on loopback.
    pub prefill_netns: Option<&'a Netns>,
    pub decode_netns: Option<&'a Netns>,
}

/// A network namespace an engine runs in, as if on another host, and the address this
/// namespace reaches it at (`tandem-p=10.77.0.1`, as `scripts/two_hosts.sh` makes them).
#[derive(Clone, Debug, PartialEq)]
pub struct Netns {
    pub name: String,
    pub address: String,
}

impl std::str::FromStr for Netns {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.split_once('=') {
            Some((name, address)) if !name.is_empty() && !address.is_empty() => {
                Ok(Netns { name: name.to_string(), address: address.to_string() })
            }
            _ => Err(format!("`{s}` is not NAMESPACE=ADDRESS (e.g. tandem-p=10.77.0.1)")),
        }
    }
}

/// The processes of one sweep mode, started as `l` says. Returns the URL to load and the
/// processes to stop.
pub(crate) fn launch_mode(mode: &str, l: &Launch<'_>) -> Result<(String, Vec<Role>)> {
    let (host, base_port, log) = ("127.0.0.1", l.base_port, l.log);
    let url = format!("http://{host}:{base_port}");
    // An engine in a namespace of its own listens on all of its addresses (its KV side channel
    // advertises the one on its default route) and is reached at its namespace's address.
    let listen = |netns: Option<&Netns>| if netns.is_some() { "0.0.0.0" } else { host };
    let secret: Vec<String> = l
        .cluster_secret_file
        .iter()
        .flat_map(|p| ["--cluster-secret-file".to_string(), p.display().to_string()])
        .collect();
    let reach = |netns: Option<&Netns>| netns.map_or(host, |ns| ns.address.as_str()).to_string();
    let serve = |port: u16, device: &str, netns: Option<&Netns>| -> Vec<String> {
        let mut v: Vec<String> =
            ["--log", log, "serve", "--model", l.model, "--device", device, "--host", listen(netns)]
                .iter()
                .map(|s| s.to_string())
                .collect();
        v.extend(["--port".into(), port.to_string(), "--served-model-name".into(), "tandem".into()]);
        if netns.is_some() {
            v.extend(["--kv-host".into(), "0.0.0.0".into()]);
        }
        if let Some(n) = l.num_kv_blocks {
            v.extend(["--num-kv-blocks".into(), n.to_string()]);
        }
        v.extend(l.engine_args.iter().cloned());
        v.extend(secret.iter().cloned());
        v
    };
    let mut roles = Vec::new();
    if mode == "colocated" {
        roles.push(start("serve", &serve(base_port, l.colocated_device, None), l.api_key)?);
    } else {
        let (pp, dp, kp) = (base_port + 100, base_port + 200, base_port + 300);
        let mut p = serve(pp, l.prefill_device, l.prefill_netns);
        p.extend(["--role", "prefill", "--kv-mode", mode, "--kv-port", &kp.to_string()].map(String::from));
        let mut d = serve(dp, l.decode_device, l.decode_netns);
        d.extend(["--role", "decode", "--kv-mode", mode, "--kv-port", &(kp + 1).to_string()].map(String::from));
        roles.push(start_in(l.prefill_netns, "prefill", &p, l.api_key)?);
        roles.push(start_in(l.decode_netns, "decode", &d, l.api_key)?);
        let r: Vec<String> = ["--log", log, "router", "--mode", mode, "--prefill"]
            .iter()
            .map(|s| s.to_string())
            .chain([
                format!("http://{}:{pp}", reach(l.prefill_netns)),
                "--decode".to_string(),
                format!("http://{}:{dp}", reach(l.decode_netns)),
                "--host".into(),
                host.into(),
                "--port".into(),
                base_port.to_string(),
            ])
            .chain(secret.iter().cloned())
            .collect();
        roles.push(start("router", &r, l.api_key)?);
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    while !healthy(&url) {
        if let Some((name, status)) = exited(&mut roles) {
            stop_all(&mut roles, Duration::from_secs(5));
            bail!("the {name} process exited during start-up ({status})");
        }
        if Instant::now() > deadline {
            stop_all(&mut roles, Duration::from_secs(5));
            bail!("{mode}: not healthy after 120 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok((url, roles))
}

/// `up --bench`: a short sweep against the running router, then the figures.
fn short_bench(a: &UpArgs, mode: &str, url: &str) -> Result<()> {
    let cfg = tandem_bench::sweep::SweepConfig {
        qps: vec![2.0, 4.0],
        input_lens: vec![64, 256],
        output_len: 16,
        iterations: 1,
        num_prompts: 12,
        vocab_size: 256,
        percentiles: vec![50.0, 90.0, 99.0],
        result_dir: a.bench_dir.clone(),
        seed: 0,
        api_key: a.auth.keys()?.first().cloned(),
        tls_ca: a.tls.ca_pem()?,
    };
    let _ = std::fs::remove_file(a.bench_dir.join("summary.csv"));
    eprintln!("\ntandem up --bench: {mode} sweep (request rates 2, 4 x input lengths 64, 256; 12 prompts each)");
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(tandem_bench::sweep::run_mode(&cfg, mode, url, |line| eprintln!("{line}")))
        .map_err(anyhow::Error::msg)?;
    println!("{}", std::fs::read_to_string(a.bench_dir.join("summary.csv")).unwrap_or_default());
    for m in [tandem_bench::plot::Metric::Ttft, tandem_bench::plot::Metric::Tpot] {
        let (png, svg) = tandem_bench::plot::four_panel(&a.bench_dir, m, &a.bench_dir).map_err(anyhow::Error::msg)?;
        println!("figure: {} ({})", png.display(), svg.display());
    }
    if let Some((png, svg)) =
        tandem_bench::plot::ttft_breakdown(&a.bench_dir, &a.bench_dir).map_err(anyhow::Error::msg)?
    {
        println!("figure: {} ({})", png.display(), svg.display());
    }
    Ok(())
}
