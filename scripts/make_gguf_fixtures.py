#!/usr/bin/env python3
"""GGUF fixtures for tandem's loader, made once and committed (needs `pip install gguf numpy`).

fixtures/gguf/{qwen3,qwen2,llama}.gguf: the tiny HF fixtures of scripts/make_fixtures.py in
llama.cpp's layout and names, written with gguf-py as llama.cpp's converter writes them (Llama's
q and k rows permuted for its rotary layout; norms in F32, matrices in the checkpoint's dtype:
F32, BF16, F16). No tokenizer (token-ids mode). The llama one leaves out Llama 3 RoPE scaling
(GGUF stores it as a rope_freqs tensor, which tandem does not read yet).

fixtures/gguf/types.gguf + types.json + types.f32: one tensor per ggml type tandem reads, random
contents, and the values gguf-py's dequantizer gives for each (f32 little-endian, in file order).
`make_gguf_fixtures.py types` makes only these.
"""
import json
import pathlib
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIX = ROOT / "fixtures"
OUT = FIX / "gguf"

NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf):
    if hf in NAMES:
        return NAMES[hf]
    parts = hf.split(".")
    layer, rest, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
    return f"blk.{layer}.{LAYER[rest]}.{kind}"


def permute(w, heads):
    # llama.cpp's convert_hf_to_gguf.py LlamaModel.permute
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def model(name, arch, dtype):
    d = FIX / name
    cfg = json.loads((d / "config.json").read_text())
    tensors = {}
    for f in sorted(d.glob("*.safetensors")):
        # Read with numpy alone (bf16 included): no torch or safetensors package needed.
        tensors.update(read_safetensors(f))
    w = gguf.GGUFWriter(str(OUT / f"{name}.gguf"), arch)
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // heads)
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    for hf, a in sorted(tensors.items()):
        a = a.astype(np.float32)
        if arch == "llama" and hf.endswith("q_proj.weight"):
            a = permute(a, heads)
        if arch == "llama" and hf.endswith("k_proj.weight"):
            a = permute(a, kv_heads)
        if a.ndim == 1 or dtype == "f32":
            w.add_tensor(gguf_name(hf), a)
        elif dtype == "f16":
            w.add_tensor(gguf_name(hf), a.astype(np.float16))
        else:
            q = gguf.quants.quantize(a, T.BF16)
            w.add_tensor(gguf_name(hf), q, raw_shape=q.shape, raw_dtype=T.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def read_safetensors(path):
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    body = raw[8 + n :]
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        s, e = v["data_offsets"]
        b = body[s:e]
        if v["dtype"] == "F32":
            a = np.frombuffer(b, dtype=np.float32)
        elif v["dtype"] == "F16":
            a = np.frombuffer(b, dtype=np.float16).astype(np.float32)
        elif v["dtype"] == "BF16":
            a = (np.frombuffer(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            raise SystemExit(f"{path}: {k} has dtype {v['dtype']}")
        out[k] = a.reshape(v["shape"])
    return out


def types():
    rng = np.random.default_rng(7)
    rows, cols = 3, 512
    w = gguf.GGUFWriter(str(OUT / "types.gguf"), "llama")
    index, values = [], []
    for ty in [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K, T.Q5_0, T.Q5_1]:
        block, size = gguf.GGML_QUANT_SIZES[ty]
        nbytes = rows * cols // block * size
        if ty in (T.F32, T.F16):
            a = rng.standard_normal((rows, cols)).astype(np.float32)
            q = a if ty == T.F32 else a.astype(np.float16)
            w.add_tensor(ty.name, q)
            deq = q.astype(np.float32)
        else:
            if ty in (T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):
                q = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), ty)
            else:
                # K-quants: random blocks with small finite f16 scales (gguf-py quantizes few
                # of them; the dequantizer is what is compared).
                q = rng.integers(0, 256, size=(rows, nbytes // rows), dtype=np.uint8)
                blocks = q.reshape(-1, size)
                scale = rng.uniform(0.001, 0.05, size=(blocks.shape[0], 2)).astype(np.float16).view(np.uint8)
                if ty == T.Q6_K:
                    blocks[:, size - 2 : size] = scale[:, :2]
                else:
                    blocks[:, 0:4] = scale
            w.add_tensor(ty.name, q, raw_shape=q.shape, raw_dtype=ty)
            deq = gguf.quants.dequantize(q, ty).astype(np.float32)
        assert deq.shape == (rows, cols), (ty.name, deq.shape)
        index.append({"name": ty.name, "shape": [rows, cols]})
        values.append(deq.reshape(-1))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    (OUT / "types.json").write_text(json.dumps(index, indent=1) + "\n")
    np.concatenate(values).astype("<f4").tofile(OUT / "types.f32")


if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    if sys.argv[1:] == ["types"]:
        types()
        sys.exit()
    model("qwen3", "qwen3", "f32")
    model("qwen2", "qwen2", "bf16")
    model("llama", "llama", "f16")
    types()
    print("wrote", sorted(p.name for p in OUT.iterdir()))
