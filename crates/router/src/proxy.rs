//! The two-leg dispatch (see the crate docs for push vs pull).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use serde_json::{json, Map, Value};
use tandem_core::{ApiKeys, KvTransferParams, TransferMode};
use tandem_kv::{AgentInfo, KvMode, Role};

use crate::answer::{
    answer, bad_request, describe, error, is_streamed, leg_error, leg_failed, passthrough, AbortOnDrop, LegError, Legs,
    ReleaseOnDrop,
};
use crate::backend::{choose, Backend, BackendState, KvEndpoint};
use crate::resume;

/// How the router runs.
#[derive(Clone, Debug)]
pub struct RouterConfig {
    /// Push or pull.
    pub mode: TransferMode,
    /// Prefill engine base URLs.
    pub prefill: Vec<String>,
    /// Decode engine base URLs.
    pub decode: Vec<String>,
    /// Longest a prefill leg may take (the decode leg streams for as long as it generates).
    pub prefill_timeout: Duration,
    /// How often every engine's health, mode and model are checked again while serving (an
    /// engine that restarts in another mode or with other weights is taken out of service).
    pub check_interval: Duration,
    /// Conditional disaggregation: a request whose prompt the chosen decode engine would have
    /// to compute at most this many tokens of (its length less what decode's prefix cache
    /// holds) runs entirely on that decode engine, without a prefill leg or a transfer.
    /// `None`: every request is disaggregated. A request's `kv_transfer_params`
    /// `{"disaggregate": true|false}` overrides it.
    pub local_prefill_max_tokens: Option<usize>,
    /// With several engines of a role, send a prompt to the one whose prefix cache holds the
    /// most of it (load permitting); off: the least busy, round-robin among ties.
    pub kv_aware_routing: bool,
    /// Keys clients must send (`Authorization: Bearer`) on `/v1/*`; none: open.
    pub api_keys: ApiKeys,
    /// The key the router sends on every request to its engines (engines that take
    /// `--api-key` want one of theirs); `None`: none sent.
    pub engine_api_key: Option<String>,
    /// The deployment's secret (`--cluster-secret-file`): its token goes to the engines on
    /// every request (their `/kv/*` want it) and opens `/admin/engines`.
    pub cluster_secret: Option<tandem_core::ClusterSecret>,
    /// Keys that open `/admin/engines` as `Authorization: Bearer` (`--admin-key`). With neither
    /// these nor a secret the admin endpoints are open.
    pub admin_keys: ApiKeys,
    /// The CA certificates (PEM, `--tls-ca`) an engine's HTTPS certificate must chain to;
    /// `None`: engines are reached over plain HTTP only (an `https://` engine is refused).
    pub engine_ca: Option<Vec<u8>>,
    /// Engines come (also) from discovery ([`Router::follow_membership`]): the lists may start
    /// empty, and an engine that leaves the membership leaves the router, the last of its role
    /// too.
    pub discovered_engines: bool,
}

impl RouterConfig {
    /// A config with the default timeouts.
    pub fn new(mode: TransferMode, prefill: Vec<String>, decode: Vec<String>) -> Self {
        Self {
            mode,
            prefill,
            decode,
            prefill_timeout: Duration::from_secs(300),
            check_interval: Duration::from_secs(2),
            local_prefill_max_tokens: None,
            kv_aware_routing: true,
            api_keys: ApiKeys::default(),
            engine_api_key: None,
            cluster_secret: None,
            admin_keys: ApiKeys::default(),
            engine_ca: None,
            discovered_engines: false,
        }
    }
}

/// Why the router could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RouterError {
    /// No prefill or no decode backend was given.
    #[error("need at least one --prefill and one --decode URL")]
    NoBackends,
    /// The key for the engines cannot go in an HTTP header.
    #[error("the engines' API key must be printable ASCII without spaces")]
    BadEngineKey,
    /// A backend did not become healthy in time.
    #[error("backend {url} not ready after {secs} s: {reason}")]
    NotReady {
        /// The backend.
        url: String,
        /// How long we waited.
        secs: u64,
        /// The last error.
        reason: String,
    },
    /// An engine is healthy but cannot serve its part: no KV connector, another role or mode.
    #[error("engine {url}: {reason}")]
    Misconfigured {
        /// The backend.
        url: String,
        /// What is wrong.
        reason: String,
    },
    /// A prefill and a decode engine cannot exchange KV (another model, dtype or KV shape).
    #[error("{0}")]
    Unpairable(String),
    /// An engine is reached over HTTPS but no CA was given to check its certificate against.
    #[error("engine {0} is reached over https: give the CA its certificate chains to (--tls-ca)")]
    NoEngineCa(String),
    /// The engines' CA could not be read.
    #[error("--tls-ca: {0}")]
    BadEngineCa(String),
}

/// The engines of one role. The list changes while serving (`/admin/engines`); a request
/// works on the list as it was when it started (a removed engine finishes what it has).
pub(crate) struct Engines(std::sync::RwLock<Arc<Vec<Arc<Backend>>>>);

impl Engines {
    fn new(urls: &[String], role: Role) -> Self {
        Self(std::sync::RwLock::new(Arc::new(urls.iter().map(|u| Arc::new(Backend::new(u, role))).collect())))
    }

