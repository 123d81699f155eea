#!/usr/bin/env bash
# Portcullis tunnel vs rathole, side by side in one run, TLS on both tunnels.
#
#   bench/tunnel.sh
#   DURATION=10 ROUNDS=3 CONNECTIONS=64 BIG_MB=512 IDLE=1000 bench/tunnel.sh
#
# Both carry public traffic from a server-side listener through a tunnel
# the client dialled out over TLS, to the same upstream (one nginx worker):
#   requests/s  wrk -c$CONNECTIONS on a small body, keep-alive;
#   throughput  one stream: curl downloads a BIG_MB file through the tunnel,
#               then a client uploads BIG_MB (bench/bodies.py; nginx passes
#               it to a sink that reads it whole before answering);
#   idle memory the tunnel server's RSS growth per idle tunnel (IDLE tunnels:
#               rathole services, Portcullis --connections), and both
#               ends' per idle public keep-alive connection (IDLE_PUBLIC).
# rathole is a TCP-level tunnel (one data channel per public connection);
# Portcullis is HTTP-aware (routing core on the client), measured over both
# its transports: HTTP/2 streams over a WebSocket (the default), and QUIC
# (--transport quic: a QUIC stream per request). Installs wrk, nginx and
# rathole if missing.
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${DURATION:-10}
ROUNDS=${ROUNDS:-3}
CONNECTIONS=${CONNECTIONS:-64}
BIG_MB=${BIG_MB:-512}
# 1,000 idle tunnels: at 200, the growth was mostly the allocators' own
# granularity, for both tunnels (rathole 125 KiB a tunnel at 200, 44 at
# 1,000; Portcullis 60 and 48).
IDLE=${IDLE:-1000}
IDLE_PUBLIC=${IDLE_PUBLIC:-1000}
# shellcheck source=bench/common.sh
. bench/common.sh
command -v rathole >/dev/null || cargo install rathole
export RUST_LOG=warn

# A private CA and a leaf for localhost; rathole's server wants PKCS#12.
make_pki localhost
cd "$WORK"
head -c "$((BIG_MB << 20))" /dev/zero > big.bin
# nginx's workers drop root: let them read the file.
chmod a+rx "$WORK"; chmod a+r big.bin
cd - >/dev/null

UP=$(free_port); RH_CTL=$(free_port); RH_PUB=$(free_port); PC_TUN=$(free_port); PC_PUB=$(free_port)
SINK_PORT=$(free_port)
python3 bench/bodies.py sink "$SINK_PORT" 1 & PIDS+=($!)
start_upstream "$UP"

# rathole: one service through one TLS control channel.
rathole_configs "127.0.0.1:$RH_CTL" "127.0.0.1:$RH_PUB" "localhost:$RH_CTL" localhost "127.0.0.1:$UP"
rathole --server "$WORK/rh-server.toml" & PIDS+=($!); RH_S=$!
sleep 0.5
rathole --client "$WORK/rh-client.toml" & PIDS+=($!); RH_C=$!

# Portcullis: tunnel server with TLS, client fronting the same upstream.
# The runtime `bench` dials over WebSocket, `benchq` over QUIC.
hash=$(printf bench-token-not-a-secret | "$BIN" hash-token)
printf 'bench: %s\nbenchq: %s\n' "$hash" "$hash" > "$WORK/tokens.yaml"
"$BIN" tunnel-server --public "127.0.0.1:$PC_PUB" --tunnel-listen "127.0.0.1:$PC_TUN" \
  --domain bench.test --tokens "$WORK/tokens.yaml" --cert "$WORK/leaf.pem" --key "$WORK/leaf.key" \
  --tunnel-quic --admin off & PIDS+=($!); PC_S=$!
sleep 0.5
PORTCULLIS_TOKEN=bench-token-not-a-secret "$BIN" tunnel-client --server "wss://localhost:$PC_TUN" --ca "$WORK/ca.pem" \
  --runtime-id bench --upstream "http://127.0.0.1:$UP" --admin off & PIDS+=($!); PC_C=$!
PORTCULLIS_TOKEN=bench-token-not-a-secret "$BIN" tunnel-client --server "wss://localhost:$PC_TUN" --ca "$WORK/ca.pem" \
  --runtime-id benchq --transport quic --upstream "http://127.0.0.1:$UP" --admin off & PIDS+=($!)

