#!/usr/bin/env python3
"""Transformers' reading of a GGUF tokenizer, as references for tandem's (run on the GPU machine,
which has transformers and torch; gguf-py is carried in gpu-bin/pylib):
  PYTHONPATH=gpu-bin/pylib python3 scripts/gpu/gguf_tokenizer_refs.py fixtures/gguf/smollm2-tokenizer.gguf OUT.json
Writes each text's ids with and without special tokens, and each conversation's rendered chat
prompt and its ids (add_generation_prompt=True). The output is committed as
fixtures/gguf/smollm2-tokenizer.json.
"""
import json
import pathlib
import sys

import transformers
from transformers import AutoTokenizer

path = pathlib.Path(sys.argv[1])
tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
texts = [
    "The capital of France is",
    "Hello, world! 12345 numbers, 3.14159 and   spaces\n\nnew lines\ttabs",
    "naïve café — unicode ✓ 日本語 emoji 🎉",
    "def f(x):\n    return x ** 2  # squares\n",
    "<|im_start|>user\nhi<|im_end|>",
    "  leading spaces and trailing  ",
    "I'm sure they'll say it's 2024-12-03, isn't it?",
]
chats = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello. How can I help?"},
        {"role": "user", "content": "Count to 3."},
    ],
]
out = {
    "transformers_version": transformers.__version__,
    "texts": [
        {"text": t, "ids": tok.encode(t, add_special_tokens=True), "ids_no_special": tok.encode(t, add_special_tokens=False)}
        for t in texts
    ],
    "chats": [
        {
            "messages": m,
            "prompt": tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
            "ids": list(tok.apply_chat_template(m, tokenize=True, add_generation_prompt=True, return_dict=False)),
        }
        for m in chats
    ],
}
pathlib.Path(sys.argv[2]).write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
print(json.dumps(out, ensure_ascii=False)[:600])
