#!/usr/bin/env bash
# The example plugin in Rust, Python and JavaScript against no plugin, on
# one proxy: how long the policies take to load (the interpreters'
# components compile then), p50 at one connection and requests/s at 16,
# the routes alternated within each round. Builds the release binary and
# the three examples; wrk, the proxy and the upstream share the machine.
#
#   bench/languages.sh                      # 3 rounds of 4 s per route
#   ROUNDS="1" PATHS="/js" JS_MEMORY=64MiB bench/languages.sh
set -euo pipefail
cd "$(dirname "$0")/.."
plugins/build.sh >/dev/null
plugins/examples/require-header-py/build.sh >/dev/null
plugins/examples/require-header-js/build.sh >/dev/null
# shellcheck source=bench/common.sh
. bench/common.sh
UP=$(free_port); PC=$(free_port)
start_upstream "$UP"
mkdir -p "$WORK/p"
cp plugins/dist/example-require-header{,-py,-js}.wasm "$WORK/p/"
cat > "$WORK/p/bench.yaml" <<YAML
listeners: [{ name: http, bind: "127.0.0.1:$PC", max_requests_per_connection: 0 }]
upstreams: [{ name: app, endpoints: ["http://127.0.0.1:$UP"] }]
plugins:
  - { name: rs, path: example-require-header.wasm }
  - { name: py, path: example-require-header-py.wasm }
  - { name: js, path: example-require-header-js.wasm }
routes:
  - { name: plain, match: { path: /plain }, upstream: app }
  - { name: rs, match: { path: /rs }, upstream: app, plugins: [{ use: rs, config: { header: x-api-key } }] }
  - { name: py, match: { path: /py }, upstream: app, plugins: [{ use: py, config: { header: x-api-key } }] }
  - { name: js, match: { path: /js }, upstream: app, plugins: [{ use: js, config: { header: x-api-key }, memory: ${JS_MEMORY:-16MiB} }] }
YAML
t0=$(date +%s.%N)
RUST_LOG=warn,access=off "$BIN" serve --policies "$WORK/p" --workers 2 --admin off &
PIDS+=($!)
until curl -s -o /dev/null "http://127.0.0.1:$PC/plain"; do sleep 0.05; done
echo "policies loaded, plugins compiled: $(echo "$(date +%s.%N) - $t0" | bc) s"
# The header is sent, so every plugin forwards; non-2xx counts failures.
for round in ${ROUNDS:-1 2 3}; do
  for path in ${PATHS:-/plain /rs /py /js}; do
    c1=$(wrk -t1 -c1 -d4s -H 'x-api-key: k' --latency "http://127.0.0.1:$PC$path" | awk '/ 50%/{print $2}')
    c16=$(wrk -t2 -c16 -d4s -H 'x-api-key: k' "http://127.0.0.1:$PC$path" \
      | awk '/Non-2xx/{n=$NF} /Requests\/sec/{r=$2} END{print r, "non-2xx=" (n ? n : 0)}')
    echo "round $round $path p50(c1)=$c1 rps(c16)=$c16"
  done
done