    /// The engines now.
    pub(crate) fn list(&self) -> Arc<Vec<Arc<Backend>>> {
        self.0.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Adds `b` unless an engine with its URL is in the list.
    pub(crate) fn add(&self, b: Arc<Backend>) -> bool {
        let mut list = self.0.write().unwrap_or_else(|p| p.into_inner());
        if list.iter().any(|e| e.url == b.url) {
            return false;
        }
        let mut next = (**list).clone();
        next.push(b);
        *list = Arc::new(next);
        true
    }

    /// Takes the engine at `url` out, the last of its role too (it left the membership);
    /// whether it was there.
    pub(crate) fn remove_any(&self, url: &str) -> bool {
        let mut list = self.0.write().unwrap_or_else(|p| p.into_inner());
        let before = list.len();
        *list = Arc::new(list.iter().filter(|e| e.url != url).cloned().collect());
        list.len() != before
    }

    /// Takes the engine at `url` out (never the last one); whether it was there, and why not.
    pub(crate) fn remove(&self, url: &str) -> Result<bool, String> {
        let mut list = self.0.write().unwrap_or_else(|p| p.into_inner());
        if !list.iter().any(|e| e.url == url) {
            return Ok(false);
        }
        if list.len() == 1 {
            return Err(format!("{url} is the last engine of its role: add another first"));
        }
        *list = Arc::new(list.iter().filter(|e| e.url != url).cloned().collect());
        Ok(true)
    }
}

/// The router's state: backends, HTTP client, counters.
pub struct Router {
    pub(crate) cfg: RouterConfig,
    http: reqwest::Client,
    /// Without the cluster token and API key: for `/kv/prove` (see [`Router::probe`]).
    bare: reqwest::Client,
    pub(crate) prefill: Engines,
    pub(crate) decode: Engines,
    turn: AtomicUsize,
    next_transfer: AtomicU64,
    id_prefix: String,
    /// Set once by [`Router::abort_all`].
    abort: tokio::sync::watch::Sender<bool>,
    /// How discovery is doing, when the router follows it (for `/health`).
    pub(crate) discovery: std::sync::OnceLock<Arc<tandem_discovery::DiscoveryHealth>>,
    /// Requests refused for want of an API key (or, on the admin endpoints, an admin key).
    pub(crate) unauthorized: AtomicU64,
    /// Streamed answers that broke off and went on from another engine (`crate::resume`).
    pub(crate) resumed_streams: AtomicU64,
}

fn mode_name(m: TransferMode) -> &'static str {
    match m {
        TransferMode::Push => "push",
        TransferMode::Pull => "pull",
    }
}

pub(crate) fn role_name(r: Role) -> &'static str {
    match r {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
        Role::Both => "colocated",
    }
}

impl Router {
    /// Requests refused so far for want of one of the router's API keys (also in `/health`).
    pub fn refused_unauthorized(&self) -> u64 {
        self.unauthorized.load(Ordering::Relaxed)
    }

    /// A router over the configured backends (not yet checked; see [`Router::wait_ready`]).
    pub fn new(cfg: RouterConfig) -> Result<Self, RouterError> {
        if (cfg.prefill.is_empty() || cfg.decode.is_empty()) && !cfg.discovered_engines {
            return Err(RouterError::NoBackends);
        }
        let mut engine_headers = reqwest::header::HeaderMap::new();
        if let Some(key) = &cfg.engine_api_key {
            let mut value = reqwest::header::HeaderValue::from_str(&format!("Bearer {key}"))
                .map_err(|_| RouterError::BadEngineKey)?;
            value.set_sensitive(true);
            engine_headers.insert(reqwest::header::AUTHORIZATION, value);
        }
        if let Some(secret) = &cfg.cluster_secret {
            let mut value = reqwest::header::HeaderValue::from_str(&secret.http_token())
                .expect("a hex token is a valid header value");
            value.set_sensitive(true);
            engine_headers.insert(tandem_core::CLUSTER_TOKEN_HEADER, value);
        }
        // Two clients: one without the token and key, for the challenge an engine must answer
        // before it is sent either.
        let mut http =
            reqwest::Client::builder().connect_timeout(Duration::from_secs(5)).default_headers(engine_headers);
        let mut bare = reqwest::Client::builder().connect_timeout(Duration::from_secs(5));
        if let Some(url) = cfg.prefill.iter().chain(&cfg.decode).find(|u| u.starts_with("https://")) {
            if cfg.engine_ca.is_none() {
                return Err(RouterError::NoEngineCa(url.clone()));
            }
        }
        if let Some(ca) = &cfg.engine_ca {
            let certs =
                reqwest::Certificate::from_pem_bundle(ca).map_err(|e| RouterError::BadEngineCa(e.to_string()))?;
            if certs.is_empty() {
                return Err(RouterError::BadEngineCa("the file holds no certificate".into()));
            }
            http = certs.iter().cloned().fold(http, |b, c| b.add_root_certificate(c));
            bare = certs.into_iter().fold(bare, |b, c| b.add_root_certificate(c));
        }
        let http = http.build().map_err(|e| RouterError::BadEngineCa(e.to_string()))?;
        let bare = bare.build().map_err(|e| RouterError::BadEngineCa(e.to_string()))?;
        Ok(Self {
            prefill: Engines::new(&cfg.prefill, Role::Prefill),
            decode: Engines::new(&cfg.decode, Role::Decode),
            http,
            bare,
            turn: AtomicUsize::new(0),
            next_transfer: AtomicU64::new(0),
            id_prefix: format!("{:08x}", rand::random::<u32>()),
            abort: tokio::sync::watch::Sender::new(false),
            discovery: std::sync::OnceLock::new(),
            unauthorized: AtomicU64::new(0),
            resumed_streams: AtomicU64::new(0),
            cfg,
        })
    }

