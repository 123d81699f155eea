#!/usr/bin/env python3
"""Instructions per request, counted by valgrind's cachegrind (see
bench/instructions.sh, which sets up the upstream and the policies).

    instructions.py BIN POLICIES PORT TOKEN REQUESTS TOP REPEAT PATH...

For each path the proxy (one worker) runs twice under cachegrind, serving
WARM and then WARM + REQUESTS requests on one keep-alive connection; the
difference over REQUESTS is the count per request, with start-up and
warm-up cancelled out. That is done REPEAT times and the median kept: the
count still varies a little between runs (~0.5%), as the worker parks
between requests or finds the next one already there, depending on how
the client and the proxy happen to interleave. With TOP > 0, the
functions that add most over the first path are listed for each other
path (from the median run).
"""

import collections
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

WARM = 200


def requests(port, path, token, n):
    """n GET requests on one keep-alive connection; each answer must be 200.
    HEADERS in the environment adds header lines (separated by `;`), e.g.
    a `traceparent` the client brings."""
    extra = "".join(
        f"{h.strip()}\r\n" for h in os.environ.get("HEADERS", "").split(";") if h.strip()
    )
    req = (
        f"GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\n"
        f"authorization: Bearer {token}\r\n{extra}\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port)) as s:
        buf = b""
        for _ in range(n):
            s.sendall(req)
            while True:
                end = buf.find(b"\r\n\r\n")
                if end >= 0:
                    head = buf[:end].decode("latin-1")
                    length = 0
                    for line in head.split("\r\n")[1:]:
                        name, _, value = line.partition(":")
                        if name.lower() == "content-length":
                            length = int(value)
                    if len(buf) >= end + 4 + length:
                        if not head.startswith("HTTP/1.1 200"):
                            sys.exit(f"{path}: {head.splitlines()[0]}")
                        buf = buf[end + 4 + length :]
                        break
                data = s.recv(65536)
                if not data:
                    sys.exit(f"{path}: the proxy closed the connection")
                buf += data


def counts(out):
    """Instructions by function in a cachegrind output file."""
    by_fn = collections.Counter()
    fn = None
    with open(out, errors="replace") as f:
        for line in f:
            if line.startswith("fn="):
                fn = line[3:].strip()
            elif fn and line[:1].isdigit():
                parts = line.split()
                if len(parts) >= 2:
                    by_fn[fn] += int(parts[1])
    return by_fn


def serve_under_valgrind(tool, binary, policies, port, token, path, n, out):
    """Runs the proxy (one worker) under valgrind with the `tool` options,
    its output in `out`, for n requests to path, then stops it."""
    proxy = subprocess.Popen(
        ["valgrind", *tool,
         binary, "serve", "--workers", "1", "--policies", policies, "--admin", "off"],
        stdout=subprocess.DEVNULL, stderr=open(out + ".log", "w"),
        # One compiler thread: the plugins compile at start-up, and how
        # rayon spreads their functions over threads changes how much of
        # regalloc2's reused buffers is cleared (memset), by up to ~45
        # million instructions, ~22,000 per request of a run; serially
        # the count is the same every run, and cancels out.
        # BENCH_RUST_LOG=info counts the access line too (to stderr, a file).
        env=dict(os.environ, RUST_LOG=os.environ.get("BENCH_RUST_LOG", "error"), RAYON_NUM_THREADS="1"),
    )
    try:
        deadline = time.monotonic() + 300  # plugins compile slowly under valgrind
        while True:
            if proxy.poll() is not None or time.monotonic() > deadline:
                sys.exit("the proxy did not start:\n" + open(out + ".log").read()[-2000:])
            try:
                socket.create_connection(("127.0.0.1", port)).close()
                break
            except OSError:
                time.sleep(0.5)
        requests(port, path, token, n)
    finally:
        # Also on failure: a proxy left running would hold the port.
        proxy.send_signal(signal.SIGTERM)
        proxy.wait(timeout=120)


def run(binary, policies, port, token, path, n, scratch):
    out = os.path.join(scratch, f"cg.{path.strip('/')}.{n}")
    tool = ["--tool=cachegrind", "--cache-sim=no", f"--cachegrind-out-file={out}"]
    serve_under_valgrind(tool, binary, policies, port, token, path, n, out)
    return counts(out)


def counted(binary, setup, path, scratch):
    """`path`'s instructions per request by function with `binary`: the
    median of `repeat` runs (by total), and the lowest and highest totals."""
    policies, port, token, n, repeat = setup
    runs = []
    for _ in range(repeat):
        warm = run(binary, policies, port, token, path, WARM, scratch)
        full = run(binary, policies, port, token, path, WARM + n, scratch)
        runs.append({f: (full[f] - warm[f]) / n for f in set(warm) | set(full)})
    runs.sort(key=lambda r: sum(r.values()))
    return runs[len(runs) // 2], (sum(runs[0].values()), sum(runs[-1].values()))


def main():
    binary, policies, port, token, n, top, repeat = sys.argv[1:8]
    port, n, top, repeat = int(port), int(n), int(top), int(repeat)
    paths = sys.argv[8:]
    setup = (policies, port, token, n, repeat)
    per_request, spread = {}, {}
    with tempfile.TemporaryDirectory() as scratch:
        for path in paths:
            per_request[path], spread[path] = counted(binary, setup, path, scratch)
    if os.environ.get("BASE_BIN"):
        compare_builds(os.environ["BASE_BIN"], per_request, setup, top)
        return
    base = paths[0]
    base_total = sum(per_request[base].values())
    print(f"{'path':<10} {'instructions/request':>21} {'vs ' + base:>12}   runs from-to")
    for path in paths:
        total = sum(per_request[path].values())
        low, high = spread[path]
        print(f"{path:<10} {total:>21,.0f} {total - base_total:>+12,.0f}   {low:,.0f}-{high:,.0f}")
    for path in paths[1:] if top > 0 else []:
        added = collections.Counter(
            {f: per_request[path].get(f, 0) - per_request[base].get(f, 0)
             for f in set(per_request[path]) | set(per_request[base])})
        print(f"\n{path}: the {top} functions adding most over {base} (??? = JIT-compiled plugin code)")
        for f, v in added.most_common(top):
            print(f"{v:>8,.0f}  {f[:110]}")


def compare_builds(base_bin, per_request, setup, top):
    """BASE_BIN: each path counted again with that binary, in the same
    sitting (two sittings of one binary can differ by ~60 on /plain), and
    the functions whose counts moved most between the two."""
    print(f"{'path':<10} {'BASE_BIN':>12} {'this build':>12} {'change':>9}")
    moved = {}
    with tempfile.TemporaryDirectory() as scratch:
        for path, mine in per_request.items():
            theirs, _ = counted(base_bin, setup, path, scratch)
            a, b = sum(theirs.values()), sum(mine.values())
            print(f"{path:<10} {a:>12,.0f} {b:>12,.0f} {(b - a) / a:>+9.2%}")
            moved[path] = collections.Counter(
                {f: mine.get(f, 0) - theirs.get(f, 0) for f in set(mine) | set(theirs)})
    for path, by_fn in moved.items() if top > 0 else []:
        print(f"\n{path}: the {top} functions that moved most")
        for f, v in sorted(by_fn.items(), key=lambda kv: -abs(kv[1]))[:top]:
            print(f"{v:>+8,.0f}  {f[:110]}")


if __name__ == "__main__":
    main()
