//! `tandem generate`: one completion on this machine, printed as it is generated.

use std::io::Write;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use tandem_core::{RequestId, SamplingParams};
use tandem_engine::{EngineEvent, EngineRequest};

use crate::engine::{build_engine, EngineArgs, ModelArgs};

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Prompt text (needs a tokenizer).
    #[arg(long, conflicts_with = "prompt_ids", required_unless_present = "prompt_ids")]
    pub prompt: Option<String>,
    /// Prompt as comma-separated token ids, e.g. `1,2,3` (works without a tokenizer).
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    /// Sampling temperature; 0 (the default here) is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling mass.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Keep only the k most likely tokens (0 disables).
    #[arg(long, default_value_t = 0)]
    pub top_k: u32,
    /// Sampling seed (same seed, same output).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print a JSON object (token_ids, text, finish_reason, timings) instead of the text.
    #[arg(long)]
    pub json: bool,
}

pub(crate) fn generate(a: GenerateArgs) -> Result<()> {
    let parts = build_engine(&a.model, &a.engine, None)?;
    let prompt_ids = match (&a.prompt, &a.prompt_ids) {
        (Some(text), _) => match &parts.tokenizer {
            Some(tok) => tok.encode(text, true)?,
            None => bail!("this model has no tokenizer (token-ids mode): use --prompt-ids"),
        },
        (None, Some(ids)) => ids.clone(),
        (None, None) => bail!("give --prompt or --prompt-ids"),
    };
    let params = SamplingParams {
        temperature: a.temperature,
        top_p: a.top_p,
        top_k: (a.top_k > 0).then_some(a.top_k),
        seed: a.seed,
        max_tokens: a.max_tokens,
        ignore_eos: a.ignore_eos,
        ..SamplingParams::default()
    };
    let tokenizer = parts.tokenizer;
    let engine = tandem_engine::spawn(parts.model, parts.eos_token_ids, parts.max_model_len, parts.config)
        .context("starting the engine thread")?;
    let prompt_len = prompt_ids.len();
    let start = Instant::now();
    let mut stream = engine.submit(EngineRequest::new(RequestId::new("generate"), prompt_ids, params))?;
    let mut token_ids = Vec::new();
    let mut first_token_s = None;
    let mut finish = None;
    let mut detok = tandem_model::IncrementalDetokenizer::new();
    let mut text = String::new();
    let stdout = std::io::stdout();
    while let Some(ev) = stream.blocking_next() {
        match ev {
            EngineEvent::Tokens { token_ids: new, finish: f, .. } => {
                first_token_s.get_or_insert(start.elapsed().as_secs_f64());
                if let Some(tok) = &tokenizer {
                    let mut piece = detok.push(tok, &new)?;
                    if f.is_some() {
                        piece.push_str(&detok.finish(tok)?);
                    }
                    if !a.json {
                        let mut out = stdout.lock();
                        let _ = write!(out, "{piece}");
                        let _ = out.flush();
                    }
                    text.push_str(&piece);
                }
                token_ids.extend(new);
                if f.is_some() {
                    finish = f;
                    break;
                }
            }
            EngineEvent::Failed(e) => bail!("generation failed: {e}"),
            EngineEvent::QueueTimeout { .. } => bail!("generation failed: it waited in the queue past its bound"),
            // generate runs colocated: no KV is handed to a connector.
            EngineEvent::KvProduced { .. } | EngineEvent::KvLoaded { .. } => {}
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    if a.json {
        let out = serde_json::json!({
            "prompt_tokens": prompt_len,
            "token_ids": token_ids,
            "text": text,
            "finish_reason": finish.map(|f| f.as_str()),
            "time_to_first_token_s": first_token_s,
            "elapsed_s": elapsed,
        });
        println!("{out}");
    } else if tokenizer.is_some() {
        println!();
    } else {
        println!("{}", token_ids.iter().map(u32::to_string).collect::<Vec<_>>().join(","));
    }
    Ok(())
}
