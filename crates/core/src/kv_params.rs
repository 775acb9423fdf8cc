//! `kv_transfer_params`: the request field (vLLM's names) that tells an engine its part in a
//! disaggregated request, and what a prefill engine answers for the decode leg.

use serde::{Deserialize, Serialize};

use crate::{EngineId, Epoch, TransferId};

/// The JSON object as clients and proxies send it. Unknown fields are ignored; which fields
/// are required depends on the engine's role and mode ([`KvTransferParams::resolve`]).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct KvTransferParams {
    /// This request is the prefill leg: compute the prompt's KV for a remote decoder.
    #[serde(default)]
    pub do_remote_decode: bool,
    /// This request is the decode leg: the prompt's KV comes from a remote prefill.
    #[serde(default)]
    pub do_remote_prefill: bool,
    /// The prefill engine's id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_engine_id: Option<String>,
    /// Pull: the prefill engine's blocks holding the prompt's KV.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_block_ids: Option<Vec<u32>>,
    /// The prefill engine's KV side-channel host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_host: Option<String>,
    /// The prefill engine's KV side-channel port.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_port: Option<u16>,
    /// The prefill leg's request id (informational; pairing uses `transfer_id`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_request_id: Option<String>,
    /// Tensor-parallel size of the prefill engine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp_size: Option<u32>,
    /// Pipeline-parallel size of the prefill engine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pp_size: Option<u32>,
    /// The router's id for this transfer attempt (pairs the two legs exactly).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transfer_id: Option<String>,
    /// tandem: the prefill engine's epoch when it produced the KV (pull; a restarted prefill
    /// has another epoch and its old blocks are void).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_epoch: Option<u64>,
    /// tandem: tokens whose KV the prefill engine holds (pull).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_num_tokens: Option<usize>,
    /// tandem: the first token the prefill engine sampled (pull), emitted by decode as is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_token_id: Option<u32>,
}

/// What a request's `kv_transfer_params` asks of this engine, validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RemoteKv {
    /// Prefill leg: compute the prompt's KV and hand it to the connector under `transfer_id`.
    Produce {
        /// The attempt.
        transfer_id: TransferId,
    },
    /// Decode leg, push: register blocks with the prefill engine at `peer`; it writes them.
    PushFrom {
        /// The attempt.
        transfer_id: TransferId,
        /// The prefill engine's KV side channel, `host:port`.
        peer: String,
        /// The prefill engine's id, if the router said.
        peer_engine: Option<EngineId>,
    },
    /// Decode leg, pull: read `blocks` from the prefill engine at `peer`.
    PullFrom {
        /// The attempt.
        transfer_id: TransferId,
        /// The prefill engine's KV side channel, `host:port`.
        peer: String,
        /// The prefill engine's id.
        peer_engine: Option<EngineId>,
        /// The prefill engine's epoch when it produced the KV.
        epoch: Epoch,
        /// Its blocks, in token order.
        blocks: Vec<u32>,
        /// Tokens of KV they hold.
        num_tokens: usize,
        /// The token prefill sampled.
        first_token: u32,
    },
}

impl RemoteKv {
    /// The attempt this names.
    pub fn transfer_id(&self) -> &TransferId {
        match self {
            RemoteKv::Produce { transfer_id }
            | RemoteKv::PushFrom { transfer_id, .. }
            | RemoteKv::PullFrom { transfer_id, .. } => transfer_id,
        }
    }
}

/// Which way this engine moves KV.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransferMode {
    /// Decode registers, prefill writes.
    Push,
    /// Prefill holds, decode reads.
    Pull,
}

