#!/usr/bin/env python3
"""A lossy, slow link between two network namespaces, in user space: what
`tc qdisc ... netem` would do on a kernel that has it (this VM's has no
sch_netem, nor any classifier to drop packets with).

    lossy_link.py NS_A NS_B CONTROL READY

Makes a TUN device `tun0` in each of the namespaces NS_A and NS_B (names
under /run/netns, from `ip netns add`) and carries every IP packet one
writes to the other, as a wire would, after:
  - a drop with probability LOSS percent, each direction on its own;
  - the link's rate (RATE Mbit/s each way: a packet waits for the ones
    queued before it), with a tail drop once QUEUE ms of packets wait;
  - a fixed one-way delay of RTT/2 ms.
CONTROL is a file holding "LOSS RTT RATE QUEUE" (e.g. "1 40 100 50"),
read at start and again on SIGHUP, so one set of tunnels can be measured
at several loss rates. On SIGUSR1 (and on each SIGHUP) it writes the
packets carried and dropped since the last report to stderr. It touches
READY once both devices exist; the caller gives them addresses. The
devices go when it exits.
"""

import collections
import ctypes
import fcntl
import os
import random
import select
import signal
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
CLONE_NEWNET = 0x40000000

libc = ctypes.CDLL(None, use_errno=True)


def enter(ns_path):
    """Moves this process into the network namespace at ns_path."""
    fd = os.open(ns_path, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            sys.exit(f"setns {ns_path}: {os.strerror(err)}")
    finally:
        os.close(fd)


def open_tun(ns):
    """A new TUN device tun0 in namespace ns (it stays there: a device
    belongs to the namespace it was made in, whatever this process does
    next)."""
    enter(f"/run/netns/{ns}")
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", b"tun0", IFF_TUN | IFF_NO_PI))
    return fd


class Link:
    """The settings, and what was carried and dropped since the last
    report."""

    def __init__(self, control):
        self.control = control
        self.reload = True
        self.report = False
        self.counts = collections.Counter()
        self.read()

    def read(self):
        with open(self.control) as f:
            loss, rtt, rate, queue = (float(x) for x in f.read().split())
        self.loss = loss / 100
        self.delay = rtt / 2000
        self.seconds_per_byte = 8 / (rate * 1e6)
        self.queue = queue / 1000
        print(
            f"lossy_link: loss {loss}% each way, rtt {rtt} ms, {rate} Mbit/s, queue {queue} ms",
            file=sys.stderr,
            flush=True,
        )

    def tell(self):
        c = self.counts
        sent = c["carried"] + c["lost"] + c["queue_full"]
        share = 100 * c["lost"] / sent if sent else 0
        print(
            f"lossy_link: {c['carried']} packets carried, {c['lost']} dropped at random "
            f"({share:.2f}%), {c['queue_full']} at a full queue",
            file=sys.stderr,
            flush=True,
        )
        self.counts.clear()


def main():
    ns_a, ns_b, control, ready = sys.argv[1:5]
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    fds = [open_tun(ns_a), open_tun(ns_b)]
    if libc.setns(home, CLONE_NEWNET) != 0:
        sys.exit("setns back: " + os.strerror(ctypes.get_errno()))
    link = Link(control)
    signal.signal(signal.SIGHUP, lambda *_: setattr(link, "reload", True))
    signal.signal(signal.SIGUSR1, lambda *_: setattr(link, "report", True))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    random.seed(1)
    link.reload = False
    open(ready, "w").close()

    # Per direction (index = the device the packets came from): packets
    # on their way, in the order they arrive, and when the link is free.
    wire = [collections.deque(), collections.deque()]
    free_at = [0.0, 0.0]
    while True:
        if link.reload:
            link.reload = False
            link.tell()
            link.read()
        if link.report:
            link.report = False
            link.tell()
        now = time.monotonic()
        due = [q[0][0] for q in wire if q]
        timeout = max(0.0, min(due) - now) if due else 1.0
        try:
            readable, _, _ = select.select(fds, [], [], timeout)
        except InterruptedError:
            continue
        now = time.monotonic()
        for i, fd in enumerate(fds):
            if fd not in readable:
                continue
            for _ in range(256):
                try:
                    packet = os.read(fd, 65536)
                except BlockingIOError:
                    break
                if random.random() < link.loss:
                    link.counts["lost"] += 1
                    continue
                start = max(now, free_at[i])
                if start - now > link.queue:
                    link.counts["queue_full"] += 1
                    continue
                free_at[i] = start + len(packet) * link.seconds_per_byte
                wire[i].append((free_at[i] + link.delay, packet))
        now = time.monotonic()
        for i, q in enumerate(wire):
            while q and q[0][0] <= now:
                _, packet = q.popleft()
                try:
                    os.write(fds[1 - i], packet)
                    link.counts["carried"] += 1
                except OSError:
                    # The other side's stack refused it (its queue full):
                    # a loss, as on a real wire.
                    link.counts["refused"] += 1


if __name__ == "__main__":
    main()
