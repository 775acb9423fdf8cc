//! `tandem model`: make or look at model directories.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Subcommand;
use tandem_model::{ModelSource, ModelSpec, Preset, PRESETS};

use crate::engine::{model_source, ModelArgs};

#[derive(Subcommand, Debug)]
pub enum ModelCommand {
    /// Write a preset as a Hugging Face model directory with seeded random weights.
    Init {
        /// Preset name (see `tandem model list`).
        #[arg(long)]
        preset: String,
        /// Directory to write.
        #[arg(long)]
        out: PathBuf,
        /// Weight seed (same seed, same bytes).
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Print a model's shape, parameter count and KV bytes per token.
    Inspect {
        #[command(flatten)]
        model: ModelArgs,
    },
    /// List the built-in presets.
    List,
}

pub(crate) fn model_command(c: ModelCommand) -> Result<()> {
    match c {
        ModelCommand::Init { preset, out, seed } => {
            let p = Preset::find(&preset)?;
            let t = Instant::now();
            eprintln!("writing preset `{}` (seed {seed}) to {} ...", p.name, out.display());
            p.write_dir(&out, seed)?;
            eprintln!("done in {:.1}s", t.elapsed().as_secs_f64());
            Ok(())
        }
        ModelCommand::Inspect { model } => {
            // The config and tokenizer only: a shape needs no weights (a preset's would be
            // generated, gigabytes of them for the larger ones).
            let source = model_source(&model.model, model.model_seed)?;
            let m = ModelSpec::load_shape(&source, model.max_model_len)
                .with_context(|| format!("reading model `{}`", model.model))?;
            let has_tokenizer = m.tokenizer.is_some() || matches!(source, ModelSource::Preset { .. });
            let c = &m.config;
            let info = serde_json::json!({
                "architecture": c.architecture.hf_name(),
                "params": c.num_params(),
                "vocab_size": c.vocab_size,
                "hidden_size": c.hidden_size,
                "intermediate_size": c.intermediate_size,
                "num_layers": c.num_layers,
                "num_heads": c.num_heads,
                "num_kv_heads": c.num_kv_heads,
                "head_dim": c.head_dim,
                "tie_word_embeddings": c.tie_word_embeddings,
                "max_model_len": m.max_model_len,
                "kv_bytes_per_token_f32": c.kv_bytes_per_token_f32(),
                "weight_bytes_f32": c.num_params() * 4,
                "eos_token_ids": m.eos_token_ids,
                "tokenizer": has_tokenizer,
                "reduction_groups": c.reduction_groups,
                "experts": c.moe.as_ref().map(|m| serde_json::json!({
                    "num_experts": m.num_experts,
                    "num_experts_per_tok": m.num_experts_per_tok,
                    "moe_intermediate_size": m.moe_intermediate_size,
                    "norm_topk_prob": m.norm_topk_prob,
                    "sparse_layers": (0..c.num_layers).filter(|&l| m.is_sparse(l)).count(),
                })),
            });
            println!("{}", serde_json::to_string_pretty(&info)?);
            Ok(())
        }
        ModelCommand::List => {
            for p in PRESETS {
                let params = tandem_model::ModelConfig::from_preset(p)?.num_params();
                println!(
                    "{:<14} {:>9.1}M  {:<19} {}",
                    p.name,
                    params as f64 / 1e6,
                    p.architecture.hf_name(),
                    p.description
                );
            }
            Ok(())
        }
    }
}
