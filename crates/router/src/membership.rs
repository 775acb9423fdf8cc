//! Engines from discovery: the router follows a [`Membership`] (etcd's, through
//! `tandem-discovery`) and serves the prefill and decode engines in it, beside any it was given
//! on its command line.
//!
//! An engine that joins is checked at once (as `/admin/engines` checks one) and takes requests
//! as soon as it is ready; one that cannot serve its role here (another mode, a model its peers
//! cannot pair with, https without a CA) is never routed to, with a line saying why. An engine
//! that leaves the membership takes no new request (what it is answering finishes there): at once
//! when it withdrew (it answers `/health` "draining") or is gone, and after its lease when it
//! still answers healthy (etcd expiring leases it could not renew, after an outage: it registers
//! again meanwhile, and stays).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tandem_discovery::{DiscoveryHealth, Membership};
use tandem_kv::Role;

use crate::answer::AbortOnDrop;
use crate::backend::{Backend, BackendState};
use crate::proxy::{role_name, Router};

/// The router following a membership; it stops when this drops.
pub struct Following(#[allow(dead_code)] AbortOnDrop<()>);

impl Router {
    /// Serves the engines `membership` holds, following its changes until the returned guard
    /// drops; `health` is shown in `/health`.
    pub fn follow_membership(
        self: &Arc<Self>,
        mut membership: tokio::sync::watch::Receiver<Option<Membership>>,
        health: Arc<DiscoveryHealth>,
    ) -> Following {
        let _ = self.discovery.set(health);
        let r = self.clone();
        Following(AbortOnDrop(tokio::spawn(async move {
            let mut joined = Joined::default();
            loop {
                let now = membership.borrow_and_update().clone();
                if let Some(now) = now {
                    r.reconcile(&now, &mut joined).await;
                }
                // Changes, and engines kept past their keys to look at again.
                tokio::select! {
                    changed = membership.changed() => if changed.is_err() { return },
                    _ = tokio::time::sleep(Duration::from_millis(500)), if !joined.kept.is_empty() => {}
                }
            }
        })))
    }

    /// Adds the members not served yet and takes out those that left; `joined` holds the
    /// engines that came from the membership (engines given on the command line never leave by
    /// it).
    async fn reconcile(&self, members: &Membership, joined: &mut Joined) {
        let mut wanted = BTreeMap::new();
        for record in members.values() {
            let role = match record.role.as_str() {
                "prefill" => Role::Prefill,
                "decode" => Role::Decode,
                _ => continue,
            };
            wanted.insert(
                record.http_url.trim_end_matches('/').to_string(),
                (role, record.engine_id.clone(), record.lease_secs),
            );
        }
        let arriving: Vec<Arc<Backend>> = wanted
            .iter()
            .filter(|(url, (role, ..))| !self.engines_of(*role).list().iter().any(|b| &b.url == *url))
            .map(|(url, (role, ..))| Arc::new(Backend::new(url, *role)))
            .collect();
        let vetted = futures::future::join_all(arriving.iter().map(|b| self.vet(b))).await;
        for (b, vetted) in arriving.into_iter().zip(vetted) {
            let (_, engine_id, lease_secs) = &wanted[&b.url];
            match vetted {
                Err(why) => {
                    tracing::error!(url = %b.url, %engine_id, %why, "discovered engine not taken into service")
                }
                Ok(state) => {
                    match &state {
                        BackendState::Ready(_) => {}
                        BackendState::Down(why) => {
                            tracing::warn!(url = %b.url, %engine_id, %why, "discovered engine cannot be reached yet")
                        }
                        _ => {}
                    }
                    b.set_state(state);
                    if self.engines_of(b.role).add(b.clone()) {
                        tracing::info!(url = %b.url, %engine_id, role = role_name(b.role), "engine joined (discovery)");
                        joined.leases.insert(b.url.clone(), Duration::from_secs(*lease_secs));
                    }
                }
            }
        }
        for (url, lease) in joined.leases.clone() {
            if wanted.contains_key(&url) {
                if joined.kept.remove(&url).is_some() {
                    tracing::info!(%url, "engine registered again (discovery)");
                }
                continue;
            }
            let why = match joined.kept.get(&url) {
                Some(until) if Instant::now() < *until => continue,
                Some(_) => "its key did not come back within its lease",
                None if self.answers_healthy(&url).await => {
                    tracing::warn!(%url, "engine's key lapsed while it answers healthy (etcd may have expired its lease): kept for a lease");
                    joined.kept.insert(url, Instant::now() + lease);
                    continue;
                }
                None => "withdrawn or gone",
            };
            if self.prefill.remove_any(&url) || self.decode.remove_any(&url) {
                tracing::info!(%url, %why, "engine left (discovery): no new requests go to it");
            }
            joined.leases.remove(&url);
            joined.kept.remove(&url);
        }
    }

    /// Whether the engine at `url` (one of ours) is ready now (a draining one is not).
    async fn answers_healthy(&self, url: &str) -> bool {
        let all = [self.prefill.list(), self.decode.list()];
        let Some(b) = all.iter().flat_map(|l| l.iter()).find(|b| b.url == url).cloned() else { return false };
        let state = self.probe(&b).await;
        let ready = matches!(state, BackendState::Ready(_));
        b.set_state(state);
        ready
    }

    fn engines_of(&self, role: Role) -> &crate::proxy::Engines {
        match role {
            Role::Prefill => &self.prefill,
            _ => &self.decode,
        }
    }
}

/// The engines that came from the membership: each one's lease, and those kept past their keys
/// (until when).
#[derive(Default)]
struct Joined {
    leases: HashMap<String, Duration>,
    kept: HashMap<String, Instant>,
}
