//! The `tandem` binary: parses arguments, builds components from the library crates, and maps
//! errors to exit codes. No logic of its own beyond wiring: each subcommand is a module that
//! owns its arguments and its run function (`serve`, `router`, `up`, `generate`, `model`,
//! `bench`), and `engine` holds what every engine-running one shares.

mod auth;
mod bench;
mod discovery;
mod engine;
mod generate;
mod model;
mod router;
mod serve;
mod up;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::bench::BenchCommand;
use crate::generate::GenerateArgs;
use crate::model::ModelCommand;
use crate::router::RouterArgs;
use crate::serve::{KvTransportArg, ServeArgs};
use crate::up::UpArgs;

/// tandem: an LLM serving engine with an OpenAI-compatible API and prefill/decode
/// disaggregation, KV moving from prefill to decode in push or pull mode.
///
/// Start with `tandem up` (prefill, decode and router on this machine) or `tandem serve`
/// (one engine). Logs go to stderr; NO_COLOR=1 turns their colours off.
#[derive(Parser, Debug)]
#[command(name = "tandem", version)]
pub struct Cli {
    /// Log filter (tracing's EnvFilter syntax), e.g. `info` or `tandem_engine=debug`.
    #[arg(long, global = true, env = "TANDEM_LOG", default_value = "info")]
    pub log: String,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Serve a model over the OpenAI API (/v1/completions, /v1/chat/completions, /metrics, ...),
    /// colocated or as the prefill or decode half of a disaggregated pair.
    Serve(Box<ServeArgs>),
    /// The proxy in front of prefill and decode engines (push or pull KV transfer).
    Router(RouterArgs),
    /// The whole disaggregated system on this machine: prefill (8100), decode (8200) and the
    /// router (8000), on an embedded default model. Ctrl-C stops all three.
    Up(Box<UpArgs>),
    /// Generate one completion on this machine and print it.
    Generate(GenerateArgs),
    /// Make or look at model directories.
    #[command(subcommand)]
    Model(ModelCommand),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // While this is the only thread: an engine moving KV over NIXL has UCX log into a file the
    // connector reads back (the transports UCX chose; its warnings, through tracing).
    let ucx_log = match &cli.command {
        Command::Serve(a) if matches!(a.kv.kv_transport, KvTransportArg::Nixl) => redirect_ucx_log(),
        _ => None,
    };
    let filter =
        tracing_subscriber::EnvFilter::try_new(&cli.log).unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colours only on a terminal, and never with NO_COLOR set (the no-color.org convention).
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr()) && std::env::var_os("NO_COLOR").is_none();
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi).init();
    let result = match cli.command {
        Command::Serve(a) => serve::serve(*a, ucx_log.clone()),
        Command::Router(a) => router::router(a),
        Command::Up(a) => up::up(*a),
        Command::Generate(a) => generate::generate(a),
        Command::Model(c) => model::model_command(c),
        Command::Bench(c) => bench::run(c),
    };
    if let Some(path) = ucx_log {
        let _ = std::fs::remove_file(path);
    }
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Points UCX's log at a file of this process's own, at INFO level, unless the user chose
/// either (`UCX_LOG_LEVEL`, `UCX_LOG_FILE`: UCX's own settings); the path for the connector to
/// read it back from (`tandem_kv::ucx_log`). Called while `main` is the only thread, since it
/// sets the environment UCX reads when NIXL creates its backend.
fn redirect_ucx_log() -> Option<std::path::PathBuf> {
    if std::env::var_os("UCX_LOG_LEVEL").is_some() || std::env::var_os("UCX_LOG_FILE").is_some() {
        return None;
    }
    let path = std::env::temp_dir().join(format!("tandem-ucx-{}.log", std::process::id()));
    std::env::set_var("UCX_LOG_LEVEL", "info");
    std::env::set_var("UCX_LOG_FILE", &path);
    Some(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_definition_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
