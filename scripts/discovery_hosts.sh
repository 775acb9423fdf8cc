#!/usr/bin/env bash
# Engines on five "hosts" found through etcd (issue 52): network namespaces tandem-e1..e5
# (10.78.0.1-5) joined by a bridge in this namespace (10.78.0.254), where etcd, the two routers,
# a colocated reference engine and the clients stay. Runs scripts/discovery_check.py: load
# through both routers while a decode engine joins, one leaves gracefully, and a prefill and a
# decode engine are killed and started again, and etcd is stopped for 30 s (DISC_ETCD_PAUSE); no
# request may fail or be wrong.
#
# Usage (root; ip from iproute2, etcd from Debian's etcd-server):
#   scripts/discovery_hosts.sh TANDEM_BINARY OUT_DIR     (a tandem built with --features etcd)
set -euo pipefail
exe=$(realpath "$1") out=$(realpath -m "$2")
here=$(dirname "$(realpath "$0")")
mkdir -p "$out"
command -v ip >/dev/null || { echo "needs ip (Debian: iproute2)"; exit 2; }
command -v etcd >/dev/null || { echo "needs etcd (Debian: etcd-server)"; exit 2; }
spaces="tandem-e1 tandem-e2 tandem-e3 tandem-e4 tandem-e5"
etcd_pid=
down() {
  [ -n "$etcd_pid" ] && kill "$etcd_pid" 2>/dev/null || true
  for ns in $spaces; do ip netns del $ns 2>/dev/null || true; done
  ip link del tandem-dbr 2>/dev/null || true
}
down
trap down EXIT
ip link add tandem-dbr type bridge
ip addr add 10.78.0.254/24 dev tandem-dbr
ip link set tandem-dbr up
n=1 hosts=()
for ns in $spaces; do
  ip netns add $ns
  ip link add $ns-eth type veth peer name $ns-br
  ip link set $ns-eth netns $ns
  ip link set $ns-br master tandem-dbr up
  ip -n $ns addr add 10.78.0.$n/24 dev $ns-eth
  ip -n $ns link set $ns-eth up
  ip -n $ns link set lo up
  ip -n $ns route add default via 10.78.0.254
  hosts+=("$ns:10.78.0.$n")
  n=$((n + 1))
done
rm -rf "$out/etcd"
etcd --name disc --data-dir "$out/etcd" --listen-client-urls http://10.78.0.254:23790 \
  --advertise-client-urls http://10.78.0.254:23790 --listen-peer-urls http://127.0.0.1:23800 \
  --initial-advertise-peer-urls http://127.0.0.1:23800 --initial-cluster disc=http://127.0.0.1:23800 \
  > "$out/etcd.log" 2>&1 &
etcd_pid=$!
echo "five hosts (10.78.0.1-5), etcd at 10.78.0.254:23790"
DISC_HOSTS=$(IFS=,; echo "${hosts[*]}") DISC_ETCD_PID=$etcd_pid python3 "$here/discovery_check.py" "$exe" "$out" etcd://10.78.0.254:23790
