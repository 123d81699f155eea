#!/usr/bin/env bash
# Makes the Python virtualenv VENV with REQUIREMENT (pip's form, pinned)
# when it lacks EXECUTABLE or the requirement; with apt-get, installs
# python3-venv first when this Debian's python3 has no venv module.
#   tests/venv.sh VENV EXECUTABLE REQUIREMENT
set -euo pipefail
venv=$1 executable=$2 requirement=$3
# The requirement too: a virtualenv whose install failed has its python.
[ -x "$venv/bin/$executable" ] && "$venv/bin/pip" show -q "${requirement%%==*}" >/dev/null 2>&1 && exit 0
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
"$venv/bin/pip" install -q "$requirement"
