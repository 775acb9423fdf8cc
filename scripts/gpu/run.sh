#!/usr/bin/env bash
# Every GPU check and benchmark of tandem in one call of the lent GPU machine.
#
# Here (no GPU):   scripts/gpu/build.sh            # release binary + GPU test binaries in gpu-bin/
# There (device):  scripts/gpu/run.sh [full|bench|quick]   # carry: gpu-bin
#   full (default): tests, tandem bench (also decode at a 1024-token context), PyTorch;
#   bench: tests and tandem bench; quick: tests (without the f32 transformers diagnostic, and
#   pd_check over cuda-ipc only, so that it fits one call);
#   tune: kernel tests and the decode-projection plan sweep (bench engine --sweep-gemv-plans);
#   fp8: issue 51's FP8 kernel and model tests, then qwen3-4b bf16 / fp8 / fp8 unfused decode /
#   fp8 prefill through a bf16 copy and qwen3-32b fp8 and bf16 (FP8_32B=0 leaves them out) in
#   bench engine, then decode at a 32k context over bf16 and FP8 KV caches and P/D with FP8
#   caches (FP8_KV=0 leaves those out);
#   matrix "label:SETTING ..." ...: kernel and model tests, then the decode step under each setting;
#   a setting is exe=PATH (another tandem binary, e.g. gpu-bin/tandem-base), model=M (default
#   preset:qwen3-4b), prompt=N (the decode
#   sequences' prompt length), prefill=N[,N...] (the prefill lengths, the longest also the
#   engine's batched-token limit; issue 50: SKIP_TESTS=1 ... matrix "long:prefill=4096,16384,32768 profile"),
#   profile (the step's kernel profile), or a `tandem bench engine` argument such as
#   --cuda-tune=programmatic_launch=1 or --async-scheduling=off (SKIP_TESTS=1 skips the tests);
#   ncu "label:ARG ..." ...: Nsight Compute on a batch-1 decode with those bench arguments (the first
#   NCU_COUNT, default 40, launches of kernels matching NCU_KERNELS, default gemv and
#   attention): per kernel its duration, DRAM throughput, occupancy, hit rates and
#   top warp stall reasons (scripts/gpu/ncu_table.py; raw CSV in $OUT/ncu_LABEL.csv);
#   ncu-src KERNEL_REGEX "ARG ...": Nsight Compute's per-instruction warp stall samples of
#   one launch of the matching kernel in a batch-1 decode, summarised by SASS basic block
#   (scripts/gpu/ncu_hot.py; raw CSV in $OUT/ncu_src.csv): where its warps wait;
#   prefill: issue 50 in one call: the attention kernels against the reference (every prefill
#   build), bench engine's long prefills under each build (PREFILL_BUILDS, default "1 2 3" of
#   --cuda-tune wgmma_prefill, without 3 if the TMA build failed the test, only 0 and 1 if
#   another did; PREFILL_TOKENS, default
#   4096,16384), then ncu-prefill (its NCU_PREFILL_* settings; SKIP_NCU=1 leaves it out);
#   ncu-prefill [TOKENS]: the same two views of one launch of the prefill attention kernel
#   (NCU_PREFILL_KERNEL, default flash_prefill_wgmma_tma_hd128, Hopper's default; NCU_PREFILL_ARGS adds
#   bench engine arguments, e.g. "--cuda-tune=wgmma_prefill=1" with flash_prefill_wgmma_hd128)
#   on a TOKENS-token prompt (default 16384; issue 50);
#   ipc: kernel, engine and kv_transport tests (cuda-ipc alone, into another process), P/D over tcp and cuda-ipc (pd_check.py) and `tandem bench kv
#   --transport cuda-ipc` (also into cuda:1 when there are two GPUs) and the tcp benchmarks
#   (SKIP_TCP=1 leaves those out);
#   tcp: `tandem bench kv --transport tcp --device cuda:0` (TCP_SIZES, each over TCP_STREAMS streams,
#   default "1 4"; TCP_TLS=1 over TLS, and on host memory too, TCP_TLS_PIPES="on off" with the
#   connections' TLS threads and without; TCP_SPLIT=1 each end on half the cores, as two hosts,
#   `--split-cpus`) and on host memory; sweep: `tandem bench sweep
#   --launch` on cuda:0 (push and pull over cuda-ipc, colocated; SWEEP_MODEL (preset:qwen3-4b), SWEEP_MODES, SWEEP_INPUTS,
#   SWEEP_QPS narrow it, SWEEP_PROMPTS sets the requests a point (16); SWEEP_DECODE_DEVICE=cuda:1 puts decode on the second GPU;
#   SWEEP_KV_BLOCKS each engine's cache blocks (4096); SWEEP_MPS=1 under CUDA MPS; SWEEP_ENGINE_ARGS adds
#   --engine-arg=... flags or other sweep options (`--engine-log warn,tandem_kv=debug`: each push
#   group's times, for scripts/gpu/push_tail.py); SWEEP_DIR names its result folder under $OUT);
#   longctx ["label:ARG ..." ...]: decode at a long context (LONGCTX_CONTEXT, LONGCTX_BATCH,
#   LONGCTX_MODEL) over bf16 and FP8 caches under each set of bench engine arguments, after the
#   attention kernel and model tests (see the mode below);
#   kv-fp8: the KV of KV_TOKENS tokens over tcp between GPU caches, bf16 then FP8 (issue 51);
#   fp8-skinny: steps of 17-64 rows over FP8 weights on the skinny product against cuBLASLt and
#   bf16 (issue 51's batch 64; see the mode below);
#   seed: issue 51's qwen3-32b, FP8 weights and KV, swept as sweep does (SWEEP_TRANSPORT=tcp too);
#   ab: P/D with the new build, then bench kv (cuda-ipc, tcp) for gpu-bin/tandem-base and the new
#   build alternately (AB_ROUNDS, TCP_SIZES; build with BASELINE=<rev>);
#   prefix: issue 30's multi-turn TTFT by turn, conditional and 2P2D KV-aware routing, and the
#   bytes of a 90% prefix hit (scripts/gpu/prefix_check.py, preset:qwen3-4b);
#   pd: only disaggregated serving on the GPU (scripts/gpu/pd_check.py; also part of every mode
#   that runs the tests);
#   invariant: --batch-invariant's kernel and engine tests, P/D with it (SKIP_PD=1 leaves that
#   out), and bench engine with and without it (SKIP_BENCH=1 leaves that out; INV_BENCH names
#   the settings, e.g. "default --batch-invariant wgmma"); invariant-serve: bench serve with and without
#   it, then the GPU soak with it (SOAK_SECS per mode, default 60; ENGINE_TEST=1 runs the
#   engine's batch-invariance test first);
#   serve-long: colocated TTFT of 16k-token prompts at 1 req/s, the Hopper prefill attention against
#   the mma.sync one (SERVE_IN, SERVE_PROMPTS, SERVE_RATE, SERVE_OUT; issue 50);
#   soak "label:ARG ..." ...: the GPU soak (push; SOAK_MODES, SOAK_SECS) under each set of `bench soak`
#   arguments, with the engines' warnings in $OUT/soak_LABEL.log;
#   faults [LABEL ...]: issue 28's faults 1-4 and corruption on the GPU path, one soak each (push and
#   pull over cuda-ipc, --batch-invariant; late-writes, frozen-peer, expired-lease, dropped-done,
#   corrupt; FAULT_SECS per mode), each line with both engines' KV transfer counters;
#   tests [BINARY ...]: only those GPU test binaries (default cuda_model and cuda_engine; TEST_FILTER);
#   sanitize [TOOL [TEST_FILTER]]: the kernel tests (those matching TEST_FILTER) under
#   compute-sanitizer's TOOL (memcheck, the default; racecheck, initcheck, synccheck).
#
# Everything under $OUT but summary.txt comes back packed in $OUT/results.tgz.
#
# Runs the kernel, model and engine GPU tests (ignored by `cargo test` elsewhere, run here with
# --include-ignored; failing if no GPU is usable or any test skips), the transformers
# comparison, `tandem bench engine` on preset:qwen3-4b with its floors, and the same shapes in
# PyTorch; prints a short table last. Full logs go to $OUT (or ./gpu-out). `tune` also measures
# programmatic dependent launch (--cuda-tune programmatic_launch=1: no gain measured so far).
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/local/nvidia/lib64:${LD_LIBRARY_PATH:-}
export TANDEM_REQUIRE_CUDA=1 TANDEM_CACHE_DIR=/tmp/tandem-cache RUST_BACKTRACE=1
# cudarc opens libnccl.so, NCCL installs libnccl.so.2: link it where the loader looks (the
# one-rank NCCL test then must run: TANDEM_REQUIRE_NCCL).
nccl=$(ls /usr/lib/x86_64-linux-gnu/libnccl.so.2 /usr/local/cuda*/targets/x86_64-linux/lib/libnccl.so.2 \
  /usr/local/nvidia/lib64/libnccl.so.2 2>/dev/null | head -1)