# MiB/s of one download; fails the run unless all of it arrived.
download() {
  curl -s -o /dev/null -w '%{http_code} %{size_download} %{speed_download}\n' "$@" |
    awk -v want="$((BIG_MB << 20))" '$1 != 200 || $2 != want { print "download failed: " $0 > "/dev/stderr"; exit 1 } { printf "%.0f\n", $3 / 1048576 }'
}
# MiB/s of one upload of BIG_MB to the sink, Host $2 (bodies.py checks
# that all of it arrived).
upload() {
  python3 bench/bodies.py client "$1" put "$BIG_MB" 1 "$2" /upload | awk '{ printf "%.0f\n", $1 * 1e6 / 1048576 }'
}
wait_ok() { for _ in $(seq 100); do curl -sf -o /dev/null "$@" && return 0; sleep 0.1; done; echo "not answering: $*" >&2; exit 1; }
wait_ok "http://127.0.0.1:$RH_PUB/"
wait_ok -H "Host: bench.bench.test" "http://127.0.0.1:$PC_PUB/"
wait_ok -H "Host: benchq.bench.test" "http://127.0.0.1:$PC_PUB/"

# Idle public connections, first, while both tunnels are fresh: each makes
# one request and stays open; the growth of both ends' resident memory
# (server and client) per connection. rathole holds a data channel per
# public connection; Portcullis holds the public connection on the server
# and nothing on the client once the request's stream ends.
RH_IDLE=$(python3 bench/bodies.py idle "$RH_PUB" "$IDLE_PUBLIC" 0 "$RH_S" "$RH_C")
PC_IDLE=$(IDLE_HOST=bench.bench.test python3 bench/bodies.py idle "$PC_PUB" "$IDLE_PUBLIC" 0 "$PC_S" "$PC_C")

: > "$WORK/rps.rh"; : > "$WORK/rps.pc"; : > "$WORK/rps.pq"
: > "$WORK/mbps.rh"; : > "$WORK/mbps.pc"; : > "$WORK/mbps.pq"
: > "$WORK/up.rh"; : > "$WORK/up.pc"; : > "$WORK/up.pq"
for round in $(seq "$ROUNDS"); do
  wrk -t2 -c"$CONNECTIONS" -d"${DURATION}s" --latency "http://127.0.0.1:$RH_PUB/" | wrk_figures >> "$WORK/rps.rh"
  wrk -t2 -c"$CONNECTIONS" -d"${DURATION}s" --latency -H "Host: bench.bench.test" "http://127.0.0.1:$PC_PUB/" | wrk_figures >> "$WORK/rps.pc"
  wrk -t2 -c"$CONNECTIONS" -d"${DURATION}s" --latency -H "Host: benchq.bench.test" "http://127.0.0.1:$PC_PUB/" | wrk_figures >> "$WORK/rps.pq"
  download "http://127.0.0.1:$RH_PUB/big" >> "$WORK/mbps.rh"
  download -H "Host: bench.bench.test" "http://127.0.0.1:$PC_PUB/big" >> "$WORK/mbps.pc"
  download -H "Host: benchq.bench.test" "http://127.0.0.1:$PC_PUB/big" >> "$WORK/mbps.pq"
  upload "$RH_PUB" localhost >> "$WORK/up.rh"
  upload "$PC_PUB" bench.bench.test >> "$WORK/up.pc"
  upload "$PC_PUB" benchq.bench.test >> "$WORK/up.pq"
  echo "round $round done" >&2
done

# Idle tunnels: a fresh server of each kind, RSS before and after IDLE
# tunnels connect.
rss() { awk '/VmRSS/ { print $2 }' "/proc/$1/status"; }
RH2_CTL=$(free_port); PC2_TUN=$(free_port); PC2_PUB=$(free_port); PQ_TUN=$(free_port); PQ_PUB=$(free_port)
{
  printf '[server]\nbind_addr = "127.0.0.1:%s"\n[server.transport]\ntype = "tls"\n[server.transport.tls]\npkcs12 = "%s"\npkcs12_password = "bench"\n' "$RH2_CTL" "$WORK/identity.pfx"
  i=0
  for port in $(free_ports "$IDLE"); do i=$((i + 1)); printf '[server.services.s%s]\ntoken = "t"\nbind_addr = "127.0.0.1:%s"\n' "$i" "$port"; done
} > "$WORK/rh-idle-server.toml"
{
  printf '[client]\nremote_addr = "localhost:%s"\n[client.transport]\ntype = "tls"\n[client.transport.tls]\ntrusted_root = "%s"\nhostname = "localhost"\n' "$RH2_CTL" "$WORK/ca.pem"
  for i in $(seq "$IDLE"); do printf '[client.services.s%s]\ntoken = "t"\nlocal_addr = "127.0.0.1:%s"\n' "$i" "$UP"; done
} > "$WORK/rh-idle-client.toml"
rathole --server "$WORK/rh-idle-server.toml" & RH2=$!; PIDS+=($RH2)
sleep 1; RH_BEFORE=$(rss $RH2)
rathole --client "$WORK/rh-idle-client.toml" & PIDS+=($!)
sleep 5; RH_AFTER=$(rss $RH2)

