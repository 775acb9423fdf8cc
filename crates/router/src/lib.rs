//! The router: one OpenAI endpoint in front of prefill and decode engines.
//!
//! # Brief overview
//! [`Router`] holds the backends and the mode; [`app`] serves `/v1/completions`,
//! `/v1/chat/completions`, `/v1/models` and `/health`. Each request is split into two legs:
//!
//! - **Pull**: the prefill leg runs first (one token, not streamed, `do_remote_decode`); its
//!   answer's `kv_transfer_params` (prefill's block ids, epoch, first token) go on the decode
//!   leg, which streams back to the client. Pull lets the router choose the decode engine
//!   after prefill, but decode can only start fetching once prefill is done.
//! - **Push**: the router makes a `transfer_id`, picks both engines up front, and sends both
//!   legs at once: the decode leg names the prefill engine's side channel, so decode registers
//!   its blocks while prefill is still computing and prefill writes them the moment it
//!   finishes. This overlap is why push must dispatch the two legs concurrently.
//!
//! Backends are chosen by fewest outstanding requests (round-robin among ties). Every engine's
//! health, role, mode and model are checked at start ([`Router::wait_ready`] refuses to start
//! on a misconfiguration, naming it) and again every `check_interval` while serving; a
//! misconfigured engine, or a prefill/decode pair that cannot exchange KV, is never sent a
//! request (503 naming why; `/health` lists the problems).
//!
//! The router checks the fields it rewrites; prefill gets the client's fields as they are and
//! validates them as decode will before computing anything. A failed prefill leg ends the
//! request with its 4xx (a bad request) or a 502 naming the leg and the cause. However a
//! request ends, the router has the prefill engine free whatever KV it still holds for it
//! (`POST /kv/release`; nothing, when decode took the KV): a decode leg that failed, a client
//! disconnect (which drops both legs, cancelling them on both engines), or a decode engine that
//! could not reach prefill's side channel and recomputed, none of which decode can tell
//! prefill, would otherwise leave the blocks held until prefill's registration wait or lease
//! ran out.
//!
//! Failover: a leg that never reached its engine (no connection: the engine is marked down
//! until a check finds it again), that its engine turned away before computing (429, at its
//! `--max-queued-requests`) or that its engine failed before answering any of it (500: its
//! model failed the step) goes to another engine of that role, each engine at most once per
//! request; pull keeps prefill's KV under its lease for the next decode engine, push starts a
//! new pair. Only when no engine is left does the client get the error: a 429 keeps its
//! `Retry-After`. A request that is not streamed is answered only once its decode engine's
//! answer is whole, so a decode engine that dies before that (killed, its connection reset)
//! fails only the attempt: the request goes to another pair. Other legs that failed after
//! their engine took them are not retried (tokens may have been streamed, and a prefill that
//! computed is not computed twice).
#![deny(missing_docs)]

mod admin;
mod answer;
mod backend;
mod membership;
mod proxy;
mod resume;
mod routes;

pub use backend::{Backend, BackendState, KvEndpoint};
pub use membership::Following;
pub use proxy::{Router, RouterConfig, RouterError};
pub use routes::{app, serve};