[ -n "$nccl" ] || nccl=$(python3 -c 'import glob, site
print(next((f for p in site.getsitepackages() for f in glob.glob(p + "/nvidia/nccl/lib/libnccl.so*")), ""))' 2>/dev/null)
if [ -n "$nccl" ] && [ -f "$nccl" ]; then
  mkdir -p /tmp/nccl-lib && ln -sf "$nccl" /tmp/nccl-lib/libnccl.so
  export LD_LIBRARY_PATH=/tmp/nccl-lib:$LD_LIBRARY_PATH TANDEM_REQUIRE_NCCL=1
else
  echo "no libnccl.so.2 found: the one-rank NCCL test will skip"
fi
BIN=${BIN:-gpu-bin}
[ -x "$BIN/tandem" ] || { echo "no $BIN/tandem: run scripts/gpu/build.sh first and carry gpu-bin"; exit 2; }
status=0
note() { echo "== $*" | tee -a "$OUT/summary.txt"; }
# At most 8 files come back from $OUT: everything but the summary goes back as one archive
# (`tar xzf results.tgz` here; a sweep's figures and JSONs are in it under sweep/).
pack() {
  (cd "$OUT" && tar czf /tmp/results.tgz --exclude=summary.txt . && find . -mindepth 1 ! -name summary.txt -delete \
    && mv /tmp/results.tgz results.tgz) || echo "packing $OUT failed"
}
trap pack EXIT

nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"

MODE=${1:-full}
if [ "$MODE" = prefill ]; then
  builds=${PREFILL_BUILDS:-1 2 3}
  timeout 150 "$BIN/cuda_kernels" --include-ignored --test-threads=1 --nocapture attention_kernels_match \
    > "$OUT/tests_attention.log" 2>&1 && note "attention kernels against the reference: ok" \
    || { # A failing TMA build (3) leaves the others measured; any other failure builds 0 and 1.
         if grep -q "PingPongTma" "$OUT/tests_attention.log"; then builds=${builds//3/}; else builds="0 1"; fi
         note "attention kernels against the reference: FAILED (benchmarks of builds $builds only)"
         grep -A6 "panicked" "$OUT/tests_attention.log" | head -20; status=1; }
  grep "^wgmma" "$OUT/tests_attention.log" | tail -3 | cut -c1-240
  specs=()
  for build in $builds; do
    specs+=("build$build:prefill=${PREFILL_TOKENS:-4096,16384} profile --cuda-tune=wgmma_prefill=$build")
  done
  OUT="$OUT/matrix" SKIP_TESTS=1 "$0" matrix "${specs[@]}" > /dev/null 2>&1 || status=1
  grep -E "^==|rate|^  build[0-9] [0-9]" "$OUT/matrix/summary.txt" | tee -a "$OUT/summary.txt"
  # Only the top summary.txt stays out of results.tgz (pack deletes the rest once packed).
  mv "$OUT/matrix/summary.txt" "$OUT/matrix/summary_matrix.txt"
  if [ -z "${SKIP_NCU:-}" ]; then
    OUT="$OUT/ncu" "$0" ncu-prefill "${PREFILL_NCU_TOKENS:-16384}" > /dev/null 2>&1 || status=1
    if [ -f "$OUT/ncu/summary.txt" ]; then
      tee -a "$OUT/summary.txt" < "$OUT/ncu/summary.txt"
      mv "$OUT/ncu/summary.txt" "$OUT/ncu/summary_ncu.txt"
    fi
  fi
  exit $status
fi
# Disaggregated serving on the GPU, as separate processes (prefill, decode, router; KV through
# each engine's host copy of its GPU cache), against a colocated engine, push and pull.
pd_check() {
  local rc=0
  timeout 400 python3 scripts/gpu/pd_check.py "$BIN/tandem" "$OUT" > "$OUT/pd.log" 2>&1 || { status=1; rc=1; }
  while read -r line; do note "$line"; done < "$OUT/pd.log"
  return $rc
}
# FP8 (issue 51) in one call: the FP8 kernel tests (quantization, gemv_fp8 and its K-split build,
# the block-scaled GEMM against the exact dequantized product and which row counts have a
# cuBLASLt kernel, the fused FP8 decode projections against the dequantized reference) and the
# model tests (the GPU against the CPU's FP8 rounding: weights fused and unfused, W8A8 prefill;
# the FP8 KV cache, fused and unfused decode), then bench engine: qwen3-4b bf16 / fp8 (the
# defaults, with --profile) / fp8 with unfused decode / fp8 prefill through the bf16 copy, and
# qwen3-32b fp8 (profiled) and bf16 (FP8_32B=0 leaves them out; FP8_BENCH=quick keeps fp8 and
# fp8_32 only), prefill of 8192; then the FP8 KV cache (FP8_KV=0 leaves it out): decode at a
# KV_CONTEXT-token context (default 32768, batch 1 and 8) over bf16 and FP8 caches, and P/D with
# every engine's cache FP8 (FP8KV_PD_SETTINGS, default push over cuda-ipc and pull over tcp)
# against an FP8 colocated engine.
# Long-context decode (the row attention's split ranges and GQA groups; issue 51's FP8 KV
# target) in one call: the attention kernel tests (the row kernel against the reference over
# bf16 and FP8 caches, split and unsplit, and with the fused RoPE) and the model tests at split
# contexts (SKIP_TESTS=1 leaves them out), then bench engine at LONGCTX_CONTEXT tokens of
# context (16384) for batches LONGCTX_BATCH (1,8,16) over bf16 and FP8 caches under each
# further argument "label:ARG ..." (bench engine arguments; default: old = one head a block
# over at most 16 ranges, the builds before, and new = the defaults, profiled).
if [ "$MODE" = longctx ]; then
  shift
  if [ -z "${SKIP_TESTS:-}" ]; then
    timeout 240 "$BIN/cuda_kernels" --include-ignored --test-threads=1 attention fp8_ > "$OUT/lc_kernels.log" 2>&1 \
      && note "kernel tests (attention, fp8_): ok" \
      || { note "kernel tests: FAILED"; grep -B2 -A8 panicked "$OUT/lc_kernels.log" | head -30 >> "$OUT/summary.txt"; status=1; }
    timeout 240 "$BIN/cuda_model" --include-ignored --nocapture logits_agree fp8_kv > "$OUT/lc_model.log" 2>&1 \
      && note "model tests (logits_agree, fp8_kv): ok" \
      || { note "model tests: FAILED"; grep -B2 -A8 panicked "$OUT/lc_model.log" | head -30 >> "$OUT/summary.txt"; status=1; }
    grep -E "split_keys.*step [2-4]|fp8 KV.*step 4" "$OUT/lc_model.log" | while read -r l; do note "$l"; done
  fi
  [ $# -gt 0 ] || set -- "old:--cuda-tune=attention_split_group=0 --cuda-tune=attention_split_ranges=16" "new:--profile"
  ctx=${LONGCTX_CONTEXT:-16384} batches=${LONGCTX_BATCH:-1,8,16}
  rows="^(${batches//,/|}) +[0-9]"
  for spec in "$@"; do
    label=${spec%%:*}
    for kv in auto fp8; do
      # shellcheck disable=SC2086  # the arguments split into words
      timeout 300 "$BIN/tandem" bench engine --device cuda:0 --model "${LONGCTX_MODEL:-preset:qwen3-4b}" \
        --batch "$batches" --decode-steps 32 --decode-prompt-tokens "$ctx" --prefill-tokens 512 \
        --kv-cache-dtype "$kv" ${spec#*:} > "$OUT/lc_${label}_$kv.log" 2>&1 || status=1
      note "$label $kv ctx $ctx: $(grep -E "$rows" "$OUT/lc_${label}_$kv.log" | tr -s ' ' | tr '\n' '|')"
      grep -E "Error|error" "$OUT/lc_${label}_$kv.log" | head -3 | while read -r l; do note "  $l"; done
      grep -E "^device time per forward by op: decode|^  (attention \(row|fused: q/k)" "$OUT/lc_${label}_$kv.log" \
        | sed "s/^/  $label $kv /" | tee -a "$OUT/summary.txt"
    done
  done
  exit $status
fi
if [ "$MODE" = fp8 ]; then
  timeout 200 "$BIN/cuda_kernels" --include-ignored --test-threads=1 --nocapture fp8_ gate_up_interleave \
    > "$OUT/fp8_kernels.log" 2>&1 && note "fp8 kernel tests: ok" \
    || { note "fp8 kernel tests: FAILED"; grep -B2 -A8 panicked "$OUT/fp8_kernels.log" | head -30 >> "$OUT/summary.txt"; status=1; }
  grep -E "^fp8" "$OUT/fp8_kernels.log" | while read -r l; do note "$l"; done
  timeout 300 "$BIN/cuda_model" --include-ignored --nocapture fp8_ > "$OUT/fp8_model.log" 2>&1 \
    && note "fp8 model tests: ok" \
    || { note "fp8 model tests: FAILED"; grep -B2 -A8 panicked "$OUT/fp8_model.log" | head -30 >> "$OUT/summary.txt"; status=1; }
  grep -E "step [0-9]" "$OUT/fp8_model.log" | while read -r l; do note "$l"; done
  specs=("bf16:prefill=8192" "fp8:prefill=8192 profile --quantization=fp8"
    "fp8_unfused:prefill=8192 --quantization=fp8 --cuda-tune=fp8_fused_decode=0"
    "fp8_copy:prefill=8192 --quantization=fp8 --cuda-tune=fp8_block_gemm=0")
  [ "${FP8_BENCH:-}" = quick ] && specs=("fp8:prefill=8192 profile --quantization=fp8")
  [ "${FP8_32B:-1}" = 0 ] || specs+=("fp8_32:prefill=8192 profile model=preset:qwen3-32b --quantization=fp8")
  [ "${FP8_32B:-1}" = 0 ] || [ "${FP8_BENCH:-}" = quick ] || specs+=("bf16_32:prefill=8192 model=preset:qwen3-32b")
  OUT="$OUT/matrix" SKIP_TESTS=1 "$0" matrix "${specs[@]}" > /dev/null 2>&1 || status=1
  grep -E "^==" "$OUT/matrix/summary.txt" | tee -a "$OUT/summary.txt"
  mv "$OUT/matrix/summary.txt" "$OUT/matrix/summary_matrix.txt"
  if [ "${FP8_KV:-1}" != 0 ]; then
    for kv in auto fp8; do
      timeout 300 "$BIN/tandem" bench engine --device cuda:0 --model preset:qwen3-4b --batch 1,8 --decode-steps 32 \
        --decode-prompt-tokens "${KV_CONTEXT:-32768}" --prefill-tokens 8192 --kv-cache-dtype "$kv" > "$OUT/kv_$kv.log" 2>&1 \
        || status=1
      note "kv $kv, context ${KV_CONTEXT:-32768}: $(grep -E '^(1|8) +[0-9]' "$OUT/kv_$kv.log" | tr -s ' ' | tr '\n' '|')$(grep -oE '^prefill [0-9]+ tokens: [0-9.]+ ms' "$OUT/kv_$kv.log")"
      grep -E "KV cache on the GPU|Error|error" "$OUT/kv_$kv.log" | head -3 | while read -r l; do note "  $l"; done
    done
    PD_KV_DTYPE=fp8 PD_SETTINGS="${FP8KV_PD_SETTINGS:-push_cuda-ipc_16_16,pull_tcp}" PD_LONG=2000 pd_check
  fi
  exit $status
fi
if [ "$MODE" = matrix ]; then
  # Decode step under several settings in one call: each further argument is
  # "label:SETTING SETTING ..." (see the top of this file).
  shift
  for t in cuda_kernels cuda_model; do
    [ -n "${SKIP_TESTS:-}" ] && break
    timeout 300 "$BIN/$t" --include-ignored --test-threads=1 > "$OUT/tests_$t.log" 2>&1 && note "test $t: ok" \
      || { note "test $t: FAILED"; grep -B2 -A6 "panicked" "$OUT/tests_$t.log" | head -30; status=1; }
  done
  for spec in "$@"; do
    label=${spec%%:*}
    exe=$BIN/tandem prompt=16 prefill=512 model=preset:qwen3-4b extra=()
    # shellcheck disable=SC2086  # the settings split into words
    for w in ${spec#*:}; do
      case $w in
        exe=*) exe=${w#exe=} ;; prompt=*) prompt=${w#prompt=} ;; prefill=*) prefill=${w#prefill=} ;;
        model=*) model=${w#model=} ;;
        profile) extra+=(--profile) ;; *) extra+=("$w") ;;
      esac
    done
    timeout 300 "$exe" bench engine --device cuda:0 --model "$model" --batch 1,64 \
      --decode-steps 64 --decode-prompt-tokens "$prompt" --prefill-tokens "$prefill" "${extra[@]}" \
      > "$OUT/matrix_$label.log" 2>&1
    note "$label: $(grep -E '^(1|64) +[0-9]' "$OUT/matrix_$label.log" | tr -s ' ' | tr '\n' '|')$(grep -oE '^prefill [0-9]+ tokens: [0-9.]+ ms' "$OUT/matrix_$label.log")"
    # Several prefill lengths (prefill=4096,16384,32768): each one's row, and with `profile`
    # each prefill attention's own rate.
    grep -E "^[0-9]{3,} +[0-9.]+ +[0-9]+ |attention's rate|^device time per forward by op: prefill" "$OUT/matrix_$label.log" \
      | sed "s/^/  $label /" | tee -a "$OUT/summary.txt"
    grep -E "^ *fused|plan sweep: down" "$OUT/matrix_$label.log" | grep -v pipelined | sed "s/^/  $label /"
  done
  exit $status
fi
# Nsight Compute on a batch-1 decode (the first NCU_COUNT launches of kernels matching
# NCU_KERNELS), summarised per kernel. Arguments: a label, then bench engine arguments.
ncu_decode() {
  local label=$1; shift
  local NCU; NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  [ -n "$NCU" ] || { note "no ncu on this machine"; return 2; }
  ( timeout 500 "$NCU" --clock-control none --graph-profiling node \
      -k "regex:${NCU_KERNELS:-gemv|attention}" --launch-count "${NCU_COUNT:-40}" \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
      --section LaunchStats --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' \
      --csv --page details --print-units base \
      "$BIN/tandem" bench engine --device cuda:0 --model preset:qwen3-4b --batch 1 --decode-steps 4 \
      --prefill-tokens 16 "$@" > "$OUT/ncu_$label.csv" 2> "$OUT/ncu_$label.err" ) \
    || { note "ncu $label failed"; tail -5 "$OUT/ncu_$label.err"; tail -5 "$OUT/ncu_$label.csv"; return 1; }
  note "ncu $label:"
  python3 scripts/gpu/ncu_table.py "$OUT/ncu_$label.csv" | tee -a "$OUT/summary.txt"
}
if [ "$MODE" = prefix ]; then
  # Issue 30 on this GPU: multi-turn TTFT by turn (colocated with and without prefix caching,
  # P/D, conditional P/D, 2P2D KV-aware against round-robin) and the bytes of a 90% prefix hit
  # (scripts/gpu/prefix_check.py; PREFIX_* narrow it).
  timeout 590 python3 scripts/gpu/prefix_check.py "$BIN/tandem" "$OUT" > "$OUT/prefix.log" 2>&1 || status=1
  tail -18 "$OUT/prefix.log" | tee -a "$OUT/summary.txt"
  exit $status
fi
# The seed's experiment on this GPU: push and pull and colocated, every engine on cuda:0,
# preset:qwen3-4b, KV over SWEEP_TRANSPORT (default cuda-ipc); figures and summary.csv in
# $OUT/sweep (copy them to docs/figures/gpu). SWEEP_DECODE_DEVICE=cuda:1 on the two-GPU machine:
# prefill on one GPU, decode on the other.
# SWEEP_KV_BLOCKS sizes every engine's cache (default 4096 blocks: three engines fit one GPU;
# the modes run one at a time, so two engines of 8192 fit too). SWEEP_MPS=1 runs the engines
# under CUDA MPS (a daemon of this call's own, stopped at the end): prefill's and decode's
# kernels then share the GPU's SMs at once instead of taking turns in time slices, which is
# nearer two GPUs' behaviour under load.
sweep() {
  local mps_dir=""
  if [ -n "${SWEEP_MPS:-}" ]; then
    mps_dir=/tmp/tandem-mps
    mkdir -p "$mps_dir/pipe" "$mps_dir/log"
    export CUDA_MPS_PIPE_DIRECTORY=$mps_dir/pipe CUDA_MPS_LOG_DIRECTORY=$mps_dir/log
    if nvidia-cuda-mps-control -d; then note "sweep under CUDA MPS"; else note "CUDA MPS did not start: sweeping without it"; mps_dir=""; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; fi
  fi
  timeout "${SWEEP_SECS:-590}" "$BIN/tandem" bench sweep --launch --model "${SWEEP_MODEL:-preset:qwen3-4b}" --modes "${SWEEP_MODES:-push,pull,colocated}" \
    --prefill-device cuda:0 --decode-device "${SWEEP_DECODE_DEVICE:-cuda:0}" --colocated-device cuda:0 --num-kv-blocks "${SWEEP_KV_BLOCKS:-4096}" \
    --engine-arg="--kv-transport=${SWEEP_TRANSPORT:-cuda-ipc}" ${SWEEP_ENGINE_ARGS:-} --input-lens "${SWEEP_INPUTS:-1024,4096,8192}" --qps "${SWEEP_QPS:-1,2,4,8}" \
    --output-len 64 --num-prompts "${SWEEP_PROMPTS:-16}" --vocab-size 100000 --result-dir "$OUT/${SWEEP_DIR:-sweep}" --plot > "$OUT/${SWEEP_DIR:-sweep}.log" 2>&1 \
    || { note "sweep failed"; tail -20 "$OUT/${SWEEP_DIR:-sweep}.log"; status=1; }
  if [ -n "$mps_dir" ]; then
    echo quit | nvidia-cuda-mps-control; cp "$mps_dir/log/control.log" "$OUT/${SWEEP_DIR:-sweep}_mps.log" 2>/dev/null
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  fi
  tail -40 "$OUT/${SWEEP_DIR:-sweep}.log"
  # The table: median TTFT and TPOT per point, and for the disaggregated modes the median KV
  # transfer and prefill hand-over -> KV applied at decode (push), with the transfer's share.
  python3 - "$OUT/${SWEEP_DIR:-sweep}/summary.csv" <<'PY' | tee -a "$OUT/summary.txt"
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
print(f"{'mode':>9} {'in':>5} {'qps':>4} {'TTFT ms':>8} {'TPOT ms':>8} {'KV ms':>7} {'KV/TTFT':>7} {'handover->ready ms':>18} {'of it backlog':>13}")
for r in rows:
    kv, h = r.get("median_kv_transfer_ms") or "", r.get("median_produced_to_ready_ms") or ""
    b = r.get("median_handover_backlog_ms") or ""
    share = f"{100 * float(kv) / float(r['median_ttft_ms']):.2f}%" if kv else ""
    print(f"{r['mode']:>9} {r['input_len']:>5} {r['qps']:>4} {float(r['median_ttft_ms']):8.1f} {float(r['median_tpot_ms']):8.2f} {kv:>7} {share:>7} {h:>18} {b:>13}")
PY
}
# Issue 31 on this GPU (BIN=gpu-nixl, from `NIXL=1 scripts/gpu/build.sh`): NIXL between two
# processes' GPU caches (VRAM registered) beside cuda-ipc into the same peer cache (`bench kv
# --transport nixl --device cuda:0`, whose peer checks what landed), then P/D push and pull over
# NIXL (and push over cuda-ipc, to compare) against colocated with every engine
# --batch-invariant, then push and pull of the sweep over NIXL (SKIP_SWEEP=1 leaves it out);
# SLICED_TEST=1 also runs the sliced batch-invariant product test.
if [ "$MODE" = nixl ]; then
  rt=/tmp/nixl-rt
  mkdir -p "$rt" && tar xJf "$BIN/nixl-runtime.tar.xz" -C "$rt" || { note "no NIXL runtime in $BIN"; exit 2; }
  export LD_LIBRARY_PATH="$rt/lib:$LD_LIBRARY_PATH" NIXL_PLUGIN_DIR="$rt/plugins"
  # NIXL_UCX="label:UCX_SETTING ..." runs the benchmark once per label (default: UCX as it is).
  for spec in ${NIXL_UCX:-default:}; do
    [ -n "${SKIP_KV:-}" ] && break
    label=${spec%%:*} settings=${spec#*:}
    # shellcheck disable=SC2086  # the settings split into words
    env UCX_LOG_LEVEL=info ${settings//,/ } timeout 300 "$BIN/tandem" bench kv --transport nixl --device cuda:0 \
      --sizes "${NIXL_SIZES:-1MiB,16MiB,64MiB,256MiB,1GiB}" --json-out "$OUT/kv_nixl_$label.json" \
      > "$OUT/kv_nixl_$label.log" 2>&1 \
      && note "bench kv nixl beside cuda-ipc (one GPU, two processes), UCX $label ($settings):" \
      || { note "bench kv nixl $label: FAILED"; tail -4 "$OUT/kv_nixl_$label.log" >> "$OUT/summary.txt"; status=1; }
    grep -A8 "^cuda-ipc into" "$OUT/kv_nixl_$label.log" | tee -a "$OUT/summary.txt"
    # UCX's own account of the transports each endpoint uses (its info log's cfg lines).
    grep -oE "intra-node cfg.{0,200}" "$OUT/kv_nixl_$label.log" | sort | uniq -c | head -4 | tee -a "$OUT/summary.txt"
  done
  if [ -z "${SKIP_PD:-}" ]; then
    # NIXL_PD_UCX: UCX settings for the engines of this check only.
    # shellcheck disable=SC2086
    ( [ -n "${NIXL_PD_UCX:-}" ] && export ${NIXL_PD_UCX//,/ }
      PD_NIXL=1 PD_SETTINGS="${NIXL_PD_SETTINGS:-nixl,push_cuda-ipc_16_16}" PD_BATCH_INVARIANT=1 PD_LONG=2000 pd_check ) \
      || status=1
  fi
  if [ -n "${SLICED_TEST:-}" ]; then
    timeout 200 "$BIN/cuda_kernels" --include-ignored --test-threads=1 --nocapture sliced_invariant \
      > "$OUT/sliced_kernels.log" 2>&1 && note "sliced invariant kernel test: ok" \
      || { note "sliced invariant kernel test: FAILED"; grep -A8 panicked "$OUT/sliced_kernels.log" | head -12 >> "$OUT/summary.txt"; status=1; }
    grep -E "^sliced " "$OUT/sliced_kernels.log" | while read -r l; do note "$l"; done
  fi
  # The sweep over NIXL (push and pull; NIXL_SWEEP_INPUTS, NIXL_SWEEP_QPS), against the
  # cuda-ipc sweep in docs/PERFORMANCE.md.
  if [ -z "${SKIP_SWEEP:-}" ]; then
    # shellcheck disable=SC2086
    [ -n "${NIXL_SWEEP_UCX:-}" ] && export ${NIXL_SWEEP_UCX//,/ }
    SWEEP_TRANSPORT=nixl SWEEP_MODES="${NIXL_SWEEP_MODES:-push,pull}" SWEEP_INPUTS="${NIXL_SWEEP_INPUTS:-4096}" \
      SWEEP_QPS="${NIXL_SWEEP_QPS:-1,8}" SWEEP_SECS=300 sweep
  fi
  cat "$OUT/summary.txt"; exit $status
fi
if [ "$MODE" = pd ]; then
  pd_check; cat "$OUT/summary.txt"; exit $status
fi
# Batch-invariant serving: the kernels' invariance tests, the engine's (requests alone against
# 24 and 64 at a time, chunked and whole prompts, greedy and seeded), P/D push and pull over
# cuda-ipc with every engine --batch-invariant (the burst must equal colocated one at a time),
# then the flag's cost: bench engine on qwen3-4b with and without it.
if [ "$MODE" = invariant ]; then
  if [ -z "${SKIP_TESTS:-}" ]; then
    timeout 240 "$BIN/cuda_kernels" --include-ignored --test-threads=1 --nocapture packed_attention invariant_matmul \
      sliced_invariant skinny_norm skinny_wg ${SKINNY_TEST:+skinny_invariant} attention_kernels > "$OUT/inv_kernels.log" 2>&1 \
      && note "invariant kernel tests: ok" \
      || { note "invariant kernel tests: FAILED"; grep -B2 -A8 panicked "$OUT/inv_kernels.log" | head -30 >> "$OUT/summary.txt"; status=1; }
    grep -E "cuBLAS.s default|^skinny |^sliced " "$OUT/inv_kernels.log" | while read -r l; do note "$l"; done
    timeout 300 "$BIN/cuda_engine" --include-ignored --nocapture batch_invariant > "$OUT/inv_engine.log" 2>&1 \
      && note "batch-invariant engine test: ok" \
      || { note "batch-invariant engine test: FAILED"; grep -B2 -A8 panicked "$OUT/inv_engine.log" | head -20 >> "$OUT/summary.txt"; status=1; }
    grep -E "without --batch-invariant|preemptions" "$OUT/inv_engine.log" | while read -r l; do note "$l"; done
  fi
  if [ -z "${SKIP_PD:-}" ]; then
    PD_BATCH_INVARIANT=1 PD_SETTINGS=cuda-ipc_16 PD_LONG=2000 pd_check
  fi
  # Then (INV_BENCH, default all of these) wgmma: the invariant build with its attention on
  # Hopper's warpgroup MMAs (invariant_wgmma=1; wgmma-wide: decode tokens in its 128-row items
  # too, invariant_narrow=0; wgmma-shared: its range sums in shared memory and two stages,
  # invariant_fold_l2=0); the o and down products cut into K
  # slices of at most 1280 and 2560 columns (--cuda-tune invariant_slice_cols), at the short
  # context, on skinny kernels of 8 and of 2 stages (more blocks an SM); skinny2|4|8: wgmma
  # with the few-row products on the skinny kernels of that many stages (short context); fused:
  # wgmma with the norms of few-token steps inside the products and their other products on
  # the same chains (fusedSxG: that norm build; fusedwgS: the others with S stages).
  for flag in ${INV_BENCH:-default --batch-invariant wgmma slices1280 slices2560 slices1280s2 slices2560s2}; do
    [ -n "${SKIP_BENCH:-}" ] && break
    for ctx in 16 1024; do
      args=()
      case $flag in
        --batch-invariant) args=("$flag") ;;
        wgmma) args=(--batch-invariant --cuda-tune=invariant_wgmma=1) ;;
        wgmma-wide) args=(--batch-invariant --cuda-tune=invariant_wgmma=1 --cuda-tune=invariant_narrow=0) ;;
        wgmma-shared) args=(--batch-invariant --cuda-tune=invariant_wgmma=1 --cuda-tune=invariant_fold_l2=0) ;;
        fused) args=(--batch-invariant --cuda-tune=invariant_wgmma=1 --cuda-tune=invariant_fused_norm=1) ;;
        fusedwg*) [ "$ctx" = 16 ] || continue
          args=(--batch-invariant --cuda-tune=invariant_wgmma=1 --cuda-tune=invariant_fused_norm=1
            "--cuda-tune=wg_product_stages=${flag#fusedwg}") ;;
        fused[0-9]x[0-9]) [ "$ctx" = 16 ] || continue
          args=(--batch-invariant --cuda-tune=invariant_wgmma=1 --cuda-tune=invariant_fused_norm=1
            "--cuda-tune=fused_norm_build=${flag#fused}") ;;
        skinny[248]) [ "$ctx" = 16 ] || continue
          args=(--batch-invariant --cuda-tune=invariant_wgmma=1 --cuda-tune=invariant_skinny=1
            "--cuda-tune=skinny_stages=${flag#skinny}") ;;
        slices*s2) [ "$ctx" = 16 ] || continue; cols=${flag#slices}
          args=(--batch-invariant "--cuda-tune=invariant_slice_cols=${cols%s2}" --cuda-tune=skinny_stages=2) ;;
        slices*) [ "$ctx" = 16 ] || continue
          args=(--batch-invariant "--cuda-tune=invariant_slice_cols=${flag#slices}") ;;
      esac
      # Where each step's time goes (per op).
      args+=(--profile)
      log="$OUT/inv_bench_${flag#--}_$ctx.log"
      timeout 300 "$BIN/tandem" bench engine --device cuda:0 --model preset:qwen3-4b --batch 1,64 --decode-steps 32 \
        --decode-prompt-tokens "$ctx" --prefill-tokens 4096 "${args[@]}" > "$log" 2>&1 \
        && note "$flag, context $ctx: $(grep -E '^(1|64) +[0-9]' "$log" | tr -s ' ' | tr '\n' '|')$(grep -oE 'prefill [0-9]+ tokens: [0-9.]+ ms' "$log" | head -1)" \
        || { note "bench engine $flag context $ctx failed"; tail -8 "$log" >> "$OUT/summary.txt"; status=1; }
    done
  done
  cat "$OUT/summary.txt"; exit $status
