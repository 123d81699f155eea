#!/usr/bin/env python3
"""Time from a ConfigMap swap to the first request served on the new rules.

Reproduces the kubelet's atomic update (new timestamped directory, a new
`..data_tmp` link renamed over `..data`, old directory deleted), starts the
clock at the rename, and asks over one keep-alive connection until the
answer changes. Usage: reload_latency.py BINARY ROUNDS DEBOUNCE [PLUGIN.wasm]
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

binary, rounds, debounce = sys.argv[1], int(sys.argv[2]), sys.argv[3]
plugin = sys.argv[4] if len(sys.argv) > 4 else None
root = tempfile.mkdtemp()
state = {"serial": 0, "current": None}


def policy(body):
    text = 'listeners: [{ name: main, bind: "127.0.0.1:0" }]\n'
    uses = ""
    if plugin:
        text += "plugins: [{ name: sig, path: sig.wasm }]\n"
        uses = ", plugins: [{ use: sig, config: { provider: gitlab, secret: s3cret } }]"
    text += "routes:\n"
    # Enough routes to be a real table, not a toy.
    for i in range(50):
        text += f'  - {{ name: r{i}, match: {{ path: "/r{i}/{{*rest}}" }}, respond: {{ status: 204 }}{uses} }}\n'
    text += f'  - {{ name: v, match: {{ path: /v }}, respond: {{ status: 200, body: "{body}" }} }}\n'
    return text


def stage(text):
    """Writes the new version beside the live one; returns the swap."""
    state["serial"] += 1
    stamp = f"..2026_11_22_00_00_00.{state['serial']:09d}"
    os.mkdir(os.path.join(root, stamp))
    with open(os.path.join(root, stamp, "routing.yaml"), "w") as f:
        f.write(text)
    if plugin:
        shutil.copy(plugin, os.path.join(root, stamp, "sig.wasm"))
    os.symlink(stamp, os.path.join(root, "..data_tmp"))

    def swap():
        os.rename(os.path.join(root, "..data_tmp"), os.path.join(root, "..data"))

    def cleanup():
        if state["current"]:
            shutil.rmtree(os.path.join(root, state["current"]))
        state["current"] = stamp

    return swap, cleanup


swap, cleanup = stage(policy("r0"))
swap()
cleanup()
for key in ["routing.yaml"] + (["sig.wasm"] if plugin else []):
    os.symlink(f"..data/{key}", os.path.join(root, key))

proc, addr, admin = serve(binary, "--policies", root, "--watch-debounce", debounce)
host, port = addr.rsplit(":", 1)
conn = http.client.HTTPConnection(host, int(port))


def get(path):
    conn.request("GET", path)
    r = conn.getresponse()
    return r.read()


assert get("/v") == b"r0"
total, build = [], []
try:
    for n in range(1, rounds + 1):
        want = f"r{n}".encode()
        swap, cleanup = stage(policy(f"r{n}"))
        t0 = time.perf_counter()
        swap()
        cleanup()
        while get("/v") != want:
            pass
        total.append((time.perf_counter() - t0) * 1000)
        ah, ap = admin.rsplit(":", 1)
        a = http.client.HTTPConnection(ah, int(ap))
        a.request("GET", "/status")
        build.append(json.loads(a.getresponse().read())["reloads"]["last_duration_ms"])
        # Let the next swap start a new burst rather than extend this one.
        time.sleep(0.2)
finally:
    proc.terminate()
    proc.wait()
    shutil.rmtree(root)


print(f"debounce {debounce}{' + plugin' if plugin else ''}: swap->served "
      f"p50 {statistics.median(total):.1f} ms, p90 {q(total, 0.9):.1f} ms, max {max(total):.1f} ms; "
      f"reload build+swap p50 {statistics.median(build):.2f} ms ({rounds} swaps)")
