#!/usr/bin/env bash
# Instructions per request, counted by valgrind (cachegrind): the routing
# core and the plugin path, in figures that move far less with the
# machine's load than requests/s. On two shared cores requests/s swings by
# 10% between runs, which hides a change worth 3%; the instruction count
# of the same binary repeats within ~0.5% (see bench/instructions.py);
# the script gives the median of REPEAT and the range. Use it to compare
# a change (build, run, note the figures);
# requests/s and latency stay bench/core.sh's and bench/plugins.sh's.
#
#   bench/instructions.sh              # /plain, /key, /auth; 2000 requests, median of 3
#   REQUESTS=5000 REPEAT=5 TOP=20 PATHS="/plain /verify" bench/instructions.sh
#   BASE_BIN=/tmp/portcullis-before PATHS=/plain bench/instructions.sh   # two builds, one sitting
#
# Routes as in bench/plugins.sh (one nginx worker upstream):
#   /plain  no plugin;  /key  the SDK example (header-only API-key check);
#   /auth   jwt-auth (HS256, verified token remembered); also /verify.
# Under valgrind the plugin instance pool cannot reserve its address space,
# so instances are allocated on demand (the proxy warns); calls on reused
# instances, which is what is counted, are the same.
# Instructions are not time: cache misses and system calls are not in
# them. TOP lists the functions that add most over /plain (with BASE_BIN:
# those that moved most between the two builds).
set -euo pipefail
cd "$(dirname "$0")/.."

REQUESTS=${REQUESTS:-2000}
TOP=${TOP:-12}
REPEAT=${REPEAT:-3}
PATHS=${PATHS:-/plain /key /auth}
if ! command -v valgrind >/dev/null; then
  apt-get update -qq && apt-get install -y -qq valgrind >/dev/null
fi
plugins/build.sh >/dev/null
# shellcheck source=bench/common.sh
. bench/common.sh
UP_PORT=$(free_port); PC_PORT=$(free_port)
start_upstream "$UP_PORT"
plugin_policies "$WORK/policies" "$PC_PORT" "$UP_PORT"

echo "# $(git rev-parse --short HEAD)$(git diff --quiet || echo '+changes'), $REQUESTS requests per path, 1 worker, median of $REPEAT runs"
# shellcheck disable=SC2086
python3 bench/instructions.py "$BIN" "$WORK/policies" "$PC_PORT" "$(bench_token)" "$REQUESTS" "$TOP" "$REPEAT" $PATHS
