#!/usr/bin/env bash
# P/D between two "hosts" on one machine: the prefill engine in network namespace tandem-p
# (10.77.0.1), the decode engine in tandem-d (10.77.0.2), each with its own network stack,
# joined by a bridge in this namespace (10.77.0.254), where the colocated engine, the router and
# the client stay. Each engine binds its KV side channel to 0.0.0.0 and advertises the address
# of its default route (what `--kv-advertise-host` defaults to). Every byte of KV crosses veth links, as it would cross a NIC; NIXL's UCX is
# held to TCP (UCX_TLS=tcp), since the namespaces still share the kernel's shared-memory paths a
# real second host would not have. (No added delay: the kernels this was run on lack netem.)
#
# Usage (root; ip from iproute2):
#   scripts/two_hosts.sh TANDEM_BINARY OUT_DIR [MODEL]     (MODEL default preset:tiny-qwen3)
# Env: NIXL=1 adds the NIXL settings (a tandem built with --features nixl, NIXL's libraries on
# LD_LIBRARY_PATH and NIXL_PLUGIN_DIR set); MIN_GB_S (below); PD_SETTINGS as pd_check.py;
# LINK_RATE (tc's rate syntax: 300mbit, 1gbit) holds each host's link to that rate both ways with
# a token bucket (tc's tbf; netem, which would add delay, does not exist on these kernels), so
# that one machine shows what a network between prefill and decode does. LINK_RATES="50mbit
# 100mbit ..." runs the check once per rate (results in OUT_DIR/link-RATE/) and draws the long
# prompt's TTFT against the link's rate, push, pull and colocated (OUT_DIR/ttft_by_link.png,
# `tandem bench plot --link`).
# Runs scripts/gpu/pd_check.py on CPU engines: greedy answers through the router must equal the
# colocated engine's, KV blocks back to baseline, no transfer failed. CHECK=partition runs
# scripts/partition_check.py instead: the link between the two hosts cut under load, and healed.
set -euo pipefail
exe=$(realpath "$1") out=$2 model=${3:-preset:tiny-qwen3}
here=$(dirname "$(realpath "$0")")
mkdir -p "$out"
command -v ip >/dev/null || { echo "needs ip (Debian: iproute2)"; exit 2; }

# Deletes the hosts. A namespace is torn down by the kernel after `ip netns del` returns, with
# the veth link it holds, so the root side of each link goes first (deleting a veth end deletes
# its peer at once), and the next run waits (bounded) until none is left: a run right after
# another met "File exists" making them.
down() {
  for ns in tandem-p tandem-d; do
    ip link del $ns-br 2>/dev/null || true
    ip netns del $ns 2>/dev/null || true
  done
  ip link del tandem-br 2>/dev/null || true
}
down
for _ in $(seq 50); do
  ip link show tandem-p-br >/dev/null 2>&1 || ip link show tandem-d-br >/dev/null 2>&1 \
    || ip link show tandem-br >/dev/null 2>&1 || break
  sleep 0.1
done
trap down EXIT
ip link add tandem-br type bridge
ip addr add 10.77.0.254/24 dev tandem-br
ip link set tandem-br up
n=1
for ns in tandem-p tandem-d; do
  ip netns add $ns
  ip link add $ns-eth type veth peer name $ns-br
  ip link set $ns-eth netns $ns
  ip link set $ns-br master tandem-br up
  ip -n $ns addr add 10.77.0.$n/24 dev $ns-eth
  ip -n $ns link set $ns-eth up
  ip -n $ns link set lo up
  # A default route, as a host has: the engines bind their side channels to 0.0.0.0 and advertise
  # their address on it.
  ip -n $ns route add default via 10.77.0.254
  n=$((n + 1))
done
# Holds both hosts' links to rate $1 both ways: each host's egress in its namespace, and its
# ingress as the bridge port's egress.
set_rate() {
  for ns in tandem-p tandem-d; do
    ip netns exec $ns tc qdisc replace dev $ns-eth root tbf rate "$1" burst 1mb latency 100ms
    tc qdisc replace dev $ns-br root tbf rate "$1" burst 1mb latency 100ms
  done
}
if [ -n "${LINK_RATE:-}" ]; then
  set_rate "$LINK_RATE"
fi
# The link works before any engine starts: bash's /dev/tcp from tandem-p to a listener in tandem-d.
ip netns exec tandem-d python3 -c 'import socket; s = socket.create_server(("10.77.0.2", 18999)); s.settimeout(10); s.accept()' &
sleep 0.5
ip netns exec tandem-p timeout 5 bash -c 'exec 3<>/dev/tcp/10.77.0.2/18999' || { echo "tandem-p cannot reach tandem-d"; exit 1; }
wait

export UCX_TLS=${UCX_TLS:-tcp} PD_DEVICE=cpu PD_HOSTS=tandem-p:10.77.0.1,tandem-d:10.77.0.2
# UCX's TCP transport runs at about 1 GB/s over veth on a small machine, at the NIXL self-check's
# default floor: MIN_GB_S (default 0.1) lowers it so that the run tests the path, not the rate.
export PD_ENGINE_ARGS="--kv-nixl-min-gb-s ${MIN_GB_S:-0.1} ${PD_ENGINE_ARGS:-}"
# The tiny presets' vocabulary: prompts keep their token ids below it.
export PD_VOCAB=${PD_VOCAB:-256} PD_LONG=${PD_LONG:-1000} PD_NIXL=${NIXL:-0}
echo "two hosts: prefill at 10.77.0.1 (tandem-p), decode at 10.77.0.2 (tandem-d), UCX_TLS=$UCX_TLS, link ${LINK_RATE:-unlimited}"
if [ "${CHECK:-pd}" = sweep ]; then
  # `tandem bench sweep` with the engines in the two namespaces, push and pull at each of
  # LINK_RATES (default: the link as it is) and colocated once: TTFT and TPOT per point, and
  # with LINK_RATES the long prompt's TTFT against the rate (OUT_DIR/ttft_by_link.png).
  # SWEEP_INPUTS (default PD_LONG), SWEEP_QPS (default 1), SWEEP_PROMPTS (default 4).
  engine_args=()
  for arg in $PD_ENGINE_ARGS; do engine_args+=("--engine-arg=$arg"); done
  rates=(); [ -n "${LINK_RATES:-}" ] && rates=(--link-rates "${LINK_RATES// /,}")
  "$exe" bench sweep --launch --model "$model" --prefill-netns tandem-p=10.77.0.1 --decode-netns tandem-d=10.77.0.2 \
    "${rates[@]}" --input-lens "${SWEEP_INPUTS:-$PD_LONG}" --qps "${SWEEP_QPS:-1}" --num-prompts "${SWEEP_PROMPTS:-4}" \
    --output-len 8 --vocab-size "$PD_VOCAB" --result-dir "$out" --plot "${engine_args[@]}"
  exit $?
fi
if [ -n "${LINK_RATES:-}" ]; then
  status=0
  for rate in $LINK_RATES; do
    set_rate "$rate"
    echo "== link $rate"
    LINK_RATE=$rate python3 "$here/gpu/pd_check.py" "$exe" "$out/link-$rate" "$model" || status=1
  done
  "$exe" bench plot --link --results-dir "$out" || status=1
  exit $status
fi
case "${CHECK:-pd}" in
  pd) python3 "$here/gpu/pd_check.py" "$exe" "$out" "$model" ;;
  partition) python3 "$here/partition_check.py" "$exe" "$out" "$model" ;;
  *) echo "CHECK is pd, partition or sweep"; exit 2 ;;
esac
