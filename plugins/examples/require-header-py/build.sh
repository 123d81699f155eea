#!/usr/bin/env bash
# Builds the Python example plugin to plugins/dist/example-require-header-py.wasm
# with componentize-py (from PyPI, pinned), installed into a virtualenv
# beside the Rust build when missing. Skipped when the component is newer
# than its source and the WIT.
set -euo pipefail
cd "$(dirname "$0")"
VERSION=0.25.1
out=../../dist/example-require-header-py.wasm
if [ -f "$out" ] && [ "$out" -nt require_header.py ] && [ "$out" -nt ../../../wit/policy.wit ]; then
  exit 0
fi
venv="${CARGO_TARGET_DIR:-/tmp/portcullis-target}/componentize-py-$VERSION"
../../../tests/venv.sh "$venv" componentize-py "componentize-py==$VERSION"
mkdir -p ../../dist
"$venv/bin/componentize-py" -d ../../../wit -w policy componentize require_header -o "$out"
