//! UCX's own log, read back (`--kv-transport nixl`). UCX says which transports it chose for an
//! endpoint only in its log, at INFO level; so a serving process that uses NIXL, unless its user
//! set `UCX_LOG_LEVEL` or `UCX_LOG_FILE`, has UCX log at INFO into a file of its own (the
//! `tandem` binary sets that up before any thread starts, and names the file in
//! `ConnectorConfig::ucx_log`), and the connector reads it: the endpoint lines name the transports in the
//! NIXL self-check ("ran at 0.4 GB/s over intra-node rma_am(tcp/eth0) ..."), and UCX's
//! warnings and errors, which would have gone to the terminal, go through tracing instead.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The reader of a redirected UCX log; removes the file when dropped.
#[derive(Debug)]
pub struct UcxLog {
    path: PathBuf,
    state: Mutex<ReadState>,
    /// UCX's `ucs_log_flush`, once UCX is loaded: UCX writes its log file through stdio and
    /// flushes it only after errors, so what it said of a link just made would still sit in its
    /// buffer.
    #[cfg(feature = "nixl")]
    flush: std::sync::OnceLock<Option<UcsLogFlush>>,
}

/// UCX's `void ucs_log_flush(void)`, from the copy of libucs this process loaded.
#[cfg(feature = "nixl")]
#[derive(Debug)]
struct UcsLogFlush {
    flush: unsafe extern "C" fn(),
    /// Keeps `flush` loaded.
    _lib: libloading::Library,
}

#[cfg(feature = "nixl")]
impl UcsLogFlush {
    /// Finds the libucs this process has loaded (NIXL's UCX plugin loads it; a wheel renames
    /// it `libucs-<hash>.so.0`) and its `ucs_log_flush`.
    fn find() -> Option<Self> {
        let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
        let path = maps.lines().filter_map(|l| l.split_whitespace().nth(5)).find(|p| {
            let name = p.rsplit('/').next().unwrap_or("");
            name.starts_with("libucs-") || name.starts_with("libucs.so")
        })?;
        // SAFETY: the library is loaded already, so opening it again only takes a reference
        // (its initialisers ran when UCX loaded it); the Library keeps it loaded while `flush`
        // may be called.
        let lib = unsafe { libloading::Library::new(path) }.ok()?;
        // SAFETY: `ucs_log_flush` is UCX's public `void ucs_log_flush(void)` (ucs/debug/log_def.h).
        let flush = unsafe { lib.get::<unsafe extern "C" fn()>(b"ucs_log_flush\0") }.ok().map(|f| *f)?;
        Some(Self { flush, _lib: lib })
    }
}

#[derive(Debug, Default)]
struct ReadState {
    /// Bytes read so far.
    offset: u64,
    /// The latest endpoint's transports, as [`endpoint_transports`] words them.
    transports: Option<String>,
}

/// One line of UCX's log, as far as tandem cares.
#[derive(Debug, PartialEq, Eq)]
pub enum UcxLine {
    /// An endpoint's configuration: the transports of each lane, with the peer's scope.
    Endpoint(String),
    /// A warning or an error, its message.
    Problem(String),
    /// Anything else.
    Other,
}

impl UcxLog {
    /// Reads UCX's log at `path`, where UCX was told to write it.
    pub fn new(path: &Path) -> Self {
        Self {
            path: path.to_path_buf(),
            state: Mutex::default(),
            #[cfg(feature = "nixl")]
            flush: std::sync::OnceLock::new(),
        }
    }

    /// Reads what UCX has logged since the last call: relays its warnings and errors through
    /// tracing, and returns the transports of the latest endpoint it has configured (new or
    /// seen before), if any.
    pub fn read(&self) -> Option<String> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        #[cfg(feature = "nixl")]
        if let Some(f) = self.flush.get_or_init(UcsLogFlush::find) {
            // SAFETY: it takes nothing and flushes UCX's log FILE, which stdio locks for the
            // call, so any thread may make it.
            unsafe { (f.flush)() };
        }
        let mut text = String::new();
        if let Ok(mut file) = std::fs::File::open(&self.path) {
            let read = file.seek(SeekFrom::Start(state.offset)).and_then(|_| file.read_to_string(&mut text));
            if read.is_err() {
                return state.transports.clone();
            }
        }
        // Whole lines only: UCX may be writing the last one.
        let whole = text.rfind('\n').map_or(0, |i| i + 1);
        state.offset += whole as u64;
        for line in text[..whole].lines() {
            match parse(line) {
                UcxLine::Endpoint(t) => state.transports = Some(t),
                UcxLine::Problem(message) => tracing::warn!(target: "ucx", "{message}"),
                UcxLine::Other => {}
            }
        }
        state.transports.clone()
    }
}

