#!/usr/bin/env python3
"""The first requests after a reload against the rest, through a large
proxy-wasm filter: is the first as fast as the hundredth?

Each round rewrites the filter's config (a new use, configured in the
running VMs when its configure is quick enough, else in VMs of its own;
with CHANGE `other`, only another route changes, so the filter's use and
its VMs are kept), reloads through `POST /reload` (answered once the new policies
serve), then sends REQUESTS requests, each on a new connection (so they
spread over the workers), timing each from connect to the last byte.

Each round first makes the same requests after a `POST /reload` that
changes nothing (the policies as they are: nothing is applied), the
control: the first request after any pause of the client's costs more
than the hundredth here (cold caches on both sides, the client's own
code), reload or not, and that part is not the reload's.
Usage: first_request.py BINARY FILTER.wasm|none UPSTREAM_PORT ROUNDS REQUESTS [filter|other]
(`none`: the same reloads with no filter, what a reload costs by itself).
"""
import http.client
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from serve_proc import quantile as q, serve

binary, filter_path, up_port = sys.argv[1], sys.argv[2], int(sys.argv[3])
rounds, requests = int(sys.argv[4]), int(sys.argv[5])
change = sys.argv[6] if len(sys.argv) > 6 else "filter"
root = tempfile.mkdtemp()
bare = filter_path == "none"
if not bare:
    shutil.copy(filter_path, os.path.join(root, "filter.wasm"))


def write_policy(n):
    # Higress's transformer's README rules; the round's number in them, so
    # each reload configures the filter anew.
    tag = str(n) if change == "filter" else "kept"
    config = {"reqRules": [{"operate": "add", "headers": [{"key": "x-round", "value": tag}]}]}
    plugins = "plugins: [{ name: filter, path: filter.wasm }]\n"
    uses = f", plugins: [{{ use: filter, config: {json.dumps(config)} }}]"
    if bare:
        # A route of its own changes instead, so each reload applies.
        plugins, uses = "", ""
    with open(os.path.join(root, "policy.yaml"), "w") as f:
        f.write(
            'listeners: [{ name: main, bind: "127.0.0.1:0" }]\n'
            f'upstreams: [{{ name: app, endpoints: ["http://127.0.0.1:{up_port}"] }}]\n'
            + plugins
            + "routes:\n"
            f"  - {{ name: app, match: {{ path_prefix: / }}, upstream: app{uses} }}\n"
            f"  - {{ name: round{n}, match: {{ path: /round }}, respond: {{ status: 204 }} }}\n"
        )


write_policy(0)
proc, addr, admin = serve(binary, "--policies", root, "--watch", "false")
host, port = addr.rsplit(":", 1)
ahost, aport = admin.rsplit(":", 1)


def timed(method, at, path):
    """`method path` on a new connection to `at` (host, port), answered
    200: how long it took, connect to last byte (ms)."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(at[0], int(at[1]))
    conn.request(method, path)
    r = conn.getresponse()
    r.read()
    conn.close()
    assert r.status == 200, r.status
    return (time.perf_counter() - t0) * 1000


def timed_get():
    return timed("GET", (host, port), "/x")


firsts, hundredths, rest, reload_ms = [], [], [], []
# After a reload that applies nothing, and each round's difference.
paused, over = [], []


def reload():
    return timed("POST", (ahost, aport), "/reload")


try:
    for _ in range(requests):
        timed_get()
    for n in range(1, rounds + 1):
        # The control first: the policies as they are.
        reload()
        paused.append(timed_get())
        for _ in range(requests - 1):
            timed_get()
        write_policy(n)
        reload_ms.append(reload())
        times = [timed_get() for _ in range(requests)]
        firsts.append(times[0])
        hundredths.append(times[-1])
        rest.extend(times[1:])
        over.append(times[0] - paused[-1])
finally:
    proc.terminate()
    proc.wait()
    shutil.rmtree(root)


if bare:
    name = "no filter"
else:
    size = os.path.getsize(filter_path) / 1e6
    name = f"{os.path.basename(os.path.dirname(os.path.dirname(filter_path)))} ({size:.1f} MB)"
    name += ", its config changed" if change == "filter" else ", another route changed"
print(f"{name}, {rounds} reloads, {requests} requests after each, "
      f"each on a new connection (ms):")
print(f"  request 1 after a reload:    p50 {statistics.median(firsts):.2f}  p90 {q(firsts, 0.9):.2f}  max {max(firsts):.2f}")
print(f"  request 1 after one that changes nothing: p50 {statistics.median(paused):.2f}  p90 {q(paused, 0.9):.2f}  max {max(paused):.2f}")
print(f"  request 1, the reload's less the no-op's: p50 {statistics.median(over):+.2f}  p90 {q(over, 0.9):+.2f}")
print(f"  request {requests} after a reload:  p50 {statistics.median(hundredths):.2f}  p90 {q(hundredths, 0.9):.2f}  max {max(hundredths):.2f}")
print(f"  requests 2-{requests}:              p50 {statistics.median(rest):.2f}  p90 {q(rest, 0.9):.2f}  p99 {q(rest, 0.99):.2f}")
print(f"  POST /reload (VMs started on every worker before it answers): p50 {statistics.median(reload_ms):.0f}")
