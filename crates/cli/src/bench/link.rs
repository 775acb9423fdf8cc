//! The link between two network namespaces held to a rate (`bench sweep --link-rates`): a token
//! bucket (tc's tbf) on the sending side of every link in each namespace, so traffic between
//! them is held both ways. netem, which would add delay, does not exist on every kernel; tbf
//! does.

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::up::Netns;

/// Holds every link of each namespace (loopback aside) to `rate` (tc's syntax: 50mbit, 1gbit).
pub(crate) fn hold(namespaces: &[&Netns], rate: &str) -> Result<()> {
    for ns in namespaces {
        for dev in links(ns)? {
            let tbf =
                ["qdisc", "replace", "dev", &dev, "root", "tbf", "rate", rate, "burst", "1mb", "latency", "100ms"];
            run_in(ns, "tc", &tbf).with_context(|| format!("holding {dev} in {} to {rate}", ns.name))?;
        }
    }
    Ok(())
}

/// Frees the links `hold` held (what fails to, for a link already gone, is only reported).
pub(crate) fn release(namespaces: &[&Netns]) {
    for ns in namespaces {
        for dev in links(ns).unwrap_or_default() {
            if let Err(e) = run_in(ns, "tc", &["qdisc", "del", "dev", &dev, "root"]) {
                eprintln!("warning: freeing {dev} in {}: {e:#}", ns.name);
            }
        }
    }
}

/// The names of a namespace's links but loopback (`ip -o link` prints `2: veth0@if5: <...>`).
fn links(ns: &Netns) -> Result<Vec<String>> {
    let out = run_in(ns, "ip", &["-o", "link", "show"])?;
    Ok(out
        .lines()
        .filter_map(|line| line.split(':').nth(1))
        .map(|name| name.trim().split('@').next().unwrap_or_default().to_string())
        .filter(|name| !name.is_empty() && name != "lo")
        .collect())
}

/// Runs `program args` inside the namespace; its standard output, or its error output as the
/// error.
fn run_in(ns: &Netns, program: &str, args: &[&str]) -> Result<String> {
    let out = Command::new("ip")
        .args(["netns", "exec", &ns.name, program])
        .args(args)
        .output()
        .with_context(|| format!("running ip netns exec {} {program} (needs iproute2 and root)", ns.name))?;
    if !out.status.success() {
        bail!("{program} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Gives a link rate's results (`dir`) the colocated points the sweep ran once in `root`: their
/// rows of `root/summary.csv` and their result files, so each rate's directory is a whole sweep.
pub(crate) fn take_colocated(root: &Path, dir: &Path) -> Result<()> {
    let csv = std::fs::read_to_string(root.join("summary.csv")).context("reading the colocated summary")?;
    let rows: String = csv.lines().filter(|l| l.starts_with("colocated,")).map(|l| format!("{l}\n")).collect();
    let target = dir.join("summary.csv");
    let mut text = std::fs::read_to_string(&target).with_context(|| format!("reading {}", target.display()))?;
    text.push_str(&rows);
    std::fs::write(&target, text).with_context(|| format!("writing {}", target.display()))?;
    for e in std::fs::read_dir(root)?.flatten() {
        let name = e.file_name();
        if name.to_string_lossy().starts_with("colocated_") {
            std::fs::copy(e.path(), dir.join(&name))?;
        }
    }
    Ok(())
}
