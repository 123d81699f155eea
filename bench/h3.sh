#!/usr/bin/env bash
# The tunnel server's public side over HTTPS with HTTP/2 against HTTP/3,
# side by side in one run: same server, same tunnel, same upstream, same
# load generator (proxy/examples/h3_load.rs: wrk speaks neither protocol).
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

UP=$(free_port); TUN=$(free_port); PUB=$(free_port)
start_upstream "$UP"
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

load() { "$LOAD" "127.0.0.1:$PUB" bench.bench.test "$WORK/ca.pem" / "$1" "$CONNECTIONS" "$STREAMS" "$DURATION"; }
: > "$WORK/h2"; : > "$WORK/h3"
for round in $(seq "$ROUNDS"); do
  load h2 >> "$WORK/h2"
  load h3 >> "$WORK/h3"
  echo "round $round: h2 $(tail -1 "$WORK/h2"), h3 $(tail -1 "$WORK/h3")" >&2
done

read -r h2_rps h2_p50 h2_p99 < <(median "$WORK/h2" 1)
read -r h3_rps h3_p50 h3_p99 < <(median "$WORK/h3" 1)
echo
echo "public side through a tunnel, $CONNECTIONS connections x $STREAMS streams, ${DURATION}s, median of $ROUNDS rounds, $(nproc) cores"
printf '%-10s %12s %10s %10s\n' protocol "requests/s" "p50 (us)" "p99 (us)"
printf '%-10s %12s %10s %10s\n' "HTTP/2" "$h2_rps" "$h2_p50" "$h2_p99"
printf '%-10s %12s %10s %10s\n' "HTTP/3" "$h3_rps" "$h3_p50" "$h3_p99"
awk -v a="$h3_rps" -v b="$h2_rps" 'BEGIN { printf "HTTP/3 / HTTP/2: requests/s %.2fx\n", a / b }'
