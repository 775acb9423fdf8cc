"""Make the exactness fixtures: tiny seeded random Qwen3, Qwen2 and Llama checkpoints in HF
layout, plus transformers' greedy continuations for a few prompts.

Run once (it needs torch + transformers; the GPU machine has both, CPU math is used):
    python3 scripts/make_fixtures.py OUT_DIR
The outputs are committed under fixtures/; tests never run this script.

Each checkpoint is saved in a different dtype and layout so loading is exercised too
(qwen3: f32 single file; qwen2: bf16 sharded with an index; llama: f16, tied embeddings,
llama3 rope scaling). References are computed in f32 from the *saved* weights, reloaded, so
they see exactly what tandem loads. A seed is accepted only when every greedy step's
top-1/top-2 logit margin exceeds MIN_MARGIN, so f32 rounding differences between
implementations cannot flip a token.
"""
import json
import os
import random
import sys

import torch
import transformers
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

MIN_MARGIN = 2e-3
NEW_TOKENS = 24
VOCAB = 512
PROMPT_LENS = [1, 5, 40, 100]  # 1 token, < one block (16), several blocks, > chunk budget (32)


def rope_kwargs(theta, scaling=None):
    """transformers 5 takes `rope_parameters`; 4.x takes rope_theta/rope_scaling."""
    major = int(transformers.__version__.split(".")[0])
    if major >= 5:
        params = {"rope_type": "default", "rope_theta": theta}
        if scaling:
            params.update(scaling)
        return {"rope_parameters": params}
    kw = {"rope_theta": theta}
    if scaling:
        kw["rope_scaling"] = scaling
    return kw


def specs():
    common = dict(vocab_size=VOCAB, max_position_embeddings=1024, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2, attn_implementation="eager")
    return [
        ("qwen3", Qwen3ForCausalLM, Qwen3Config(
            hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
            **rope_kwargs(1_000_000.0), **common), torch.float32, None),
        ("qwen2", Qwen2ForCausalLM, Qwen2Config(
            hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=1, tie_word_embeddings=True, use_sliding_window=False,
            **rope_kwargs(10_000.0), **common), torch.bfloat16, "60KB"),
        ("llama", LlamaForCausalLM, LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=8,
            num_key_value_heads=2, tie_word_embeddings=True,
            **rope_kwargs(500_000.0, {"rope_type": "llama3", "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 64}),
            **common), torch.float16, None),
    ]


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


def greedy(model, prompt):
    ids = list(prompt)
    out, margins = [], []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            top = torch.topk(logits, 2)
            margins.append(float(top.values[0] - top.values[1]))
            tok = int(top.indices[0])
            out.append(tok)
            ids.append(tok)
    return out, margins


def main():
    out_dir = sys.argv[1]
    torch.set_num_threads(4)
    rng = random.Random(1234)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS]
    summary = {"transformers": transformers.__version__, "torch": torch.__version__}
    for name, cls, cfg, save_dtype, shard in specs():
        for seed in range(50):
            torch.manual_seed(seed)
            model = cls(cfg).eval()
            randomize(model, seed)
            path = os.path.join(out_dir, name)
            model.to(save_dtype)
            kw = {"max_shard_size": shard} if shard else {}
            model.save_pretrained(path, **kw)
            ref = cls.from_pretrained(path, dtype=torch.float32,
                                      attn_implementation="eager").eval()
            cases, worst = [], float("inf")
            for prompt in prompts:
                toks, margins = greedy(ref, prompt)
                worst = min(worst, min(margins))
                cases.append({"prompt_ids": prompt, "greedy_ids": toks,
                              "min_margin": min(margins)})
            if worst >= MIN_MARGIN:
                break
            print(f"{name}: seed {seed} min margin {worst:.2e}, retrying", flush=True)
        else:
            raise SystemExit(f"{name}: no seed gave margins >= {MIN_MARGIN}")
        with open(os.path.join(path, "expected.json"), "w") as f:
            json.dump({"seed": seed, "new_tokens": NEW_TOKENS, "min_margin": worst,
                       "cases": cases}, f, indent=1)
        summary[name] = {"seed": seed, "min_margin": worst, "files": sorted(os.listdir(path))}
        print(name, summary[name], flush=True)
        print(open(os.path.join(path, "config.json")).read(), flush=True)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
