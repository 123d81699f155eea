#!/usr/bin/env bash
# Builds the JavaScript example plugin to plugins/dist/example-require-header-js.wasm
# with componentize-js (from npm, every version pinned by package-lock.json),
# installed beside the Rust build when missing; Node.js and npm from
# apt-get when missing. Skipped when the component is newer than its
# sources and the WIT.
set -euo pipefail
cd "$(dirname "$0")"
here=$PWD
out="$here/../../dist/example-require-header-js.wasm"
newer() { for f in "$@"; do [ "$out" -nt "$f" ] || return 1; done; }
if [ -f "$out" ] && newer require-header.js componentize.mjs package-lock.json ../../../wit/policy.wit; then
  exit 0
fi
if ! { command -v node && command -v npm; } >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq nodejs npm >/dev/null
  else
    echo "node and npm are needed to build the JavaScript example" >&2
    exit 1
  fi
fi
# One install per lock file, reused by later builds and CI runs.
tools="${CARGO_TARGET_DIR:-/tmp/portcullis-target}/componentize-js-$(sha256sum package-lock.json | cut -c1-12)"
if [ ! -d "$tools/node_modules/@bytecodealliance/componentize-js" ]; then
  rm -rf "$tools"
  mkdir -p "$tools"
  cp package.json package-lock.json "$tools/"
  (cd "$tools" && npm ci --no-audit --no-fund --loglevel=error)
fi
cp componentize.mjs "$tools/"
mkdir -p "$(dirname "$out")"
(cd "$tools" && node componentize.mjs "$here/require-header.js" "$here/../../../wit" "$out")
echo "built $out"
