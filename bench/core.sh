#!/usr/bin/env bash
# Portcullis vs nginx as a reverse proxy, side by side in one run.
#
#   bench/core.sh                 # defaults below
#   DURATION=30 CONNECTIONS=128 ROUNDS=5 bench/core.sh
#   ACCESS_LOG=1 bench/core.sh    # and every proxy again, logging each request to a file
#
# Every proxy forwards to the same upstream (nginx answering a fixed 200 on
# its own port) with the same number of workers (WORKERS, default the core
# count) and access logs off (ACCESS_LOG=1: and each again as +log, logging
# every request to a file). Two nginx set-ups run beside Portcullis:
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
UP_PORT=$(free_port)
start_upstream "$UP_PORT"

NAMES=(); PORTS=(); PROCS=()
# Starts nginx as the reverse proxy under test: `start_nginx NAME LOG
# KEEPALIVE`, its access log `off` or a file; with KEEPALIVE `yes`, an
# upstream block with keep-alive (nginx-tuned), else proxy_pass as the
# runtime chart's routing service has it (nginx-chart: a new upstream
# connection per request).
start_nginx() {
  local name=$1 log=$2 port dir="$WORK/$1"
  port=$(free_port); mkdir -p "$dir"
  local upstream="" pass="http://127.0.0.1:$UP_PORT" keep=""
  if [ "$3" = yes ]; then
    upstream="upstream app { server 127.0.0.1:$UP_PORT; keepalive 256; }"
    pass="http://app"
    keep='proxy_http_version 1.1; proxy_set_header Connection "";'
  fi
  cat > "$dir/nginx.conf" <<CONF
worker_processes $WORKERS;
pid $dir/nginx.pid;
error_log $dir/error.log;
events { worker_connections 4096; }
http {
  access_log $log;
  keepalive_requests 1000000;
  $upstream
  server {
    listen 127.0.0.1:$port;
    location / {
      proxy_pass $pass;
      $keep
      proxy_set_header X-Forwarded-For \$proxy_add_x_forwarded_for;
      proxy_set_header X-Forwarded-Proto \$scheme;
      proxy_set_header X-Forwarded-Host \$http_host;
    }
  }
}
CONF
  nginx -p "$dir" -c "$dir/nginx.conf" -g 'daemon off;' & PIDS+=($!)
  NAMES+=("$name"); PORTS+=("$port"); PROCS+=($!)
}

# Portcullis with the same route (and nginx's keepalive_requests above
# for its client connections): `start_portcullis NAME LOG`, LOG `off` or
# a file its access lines go to (RUST_LOG=info, the default policies'
# logging: a line per request).
start_portcullis() {
  local name=$1 port dir="$WORK/$1"
  port=$(free_port); mkdir -p "$dir/policies"
  cat > "$dir/policies/bench.yaml" <<YAML
listeners: [{ name: http, bind: "127.0.0.1:$port", max_requests_per_connection: 1000000 }]
upstreams: [{ name: app, endpoints: ["http://127.0.0.1:$UP_PORT"] }]
routes: [{ name: all, match: { path_prefix: / }, upstream: app }]
YAML
  if [ "$2" = off ]; then
    RUST_LOG=warn "$BIN" serve --workers "$WORKERS" --policies "$dir/policies" --admin off & PIDS+=($!)
  elif ! "$BIN" serve --help | grep -q -- --access-log; then
    # A build from before --access-log: its lines went to stderr.
    RUST_LOG=info "$BIN" serve --workers "$WORKERS" --policies "$dir/policies" --admin off \
      2>>"$2" & PIDS+=($!)
  else
    RUST_LOG=info "$BIN" serve --workers "$WORKERS" --policies "$dir/policies" --admin off \
      --access-log "$2" 2>>"$dir/stderr.log" & PIDS+=($!)
  fi
  NAMES+=("$name"); PORTS+=("$port"); PROCS+=($!)
}

start_nginx nginx-tuned off yes
start_nginx nginx-chart off no
start_portcullis portcullis off
if [ "${ACCESS_LOG:-0}" = 1 ]; then
  # Every proxy again, logging every request to a file: nginx's default
  # (combined) format, unbuffered as ingress-nginx writes it; Portcullis's
  # default line, buffered as it ships.
  start_nginx nginx-tuned+log "$WORK/nginx-tuned+log/access.log" yes
  start_nginx nginx-chart+log "$WORK/nginx-chart+log/access.log" no
  start_portcullis portcullis+log "$WORK/portcullis+log/access.log"
fi

wait_port "$UP_PORT"; for port in "${PORTS[@]}"; do wait_port "$port"; done

