#!/usr/bin/env python3
"""Instructions per request, Portcullis beside nginx-tuned, counted by
valgrind's cachegrind (see bench/versus-nginx.sh, which writes the configs
and starts the upstream).

    versus_nginx.py SCRATCH REQUESTS REPEAT

Reads the set-ups from SCRATCH/setups.json: a list of {"name", "cmd",
"env", "port", "path", "log"}. Each runs twice under cachegrind (WARM and
WARM + REQUESTS requests on a keep-alive connection, opened again when the
server closes it, as both do after 1,000 requests by default), and the
difference over REQUESTS is its count per request: start-up, warm-up and
exit cancel out. REPEAT times, the median kept. Prints one table: each
log setting a row, each set-up's count and its ratio to nginx-tuned's.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from instructions import counts  # noqa: E402

WARM = 200


def answer_end(buf):
    """Where the first whole answer in buf ends, its status line, and
    whether it closes the connection; None while incomplete."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = buf[:end].decode("latin-1")
    length, close = 0, False
    for line in head.split("\r\n")[1:]:
        name, _, value = line.partition(":")
        name = name.strip().lower()
        if name == "content-length":
            length = int(value)
        elif name == "connection" and "close" in value.lower():
            close = True
        elif name == "transfer-encoding":
            sys.exit(f"a chunked answer; the client reads Content-Length only: {head}")
    if len(buf) < end + 4 + length:
        return None
    return end + 4 + length, head.split("\r\n")[0], close


def requests(port, path, n):
    """n GETs in turn on a keep-alive connection (a new one when the server
    closes it); each answer must be 200."""
    req = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: bench\r\nAccept: */*\r\n\r\n".encode()
    s, buf, done = None, b"", 0
    try:
        while done < n:
            if s is None:
                s, buf = socket.create_connection(("127.0.0.1", port)), b""
            s.sendall(req)
            while (got := answer_end(buf)) is None:
                data = s.recv(65536)
                if not data:
                    sys.exit(f"{path}: closed without an answer after {done} requests")
                buf += data
            end, status, close = got
            if not status.startswith("HTTP/1.1 200"):
                sys.exit(f"{path}: {status}")
            buf = buf[end:]
            done += 1
            if close:
                s.close()
                s = None
    finally:
        if s is not None:
            s.close()


def wait_port(proc, port, log):
    deadline = time.monotonic() + 300  # plugins compile slowly under valgrind
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"not started on port {port}:\n" + open(log).read()[-2000:])
        try:
            socket.create_connection(("127.0.0.1", port)).close()
            return
        except OSError:
            time.sleep(0.3)


def run(setup, n, scratch):
    """The set-up's instructions by function, serving n requests."""
    out = os.path.join(scratch, f"cg.{setup['name']}.{setup['log']}.{n}")
    log = out + ".log"
    # One compiler thread: see bench/instructions.py.
    env = dict(os.environ, RAYON_NUM_THREADS="1", **setup["env"])
    proc = subprocess.Popen(
        ["valgrind", "--tool=cachegrind", "--cache-sim=no", f"--cachegrind-out-file={out}",
         *setup["cmd"]],
        stdout=subprocess.DEVNULL, stderr=open(log, "w"), env=env,
    )
    try:
        wait_port(proc, setup["port"], log)
        requests(setup["port"], setup["path"], n)
    finally:
        # Also on failure: a server left running would hold the port.
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    return counts(out)


def per_request(setup, n, repeat, scratch):
    runs = []
    for _ in range(repeat):
        warm = sum(run(setup, WARM, scratch).values())
        full = sum(run(setup, WARM + n, scratch).values())
        runs.append((full - warm) / n)
    runs.sort()
    return runs[len(runs) // 2], runs[0], runs[-1]


def main():
    scratch, n, repeat = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    setups = json.load(open(os.path.join(scratch, "setups.json")))
    figures = {}
    for s in setups:
        figures[(s["name"], s["log"])] = per_request(s, n, repeat, scratch)
        mid, low, high = figures[(s["name"], s["log"])]
        print(f"  {s['name']:<24} log {s['log']:<4} {mid:>9,.0f}   runs {low:,.0f}-{high:,.0f}", flush=True)
    names = list(dict.fromkeys(s["name"] for s in setups))
    logs = list(dict.fromkeys(s["log"] for s in setups))
    base = names[0]
    print()
    print("| access log | " + " | ".join(names[:1] + [f"{x} | ratio" for x in names[1:]]) + " |")
    print("|---|" + "---|" * (1 + 2 * (len(names) - 1)))
    for log in logs:
        b = figures[(base, log)][0]
        cells = [f"{b:,.0f}"]
        for x in names[1:]:
            v = figures[(x, log)][0]
            cells += [f"{v:,.0f}", f"{v / b:.2f}x"]
        print(f"| {log} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
