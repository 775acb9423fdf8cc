#!/usr/bin/env bash
# Builds what scripts/gpu/run.sh needs on the GPU machine (which has no Rust): the release
# `tandem` binary and the GPU test executables (the kernel, model and engine tests, and the KV
# crate's unit tests as kv_transport), copied into gpu-bin/ (git-ignored; carry it).
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
# The KV crate's unit tests, whose GPU ones test each transport alone (cuda-ipc into a second
# process): gpu-bin/kv_transport.
cargo test --release --no-run -p tandem-kv --lib 2>&1 | tee /tmp/gpu-build-kv.log
cp "$(grep -o "target/release/deps/tandem_kv-[0-9a-f]*" /tmp/gpu-build-kv.log | tail -1)" gpu-bin/kv_transport
# BASELINE=<git rev>: also that revision's tandem, as gpu-bin/tandem-base, to measure against in
# the same GPU call (`scripts/gpu/run.sh matrix "base:TANDEM_EXE=gpu-bin/tandem-base" "new:X=1"`).
if [ -n "${BASELINE:-}" ]; then
  rm -rf target/baseline-src
  git worktree add --force --detach target/baseline-src "$BASELINE"
  # The same target directory: the dependencies are built once (the workspace's own crates build
  # again from the other tree), which halves the baseline's build on 2 cores.
  (cd target/baseline-src && CARGO_TARGET_DIR="$PWD/.." cargo build --release -p tandem)
  cp target/release/tandem gpu-bin/tandem-base
  git worktree remove --force target/baseline-src
fi
strip gpu-bin/*  # line tables make them too large to carry (64 MiB)
ls -la gpu-bin
# NIXL=1: also gpu-nixl/ (carry it instead of gpu-bin for `run.sh nixl`): tandem built with
# --features nixl, the kernel tests, and nixl-runtime.tar.xz, NIXL's C API with its UCX plugin
# and UCX's CUDA and shared-memory modules, the libraries they load, from PyPI's nixl-cu13 wheel
# (the whole wheel, 57 MB, would not fit the carry beside the binaries).
if [ -n "${NIXL:-}" ]; then
  wheels=target/ci-nixl  # what .ci/run downloads, fetched here if missing
  if [ ! -e "$wheels/.nixl_cu13.mesonpy.libs/libnixl_capi.so" ]; then
    mkdir -p "$wheels"
    python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$wheels" 'libclang==18.1.1'
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
      --platform manylinux_2_28_x86_64 --dest "$wheels" 'nixl-cu13==1.5.1'
    for wheel in "$wheels"/*.whl; do python3 -m zipfile -e "$wheel" "$wheels"; done
  fi
  export LIBCLANG_PATH="$PWD/$wheels/libclang-18.1.1.data/platlib/clang/native"
  export BINDGEN_EXTRA_CLANG_ARGS="-I$(gcc -print-file-name=include)"
  cargo build --release -p tandem --features tandem/nixl
  rm -rf gpu-nixl target/nixl-rt && mkdir -p gpu-nixl target/nixl-rt/lib/ucx target/nixl-rt/plugins
  cp target/release/tandem gpu-nixl/tandem
  cp gpu-bin/cuda_kernels gpu-nixl/
  libs="$PWD/$wheels/.nixl_cu13.mesonpy.libs" deps="$PWD/$wheels/nixl_cu13.libs"
  modules="$deps/ucx/libuct_cuda.so.0.0.0 $deps/ucx/libuct_cma.so.0.0.0 $deps/ucx/libucm_cuda.so.0.0.0"
  # shellcheck disable=SC2086  # the module list splits into words
  closure=$(LD_LIBRARY_PATH="$libs:$deps" ldd "$libs/libnixl_capi.so" "$libs/plugins/libplugin_UCX.so" $modules \
    | awk '$3 ~ /nixl_cu13/ {print $3}' | sort -u)
  # shellcheck disable=SC2086
  cp $closure "$libs/libnixl_capi.so" target/nixl-rt/lib/
  cp "$libs/plugins/libplugin_UCX.so" target/nixl-rt/plugins/
  # shellcheck disable=SC2086
  cp $modules target/nixl-rt/lib/ucx/  # UCX looks for its modules in ucx/ beside libucs
  tar cJf gpu-nixl/nixl-runtime.tar.xz -C target/nixl-rt .
  strip gpu-nixl/tandem
  ls -la gpu-nixl
fi
