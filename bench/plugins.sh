#!/usr/bin/env bash
# The cost of a header-only auth plugin: the same route with and without
# jwt-auth (HS256 bearer token), in one Portcullis process, side by side.
#
#   bench/plugins.sh                    # defaults below
#   DURATION=20 ROUNDS=5 bench/plugins.sh
#
# Routes (same upstream: one nginx worker answering a fixed body):
#   /plain   no plugin
#   /key     the SDK example (require-header): a header-only API-key check
#   /auth    jwt-auth (HS256), instances reused (the default)
#   /fresh   jwt-auth, a new instance per request (instances: per-request)
# Throughput: wrk -c$CONNECTIONS, median of ROUNDS. Added latency per call:
# p50 with one connection (-c1), minus the plain route's.
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${DURATION:-10}
CONNECTIONS=${CONNECTIONS:-64}
ROUNDS=${ROUNDS:-3}
WORKERS=${WORKERS:-$(nproc)}
plugins/build.sh >/dev/null
# shellcheck source=bench/common.sh
. bench/common.sh
UP_PORT=$(free_port); PC_PORT=$(free_port)
mkdir -p "$WORK/policies"
start_upstream "$UP_PORT"

cp plugins/dist/jwt-auth.wasm plugins/dist/example-require-header.wasm "$WORK/policies/"
cat > "$WORK/policies/bench.yaml" <<YAML
listeners: [{ name: http, bind: "127.0.0.1:$PC_PORT" }]
upstreams: [{ name: app, endpoints: ["http://127.0.0.1:$UP_PORT"] }]
plugins: [{ name: jwt, path: jwt-auth.wasm }, { name: key, path: example-require-header.wasm }]
routes:
  - { name: plain, match: { path: /plain }, upstream: app }
  - { name: key, match: { path: /key }, upstream: app, plugins: [{ use: key, config: { header: authorization } }] }
  - { name: auth, match: { path: /auth }, upstream: app, plugins: [{ use: jwt, config: { hs256_secret: bench-secret } }] }
  - { name: fresh, match: { path: /fresh }, upstream: app, plugins: [{ use: jwt, instances: per-request, config: { hs256_secret: bench-secret } }] }
YAML
RUST_LOG=warn "$BIN" serve --workers "$WORKERS" --policies "$WORK/policies" & PIDS+=($!)

# An HS256 token for the bench secret, valid for an hour.
TOKEN=$(python3 - <<'PY'
import base64, hmac, hashlib, json, time
b = lambda d: base64.urlsafe_b64encode(d).rstrip(b"=").decode()
h = b(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
c = b(json.dumps({"sub": "bench", "exp": int(time.time()) + 3600}).encode())
s = b(hmac.new(b"bench-secret", f"{h}.{c}".encode(), hashlib.sha256).digest())
print(f"{h}.{c}.{s}")
PY
)
for _ in $(seq 100); do curl -fsS -H "authorization: Bearer $TOKEN" "http://127.0.0.1:$PC_PORT/auth" >/dev/null 2>&1 && break; sleep 0.1; done
curl -fsS -H "authorization: Bearer $TOKEN" "http://127.0.0.1:$PC_PORT/auth" >/dev/null

run_wrk() { # path threads connections -> "rps p50_us p99_us"
  wrk -t"$2" -c"$3" -d"${DURATION}s" --latency -H "authorization: Bearer $TOKEN" "http://127.0.0.1:$PC_PORT$1" | wrk_figures
}
for p in /plain /key /auth /fresh; do wrk -t1 -c8 -d2s -H "authorization: Bearer $TOKEN" "http://127.0.0.1:$PC_PORT$p" >/dev/null; done

for p in plain key auth fresh; do : > "$WORK/$p.c64"; : > "$WORK/$p.c1"; done
for r in $(seq "$ROUNDS"); do
  for p in plain key auth fresh; do
    run_wrk "/$p" 2 "$CONNECTIONS" >> "$WORK/$p.c64"
    run_wrk "/$p" 1 1 >> "$WORK/$p.c1"
  done
  echo "round $r: $(for p in plain key auth fresh; do echo -n "$p [$(tail -1 "$WORK/$p.c64") | c1 $(tail -1 "$WORK/$p.c1")] "; done)"
done
read -r BASE _ _ <<<"$(median "$WORK/plain.c64" 1)"
read -r _ BASE_P50 _ <<<"$(median "$WORK/plain.c1" 2)"
echo
echo "wrk -t2 -c$CONNECTIONS -d${DURATION}s (throughput) and -t1 -c1 (latency), $WORKERS workers, median of $ROUNDS rounds"
printf "%-8s %12s %10s %14s %16s\n" route "requests/s" "vs plain" "p50 -c1 (us)" "added p50 (us)"
for p in plain key auth fresh; do
  read -r RPS _ _ <<<"$(median "$WORK/$p.c64" 1)"
  read -r _ P50 _ <<<"$(median "$WORK/$p.c1" 2)"
  awk -v n="$p" -v r="$RPS" -v b="$BASE" -v l="$P50" -v bl="$BASE_P50" \
    'BEGIN { printf "%-8s %12d %9.1f%% %14.1f %16.1f\n", n, r, (r/b-1)*100, l, l-bl }'
done
