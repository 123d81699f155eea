#!/usr/bin/env bash
# The routing core's memory copies per request, by call site and size:
# how many times a request's futures and responses are moved, and where.
# callgrind counts the instructions of `memcpy` but not which move made
# them; this counts the calls themselves (an LD_PRELOAD shim,
# bench/copies_shim.c), for the default policies' app-proxy route on one
# keep-alive connection, and names each site's source lines. A change
# that makes a response or a future larger shows up here as more bytes, or
# as a copy past 256 bytes (glibc's memcpy loops from there: twice the
# instructions). Needs cc and addr2line (build-essential, binutils).
#
#   bench/copies.sh                                  # 1000 requests, top 30 sites
#   REQUESTS=2000 TOP=50 bench/copies.sh
#   PORTCULLIS_BIN=/tmp/after BASE_BIN=/tmp/before bench/copies.sh
set -euo pipefail
cd "$(dirname "$0")/.."
REQUESTS=${REQUESTS:-1000}
TOP=${TOP:-30}
if ! command -v cc >/dev/null || ! command -v addr2line >/dev/null; then
  apt-get update -qq && apt-get install -y -qq build-essential binutils >/dev/null
fi
# shellcheck source=bench/common.sh
. bench/common.sh
read -r UP_PORT PD_PORT < <(free_ports 2 | xargs)
start_upstream "$UP_PORT"
wait_port "$UP_PORT"
cc -O2 -fPIC -shared -fno-builtin -o "$WORK/copies_shim.so" bench/copies_shim.c

echo "# $(git rev-parse --short HEAD)$(git diff --quiet || echo '+changes'), $REQUESTS requests after 100, 1 worker"
python3 bench/copies.py "$WORK/copies_shim.so" "$BIN" "$UP_PORT" "$PD_PORT" "$WORK" "$REQUESTS" "$TOP" "${BASE_BIN:-}"
