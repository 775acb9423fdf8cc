"""Make the mixture-of-experts fixtures: tiny seeded random Qwen3-MoE checkpoints
(`Qwen3MoeForCausalLM`) in Hugging Face layout, and transformers' greedy continuations.

Run once (torch + transformers; CPU math):
    python3 scripts/make_moe_fixtures.py fixtures
The outputs are committed under fixtures/; tests never run this script.

Two checkpoints, so both layouts and every routing switch are exercised:
- `qwen3-moe/`: as transformers 5 saves it (`num_local_experts` in config.json, one
  `mlp.experts.N.{gate,up,down}_proj` per expert, as the Hub's checkpoints have them), f32;
  `norm_topk_prob: true` (Qwen3-30B-A3B's setting), layer 1 dense through `mlp_only_layers`.
- `qwen3-moe-fused/`: the experts stacked in one tensor each (`mlp.experts.gate_up_proj`
  `[experts, 2 * moe_intermediate, hidden]` and `mlp.experts.down_proj`, transformers 5's
  in-memory layout), `num_experts` as older configs write it, bf16; `norm_topk_prob: false`
  and `decoder_sparse_step: 2` (layers 1 and 3 sparse).

References are computed in f32 from the saved files, reloaded, as for the dense fixtures. A seed
is accepted only when every greedy step's top-1/top-2 logit margin is at least MIN_MARGIN and,
at every layer and position the references ran, the router's k-th and (k+1)-th largest logits
differ by at least MIN_ROUTER_GAP: f32 rounding differences can then flip neither a token nor
an expert choice.
"""
import json
import os
import random
import sys

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from make_fixtures import NEW_TOKENS, greedy, randomize

MIN_MARGIN = 2e-3
MIN_ROUTER_GAP = 1e-3
VOCAB = 512
PROMPT_LENS = [1, 5, 40, 100]


def specs():
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                  num_experts_per_tok=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                  attn_implementation="eager")
    return [
        ("qwen3-moe", Qwen3MoeConfig(num_hidden_layers=3, norm_topk_prob=True, mlp_only_layers=[1],
                                     decoder_sparse_step=1, **common), torch.float32, False),
        ("qwen3-moe-fused", Qwen3MoeConfig(num_hidden_layers=4, norm_topk_prob=False, mlp_only_layers=[],
                                           decoder_sparse_step=2, **common), torch.bfloat16, True),
    ]


def fuse_experts(path, num_layers, num_experts):
    """Rewrites the saved checkpoint with each layer's experts stacked, and config.json with
    `num_experts` instead of `num_local_experts`."""
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    for layer in range(num_layers):
        p = f"model.layers.{layer}.mlp.experts"
        if f"{p}.0.gate_proj.weight" not in tensors:
            continue
        gate_up, down = [], []
        for e in range(num_experts):
            gate_up.append(torch.cat([tensors.pop(f"{p}.{e}.gate_proj.weight"),
                                      tensors.pop(f"{p}.{e}.up_proj.weight")], dim=0))
            down.append(tensors.pop(f"{p}.{e}.down_proj.weight"))
        tensors[f"{p}.gate_up_proj"] = torch.stack(gate_up).contiguous()
        tensors[f"{p}.down_proj"] = torch.stack(down).contiguous()
    save_file(tensors, file, metadata={"format": "pt"})
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["num_experts"] = cfg.pop("num_local_experts")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


class RouterGaps:
    """The smallest gap between the k-th and (k+1)-th router logit seen by the routers."""

    def __init__(self, model, top_k):
        self.smallest = float("inf")
        self.top_k = top_k
        for name, module in model.named_modules():
            if name.endswith("mlp.gate"):
                module.register_forward_hook(self.hook)

    def hook(self, _module, _inputs, output):
        logits = output[0].float()
        top = torch.topk(logits, self.top_k + 1, dim=-1).values
        self.smallest = min(self.smallest, float((top[:, -2] - top[:, -1]).min()))


def main():
    out_dir = sys.argv[1]
    torch.set_num_threads(2)
    rng = random.Random(1234)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENS]
    summary = {"transformers": transformers.__version__, "torch": torch.__version__}
    for name, cfg, save_dtype, fused in specs():
        path = os.path.join(out_dir, name)
        for seed in range(100):
            torch.manual_seed(seed)
            model = Qwen3MoeForCausalLM(cfg).eval()
            randomize(model, seed)
            model.to(save_dtype)
            model.save_pretrained(path)
            if fused:
                fuse_experts(path, cfg.num_hidden_layers, cfg.num_experts)
            ref, info = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                            output_loading_info=True)
            if any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")):
                raise SystemExit(f"{name}: transformers did not load the saved checkpoint whole: {info}")
            ref.eval()
            gaps = RouterGaps(ref, cfg.num_experts_per_tok)
            cases, worst = [], float("inf")
            for prompt in prompts:
                toks, margins = greedy(ref, prompt)
                worst = min(worst, min(margins))
                cases.append({"prompt_ids": prompt, "greedy_ids": toks, "min_margin": min(margins)})
            if worst >= MIN_MARGIN and gaps.smallest >= MIN_ROUTER_GAP:
                break
            print(f"{name}: seed {seed} margin {worst:.2e} router gap {gaps.smallest:.2e}, retrying", flush=True)
        else:
            raise SystemExit(f"{name}: no seed gave margins >= {MIN_MARGIN} and router gaps >= {MIN_ROUTER_GAP}")
        with open(os.path.join(path, "expected.json"), "w") as f:
            json.dump({"seed": seed, "new_tokens": NEW_TOKENS, "min_margin": worst,
                       "min_router_gap": gaps.smallest, "cases": cases}, f, indent=1)
        summary[name] = {"seed": seed, "min_margin": worst, "min_router_gap": gaps.smallest,
                         "files": sorted(os.listdir(path))}
        print(name, summary[name], flush=True)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
