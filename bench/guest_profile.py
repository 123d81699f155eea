#!/usr/bin/env python3
"""Instructions per request in a plugin's own code, by function (see
bench/guest-profile.sh, which builds what this needs).

    guest_profile.py BIN POLICIES PORT TOKEN REQUESTS PATH PLUGIN.wasm PRECOMPILE

Runs the proxy (one worker) under valgrind's callgrind, sends REQUESTS
keep-alive GETs to PATH, and stops it. The plugin's machine code is
JIT-compiled, so callgrind knows its functions only by address. The same
component compiled ahead of time by PRECOMPILE (the proxy's engine
settings, so the same machine code) is an ELF object with a symbol per
function; every JIT address minus its function's offset in that object
gives the same base, the most common difference, through which each
address maps to a function. The symbols carry the names of the plugin's
functions when its build kept them (`strip = false`). Start-up (the
plugin's `configure`) is included once, so use thousands of requests.
"""

import bisect
import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from instructions import serve_under_valgrind  # noqa: E402


def profile(binary, policies, port, token, n, path, scratch):
    out = os.path.join(scratch, "callgrind.out")
    tool = ["--tool=callgrind", f"--callgrind-out-file={out}"]
    serve_under_valgrind(tool, binary, policies, port, token, path, n, out)
    annotated = subprocess.run(
        ["callgrind_annotate", "--threshold=100", "--auto=no", out],
        capture_output=True, text=True, check=True,
    ).stdout
    # Lines like "  1,234,567 (0.03%)  ???:0x0000000005f3a120 [???]":
    # code without a symbol, named by its entry address.
    counts = []
    for line in annotated.splitlines():
        m = re.match(r"\s*([\d,]+)\s.*\?\?\?:0x([0-9a-f]+)", line)
        if m and "=>" not in line:
            counts.append((int(m.group(1).replace(",", "")), int(m.group(2), 16)))
    return counts


def symbols(precompile, wasm, scratch):
    cwasm = os.path.join(scratch, "plugin.cwasm")
    subprocess.run([precompile, wasm, cwasm], check=True)
    nm = subprocess.run(["nm", "-n", cwasm], capture_output=True, text=True, check=True).stdout
    syms = []
    for line in nm.splitlines():
        parts = line.split(None, 2)
        if len(parts) == 3 and re.fullmatch(r"[0-9a-f]{16}", parts[0]):
            syms.append((int(parts[0], 16), parts[2].strip()))
    return syms


def main():
    binary, policies, port, token, n, path, wasm, precompile = sys.argv[1:9]
    port, n = int(port), int(n)
    with tempfile.TemporaryDirectory() as scratch:
        counts = profile(binary, policies, port, token, n, path, scratch)
        syms = symbols(precompile, wasm, scratch)
    if not counts or not syms:
        sys.exit("nothing to map: no JIT code in the profile, or no symbols in the object")
    offsets = [s for s, _ in syms]
    # The load base: the difference most JIT entry addresses share with
    # some symbol's offset.
    diffs = collections.Counter(a - s for _, a in counts for s in offsets)
    base = diffs.most_common(1)[0][0]
    by_fn = collections.Counter()
    for cnt, addr in counts:
        off = addr - base
        i = bisect.bisect_right(offsets, off) - 1
        # Not the plugin's (another JIT region), or past its last function.
        if i < 0 or off - offsets[i] > 1 << 20:
            continue
        by_fn[syms[i][1]] += cnt
    total = sum(by_fn.values())
    print(f"{'per request':>11}  function (wasm[0] is the plugin's module; trampolines are the host's way in and out)")
    for name, cnt in by_fn.most_common():
        if cnt / n >= 1:
            print(f"{cnt / n:11.1f}  {name[:150]}")
    print(f"{total / n:11.1f}  in all, in the plugin's code, per request ({n} requests)")


if __name__ == "__main__":
    main()