impl Drop for UcxLog {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// What one line of UCX's log says: `[time] [host:pid:thread] file.c:line UCX LEVEL message`.
pub fn parse(line: &str) -> UcxLine {
    let Some((_, rest)) = line.split_once(" UCX ") else { return UcxLine::Other };
    let rest = rest.trim_start();
    let (level, message) = rest.split_once(char::is_whitespace).unwrap_or((rest, ""));
    let message = message.trim();
    match level {
        "INFO" => endpoint_transports(message).map_or(UcxLine::Other, UcxLine::Endpoint),
        "WARN" | "ERROR" | "FATAL" | "DIAG" => UcxLine::Problem(message.to_string()),
        _ => UcxLine::Other,
    }
}

/// From an endpoint's INFO line (`<worker> <scope> cfg#<n> <lane>(<tl>/<dev> ...) ...`), its
/// scope and the lanes that move data (RMA, active messages, device), `None` for other lines
/// and for the worker's endpoint to itself.
fn endpoint_transports(message: &str) -> Option<String> {
    let mut words = message.split_whitespace();
    let _worker = words.next()?;
    let scope = words.next()?;
    if scope == "self" || !words.next()?.starts_with("cfg#") {
        return None;
    }
    let rest: Vec<&str> = words.collect();
    let rest = rest.join(" ");
    // Lanes look like `name(tl/dev tl/dev)`; keep those that move data.
    let lanes: Vec<&str> = rest
        .split_inclusive(')')
        .map(str::trim)
        .filter(|lane| !lane.is_empty() && !lane.starts_with("amo") && !lane.starts_with("ka("))
        .collect();
    (!lanes.is_empty()).then(|| format!("{scope} {}", lanes.join(" ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    // Lines as UCX 1.23 (PyPI's nixl-cu13 1.5.1) wrote them between two namespaces of one host.
    const SELF: &str = "[1796377285.421337] [vm:25667:0]      ucp_worker.c:1997 UCX  INFO    \
        prefill-18400@17963772849361894 self cfg#0 rma_am(tcp/tandem-p-eth)  amo_am(tcp/tandem-p-eth)  \
        am(tcp/tandem-p-eth cma/memory)  ka(tcp/tandem-p-eth)";
    const PEER: &str = "[1796377286.449445] [vm:25667:1]      ucp_worker.c:1997 UCX  INFO    \
        prefill-18400@17963772849361894 intra-node cfg#1 rma_am(tcp/tandem-p-eth)  amo_am(tcp/tandem-p-eth)  \
        am(tcp/tandem-p-eth cma/memory)  ka(tcp/tandem-p-eth)";

    #[test]
    fn endpoint_lines_name_the_lanes_that_move_data() {
        assert_eq!(parse(SELF), UcxLine::Other, "the worker's endpoint to itself says nothing of a link");
        assert_eq!(
            parse(PEER),
            UcxLine::Endpoint("intra-node rma_am(tcp/tandem-p-eth) am(tcp/tandem-p-eth cma/memory)".into())
        );
        let warn = "[1.2] [h:1:0]  ucp_context.c:1200 UCX  WARN  transport 'rc' is not available";
        assert_eq!(parse(warn), UcxLine::Problem("transport 'rc' is not available".into()));
        assert_eq!(parse("[1.2] [h:1:0]  parser.c:2000 UCX  INFO  UCX_TLS is tcp"), UcxLine::Other);
        assert_eq!(parse("not UCX at all"), UcxLine::Other);
    }

    #[test]
    fn the_reader_keeps_the_latest_endpoint_and_reads_only_whole_new_lines() {
        let path = std::env::temp_dir().join(format!("tandem-ucx-test-{}.log", std::process::id()));
        std::fs::write(&path, format!("{SELF}\n")).unwrap();
        let log = UcxLog::new(&path);
        assert_eq!(log.read(), None);
        // A line being written (no newline yet) waits for its end.
        std::fs::write(&path, format!("{SELF}\n{}", &PEER[..40])).unwrap();
        assert_eq!(log.read(), None);
        std::fs::write(&path, format!("{SELF}\n{PEER}\n")).unwrap();
        let want = Some("intra-node rma_am(tcp/tandem-p-eth) am(tcp/tandem-p-eth cma/memory)".to_string());
        assert_eq!(log.read(), want);
        assert_eq!(log.read(), want, "nothing new: the latest endpoint still");
        drop(log);
        assert!(!path.exists(), "the reader removes the log it read");
    }
}
