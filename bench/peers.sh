#!/usr/bin/env bash
# Tunnel-server replicas sharing a registry in Redis (--registry), and
# the routing core's shared rate limit (serve --state). Four figures:
#  1. a hop through a peer: two servers A and B, one tunnel client
#     (WebSocket, no TLS) dialled to B in front of one nginx worker; wrk
#     asks B (the tunnel is there) and A (which forwards each request to
#     B) in alternated rounds: requests/s, latency, CPU per request;
#  2. a move: a runtime's client stopped on B and started on A; the time
#     from A registering its tunnel to B's first answer through A;
#  3. Redis commands/s with RUNTIMES clients connected (one process
#     each): steady state, and the reconnect storm after B restarts;
#  4. a routing core's route with a local rate limit against the same
#     limit `shared: true` (one Redis script a request): CPU per request.
#
#   bench/peers.sh                       # 5 s rounds, 3 of each, 1000 runtimes
#   DURATION=8 ROUNDS=5 CONNECTIONS=64 RUNTIMES=200 bench/peers.sh
#   PEER_TLS=1 bench/peers.sh            # peers speak mutual TLS (RSA 2048)
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${DURATION:-5}
ROUNDS=${ROUNDS:-3}
CONNECTIONS=${CONNECTIONS:-32}
RUNTIMES=${RUNTIMES:-1000}
MOVES=${MOVES:-5}
# shellcheck source=bench/common.sh
. bench/common.sh
# The tunnel endpoint's connects and closes, with timestamps, for the move
# figure; access lines stay off.
export RUST_LOG=warn,portcullis_tunnel::server=info PORTCULLIS_LOG_FORMAT=json
command -v redis-server >/dev/null || { echo "bench/peers.sh: redis-server is missing (apt-get install redis-server)" >&2; exit 1; }

read -r UP A_PUB A_TUN A_PEER B_PUB B_TUN B_PEER REDIS CORE < <(free_ports 9 | paste -sd' ')
start_upstream "$UP"
redis-server --port "$REDIS" --bind 127.0.0.1 --save '' --appendonly no --dir "$WORK" >/dev/null & PIDS+=($!)
REDIS_PID=$!
for _ in $(seq 100); do redis-cli -p "$REDIS" ping >/dev/null 2>&1 && break; sleep 0.05; done
rcli() { redis-cli -p "$REDIS" "$@"; }
hash=$(printf bench-token-not-a-secret | "$BIN" hash-token)
{
  printf 'bench: %s\nmover: %s\n' "$hash" "$hash"
  for i in $(seq 0 $((RUNTIMES - 1))); do printf 'rt-%d: %s\n' "$i" "$hash"; done
} > "$WORK/tokens.yaml"
export PORTCULLIS_PEER_TOKEN=bench-peer-token-0123456789 PORTCULLIS_TOKEN=bench-token-not-a-secret
PEER_TLS_ARGS=()
if [ "${PEER_TLS:-0}" = 1 ]; then
  make_pki 127.0.0.1
  PEER_TLS_ARGS=(--peer-cert "$WORK/leaf.pem" --peer-key "$WORK/leaf.key" --peer-ca "$WORK/ca.pem")
fi
# server NAME PUBLIC TUNNEL PEER: a replica in the registry, its log in $WORK/NAME.log.
server() {
  "$BIN" tunnel-server --public "127.0.0.1:$2" --tunnel-listen "127.0.0.1:$3" \
    --domain bench.test --tokens "$WORK/tokens.yaml" --workers 1 --admin off \
    --registry "redis://127.0.0.1:$REDIS" --peer-listen "127.0.0.1:$4" "${PEER_TLS_ARGS[@]}" \
    2>>"$WORK/$1.log" & PIDS+=($!)
}
server b "$B_PUB" "$B_TUN" "$B_PEER"; B_PID=$!
server a "$A_PUB" "$A_TUN" "$A_PEER"; A_PID=$!
# client RUNTIME SERVER_TUNNEL_PORT: a one-connection client in front of nginx.
client() {
  "$BIN" tunnel-client --server "ws://127.0.0.1:$2" --runtime-id "$1" --upstream "http://127.0.0.1:$UP" \
    --workers 1 --connections 1 --admin off 2>/dev/null & PIDS+=($!)
}
client bench "$B_TUN"
# answers PORT RUNTIME: waits until the public side on PORT serves RUNTIME.
answers() {
  for _ in $(seq 200); do
    curl -sf -o /dev/null -H "Host: $2.bench.test" "http://127.0.0.1:$1/" && return 0
    sleep 0.05
  done
  echo "$2 not served on $1" >&2; exit 1
}
answers "$B_PUB" bench
answers "$A_PUB" bench

