//! The etcd side: an engine's key under its lease, and a router's watch of every key.
//!
//! Every call to etcd is bounded (the client's request timeout, and HTTP/2 keep-alives that
//! notice a silent connection); whatever breaks a session ends it, and the caller's loop starts
//! another after a pause, so nothing here ever stops trying and nothing waits forever.

use std::sync::Arc;
use std::time::{Duration, Instant};

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, PutOptions, Txn, TxnOp, TxnOpResponse,
    WatchOptions,
};
use tokio::sync::{oneshot, watch as channel};

use crate::{DiscoveryConfig, DiscoveryHealth, EngineRecord, Membership, Registration};

/// Pause after a failed session: short at first, then up to this.
const MAX_PAUSE: Duration = Duration::from_secs(2);

/// A client pinned to one member that answers, trying them in turn from `*turn` (which is left
/// naming the member it pinned). etcd's client spreads requests over every endpoint it is
/// given, and a request sent to a member that is down fails there rather than going to another:
/// with one member of three down a third of all calls would fail. So a session talks to one
/// member; when that member goes, the session ends and the next one pins another (as etcd's
/// own clients fail over). Every call requires the member to have a leader: one cut off from
/// the others' quorum refuses calls and cancels watches instead of serving a stale view
/// silently, so the session moves on.
async fn connect(cfg: &DiscoveryConfig, turn: &mut usize) -> Result<Client, String> {
    let bound = cfg.lease_ttl.min(Duration::from_secs(5));
    // HTTP/2 pings no more often than every 10 s: etcd takes pings less than 5 s apart
    // (`--grpc-keepalive-min-time`) as abuse and closes the connection, which broke an idle
    // watch every few seconds when they went every second.
    let options = ConnectOptions::new()
        .with_connect_timeout(bound)
        .with_timeout(bound)
        .with_keep_alive(Duration::from_secs(10), bound)
        .with_keep_alive_while_idle(true)
        .with_require_leader(true);
    let members = cfg.endpoints.len();
    let mut refused = Vec::with_capacity(members);
    for i in 0..members {
        let at = (*turn + i) % members;
        let endpoint = &cfg.endpoints[at];
        let answered = async {
            let mut client = Client::connect([endpoint], Some(options.clone())).await?;
            client.status().await.map(|_| client)
        };
        match tokio::time::timeout(bound, answered).await {
            Ok(Ok(client)) => {
                *turn = at;
                return Ok(client);
            }
            Ok(Err(e)) => refused.push(format!("{endpoint}: {e}")),
            Err(_) => refused.push(format!("{endpoint}: no answer within {bound:?}")),
        }
    }
    Err(format!("no etcd member answered ({})", refused.join("; ")))
}

/// Where a process starts looking for a member: spread over the members, so that many engines
/// do not all pin the first.
fn first_turn() -> usize {
    std::process::id() as usize
}

fn pause(after: Duration) -> Duration {
    (after * 2).clamp(Duration::from_millis(100), MAX_PAUSE)
}

pub(crate) fn register(cfg: DiscoveryConfig, record: EngineRecord, health: Arc<DiscoveryHealth>) -> Registration {
    let (stop, mut stopped) = oneshot::channel::<oneshot::Sender<()>>();
    let task = tokio::spawn(async move {
        let mut wait = Duration::ZERO;
        let mut turn = first_turn();
        loop {
            match hold(&cfg, &record, &health, &mut stopped, &mut turn).await {
                Ok(()) => return,
                Err(e) => {
                    turn += 1;
                    if health.down(e.clone()) {
                        tracing::warn!(error = %e, "etcd: not registered; still serving, registering again when etcd answers");
                    } else {
                        tracing::debug!(error = %e, "etcd: registering failed again");
                    }
                }
            }
            wait = pause(wait);
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                done = &mut stopped => {
                    if let Ok(done) = done {
                        let _ = done.send(());
                    }
                    return;
                }
            }
        }
    });
    Registration { stop: Some(stop), task }
}

