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
if [ ! -x "$venv/bin/componentize-py" ]; then
  rm -rf "$venv"
  if ! python3 -m venv "$venv" 2>/dev/null; then
    # Debian's python3 keeps venv in a package of its own.
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
      rm -rf "$venv"
      python3 -m venv "$venv"
    else
      echo "python3 -m venv failed: install python3-venv" >&2
      exit 1
    fi
  fi
  "$venv/bin/pip" install -q "componentize-py==$VERSION"
fi
mkdir -p ../../dist
"$venv/bin/componentize-py" -d ../../../wit -w policy componentize require_header -o "$out"