    /// Waits (bounded by `timeout`) until every engine answers, then refuses to start if one
    /// is misconfigured or a prefill and a decode engine cannot pair, naming what differs.
    pub async fn wait_ready(&self, timeout: Duration) -> Result<(), RouterError> {
        let start = Instant::now();
        loop {
            self.check_all().await;
            let down = self.backends().iter().find_map(|b| match b.state() {
                BackendState::Down(reason) => Some((b.url.clone(), reason)),
                BackendState::Unknown => Some((b.url.clone(), "not checked".into())),
                _ => None,
            });
            match down {
                None => break,
                Some((url, reason)) if start.elapsed() > timeout => {
                    return Err(RouterError::NotReady { url, secs: timeout.as_secs(), reason })
                }
                Some(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
        for b in self.backends() {
            if let BackendState::Misconfigured(reason) = b.state() {
                return Err(RouterError::Misconfigured { url: b.url.clone(), reason });
            }
        }
        if let Some(problem) = self.pair_problems().into_iter().next() {
            return Err(RouterError::Unpairable(problem));
        }
        Ok(())
    }

    /// Every engine now, prefill first.
    fn backends(&self) -> Vec<Arc<Backend>> {
        let (p, d) = (self.prefill.list(), self.decode.list());
        p.iter().chain(d.iter()).cloned().collect()
    }

    /// Checks one engine: healthy, a KV connector in the role it was given as and the router's
    /// mode.
    pub(crate) async fn probe(&self, b: &Backend) -> BackendState {
        if let Some(secret) = &self.cfg.cluster_secret {
            // Before anything carrying the token or the API key goes to it: the engine proves
            // it holds the secret (one found through discovery may be anybody's).
            if let Err(state) = self.challenge(b, secret).await {
                return state;
            }
        }
        let get = |path: &str| self.http.get(format!("{}{path}", b.url)).timeout(Duration::from_secs(5)).send();
        match get("/health").await {
            Ok(r) if r.status().is_success() => {}
            Ok(r) => return BackendState::Down(format!("/health answers HTTP {}", r.status())),
            Err(e) => return BackendState::Down(describe(&e)),
        }
        let wanted = role_name(b.role);
        let r = match get("/kv/info").await {
            Ok(r) => r,
            Err(e) => return BackendState::Down(describe(&e)),
        };
        if matches!(r.status().as_u16(), 400 | 404) {
            return BackendState::Misconfigured(format!(
                "has no KV connector: start it with `tandem serve --role {wanted} --kv-mode {}`",
                mode_name(self.cfg.mode)
            ));
        }
        if r.status() == StatusCode::UNAUTHORIZED {
            // Not down: it will not answer this router until one of them is restarted.
            return BackendState::Misconfigured(match self.cfg.cluster_secret {
                Some(_) => "refuses this router's cluster token: it has another --cluster-secret-file".into(),
                None => "takes only its deployment's cluster token: give the router its --cluster-secret-file".into(),
            });
        }
        if !r.status().is_success() {
            return BackendState::Down(format!("/kv/info answers HTTP {}", r.status()));
        }
        let info: AgentInfo = match r.json().await {
            Ok(i) => i,
            Err(e) => {
                return BackendState::Misconfigured(format!("/kv/info is not a tandem engine's: {}", describe(&e)))
            }
        };
        if info.role != b.role {
            return BackendState::Misconfigured(format!(
                "is a {} engine, but the router was given it as a {wanted} engine (--{wanted})",
                role_name(info.role)
            ));
        }
        let mode = match info.kv_mode {
            KvMode::Push => TransferMode::Push,
            KvMode::Pull => TransferMode::Pull,
        };
        if mode != self.cfg.mode {
            return BackendState::Misconfigured(format!(
                "runs in {} mode, the router in {} mode (give the engines' --kv-mode and the router's --mode the same value)",
                mode_name(mode),
                mode_name(self.cfg.mode)
            ));
        }
        if b.role == Role::Prefill && KvEndpoint::of(&info).is_none() {
            return BackendState::Misconfigured("offers no TCP KV side channel".into());
        }
        BackendState::Ready(Arc::new(info))
    }

    /// Asks engine `b` to prove it holds `secret` (`GET /kv/prove` with a fresh challenge,
    /// sent without the token or an API key).
    async fn challenge(&self, b: &Backend, secret: &tandem_core::ClusterSecret) -> Result<(), BackendState> {
        let challenge = tandem_core::hex(&rand::random::<[u8; 32]>());
        let resp = self
            .bare
            .get(format!("{}/kv/prove", b.url))
            .header(tandem_core::CLUSTER_CHALLENGE_HEADER, &challenge)
            .timeout(Duration::from_secs(5))
            .send()
            .await
            .map_err(|e| BackendState::Down(describe(&e)))?;
        if resp.status() == StatusCode::NOT_FOUND {
            return Err(BackendState::Misconfigured(
                "has no --cluster-secret-file: it cannot prove it belongs to this deployment".into(),
            ));
        }
        if !resp.status().is_success() {
            return Err(BackendState::Down(format!("/kv/prove answers HTTP {}", resp.status())));
        }
        let proof: Value = resp.json().await.unwrap_or(Value::Null);
        match proof["proof"].as_str() {
            Some(p) if secret.check_engine_proof(challenge.as_bytes(), p.as_bytes()) => Ok(()),
            _ => Err(BackendState::Misconfigured(
                "cannot prove this deployment's cluster secret: it has another --cluster-secret-file".into(),
            )),
        }
    }

    /// Checks every engine (concurrently) and logs what changed.
    async fn check_all(&self) {
        let all = self.backends();
        let states = futures::future::join_all(all.iter().map(|b| self.probe(b))).await;
        for (b, new) in all.iter().zip(states) {
            let old = b.set_state(new.clone());
            match (&old, &new) {
                (BackendState::Ready(a), BackendState::Ready(n)) if a.epoch != n.epoch => {
                    tracing::info!(url = %b.url, epoch = n.epoch.0, "engine restarted; ready again")
                }
                (BackendState::Ready(_), BackendState::Ready(_)) => {}
                (_, BackendState::Ready(n)) => tracing::info!(url = %b.url, engine_id = %n.engine_id, "engine ready"),
                (BackendState::Down(a), BackendState::Down(n))
                | (BackendState::Misconfigured(a), BackendState::Misconfigured(n))
                    if a == n => {}
                (_, BackendState::Down(reason)) => tracing::warn!(url = %b.url, %reason, "engine down"),
                (_, BackendState::Misconfigured(reason)) => {
                    tracing::error!(url = %b.url, %reason, "engine misconfigured: taken out of service")
                }
                (_, BackendState::Unknown) => {}
            }
        }
        for problem in self.pair_problems() {
            tracing::debug!(%problem, "engines that cannot pair");
        }
    }

    /// Every ready prefill/decode pair that cannot exchange KV, in words.
    fn pair_problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        let (prefill, decode) = (self.prefill.list(), self.decode.list());
        for p in prefill.iter() {
            for d in decode.iter() {
                if let (Some(pi), Some(di)) = (p.info(), d.info()) {
                    if let Err(e) = di.check_pairing(&pi) {
                        out.push(format!("prefill engine {} and decode engine {} cannot pair: {e}", p.url, d.url));
                    }
                }
            }
        }
        out
    }

    /// Everything that keeps requests from being served, in words (empty when all is well).
    pub fn problems(&self) -> Vec<String> {
        let mut out: Vec<String> = [("prefill", self.prefill.list()), ("decode", self.decode.list())]
            .into_iter()
            .filter(|(_, list)| list.is_empty())
            .map(|(role, _)| format!("no {role} engine (none registered yet)"))
            .collect();
        out.extend(self.backends().iter().filter_map(|b| match b.state() {
            BackendState::Down(r) => Some(format!("{} engine {} is down: {r}", role_name(b.role), b.url)),
            BackendState::Misconfigured(r) => Some(format!("{} engine {} {r}", role_name(b.role), b.url)),
            BackendState::Unknown => Some(format!("{} engine {} not checked yet", role_name(b.role), b.url)),
            BackendState::Ready(_) => None,
        }));
        out.extend(self.pair_problems());
        out
    }

    /// Checks every engine again every `check_interval` until the returned guard drops.
    pub(crate) fn spawn_checks(self: &Arc<Self>) -> AbortOnDrop<()> {
        let r = self.clone();
        AbortOnDrop(tokio::spawn(async move {
            loop {
                tokio::time::sleep(r.cfg.check_interval).await;
                r.check_all().await;
            }
        }))
    }

    /// How many tokens `orig`'s prompt has and how many of them engine `b`'s prefix cache holds
    /// (its `/kv/prefix`); `None` when it cannot say within [`PREFIX_QUERY_TIMEOUT`].
    async fn prefix_on(&self, b: &Backend, orig: &Map<String, Value>) -> Option<(usize, usize)> {
        let body: Map<String, Value> = ["model", "prompt", "messages", "add_generation_prompt"]
            .into_iter()
            .filter_map(|k| orig.get(k).map(|v| (k.to_string(), v.clone())))
            .collect();
        let resp = self
            .http
            .post(format!("{}/kv/prefix", b.url))
            .json(&body)
            .timeout(PREFIX_QUERY_TIMEOUT)
            .send()
            .await
            .ok()
            .filter(|r| r.status().is_success())?;
        let v: Value = resp.json().await.ok()?;
        Some((v["num_tokens"].as_u64()? as usize, v["cached_tokens"].as_u64()? as usize))
    }

    /// KV-aware routing: among several ready engines of `backends` not in `tried`, the one whose
    /// prefix cache holds the most of `orig`'s prompt, unless it is busier than the least busy
    /// by more than `KV_AWARE_SLACK` requests; `None` when none holds any (then load decides).
    /// Also what each engine asked answered (`prefix_on`), so nobody asks it again.
    async fn best_cached(
        &self,
        backends: &[Arc<Backend>],
        orig: &Map<String, Value>,
        tried: &[Arc<Backend>],
    ) -> (Option<Arc<Backend>>, Vec<(Arc<Backend>, (usize, usize))>) {
        const KV_AWARE_SLACK: usize = 8;
        let candidates: Vec<&Arc<Backend>> =
            backends.iter().filter(|b| b.is_healthy() && !tried.iter().any(|t| Arc::ptr_eq(t, b))).collect();
        if !self.cfg.kv_aware_routing || candidates.len() < 2 {
            return (None, Vec::new());
        }
        let cached = futures::future::join_all(candidates.iter().map(|b| self.prefix_on(b, orig))).await;
        let answers: Vec<(Arc<Backend>, (usize, usize))> =
            candidates.iter().zip(cached).filter_map(|(b, c)| Some(((*b).clone(), c?))).collect();
        let least_busy = candidates.iter().map(|b| b.outstanding()).min().unwrap_or(0);
        let best = answers
            .iter()
            .max_by_key(|(b, (_, cached))| (*cached, std::cmp::Reverse(b.outstanding())))
            .filter(|(b, (_, cached))| *cached > 0 && b.outstanding() <= least_busy + KV_AWARE_SLACK)
            .map(|(b, _)| b.clone());
        (best, answers)
    }

    /// A prefill engine and a decode engine that can pair with it, none of them in `tried`
    /// (engines this request already failed on), or why there is none. The `preferred`
    /// engines (those holding the prompt's prefix) are taken when given and usable.
    fn pick(&self, tried: &[Arc<Backend>], preferred: Preferred) -> Result<(Arc<Backend>, Arc<Backend>), String> {
        let untried = |b: &Backend| !tried.iter().any(|t| std::ptr::eq(&**t, b));
        let t = self.turn.fetch_add(1, Ordering::Relaxed);
        let unusable = |role: &str, list: &[Arc<Backend>]| {
            let why: Vec<String> = list
                .iter()
                .map(|b| match b.state() {
                    BackendState::Misconfigured(r) => format!("{} {r}", b.url),
                    other => format!("{}: {other:?}", b.url),
                })
                .collect();
            format!("no usable {role} engine: {}", why.join("; "))
        };
        let (prefill, decode) = (self.prefill.list(), self.decode.list());
        let p = match preferred.prefill {
            Some(p) => p,
            None => choose(&prefill, t, untried).ok_or_else(|| unusable("prefill", &prefill))?,
        };
        let fits_preferred = preferred.decode.filter(|d| self.can_pair(&p, d));
        let d = fits_preferred.or_else(|| self.pick_decode(&p, t, tried)).ok_or_else(|| {
            let problems = self.pair_problems();
            if problems.is_empty() {
                unusable("decode", &decode)
            } else {
                problems.join("; ")
            }
        })?;
        Ok((p, d))
    }

    /// A decode engine that can pair with prefill engine `p`, not in `tried`.
    fn pick_decode(&self, p: &Backend, turn: usize, tried: &[Arc<Backend>]) -> Option<Arc<Backend>> {
        let fits = |d: &Backend| !tried.iter().any(|t| std::ptr::eq(&**t, d)) && self.can_pair(p, d);
        choose(&self.decode.list(), turn, fits)
    }

    /// Whether decode engine `d` can take KV from prefill engine `p` (as far as is known).
    fn can_pair(&self, p: &Backend, d: &Backend) -> bool {
        match (p.info(), d.info()) {
            (Some(pi), Some(di)) => di.check_pairing(&pi).is_ok(),
            _ => true,
        }
    }

    fn transfer_id(&self) -> String {
        format!("tx-{}-{}", self.id_prefix, self.next_transfer.fetch_add(1, Ordering::Relaxed))
    }

    /// Requests being answered now (streams included).
    pub fn in_flight(&self) -> usize {
        self.decode.list().iter().map(|b| b.outstanding()).sum()
    }

    /// Ends every request now, for a bounded shutdown: a stream gets a final error chunk, a
    /// waiting client a 503; both legs are dropped, which cancels them on the engines.
    pub fn abort_all(&self) {
        self.abort.send_replace(true);
    }

    /// A guard that has prefill engine `p` free the KV it holds for `transfer_id` when it
    /// drops, as the request ends.
    fn release_on_drop(&self, p: &Backend, transfer_id: &str) -> ReleaseOnDrop {
        ReleaseOnDrop { http: self.http.clone(), url: p.url.clone(), transfer_id: transfer_id.to_string() }
    }
}

/// Lets a request through to `/v1/*` only with one of the router's API keys.
pub(crate) async fn require_api_key(
    State(r): State<Arc<Router>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let header = req.headers().get(axum::http::header::AUTHORIZATION).map(|v| v.as_bytes());
    if r.cfg.api_keys.allows(header) {
        return next.run(req).await;
    }
    r.unauthorized.fetch_add(1, Ordering::Relaxed);
    error(
        StatusCode::UNAUTHORIZED,
        "this router needs an API key: send `Authorization: Bearer <key>` with one of its --api-key keys",
    )
}

/// Cancel safety: dropping this future (client disconnect) drops both legs' requests, which
/// the engines see as disconnects and cancel.
pub(crate) async fn completions(State(r): State<Arc<Router>>, headers: HeaderMap, body: Bytes) -> Response {
    dispatch_or_abort(r, "/v1/completions", headers, body).await
}

/// Cancel safety: as [`completions`].
pub(crate) async fn chat_completions(State(r): State<Arc<Router>>, headers: HeaderMap, body: Bytes) -> Response {
    dispatch_or_abort(r, "/v1/chat/completions", headers, body).await
}

/// [`dispatch`], ended with a 503 when [`Router::abort_all`] is called before it answers.
async fn dispatch_or_abort(r: Arc<Router>, path: &'static str, headers: HeaderMap, body: Bytes) -> Response {
    let mut abort = r.abort.subscribe();
    if *abort.borrow() {
        return error(StatusCode::SERVICE_UNAVAILABLE, "the router is shutting down");
    }
    tokio::select! {
        resp = dispatch(r.clone(), path, headers, body) => resp,
        _ = abort.wait_for(|a| *a) => error(StatusCode::SERVICE_UNAVAILABLE, "the router is shutting down; the request was ended"),
    }
}

pub(crate) async fn models(State(r): State<Arc<Router>>) -> Response {
    let decode = r.decode.list();
    let Some(d) = choose(&decode, 0, |_| true).or_else(|| decode.first().cloned()) else {
        return error(StatusCode::SERVICE_UNAVAILABLE, "no decode engine");
    };
    match r.http.get(format!("{}/v1/models", d.url)).timeout(Duration::from_secs(10)).send().await {
        Ok(resp) => passthrough(resp, None, Legs::default(), r.abort.subscribe()),
        Err(e) => error(StatusCode::BAD_GATEWAY, format!("decode engine {}: {}", d.url, describe(&e))),
    }
}

/// 200 when every engine is ready and every prefill/decode pair can exchange KV; otherwise
/// 503 with what is wrong, so a misconfiguration shows where operators look.
pub(crate) async fn health(State(r): State<Arc<Router>>) -> Response {
    r.check_all().await;
    let problems = r.problems();
    let refused = r.refused_unauthorized();
    let resumed = r.resumed_streams.load(Ordering::Relaxed);
    let mut body = json!({"status": "ok", "refused_unauthorized": refused, "resumed_streams": resumed});
    if let Some(d) = r.discovery.get() {
        body["discovery"] = json!({"connected": d.connected(), "member": d.member(), "failures": d.failures(), "last_error": d.last_error()});
    }
    if problems.is_empty() {
        (StatusCode::OK, Json(body)).into_response()
    } else {
        body["status"] = json!("unavailable");
        body["problems"] = json!(problems);
        (StatusCode::SERVICE_UNAVAILABLE, Json(body)).into_response()
    }
}

/// Checks the fields the router itself reads or rewrites before it sends either leg (the
/// engines check the rest, prefill first, before computing anything).
fn check_body(orig: &Map<String, Value>) -> Result<(), (&'static str, String)> {
    let flag = |param: &'static str, v: Option<&Value>| match v {
        None | Some(Value::Null) | Some(Value::Bool(_)) => Ok(()),
        Some(v) => Err((param, format!("invalid `{param}`: expected true or false, got {v}"))),
    };
    flag("stream", orig.get("stream"))?;
    match orig.get("stream_options") {
        None | Some(Value::Null) => Ok(()),
        Some(Value::Object(o)) => flag("stream_options.include_usage", o.get("include_usage")),
        Some(v) => Err(("stream_options", format!("invalid `stream_options`: expected an object, got {v}"))),
    }
}

/// The prefill leg's body: the client's request, marked as the prefill of `transfer_id`,
/// answered in one piece. Prefill validates every field as decode will (`max_tokens` against
/// its context length included) and then samples one token, so a request decode would
/// refuse is refused before any KV is computed.
fn prefill_body(orig: &Map<String, Value>, transfer_id: &str) -> Value {
    let mut b = orig.clone();
    b.insert("stream".into(), json!(false));
    b.remove("stream_options");
    let kv =
        KvTransferParams { do_remote_decode: true, transfer_id: Some(transfer_id.to_string()), ..Default::default() };
    b.insert("kv_transfer_params".into(), serde_json::to_value(kv).unwrap_or(Value::Null));
    Value::Object(b)
}

async fn dispatch(r: Arc<Router>, path: &'static str, headers: HeaderMap, body: Bytes) -> Response {
    let orig: Map<String, Value> = match serde_json::from_slice::<Value>(&body) {
        Ok(Value::Object(m)) => m,
        Ok(_) => return error(StatusCode::BAD_REQUEST, "invalid request body: expected a JSON object"),
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("invalid request body (not valid JSON): {e}")),
    };
    if let Err((param, message)) = check_body(&orig) {
        return bad_request(param, message);
    }
    let mut orig = orig;
    let resumable = resume::resumable(path, &orig);
    let strip_ids = resumable && resume::ask_token_ids(path, &mut orig);
    let resp = route(&r, path, &headers, &orig).await;
    let sse = resp.headers().get("content-type").is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    if resp.status().is_success() && sse && resumable {
        return resume::wrap(r, path, headers, orig, strip_ids, resp);
    }
    resp
}

