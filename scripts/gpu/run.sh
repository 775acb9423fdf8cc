#!/usr/bin/env bash
# Every GPU check and benchmark of tandem in one call of the lent GPU machine.
#
# Here (no GPU):   scripts/gpu/build.sh            # release binary + GPU test binaries in gpu-bin/
# There (device):  scripts/gpu/run.sh [full|bench|quick]   # carry: gpu-bin
#   full (default): tests, tandem bench (also decode at a 1024-token context), PyTorch;
#   bench: tests and tandem bench; quick: tests;
#   tune: kernel tests and the decode-projection plan sweep (TANDEM_GEMV_SWEEP=1);
#   ring: the matrix below for the ring decode kernel (TANDEM_DECODE_RING) and its decomposition;
#   matrix "label:VAR=value ..." ...: kernel and model tests, then the decode step under each setting
#   (PROFILE=1 among the settings adds the step's kernel profile, DECODE_PROMPT=n sets the decode
#   sequences' prompt length, PREFILL_TOKENS=n the prefill (and so the engine's batched-token
#   limit, which sizes the per-step metadata upload), TANDEM_EXE=path runs another tandem binary,
#   BENCH_ARGS=--flag=value adds one bench argument (e.g. BENCH_ARGS=--async-scheduling=off);
#   SKIP_TESTS=1 in the environment skips the tests);
#   ncu "label:VAR=value ..." ...: Nsight Compute on a batch-1 decode under each setting (the first
#   NCU_COUNT, default 40, launches of kernels matching NCU_KERNELS, default gemv, attention and
#   the persistent kernel): per kernel its duration, DRAM throughput, occupancy, hit rates and
#   top warp stall reasons (scripts/gpu/ncu_table.py; raw CSV in $OUT/ncu_LABEL.csv);
#   ncu-src KERNEL_REGEX "VAR=value ...": Nsight Compute's per-instruction warp stall samples of
#   one launch of the matching kernel in a batch-1 decode, summarised by SASS basic block
#   (scripts/gpu/ncu_hot.py; raw CSV in $OUT/ncu_src.csv): where its warps wait;
#   pd: only disaggregated serving on the GPU (scripts/gpu/pd_check.py; also part of every mode
#   that runs the tests);
#   sanitize [TOOL [TEST_FILTER]]: the kernel tests (those matching TEST_FILTER) under
#   compute-sanitizer's TOOL (memcheck, the default; racecheck, initcheck, synccheck).
#
# Runs the kernel, model and engine GPU tests (ignored by `cargo test` elsewhere, run here with
# --include-ignored; failing if no GPU is usable or any test skips), the transformers
# comparison, `tandem bench engine` on preset:qwen3-4b with its floors, and the same shapes in
# PyTorch; prints a short table last. Full logs go to $OUT (or ./gpu-out). `tune` also measures
# programmatic dependent launch (TANDEM_CUDA_PDL=1, experimental: no gain measured so far).
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
export TANDEM_REQUIRE_CUDA=1 TANDEM_CACHE_DIR=/tmp/tandem-cache RUST_BACKTRACE=1
BIN=gpu-bin
[ -x "$BIN/tandem" ] || { echo "no $BIN/tandem: run scripts/gpu/build.sh first and carry gpu-bin"; exit 2; }
status=0
note() { echo "== $*" | tee -a "$OUT/summary.txt"; }

nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"

MODE=${1:-full}
if [ "$MODE" = ring ]; then
  # The ring decode kernel against the five-kernel step: kernel and model tests first (they
  # fill the kernel cache and include the ring's bit-equality test), then its timing and the
  # per-stage clock trace (TANDEM_RING_TRACE: critical path, grid barrier, median and slowest
  # block per stage kind), 256 KiB of L2 prefetch past a full ring (TANDEM_RING_PREFETCH) and
  # the TANDEM_RING_DEBUG decomposition (8 no attention, 1 no grid waits; 2 no arithmetic and 3
  # the stream alone were 2.63 and 2.20 ms in run AP).
  exec "$0" matrix "fused:X=1" "ring:TANDEM_DECODE_RING=1" "ring_trace:TANDEM_DECODE_RING=1 TANDEM_RING_TRACE=1" \
    "ring_pf256:TANDEM_DECODE_RING=1 TANDEM_RING_PREFETCH=262144" \
    "ring_noattn:TANDEM_DECODE_RING=1 TANDEM_RING_DEBUG=8" \
    "ring_nowait:TANDEM_DECODE_RING=1 TANDEM_RING_DEBUG=1" "ring200:TANDEM_DECODE_RING=1 DECODE_PROMPT=200"
