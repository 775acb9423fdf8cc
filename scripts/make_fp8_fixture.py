"""Make fixtures/qwen3-fp8: the qwen3 fixture's checkpoint in the block-scaled FP8 layout Qwen and
DeepSeek publish (Qwen3-32B-FP8 and the like): every decoder linear weight as float8_e4m3fn with
one float32 `weight_scale_inv` per block, `quantization_config` with `quant_method: fp8` in
config.json; embeddings, norms and the output head kept as they were.

Run once (numpy, ml_dtypes and safetensors; no torch):
    python3 scripts/make_fp8_fixture.py fixtures/qwen3 fixtures/qwen3-fp8
The output is committed; tests never run this script.

The blocks are 32 x 48 (`weight_block_size: [32, 48]`; published checkpoints use 128 x 128,
which would make each of this tiny model's matrices one partial block): not square, and 48
divides neither 64 nor 128, so a loader that swaps rows and columns or mishandles the last,
partial blocks gets other numbers. A block's scale is its largest magnitude over 448 (e4m3's
largest finite value), as the published checkpoints were made; ml_dtypes rounds to nearest even.

`dequantized.json` holds, for each FP8 tensor, the SHA-256 of its dequantized values (the e4m3
numbers times their block's scale, in float32, little-endian, row-major), computed here with
ml_dtypes' own e4m3 conversion: tandem's loader must give the same bits. With torch and
transformers at hand (the GPU machine), `--references` also writes expected.json: transformers'
greedy continuations of the source fixture's prompts on those dequantized weights.
"""
import hashlib
import json
import os
import re
import shutil
import sys

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

BLOCK = (32, 48)
E4M3_MAX = 448.0
QUANTIZED = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")


def quantize(w):
    """float32 matrix -> (e4m3 matrix, float32 block scales), one scale per BLOCK."""
    rows, cols = w.shape
    br, bc = BLOCK
    scales = np.ones(((rows + br - 1) // br, (cols + bc - 1) // bc), dtype=np.float32)
    q = np.zeros(w.shape, dtype=ml_dtypes.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            block = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            amax = float(np.abs(block).max())
            scale = np.float32(amax / E4M3_MAX) if amax > 0 else np.float32(1.0)
            scales[i, j] = scale
            q[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = (block / scale).astype(ml_dtypes.float8_e4m3fn)
    return q, scales


def dequantize(q, scales):
    br, bc = BLOCK
    full = np.repeat(np.repeat(scales, br, axis=0), bc, axis=1)[:q.shape[0], :q.shape[1]]
    return (q.astype(np.float32) * full).astype(np.float32)


def main(src, out, references):
    os.makedirs(out, exist_ok=True)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    stored, digests, dequantized = {}, {}, {}
    for name, w in sorted(tensors.items()):
        if QUANTIZED.match(name):
            q, scales = quantize(w.astype(np.float32))
            stored[name] = q
            stored[name + "_scale_inv"] = scales
            deq = dequantize(q, scales)
            dequantized[name] = deq
            digests[name] = hashlib.sha256(deq.astype("<f4").tobytes()).hexdigest()
        else:
            stored[name] = w
            dequantized[name] = w
    save_file(stored, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(BLOCK)}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    shutil.copy(os.path.join(src, "generation_config.json"), out)
    with open(os.path.join(out, "dequantized.json"), "w") as f:
        json.dump({"weight_block_size": list(BLOCK), "ml_dtypes": ml_dtypes.__version__, "sha256": digests}, f,
                  indent=1)
    if references:
        write_references(src, out, config, dequantized)
    print(f"{out}: {len(digests)} FP8 tensors in {BLOCK[0]}x{BLOCK[1]} blocks")


def write_references(src, out, config, dequantized):
    """transformers' greedy continuations on the dequantized weights (needs torch)."""
    import torch
    import transformers
    del config["quantization_config"]
    cfg = transformers.AutoConfig.for_model(**config)
    model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32).eval()
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in dequantized.items()},
                          strict=False)
    with open(os.path.join(src, "expected.json")) as f:
        source = json.load(f)
    cases = []
    for case in source["cases"]:
        ids = torch.tensor([case["prompt_ids"]])
        with torch.no_grad():
            outs = model.generate(ids, max_new_tokens=source["new_tokens"], do_sample=False)
        cases.append({"prompt_ids": case["prompt_ids"], "greedy_ids": outs[0, ids.shape[1]:].tolist()})
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump({"new_tokens": source["new_tokens"], "transformers": transformers.__version__,
                   "torch": torch.__version__, "cases": cases}, f, indent=1)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if len(args) != 2:
        sys.exit(__doc__)
    main(args[0], args[1], "--references" in sys.argv)
