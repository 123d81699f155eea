"""`portcullis serve` started for a bench script, with its addresses; and
the quantile its figures are given in."""
import json
import os
import subprocess
import threading


def serve(binary, *args):
    """Starts `binary serve ARGS --admin 127.0.0.1:0` logging JSON; returns
    the process, its first listener's and its admin listener's addresses
    (host:port), once it listens. Its later log lines are read and
    dropped, so it never blocks on a full pipe."""
    env = dict(os.environ, PORTCULLIS_LOG_FORMAT="json", RUST_LOG="info,access=off")
    proc = subprocess.Popen(
        [binary, "serve", *args, "--admin", "127.0.0.1:0"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, text=True)
    addr = admin = None
    for line in proc.stderr:
        msg = json.loads(line)
        if msg.get("message") == "admin listening":
            admin = msg["addr"]
        if msg.get("message") == "listening":
            addr = msg["addr"]
            break
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    return proc, addr, admin


def quantile(xs, p):
    """The value at fraction `p` of `xs` sorted (nearest rank, below)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]
