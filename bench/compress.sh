#!/usr/bin/env bash
# What a route's `compress` costs and saves: one Portcullis process
# serving a 64 KiB JSON document (a workflow list, as argo-server answers)
# from one nginx worker, asked for it plain, gzipped and in brotli in
# alternated rounds. Prints requests/s, the proxy's CPU per request, the
# bytes on the wire, and the rate one core compresses at (the extra CPU
# per request over the document's size).
#
#   bench/compress.sh                      # 5 s rounds, 3 of each
#   DURATION=8 ROUNDS=5 LEVEL=5 BROTLI=5 bench/compress.sh
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION=${DURATION:-5}
ROUNDS=${ROUNDS:-3}
LEVEL=${LEVEL:-1}
BROTLI=${BROTLI:-2}
# shellcheck source=bench/common.sh
. bench/common.sh
read -r UP_PORT PC_PORT < <(free_ports 2 | paste -sd' ')

python3 - "$WORK/list.json" <<'PY'
import json, sys
items = []
i = 0
while len(json.dumps({"items": items})) < 64 * 1024:
    items.append({"metadata": {"name": f"ci-build-{i:05d}", "namespace": "argo",
                               "uid": f"{i * 2654435761 % 2**32:08x}-4c1d-9a7e-{i:012x}",
                               "labels": {"workflows.argoproj.io/phase": "Succeeded"}},
                  "status": {"phase": "Succeeded", "progress": "3/3",
                             "startedAt": f"2026-11-23T10:{i % 60:02d}:00Z"}})
    i += 1
open(sys.argv[1], "w").write(json.dumps({"items": items}))
PY
# nginx's worker (not root) reads the document.
chmod a+rx "$WORK"; chmod a+r "$WORK/list.json"
start_upstream "$UP_PORT"

mkdir -p "$WORK/policies"
cat > "$WORK/policies/bench.yaml" <<YAML
listeners: [{ name: http, bind: "127.0.0.1:$PC_PORT", max_requests_per_connection: 1000000 }]
upstreams: [{ name: argo, endpoints: ["http://127.0.0.1:$UP_PORT"] }]
routes:
  - { name: list, match: { path: /list.json }, upstream: argo, compress: { level: $LEVEL, brotli: $BROTLI } }
YAML
RUST_LOG=warn,access=off "$BIN" serve --workers 2 --policies "$WORK/policies" --admin off & PIDS+=($!)
PC_PID=$!
URL="http://127.0.0.1:$PC_PORT/list.json"
for _ in $(seq 100); do curl -sf -o /dev/null "$URL" && break; sleep 0.1; done

plain_bytes=$(curl -s -o /dev/null -w '%{size_download}' "$URL")
gzip_bytes=$(curl -s -H 'Accept-Encoding: gzip' -o /dev/null -w '%{size_download}' "$URL")
br_bytes=$(curl -s -H 'Accept-Encoding: br' -o /dev/null -w '%{size_download}' "$URL")
curl -s -H "Accept-Encoding: gzip" -o "$WORK/list.json.gz" "$URL"
gunzip -c "$WORK/list.json.gz" | cmp -s - "$WORK/list.json" \
  || { echo "the gzipped answer does not unzip to the document" >&2; exit 1; }

run() {
  with_cpu "$PC_PID" bash -c "wrk -t2 -c16 -d${DURATION}s --latency $1 '$URL' | wrk_figures"
}
export -f wrk_figures
: > "$WORK/plain"; : > "$WORK/gzip"; : > "$WORK/br"
for round in $(seq "$ROUNDS"); do
  run "" >> "$WORK/plain"
  run "-H 'Accept-Encoding: gzip'" >> "$WORK/gzip"
  run "-H 'Accept-Encoding: br'" >> "$WORK/br"
  echo "round $round: plain $(tail -1 "$WORK/plain") | gzip $(tail -1 "$WORK/gzip") | br $(tail -1 "$WORK/br")"
done

echo
echo "64 KiB JSON, gzip level $LEVEL, brotli quality $BROTLI, wrk -t2 -c16 -d${DURATION}s, 2 workers, median of $ROUNDS rounds"
printf '%-8s %11s %9s %9s %15s %14s\n' mode requests/s 'p50 (us)' 'p99 (us)' 'proxy CPU/req' 'bytes/answer'
p=$(median "$WORK/plain"); g=$(median "$WORK/gzip"); b=$(median "$WORK/br")
awk -v p="$p" -v g="$g" -v b="$b" -v pb="$plain_bytes" -v gb="$gzip_bytes" -v bb="$br_bytes" 'BEGIN {
  split(p, a, " "); split(g, z, " "); split(b, r, " ")
  printf "%-8s %11d %9.0f %9d %12.1f us %14d\n", "plain", a[1], a[2], a[3], a[4] + a[5], pb
  printf "%-8s %11d %9.0f %9d %12.1f us %14d\n", "gzip", z[1], z[2], z[3], z[4] + z[5], gb
  printf "%-8s %11d %9.0f %9d %12.1f us %14d\n", "br", r[1], r[2], r[3], r[4] + r[5], bb
  extra = (z[4] + z[5]) - (a[4] + a[5])
  printf "gzip: %.1fx smaller; +%.0f us of proxy CPU per answer, %.0f MB/s of JSON per core\n", pb / gb, extra, pb / extra
  extra = (r[4] + r[5]) - (a[4] + a[5])
  printf "br:   %.1fx smaller; +%.0f us of proxy CPU per answer, %.0f MB/s of JSON per core\n", pb / bb, extra, pb / extra
}'
