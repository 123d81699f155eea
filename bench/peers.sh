#!/usr/bin/env bash
# What a hop through a peer costs: two tunnel servers, A and B, peers;
# one tunnel client (WebSocket, no TLS) dialled to B only, in front of one
# nginx worker. wrk asks B's public side (the runtime's tunnel is there)
# and A's (A holds none, and forwards each request to B) in alternated
# rounds, and the script prints requests/s, latency and the CPU per
# request of each server.
#
#   bench/peers.sh                       # 5 s rounds, 3 of each
#   DURATION=8 ROUNDS=5 CONNECTIONS=64 bench/peers.sh
#   PEER_TLS=1 bench/peers.sh            # peers speak mutual TLS (RSA 2048)
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${DURATION:-5}
ROUNDS=${ROUNDS:-3}
CONNECTIONS=${CONNECTIONS:-32}
# shellcheck source=bench/common.sh
. bench/common.sh
export RUST_LOG=warn

read -r UP A_PUB A_TUN B_PUB B_TUN B_PEER < <(free_ports 6 | paste -sd' ')
start_upstream "$UP"
hash=$(printf bench-token-not-a-secret | "$BIN" hash-token)
printf 'bench: %s\n' "$hash" > "$WORK/tokens.yaml"
export PORTCULLIS_PEER_TOKEN=bench-peer-token-0123456789
PEER_TLS_ARGS=()
if [ "${PEER_TLS:-0}" = 1 ]; then
  make_pki 127.0.0.1
  PEER_TLS_ARGS=(--peer-cert "$WORK/leaf.pem" --peer-key "$WORK/leaf.key" --peer-ca "$WORK/ca.pem")
fi
"$BIN" tunnel-server --public "127.0.0.1:$B_PUB" --tunnel-listen "127.0.0.1:$B_TUN" \
  --domain bench.test --tokens "$WORK/tokens.yaml" --workers 1 --admin off \
  --peer-listen "127.0.0.1:$B_PEER" "${PEER_TLS_ARGS[@]}" & PIDS+=($!)
B_PID=$!
"$BIN" tunnel-server --public "127.0.0.1:$A_PUB" --tunnel-listen "127.0.0.1:$A_TUN" \
  --domain bench.test --tokens "$WORK/tokens.yaml" --workers 1 --admin off \
  --peers "127.0.0.1:$B_PEER" "${PEER_TLS_ARGS[@]}" & PIDS+=($!)
A_PID=$!
sleep 0.5
PORTCULLIS_TOKEN=bench-token-not-a-secret "$BIN" tunnel-client --server "ws://127.0.0.1:$B_TUN" \
  --runtime-id bench --upstream "http://127.0.0.1:$UP" --workers 1 --admin off & PIDS+=($!)

# A learns B's runtimes within a second of the tunnel coming up.
for server in "$B_PUB" "$A_PUB"; do
  for _ in $(seq 100); do
    curl -sf -o /dev/null -H "Host: bench.bench.test" "http://127.0.0.1:$server/" && continue 2
    sleep 0.1
  done
  echo "not answering on $server" >&2; exit 1
done

# "rps p50 p99 user_us sys_us" with the CPU of server $1 per request.
run() {
  local pid=$1 port=$2
  with_cpu "$pid" bash -c "wrk -t2 -c$CONNECTIONS -d${DURATION}s --latency -H 'Host: bench.bench.test' 'http://127.0.0.1:$port/' | wrk_figures"
}
export -f wrk_figures
: > "$WORK/direct"; : > "$WORK/peer"; : > "$WORK/peer-b"
for round in $(seq "$ROUNDS"); do
  run "$B_PID" "$B_PUB" >> "$WORK/direct"
  # Through A: A's CPU, then B's for the same kind of run.
  run "$A_PID" "$A_PUB" >> "$WORK/peer"
  run "$B_PID" "$A_PUB" >> "$WORK/peer-b"
  echo "round $round: direct $(tail -1 "$WORK/direct") | via peer $(tail -1 "$WORK/peer") (B: $(tail -1 "$WORK/peer-b"))"
done

echo
echo "wrk -t2 -c$CONNECTIONS -d${DURATION}s, servers and client with 1 worker each, peers $([ "${PEER_TLS:-0}" = 1 ] && echo 'over mutual TLS' || echo cleartext), median of $ROUNDS rounds"
d=$(median "$WORK/direct"); p=$(median "$WORK/peer"); pb=$(median "$WORK/peer-b")
awk -v d="$d" -v p="$p" -v pb="$pb" 'BEGIN {
  split(d, a, " "); split(p, b, " "); split(pb, c, " ")
  printf "%-14s %11s %9s %9s %20s\n", "path", "requests/s", "p50 (us)", "p99 (us)", "server CPU/req (us)"
  printf "%-14s %11d %9.0f %9d %20.1f\n", "direct to B", a[1], a[2], a[3], a[4] + a[5]
  printf "%-14s %11d %9.0f %9d %13.1f + %4.1f\n", "A via peer B", b[1], b[2], b[3], b[4] + b[5], c[4] + c[5]
  printf "through a peer: %.2fx the requests/s, +%.0f us at p50\n", b[1] / a[1], b[2] - a[2]
}'
