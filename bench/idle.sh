#!/usr/bin/env bash
# Memory held by idle keep-alive client connections, nginx against
# Portcullis as reverse proxies, over HTTP, HTTPS, and HTTP/2 on TLS (as
# browsers connect).
#
#   bench/idle.sh                      # CONNS=2000
#
# For each protocol, fresh proxies (two workers each) in turn: CONNS client
# connections each make one request (bench/bodies.py idle) and stay open;
# the figure is the growth of the proxy's resident memory (all its
# processes) per connection, four seconds after the last one was answered
# (Portcullis parks an idle HTTP/1 connection within a second, and hands
# the freed memory back within two more).
# Kernel socket buffers are not in it, for either. A fresh process each
# time: memory an allocator kept from earlier connections would hide the
# cost of new ones. The upstream is one nginx worker answering a small
# body. Needs nginx (installed if missing).
set -euo pipefail
cd "$(dirname "$0")/.."

CONNS=${CONNS:-2000}
WORKERS=${WORKERS:-$(nproc)}
# shellcheck source=bench/common.sh
. bench/common.sh
UP=$(free_port)
start_upstream "$UP"
wait_port "$UP"
make_pki localhost
chmod a+rx "$WORK"; chmod a+r "$WORK/leaf.key"

# One fresh nginx on port $2: TLS unless $1 is http, and HTTP/2 when it is h2;
# its master's pid in STARTED.
start_nginx() {
  local dir="$WORK/nginx-$1" listen="127.0.0.1:$2" tls=""
  mkdir -p "$dir"
  if [ "$1" != http ]; then
    listen="$listen ssl"
    [ "$1" = h2 ] && listen="$listen http2"
    tls="ssl_certificate $WORK/leaf.pem; ssl_certificate_key $WORK/leaf.key; ssl_session_cache shared:SSL:10m;"
  fi
  cat > "$dir/nginx.conf" <<CONF
worker_processes $WORKERS;
pid $dir/nginx.pid;
error_log $dir/error.log;
worker_rlimit_nofile 20000;
events { worker_connections 8192; }
http {
  access_log off;
  keepalive_requests 1000000;
  keepalive_timeout 600s;
  upstream app { server 127.0.0.1:$UP; keepalive 64; }
  server {
    listen $listen;
    $tls
    location / {
      proxy_pass http://app;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }
  }
}
CONF
  nginx -p "$dir" -c "$dir/nginx.conf" -g 'daemon off;' >/dev/null 2>&1 &
  STARTED=$!; PIDS+=("$STARTED")
}

# One fresh Portcullis on port $2, TLS (ALPN h2 and http/1.1) unless $1 is
# http; its pid in STARTED.
start_portcullis() {
  local dir="$WORK/pc-$1" tls=""
  mkdir -p "$dir"
  [ "$1" != http ] && tls=", tls: { cert: $WORK/leaf.pem, key: $WORK/leaf.key }"
  cat > "$dir/bench.yaml" <<YAML
listeners: [{ name: l, bind: "127.0.0.1:$2", max_requests_per_connection: 1000000$tls }]
upstreams: [{ name: app, endpoints: ["http://127.0.0.1:$UP"] }]
routes: [{ name: all, match: { path_prefix: / }, upstream: app }]
YAML
  RUST_LOG=warn PORTCULLIS_MAX_CONNECTIONS=$((CONNS * 2)) "$BIN" serve --admin off \
    --workers "$WORKERS" --policies "$dir" >/dev/null 2>&1 &
  STARTED=$!; PIDS+=("$STARTED")
}

# KiB per idle connection through a fresh proxy $2 over protocol $1, in
# the file $WORK/$1-$2.
measure() {
  local port pid pids
  port=$(free_port)
  "start_$2" "$1" "$port"
  pid=$STARTED
  local scheme=https tls=$1
  [ "$1" = http ] && scheme=http tls=0
  [ "$1" = https ] && tls=1
  for _ in $(seq 100); do curl -fsk -o /dev/null "$scheme://localhost:$port/" && break; sleep 0.1; done
  pids="$pid $(pgrep -P "$pid" | xargs || true)"
  # shellcheck disable=SC2086
  IDLE_TLS=$tls python3 bench/bodies.py idle "$port" "$CONNS" 0 $pids > "$WORK/$1-$2"
  kill "$pid"; wait "$pid" 2>/dev/null || true
}

echo "$CONNS idle keep-alive connections, one request each, $WORKERS workers: RSS growth per connection"
printf '%-6s %12s %12s %8s\n' proto nginx portcullis ratio
for proto in http https h2; do
  measure "$proto" nginx; measure "$proto" portcullis
  n=$(cat "$WORK/$proto-nginx"); p=$(cat "$WORK/$proto-portcullis")
  awk -v t="$proto" -v n="$n" -v p="$p" 'BEGIN { printf "%-6s %9s KiB %9s KiB %7.1fx\n", t, n, p, p / (n > 0 ? n : 1) }'
done
