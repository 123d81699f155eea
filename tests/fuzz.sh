#!/usr/bin/env bash
# Runs every fuzz target in proxy/fuzz for FUZZ_SECONDS each (30 by
# default, 10 in CI), from its committed corpus (proxy/fuzz/corpus/<target>), with
# cargo-fuzz on a pinned nightly: both installed when missing. What a run
# finds new goes to a scratch directory, not into the checkout; a crash or
# a failed check stops the run with libFuzzer's report and the input
# (proxy/fuzz/artifacts/<target>/).
#
#   tests/fuzz.sh                  # every target
#   FUZZ_SECONDS=300 tests/fuzz.sh policy der
set -euo pipefail
cd "$(dirname "$0")/../proxy"

# The nightly of the pinned stable's cycle (rust-toolchain.toml), so both
# read the code alike; cargo-fuzz at a known version.
NIGHTLY=nightly-2026-05-20
CARGO_FUZZ_VERSION=0.13.2
# In CI (CI=true) 10 s each: a smoke run of every target from its corpus,
# bounded so the whole CI run stays short; longer runs are for hunting.
if [ "${CI:-}" = true ]; then
  SECONDS_EACH="${FUZZ_SECONDS:-10}"
  # A smoke run from the corpus gains nothing from full optimisation,
  # which is most of a cold instrumented build's time (the CI time in
  # docs/benchmarks.md); hunting runs keep it.
  export CARGO_PROFILE_RELEASE_OPT_LEVEL=1 CARGO_PROFILE_RELEASE_DEBUG=line-tables-only
  # cargo-fuzz builds with one codegen unit a crate unless told: the
  # proxy's own crates, built one after another at the end, then use one
  # core of two.
  CODEGEN_UNITS=(--codegen-units 16)
else
  SECONDS_EACH="${FUZZ_SECONDS:-30}"
  CODEGEN_UNITS=()
fi
# Instrumented builds go beside the main target directory, not into it:
# every dependency is built again with coverage counters.
export CARGO_TARGET_DIR="${CARGO_FUZZ_TARGET_DIR:-${CARGO_TARGET_DIR:-/tmp/portcullis-target}-fuzz}"

rustup toolchain list | grep -q "^$NIGHTLY" || rustup toolchain install --profile minimal "$NIGHTLY"
rustup component list --toolchain "$NIGHTLY" --installed 2>/dev/null | grep -q '^clippy' \
  || rustup component add --toolchain "$NIGHTLY" clippy
# No target reads a plugin: the build leaves the built-in ones out (this
# nightly has no wasm32-wasip2 to build them with).
export PORTCULLIS_NO_BUILTIN_PLUGINS=1
if ! cargo fuzz --version 2>/dev/null | grep -q "$CARGO_FUZZ_VERSION"; then
  cargo +"$NIGHTLY" install --locked "cargo-fuzz@$CARGO_FUZZ_VERSION"
fi

targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  mapfile -t targets < <(cargo +"$NIGHTLY" fuzz list)
fi
# No sanitizer: the parsers are safe Rust, where AddressSanitizer finds
# nothing the bounds checks do not, at twice the build and run time.
# Debug assertions on: an overflowing length is a finding.
flags=(--sanitizer none --debug-assertions "${CODEGEN_UNITS[@]}")
# The targets are linted as they are built: clippy-driver compiles the
# fuzz crate (lints as errors), rustc the rest (the proxy's crates are
# linted by the main build). No separate check of every dependency.
export RUSTC_WORKSPACE_WRAPPER="$(rustc +"$NIGHTLY" --print sysroot)/bin/clippy-driver"
export CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__"
cargo +"$NIGHTLY" fuzz build "${flags[@]}"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for target in "${targets[@]}"; do
  echo "== fuzz $target (${SECONDS_EACH}s)"
  mkdir -p "$scratch/$target"
  # -timeout: one input taking 10 s is a hang; the corpus is read, never
  # written (new inputs go to the scratch directory named first).
  log="$scratch/$target.log"
  if ! cargo +"$NIGHTLY" fuzz run "${flags[@]}" "$target" "$scratch/$target" "fuzz/corpus/$target" -- \
      -max_total_time="$SECONDS_EACH" -timeout=10 -rss_limit_mb=4096 >"$log" 2>&1; then
    tail -n 80 "$log"
    echo "fuzz target $target failed (input in proxy/fuzz/artifacts/$target/)" >&2
    exit 1
  fi
  # libFuzzer's status at the start and at the end (inputs run, coverage
  # in edges, corpus size), and its count of runs.
  grep -E "^#[0-9]+[[:space:]]+(INITED|DONE)|^Done [0-9]+ runs" "$log" || true
done
echo "fuzz: ${#targets[@]} targets ran ${SECONDS_EACH}s each without a crash"