impl resume::Reroute for Router {
    fn reroute(
        self: Arc<Self>,
        path: &'static str,
        headers: HeaderMap,
        body: Map<String, Value>,
    ) -> futures::future::BoxFuture<'static, Response> {
        Box::pin(async move { route(&self, path, &headers, &body).await })
    }

    fn shutting_down(&self) -> bool {
        *self.abort.borrow()
    }

    fn count_resume(&self) {
        self.resumed_streams.fetch_add(1, Ordering::Relaxed);
    }
}

/// The request's legs on the engines it picks, each leg tried on another engine while none of
/// its answer has reached the client.
pub(crate) async fn route(
    r: &Arc<Router>,
    path: &'static str,
    headers: &HeaderMap,
    orig: &Map<String, Value>,
) -> Response {
    let request_id = headers.get("x-request-id").cloned();
    // A leg that never reached its engine (no connection) or that the engine turned away
    // before computing anything (429) is tried again on another engine of that role, each
    // engine at most once: the client sees an error only when no engine is left.
    let disaggregate = match disaggregate_override(orig) {
        Ok(d) => d,
        Err(message) => return bad_request("kv_transfer_params", message),
    };
    let mut tried: Vec<Arc<Backend>> = Vec::new();
    let mut last: Option<Response> = None;
    loop {
        let (prefills, decodes) = (r.prefill.list(), r.decode.list());
        let ((prefill, _), (decode, decode_answers)) =
            tokio::join!(r.best_cached(&prefills, orig, &tried), r.best_cached(&decodes, orig, &tried));
        let preferred = Preferred { prefill, decode };
        let (p, d) = match r.pick(&tried, preferred) {
            Ok(pair) => pair,
            Err(why) => return last.unwrap_or_else(|| error(StatusCode::SERVICE_UNAVAILABLE, why)),
        };
        let local = match (disaggregate, r.cfg.local_prefill_max_tokens) {
            (Some(d), _) => !d,
            (None, Some(most)) if prompt_tokens_at_most(orig).is_some_and(|n| n <= most) => true,
            (None, Some(most)) => {
                let known = decode_answers.iter().find(|(b, _)| Arc::ptr_eq(b, &d)).map(|(_, a)| *a);
                let prefix = match known {
                    Some(answer) => Some(answer),
                    None => r.prefix_on(&d, orig).await,
                };
                prefix.is_some_and(|(n, cached)| n.saturating_sub(cached) <= most)
            }
            (None, None) => false,
        };
        let attempt = if local {
            dispatch_local(r, path, request_id.as_ref(), orig, d).await
        } else {
            dispatch_to(r, path, request_id.as_ref(), orig, p, d).await
        };
        match attempt {
            Ok(resp) => return resp,
            Err(LegError { response, engine: Some(engine) }) => {
                tracing::info!(url = %engine.url, role = role_name(engine.role), status = %response.status(), "leg not taken; trying another engine");
                tried.push(engine);
                last = Some(response);
            }
            Err(LegError { response, engine: None }) => return response,
        }
    }
}