fi
# One `tandem serve` on preset:qwen3-4b (cuda:0) with the further arguments, then `tandem bench
# serve` against it: SERVE_PROMPTS (200) prompts of SERVE_IN (1024) random tokens at SERVE_RATE
# (8) req/s, SERVE_OUT (128) out; a line of its medians in the summary.
serve_bench() {  # label, then serve arguments
  local label=$1; shift
  local prompts=${SERVE_PROMPTS:-200} rate=${SERVE_RATE:-8} len=${SERVE_IN:-1024} out=${SERVE_OUT:-128}
  "$BIN/tandem" serve --device cuda:0 --model preset:qwen3-4b --port 18500 \
    --max-model-len "$(( len + out > 4096 ? len + out : 4096 ))" "$@" > "$OUT/serve_$label.log" 2>&1 &
  local pid=$!
  for _ in $(seq 240); do
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:18500/health', timeout=1)" \
      2>/dev/null && break
    sleep 0.5
  done
  timeout 240 "$BIN/tandem" bench serve --base-url http://127.0.0.1:18500 --num-prompts "$prompts" \
    --request-rate "$rate" --random-input-len "$len" --random-output-len "$out" --seed 1 --no-progress \
    --save-result --result-dir "$OUT" --result-filename "serve_$label.json" > "$OUT/bench_serve_$label.log" 2>&1 \
    || { note "bench serve $label failed"; tail -5 "$OUT/bench_serve_$label.log" >> "$OUT/summary.txt"; status=1; }
  kill "$pid"; wait "$pid" 2>/dev/null
  python3 - "$OUT/serve_$label.json" "$label" "$prompts" "$len" "$rate" "$out" >> "$OUT/summary.txt" <<'PY'
import json, sys
label, prompts, length, rate, out = sys.argv[2:]
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    print(f"== serve {label}: no result ({e})"); sys.exit(0)
print(f"== serve {label}: {prompts} prompts of {length} tokens at {rate} req/s, {out} out: TTFT median "
      f"{r['median_ttft_ms']:.1f} p99 {r['p99_ttft_ms']:.1f} ms, TPOT median {r['median_tpot_ms']:.2f} p99 "
      f"{r['p99_tpot_ms']:.2f} ms, E2EL median {r['median_e2el_ms']:.0f} ms, output {r['output_throughput']:.0f} tok/s")
PY
}
# Issue 50's end-to-end row: colocated TTFT of long prompts (SERVE_IN, default 16384; 16 at 1
# req/s, 64 out) with the Hopper prefill attention (the default) and with the mma.sync kernel
# of other GPUs (--cuda-tune wgmma_prefill=0), one engine at a time.
if [ "$MODE" = serve-long ]; then
  export SERVE_IN=${SERVE_IN:-16384} SERVE_PROMPTS=${SERVE_PROMPTS:-16} SERVE_RATE=${SERVE_RATE:-1} SERVE_OUT=${SERVE_OUT:-64}
  serve_bench hopper
  serve_bench mma --cuda-tune wgmma_prefill=0
  cat "$OUT/summary.txt"; exit $status