/// One session: a lease, the key under it, keep-alives until withdrawn (`Ok`) or until
/// something breaks (`Err`).
async fn hold(
    cfg: &DiscoveryConfig,
    record: &EngineRecord,
    health: &DiscoveryHealth,
    stopped: &mut oneshot::Receiver<oneshot::Sender<()>>,
    turn: &mut usize,
) -> Result<(), String> {
    let key = cfg.key_of(&record.engine_id);
    let value = serde_json::to_vec(record).map_err(|e| e.to_string())?;
    let mut client = connect(cfg, turn).await?;
    health.pinned(&cfg.endpoints[*turn]);
    let ttl = cfg.lease_ttl.as_secs().max(1) as i64;
    let lease = client.lease_grant(ttl, None).await.map_err(|e| format!("granting a lease: {e}"))?.id();
    // The key is written only if it is free or was this engine's (an earlier lease of its own,
    // or this engine restarted): another engine with the same id must not be displaced.
    let put = TxnOp::put(key.as_str(), value.clone(), Some(PutOptions::new().with_lease(lease)));
    let txn = Txn::new()
        .when([Compare::create_revision(key.as_str(), CompareOp::Equal, 0)])
        .and_then([put])
        .or_else([TxnOp::get(key.as_str(), None)]);
    let written = client.txn(txn).await.map_err(|e| format!("writing {key}: {e}"))?;
    if !written.succeeded() {
        let holder = written.op_responses().into_iter().find_map(|r| match r {
            TxnOpResponse::Get(g) => g.kvs().first().map(|kv| kv.value().to_vec()),
            _ => None,
        });
        let holder: Option<EngineRecord> = holder.and_then(|v| serde_json::from_slice(&v).ok());
        match holder {
            Some(h) if h.http_url == record.http_url => {
                client
                    .put(key.as_str(), value, Some(PutOptions::new().with_lease(lease)))
                    .await
                    .map_err(|e| format!("writing {key}: {e}"))?;
            }
            other => {
                let _ = client.lease_revoke(lease).await;
                let by = other.map_or_else(|| "something that is no engine record".into(), |h| h.http_url);
                tracing::error!(%key, held_by = %by, "etcd: another engine is registered under this engine's id: not registering (give each engine its own --engine-id)");
                return Err(format!("{key} is held by {by}"));
            }
        }
    }
    let (mut keeper, mut answers) =
        client.lease_keep_alive(lease).await.map_err(|e| format!("keeping the lease alive: {e}"))?;
    if health.up() {
        tracing::info!(%key, lease_secs = ttl, "etcd: registered");
    }
    let every = cfg.lease_ttl / 3;
    let mut tick = tokio::time::interval(every);
    let mut last_answer = Instant::now();
    loop {
        tokio::select! {
            done = &mut *stopped => {
                match tokio::time::timeout(Duration::from_secs(2), client.lease_revoke(lease)).await {
                    Ok(Ok(_)) => tracing::info!(%key, "etcd: withdrawn"),
                    Ok(Err(e)) => tracing::warn!(%key, error = %e, "etcd: withdrawing failed; the key lasts until its lease runs out"),
                    Err(_) => tracing::warn!(%key, "etcd: withdrawing timed out; the key lasts until its lease runs out"),
                }
                if let Ok(done) = done {
                    let _ = done.send(());
                }
                return Ok(());
            }
            _ = tick.tick() => {
                if last_answer.elapsed() > cfg.lease_ttl {
                    return Err(format!("no keep-alive answer for {:?}: the lease may have run out", cfg.lease_ttl));
                }
                keeper.keep_alive().await.map_err(|e| format!("keep-alive: {e}"))?;
            }
            answer = answers.message() => match answer.map_err(|e| format!("keep-alive: {e}"))? {
                Some(a) if a.ttl() > 0 => last_answer = Instant::now(),
                Some(_) => return Err("the lease ran out (etcd was out of reach too long)".into()),
                None => return Err("etcd ended the keep-alive stream".into()),
            },
        }
    }
}

