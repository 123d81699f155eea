#!/usr/bin/env bash
# HTTP/2 over TLS against HTTP/3, side by side in one run, on both places
# Portcullis serves HTTP/3: the routing core's HTTPS listener (`http3:
# true`, straight to the upstream) and the tunnel server's public side
# (through a tunnel). Same upstream, same load generator
# (proxy/examples/h3_load.rs: wrk speaks neither protocol).
#
#   bench/h3.sh
#   DURATION=10 ROUNDS=3 CONNECTIONS=8 STREAMS=8 bench/h3.sh
#
# CONNECTIONS connections with STREAMS requests in flight each, on one
# load thread; rounds alternate the protocols. Release build.
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${DURATION:-10}
ROUNDS=${ROUNDS:-3}
CONNECTIONS=${CONNECTIONS:-8}
STREAMS=${STREAMS:-8}
# shellcheck source=bench/common.sh
. bench/common.sh
cargo build --release --locked -p portcullis --example h3_load
LOAD="$CARGO_TARGET_DIR/release/examples/h3_load"
export RUST_LOG=warn

make_pki localhost '*.bench.test'

# The routing core: one HTTPS listener with HTTP/3, every path to the
# upstream, no access log (as the tunnel server's public side below has
# none in this script either).
CORE=$(free_port)
mkdir "$WORK/policies"
cat > "$WORK/policies/policy.yaml" <<POLICY
listeners:
  - name: https
    bind: "127.0.0.1:$CORE"
    max_requests_per_connection: 0
    tls: { cert: $WORK/leaf.pem, key: $WORK/leaf.key }
    http3: true
upstreams: [{ name: up, endpoints: ["http://127.0.0.1:UPSTREAM_PORT"] }]
routes: [{ name: all, match: { path_prefix: / }, upstream: up }]
POLICY

UP=$(free_port); TUN=$(free_port); PUB=$(free_port)
start_upstream "$UP"
sed -i "s/UPSTREAM_PORT/$UP/" "$WORK/policies/policy.yaml"
RUST_LOG=warn,access=off "$BIN" serve --policies "$WORK/policies" --watch false --admin off & PIDS+=($!)
echo "bench: $(printf bench-token-not-a-secret | "$BIN" hash-token)" > "$WORK/tokens.yaml"
"$BIN" tunnel-server --public "127.0.0.1:$PUB" --tunnel-listen "127.0.0.1:$TUN" \
  --domain bench.test --tokens "$WORK/tokens.yaml" --cert "$WORK/leaf.pem" --key "$WORK/leaf.key" \
  --public-cert "$WORK/leaf.pem" --public-key "$WORK/leaf.key" --http3 --admin off & PIDS+=($!)
sleep 0.5
PORTCULLIS_TOKEN=bench-token-not-a-secret "$BIN" tunnel-client --server "wss://localhost:$TUN" --ca "$WORK/ca.pem" \
  --runtime-id bench --upstream "http://127.0.0.1:$UP" --admin off & PIDS+=($!)
for _ in $(seq 100); do
  curl -sf -o /dev/null --cacert "$WORK/ca.pem" --resolve "bench.bench.test:$PUB:127.0.0.1" "https://bench.bench.test:$PUB/" && break
  sleep 0.1
done

for _ in $(seq 100); do
  curl -sf -o /dev/null --cacert "$WORK/ca.pem" "https://localhost:$CORE/" && break
  sleep 0.1
done

tunnel() { "$LOAD" "127.0.0.1:$PUB" bench.bench.test "$WORK/ca.pem" / "$1" "$CONNECTIONS" "$STREAMS" "$DURATION"; }
core() { "$LOAD" "127.0.0.1:$CORE" localhost "$WORK/ca.pem" / "$1" "$CONNECTIONS" "$STREAMS" "$DURATION"; }
runs=(core-h2 core-h3 tunnel-h2 tunnel-h3)
for run in "${runs[@]}"; do : > "$WORK/$run"; done
for round in $(seq "$ROUNDS"); do
  for run in "${runs[@]}"; do
    "${run%-*}" "${run#*-}" >> "$WORK/$run"
  done
  echo "round $round: $(for run in "${runs[@]}"; do printf '%s %s; ' "$run" "$(tail -1 "$WORK/$run")"; done)" >&2
done

echo
echo "$CONNECTIONS connections x $STREAMS streams, ${DURATION}s, median of $ROUNDS rounds, $(nproc) cores"
printf '%-36s %12s %10s %10s\n' "" "requests/s" "p50 (us)" "p99 (us)"
declare -A rps
for run in "${runs[@]}"; do
  read -r r p50 p99 < <(median "$WORK/$run" 1)
  rps[$run]=$r
  case $run in
    core-h2) name="routing core, HTTP/2" ;;
    core-h3) name="routing core, HTTP/3" ;;
    tunnel-h2) name="tunnel public side, HTTP/2" ;;
    tunnel-h3) name="tunnel public side, HTTP/3" ;;
  esac
  printf '%-36s %12s %10s %10s\n' "$name" "$r" "$p50" "$p99"
done
awk -v a="${rps[core-h3]}" -v b="${rps[core-h2]}" -v c="${rps[tunnel-h3]}" -v d="${rps[tunnel-h2]}" \
  'BEGIN { printf "HTTP/3 / HTTP/2: routing core %.2fx, tunnel public side %.2fx; HTTP/3 routing core / tunnel %.2fx\n", a / b, c / d, a / c }'