fi
# End to end with and without --batch-invariant (`tandem bench serve` against one engine on
# preset:qwen3-4b), then the reliability soak on the GPU with it (push and pull: freezes,
# cancellations, a small KV pool, every answer against the reference engine's).
if [ "$MODE" = invariant-serve ]; then
  if [ -n "${ENGINE_TEST:-}" ]; then
    timeout 300 "$BIN/cuda_engine" --include-ignored --nocapture batch_invariant > "$OUT/inv_engine.log" 2>&1 \
      && note "batch-invariant engine test: ok" \
      || { note "batch-invariant engine test: FAILED"; grep -B2 -A8 panicked "$OUT/inv_engine.log" | head -20 >> "$OUT/summary.txt"; status=1; }
    grep -E "without --batch-invariant|preemptions" "$OUT/inv_engine.log" | while read -r l; do note "$l"; done
  fi
  serve_bench default
  serve_bench invariant --batch-invariant
  timeout 330 "$BIN/tandem" bench soak --device cuda:0 --batch-invariant --model preset:qwen3-0.6b \
    --secs "${SOAK_SECS:-60}" --freeze-every-secs 20 --json-out "$OUT/soak_gpu.json" > "$OUT/soak_gpu.log" 2>&1 \
    && note "GPU soak with --batch-invariant: passed" || { note "GPU soak with --batch-invariant: FAILED"; status=1; }
  grep -E "^(push|pull): " "$OUT/soak_gpu.log" | while read -r l; do note "$l"; done
  cat "$OUT/summary.txt"; exit $status
