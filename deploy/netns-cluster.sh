#!/usr/bin/env bash
# A two-node Ray cluster on one Linux machine, to try `sbpflow server --ray-address` by hand: two network
# namespaces joined by a veth pair, a Ray head in one (10.77.0.1) and a worker node in the other
# (10.77.0.2), 2 CPUs each, with a Ray token made for them. Needs root and iproute2. The namespaces have
# no route out: the processes inside reach each other and their own loopback only.
#
#   sudo deploy/netns-cluster.sh up       # prints the commands to run the server and submit inside
#   sudo deploy/netns-cluster.sh down     # ends every process inside the namespaces (by pid), deletes them
#
# tests/deploy/test_multinode.py builds the same cluster (tests/deploy/netns.py) and checks a DP 4 job.
set -euo pipefail

TAG=${SBPFLOW_NETNS_TAG:-sbpfdemo}
A=${TAG}a B=${TAG}b
WORK=${SBPFLOW_NETNS_DIR:-/tmp/${TAG}}
RAY=${RAY:-$(command -v ray)}
ENVFILE=$WORK/env

run_in() { local ns=$1; shift; ip netns exec "$ns" env $(cat "$ENVFILE") "$@"; }

up() {
  mkdir -p "$WORK"
  echo "RAY_AUTH_MODE=token RAY_AUTH_TOKEN=$(od -An -tx1 -N32 /dev/urandom | tr -d ' \n') RAY_USAGE_STATS_ENABLED=0 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1" >"$ENVFILE"
  chmod 600 "$ENVFILE"
  ip netns add "$A"
  ip netns add "$B"
  ip -n "$A" link add "${TAG}va" type veth peer name "${TAG}vb"
  ip -n "$A" link set "${TAG}vb" netns "$B"
  ip -n "$A" addr add 10.77.0.1/24 dev "${TAG}va"
  ip -n "$B" addr add 10.77.0.2/24 dev "${TAG}vb"
  for ns in "$A" "$B"; do ip -n "$ns" link set lo up; done
  ip -n "$A" link set "${TAG}va" up
  ip -n "$B" link set "${TAG}vb" up
  common=(--num-cpus=2 --num-gpus=0 --disable-usage-stats --object-store-memory=100000000)
  run_in "$A" "$RAY" start --head --node-ip-address=10.77.0.1 --port=6379 --include-dashboard=false \
    --temp-dir="$WORK/ray-a" "${common[@]}" >/dev/null
  run_in "$B" "$RAY" start --address=10.77.0.1:6379 --node-ip-address=10.77.0.2 \
    --temp-dir="$WORK/ray-b" "${common[@]}" >/dev/null
  cat <<EOT
Ray cluster up: head 10.77.0.1:6379 (namespace $A), worker node 10.77.0.2 (namespace $B).
Ray's token and settings: $ENVFILE. Then, as root:
  ip netns exec $A env \$(cat $ENVFILE) SBPFLOW_TOKEN=secret \\
      sbpflow server --host 10.77.0.1 --ray-address 10.77.0.1:6379 --store $WORK/jobs.db
  ip netns exec $A env SBPFLOW_TOKEN=secret \\
      sbpflow submit examples/mlp.py --ranks 4 --watch --address 10.77.0.1:50051
  ip netns exec $A curl -s 10.77.0.1:8080/readyz
Stop with: $0 down
EOT
}

down() {
  for sig in TERM KILL; do
    for ns in "$A" "$B"; do
      pids=$(ip netns pids "$ns" 2>/dev/null || true)
      [ -n "$pids" ] && kill -s "$sig" $pids 2>/dev/null || true
    done
    for _ in $(seq 50); do
      [ -z "$(ip netns pids "$A" 2>/dev/null)$(ip netns pids "$B" 2>/dev/null)" ] && break
      sleep 0.2
    done
  done
  for ns in "$A" "$B"; do ip netns del "$ns" 2>/dev/null || true; done
  rm -rf "$WORK"
  echo "down: namespaces $A $B and $WORK removed"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  *) echo "usage: $0 up|down   (as root; SBPFLOW_NETNS_TAG names the namespaces, default sbpfdemo)" >&2; exit 2 ;;
esac
