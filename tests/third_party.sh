#!/usr/bin/env bash
# Fetches the prebuilt third-party proxy-wasm filters the tests run
# (tests/plugins/third_party.rs) into DIR, unless they are there: from
# PyPI, pinned by version and sha256, as a user would bring them.
#   tests/third_party.sh DIR
#
# gpustack-higress-plugins 0.5.1: Higress's own filters (transformer,
# ai-statistics, ...) and GPUStack's, built with Higress's wasm-go SDK
# for wasip1 (Go's own compiler, not TinyGo) but for ai-data-masking
# (Rust, Higress's fork of the Rust SDK), as Higress's plugin hub ships
# them.
set -euo pipefail
dir=$1
[ -f "$dir/gpustack_higress_plugins/manifest.json" ] && exit 0
mkdir -p "$dir"
cat > "$dir/requirements.txt" <<'REQ'
gpustack-higress-plugins==0.5.1 --hash=sha256:d233f22b3825258505406a07157f489f670f7b1b67473c1c8ded0389d3b4cdb2
REQ
python3 -m pip download -q --no-deps --require-hashes -r "$dir/requirements.txt" -d "$dir/wheels"
python3 - "$dir" <<'PY'
import glob, sys, zipfile
dir = sys.argv[1]
for wheel in glob.glob(f"{dir}/wheels/*.whl"):
    zipfile.ZipFile(wheel).extractall(dir)
PY
