//! The engine's own host time per decode step: scheduling, building the runner's inputs and
//! emitting tokens, over a runner that does no work (it answers token 1 at once). On a GPU this
//! is what the device would wait for between steps without async scheduling, and what must
//! stay below a step's device time for async scheduling to hide it.
//!
//! `cargo bench -p tandem-engine --bench step_overhead` (prints microseconds per step by batch
//! size, one step at a time and pipelined).

use std::collections::VecDeque;
use std::time::Instant;

use tandem_compute::{KvLayout, KvRegion};
use tandem_core::{RequestId, SamplingParams};
use tandem_engine::{EngineConfig, EngineCore, EngineRequest};
use tandem_model::{LoadedModel, ModelConfig, ModelError, ModelRunner, ModelSource, Preset, SampleSpec, SeqBatch};
use tokio::sync::mpsc::unbounded_channel;

/// A runner that computes nothing: every sampled token is 1.
struct NullRunner {
    config: ModelConfig,
    layout: KvLayout,
    pending: VecDeque<Vec<u32>>,
}

impl ModelRunner for NullRunner {
    fn describe(&self) -> String {
        "null".into()
    }
    fn config(&self) -> &ModelConfig {
        &self.config
    }
    fn max_positions(&self) -> usize {
        1 << 20
    }
    fn kv_layout(&self) -> KvLayout {
        self.layout
    }
    fn kv_region(&self) -> Option<std::sync::Arc<KvRegion>> {
        None
    }
    fn fingerprint(&self) -> String {
        "null".into()
    }
    fn execute(&mut self, _: &[u32], _: &[SeqBatch<'_>], samples: &[SampleSpec]) -> Result<Vec<u32>, ModelError> {
        Ok(vec![1; samples.len()])
    }
    fn can_pipeline(&self) -> bool {
        true
    }
    fn submit(&mut self, _: &[u32], _: &[SeqBatch<'_>], samples: &[SampleSpec]) -> Result<(), ModelError> {
        self.pending.push_back(vec![1; samples.len()]);
        Ok(())
    }
    fn collect(&mut self) -> Result<Vec<u32>, ModelError> {
        self.pending.pop_front().ok_or_else(|| ModelError::Pipeline("nothing submitted".into()))
    }
}

fn main() {
    let model = LoadedModel::load(&ModelSource::Preset { preset: Preset::find("tiny-qwen3").unwrap(), seed: 0 }, None)
        .expect("the tiny-qwen3 preset builds");
    let steps: usize = 2000;
    println!("engine host time per decode step (null runner, {steps} steps, 16-token prompts)");
    println!("{:>6} {:>14} {:>14}", "batch", "one at a time", "pipelined");
    for batch in [1usize, 8, 64, 256] {
        let mut cells = Vec::new();
        for pipelined in [false, true] {
            let block_size: usize = 16;
            let num_blocks = batch * (16 + steps + 8).div_ceil(block_size) + 8;
            let cfg = EngineConfig {
                block_size,
                num_blocks,
                max_num_seqs: batch,
                max_num_batched_tokens: 16 * batch,
                async_scheduling: pipelined,
                max_queue_time: None,
                prefix_caching: false,
            };
            let runner = NullRunner {
                config: model.transformer.config().clone(),
                layout: model.transformer.kv_layout(block_size, num_blocks),
                pending: VecDeque::new(),
            };
            let mut core = EngineCore::new(Box::new(runner) as Box<dyn ModelRunner>, Vec::new(), 1 << 20, &cfg);
            let mut streams = Vec::new();
            for b in 0..batch {
                let (tx, rx) = unbounded_channel();
                let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(steps + 8) };
                let req = EngineRequest::new(RequestId::new(format!("r{b}")), vec![3; 16], params);
                core.add_request(req, tx).expect("the request fits");
                streams.push(rx);
            }
            for _ in 0..3 {
                core.step();
            }
            let t = Instant::now();
            for _ in 0..steps {
                core.step();
                // Drain the events as a server would, so the channels do not grow.
                for rx in streams.iter_mut() {
                    while rx.try_recv().is_ok() {}
                }
            }
            cells.push(t.elapsed().as_secs_f64() * 1e6 / steps as f64);
        }
        println!("{batch:>6} {:>11.1} us {:>11.1} us", cells[0], cells[1]);
    }
}
