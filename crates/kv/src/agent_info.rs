//! What an engine tells a peer about itself at handshake, and whether two engines can pair.
//!
//! Everything that would make a transfer wrong is checked here, once, when the connection
//! opens: a prefill and a decode engine that disagree on the transfer mode, the model, the
//! dtype or the KV shape are refused with a message naming the field, never mid-transfer.
//! Block sizes may differ (each side maps token positions to its own layout).

use serde::{Deserialize, Serialize};
use tandem_core::{EngineId, Epoch};

/// An engine's part in disaggregated serving.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Runs prompts and hands their KV to decode engines.
    Prefill,
    /// Receives KV and generates.
    Decode,
    /// Does both (colocated).
    Both,
}

/// How KV moves between prefill and decode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvMode {
    /// Decode registers its blocks early; prefill writes into them.
    Push,
    /// Prefill holds its blocks under a lease; decode reads them.
    Pull,
}

/// A data transport an engine offers, with its endpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum TransportOffer {
    /// Bulk data over the side-channel TCP connection.
    Tcp {
        /// `host:port` of the engine's KV listener.
        addr: String,
    },
    /// Direct copies between KV memories, for engines in one process (tests, single-host
    /// setups). Control messages still use the side channel.
    Local {
        /// Process id the engine lives in.
        process: u32,
        /// The engine's key in that process's registry.
        key: String,
    },
    /// Device-to-device copies into a GPU engine's KV cache, mapped by CUDA IPC: for engines
    /// on one host, on one GPU or on two with peer access. Control messages still use the side
    /// channel.
    CudaIpc {
        /// Identifies the host (its boot id): IPC handles mean nothing elsewhere.
        host: String,
        /// Process id the engine lives in (a handle cannot be opened in its own process).
        process: u32,
        /// UUID of the GPU holding the cache, hex.
        device: String,
        /// The cache allocation's IPC handle, hex.
        handle: String,
        /// Bytes of the allocation.
        bytes: u64,
    },
    /// NIXL one-sided WRITEs into the engine's registered KV memory (`--kv-transport nixl`).
    /// Control messages still use the side channel.
    Nixl {
        /// The engine's NIXL agent name (unique per connector: engine id and epoch).
        agent: String,
        /// The agent's metadata (connection info and registered memory), hex.
        metadata: String,
        /// Where the KV blocks start in the engine's process (a number to address writes by).
        addr: u64,
        /// Bytes of the registered KV memory.
        bytes: u64,
        /// Where the engine's probe scratch memory starts (see `NixlEndpoint::probe`).
        scratch_addr: u64,
        /// Bytes of the scratch memory.
        scratch_bytes: u64,
        /// The CUDA ordinal (in the engine's process) of the GPU holding the KV and the
        /// scratch memory; none for host memory.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        gpu: Option<u32>,
    },
}

impl TransportOffer {
    /// The offer's transport name, as `--kv-transport` spells it.
    pub fn name(&self) -> &'static str {
        match self {
            TransportOffer::Tcp { .. } => "tcp",
            TransportOffer::Local { .. } => "local",
            TransportOffer::CudaIpc { .. } => "cuda-ipc",
            TransportOffer::Nixl { .. } => "nixl",
        }
    }
}

/// An engine's identity and KV shape, exchanged at handshake.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentInfo {
    /// Stable name of the engine.
    pub engine_id: EngineId,
    /// This incarnation; changes on restart.
    pub epoch: Epoch,
    /// Prefill, decode or both.
    pub role: Role,
    /// Push or pull.
    pub kv_mode: KvMode,
    /// Tensor-parallel rank of this agent.
    pub tp_rank: u32,
    /// Tensor-parallel size of the engine (any pairs with any: the connector moves every
    /// rank's KV heads as one region).
    pub tp_size: u32,
    /// Identifies the weights (architecture, shape, a hash of the weights): KV from another
    /// model is garbage.
    pub model_fingerprint: String,
    /// Element type of the KV cache (`f32` on CPU).
    pub dtype: String,
    /// Transformer layers.
    pub num_layers: usize,
    /// KV heads the connector moves (every rank's).
    pub num_kv_heads: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Bytes per block.
    pub block_bytes: usize,
    /// Blocks in the pool.
    pub num_blocks: usize,
    /// Data transports offered.
    pub transports: Vec<TransportOffer>,
    /// Bulk sends carry checksums (`--kv-verify`); both ends of a pair must agree.
    #[serde(default)]
    pub kv_verify: bool,
    /// TCP connections a pair's tcp transport stripes its bytes over (`--kv-tcp-streams`); a
    /// pair uses the smaller of its two ends' counts.
    #[serde(default = "one_stream")]
    pub tcp_streams: usize,
}

fn one_stream() -> usize {
    1
}

/// Why two engines cannot pair.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Incompatible {
    /// Different protocol versions.
    #[error("protocol version {local} here, {remote} on the peer")]
    Version {
        /// Ours.
        local: u32,
        /// Theirs.
        remote: u32,
    },
    /// A field that must match does not.
    #[error("{field} differs: {local} here, {remote} on the peer `{peer}`")]
    Mismatch {
        /// The field, as named in AgentInfo.
        field: &'static str,
        /// Our value.
        local: String,
        /// Their value.
        remote: String,
        /// The peer's engine id.
        peer: String,
    },
    /// The roles cannot exchange KV (e.g. two decode engines).
    #[error("a {local:?} engine cannot pair with a {remote:?} engine")]
    Roles {
        /// Ours.
        local: Role,
        /// Theirs.
        remote: Role,
    },
}