pub(crate) fn watch(
    cfg: DiscoveryConfig,
    health: Arc<DiscoveryHealth>,
) -> (channel::Receiver<Option<Membership>>, tokio::task::JoinHandle<()>) {
    let (tx, rx) = channel::channel(None);
    let task = tokio::spawn(async move {
        let mut wait = Duration::ZERO;
        let mut turn = first_turn();
        loop {
            let e = follow(&cfg, &tx, &health, &mut turn).await;
            turn += 1;
            let known = tx.borrow().as_ref().map_or(0, |m| m.len());
            if health.down(e.clone()) {
                tracing::warn!(error = %e, engines = known, "etcd unreachable: keeping the last view of the engines");
            }
            wait = pause(wait);
            tokio::time::sleep(wait).await;
        }
    });
    (rx, task)
}

/// Reads every engine's key, then follows changes from that revision on; returns why it
/// stopped.
async fn follow(
    cfg: &DiscoveryConfig,
    tx: &channel::Sender<Option<Membership>>,
    health: &DiscoveryHealth,
    turn: &mut usize,
) -> String {
    let prefix = cfg.engines_prefix();
    let mut client = match connect(cfg, turn).await {
        Ok(c) => c,
        Err(e) => return e,
    };
    health.pinned(&cfg.endpoints[*turn]);
    let listing = match client.get(prefix.as_str(), Some(GetOptions::new().with_prefix())).await {
        Ok(l) => l,
        Err(e) => return format!("listing {prefix}: {e}"),
    };
    let mut members = Membership::new();
    for kv in listing.kvs() {
        if let Some((id, record)) = parse(&prefix, kv.key(), kv.value()) {
            members.insert(id, record);
        }
    }
    if health.up() {
        tracing::info!(engines = members.len(), %prefix, "etcd: following the engines");
    }
    tx.send_replace(Some(members.clone()));
    let revision = listing.header().map_or(0, |h| h.revision());
    let options = WatchOptions::new().with_prefix().with_start_revision(revision + 1);
    let mut stream = match client.watch(prefix.as_str(), Some(options)).await {
        Ok(s) => s,
        Err(e) => return format!("watching {prefix}: {e}"),
    };
    loop {
        let resp = match stream.message().await {
            Ok(Some(r)) => r,
            Ok(None) => return "etcd ended the watch".into(),
            Err(e) => return format!("watch: {e}"),
        };
        if resp.canceled() {
            return format!("etcd cancelled the watch: {}", resp.cancel_reason());
        }
        let mut changed = false;
        for event in resp.events() {
            let Some(kv) = event.kv() else { continue };
            match event.event_type() {
                EventType::Put => {
                    if let Some((id, record)) = parse(&prefix, kv.key(), kv.value()) {
                        changed |= members.insert(id, record.clone()).as_ref() != Some(&record);
                    }
                }
                EventType::Delete => {
                    let id = String::from_utf8_lossy(kv.key().strip_prefix(prefix.as_bytes()).unwrap_or(kv.key()));
                    changed |= members.remove(id.as_ref()).is_some();
                }
            }
        }
        if changed {
            tx.send_replace(Some(members.clone()));
        }
    }
}

/// One key's record, if it is one: a record that does not parse, or whose engine id is not its
/// key's, is skipped with a line saying so (never routed to).
fn parse(prefix: &str, key: &[u8], value: &[u8]) -> Option<(String, EngineRecord)> {
    let key = String::from_utf8_lossy(key);
    let id = key.strip_prefix(prefix)?.to_string();
    match serde_json::from_slice::<EngineRecord>(value) {
        Ok(r) if r.engine_id == id => Some((id, r)),
        Ok(r) => {
            tracing::warn!(%key, engine_id = %r.engine_id, "etcd: a record under another engine's key: skipped");
            None
        }
        Err(e) => {
            tracing::warn!(%key, error = %e, "etcd: a key that holds no engine record: skipped");
            None
        }
    }
}
