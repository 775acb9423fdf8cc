//! The handle on a push registration's writer thread (direct transports), kept in the
//! registration's table entry: the queue of what it is to write, in order, and how far the
//! prompt's parts have been queued. Dropping the registration drops the queue, and the thread
//! ends once what was queued is done.

use std::sync::atomic::AtomicU32;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Instant;

use tandem_compute::cuda::KvFences;

use super::conn::Conn;
use crate::protocol::push::Progress;
use crate::table::{Produced, Registration};
use crate::wire::Message;

/// A registration's writer thread and how far it has been asked to write.
pub(crate) struct PartsWriter {
    pub jobs: mpsc::Sender<Job>,
    pub progress: Progress,
    /// The newest attempt reported, shared with the writer: a part queued under an older one
    /// is skipped (its tokens are written again under the new one anyway).
    pub latest: Arc<AtomicU32>,
}

/// What the writer thread does next, strictly in the order queued, so that decode never hears
/// "done" or "failed" while a part it was not told about may still land in its blocks.
pub(crate) enum Job {
    /// Tokens `from..to` of the prompt computed in `attempt`, from our blocks `src` (the
    /// request's table from decode's first wanted token), once `fences` say the KV is there.
    Part { src: Vec<u32>, from: usize, to: usize, attempt: u32, fences: KvFences },
    /// The prompt is complete: write the rest from token `from`, then `Done` (the write's time
    /// counts from `taken`, when the rendezvous met).
    Finish { reg: Registration<Arc<Conn>, PartsWriter>, produced: Produced, from: usize, taken: Instant },
    /// Nothing more will be written: tell decode (after every part queued before this).
    Notify(Message),
}