impl KvTransferParams {
    /// Validates the params for an engine in `mode`. `Ok(None)`: an ordinary local request.
    /// Errors name the missing or inconsistent field (they become HTTP 400s).
    pub fn resolve(&self, mode: TransferMode) -> Result<Option<RemoteKv>, String> {
        let transfer_id = || {
            self.transfer_id
                .clone()
                .or_else(|| self.remote_request_id.clone())
                .filter(|t| !t.is_empty())
                .map(TransferId)
                .ok_or_else(|| "kv_transfer_params.transfer_id is required".to_string())
        };
        match (self.do_remote_decode, self.do_remote_prefill) {
            (false, false) => Ok(None),
            (true, true) => {
                Err("kv_transfer_params: do_remote_decode and do_remote_prefill cannot both be true".into())
            }
            (true, false) => Ok(Some(RemoteKv::Produce { transfer_id: transfer_id()? })),
            (false, true) => {
                let host = self
                    .remote_host
                    .clone()
                    .filter(|h| !h.is_empty())
                    .ok_or("kv_transfer_params.remote_host is required")?;
                let port = self.remote_port.ok_or("kv_transfer_params.remote_port is required")?;
                let peer = if host.contains(':') && !host.starts_with('[') {
                    format!("[{host}]:{port}")
                } else {
                    format!("{host}:{port}")
                };
                let peer_engine = self.remote_engine_id.clone().map(EngineId);
                let transfer_id = transfer_id()?;
                match mode {
                    TransferMode::Push => Ok(Some(RemoteKv::PushFrom { transfer_id, peer, peer_engine })),
                    TransferMode::Pull => {
                        let blocks = self
                            .remote_block_ids
                            .clone()
                            .ok_or("kv_transfer_params.remote_block_ids is required in pull mode")?;
                        let num_tokens = self
                            .remote_num_tokens
                            .ok_or("kv_transfer_params.remote_num_tokens is required in pull mode")?;
                        let epoch =
                            self.remote_epoch.ok_or("kv_transfer_params.remote_epoch is required in pull mode")?;
                        let first_token =
                            self.first_token_id.ok_or("kv_transfer_params.first_token_id is required in pull mode")?;
                        Ok(Some(RemoteKv::PullFrom {
                            transfer_id,
                            peer,
                            peer_engine,
                            epoch: Epoch(epoch),
                            blocks,
                            num_tokens,
                            first_token,
                        }))
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> KvTransferParams {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn resolves_each_leg_and_names_missing_fields() {
        assert_eq!(parse("{}").resolve(TransferMode::Push), Ok(None));
        let p = parse(r#"{"do_remote_decode": true, "transfer_id": "t1", "unknown": 5}"#);
        assert_eq!(p.resolve(TransferMode::Pull), Ok(Some(RemoteKv::Produce { transfer_id: TransferId("t1".into()) })));
        let push = parse(
            r#"{"do_remote_prefill": true, "remote_host": "10.0.0.1", "remote_port": 5600, "transfer_id": "t2"}"#,
        );
        assert!(
            matches!(push.resolve(TransferMode::Push), Ok(Some(RemoteKv::PushFrom { ref peer, .. })) if peer == "10.0.0.1:5600")
        );
        let e = push.resolve(TransferMode::Pull).unwrap_err();
        assert!(e.contains("remote_block_ids"), "{e}");
        for (json, field) in [
            (r#"{"do_remote_prefill": true, "remote_port": 1, "transfer_id": "t"}"#, "remote_host"),
            (r#"{"do_remote_prefill": true, "remote_host": "h", "transfer_id": "t"}"#, "remote_port"),
            (r#"{"do_remote_prefill": true, "remote_host": "h", "remote_port": 1}"#, "transfer_id"),
            (r#"{"do_remote_decode": true}"#, "transfer_id"),
            (r#"{"do_remote_decode": true, "do_remote_prefill": true}"#, "both"),
        ] {
            let e = parse(json).resolve(TransferMode::Push).unwrap_err();
            assert!(e.contains(field), "{json}: {e}");
        }
        assert!(serde_json::from_str::<KvTransferParams>(r#"{"remote_port": "x"}"#).is_err(), "ill-typed is an error");
    }
}