fi
if [ "$MODE" = faults ]; then
  # Issue 28's faults 1-4 on the GPU path: push and pull over cuda-ipc with every engine
  # --batch-invariant and --kv-verify, each answer against the reference engine's bit for bit
  # (so a mismatch is a KV fault, not batching), blocks back to baseline, both engines serving
  # after. 1: late writes into blocks decode gave up (cancellations while every write waits
  # 200 ms); 2: a peer that stops mid-transfer (SIGSTOP past the liveness bound); 3: reads
  # after the lease expired (decode frozen past a 0.5 s lease); 4: completions never reported
  # (prefill drops Done, 1 s transfer timeout); and KV corrupted in the direct copy (caught by
  # the digest). Further arguments pick variants by label; FAULT_SECS per mode (default 10).
  shift
  specs=("late-writes:--freeze-every-secs 0 --cancel-fraction 0.3 --engine-arg=--fault-slow-write-ms=200"
         "frozen-peer:--freeze-every-secs 6"
         "expired-lease:--freeze-every-secs 5 --cancel-fraction 0 --engine-arg=--kv-lease-secs=0.5"
         "dropped-done:--freeze-every-secs 0 --engine-arg=--fault-drop-done --engine-arg=--kv-transfer-timeout-secs=1"
         "corrupt:--freeze-every-secs 0 --engine-arg=--fault-corrupt-sends")
  for spec in "${specs[@]}"; do
    label=${spec%%:*}
    if [ $# -gt 0 ] && [[ " $* " != *" $label "* ]]; then continue; fi
    # shellcheck disable=SC2086  # the arguments split into words
    timeout 280 "$BIN/tandem" bench soak --device cuda:0 --batch-invariant --model preset:qwen3-0.6b \
      --modes push,pull --secs "${FAULT_SECS:-10}" --engine-log warn --engine-arg=--kv-transport=cuda-ipc ${spec#*:} \
      --json-out "$OUT/fault_$label.json" > "$OUT/fault_$label.log" 2>&1 \
      && note "fault $label: passed" || { note "fault $label: FAILED"; status=1; }
    grep -E "^(push|pull): |^    (wrong|lost|error): " "$OUT/fault_$label.log" | head -8 \
      | sed 's/; p50.*KV transfers/; KV/' | while read -r l; do note "  $l"; done
  done
  cat "$OUT/summary.txt"; exit $status
fi
if [ "$MODE" = soak ]; then
  # The GPU soak (push only unless SOAK_MODES) under each variant: every further argument is
  # "label:ARG ..." with `tandem bench soak` arguments, e.g. "tcp:--engine-arg=--kv-transport=tcp"
  # or "calm:--freeze-every-secs 0 --cancel-fraction 0"; SOAK_SECS per variant (default 30).
  shift
  for spec in "$@"; do
    label=${spec%%:*}
    # shellcheck disable=SC2086  # the arguments split into words
    timeout 300 "$BIN/tandem" bench soak --device cuda:0 --batch-invariant --model preset:qwen3-0.6b \
      --modes "${SOAK_MODES:-push}" --secs "${SOAK_SECS:-30}" --engine-log warn ${spec#*:} \
      --json-out "$OUT/soak_$label.json" > "$OUT/soak_$label.log" 2>&1 \
      && note "soak $label: passed" || { note "soak $label: FAILED"; status=1; }
    grep -E "^(push|pull): |^    (wrong|lost): " "$OUT/soak_$label.log" | head -12 | while read -r l; do note "  $l"; done
  done
  cat "$OUT/summary.txt"; exit $status
fi
# The cuda-ipc transport's copies into another process's GPU cache, against the same copies
# inside one GPU measured in the same run; same block size, then 16 -> 32 tokens a block.
kv_bench() {  # [EXE [TAG]]: another tandem binary (gpu-bin/tandem-base), its results tagged
  local exe=${1:-$BIN/tandem} suffix=${2:+_$2}
  # With two GPUs, also into a peer process on the second one (over NVLink).
  peers=(cuda:0); [ "$(nvidia-smi -L | wc -l)" -ge 2 ] && peers+=(cuda:1)
  for peer in "${peers[@]}"; do
    for pbs in 16 32; do
      tag="${peer#cuda:}_$pbs$suffix"
      timeout 150 "$exe" bench kv --transport cuda-ipc --device cuda:0 --peer-device "$peer" \
        --peer-block-size "$pbs" --json-out "$OUT/bench_kv_ipc_$tag.json" > "$OUT/bench_kv_ipc_$tag.log" 2>&1 \
        || { note "bench kv cuda-ipc (peer $peer, blocks $pbs${2:+, $2}) failed"; tail -5 "$OUT/bench_kv_ipc_$tag.log"; status=1; }
      while read -r line; do note "${2:+$2: }$line"; done < <(grep -v '^\.\.\.' "$OUT/bench_kv_ipc_$tag.log")
    done
  done
}
# The tcp transport between two GPU engines' caches (device -> host copy -> loopback TCP -> host
# copy -> device, the copies overlapping the socket piece by piece), against raw loopback TCP
# and the same transfer with the copies not overlapped, measured in the same run; then the
# host-memory transport as before.
tcp_bench() {  # [EXE [TAG]] as kv_bench; TCP_STREAMS (default "1 4"): streams, each a run
  local exe=${1:-$BIN/tandem} suffix=${2:+_$2}
  for size in ${TCP_SIZES:-64MiB 256MiB 1GiB}; do
    for n in ${TCP_STREAMS:-1 4}; do
      # One stream passes no flag, so that a build from before --tcp-streams runs too.
      local tag=${size}_s$n$suffix streams=(); [ "$n" = 1 ] || streams=(--tcp-streams "$n")
      [ -z "${TCP_TLS:-}" ] || { streams+=(--tls); tag=${tag}_tls; }
      [ -z "${TCP_SPLIT:-}" ] || { streams+=(--split-cpus); tag=${tag}_split; }
      timeout 120 "$exe" bench kv --transport tcp --device cuda:0 --size "$size" "${streams[@]}" \
        --json-out "$OUT/bench_kv_tcp_gpu_$tag.json" > "$OUT/bench_kv_tcp_gpu_$tag.log" 2>&1 \
        || { note "bench kv tcp --device cuda:0 --size $size, $n streams${2:+ ($2)} failed"; tail -5 "$OUT/bench_kv_tcp_gpu_$tag.log"; status=1; }
      while read -r line; do note "${2:+$2: }$line"; done < <(grep -v '^\.\.\.' "$OUT/bench_kv_tcp_gpu_$tag.log")
    done
  done
  # TCP_TLS=1: every run over TLS, against raw TCP and the plain transport in the same run.
  # TCP_TLS_PIPES="on off": each host run with the connections' TLS threads and without.
  for n in ${TCP_TLS:+${TCP_STREAMS:-1 4}}; do
    for pipes in ${TCP_TLS_PIPES:-auto}; do
      local log=$OUT/bench_kv_tls_host_s${n}_$pipes$suffix.log
      timeout 120 "$exe" bench kv --transport tcp --size 256MiB --tls --tls-pipes "$pipes" --tcp-streams "$n" \
        ${TCP_SPLIT:+--split-cpus} > "$log" 2>&1 \
        || { note "bench kv tcp --tls (host memory, $n streams, pipes $pipes) failed"; status=1; }
      while read -r line; do note "tls host s$n pipes $pipes: $line"; done < <(grep -v '^\.\.\.' "$log")
    done
  done
  timeout 120 "$exe" bench kv --transport tcp --size 256MiB > "$OUT/bench_kv_tcp_host$suffix.log" 2>&1 \
    || { note "bench kv tcp (host memory${2:+, $2}) failed"; status=1; }
  while read -r line; do note "${2:+$2: }$line"; done < <(grep -v '^\.\.\.' "$OUT/bench_kv_tcp_host$suffix.log")
}
if [ "$MODE" = tcp ]; then
  tcp_bench; cat "$OUT/summary.txt"; exit $status
fi
# kv-fp8: issue 51's FP8 KV transfer target: the KV of KV_TOKENS (16384) tokens of Qwen3-4B's
# shape between two GPU caches over tcp, bf16 then FP8 in one run, over each of TCP_STREAMS.
kv_fp8() {
  for n in ${TCP_STREAMS:-1 8}; do
    local log=$OUT/bench_kv_fp8_s$n.log
    timeout 180 "$BIN/tandem" bench kv --transport tcp --device cuda:0 --tokens "${KV_TOKENS:-16384}" \
      --kv-cache-dtype auto,fp8 --tcp-streams "$n" --json-out "$OUT/bench_kv_fp8_s$n.json" > "$log" 2>&1 \
      || { note "bench kv --kv-cache-dtype auto,fp8 ($n streams) failed"; tail -5 "$log"; status=1; }
    while read -r line; do note "kv fp8 s$n: $line"; done < <(grep -E '^(KV set|tcp KV|transport|fp8)' "$log")
  done
}
if [ "$MODE" = kv-fp8 ]; then
  kv_fp8; cat "$OUT/summary.txt"; exit $status
fi
# A change measured against the build before it in one call (issue 47: a restructuring must not
# move the numbers): P/D answers with the new build, then the cuda-ipc and tcp transports'
# benchmarks for gpu-bin/tandem-base (BASELINE=<rev> scripts/gpu/build.sh) and the new build,
# alternating, AB_ROUNDS times (default 1; AB_SKIP_PD=1 leaves P/D out).
if [ "$MODE" = ab ]; then
  [ -x "$BIN/tandem-base" ] || { echo "no $BIN/tandem-base: BASELINE=<rev> scripts/gpu/build.sh"; exit 2; }
  [ -n "${AB_SKIP_PD:-}" ] || pd_check
  for round in $(seq 1 "${AB_ROUNDS:-1}"); do
    for who in base new; do
      exe=$BIN/tandem; [ "$who" = base ] && exe=$BIN/tandem-base
      kv_bench "$exe" "$who$round"
      tcp_bench "$exe" "$who$round"
    done
  done
  cat "$OUT/summary.txt"; exit $status
fi
run_test() {  # TEST_BINARY [NAME_FILTER]; TEST_TIMEOUT seconds each (420: cuda_model takes ~360; cuda_engine's
  # batch-invariance test alone takes longer: TEST_TIMEOUT=560 run.sh tests cuda_engine)
  if timeout "${TEST_TIMEOUT:-420}" "$BIN/$1" --include-ignored --test-threads=1 --nocapture ${2:-} > "/tmp/test_$1.log" 2>&1; then
    note "test $1: ok"
  else
    note "test $1: FAILED"; status=1
    grep -B2 -A6 "panicked" "/tmp/test_$1.log" | head -30 >> "$OUT/summary.txt"
  fi
  cat "/tmp/test_$1.log" >> "$OUT/tests.log"
}
if [ "$MODE" = ipc ]; then
  # KV GPU to GPU: kernel and engine tests, P/D over tcp and cuda-ipc, the transport's bandwidth.
  # KERNEL_TESTS=NAME runs only the kernel tests matching NAME.
  [ -n "${SKIP_KERNEL_TESTS:-}" ] || run_test cuda_kernels "${KERNEL_TESTS:-}"
  run_test cuda_engine
  run_test kv_transport  # each KV transport alone: cuda-ipc into another process
  pd_check
  kv_bench
  [ -n "${SKIP_TCP:-}" ] || tcp_bench
  cat "$OUT/summary.txt"; exit $status
fi
# fp8-skinny: issue 51's steps of 17-64 rows on the skinny FP8 product (--cuda-tune fp8_skinny):
# its kernel test (timed beside cuBLASLt on Qwen3-32B's shapes; SKIP_TESTS=1 skips it), then bench
# engine on FP8_MODEL (preset:qwen3-32b) at SKINNY_BATCHES (24,64) in bf16, in FP8 on cuBLASLt and
# in FP8 on each skinny build (1 e4m3 mma.sync, 2 warpgroup MMAs), in the same call (the issue's
# ratios; SKINNY_RUNS picks among bf16,fp8,fp8_mma,fp8_wg,fp8_wg3); SKINNY_PROFILE=1 adds where batch 64 spends its time on build SKINNY_BUILD (2; with a
# prefill of 8192, whose cache holds the 64 sequences: 256 tokens' does not).
if [ "$MODE" = fp8-skinny ]; then
  if [ -z "${SKIP_TESTS:-}" ]; then
    run_test cuda_kernels fp8_skinny
    grep -E "^fp8 skinny" /tmp/test_cuda_kernels.log | tee -a "$OUT/summary.txt"
  fi
  for run in "bf16:" "fp8:--quantization fp8" "fp8_mma:--quantization fp8 --cuda-tune fp8_skinny=1" \
    "fp8_wg:--quantization fp8 --cuda-tune fp8_skinny=2" \
    "fp8_wg3:--quantization fp8 --cuda-tune fp8_skinny=3"; do
    label=${run%%:*}
    case ",${SKINNY_RUNS:-bf16,fp8,fp8_mma,fp8_wg,fp8_wg3}," in *",$label,"*) ;; *) continue ;; esac
    # shellcheck disable=SC2086  # the arguments split into words
    timeout 300 "$BIN/tandem" bench engine --device cuda:0 --model "${FP8_MODEL:-preset:qwen3-32b}" ${run#*:} \
      --batch "${SKINNY_BATCHES:-24,64}" --decode-steps 16 --prefill-tokens 256 > "$OUT/skinny_$label.log" 2>&1 || status=1
    note "$label: $(grep -E '^[0-9]+ +[0-9]' "$OUT/skinny_$label.log" | tr -s ' ' | tr '\n' '|')"
  done
  if [ -n "${SKINNY_PROFILE:-}" ]; then
    timeout 300 "$BIN/tandem" bench engine --device cuda:0 --model "${FP8_MODEL:-preset:qwen3-32b}" --quantization fp8 \
      --cuda-tune "fp8_skinny=${SKINNY_BUILD:-2}" --batch 64 --decode-steps 16 --prefill-tokens 8192 --profile \
      > "$OUT/skinny_profile.log" 2>&1 || status=1
    grep -A18 "decode, batch 64" "$OUT/skinny_profile.log" | tee -a "$OUT/summary.txt"
  fi
  exit $status
fi
if [ "$MODE" = fp8-builds ]; then
  # fp8-builds [BUILD ...]: the FP8 weights' fused decode projection builds (--cuda-tune
  # fp8_gemv_build): the kernel test (every build against the reference, one row's time on
  # Qwen3-4B's and Qwen3-32B's products; cuBLASLt's block-scaled candidates, fp8_gemm_algo, timed
  # on Qwen3-32B's; the fused rounding kernels; FP8_KERNEL_TESTS names others), then bench engine
  # on FP8_MODEL (preset:qwen3-32b) at batch 1 and 8 under each build (default 0 1 2 3;
  # SKIP_TESTS=1 skips the tests; FP8_PROFILE=1 first profiles batch 64 and a prefill of 8192
  # under each of FP8_PROFILE_TUNES (default: the defaults, then fp8_fused_act and _norm 0);
  # FP8_BF16=1 adds the bf16 model's batch 1 / 64 and prefill in the same call).
  shift
  if [ -z "${SKIP_TESTS:-}" ]; then
    TEST_TIMEOUT=${TEST_TIMEOUT:-400} run_test cuda_kernels "${FP8_KERNEL_TESTS:-fp8_decode_projections fp8_block_gemm_candidates silu_mul_rounded add_rms_norm_rounded}"
    grep -E "^fp8 (fused|build|gemm)|shapes checked" /tmp/test_cuda_kernels.log | tee -a "$OUT/summary.txt"
  fi
  # FP8_PROFILE=1: where batch 64 and a prefill of 8192 spend their time under each of
  # FP8_PROFILE_TUNES (each a comma-separated list of --cuda-tune KEY=VALUE; default: the
  # defaults, then SiLU and the norms rounding their outputs to FP8 in kernels of their own).
  if [ -n "${FP8_PROFILE:-}" ]; then
    for tunes in ${FP8_PROFILE_TUNES:-fp8_fused_act=1 fp8_fused_act=0,fp8_fused_norm=0}; do
      local_args=(); for kv in ${tunes//,/ }; do local_args+=(--cuda-tune "$kv"); done
      log=$OUT/fp8_profile_${tunes//[=,]/_}.log
      timeout 300 "$BIN/tandem" bench engine --device cuda:0 --model "${FP8_MODEL:-preset:qwen3-32b}" --quantization fp8 \
        --batch 64 --decode-steps 16 --prefill-tokens 8192 --profile "${local_args[@]}" > "$log" 2>&1 || status=1
      note "fp8 profile, $tunes: $(grep -E '^64 +[0-9]' "$log" | tr -s ' ')$(grep -oE '^prefill [0-9]+ tokens: [0-9.]+ ms' "$log")"
    done
  fi
  # FP8_BF16=1: the bf16 model's batch 1 and 64 steps and prefill of 8192 in the same call, for
  # the issue's ratios from one run.
  if [ -n "${FP8_BF16:-}" ]; then
    timeout 300 "$BIN/tandem" bench engine --device cuda:0 --model "${FP8_MODEL:-preset:qwen3-32b}" \
      --batch 1,64 --decode-steps 16 --prefill-tokens 8192 > "$OUT/bf16_baseline.log" 2>&1 || status=1
    note "bf16 baseline: $(grep -E '^(1|64) +[0-9]' "$OUT/bf16_baseline.log" | tr -s ' ' | tr '\n' '|')$(grep -oE '^prefill [0-9]+ tokens: [0-9.]+ ms' "$OUT/bf16_baseline.log")"
  fi
  for b in "${@:-0 1 2 3}"; do
    for build in $b; do
      timeout 300 "$BIN/tandem" bench engine --device cuda:0 --model "${FP8_MODEL:-preset:qwen3-32b}" --quantization fp8 \
        --batch 1,8 --decode-steps 32 --prefill-tokens 256 --cuda-tune "fp8_gemv_build=$build" \
        > "$OUT/fp8_build$build.log" 2>&1 || status=1
      note "fp8 build $build: $(grep -E '^(1|8) +[0-9]' "$OUT/fp8_build$build.log" | tr -s ' ' | tr '\n' '|')"
      grep -E "Error|error" "$OUT/fp8_build$build.log" | head -3 | while read -r l; do note "  $l"; done
    done
  done
  exit $status
fi
if [ "$MODE" = tests ]; then
  # tests [BINARY ...]: only those GPU test binaries (default cuda_model cuda_engine); TEST_FILTER
  # keeps the tests whose names contain it (`TEST_FILTER=moe run.sh tests cuda_kernels`).
  shift
  for t in "${@:-cuda_model cuda_engine}"; do for b in $t; do run_test "$b" "${TEST_FILTER:-}"; done; done
  cat "$OUT/summary.txt"; exit $status
fi
if [ "$MODE" = sweep ]; then
  sweep
  exit $status
fi
# Issue 51's seed model disaggregated on one H200 (needs_h200): qwen3-32b with FP8 weights and
# FP8 KV caches as prefill, decode and router on cuda:0 beside a colocated engine, 4k / 8k / 16k
# prompts at 1 / 2 / 4 req/s, KV over SWEEP_TRANSPORT (cuda-ipc; run again with tcp), 8
# requests a point, 8192 blocks (four 16k prompts and their answers) an engine.
if [ "$MODE" = seed ]; then
  SWEEP_MODEL=preset:qwen3-32b SWEEP_INPUTS=${SWEEP_INPUTS:-4096,8192,16384} SWEEP_QPS=${SWEEP_QPS:-1,2,4} \
    SWEEP_PROMPTS=${SWEEP_PROMPTS:-8} SWEEP_KV_BLOCKS=${SWEEP_KV_BLOCKS:-8192} SWEEP_DIR=seed_${SWEEP_TRANSPORT:-cuda-ipc} \
    SWEEP_ENGINE_ARGS="--engine-arg=--quantization=fp8 --engine-arg=--kv-cache-dtype=fp8 ${SWEEP_ENGINE_ARGS:-}" sweep
  exit $status
fi
if [ "$MODE" = ncu ]; then
  shift
  for spec in "$@"; do
    # shellcheck disable=SC2086  # the arguments split into words
    ncu_decode "${spec%%:*}" ${spec#*:} || status=1
  done
  exit $status
fi
if [ "$MODE" = ncu-src ]; then
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  [ -n "$NCU" ] || { echo "no ncu on this machine"; exit 2; }
  # shellcheck disable=SC2086  # the arguments split into words
  ( timeout 500 "$NCU" --clock-control none -k "regex:${2:?kernel regex}" --launch-skip 2 --launch-count 1 \
      --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \
      "$BIN/tandem" bench engine --device cuda:0 --model preset:qwen3-4b --batch 1 --decode-steps 4 \
      --prefill-tokens 16 ${3:-} > "$OUT/ncu_src.csv" 2> "$OUT/ncu_src.err" ) \
    || { note "ncu-src failed"; tail -5 "$OUT/ncu_src.err"; exit 1; }
  python3 scripts/gpu/ncu_hot.py "$OUT/ncu_src.csv" 25 | tee -a "$OUT/summary.txt"
  exit 0
fi
if [ "$MODE" = ncu-prefill ]; then
  # Issue 50: where the prefill attention kernel's time goes on a long prompt (argument 2, default
  # 16384 tokens): one launch of NCU_PREFILL_KERNEL (a middle layer of a measured prefill: the
  # skip passes the decode prompts' and warm-up's launches whatever they are) through Nsight
  # Compute, first its speed of light, occupancy and warp stall reasons (ncu_table.py), then its
  # per-SASS-block stall samples (ncu_hot.py).
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  [ -n "$NCU" ] || { echo "no ncu on this machine"; exit 2; }
  tokens=${2:-16384}
  run_ncu() {  # OUTPUT NCU_ARGS...
    local csv=$1; shift
    # shellcheck disable=SC2086  # NCU_PREFILL_ARGS splits into words
    timeout 280 "$NCU" --clock-control none -k "regex:^${NCU_PREFILL_KERNEL:-flash_prefill_wgmma_tma_hd128}$" --launch-skip 54 \
      --launch-count 1 "$@" --csv "$BIN/tandem" bench engine --device cuda:0 --model preset:qwen3-4b --batch 1 \
      --decode-steps 2 --prefill-tokens "$tokens" ${NCU_PREFILL_ARGS:-} > "$OUT/$csv" 2> "$OUT/$csv.err" \
      || { note "ncu $csv failed"; tail -5 "$OUT/$csv.err"; status=1; }
  }
  run_ncu ncu_prefill.csv --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
    --section WarpStateStats --section LaunchStats --section ComputeWorkloadAnalysis \
    --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio' --page details --print-units base
  python3 scripts/gpu/ncu_table.py "$OUT/ncu_prefill.csv" | tee -a "$OUT/summary.txt"
  run_ncu ncu_prefill_src.csv --section SourceCounters --section WarpStateStats --page source --print-source sass
  python3 scripts/gpu/ncu_hot.py "$OUT/ncu_prefill_src.csv" 25 | tee -a "$OUT/summary.txt"
  exit $status
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
  # sweep, with programmatic launch off and on.
  timeout 300 "$BIN/cuda_kernels" --include-ignored --test-threads=1 > "$OUT/tests.log" 2>&1 && note "test cuda_kernels: ok" \
    || { note "test cuda_kernels: FAILED"; grep -B2 -A6 "panicked" "$OUT/tests.log" | head -30; status=1; }
  for pdl in 0 1; do
    timeout 250 "$BIN/tandem" bench engine --device cuda:0 --cuda-tune "programmatic_launch=$pdl" --sweep-gemv-plans \
      --model preset:qwen3-4b --batch 1 --decode-steps 32 --prefill-tokens 512 --profile > "$OUT/tune_pdl$pdl.log" 2>&1
    note "programmatic launch $pdl: $(grep -E '^1 +[0-9]' "$OUT/tune_pdl$pdl.log" | tr -s ' ')"
    grep -E "fused|plan sweep|CUDA graph|rope|attention \(row" "$OUT/tune_pdl$pdl.log" | head -120 | sed "s/^/pdl$pdl /"
  done
  cat "$OUT/summary.txt"
  exit $status
fi

# Reports test binary $1's run (its exit status $2, its output in /tmp/test_$1.log).
report_test() {
  local t=$1 rc=$2
  if [ "$rc" = 0 ]; then
    note "test $t: ok"
    # On a GPU nothing may skip: a skipped check would count as passed.
    if grep -qi "skipp" "/tmp/test_$t.log"; then
      note "test $t: FAILED (tests skipped on a GPU)"; status=1
      grep -i "skipp" "/tmp/test_$t.log" | head -5 >> "$OUT/summary.txt"
    fi
  else
    note "test $t: FAILED"; status=1
    grep -B2 -A6 "panicked" "/tmp/test_$t.log" | head -30 >> "$OUT/summary.txt"
  fi
  cat "/tmp/test_$t.log" >> "$OUT/tests.log"
}
tests="cuda_kernels cuda_model cuda_engine kv_transport"
if [ "$MODE" = quick ]; then
  # The engine tests (the longest, about 260 s on the H200) run beside the others, so that
  # quick, P/D included, fits one call.
  ( timeout 300 "$BIN/cuda_engine" --include-ignored --test-threads=1 --nocapture > /tmp/test_cuda_engine.log 2>&1
    echo $? > /tmp/test_cuda_engine.rc ) &
  engine_tests=$!
  tests="cuda_kernels cuda_model kv_transport"
fi
for t in $tests; do
  if [ "$t" = cuda_model ]; then
    python3 scripts/gpu/make_hf_reference.py /tmp/hfref > "$OUT/hfref.log" 2>&1 || { note "make_hf_reference failed"; tail -20 "$OUT/hfref.log"; }
    export TANDEM_HF_REFERENCE=/tmp/hfref
  fi
  # (Not in quick: it is a diagnostic, and quick must fit one call.)
  if [ "$t" = cuda_model ] && [ "$MODE" != quick ] && [ -s /tmp/hfref/expected.json ]; then
    # The same comparison against transformers computing in f32 on the same bf16 weights
    # (no bf16 rounding of transformers' logits): reported, not a gate.
    REFERENCE_DTYPE=float32 python3 scripts/gpu/make_hf_reference.py /tmp/hfref32 >> "$OUT/hfref.log" 2>&1 \
      && TANDEM_HF_REFERENCE=/tmp/hfref32 timeout 120 "$BIN/$t" --include-ignored greedy --nocapture > /tmp/test_hf32.log 2>&1
    note "transformers f32 reference: $(grep -c '40/40 tokens equal' /tmp/test_hf32.log) of 8 prompts equal for 40 tokens"
    grep -h "^diagnostic transformers" "$OUT/hfref.log" | head -2 | while read -r line; do note "$line"; done
    cat /tmp/test_hf32.log >> "$OUT/tests.log"
  fi
  timeout 300 "$BIN/$t" --include-ignored --test-threads=1 --nocapture > "/tmp/test_$t.log" 2>&1
  report_test "$t" $?
done
if [ -n "${engine_tests:-}" ]; then
  wait "$engine_tests"
  report_test cuda_engine "$(cat /tmp/test_cuda_engine.rc 2>/dev/null || echo 1)"
fi
grep -h "^diagnostic" "$OUT/hfref.log" | head -8; grep -h "^diagnostic transformers" "$OUT/hfref.log"
grep -h "relative error\|tokens equal\|diverged\|shapes checked\|prompts matched\|worst logits" "$OUT/tests.log" | tail -50

# quick keeps the cuda-ipc settings (tcp staging is checked by the ipc mode) to fit one call.
if [ "$MODE" = quick ]; then PD_SETTINGS=${PD_SETTINGS:-cuda-ipc} pd_check; else pd_check; fi

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
