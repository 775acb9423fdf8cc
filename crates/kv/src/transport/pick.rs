//! Which transport a connection takes. The accepting side (the prefill engine, which does the
//! writing in both modes) picks at handshake from what both ends offer and tells the peer in
//! `HandshakeOk`: `local` (a direct copy between two engines of this process), else `cuda-ipc`
//! when both are GPU engines of one host that can reach each other's memory, else `tcp`;
//! `nixl` only when the flag forces it.

use std::sync::{Arc, Weak};

use super::cuda_ipc::{self, CudaIpc};
use super::local::{self, Local};
use super::nixl::{self, NixlSetup};
use super::tcp::Tcp;
use super::{Ours, Transport};
use crate::agent_info::{AgentInfo, TransportOffer};
use crate::channel::Picked;
use crate::config::KvTransport;
use crate::error::KvError;
use crate::memory::KvMemory;

/// What an engine's choice of transport depends on: its memory and settings, `--kv-transport`,
/// whether it offers the local transport, and its NIXL endpoint.
pub(crate) struct Picker {
    pub ours: Ours,
    pub policy: KvTransport,
    /// Offer (and use) direct copies between engines of this process.
    pub local: bool,
    pub nixl: NixlSetup,
}

impl Picker {
    /// Accepting side: the transport for a connection from `peer`, and what to tell it; an
    /// error refuses the peer, saying why.
    pub(crate) fn pick(&self, peer: &AgentInfo) -> Result<(Arc<dyn Transport>, Picked), String> {
        let policy = self.policy;
        if policy == KvTransport::Nixl {
            // Forced, so not `local` even in one process (the tests run NIXL that way).
            return match nixl::pick(&self.ours, &self.nixl, peer) {
                Ok(t) => {
                    tracing::info!(peer = %peer.engine_id, "KV transport nixl: the peer's NIXL agent is loaded");
                    let ours = self.ours.memory.layout().block_size;
                    if peer.block_size != ours {
                        // A NIXL descriptor is one contiguous span: between block sizes each
                        // head's token segment of each layer is one (measured on an H200: a
                        // 2000-token prompt's push 55x slower than with equal sizes).
                        tracing::warn!(peer = %peer.engine_id, ours, theirs = peer.block_size,
                            "KV over nixl between different block sizes moves one descriptor per head, layer and \
                             token segment, many times slower than equal sizes: give both engines one --block-size");
                    }
                    Ok((t, Picked::named("nixl", None)))
                }
                Err(why) => Err(format!("--kv-transport nixl, but nixl cannot work with `{}`: {why}", peer.engine_id)),
            };
        }
        if let Some(peer_memory) = self.local_peer(peer) {
            let local = Local::new(self.ours.clone(), peer_memory);
            return Ok((Arc::new(local), Picked::named("local", None)));
        }
        let ipc = match policy {
            KvTransport::Tcp => Err("--kv-transport tcp".to_string()),
            KvTransport::Auto | KvTransport::CudaIpc | KvTransport::Nixl => cuda_ipc::open(&self.ours, peer),
        };
        match ipc {
            Ok(mapped) => {
                tracing::info!(peer = %peer.engine_id, place = mapped.place(), "KV transport cuda-ipc: the peer's GPU cache is mapped");
                let writer = CudaIpc::writer(self.ours.clone(), mapped);
                Ok((Arc::new(writer), Picked::named("cuda-ipc", None)))
            }
            Err(why) if policy == KvTransport::CudaIpc => {
                Err(format!("--kv-transport cuda-ipc, but cuda-ipc cannot work with `{}`: {why}", peer.engine_id))
            }
            Err(why) => {
                self.ours.memory.host_region().map_err(|e| e.to_string())?;
                let note = (policy == KvTransport::Auto).then(|| format!("cuda-ipc not possible: {why}"));
                Ok((Arc::new(Tcp::new(self.ours.clone())), Picked::named("tcp", note)))
            }
        }
    }

    /// Connecting side: the transport the acceptor picked, if this engine can take part in it.
    pub(crate) fn accept(&self, peer: &AgentInfo, picked: &Picked) -> Result<Arc<dyn Transport>, KvError> {
        let refuse = |why: String| Err(KvError::Refused(why));
        let policy = self.policy;
        match picked.transport.as_str() {
            "local" => match self.local_peer(peer) {
                Some(peer_memory) => Ok(Arc::new(Local::new(self.ours.clone(), peer_memory))),
                None => {
                    refuse(format!("`{}` picked the local transport, but it is not in this process", peer.engine_id))
                }
            },
            "cuda-ipc"
                if self.ours.memory.device_cache().is_some()
                    && matches!(policy, KvTransport::Auto | KvTransport::CudaIpc) =>
            {
                Ok(Arc::new(CudaIpc::reader(self.ours.clone())))
            }
            "nixl" if policy == KvTransport::Nixl => nixl::accept(&self.ours, &self.nixl, peer),
            "tcp" if matches!(policy, KvTransport::Auto | KvTransport::Tcp) => {
                self.ours.memory.host_region()?;
                Ok(Arc::new(Tcp::new(self.ours.clone())))
            }
            other => {
                let why = picked.note.as_deref().unwrap_or("no reason given");
                refuse(format!(
                    "`{}` picked the {other} transport ({why}), which --kv-transport {} here does not allow",
                    peer.engine_id,
                    policy.name()
                ))
            }
        }
    }

    /// The memory of `peer`, when both ends offer the local transport in this process.
    fn local_peer(&self, peer: &AgentInfo) -> Option<Weak<KvMemory>> {
        if !self.local {
            return None;
        }
        peer.transports.iter().find_map(|t| match t {
            TransportOffer::Local { process, key } if *process == std::process::id() => local::find(key),
            _ => None,
        })
    }
}
