//! `tandem bench fidelity`: a model with rounded weights (`--quantization`) or over an FP8 KV
//! cache (`--kv-cache-dtype fp8`) against the same model as read over an f32 cache, on the CPU
//! (the comparison is in `tandem_bench::fidelity`).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use tandem_model::{LoadedModel, ModelSpec, Quantization};

use crate::engine::{model_source, KvCacheDtype};

#[derive(Args, Debug, Clone)]
pub struct BenchFidelityArgs {
    /// The model (as `serve --model` takes it), both as read over an f32 KV cache (the
    /// reference) and rounded (the candidate).
    #[arg(long, default_value = "preset:tiny-qwen3")]
    pub model: String,
    /// Weight seed for `preset:` models.
    #[arg(long, default_value_t = 0)]
    pub model_seed: u64,
    /// The rounding of the candidate's weights (`fp8`: as `serve --quantization fp8`).
    #[arg(long, value_parser = |s: &str| s.parse::<Quantization>())]
    pub quantization: Option<Quantization>,
    /// The candidate's KV cache (`fp8`: as `serve --kv-cache-dtype fp8`). At least one of this
    /// and --quantization.
    #[arg(long, value_enum, default_value_t = KvCacheDtype::Auto)]
    pub kv_cache_dtype: KvCacheDtype,
    /// Prompts, random token ids.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..))]
    pub num_prompts: u16,
    /// Tokens of each prompt.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    pub prompt_len: u32,
    /// Tokens the reference generates after each prompt: the positions compared.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    pub output_len: u32,
    /// Seeds the prompts.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write the report as JSON here too.
    #[arg(long)]
    pub json_out: Option<PathBuf>,
}

pub(crate) fn bench_fidelity(a: BenchFidelityArgs) -> Result<()> {
    let source = model_source(&a.model, a.model_seed)?;
    let (num_prompts, prompt_len, output_len) = (a.num_prompts as usize, a.prompt_len as usize, a.output_len as usize);
    let max_len = Some(prompt_len + output_len);
    let load = |q: Option<Quantization>| -> Result<LoadedModel> {
        let spec = ModelSpec::load(&source, max_len).and_then(|s| s.with_quantization(q))?;
        Ok(LoadedModel::from_spec(spec)?)
    };
    let candidate_kv = a.kv_cache_dtype.on_cpu();
    let mut rounding = Vec::new();
    if let Some(q) = a.quantization {
        rounding.push(format!("{} weights", q.as_str()));
    }
    if a.kv_cache_dtype == KvCacheDtype::Fp8 {
        rounding.push(format!("an {} KV cache", candidate_kv.name()));
    }
    if rounding.is_empty() {
        bail!("nothing to compare: give --quantization fp8, --kv-cache-dtype fp8 or both");
    }
    let rounding = rounding.join(" and ");
    let reference = load(None).with_context(|| format!("loading `{}`", a.model))?;
    let candidate = load(a.quantization).with_context(|| format!("loading `{}` with {rounding}", a.model))?;
    eprintln!(
        "... {num_prompts} prompts of {prompt_len} tokens, {output_len} output tokens each: `{}` as read against {rounding}",
        a.model
    );
    let cfg =
        tandem_bench::fidelity::FidelityConfig { num_prompts, prompt_len, output_len, seed: a.seed, candidate_kv };
    let report = tandem_bench::fidelity::compare(&reference.transformer, &candidate.transformer, &cfg);
    println!("{report}");
    if let Some(path) = a.json_out {
        std::fs::write(&path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
