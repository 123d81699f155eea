#!/usr/bin/env bash
# Portcullis vs nginx as a reverse proxy, side by side in one run.
#
#   bench/core.sh                 # defaults below
#   DURATION=30 CONNECTIONS=128 ROUNDS=5 bench/core.sh
#
# Every proxy forwards to the same upstream (nginx answering a fixed 200 on
# its own port) with the same number of workers (WORKERS, default the core
# count) and access logs off. Two nginx set-ups run beside Portcullis:
#   nginx-tuned  upstream keep-alive (keepalive 256, HTTP/1.1): nginx at its best;
#   nginx-chart  proxy_pass as in the runtime chart's routing service that
#                Portcullis replaces: a new upstream connection per request.
# Both nginx set-ups send the upstream the same X-Forwarded-For, -Proto and
# -Host headers that Portcullis sends, so all three do the same work.
# wrk drives each in turn, ROUNDS times; the table shows each column's
# median over the rounds, with each proxy's own CPU time per request (user
# and system, from /proc, all its processes): on a small shared machine
# requests/s swing by ~10% between runs, CPU per request much less. Then
# Portcullis against nginx-tuned round by round, and the median of those.
# Last, the CPU budget of the whole loop (wrk + upstream + proxy): when they
# share the cores, requests/s is about cores / loop CPU per request, which
# tells how far a proxy's own CPU can move the ratio on this machine.
# Needs wrk and nginx (apt-get install wrk nginx-light); installs them if
# missing.
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${DURATION:-15}
CONNECTIONS=${CONNECTIONS:-64}
ROUNDS=${ROUNDS:-3}
WORKERS=${WORKERS:-$(nproc)}
WRK_THREADS=${WRK_THREADS:-2}
# shellcheck source=bench/common.sh
. bench/common.sh
UP_PORT=$(free_port); NGINX_PORT=$(free_port); CHART_PORT=$(free_port); PC_PORT=$(free_port)
mkdir -p "$WORK/px" "$WORK/chart"
start_upstream "$UP_PORT"

