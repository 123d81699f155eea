#!/usr/bin/env bash
# Many idle tunnels on one tunnel server: its memory, and how long they
# all take to come back after the server restarts.
#
#   bench/idle-tunnels.sh                 # TUNNELS=10000 (QUIC_TUNNELS=1000), both transports
#   TUNNELS=2000 TRANSPORTS=websocket bench/idle-tunnels.sh
#
# For each transport (TLS WebSocket, QUIC), a fresh tunnel server and one
# tunnel client process holding TUNNELS tunnels to it (--connections, one
# runtime: what a server sees of TUNNELS clients, less their handshakes'
# spread). Reported: the server's resident memory before, once all are
# connected and idle (after a settling second), and per tunnel; again
# after traffic through every tunnel (64 KiB answers, up to three
# requests a tunnel in TRAFFIC_SECONDS, default 15: the server takes a
# runtime's tunnels in turn), idle again, as a
# server looks once its tunnels have carried a day's requests; then the
# server is killed (SIGKILL, as a crashed pod) and started again on the
# same ports, and the time from its start until it holds every tunnel
# again (the clients' reconnect backoff, jittered, is most of it).
# The counts come from the server's admin /metrics
# (portcullis_tunnel_connections).
set -euo pipefail
cd "$(dirname "$0")/.."

TUNNELS=${TUNNELS:-10000}
# The QUIC client opens a UDP endpoint per tunnel (distinct source ports,
# so a UDP balancer spreads them over replicas), and quinn gives each
# endpoint a receive buffer of ~3 MB, zeroed: 10,000 QUIC tunnels from one
# client process need ~30 GB on the client side. The server's side is
# what is measured, and one server endpoint holds them all.
QUIC_TUNNELS=${QUIC_TUNNELS:-1000}
TRANSPORTS=${TRANSPORTS:-websocket quic}
# shellcheck source=bench/common.sh
. bench/common.sh
# Each tunnel is a socket in the server and one in the client.
ulimit -n $((TUNNELS + 4096))
make_pki localhost
UP=$(free_port)
start_upstream "$UP"
hash=$(printf bench-token-not-a-secret | "$BIN" hash-token)
printf 'bench: %s\n' "$hash" > "$WORK/tokens.yaml"

rss() { awk '/VmRSS/ { print $2 }' "/proc/$1/status"; }
# Tunnels the server at admin port $1 holds now.
held() {
  curl -fs "http://127.0.0.1:$1/metrics" 2>/dev/null \
    | awk '/^portcullis_tunnel_connections\{runtime="bench"\}/ { n = $2 } END { print n + 0 }'
}
# Waits until the server at admin port $1 holds $2 tunnels (600 s at most).
wait_held() {
  local deadline=$((SECONDS + 600))
  until [ "$(held "$1")" -ge "$2" ]; do
    [ "$SECONDS" -lt "$deadline" ] || { echo "only $(held "$1") of $2 tunnels after 600 s" >&2; exit 1; }
    sleep 0.2
  done
}

# The answers of the traffic round.
head -c 65536 /dev/urandom > "$WORK/big.bin"
chmod a+rx "$WORK"; chmod a+r "$WORK/big.bin"
# Each wrk thread stops sending after its share of the answers (its
# argument); wrk itself ends after TRAFFIC_SECONDS.
cat > "$WORK/count.lua" <<'LUA'
local left
function init(args) left = tonumber(args[1]) end
function response() left = left - 1; if left <= 0 then wrk.thread:stop() end end
LUA

printf '%-10s %8s %14s %14s %12s %14s %16s\n' transport tunnels "RSS before" "RSS idle" "KiB/tunnel" "after traffic" "all back after"
ALL=$TUNNELS
for transport in $TRANSPORTS; do
  TUN=$(free_port); PUB=$(free_port); ADMIN=$(free_port)
  quic=()
  TUNNELS=$ALL
  [ "$transport" = quic ] && quic=(--tunnel-quic) && TUNNELS=$QUIC_TUNNELS
  start_server() {
    RUST_LOG=warn "$BIN" tunnel-server --public "127.0.0.1:$PUB" --tunnel-listen "127.0.0.1:$TUN" \
      --domain bench.test --tokens "$WORK/tokens.yaml" --cert "$WORK/leaf.pem" --key "$WORK/leaf.key" \
      --admin "127.0.0.1:$ADMIN" "${quic[@]}" &
    SERVER=$!; PIDS+=("$SERVER")
    until curl -fs "http://127.0.0.1:$ADMIN/metrics" >/dev/null 2>&1; do sleep 0.1; done
  }
  start_server
  sleep 1
  before=$(rss "$SERVER")
  RUST_LOG=warn PORTCULLIS_TOKEN=bench-token-not-a-secret "$BIN" tunnel-client \
    --server "wss://localhost:$TUN" --ca "$WORK/ca.pem" --transport "$transport" \
    --runtime-id bench --upstream "http://127.0.0.1:$UP" --connections "$TUNNELS" --admin off &
  CLIENT=$!; PIDS+=("$CLIENT")
  wait_held "$ADMIN" "$TUNNELS"
  # One request through them: the tunnels carry traffic, not only pings.
  curl -fs -o /dev/null -H 'host: bench.bench.test' "http://127.0.0.1:$PUB/"
  sleep 2
  idle=$(rss "$SERVER")
  wrk -t2 -c8 -d"${TRAFFIC_SECONDS:-15}s" -H 'Host: bench.bench.test' -s "$WORK/count.lua" \
    "http://127.0.0.1:$PUB/big" -- $((TUNNELS * 3 / 2)) > "$WORK/traffic.txt"
  if grep -q Non-2xx "$WORK/traffic.txt"; then cat "$WORK/traffic.txt" >&2; exit 1; fi
  sleep 2
  used=$(rss "$SERVER")
  kill -9 "$SERVER"; wait "$SERVER" 2>/dev/null || true
  start=$(date +%s.%N)
  start_server
  wait_held "$ADMIN" "$TUNNELS"
  back=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN { printf "%.1f s", e - s }')
  awk -v t="$transport" -v n="$TUNNELS" -v b="$before" -v i="$idle" -v u="$used" -v back="$back" \
    'BEGIN { printf "%-10s %8d %11d KiB %11d KiB %12.1f %10.1f KiB %16s\n", t, n, b, i, (i - b) / n, (u - b) / n, back }'
  kill "$CLIENT" "$SERVER" 2>/dev/null || true
  wait "$CLIENT" "$SERVER" 2>/dev/null || true
done