# Prints "rps p50_us p99_us" for one wrk run.
run_wrk() { wrk -t"$WRK_THREADS" -c"$CONNECTIONS" -d"${DURATION}s" --latency "http://127.0.0.1:$1/bench" | wrk_figures; }
# Runs wrk on port $1 against process $2: "rps p50_us p99_us user_us sys_us
# loop_us" (CPU per request; see with_cpu).
measure() { with_cpu "$2" run_wrk "$1"; }

echo "warming up..."
for port in "${PORTS[@]}"; do wrk -t1 -c8 -d2s "http://127.0.0.1:$port/" >/dev/null; done

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
printf "%-16s %12s %10s %10s %12s %12s %14s\n" proxy "requests/s" "p50 (us)" "p99 (us)" "rps ratio" "p99 ratio" "CPU/req (us)"
# Each column's own median: the round with the median requests/s can
# have any p99 (one slow round in five decided the p99 ratio before).
P_RPS=$(col_median "$WORK/portcullis.txt" 1)
P_P99=$(col_median "$WORK/portcullis.txt" 3)
for n in "${NAMES[@]}"; do
  RPS=$(col_median "$WORK/$n.txt" 1); P50=$(col_median "$WORK/$n.txt" 2); P99=$(col_median "$WORK/$n.txt" 3)
  # CPU per request: the median round by user time, as user + system.
  read -r _ _ _ U S <<<"$(median "$WORK/$n.txt" 4)"
  awk -v n="$n" -v r="$RPS" -v a="$P50" -v b="$P99" -v pr="$P_RPS" -v pp="$P_P99" -v u="$U" -v s="$S" \
    'BEGIN { printf "%-16s %12d %10d %10d %11.2fx %11.2fx %6.1f + %5.1f\n", n, r, a, b, pr/r, pp/b, u, s }'
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
    'BEGIN { printf "%-16s %6.1f + %5.1f = %5.1f  -> %6.0f req/s at full use\n", n, l, u + s, l + u + s, c * 1e6 / (l + u + s) }'
done
read -r _ _ _ NU NS NL <<<"$(median "$WORK/nginx-tuned.txt" 4)"
read -r _ _ _ PU PS PL <<<"$(median "$WORK/portcullis.txt" 4)"
awk -v nu="$NU" -v ns="$NS" -v nl="$NL" -v pu="$PU" -v ps="$PS" -v pl="$PL" 'BEGIN {
  n = nu + ns; p = pu + ps; need = (nl + n) / 1.1 - pl
  printf "portcullis uses %.2fx the CPU per request of nginx-tuned (user %.2fx, system %.2fx).\n", p / n, pu / nu, ps / ns
  printf "1.1x nginx-tuned here needs the proxy at %.1f us/req (%.2fx nginx-tuned'"'"'s); with its system time\n", need, need / n
  printf "as it is (%.1f us), that leaves %.1f us of user time; user time 0 would give %.2fx.\n", ps, need - ps, (nl + n) / (pl + ps)
}'

if [ "${ACCESS_LOG:-0}" = 1 ]; then
  echo
  echo "With access logs on (a line per request to a file):"
  paste "$WORK/portcullis+log.txt" "$WORK/nginx-tuned+log.txt" | awk '{ print $1 / $7, $3 / $9 }' > "$WORK/ratios-log.txt"
  awk '{ r = r sprintf(" %.2f", $1) } END { print "per round portcullis+log vs nginx-tuned+log: rps" r }' "$WORK/ratios-log.txt"
  read -r _ _ _ NU NS _ <<<"$(median "$WORK/nginx-tuned+log.txt" 4)"
  read -r _ _ _ PU PS _ <<<"$(median "$WORK/portcullis+log.txt" 4)"
  read -r _ _ _ QU QS _ <<<"$(median "$WORK/portcullis.txt" 4)"
  read -r _ _ _ MU MS _ <<<"$(median "$WORK/nginx-tuned.txt" 4)"
  awk -v nu="$NU" -v ns="$NS" -v pu="$PU" -v ps="$PS" -v qu="$QU" -v qs="$QS" -v mu="$MU" -v ms="$MS" \
    -v rr="$(col_median "$WORK/ratios-log.txt" 1)" 'BEGIN {
    printf "median rps ratio %.2fx; CPU per request %.2fx nginx-tuned+log'"'"'s (user %.2fx, system %.2fx)\n", rr, (pu + ps) / (nu + ns), pu / nu, ps / ns
    printf "a line costs portcullis %.1f us, nginx-tuned %.1f us (CPU per request, logs on - off)\n", pu + ps - qu - qs, nu + ns - mu - ms
  }'
  for n in nginx-tuned+log nginx-chart+log portcullis+log; do
    printf "%-16s %10d lines written\n" "$n" "$(wc -l < "$WORK/$n/access.log")"
  done
fi