# nginx as the reverse proxy under test.
cat > "$WORK/px/nginx.conf" <<CONF
worker_processes $WORKERS;
pid $WORK/px/nginx.pid;
error_log $WORK/px/error.log;
events { worker_connections 4096; }
http {
  access_log off;
  keepalive_requests 1000000;
  upstream app { server 127.0.0.1:$UP_PORT; keepalive 256; }
  server {
    listen 127.0.0.1:$NGINX_PORT;
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
TUNED_PID=$!

# nginx as the runtime chart configures its routing service (no upstream block).
cat > "$WORK/chart/nginx.conf" <<CONF
worker_processes $WORKERS;
pid $WORK/chart/nginx.pid;
error_log $WORK/chart/error.log;
events { worker_connections 4096; }
http {
  access_log off;
  keepalive_requests 1000000;
  server {
    listen 127.0.0.1:$CHART_PORT;
    location / {
      proxy_pass http://127.0.0.1:$UP_PORT;
      proxy_set_header X-Forwarded-For \$proxy_add_x_forwarded_for;
      proxy_set_header X-Forwarded-Proto \$scheme;
      proxy_set_header X-Forwarded-Host \$http_host;
    }
  }
}
CONF
nginx -p "$WORK/chart" -c "$WORK/chart/nginx.conf" -g 'daemon off;' & PIDS+=($!)
CHART_PID=$!

# Portcullis with the same route (and nginx's keepalive_requests above
# for its client connections).
mkdir -p "$WORK/policies"
cat > "$WORK/policies/bench.yaml" <<YAML
listeners: [{ name: http, bind: "127.0.0.1:$PC_PORT", max_requests_per_connection: 1000000 }]
upstreams: [{ name: app, endpoints: ["http://127.0.0.1:$UP_PORT"] }]
routes: [{ name: all, match: { path_prefix: / }, upstream: app }]
YAML
RUST_LOG=warn "$BIN" serve --workers "$WORKERS" --policies "$WORK/policies" & PIDS+=($!)
PC_PID=$!

wait_port "$UP_PORT"; wait_port "$NGINX_PORT"; wait_port "$CHART_PORT"; wait_port "$PC_PORT"

# Prints "rps p50_us p99_us" for one wrk run.
run_wrk() { wrk -t"$WRK_THREADS" -c"$CONNECTIONS" -d"${DURATION}s" --latency "http://127.0.0.1:$1/bench" | wrk_figures; }
# Runs wrk on port $1 against process $2: "rps p50_us p99_us user_us sys_us
# loop_us" (CPU per request; see with_cpu).
measure() { with_cpu "$2" run_wrk "$1"; }

echo "warming up..."
for port in "$NGINX_PORT" "$CHART_PORT" "$PC_PORT"; do wrk -t1 -c8 -d2s "http://127.0.0.1:$port/" >/dev/null; done

NAMES=(nginx-tuned nginx-chart portcullis)
PORTS=("$NGINX_PORT" "$CHART_PORT" "$PC_PORT")
PROCS=("$TUNED_PID" "$CHART_PID" "$PC_PID")
for n in "${NAMES[@]}"; do : > "$WORK/$n.txt"; done
for r in $(seq "$ROUNDS"); do
  line="round $r:"
  for i in "${!NAMES[@]}"; do
    measure "${PORTS[$i]}" "${PROCS[$i]}" >> "$WORK/${NAMES[$i]}.txt"
    line="$line ${NAMES[$i]} $(tail -1 "$WORK/${NAMES[$i]}.txt") |"
  done
  echo "$line (rps p50us p99us user-us/req sys-us/req wrk+upstream-us/req)"
done

echo
echo "wrk -t$WRK_THREADS -c$CONNECTIONS -d${DURATION}s, $WORKERS workers each, median of $ROUNDS rounds, $(nproc) cores"
printf "%-12s %12s %10s %10s %12s %12s %14s\n" proxy "requests/s" "p50 (us)" "p99 (us)" "rps ratio" "p99 ratio" "CPU/req (us)"
# Each column's own median: the round with the median requests/s can
# have any p99 (one slow round in five decided the p99 ratio before).
P_RPS=$(col_median "$WORK/portcullis.txt" 1)
P_P99=$(col_median "$WORK/portcullis.txt" 3)
for n in "${NAMES[@]}"; do
  RPS=$(col_median "$WORK/$n.txt" 1); P50=$(col_median "$WORK/$n.txt" 2); P99=$(col_median "$WORK/$n.txt" 3)
  # CPU per request: the median round by user time, as user + system.
  read -r _ _ _ U S <<<"$(median "$WORK/$n.txt" 4)"
  awk -v n="$n" -v r="$RPS" -v a="$P50" -v b="$P99" -v pr="$P_RPS" -v pp="$P_P99" -v u="$U" -v s="$S" \
    'BEGIN { printf "%-12s %12d %10d %10d %11.2fx %11.2fx %6.1f + %5.1f\n", n, r, a, b, pr/r, pp/b, u, s }'
done
echo "(ratios: portcullis / that row; rps higher is better, p99 lower is better;"
echo " CPU/req: the proxy's own user + system time per request)"
# The proxies ran one after another in each round, so a round's ratio
# compares them under the same machine load; their median is the steadier
# figure when the load moves between rounds.
paste "$WORK/portcullis.txt" "$WORK/nginx-tuned.txt" | awk '{ print $1 / $7, $3 / $9 }' > "$WORK/ratios.txt"
awk '{ r = r sprintf(" %.2f", $1); q = q sprintf(" %.2f", $2) } END { print "per round vs nginx-tuned: rps" r "; p99" q }' "$WORK/ratios.txt"
echo "median of the rounds: rps $(col_median "$WORK/ratios.txt" 1 | xargs printf %.2f)x, p99 $(col_median "$WORK/ratios.txt" 2 | xargs printf %.2f)x"

# The loop's CPU budget. wrk, the upstream and the proxy share the cores, so
# requests/s ~ cores / (their CPU per request): a proxy's ratio to
# nginx-tuned is bounded by how much of the loop it owns.
echo
echo "CPU per request of the whole loop (median rounds, us): wrk + upstream, proxy, sum; cores / sum"
for n in "${NAMES[@]}"; do
  read -r _ _ _ U S L <<<"$(median "$WORK/$n.txt" 4)"
  awk -v n="$n" -v u="$U" -v s="$S" -v l="$L" -v c="$(nproc)" \
    'BEGIN { printf "%-12s %6.1f + %5.1f = %5.1f  -> %6.0f req/s at full use\n", n, l, u + s, l + u + s, c * 1e6 / (l + u + s) }'
done
read -r _ _ _ NU NS NL <<<"$(median "$WORK/nginx-tuned.txt" 4)"
read -r _ _ _ PU PS PL <<<"$(median "$WORK/portcullis.txt" 4)"
awk -v nu="$NU" -v ns="$NS" -v nl="$NL" -v pu="$PU" -v ps="$PS" -v pl="$PL" 'BEGIN {
  n = nu + ns; p = pu + ps; need = (nl + n) / 1.1 - pl
  printf "portcullis uses %.2fx the CPU per request of nginx-tuned (user %.2fx, system %.2fx).\n", p / n, pu / nu, ps / ns
  printf "1.1x nginx-tuned here needs the proxy at %.1f us/req (%.2fx nginx-tuned'"'"'s); with its system time\n", need, need / n
  printf "as it is (%.1f us), that leaves %.1f us of user time; user time 0 would give %.2fx.\n", ps, need - ps, (nl + n) / (pl + ps)
}'