/// At most how many tokens a completion's prompt has, when that is plain without a tokenizer:
/// a token-id prompt's length, or a text's bytes plus two (a byte-level or byte-fallback
/// vocabulary spends at least one byte a token; a dummy-prefix space and a BOS may add one
/// each). A prompt this short runs on decode without asking decode what it holds (a round
/// trip that is most of the router's cost on a short prompt). `None` for chat messages.
fn prompt_tokens_at_most(orig: &Map<String, Value>) -> Option<usize> {
    match orig.get("prompt")? {
        Value::String(text) => Some(text.len() + 2),
        Value::Array(items) if items.iter().all(Value::is_u64) => Some(items.len()),
        _ => None,
    }
}

/// How long a routing hint (`/kv/prefix`) may hold a request up: past it the engine is routed
/// by load, as if it held nothing.
const PREFIX_QUERY_TIMEOUT: Duration = Duration::from_millis(500);

/// The engines KV-aware routing would take for a request (see [`Router::best_cached`]).
struct Preferred {
    prefill: Option<Arc<Backend>>,
    decode: Option<Arc<Backend>>,
}

/// A request's own say on disaggregation: `kv_transfer_params: {"disaggregate": true|false}`.
fn disaggregate_override(orig: &Map<String, Value>) -> Result<Option<bool>, String> {
    match orig.get("kv_transfer_params") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(kv)) => match kv.get("disaggregate") {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(format!("invalid `kv_transfer_params.disaggregate`: expected true or false, got {v}")),
        },
        Some(v) => Err(format!("invalid `kv_transfer_params`: expected an object, got {v}")),
    }
}

