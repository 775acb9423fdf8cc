//! `tandem up`: prefill, decode and router on this machine as three child processes of this
//! binary, their logs prefixed with the role, all stopped together on Ctrl-C.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::args::{KvModeArg, UpArgs};

struct Role {
    name: &'static str,
    child: Child,
}

/// Starts one child with its output streamed to ours, each line prefixed with `[name]`.
fn start(name: &'static str, args: &[String]) -> Result<Role> {
    let exe = std::env::current_exe().context("locating the tandem binary")?;
    let mut child = Command::new(exe)
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

fn signal(r: &Role, sig: nix::sys::signal::Signal) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(r.child.id() as i32), sig);
}

/// Stops every child: SIGINT (their graceful shutdown), then SIGKILL after `grace`.
fn stop_all(roles: &mut [Role], grace: Duration) {
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

fn healthy(url: &str) -> bool {
    matches!(reqwest::blocking::Client::new().get(format!("{url}/health")).timeout(Duration::from_secs(2)).send(), Ok(r) if r.status().is_success())
}

pub fn up(a: UpArgs) -> Result<()> {
    let mode = match a.kv_mode {
        KvModeArg::Push => "push",
        KvModeArg::Pull => "pull",
    };
    let host = "127.0.0.1";
    let common = |port: u16| {
        let mut v = vec!["--log".to_string(), a.log.clone(), "serve".into(), "--model".into(), a.model.model.clone()];
        v.extend([
            "--model-seed".into(),
            a.model.model_seed.to_string(),
            "--host".into(),
            host.into(),
            "--port".into(),
            port.to_string(),
        ]);
        v.extend(["--kv-mode".into(), mode.into(), "--served-model-name".into(), a.served_model_name.clone()]);
        v
    };
    let mut p_args = common(a.prefill_port);
    p_args.extend(["--role".into(), "prefill".into(), "--kv-port".into(), a.kv_port.to_string()]);
    let mut d_args = common(a.decode_port);
    d_args.extend(["--role".into(), "decode".into(), "--kv-port".into(), (a.kv_port + 1).to_string()]);
    let (p_url, d_url, r_url) = (
        format!("http://{host}:{}", a.prefill_port),
        format!("http://{host}:{}", a.decode_port),
        format!("http://{host}:{}", a.port),
    );
    let r_args: Vec<String> = vec![
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

    let interrupted = Arc::new(AtomicBool::new(false));
    let flag = interrupted.clone();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    std::thread::spawn(move || {
        rt.block_on(async {
            // Ctrl-C in a terminal, or SIGTERM from a process manager.
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(mut term) => {
                    tokio::select! {
                        _ = tokio::signal::ctrl_c() => {}
                        _ = term.recv() => {}
                    }
                }
                Err(_) => {
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        });
        flag.store(true, Ordering::SeqCst);
    });

    eprintln!("tandem up: model {}, {mode} mode: prefill {p_url}, decode {d_url}, router {r_url}", a.model.model);
    let mut roles = vec![start("prefill", &p_args)?, start("decode", &d_args)?, start("router", &r_args)?];
    let deadline = Instant::now() + Duration::from_secs(a.ready_timeout_secs);
    let mut ready = false;
    while !interrupted.load(Ordering::SeqCst) {
        if let Some(r) = roles.iter_mut().find_map(|r| matches!(r.child.try_wait(), Ok(Some(_))).then_some(r.name)) {
            stop_all(&mut roles, Duration::from_secs(5));
            bail!("the {r} process exited during start-up (its log is above)");
        }
        if !ready && healthy(&r_url) {
            ready = true;
            eprintln!();
            eprintln!(
                "tandem is up ({mode} mode). OpenAI API at {r_url}/v1 (model name `{}`). Try:",
                a.served_model_name
            );
            eprintln!();
            eprintln!(
                "  curl -s {r_url}/v1/completions -H 'content-type: application/json' \\\n    -d '{{\"model\": \"{}\", \"prompt\": \"Once upon a time\", \"max_tokens\": 16}}'",
                a.served_model_name
            );
            eprintln!();
            eprintln!("Metrics: {p_url}/metrics (prefill), {d_url}/metrics (decode). Ctrl-C stops all three.");
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