fi
if [ "$MODE" = matrix ]; then
  # Decode step under several settings in one call: each further argument is
  # "label:VAR=value VAR=value" (TANDEM_EXE=path picks another tandem binary).
  shift
  for t in cuda_kernels cuda_model; do
    [ -n "${SKIP_TESTS:-}" ] && break
    timeout 300 "$BIN/$t" --include-ignored --test-threads=1 > "$OUT/tests_$t.log" 2>&1 && note "test $t: ok" \
      || { note "test $t: FAILED"; grep -B2 -A6 "panicked" "$OUT/tests_$t.log" | head -30; status=1; }
  done
  for spec in "$@"; do
    label=${spec%%:*}
    ( export ${spec#*:}
      timeout 150 "${TANDEM_EXE:-$BIN/tandem}" bench engine --device cuda:0 --model preset:qwen3-4b --batch 1,64 \
        --decode-steps 64 --decode-prompt-tokens "${DECODE_PROMPT:-16}" --prefill-tokens "${PREFILL_TOKENS:-512}" \
        ${PROFILE:+--profile} ${BENCH_ARGS:-} \
        > "$OUT/matrix_$label.log" 2>&1 )
    note "$label: $(grep -E '^(1|64) +[0-9]' "$OUT/matrix_$label.log" | tr -s ' ' | tr '\n' '|')"
    grep -E "^ *fused|plan sweep: down" "$OUT/matrix_$label.log" | grep -v pipelined | sed "s/^/  $label /"
    grep -o "ring trace:.*" "$OUT/matrix_$label.log" | sed "s/^/  $label /"
    # A TANDEM_KERNEL_DEFINES=TANDEM_PDL_TRACE build: the early decode attention's phases, when
    # the bulk o projection's blocks entered, saw the attention done, had their weights, exited;
    # one layer's timeline (every kernel's entries, exits, gaps and tails) and placement.
    if grep -q "^pdl_trace" "$OUT/matrix_$label.log"; then
      python3 scripts/gpu/pdl_trace.py "$OUT/matrix_$label.log" | sed "s/^/  $label /"
    fi
  done
  exit $status
fi
# Nsight Compute on a batch-1 decode (the first NCU_COUNT launches of kernels matching
# NCU_KERNELS), summarised per kernel. Arguments: a label, then VAR=value settings.
ncu_decode() {
  local label=$1; shift
  local NCU; NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  [ -n "$NCU" ] || { note "no ncu on this machine"; return 2; }
  ( [ $# -gt 0 ] && export "$@"
    timeout 500 "$NCU" --clock-control none --graph-profiling node \
      -k "regex:${NCU_KERNELS:-gemv|attention|decode_persistent|decode_ring}" --launch-count "${NCU_COUNT:-40}" \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
      --section LaunchStats --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
      --csv --page details --print-units base \
      "${TANDEM_EXE:-$BIN/tandem}" bench engine --device cuda:0 --model preset:qwen3-4b --batch 1 --decode-steps 4 \
      --decode-prompt-tokens "${DECODE_PROMPT:-16}" --prefill-tokens 16 > "$OUT/ncu_$label.csv" 2> "$OUT/ncu_$label.err" ) \
    || { note "ncu $label failed"; tail -5 "$OUT/ncu_$label.err"; tail -5 "$OUT/ncu_$label.csv"; return 1; }
  note "ncu $label:"
  python3 scripts/gpu/ncu_table.py "$OUT/ncu_$label.csv" | tee -a "$OUT/summary.txt"
}
# Disaggregated serving on the GPU, as separate processes (prefill, decode, router; KV through
# each engine's host copy of its GPU cache), against a colocated engine, push and pull.
pd_check() {
  timeout 400 python3 scripts/gpu/pd_check.py "$BIN/tandem" "$OUT" > "$OUT/pd.log" 2>&1 || status=1
  while read -r line; do note "$line"; done < "$OUT/pd.log"
}
if [ "$MODE" = pd ]; then
  pd_check; cat "$OUT/summary.txt"; exit $status
fi
if [ "$MODE" = ncu ]; then
  shift
  for spec in "$@"; do
    # shellcheck disable=SC2086  # the settings split into VAR=value words
    ncu_decode "${spec%%:*}" ${spec#*:} || status=1
  done
  exit $status
fi
if [ "$MODE" = ncu-src ]; then
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  [ -n "$NCU" ] || { echo "no ncu on this machine"; exit 2; }
  # shellcheck disable=SC2086  # the settings split into VAR=value words
  ( [ -n "${3:-}" ] && export ${3}
    timeout 500 "$NCU" --clock-control none -k "regex:${2:?kernel regex}" --launch-skip 2 --launch-count 1 \
      --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \
      "${TANDEM_EXE:-$BIN/tandem}" bench engine --device cuda:0 --model preset:qwen3-4b --batch 1 --decode-steps 4 \
      --decode-prompt-tokens "${DECODE_PROMPT:-16}" --prefill-tokens 16 > "$OUT/ncu_src.csv" 2> "$OUT/ncu_src.err" ) \
    || { note "ncu-src failed"; tail -5 "$OUT/ncu_src.err"; exit 1; }
  python3 scripts/gpu/ncu_hot.py "$OUT/ncu_src.csv" 25 | tee -a "$OUT/summary.txt"
  exit 0
fi
if [ "$MODE" = sanitize ]; then
  SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  [ -n "$SAN" ] || { echo "no compute-sanitizer on this machine"; exit 2; }
  tool=${2:-memcheck}
  timeout 580 "$SAN" --tool "$tool" --error-exitcode 99 "$BIN/cuda_kernels" --include-ignored ${3:-} --test-threads=1 \
    > "$OUT/sanitize_$tool.log" 2>&1
  rc=$?
  note "compute-sanitizer $tool on cuda_kernels ${3:-}: exit $rc ($(grep -c '^=========  *[A-Z]' "$OUT/sanitize_$tool.log") report lines)"
  grep -m 20 -A4 "^========= [A-Z]" "$OUT/sanitize_$tool.log"; tail -3 "$OUT/sanitize_$tool.log"
  exit $rc
fi
if [ "$MODE" = tune ]; then
  # Decode-projection tuning: the kernel tests, then the batch-1 profile with every plan of the
  # sweep (TANDEM_GEMV_SWEEP), with programmatic launch off and on.
  timeout 300 "$BIN/cuda_kernels" --include-ignored --test-threads=1 > "$OUT/tests.log" 2>&1 && note "test cuda_kernels: ok" \
    || { note "test cuda_kernels: FAILED"; grep -B2 -A6 "panicked" "$OUT/tests.log" | head -30; status=1; }
  for pdl in 0 1; do
    TANDEM_CUDA_PDL=$pdl TANDEM_GEMV_SWEEP=1 timeout 250 "$BIN/tandem" bench engine --device cuda:0 \
      --model preset:qwen3-4b --batch 1 --decode-steps 32 --prefill-tokens 512 --profile > "$OUT/tune_pdl$pdl.log" 2>&1
    note "programmatic launch $pdl: $(grep -E '^1 +[0-9]' "$OUT/tune_pdl$pdl.log" | tr -s ' ')"
    grep -E "fused|plan sweep|CUDA graph|rope|attention \(row" "$OUT/tune_pdl$pdl.log" | head -120 | sed "s/^/pdl$pdl /"
  done
  cat "$OUT/summary.txt"
  exit $status
fi

for t in cuda_kernels cuda_model cuda_engine; do
  if [ "$t" = cuda_model ]; then
    python3 scripts/gpu/make_hf_reference.py /tmp/hfref > "$OUT/hfref.log" 2>&1 || { note "make_hf_reference failed"; tail -20 "$OUT/hfref.log"; }
    export TANDEM_HF_REFERENCE=/tmp/hfref
  fi
  if [ "$t" = cuda_model ] && [ -s /tmp/hfref/expected.json ]; then
    # The same comparison against transformers computing in f32 on the same bf16 weights
    # (no bf16 rounding of transformers' logits): reported, not a gate.
    REFERENCE_DTYPE=float32 python3 scripts/gpu/make_hf_reference.py /tmp/hfref32 >> "$OUT/hfref.log" 2>&1 \
      && TANDEM_HF_REFERENCE=/tmp/hfref32 timeout 120 "$BIN/$t" --include-ignored greedy --nocapture > /tmp/test_hf32.log 2>&1
    note "transformers f32 reference: $(grep -c '40/40 tokens equal' /tmp/test_hf32.log) of 8 prompts equal for 40 tokens"
    grep -h "^diagnostic transformers" "$OUT/hfref.log" | head -2 | while read -r line; do note "$line"; done
    cat /tmp/test_hf32.log >> "$OUT/tests.log"
  fi
  if timeout 300 "$BIN/$t" --include-ignored --test-threads=1 --nocapture > /tmp/test_$t.log 2>&1; then
    note "test $t: ok"
    # On a GPU nothing may skip: a skipped check would count as passed.
    if grep -qi "skipp" /tmp/test_$t.log; then
      note "test $t: FAILED (tests skipped on a GPU)"; status=1
      grep -i "skipp" /tmp/test_$t.log | head -5 >> "$OUT/summary.txt"
    fi
  else
    note "test $t: FAILED"; status=1
    grep -B2 -A6 "panicked" /tmp/test_$t.log | head -30 >> "$OUT/summary.txt"
  fi
  cat /tmp/test_$t.log >> "$OUT/tests.log"
done
grep -h "^diagnostic" "$OUT/hfref.log" | head -8; grep -h "^diagnostic transformers" "$OUT/hfref.log"
grep -h "relative error\|tokens equal\|diverged\|shapes checked\|prompts matched\|worst logits" "$OUT/tests.log" | tail -50

pd_check

if [ "$MODE" != quick ]; then
  timeout 400 "$BIN/tandem" bench engine --device cuda:0 --model preset:qwen3-4b --batch 1,64 \
    --decode-steps 32 --prefill-tokens 4096 --profile --json-out "$OUT/bench_qwen3_4b.json" > "$OUT/bench.log" 2>&1 \
    || { note "bench engine failed"; status=1; tail -30 "$OUT/bench.log"; }
  # PyTorch right after tandem's bench: the whole call runs close to the 10-minute limit, and
  # what comes after this is optional.
  if [ "$MODE" = full ]; then
    timeout 300 python3 scripts/gpu/torch_baseline.py "$OUT/torch_qwen3_4b.json" > "$OUT/torch.log" 2>&1 \
      || { note "torch baseline failed"; tail -20 "$OUT/torch.log"; }
  fi
  # Decode over a 1024-token context (vLLM's random-dataset prompt length): attention's share.
  timeout 200 "$BIN/tandem" bench engine --device cuda:0 --model preset:qwen3-4b --batch 1,64 \
    --decode-steps 32 --decode-prompt-tokens 1024 --prefill-tokens 512 > "$OUT/bench_ctx1024.log" 2>&1 \
    && note "decode at 1024-token context: $(grep -E '^(1|64) +[0-9]' "$OUT/bench_ctx1024.log" | tr -s ' ' | tr '\n' '|')" \
    || { note "bench at 1024-token context failed"; tail -10 "$OUT/bench_ctx1024.log"; }
  # What async scheduling (on by default on a GPU) gives at batch 1: without it, then with it.
  for a in off on; do
    timeout 150 "$BIN/tandem" bench engine --device cuda:0 --model preset:qwen3-4b --batch 1 --decode-steps 64 \
      --prefill-tokens 16 --async-scheduling "$a" > "$OUT/bench_async_$a.log" 2>&1 \
      && note "decode b1, async scheduling $a: $(grep -E '^1 +[0-9]' "$OUT/bench_async_$a.log" | tr -s ' ')" \
      || note "bench with async scheduling $a failed"
  done
  if [ "$MODE" = bench ]; then
    ncu_decode default || true  # per-kernel counters of the decode step (Firecracker machines)
  fi
  echo; grep -v "^\.\.\." "$OUT/bench.log"
  python3 - "$OUT" <<'PY'
import json, sys, os
out = sys.argv[1]
try:
    t = json.load(open(f"{out}/bench_qwen3_4b.json"))
except Exception as e:
    print("no tandem bench result:", e); sys.exit(0)
p = json.load(open(f"{out}/torch_qwen3_4b.json")) if os.path.exists(f"{out}/torch_qwen3_4b.json") else {}
print(f"\n{'preset:qwen3-4b, one H200':<34}{'tandem':>12}{'floor':>12}{'PyTorch':>12}{'torch/tandem':>14}")
for d in t["decode"]:
    pt = p.get(f"decode_b{d['batch']}_ms")
    print(f"{'decode step b' + str(d['batch']) + ' (ms)':<34}{d['median_step_ms']:>12.3f}{d['floor_step_ms']:>12.3f}"
          f"{pt if pt is None else round(pt, 3)!s:>12}{'' if pt is None else f'{pt / d['median_step_ms']:.2f}x':>14}")
    print(f"{'  tokens/s':<34}{d['tokens_per_s']:>12.0f}{'':>12}{'' if pt is None else round(d['batch'] * 1e3 / pt):>12}")
pf = p.get("prefill_4096_ms")
print(f"{'prefill 4096 (ms)':<34}{t['prefill_ms']:>12.1f}{t['prefill_floor_ms']:>12.1f}"
      f"{pf if pf is None else round(pf, 1)!s:>12}{'' if pf is None else f'{pf / t['prefill_ms']:.2f}x':>14}")
print(f"decode b1 floor/measured {t['decode'][0]['fraction_of_floor'] * 100:.1f}% (need >= 77%: within 1.3x); "
      f"prefill at {t['prefill_floor_ms'] / t['prefill_ms'] * 100:.1f}% of the cuBLAS GEMM rate {t['gemm_tflop_s']:.0f} TFLOP/s "
      f"({t['prefill_flops_all_params'] / (t['gemm_tflop_s'] * 1e9) / t['prefill_ms'] * 100:.1f}% counting all params; need >= 50%); "
      f"copy bandwidth {t['read_bandwidth_gb_s']:.0f} GB/s")
PY
fi
cat "$OUT/summary.txt"
exit $status