/// Conditional disaggregation: the whole request on decode engine `d`, as on a colocated
/// engine (its prefix cache serves what it holds; no prefill leg, no transfer).
async fn dispatch_local(
    r: &Arc<Router>,
    path: &str,
    request_id: Option<&axum::http::HeaderValue>,
    orig: &Map<String, Value>,
    d: Arc<Backend>,
) -> Result<Response, LegError> {
    let mut body = orig.clone();
    body.remove("kv_transfer_params");
    let mut req = r.http.post(format!("{}{path}", d.url)).json(&body);
    if let Some(id) = request_id {
        req = req.header("x-request-id", id.clone());
    }
    let d_guard = d.start();
    tracing::debug!(url = %d.url, "short uncached prompt: run on decode alone");
    let streamed = is_streamed(orig);
    match req.send().await {
        Ok(resp) if resp.status().is_success() => {
            answer(resp, streamed, &d, Some(d_guard), Legs::default(), r.abort.subscribe()).await
        }
        Ok(resp) => Err(leg_error("decode", &d, resp).await),
        Err(e) => Err(leg_failed(&d, "decode", &e)),
    }
}

/// One attempt at the two legs on prefill engine `p` and decode engine `d`.
async fn dispatch_to(
    r: &Arc<Router>,
    path: &'static str,
    request_id: Option<&axum::http::HeaderValue>,
    orig: &Map<String, Value>,
    p: Arc<Backend>,
    d: Arc<Backend>,
) -> Result<Response, LegError> {
    let transfer_id = r.transfer_id();
    let post = |b: &Arc<Backend>, json: Value| {
        let mut req = r.http.post(format!("{}{path}", b.url)).json(&json);
        if let Some(id) = request_id {
            req = req.header("x-request-id", id.clone());
        }
        req
    };
    let p_guard = p.start();
    let p_req = post(&p, prefill_body(orig, &transfer_id)).timeout(r.cfg.prefill_timeout);
    match r.cfg.mode {
        TransferMode::Pull => {
            let presp = p_req.send().await.map_err(|e| leg_failed(&p, "prefill", &e))?;
            if !presp.status().is_success() {
                return Err(leg_error("prefill", &p, presp).await);
            }
            let pjson: Value = presp
                .json()
                .await
                .map_err(|e| error(StatusCode::BAD_GATEWAY, format!("prefill leg to {}: {}", p.url, describe(&e))))?;
            drop(p_guard);
            let Some(kv) = pjson.get("kv_transfer_params").filter(|v| !v.is_null()).cloned() else {
                return Err(error(
                    StatusCode::BAD_GATEWAY,
                    format!("prefill engine {} returned no kv_transfer_params", p.url),
                )
                .into());
            };
            let mut db = orig.clone();
            db.insert("kv_transfer_params".into(), kv);
            // Prefill holds the prompt's blocks under a lease for the decode read: if none takes
            // it (every decode leg failed, or the client went away), they are freed now.
            let release = r.release_on_drop(&p, &transfer_id);
            // The KV waits under its lease: a decode engine that does not take the leg leaves it
            // for another one, without computing the prompt again.
            let mut tried = Vec::new();
            let mut d = d;
            let streamed = is_streamed(orig);
            loop {
                let d_guard = d.start();
                let failed = match post(&d, Value::Object(db.clone())).send().await {
                    Ok(resp) if resp.status().is_success() => {
                        let legs = Legs { _tasks: Vec::new(), _release: Some(release) };
                        return answer(resp, streamed, &d, Some(d_guard), legs, r.abort.subscribe()).await;
                    }
                    Ok(resp) => leg_error("decode", &d, resp).await,
                    Err(e) => leg_failed(&d, "decode", &e),
                };
                let Some(engine) = failed.engine.clone() else { return Err(failed.response.into()) };
                tracing::info!(url = %engine.url, status = %failed.response.status(), "decode leg not taken; trying another decode engine");
                tried.push(engine);
                match r.pick_decode(&p, r.turn.fetch_add(1, Ordering::Relaxed), &tried) {
                    Some(next) => d = next,
                    // (Prefill itself is not tried again; `release` frees its KV.)
                    None => return Err(failed.response.into()),
                }
            }
        }
        TransferMode::Push => {
            let d_guard = d.start();
            // Tried as a last resort (down at its last check, or not checked yet): checked now,
            // since it may have come back (a restart: its side channel has a new epoch).
            if p.kv().is_none() {
                p.set_state(r.probe(&p).await);
            }
            let kv = p.kv().ok_or_else(|| {
                error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!("prefill engine {} is not ready (its KV side channel is unknown)", p.url),
                )
            })?;
            let d_kv = KvTransferParams {
                do_remote_prefill: true,
                remote_engine_id: Some(kv.engine_id),
                remote_host: Some(kv.host),
                remote_port: Some(kv.port),
                transfer_id: Some(transfer_id.clone()),
                remote_request_id: Some(transfer_id.clone()),
                tp_size: Some(1),
                pp_size: Some(1),
                ..Default::default()
            };
            let mut db = orig.clone();
            db.insert("kv_transfer_params".into(), serde_json::to_value(d_kv).unwrap_or(Value::Null));
            // Whatever ends this attempt other than decode's whole answer (a failed leg, the
            // client going away) has prefill free what it computed under the transfer id, at
            // once: decode may never have registered for it.
            let release = r.release_on_drop(&p, &transfer_id);
            // Both legs at once: decode registers its blocks while prefill computes.
            let prefill = p.clone();
            let mut prefill_leg = AbortOnDrop(tokio::spawn(async move {
                let _guard = p_guard;
                match p_req.send().await {
                    Ok(resp) if resp.status().is_success() => {
                        let _ = resp.bytes().await;
                        Ok(())
                    }
                    Ok(resp) => Err(leg_error("prefill", &prefill, resp).await),
                    Err(e) => Err(leg_failed(&prefill, "prefill", &e)),
                }
            }));
            let decode_leg = post(&d, Value::Object(db)).send();
            tokio::pin!(decode_leg);
            let dresp = tokio::select! {
                d = &mut decode_leg => d,
                p = &mut prefill_leg.0 => match p {
                    // The prefill leg failed before decode answered: report it (or try another
                    // pair); dropping the decode leg cancels it on the decode engine.
                    Ok(Err(failed)) => return Err(failed),
                    _ => decode_leg.await,
                },
            };
            let streamed = is_streamed(orig);
            let failed = match dresp {
                Ok(resp) if resp.status().is_success() => {
                    let legs = Legs { _tasks: vec![prefill_leg], _release: Some(release) };
                    return answer(resp, streamed, &d, Some(d_guard), legs, r.abort.subscribe()).await;
                }
                Ok(resp) => leg_error("decode", &d, resp).await,
                Err(e) => leg_failed(&d, "decode", &e),
            };
            // No decode engine will register for this KV: dropping the prefill leg cancels a
            // prompt still computing, and the release frees one already finished. (The KV's
            // transfer id named this decode engine's registration: another pair starts anew.)
            drop(prefill_leg);
            drop(release);
            Err(failed)
        }
    }
}
