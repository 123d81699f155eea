#!/usr/bin/env bash
# HTTPS termination: Portcullis (rustls) vs nginx (OpenSSL) side by side,
# same certificate, same upstream (one nginx worker), same worker count,
# access logs off, in alternated rounds. Two loads:
#   keep-alive  wrk's connections stay open: the cost of the record layer
#               (AES-GCM or ChaCha20) on top of proxying;
#   handshake   `Connection: close` on every request: one handshake per
#               request, resumed from a session ticket as wrk (like a
#               browser) offers its last session: the cost of
#               clients that reconnect rather than keep connections;
#   new-session eight `openssl s_time -new` clients, each a full handshake
#               (no session offered) and a GET per connection: what first
#               visits cost, where the server's signature dominates.
# (p50/p99 are wrk's; s_time gives none.)
# Each row gives requests/s, p50/p99, and the proxy's CPU per request.
#
#   bench/tls.sh                          # RSA 2048 (cert-manager's default), 8 s rounds, 3 of each
#   KEY=ec DURATION=10 ROUNDS=5 bench/tls.sh   # ECDSA P-256
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${DURATION:-8}
ROUNDS=${ROUNDS:-3}
CONNECTIONS=${CONNECTIONS:-64}
WORKERS=${WORKERS:-$(nproc)}
KEY=${KEY:-rsa}
# shellcheck source=bench/common.sh
. bench/common.sh
read -r UP NGINX_PORT PC_PORT < <(free_ports 3 | paste -sd' ')
start_upstream "$UP"

# The certificate both serve: RSA 2048 or ECDSA P-256, for localhost.
(
  cd "$WORK"
  if [ "$KEY" = ec ]; then
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout tls.key -out tls.crt \
      -days 2 -subj /CN=localhost -addext subjectAltName=DNS:localhost 2>/dev/null
  else
    openssl req -x509 -newkey rsa:2048 -nodes -keyout tls.key -out tls.crt \
      -days 2 -subj /CN=localhost -addext subjectAltName=DNS:localhost 2>/dev/null
  fi
)
# nginx's workers read the key as another user.
chmod a+rx "$WORK"; chmod a+r "$WORK/tls.key"

mkdir -p "$WORK/px"
cat > "$WORK/px/nginx.conf" <<CONF
worker_processes $WORKERS;
pid $WORK/px/nginx.pid;
error_log $WORK/px/error.log;
events { worker_connections 4096; }
http {
  access_log off;
  keepalive_requests 1000000;
  upstream app { server 127.0.0.1:$UP; keepalive 256; }
  server {
    listen 127.0.0.1:$NGINX_PORT ssl;
    ssl_certificate $WORK/tls.crt;
    ssl_certificate_key $WORK/tls.key;
    # As Portcullis: TLS 1.2 and 1.3, sessions resumed from stateless
    # tickets (nginx's default, spelled out) backed by a server-side
    # cache. wrk resumes its sessions (it reuses each connection's SSL
    # object), as browsers do.
    ssl_protocols TLSv1.2 TLSv1.3;
    ssl_session_cache shared:SSL:10m;
    ssl_session_tickets on;
    location / {
      proxy_pass http://app;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_set_header X-Forwarded-For \$proxy_add_x_forwarded_for;
      proxy_set_header X-Forwarded-Proto \$scheme;
      proxy_set_header X-Forwarded-Host \$http_host;
    }
  }
}
CONF
nginx -p "$WORK/px" -c "$WORK/px/nginx.conf" -g 'daemon off;' & PIDS+=($!)
NGINX_PID=$!

mkdir -p "$WORK/policies"
cat > "$WORK/policies/bench.yaml" <<YAML
listeners: [{ name: https, bind: "127.0.0.1:$PC_PORT", max_requests_per_connection: 1000000, tls: { cert: ../tls.crt, key: ../tls.key } }]
upstreams: [{ name: app, endpoints: ["http://127.0.0.1:$UP"] }]
routes: [{ name: all, match: { path_prefix: / }, upstream: app }]
YAML
RUST_LOG=warn "$BIN" serve --workers "$WORKERS" --policies "$WORK/policies" --admin off & PIDS+=($!)
PC_PID=$!

for port in "$NGINX_PORT" "$PC_PORT"; do
  for _ in $(seq 100); do curl -fsSk -o /dev/null "https://localhost:$port/" && continue 2; sleep 0.1; done
  echo "not answering on $port" >&2; exit 1
done

# "rps p50 p99 user_us sys_us loop_us" for wrk on port $2 (load $3) with
# the CPU of process $1.
run() {
  local pid=$1 port=$2 load=$3 extra=""
  [ "$load" = handshake ] && extra="-H 'Connection: close'"
  if [ "$load" = new-session ]; then
    with_cpu "$pid" full_handshakes "$port"
    return
  fi
  with_cpu "$pid" bash -c "wrk -t2 -c$CONNECTIONS -d${DURATION}s --latency $extra 'https://localhost:$port/' | wrk_figures"
}
export -f wrk_figures
# Eight s_time clients for DURATION seconds on port $1: "rps 0 0".
full_handshakes() {
  local i
  {
    for i in $(seq 8); do
      openssl s_time -connect "localhost:$1" -new -www / -time "$DURATION" 2>/dev/null | grep 'connections in' &
    done
    wait
  } | awk -v d="$DURATION" '{ n += $1 } END { printf "%.0f 0 0\n", n / d }'
}
export -f full_handshakes
export DURATION

echo "warming up..."
for port in "$NGINX_PORT" "$PC_PORT"; do wrk -t1 -c8 -d2s "https://localhost:$port/" >/dev/null; done
for load in keep-alive handshake new-session; do
  : > "$WORK/nginx-$load"; : > "$WORK/portcullis-$load"
  for round in $(seq "$ROUNDS"); do
    run "$NGINX_PID" "$NGINX_PORT" "$load" >> "$WORK/nginx-$load"
    run "$PC_PID" "$PC_PORT" "$load" >> "$WORK/portcullis-$load"
    echo "$load round $round: nginx $(tail -1 "$WORK/nginx-$load") | portcullis $(tail -1 "$WORK/portcullis-$load")"
  done
done

echo
echo "wrk -t2 -c$CONNECTIONS -d${DURATION}s over HTTPS ($KEY key), $WORKERS workers each, median of $ROUNDS rounds, $(nproc) cores"
printf "%-11s %-11s %11s %9s %9s %18s\n" load proxy "requests/s" "p50 (us)" "p99 (us)" "proxy CPU/req (us)"
for load in keep-alive handshake new-session; do
  n=$(median "$WORK/nginx-$load"); p=$(median "$WORK/portcullis-$load")
  awk -v l="$load" -v n="$n" -v p="$p" 'BEGIN {
    split(n, a, " "); split(p, b, " ")
    printf "%-11s %-11s %11d %9.0f %9d %11.1f + %4.1f\n", l, "nginx", a[1], a[2], a[3], a[4], a[5]
    printf "%-11s %-11s %11d %9.0f %9d %11.1f + %4.1f\n", l, "portcullis", b[1], b[2], b[3], b[4], b[5]
    p99 = a[3] > 0 ? sprintf(", %.2fx p99", b[3] / a[3]) : ""
    printf "%-11s portcullis / nginx: %.2fx requests/s%s, %.2fx CPU per request\n", l, b[1] / a[1], p99, (b[4] + b[5]) / (a[4] + a[5])
  }'
done
