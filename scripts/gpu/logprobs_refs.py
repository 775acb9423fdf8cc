#!/usr/bin/env python3
"""transformers' log-probabilities for the exactness fixtures, for tandem's `logprobs`.

For each fixture (qwen3, qwen2, llama) and each of its cases, the log-softmax (f32 model,
log-softmax in f64) of the logits at every position of prompt + greedy continuation that
produced a greedy token: the chosen token's log-probability and the 5 most likely tokens'
(ids and log-probabilities, most likely first). Written as FIXTURE/logprobs.json; committed,
and the engine's `logprobs` test compares against it. Needs torch + transformers (the GPU
machine has both; CPU math is used).

Usage: python3 scripts/gpu/logprobs_refs.py [FIXTURES_DIR]   (default fixtures/)
"""
import json
import os
import sys

import torch
import transformers
from transformers import AutoModelForCausalLM

TOP = 5
root = sys.argv[1] if len(sys.argv) > 1 else "fixtures"
for name in ["qwen3", "qwen2", "llama"]:
    d = os.path.join(root, name)
    expected = json.load(open(os.path.join(d, "expected.json")))
    model = AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
    cases = []
    for case in expected["cases"]:
        prompt, greedy = case["prompt_ids"], case["greedy_ids"]
        ids = torch.tensor([prompt + greedy[:-1]])
        with torch.no_grad():
            logits = model(ids).logits[0].double()
        logprobs = torch.log_softmax(logits, dim=-1)[len(prompt) - 1:]
        steps = []
        for k, token in enumerate(greedy):
            row = logprobs[k]
            top = torch.topk(row, TOP)
            steps.append({"token": token, "logprob": row[token].item(),
                          "top_ids": top.indices.tolist(), "top_logprobs": top.values.tolist()})
        cases.append({"prompt_ids": prompt, "steps": steps})
    out = {"transformers": transformers.__version__, "torch": torch.__version__, "top": TOP, "cases": cases}
    with open(os.path.join(d, "logprobs.json"), "w") as f:
        json.dump(out, f)
    worst = max(abs(s["logprob"] - s["top_logprobs"][0]) for c in cases for s in c["steps"])
    print(f"{name}: {sum(len(c['steps']) for c in cases)} steps; greedy token vs top-1 logprob differ by at most {worst:.2e}")