echo "== 1. a hop through a peer"
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
echo "wrk -t2 -c$CONNECTIONS -d${DURATION}s, servers and client with 1 worker each, peers $([ "${PEER_TLS:-0}" = 1 ] && echo 'over mutual TLS' || echo cleartext), median of $ROUNDS rounds"
d=$(median "$WORK/direct"); p=$(median "$WORK/peer"); pb=$(median "$WORK/peer-b")
awk -v d="$d" -v p="$p" -v pb="$pb" 'BEGIN {
  split(d, a, " "); split(p, b, " "); split(pb, c, " ")
  printf "%-14s %11s %9s %9s %20s\n", "path", "requests/s", "p50 (us)", "p99 (us)", "server CPU/req (us)"
  printf "%-14s %11d %9.0f %9d %20.1f\n", "direct to B", a[1], a[2], a[3], a[4] + a[5]
  printf "%-14s %11d %9.0f %9d %13.1f + %4.1f\n", "A via peer B", b[1], b[2], b[3], b[4] + b[5], c[4] + c[5]
  printf "through a peer: %.2fx the requests/s, +%.0f us at p50\n", b[1] / a[1], b[2] - a[2]
}'

echo
echo "== 2. a move from B to A, $MOVES times"
: > "$WORK/moves"
for i in $(seq "$MOVES"); do
  client mover "$B_TUN"; old=$!
  answers "$A_PUB" mover
  kill "$old"; wait "$old" 2>/dev/null || true
  # B's answer turns 503 once the tunnel is gone.
  while curl -sf -o /dev/null -H "Host: mover.bench.test" "http://127.0.0.1:$B_PUB/"; do sleep 0.01; done
  lines=$(wc -l < "$WORK/a.log")
  # Polls B every millisecond from before the client starts; writes when
  # B first answers 200 (Unix s).
  python3 - "$B_PUB" > "$WORK/served" <<'PY' &
import http.client, sys, time
port = int(sys.argv[1])
deadline = time.time() + 10
while time.time() < deadline:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
    c.request("GET", "/", headers={"Host": "mover.bench.test"})
    if c.getresponse().status == 200:
        print(f"{time.time():.6f}"); break
    c.close(); time.sleep(0.001)
PY
  poller=$!
  sleep 0.5
  client mover "$A_TUN"; new=$!
  wait "$poller"; served=$(cat "$WORK/served")
  connected=$(tail -n +"$((lines + 1))" "$WORK/a.log" | python3 -c '
import json, sys, datetime
for line in sys.stdin:
    v = json.loads(line)
    if v.get("message") == "tunnel connected" and v.get("runtime") == "mover":
        t = datetime.datetime.fromisoformat(v["timestamp"].replace("Z", "+00:00"))
        print(f"{t.timestamp():.6f}"); break')
  awk -v s="$served" -v c="$connected" 'BEGIN { printf "%.1f\n", (s - c) * 1000 }' | tee -a "$WORK/moves"
  kill "$new"; wait "$new" 2>/dev/null || true
done
echo "from the new holder's 'tunnel connected' to B's first answer through it (ms, median of $MOVES; B polled every ms): $(sort -n "$WORK/moves" | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}')"

echo
echo "== 3. Redis commands/s with $RUNTIMES runtimes on B"
started=$(date +%s.%N)
for i in $(seq 0 $((RUNTIMES - 1))); do client "rt-$i" "$B_TUN"; done
registered() { rcli hlen '{portcullis-tunnels}:holders'; }
until [ "$(registered)" -ge "$RUNTIMES" ]; do sleep 0.2; done
echo "all registered $(awk -v s="$started" -v e="$(date +%s.%N)" 'BEGIN { printf "%.1f", e - s }') s after the first client started (one process each)"
commands() { rcli info stats | awk -F: '/^total_commands_processed/ { print $2 + 0 }'; }
c0=$(commands); sleep 10; c1=$(commands)
# Each `info` call is itself a command.
echo "steady: $(( (c1 - c0 - 1) / 10 )) commands/s (2 servers, $((RUNTIMES + 1)) runtimes)"
kill -TERM "$B_PID"; wait "$B_PID" 2>/dev/null || true
c0=$(commands); t0=$(date +%s.%N)
server b "$B_PUB" "$B_TUN" "$B_PEER"; B_PID=$!
until [ "$(registered)" -ge "$RUNTIMES" ]; do sleep 0.05; done
c1=$(commands); t1=$(date +%s.%N)
awk -v c="$((c1 - c0))" -v t0="$t0" -v t1="$t1" -v n="$RUNTIMES" 'BEGIN {
  printf "reconnect storm (B restarted, %d clients back): %d commands in %.1f s, %.0f commands/s\n", n, c, t1 - t0, c / (t1 - t0) }'

