//! Engines from discovery: the router follows a [`Membership`] (etcd's, through
//! `tandem-discovery`) and serves the prefill and decode engines in it, beside any it was given
//! on its command line.
//!
//! An engine that joins is checked at once (as `/admin/engines` checks one) and takes requests
//! as soon as it is ready; one that cannot serve its role here (another mode, a model its peers
//! cannot pair with, https without a CA) is never routed to, with a line saying why. An engine
//! that leaves the membership (withdrawn on shutdown, or its lease lapsed) takes no new request;
//! what it is answering finishes there.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

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
            let mut joined = HashSet::new();
            loop {
                let now = membership.borrow_and_update().clone();
                if let Some(now) = now {
                    r.reconcile(&now, &mut joined).await;
                }
                if membership.changed().await.is_err() {
                    return;
                }
            }
        })))
    }

    /// Adds the members not served yet and takes out those that left; `joined` holds the URLs
    /// that came from the membership (engines given on the command line never leave by it).
    async fn reconcile(&self, members: &Membership, joined: &mut HashSet<String>) {
        let mut wanted = BTreeMap::new();
        for record in members.values() {
            let role = match record.role.as_str() {
                "prefill" => Role::Prefill,
                "decode" => Role::Decode,
                _ => continue,
            };
            wanted.insert(record.http_url.trim_end_matches('/').to_string(), (role, record.engine_id.clone()));
        }
        let arriving: Vec<Arc<Backend>> = wanted
            .iter()
            .filter(|(url, (role, _))| !self.engines_of(*role).list().iter().any(|b| &b.url == *url))
            .map(|(url, (role, _))| Arc::new(Backend::new(url, *role)))
            .collect();
        let vetted = futures::future::join_all(arriving.iter().map(|b| self.vet(b))).await;
        for (b, vetted) in arriving.into_iter().zip(vetted) {
            let engine_id = &wanted[&b.url].1;
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
                        joined.insert(b.url.clone());
                    }
                }
            }
        }
        for url in joined.clone() {
            if wanted.contains_key(&url) {
                continue;
            }
            if self.prefill.remove_any(&url) || self.decode.remove_any(&url) {
                tracing::info!(%url, "engine left (discovery): no new requests go to it");
            }
            joined.remove(&url);
        }
    }

    fn engines_of(&self, role: Role) -> &crate::proxy::Engines {
        match role {
            Role::Prefill => &self.prefill,
            _ => &self.decode,
        }
    }
}
