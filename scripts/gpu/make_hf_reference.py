"""Makes a seeded random Qwen3 checkpoint with transformers (bf16) and its greedy continuations.

Run on the GPU machine by scripts/gpu/run.sh: `python3 make_hf_reference.py OUT_DIR`. Writes an
HF model directory (config.json, model.safetensors in bf16, no tokenizer: token-ids mode) and
expected.json with, per prompt, the greedy tokens transformers generates from the saved
checkpoint in bf16 on the GPU (`REFERENCE_DTYPE=float32` computes in f32 on the same weights),
the top-1 minus top-2 logit margin at each step (so a divergence can be checked against a
near-tie) and the prompt's last-position logits. The Rust test crates/model/tests/cuda_model.rs reads both.
"""
import json
import sys

import os

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

out = sys.argv[1]
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = getattr(torch, os.environ.get("REFERENCE_DTYPE", "bfloat16"))
torch.manual_seed(1234)
cfg = Qwen3Config(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=128,
    max_position_embeddings=1024,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    # Large enough that a random model's next token depends on its input (HF's 0.02 makes
    # every step repeat the last token).
    initializer_range=0.05,
    torch_dtype="bfloat16",
)
model = Qwen3ForCausalLM(cfg).to(torch.bfloat16).to(DEV).eval()
with torch.no_grad():
    model.model.embed_tokens.weight.mul_(3.0)
    # Output rows of log-normal scale: a few tokens stand out at each step, as in a trained
    # model, instead of thousands of near-equal random logits (whose top two tie within bf16
    # noise every few steps, whichever implementation is right).
    scale = torch.exp(torch.randn(cfg.vocab_size, 1, device=DEV, generator=torch.Generator(DEV).manual_seed(5)))
    model.lm_head.weight.mul_(scale.to(torch.bfloat16))
model.save_pretrained(out, safe_serialization=True)
# Generate from the saved checkpoint, loaded the way users load it: the in-memory model would
# carry RoPE frequencies rounded to bf16 by `.to(bfloat16)` (a buffer cast), which shifts every
# rotation by an error growing with position.
del model
model = Qwen3ForCausalLM.from_pretrained(out, dtype=DTYPE).to(DEV).eval()

cases = []
gen = torch.Generator().manual_seed(7)
for n in [1, 5, 17, 40, 64, 100, 150, 200]:
    prompt = torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()
    ids = torch.tensor([prompt], device=DEV)
    with torch.no_grad():
        res = model.generate(ids, max_new_tokens=40, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    tokens = res.sequences[0, n:].tolist()
    margins, tops = [], []
    for step in res.logits:
        top = torch.topk(step[0].float(), 5)
        margins.append(float(top.values[0] - top.values[1]))
        tops.append([[int(i), float(v)] for i, v in zip(top.indices, top.values)])
    first = res.logits[0][0].float()
    cases.append({"prompt": prompt, "tokens": tokens, "margins": margins, "first_logits": first.tolist(), "top5": tops,
                  "logit_std": float(first.std())})
with open(f"{out}/expected.json", "w") as f:
    json.dump({"transformers": __import__("transformers").__version__, "cases": cases}, f)
print(f"reference: {len(cases)} prompts, {sum(len(c['tokens']) for c in cases)} tokens -> {out}")

# Diagnostic (printed to the log, not used by the test): how much transformers' own prompt
# logits move with its attention implementation and GEMM settings, per prompt length. tandem
# agrees with the default to ~1.6e-3 on prompts up to 40 tokens and ~1e-2 beyond 64; if one of
# these settings moves transformers by that much on long prompts only, it names the cause.
def prompt_logits(m, prompt):
    with torch.no_grad():
        return m(torch.tensor([prompt], device=DEV)).logits[0, -1].float()


def rel(a, b):
    return float((a - b).norm() / b.norm())


variants = {}
for impl in ["eager"]:
    variants[f"attn_implementation={impl}"] = Qwen3ForCausalLM.from_pretrained(
        out, dtype=DTYPE, attn_implementation=impl).to(DEV).eval()
print(f"torch {torch.__version__}, default SDPA flags: flash {torch.backends.cuda.flash_sdp_enabled()}, "
      f"mem-efficient {torch.backends.cuda.mem_efficient_sdp_enabled()}, cudnn {torch.backends.cuda.cudnn_sdp_enabled()}, "
      f"bf16 reduced-precision reduction {torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction}")
for case in cases:
    p = case["prompt"]
    base = prompt_logits(model, p)
    row = [f"{len(p):>4} tokens: generate vs forward {rel(base, torch.tensor(case['first_logits'], device=DEV)):.1e}"]
    for name, m in variants.items():
        row.append(f"{name} {rel(prompt_logits(m, p), base):.1e}")
    if DEV == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        for backend in [SDPBackend.MATH, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION]:
            try:
                with sdpa_kernel(backend):
                    row.append(f"{backend.name} {rel(prompt_logits(model, p), base):.1e}")
            except Exception as e:  # a backend that does not take this shape
                row.append(f"{backend.name} n/a ({type(e).__name__})")
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        row.append(f"no reduced-precision reduction {rel(prompt_logits(model, p), base):.1e}")
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    print("diagnostic " + ", ".join(row))


# Diagnostic: transformers against itself. The greedy tokens of the reference (SDPA, DTYPE)
# against transformers' eager attention and against computing in f32 on the same weights:
# how many prompts two correct implementations keep equal for 32+ tokens on this checkpoint.
def greedy(m, prompt):
    with torch.no_grad():
        res = m.generate(torch.tensor([prompt], device=DEV), max_new_tokens=40, do_sample=False,
                         pad_token_id=0, eos_token_id=None)
    return res[0, len(prompt):].tolist()


def agreement(m):
    prefixes = []
    for case in cases:
        other = greedy(m, case["prompt"])
        prefixes.append(next((i for i, (a, b) in enumerate(zip(other, case["tokens"])) if a != b), len(other)))
    return sum(p >= 32 for p in prefixes), prefixes


others = dict(variants)
if DTYPE != torch.float32:
    others["float32"] = Qwen3ForCausalLM.from_pretrained(out, dtype=torch.float32).to(DEV).eval()
self_agreement = {}
for name, m in others.items():
    long, prefixes = agreement(m)
    self_agreement[name] = long
    print(f"diagnostic transformers {name} vs the reference: {long}/{len(cases)} prompts equal for 32+ tokens "
          f"(equal prefixes {prefixes})")
# The test compares tandem's count with these (see greedy_matches_transformers_bf16).
with open(f"{out}/expected.json") as f:
    expected = json.load(f)
expected["self_agreement"] = self_agreement
with open(f"{out}/expected.json", "w") as f:
    json.dump(expected, f)