echo
echo "== 4. a rate limit counted here against shared in Redis (serve, 1 worker)"
cat > "$WORK/core.yaml" <<EOF
listeners: [{ name: http, bind: "127.0.0.1:$CORE" }]
upstreams: [{ name: app, endpoints: ["http://127.0.0.1:$UP"] }]
routes:
  - { name: local, match: { path: /local }, upstream: app, rate_limit: { rate: 100000000/s } }
  - { name: shared, match: { path: /shared }, upstream: app, rate_limit: { rate: 100000000/s, shared: true } }
EOF
mkdir -p "$WORK/core"; mv "$WORK/core.yaml" "$WORK/core/"
RUST_LOG=warn "$BIN" serve --policies "$WORK/core" --workers 1 --admin off --state "redis://127.0.0.1:$REDIS" & PIDS+=($!)
CORE_PID=$!
for _ in $(seq 100); do curl -sf -o /dev/null "http://127.0.0.1:$CORE/local" && break; sleep 0.1; done
# with_cpu's figures, and Redis's CPU per request (us) after them.
limit_run() {
  local r1 r2 out
  r1=$(cpu_ticks "$REDIS_PID" | awk '{print $1 + $2}')
  out=$(with_cpu "$CORE_PID" bash -c "wrk -t2 -c$CONNECTIONS -d${DURATION}s --latency 'http://127.0.0.1:$CORE/$1' | wrk_figures")
  r2=$(cpu_ticks "$REDIS_PID" | awk '{print $1 + $2}')
  awk -v o="$out" -v r=$((r2 - r1)) -v t="$TICK_US" -v d="$DURATION" 'BEGIN { split(o, a, " "); printf "%s %.2f\n", o, r * t / (a[1] * d) }'
}
: > "$WORK/local"; : > "$WORK/shared"
for round in $(seq "$ROUNDS"); do
  limit_run local >> "$WORK/local"
  limit_run shared >> "$WORK/shared"
  echo "round $round: local $(tail -1 "$WORK/local") | shared $(tail -1 "$WORK/shared")"
done
l=$(median "$WORK/local"); s=$(median "$WORK/shared")
awk -v l="$l" -v s="$s" 'BEGIN {
  split(l, a, " "); split(s, b, " ")
  printf "%-8s %11s %9s %9s %18s %18s\n", "limit", "requests/s", "p50 (us)", "p99 (us)", "core CPU/req (us)", "Redis CPU/req (us)"
  printf "%-8s %11d %9.0f %9d %18.1f %18.1f\n", "local", a[1], a[2], a[3], a[4] + a[5], a[7]
  printf "%-8s %11d %9.0f %9d %18.1f %18.1f\n", "shared", b[1], b[2], b[3], b[4] + b[5], b[7]
  printf "shared: %.2fx the requests/s, +%.1f us CPU a request in the core, +%.0f us at p50\n", b[1] / a[1], (b[4] + b[5]) - (a[4] + a[5]), b[2] - a[2]
}'
