//! deploy/k8s holds only what the binary takes: every tandem container's flags exist in its
//! subcommand's `--help`, its probes ask `/health` on the port it serves, and its grace period
//! covers its drain.

use std::path::PathBuf;
use std::process::Command;

use yaml_rust2::{Yaml, YamlLoader};

fn manifests() -> Vec<(PathBuf, Yaml)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../deploy/k8s");
    let mut out = Vec::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let text = std::fs::read_to_string(&path).unwrap();
            let docs = YamlLoader::load_from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            out.extend(docs.into_iter().map(|d| (path.clone(), d)));
        }
    }
    out
}

fn help(subcommand: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_tandem")).args([subcommand, "--help"]).output().unwrap();
    assert!(out.status.success(), "tandem {subcommand} --help failed");
    String::from_utf8(out.stdout).unwrap()
}

/// The value of `--name=VALUE` in `args`.
fn flag<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter().find_map(|a| a.strip_prefix(name)?.strip_prefix('='))
}

#[test]
fn every_flag_in_the_manifests_exists_and_probes_and_grace_fit() {
    let mut checked = 0;
    for (path, doc) in manifests() {
        let spec = &doc["spec"]["template"]["spec"];
        for container in spec["containers"].as_vec().into_iter().flatten() {
            if !container["image"].as_str().is_some_and(|i| i.starts_with("tandem")) {
                continue;
            }
            let args: Vec<String> =
                container["args"].as_vec().unwrap().iter().map(|a| a.as_str().unwrap().to_string()).collect();
            let subcommand = &args[0];
            let text = help(subcommand);
            for a in &args[1..] {
                let name = a.split('=').next().unwrap();
                assert!(name.starts_with("--"), "{}: `{a}` is not a --flag=value", path.display());
                assert!(
                    text.contains(&format!("{name} "))
                        || text.contains(&format!("{name}\n"))
                        || text.contains(&format!("{name} <")),
                    "{}: tandem {subcommand} has no {name}",
                    path.display()
                );
            }
            let port: i64 = flag(&args, "--port").unwrap().parse().unwrap();
            let ports = container["ports"].as_vec().unwrap();
            let http = ports.iter().find(|p| p["name"].as_str() == Some("http")).expect("a port named http");
            assert_eq!(http["containerPort"].as_i64(), Some(port), "{}: the http port is not --port", path.display());
            let readiness = &container["readinessProbe"]["httpGet"];
            assert_eq!(readiness["path"].as_str(), Some("/health"), "{}", path.display());
            assert_eq!(readiness["port"].as_str(), Some("http"), "{}", path.display());
            let drain: i64 = flag(&args, "--shutdown-timeout-secs").unwrap().parse().unwrap();
            let grace = spec["terminationGracePeriodSeconds"].as_i64().unwrap();
            assert!(grace > drain + 3, "{}: a grace of {grace} s does not cover a {drain} s drain", path.display());
            if subcommand == "serve" {
                assert!(flag(&args, "--discovery").is_some(), "{}: an engine that does not register", path.display());
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 3, "prefill, decode and router containers");
}
