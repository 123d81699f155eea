#!/usr/bin/env bash
# Where two builds differ in instructions per request, function by
# function (cachegrind, as bench/instructions.sh counts them): for a change
# on the hot path, build before and after, keep both binaries, and run
#
#   bench/instructions-diff.sh OLD_BINARY NEW_BINARY [PATH]     # PATH: /plain, /key, /auth
#   REQUESTS=5000 REPEAT=5 TOP=40 bench/instructions-diff.sh old new
#
# It prints each build's median total over REPEAT runs, then the functions
# that gained and lost most. Inlining moves instructions between functions
# (and renamed generics appear as one gained, one lost), so read the pairs
# together; the totals are the figure to quote.
set -euo pipefail
cd "$(dirname "$0")/.."
OLD=$(realpath "$1"); NEW=$(realpath "$2"); ROUTE=${3:-/plain}
REQUESTS=${REQUESTS:-2000}
REPEAT=${REPEAT:-3}
TOP=${TOP:-20}
if ! command -v valgrind >/dev/null; then
  apt-get update -qq && apt-get install -y -qq valgrind >/dev/null
fi
# The binaries are given: no build.
BENCH_NO_BUILD=1
# shellcheck source=bench/common.sh
. bench/common.sh
UP_PORT=$(free_port); PC_PORT=$(free_port)
start_upstream "$UP_PORT"
# The routes of bench/instructions.sh: /plain (no plugin), /key (the SDK
# example), /auth (jwt-auth); plugin files, so older builds take them too.
plugins/build.sh >/dev/null
plugin_policies "$WORK/policies" "$PC_PORT" "$UP_PORT"
TOKEN=$(bench_token)
python3 - "$OLD" "$NEW" "$WORK/policies" "$PC_PORT" "$ROUTE" "$REQUESTS" "$REPEAT" "$TOP" "$TOKEN" <<'PY'
import collections, sys, tempfile
sys.path.insert(0, "bench")
import instructions
old, new, policies, port, route, n, repeat, top, token = sys.argv[1:10]
port, n, repeat, top = int(port), int(n), int(repeat), int(top)
median = {}
with tempfile.TemporaryDirectory() as scratch:
    for name, binary in (("old", old), ("new", new)):
        runs = []
        for _ in range(repeat):
            warm = instructions.run(binary, policies, port, token, route, instructions.WARM, scratch)
            full = instructions.run(binary, policies, port, token, route, instructions.WARM + n, scratch)
            runs.append({f: (full[f] - warm[f]) / n for f in set(warm) | set(full)})
        runs.sort(key=lambda r: sum(r.values()))
        median[name] = runs[len(runs) // 2]
        print(f"{name}: {sum(median[name].values()):,.0f} instructions/request on {route} ({binary})")
total = sum(median["new"].values()) - sum(median["old"].values())
print(f"new - old: {total:+,.0f}")
diff = {f: median["new"].get(f, 0) - median["old"].get(f, 0) for f in set(median["new"]) | set(median["old"])}
ranked = sorted(diff.items(), key=lambda kv: kv[1])
print(f"\ngained most (new over old):")
for f, v in reversed(ranked[-top:]):
    if v > 0.5:
        print(f"{v:>+9,.1f}  {f[:120]}")
print(f"\nlost most:")
for f, v in ranked[:top]:
    if v < -0.5:
        print(f"{v:>+9,.1f}  {f[:120]}")
PY