impl AgentInfo {
    /// The metadata of a TP-1 engine whose connector moves `dtype` KV in `layout` (f32 for
    /// CPU engines, bf16 for a GPU engine's cache and its host copy).
    #[allow(clippy::too_many_arguments)]
    pub fn for_layout(
        engine_id: EngineId,
        epoch: Epoch,
        role: Role,
        kv_mode: KvMode,
        model_fingerprint: String,
        layout: &tandem_compute::KvLayout,
        dtype: tandem_compute::KvDtype,
        transports: Vec<TransportOffer>,
    ) -> Self {
        Self {
            engine_id,
            epoch,
            role,
            kv_mode,
            tp_rank: 0,
            tp_size: 1,
            model_fingerprint,
            dtype: dtype.name().into(),
            num_layers: layout.num_layers,
            num_kv_heads: layout.num_kv_heads,
            head_dim: layout.head_dim,
            block_size: layout.block_size,
            block_bytes: layout.block_elems() * dtype.bytes(),
            num_blocks: layout.num_blocks,
            transports,
            kv_verify: false,
            tcp_streams: 1,
        }
    }

    /// The TCP side-channel address this engine offers.
    pub fn tcp_addr(&self) -> Option<&str> {
        self.transports.iter().find_map(|t| match t {
            TransportOffer::Tcp { addr } => Some(addr.as_str()),
            TransportOffer::Local { .. } | TransportOffer::CudaIpc { .. } | TransportOffer::Nixl { .. } => None,
        })
    }

    /// Checks that `self` (this engine) can exchange KV with `peer`.
    pub fn check_pairing(&self, peer: &AgentInfo) -> Result<(), Incompatible> {
        let roles_ok = matches!(
            (self.role, peer.role),
            (Role::Prefill, Role::Decode) | (Role::Decode, Role::Prefill) | (Role::Both, _) | (_, Role::Both)
        );
        if !roles_ok {
            return Err(Incompatible::Roles { local: self.role, remote: peer.role });
        }
        let mismatch = |field: &'static str, local: String, remote: String| Incompatible::Mismatch {
            field,
            local,
            remote,
            peer: peer.engine_id.0.clone(),
        };
        if self.kv_mode != peer.kv_mode {
            return Err(mismatch(
                "kv_mode",
                format!("{:?}", self.kv_mode).to_lowercase(),
                format!("{:?}", peer.kv_mode).to_lowercase(),
            ));
        }
        if self.model_fingerprint != peer.model_fingerprint {
            return Err(mismatch("model_fingerprint", self.model_fingerprint.clone(), peer.model_fingerprint.clone()));
        }
        if self.dtype != peer.dtype {
            return Err(mismatch("dtype", self.dtype.clone(), peer.dtype.clone()));
        }
        if self.kv_verify != peer.kv_verify {
            let on = |v: bool| if v { "on" } else { "off" }.to_string();
            return Err(mismatch("kv_verify", on(self.kv_verify), on(peer.kv_verify)));
        }
        for (field, a, b) in [
            ("num_layers", self.num_layers, peer.num_layers),
            ("num_kv_heads", self.num_kv_heads, peer.num_kv_heads),
            ("head_dim", self.head_dim, peer.head_dim),
        ] {
            if a != b {
                return Err(mismatch(field, a.to_string(), b.to_string()));
            }
        }
        Ok(())
    }

    /// A plausible value for tests.
    pub fn example() -> Self {
        Self {
            engine_id: EngineId("prefill-0".into()),
            epoch: Epoch(1),
            role: Role::Prefill,
            kv_mode: KvMode::Push,
            tp_rank: 0,
            tp_size: 1,
            model_fingerprint: "Qwen3ForCausalLM/abc".into(),
            dtype: "f32".into(),
            num_layers: 4,
            num_kv_heads: 2,
            head_dim: 32,
            block_size: 16,
            block_bytes: 4 * 2 * 2 * 16 * 32 * 4,
            num_blocks: 100,
            transports: vec![TransportOffer::Tcp { addr: "127.0.0.1:5600".into() }],
            kv_verify: false,
            tcp_streams: 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairing_checks_name_the_field() {
        let p = AgentInfo::example();
        let d = AgentInfo { engine_id: EngineId("decode-0".into()), role: Role::Decode, block_size: 8, ..p.clone() };
        assert_eq!(p.check_pairing(&d), Ok(()), "block sizes may differ");
        assert_eq!(p.check_pairing(&AgentInfo { tp_size: 2, ..d.clone() }), Ok(()), "and tensor-parallel sizes");
        let cases: Vec<(AgentInfo, &str)> = vec![
            (AgentInfo { kv_mode: KvMode::Pull, ..d.clone() }, "kv_mode differs: push here, pull"),
            (AgentInfo { model_fingerprint: "other".into(), ..d.clone() }, "model_fingerprint differs"),
            (AgentInfo { dtype: "bf16".into(), ..d.clone() }, "dtype differs: f32 here, bf16"),
            (AgentInfo { num_layers: 5, ..d.clone() }, "num_layers differs: 4 here, 5"),
            (AgentInfo { head_dim: 64, ..d.clone() }, "head_dim differs"),
            (AgentInfo { kv_verify: true, ..d.clone() }, "kv_verify differs: off here, on"),
            (AgentInfo { role: Role::Prefill, ..d.clone() }, "cannot pair"),
        ];
        for (peer, needle) in cases {
            let e = p.check_pairing(&peer).unwrap_err().to_string();
            assert!(e.contains(needle), "`{needle}` not in `{e}`");
        }
    }
}
