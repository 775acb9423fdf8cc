//! Decode steps replayed from CUDA graphs: one per batch bucket (a step pads up to the next
//! bucket) and attention split, all captured at load so that no request pays for a capture on
//! the first step at a new batch size (a TPOT spike under changing load).

use std::collections::HashMap;

use tandem_compute::cuda::Graph;

use crate::transformer::SeqBatch;

pub(super) struct DecodeGraphs {
    /// By (batch bucket, split row attention).
    graphs: HashMap<(usize, bool), Graph>,
    enabled: bool,
    max_seqs: usize,
    max_tokens: usize,
}

impl DecodeGraphs {
    pub fn new(enabled: bool, max_seqs: usize, max_tokens: usize) -> Self {
        Self { graphs: HashMap::new(), enabled, max_seqs, max_tokens }
    }

    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Every bucket a step may pad to.
    pub fn buckets(&self) -> Vec<usize> {
        buckets(self.max_seqs).into_iter().filter(|&b| b <= self.max_tokens).collect()
    }

    /// The bucket of a step, if it is a pure decode step graphs can serve.
    pub fn bucket_for(&self, token_ids: &[u32], seqs: &[SeqBatch<'_>]) -> Option<usize> {
        if !self.enabled || seqs.len() != token_ids.len() || seqs.iter().any(|s| s.num_tokens != 1 || !s.want_logits) {
            return None;
        }
        self.bucket_of(seqs.len())
    }

    /// The smallest bucket holding `seqs` sequences.
    pub fn bucket_of(&self, seqs: usize) -> Option<usize> {
        self.buckets().into_iter().find(|&b| b >= seqs)
    }

    pub fn get(&self, bucket: usize, split: bool) -> Option<&Graph> {
        self.graphs.get(&(bucket, split))
    }

    pub fn insert(&mut self, bucket: usize, split: bool, graph: Graph) {
        self.graphs.insert((bucket, split), graph);
    }
}

/// Batch sizes decode graphs are captured for.
fn buckets(max_seqs: usize) -> Vec<usize> {
    let mut b: Vec<usize> =
        [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512].into_iter().filter(|&n| n < max_seqs).collect();
    b.push(max_seqs);
    b
}
