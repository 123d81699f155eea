#!/usr/bin/env bash
# Large bodies through Portcullis and through nginx, side by side in one run.
#
#   bench/bodies.sh                    # defaults below
#   MB=1024 TRANSFERS=5 ROUNDS=5 bench/bodies.sh
#
# One client connection moves TRANSFERS bodies of MB MiB at a time, in four
# ways (bench/bodies.py): a Content-Length upload, a chunked upload, a
# download, and a download answering a streamed upload (in Portcullis that
# answer is read by hyper's client, not by its own reader). The upstream
# (bodies.py sink) and the client move several GB/s on their own over
# loopback, so the proxy sets the pace. nginx at its best for this: request
# buffering off (else it takes in the whole upload, in memory or on disk,
# before it sends a byte upstream) and response buffering in
# memory only (8 x 64 KiB, no temporary file), which moved large answers
# ~40% faster than buffering off here. Each round runs every
# way through each proxy in turn; the table shows medians over rounds of
# MB/s (each round's figure is the median of its transfers) and of each
# proxy's own CPU time per GiB moved (user + system, from /proc).
# First, IDLE_CONNS connections (400) each upload IDLE_MB MiB (4) through each
# proxy and stay open, idle: the growth of each proxy's resident memory per
# connection (its upstream connections included).
# Needs nginx (apt-get install nginx-light; installed if missing).
set -euo pipefail
cd "$(dirname "$0")/.."

MB=${MB:-512}
TRANSFERS=${TRANSFERS:-3}
ROUNDS=${ROUNDS:-3}
IDLE_CONNS=${IDLE_CONNS:-400}
IDLE_MB=${IDLE_MB:-4}
WORKERS=${WORKERS:-$(nproc)}
# shellcheck source=bench/common.sh
. bench/common.sh
read -r UP_PORT NGINX_PORT PC_PORT < <(free_ports 3 | xargs)

python3 bench/bodies.py sink "$UP_PORT" "$MB" & PIDS+=($!)

mkdir -p "$WORK/px" "$WORK/policies"
cat > "$WORK/px/nginx.conf" <<CONF
worker_processes $WORKERS;
pid $WORK/px/nginx.pid;
error_log $WORK/px/error.log;
events { worker_connections 4096; }
http {
  access_log off;
  upstream app { server 127.0.0.1:$UP_PORT; keepalive 64; }
  server {
    listen 127.0.0.1:$NGINX_PORT;
    client_max_body_size 0;
    client_body_buffer_size 64k;
    location / {
      proxy_pass http://app;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_request_buffering off;
      proxy_max_temp_file_size 0;
      proxy_buffer_size 64k;
      proxy_buffers 8 64k;
      proxy_busy_buffers_size 128k;
    }
  }
}
CONF
nginx -p "$WORK/px" -c "$WORK/px/nginx.conf" -g 'daemon off;' & PIDS+=($!)
NGINX_PID=$!

cat > "$WORK/policies/bench.yaml" <<YAML
listeners: [{ name: http, bind: "127.0.0.1:$PC_PORT" }]
upstreams: [{ name: app, endpoints: ["http://127.0.0.1:$UP_PORT"] }]
routes: [{ name: all, match: { path_prefix: / }, upstream: app }]
YAML
RUST_LOG=warn "$BIN" serve --admin off --workers "$WORKERS" --policies "$WORK/policies" & PIDS+=($!)
PC_PID=$!

wait_port "$UP_PORT"; wait_port "$NGINX_PORT"; wait_port "$PC_PORT"

MODES=(put chunked get put-get)
NAMES=(nginx portcullis)
PORTS=("$NGINX_PORT" "$PC_PORT")
PROCS=("$NGINX_PID" "$PC_PID")

# One way ($1) through proxy $2 on port $3: "MB/s cpu_ms_per_GiB", MB/s the
# median of the transfers.
measure() {
  local u1 s1 u2 s2 rates
  read -r u1 s1 <<<"$(cpu_ticks "$2")"
  rates=$(python3 bench/bodies.py client "$3" "$1" "$MB" "$TRANSFERS")
  read -r u2 s2 <<<"$(cpu_ticks "$2")"
  tr ' ' '\n' <<<"$rates" | sort -n | awk -v n="$TRANSFERS" -v c=$((u2 - u1 + s2 - s1)) -v t="$TICK_US" -v mb="$MB" \
    'NR == int((n + 1) / 2) { printf "%s %.0f\n", $1, c * t / 1000 / (n * mb / 1024) }'
}

# Memory held by idle keep-alive connections that each carried an upload
# (hyper keeps a connection's read buffer; Portcullis closes one an upload
# grew, see docs/forwarding.md). First, while both proxies are
# fresh: later, memory their allocators kept from the transfers is reused
# and nothing grows.
N_IDLE=$(python3 bench/bodies.py idle "$NGINX_PORT" "$IDLE_CONNS" "$IDLE_MB" "$NGINX_PID" $(pgrep -P "$NGINX_PID"))
P_IDLE=$(python3 bench/bodies.py idle "$PC_PORT" "$IDLE_CONNS" "$IDLE_MB" "$PC_PID")
echo "$IDLE_CONNS connections idle after a $IDLE_MB MiB upload each: RSS growth per connection nginx $N_IDLE KiB, portcullis $P_IDLE KiB"

for r in $(seq "$ROUNDS"); do
  line="round $r:"
  for m in "${MODES[@]}"; do
    for i in "${!NAMES[@]}"; do
      measure "$m" "${PROCS[$i]}" "${PORTS[$i]}" >> "$WORK/${NAMES[$i]}-$m.txt"
      line="$line $m ${NAMES[$i]} $(tail -1 "$WORK/${NAMES[$i]}-$m.txt") |"
    done
  done
  echo "$line (MB/s, CPU ms per GiB)"
done

echo
echo "$TRANSFERS bodies of $MB MiB per way and proxy, one connection, $WORKERS workers each, median of $ROUNDS rounds, $(nproc) cores"
printf "%-10s %12s %12s %8s %16s %16s %8s\n" way "nginx MB/s" "portcullis" ratio "nginx CPU/GiB" "portcullis" ratio
for m in "${MODES[@]}"; do
  NR_=$(col_median "$WORK/nginx-$m.txt" 1); PR=$(col_median "$WORK/portcullis-$m.txt" 1)
  NC=$(col_median "$WORK/nginx-$m.txt" 2); PC=$(col_median "$WORK/portcullis-$m.txt" 2)
  awk -v m="$m" -v nr="$NR_" -v pr="$PR" -v nc="$NC" -v pc="$PC" \
    'BEGIN { printf "%-10s %12d %12d %7.2fx %13d ms %13d ms %7.2fx\n", m, nr, pr, pr / nr, nc, pc, pc / nc }'
done
echo "(ratios: portcullis / nginx; MB/s higher is better, CPU per GiB lower is better)"

