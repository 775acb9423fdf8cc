//! The two transfer protocols as rules over the transfer table, with no I/O of their own:
//! [`push`] (decode registers its blocks, prefill writes them, in parts while the prompt still
//! computes) and [`pull`] (prefill holds its blocks under a lease, decode reads them). Each file
//! opens with its sequence (register, rendezvous, write or read, notify, release, fail); the
//! agent's threads feed them what arrived and carry out what they decide.
//!
//! Layer: under `agent`. Owns no state of its own; calls `table` and `wire`'s types, never a
//! socket, a thread or a transport.

pub(crate) mod pull;
pub(crate) mod push;

/// What a decode leg asks of prefill, in either mode: KV for `num_tokens` tokens after the
/// first `skip` of the prompt (whose KV decode holds: its prefix cache), into `blocks` (decode's,
/// from the first uncached block on).
pub(crate) struct Wanted {
    pub blocks: Vec<u32>,
    pub num_tokens: usize,
    pub skip: usize,
}
