#!/usr/bin/env bash
# Reload latency: time from the kubelet's ConfigMap swap to the first
# request served on the new rules, with the default debounce (100 ms), a
# short one (10 ms: the floor), and with a plugin attached to every route.
#   ROUNDS=30 bench/reload.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS="${ROUNDS:-30}"
source bench/common.sh

python3 bench/reload_latency.py "$BIN" "$ROUNDS" 100ms
python3 bench/reload_latency.py "$BIN" "$ROUNDS" 10ms
if [ -f plugins/dist/webhook-signature.wasm ]; then
  python3 bench/reload_latency.py "$BIN" "$ROUNDS" 100ms plugins/dist/webhook-signature.wasm
else
  echo "plugins/dist/webhook-signature.wasm missing (plugins/build.sh); skipped the plugin case" >&2
fi
