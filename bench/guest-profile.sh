#!/usr/bin/env bash
# Where a plugin's own code spends its instructions, per request and by
# function: the plugin's logic, the glue wit-bindgen generates (the export,
# its post-return, cabi_realloc), its allocator, and the trampolines
# through which the host enters and leaves it. Counted by valgrind's
# callgrind in the proxy's JIT code and mapped to the plugin's functions
# through the same component compiled ahead of time (see
# bench/guest_profile.py). This is what found dlmalloc's share of a header
# check (the SDK's allocator) and jwt-auth's byte-by-byte memcmp.
#
#   bench/guest-profile.sh             # /key: the SDK example's header check
#   bench/guest-profile.sh /auth       # jwt-auth, verified token remembered
#   REQUESTS=5000 bench/guest-profile.sh /verify
#
# Routes as in bench/plugins.sh. For your own plugin: build it with
# symbols (`CARGO_PROFILE_RELEASE_STRIP=false`), put it in a policy
# directory with a route, and call bench/guest_profile.py directly (its
# arguments are in its docstring).
# Instructions are not time, and the host's side of a call (wasmtime's
# lifting, the host functions) is in bench/instructions.sh's TOP list.
set -euo pipefail
cd "$(dirname "$0")/.."

ROUTE=${1:-/key}
REQUESTS=${REQUESTS:-3000}
case "$ROUTE" in
  /key) CRATE=example-require-header ;;
  /auth | /verify) CRATE=jwt-auth ;;
  *) echo "route $ROUTE: one of /key, /auth, /verify" >&2; exit 2 ;;
esac
if ! command -v valgrind >/dev/null; then
  apt-get update -qq && apt-get install -y -qq valgrind >/dev/null
fi
plugins/build.sh >/dev/null
# shellcheck source=bench/common.sh
. bench/common.sh
cargo build --release --locked -p portcullis --example precompile
# The plugins of plugins/dist are stripped; this build keeps the names, in a
# target directory of its own so the stripped build stays as it is.
CARGO_TARGET_DIR="$CARGO_TARGET_DIR/with-symbols" CARGO_PROFILE_RELEASE_STRIP=false \
  cargo build --quiet --locked --release --manifest-path plugins/Cargo.toml \
  --target wasm32-wasip2 -p "$CRATE"
UP_PORT=$(free_port); PC_PORT=$(free_port)
start_upstream "$UP_PORT"
plugin_policies "$WORK/policies" "$PC_PORT" "$UP_PORT"
WASM="$WORK/policies/$CRATE.wasm"
cp "$CARGO_TARGET_DIR/with-symbols/wasm32-wasip2/release/${CRATE//-/_}.wasm" "$WASM"

echo "# $(git rev-parse --short HEAD)$(git diff --quiet || echo '+changes'), $ROUTE ($CRATE), $REQUESTS requests, 1 worker"
python3 bench/guest_profile.py "$BIN" "$WORK/policies" "$PC_PORT" "$(bench_token)" \
  "$REQUESTS" "$ROUTE" "$WASM" "$CARGO_TARGET_DIR/release/examples/precompile"
