#!/usr/bin/env bash
# Where do a kernel's register spills sit? Compiles every kernel for sm_90 with NVRTC (no GPU
# needed), disassembles KERNEL (default gemv_norm_silu_m1) with cuobjdump + nvdisasm from
# PyPI wheels, and prints each loop holding weight loads or many FMAs with its spill loads and
# stores (LDL / STL). Spills outside the loops cost little; inside the weight-streaming loops
# they cost bandwidth. Usage: scripts/dev/sass_loops.sh [KERNEL]
set -euo pipefail
cd "$(dirname "$0")/../.."
kernel=${1:-gemv_norm_silu_m1}
tools=target/sass-tools
if [ ! -x "$tools/bin/nvdisasm" ]; then
  mkdir -p "$tools/whl" "$tools/bin"
  python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$tools/whl" \
    'nvidia-cuda-cuobjdump==13.2.78' nvidia-cuda-nvdisasm
  for w in "$tools"/whl/*.whl; do python3 -m zipfile -e "$w" "$tools/x"; done
  find "$tools/x" \( -name cuobjdump -o -name nvdisasm \) -type f -exec cp {} "$tools/bin/" \;
  chmod +x "$tools"/bin/*
fi
nvrtc=target/ci-nvrtc
[ -e "$nvrtc/nvidia/cu13/lib/libnvrtc.so.13" ] || { echo "run .ci/run once first (it fetches NVRTC)"; exit 2; }
out=$(mktemp -d)
TANDEM_DUMP_CUBIN=$out LD_LIBRARY_PATH="$PWD/$nvrtc/nvidia/cu13/lib" TANDEM_REQUIRE_NVRTC=1 \
  cargo test -q -p tandem-compute --test nvrtc_compile > /dev/null
# One image per kernel group: the kernel is in one of them.
for img in "$out"/kernels_sm_90_g*.cubin; do
  PATH="$PWD/$tools/bin:$PATH" "$tools/bin/cuobjdump" -sass -fun "$kernel" "$img" 2>/dev/null || true
done > "$out/k.sass"
echo "$kernel: $(grep -c 'LDL' "$out/k.sass") spill loads, $(grep -c 'STL' "$out/k.sass") spill stores in all"
python3 scripts/dev/sass_loops.py "$out/k.sass"
