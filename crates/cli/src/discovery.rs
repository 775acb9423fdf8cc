//! `--discovery etcd://...` on `serve` and `router`: the flags, and the record an engine
//! registers.

use anyhow::Result;
use clap::Args;
use tandem_discovery::{DiscoveryConfig, EngineRecord};

#[derive(Args, Debug, Clone)]
pub struct DiscoveryArgs {
    /// Find each other through etcd: `etcd://HOST:PORT[,HOST:PORT...]`. An engine registers
    /// itself (role, model, addresses, transports, capacity) under a lease it keeps alive and
    /// withdraws on shutdown before draining; a router serves every prefill and decode engine
    /// registered under the prefix (besides any --prefill/--decode), as they come and go. etcd
    /// out of reach stops neither: engines keep serving, routers keep their last view. Needs a
    /// tandem built with `--features etcd`.
    #[arg(long, value_name = "URL")]
    pub discovery: Option<String>,
    /// Key prefix of this deployment in etcd (deployments sharing an etcd use different ones).
    #[arg(long, value_name = "PREFIX", default_value = "/tandem")]
    pub discovery_prefix: String,
    /// `serve`: seconds an engine's key outlives its last keep-alive: a killed engine leaves
    /// the routers within this.
    #[arg(long, value_name = "SECS", default_value_t = 5)]
    pub discovery_lease_secs: u64,
}

impl DiscoveryArgs {
    /// The discovery setup, if `--discovery` was given.
    pub fn config(&self) -> Result<Option<DiscoveryConfig>> {
        let Some(url) = &self.discovery else { return Ok(None) };
        let lease = std::time::Duration::from_secs(self.discovery_lease_secs);
        Ok(Some(DiscoveryConfig::parse(url, &self.discovery_prefix, lease)?))
    }
}

/// What a serving engine registers: from its KV side channel's metadata where it has one.
pub fn engine_record(
    info: Option<&tandem_kv::AgentInfo>,
    fallback_id: String,
    model: &str,
    fingerprint: &str,
    http_url: String,
    lease_secs: u64,
) -> EngineRecord {
    let role = |r: tandem_kv::Role| match r {
        tandem_kv::Role::Prefill => "prefill",
        tandem_kv::Role::Decode => "decode",
        tandem_kv::Role::Both => "colocated",
    };
    EngineRecord {
        engine_id: info.map_or(fallback_id, |i| i.engine_id.0.clone()),
        epoch: info.map_or(0, |i| i.epoch.0),
        role: info.map_or("colocated", |i| role(i.role)).to_string(),
        kv_mode: info
            .map(|i| match i.kv_mode {
                tandem_kv::KvMode::Push => "push",
                tandem_kv::KvMode::Pull => "pull",
            })
            .unwrap_or_default()
            .to_string(),
        model: model.to_string(),
        fingerprint: fingerprint.to_string(),
        http_url,
        kv_address: info.and_then(|i| i.tcp_addr()).map(String::from),
        transports: info.map(|i| i.transports.iter().map(|t| t.name().to_string()).collect()).unwrap_or_default(),
        block_size: info.map_or(0, |i| i.block_size),
        capacity_blocks: info.map_or(0, |i| i.num_blocks),
        lease_secs,
    }
}
