#!/usr/bin/env bash
# Builds every plugin to a WebAssembly component (wasm32-wasip2) and copies
# them to plugins/dist/<name>.wasm. Adds the Rust target when missing.
#
#   plugins/build.sh            # all plugins and test fixtures
set -euo pipefail
cd "$(dirname "$0")"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/tmp/portcullis-target}"

if command -v rustup >/dev/null 2>&1 && ! rustup target list --installed | grep -qx wasm32-wasip2; then
  rustup target add wasm32-wasip2
fi
cargo build --locked --release --target wasm32-wasip2
mkdir -p dist
out="$CARGO_TARGET_DIR/wasm32-wasip2/release"
for crate in webhook-signature header-rules jwt-auth ip-allow basic-auth client-cert-allow canary-route token-introspection example-require-header fixture-loop-forever fixture-busy fixture-forward fixture-trap fixture-grow-memory fixture-sleep fixture-escape fixture-hoard fixture-contract-0-2-0 fixture-contract-0-3; do
  cp "$out/${crate//-/_}.wasm" "dist/$crate.wasm"
done

# Envoy proxy-wasm filters (test fixtures of the proxy-wasm host, and
# bench/plugins.sh's filter): core
# modules for wasm32-wasip1, their own workspace.
if command -v rustup >/dev/null 2>&1 && ! rustup target list --installed | grep -qx wasm32-wasip1; then
  rustup target add wasm32-wasip1
fi
cargo build --locked --release --target wasm32-wasip1 --manifest-path proxy-wasm/Cargo.toml
for crate in auth body grpc headers keys misbehave redis require shared; do
  cp "$CARGO_TARGET_DIR/wasm32-wasip1/release/proxy_wasm_$crate.wasm" "dist/proxy-wasm-$crate.wasm"
done
ls -l dist
