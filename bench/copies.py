"""The proxy's memory copies per request, by call site (bench/copies.sh).

Runs the binary on the default policies under bench/copies_shim.c, sends
warm-up requests, counts the copies of REQUESTS more, and prints the
copies and bytes a request with the sites that made them, resolved to
source lines by addr2line (innermost frames first, inlined ones
included). Most of a request's copies are moves of futures and responses
by value: what callgrind shows only as `memcpy` instructions, here by
where and how large.

    python3 bench/copies.py SHIM BIN UP_PORT PORT WORK REQUESTS TOP [BASE_BIN]
"""

import os
import signal
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import instructions  # noqa: E402  (its request loop)

PATH = "/app-proxy/x"


def wait_port(port, proc):
    while True:
        if proc.poll() is not None:
            sys.exit(f"the proxy exited ({proc.returncode}) before listening on {port}")
        try:
            socket.create_connection(("127.0.0.1", port)).close()
            return
        except OSError:
            time.sleep(0.1)


def wait_file(path, proc):
    for _ in range(200):
        if os.path.exists(path) and os.path.getsize(path) > 0:
            return
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    sys.exit(f"no {path}: was the shim loaded?")


def count(shim, binary, up_port, port, out, requests):
    """(site rows, load address of the binary) for `requests` requests."""
    env = dict(
        os.environ,
        LD_PRELOAD=shim,
        COPIES_OUT=out,
        PORTCULLIS_LISTEN=f"127.0.0.1:{port}",
        APP_PROXY_URL=f"http://127.0.0.1:{up_port}",
        RUST_LOG="warn",
    )
    args = [binary, "serve", "--workers", "1", "--policies", "policies", "--admin", "off"]
    with open(out + ".stderr", "w") as err:
        proc = subprocess.Popen(args, env=env, stderr=err)
    try:
        wait_port(port, proc)
        instructions.requests(port, PATH, "t", 100)
        proc.send_signal(signal.SIGUSR2)
        instructions.requests(port, PATH, "t", requests)
        proc.send_signal(signal.SIGUSR2)
        wait_file(out + ".maps", proc)
    finally:
        proc.terminate()
        proc.wait()
    real = os.path.realpath(binary)
    base = None
    for line in open(out + ".maps"):
        if line.rstrip().endswith(real):
            base = int(line.split("-")[0], 16)
            break
    if base is None:
        sys.exit(f"{binary} not in the process's maps")
    rows = []
    for line in open(out + ".sites"):
        site, calls, size, last = line.split()
        rows.append((int(site, 16) - base, int(calls), int(size), int(last)))
    return rows


def short(path):
    """A source path as one reads it: from its crate (ours or a
    dependency's, with its version) or std's library."""
    for mark in ("/crates/", "index.crates.io-", "/library/"):
        if mark in path:
            rest = path.split(mark, 1)[1]
            return rest.split("/", 1)[1] if mark == "index.crates.io-" else rest
    return "/".join(path.split("/")[-2:])


def places(binary, offsets):
    """Each offset's source lines, innermost first ("file:line" each)."""
    if not offsets:
        return {}
    # The return address is after the call: one byte back is inside it.
    args = ["addr2line", "-i", "-a", "-e", binary] + [hex(o - 1) for o in offsets]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    found, current = {}, None
    for line in out.splitlines():
        if line.startswith("0x"):
            current = int(line, 16) + 1
            found[current] = []
        elif current is not None:
            path, _, where = line.rpartition(":")
            found[current].append(f"{short(path)}:{where.split()[0]}")
    return found


def report(name, binary, rows, requests, top):
    calls = sum(r[1] for r in rows)
    size = sum(r[2] for r in rows)
    print(f"{name}: {calls / requests:.1f} copies, {size / requests:,.0f} bytes a request")
    rows = sorted(rows, key=lambda r: -r[2])[:top]
    where = places(binary, [r[0] for r in rows])
    print(f"  {'calls':>5} {'bytes':>6}  site, innermost first (calls a request, bytes a call)")
    for offset, n, b, _ in rows:
        chain = " <- ".join(where.get(offset, ["?"])[:3])
        print(f"  {n / requests:5.1f} {b / max(n, 1):6.0f}  {chain}")


def main():
    shim, binary, up_port, port, work, requests, top = sys.argv[1:8]
    base = sys.argv[8] if len(sys.argv) > 8 else ""
    requests, top, up_port, port = int(requests), int(top), int(up_port), int(port)
    runs = [("this build", binary)] + ([("BASE_BIN", base)] if base else [])
    for i, (name, b) in enumerate(runs):
        rows = count(shim, b, up_port, port, f"{work}/copies{i}", requests)
        report(name, b, rows, requests, top)


if __name__ == "__main__":
    main()
