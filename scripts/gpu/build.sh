#!/usr/bin/env bash
# Builds what scripts/gpu/run.sh needs on the GPU machine (which has no Rust): the release
# `tandem` binary and the GPU test executables, copied into gpu-bin/ (git-ignored; carry it).
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --release -p tandem
mkdir -p gpu-bin
cp target/release/tandem gpu-bin/
cargo test --release --no-run -p tandem-compute -p tandem-model -p tandem-engine \
  --test cuda_kernels --test cuda_model --test cuda_engine 2>&1 | tee /tmp/gpu-build.log
for t in cuda_kernels cuda_model cuda_engine; do
  exe=$(grep -o "target/release/deps/$t-[0-9a-f]*" /tmp/gpu-build.log | tail -1)
  cp "$exe" "gpu-bin/$t"
done
# BASELINE=<git rev>: also that revision's tandem, as gpu-bin/tandem-base, to measure against in
# the same GPU call (`scripts/gpu/run.sh matrix "base:TANDEM_EXE=gpu-bin/tandem-base" "new:X=1"`).
if [ -n "${BASELINE:-}" ]; then
  rm -rf target/baseline-src
  git worktree add --force --detach target/baseline-src "$BASELINE"
  (cd target/baseline-src && CARGO_TARGET_DIR="$PWD/../baseline-target" cargo build --release -p tandem)
  cp target/baseline-target/release/tandem gpu-bin/tandem-base
  git worktree remove --force target/baseline-src
fi
strip gpu-bin/*  # line tables make them too large to carry (64 MiB)
ls -la gpu-bin