"$BIN" tunnel-server --public "127.0.0.1:$PC2_PUB" --tunnel-listen "127.0.0.1:$PC2_TUN" \
  --domain bench.test --tokens "$WORK/tokens.yaml" --cert "$WORK/leaf.pem" --key "$WORK/leaf.key" \
  --admin off & PC2=$!; PIDS+=($PC2)
sleep 1; PC_BEFORE=$(rss $PC2)
PORTCULLIS_TOKEN=bench-token-not-a-secret "$BIN" tunnel-client --server "wss://localhost:$PC2_TUN" --ca "$WORK/ca.pem" \
  --runtime-id bench --upstream "http://127.0.0.1:$UP" --connections "$IDLE" --admin off & PIDS+=($!)
sleep 5; PC_AFTER=$(rss $PC2)

"$BIN" tunnel-server --public "127.0.0.1:$PQ_PUB" --tunnel-listen "127.0.0.1:$PQ_TUN" \
  --domain bench.test --tokens "$WORK/tokens.yaml" --cert "$WORK/leaf.pem" --key "$WORK/leaf.key" \
  --tunnel-quic --admin off & PQ=$!; PIDS+=($PQ)
sleep 1; PQ_BEFORE=$(rss $PQ)
PORTCULLIS_TOKEN=bench-token-not-a-secret "$BIN" tunnel-client --server "wss://localhost:$PQ_TUN" --ca "$WORK/ca.pem" \
  --runtime-id benchq --transport quic --upstream "http://127.0.0.1:$UP" --connections "$IDLE" --admin off & PIDS+=($!)
sleep 5; PQ_AFTER=$(rss $PQ)

read -r rh_rps rh_p50 rh_p99 < <(median "$WORK/rps.rh" 1)
read -r pc_rps pc_p50 pc_p99 < <(median "$WORK/rps.pc" 1)
read -r pq_rps pq_p50 pq_p99 < <(median "$WORK/rps.pq" 1)
rh_mb=$(sort -n "$WORK/mbps.rh" | awk -v n="$ROUNDS" 'NR == int((n+1)/2)')
pc_mb=$(sort -n "$WORK/mbps.pc" | awk -v n="$ROUNDS" 'NR == int((n+1)/2)')
pq_mb=$(sort -n "$WORK/mbps.pq" | awk -v n="$ROUNDS" 'NR == int((n+1)/2)')
rh_up=$(sort -n "$WORK/up.rh" | awk -v n="$ROUNDS" 'NR == int((n+1)/2)')
pc_up=$(sort -n "$WORK/up.pc" | awk -v n="$ROUNDS" 'NR == int((n+1)/2)')
pq_up=$(sort -n "$WORK/up.pq" | awk -v n="$ROUNDS" 'NR == int((n+1)/2)')
echo
echo "TLS tunnels, wrk -t2 -c$CONNECTIONS -d${DURATION}s, one-stream download and upload of $BIG_MB MiB, median of $ROUNDS rounds, $(nproc) cores"
printf '%-16s %12s %10s %10s %14s %14s %18s\n' tunnel "requests/s" "p50 (us)" "p99 (us)" "down MiB/s" "up MiB/s" "idle KiB/tunnel"
printf '%-16s %12s %10s %10s %14s %14s %18s\n' rathole "$rh_rps" "$rh_p50" "$rh_p99" "$rh_mb" "$rh_up" "$(( (RH_AFTER - RH_BEFORE) / IDLE ))"
printf '%-16s %12s %10s %10s %14s %14s %18s\n' portcullis "$pc_rps" "$pc_p50" "$pc_p99" "$pc_mb" "$pc_up" "$(( (PC_AFTER - PC_BEFORE) / IDLE ))"
printf '%-16s %12s %10s %10s %14s %14s %18s\n' portcullis-quic "$pq_rps" "$pq_p50" "$pq_p99" "$pq_mb" "$pq_up" "$(( (PQ_AFTER - PQ_BEFORE) / IDLE ))"
awk -v a="$pc_rps" -v b="$rh_rps" -v c="$pc_mb" -v d="$rh_mb" -v e="$pc_up" -v f="$rh_up" 'BEGIN { printf "portcullis / rathole: requests/s %.2fx, download %.2fx, upload %.2fx\n", a / b, c / d, e / f }'
awk -v a="$pq_rps" -v b="$pc_rps" -v c="$pq_mb" -v d="$pc_mb" -v e="$pq_up" -v f="$pc_up" 'BEGIN { printf "quic / websocket transport: requests/s %.2fx, download %.2fx, upload %.2fx\n", a / b, c / d, e / f }'
echo "idle public keep-alive connections ($IDLE_PUBLIC, one request each), RSS growth per connection, server + client: rathole $RH_IDLE KiB, portcullis $PC_IDLE KiB"
