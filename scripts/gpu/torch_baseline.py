"""PyTorch/transformers on the same GPU and the same shape as `tandem bench engine`.

`python3 torch_baseline.py OUT_JSON`: the Qwen3-4B shape (preset:qwen3-4b in tandem: hidden
2560, 36 layers, 32 query / 8 KV heads of 128, MLP 9728, vocabulary 151936, tied embeddings)
with random bf16 weights (only time matters). Measures, with CUDA events and
the median of repeats: a decode step at batch 1 and 64 with a KV cache (16-token prompts, like
tandem's bench), and a prefill of 4096 tokens (sdpa attention). Writes OUT_JSON.
"""
import json
import sys

import torch
from transformers import AutoModelForCausalLM, Qwen3Config
from transformers.cache_utils import DynamicCache

out = sys.argv[1]
cfg = Qwen3Config(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                  rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
torch.manual_seed(0)
with torch.device("cuda"):
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16, attn_implementation="sdpa").eval()


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


result = {"torch": torch.__version__, "transformers": __import__("transformers").__version__}
with torch.no_grad():
    for batch in [1, 64]:
        ids = torch.randint(0, cfg.vocab_size, (batch, 16), device="cuda")
        cache = DynamicCache()
        o = model(ids, past_key_values=cache, use_cache=True)
        nxt = o.logits[:, -1:].argmax(-1)
        state = {"cache": o.past_key_values, "next": nxt}

        def step():
            o = model(state["next"], past_key_values=state["cache"], use_cache=True)
            state["cache"] = o.past_key_values
            state["next"] = o.logits[:, -1:].argmax(-1)

        for _ in range(3):
            step()
        result[f"decode_b{batch}_ms"] = timed(step, 20)
    ids = torch.randint(0, cfg.vocab_size, (1, 4096), device="cuda")
    prefill = lambda: model(ids, use_cache=False, logits_to_keep=1)
    prefill()
    result["prefill_4096_ms"] = timed(prefill, 5)
print(json.dumps(result))
with open(out, "w") as f:
    json.dump(result, f)
