"""Large bodies through a proxy, for bench/bodies.sh.

    bodies.py sink PORT MB       an upstream: reads every request body
                                 (Content-Length or chunked) and answers its
                                 size; GET or PUT to /big answers MB MiB
    bodies.py client PORT MODE MB N [HOST [PATH]]
                                 N transfers of MB MiB on one connection;
                                 prints MB/s of each (uploads to PATH,
                                 /up by default, with Host HOST, bench)

    bodies.py idle PORT N MB PID...
                                 N connections each upload MB MiB (0: a
                                 bodiless request; Host $IDLE_HOST, bench;
                                 over TLS, unverified, if $IDLE_TLS is 1;
                                 a GET over HTTP/2 on TLS if it is h2),
                                 then stay open, idle; prints how much the
                                 resident memory of PID... grew, per
                                 connection (KiB)

MODE: put (Content-Length upload), chunked (chunked upload, 1 MiB chunks),
get (download), put-get (a 1 MiB upload, streamed through the proxy, then
the download: the answer to a streamed request).

Both ends use sendfile or recv_into a fixed buffer, so on loopback they move
several GB/s (direct, client to sink): the proxy in between sets the pace.
Each transfer is checked (status, and the byte count the sink read or the
client got), so a proxy that loses bytes fails the run.
"""

import os
import socket
import ssl
import sys
import tempfile
import threading
import time

BUF = 1 << 20


class Conn:
    def __init__(self, sock):
        self.sock = sock
        self.buf = bytearray()
        self.view = memoryview(bytearray(BUF))

    def fill(self, most=BUF):
        n = self.sock.recv_into(self.view, most)
        if n == 0:
            raise EOFError
        self.buf.extend(self.view[:n])

    def line(self):
        while True:
            i = self.buf.find(b"\r\n")
            if i >= 0:
                out = bytes(self.buf[:i])
                del self.buf[: i + 2]
                return out
            # Small reads: a chunk-size line is followed by the chunk,
            # which skip() reads without copying it here first.
            self.fill(256)

    def head(self):
        while b"\r\n\r\n" not in self.buf:
            self.fill()
        i = self.buf.index(b"\r\n\r\n")
        lines = bytes(self.buf[:i]).decode("latin-1").split("\r\n")
        del self.buf[: i + 4]
        fields = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            fields[name.strip().lower()] = value.strip()
        return lines[0], fields

    def skip(self, n):
        take = min(n, len(self.buf))
        del self.buf[:take]
        n -= take
        while n > 0:
            got = self.sock.recv_into(self.view, min(n, BUF))
            if got == 0:
                raise EOFError
            n -= got

    def body(self, fields):
        """Reads and drops a body; returns its length."""
        if fields.get("transfer-encoding", "").lower() == "chunked":
            read = 0
            while True:
                size = int(self.line().split(b";")[0], 16)
                if size == 0:
                    while self.line():
                        pass
                    return read
                self.skip(size)
                read += size
                self.line()
        n = int(fields.get("content-length", "0"))
        self.skip(n)
        return n


def sink(port, mb):
    big = tempfile.TemporaryFile()
    big.truncate(mb << 20)

    def serve(sock):
        conn = Conn(sock)
        try:
            while True:
                start, fields = conn.head()
                read = conn.body(fields)
                if start.split(" ")[1] == "/big":
                    sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % (mb << 20))
                    sock.sendfile(big, 0, mb << 20)
                else:
                    answer = b"%d\n" % read
                    sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(answer), answer))
        except (EOFError, ConnectionError):
            sock.close()

    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(64)
    while True:
        sock, _ = listener.accept()
        threading.Thread(target=serve, args=(sock,), daemon=True).start()


def client(port, mode, mb, n, host="bench", path="/up"):
    size = mb << 20
    up = b"PUT %s HTTP/1.1\r\nhost: %s\r\n" % (path.encode(), host.encode())
    upload = tempfile.TemporaryFile()
    upload.truncate(size if mode in ("put", "chunked") else BUF)
    sock = socket.create_connection(("127.0.0.1", port))
    conn = Conn(sock)
    rates = []
    for _ in range(n):
        t = time.perf_counter()
        if mode == "put":
            sock.sendall(up + b"content-length: %d\r\n\r\n" % size)
            sock.sendfile(upload, 0, size)
        elif mode == "chunked":
            sock.sendall(up + b"transfer-encoding: chunked\r\n\r\n")
            for off in range(0, size, BUF):
                k = min(BUF, size - off)
                sock.sendall(b"%x\r\n" % k)
                sock.sendfile(upload, off, k)
                sock.sendall(b"\r\n")
            sock.sendall(b"0\r\n\r\n")
        elif mode == "get":
            sock.sendall(b"GET /big HTTP/1.1\r\nhost: %s\r\n\r\n" % host.encode())
        elif mode == "put-get":
            # The head first, the body after: the proxy has to stream it.
            sock.sendall(b"PUT /big HTTP/1.1\r\nhost: %s\r\ncontent-length: %d\r\n\r\n" % (host.encode(), BUF))
            sock.sendfile(upload, 0, BUF)
        else:
            sys.exit(f"unknown mode {mode}")
        start, fields = conn.head()
        if not start.startswith("HTTP/1.1 200"):
            sys.exit(f"{mode}: answered {start!r}")
        if mode in ("put", "chunked"):
            n = int(fields["content-length"])
            while len(conn.buf) < n:
                conn.fill()
            got = int(conn.buf[:n])
            del conn.buf[:n]
            if got != size:
                sys.exit(f"{mode}: the upstream read {got} bytes of {size}")
        else:
            got = conn.body(fields)
            if got != size:
                sys.exit(f"{mode}: got {got} bytes of {size}")
        rates.append(size / (time.perf_counter() - t) / 1e6)
        if fields.get("connection", "").lower() == "close":
            # Portcullis closes a connection after a large upload (its
            # read buffer goes with it): as an HTTP client must, reconnect.
            sock.close()
            sock = socket.create_connection(("127.0.0.1", port))
            conn = Conn(sock)
    print(" ".join(f"{r:.0f}" for r in rates))


def rss_kib(pids):
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/status") as f:
            total += next(int(l.split()[1]) for l in f if l.startswith("VmRSS"))
    return total


def h2_get(sock, host):
    """One GET / over HTTP/2 (ALPN h2): the least of the protocol, HPACK
    literals only; the connection then stays open."""

    def frame(kind, flags, stream, payload=b""):
        return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload

    # :method GET, :scheme https (static table), :path and :authority as
    # literals without indexing on static names.
    block = b"\x82\x87\x04\x01/\x01" + bytes([len(host)]) + host
    sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0) + frame(1, 0x5, 1, block))
    buf = b""
    status = None
    while True:
        while len(buf) < 9 or len(buf) < 9 + int.from_bytes(buf[:3], "big"):
            more = sock.recv(65536)
            if not more:
                sys.exit("idle: HTTP/2 connection closed")
            buf += more
        length = int.from_bytes(buf[:3], "big")
        kind, flags, stream = buf[3], buf[4], int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
        payload, buf = buf[9 : 9 + length], buf[9 + length :]
        if kind == 4 and not flags & 1:
            sock.sendall(frame(4, 1, 0))
        elif kind == 7:
            sys.exit("idle: HTTP/2 GOAWAY")
        elif stream == 1 and kind == 1:
            # 0x88: :status 200 from the static table.
            status = payload[:1]
        if stream == 1 and kind in (0, 1) and flags & 1:
            if status != b"\x88":
                sys.exit(f"idle: HTTP/2 answer starts {status!r}")
            return


def idle(port, n, mb, pids):
    size = mb << 20
    host = os.environ.get("IDLE_HOST", "bench").encode()
    tls = None
    h2 = os.environ.get("IDLE_TLS") == "h2"
    if os.environ.get("IDLE_TLS") in ("1", "h2"):
        tls = ssl.create_default_context()
        tls.check_hostname = False
        tls.verify_mode = ssl.CERT_NONE
        if h2:
            tls.set_alpn_protocols(["h2"])
    upload = tempfile.TemporaryFile()
    upload.truncate(size)
    before = rss_kib(pids)
    conns = []
    for _ in range(n):
        sock = socket.create_connection(("127.0.0.1", port))
        if tls:
            sock = tls.wrap_socket(sock, server_hostname="localhost")
        if h2:
            if sock.selected_alpn_protocol() != "h2":
                sys.exit("idle: the server did not choose h2")
            h2_get(sock, host)
            conns.append(sock)
            continue
        sock.sendall(b"PUT /up HTTP/1.1\r\nhost: %s\r\ncontent-length: %d\r\n\r\n" % (host, size))
        if size:
            sock.sendfile(upload, 0, size)
        conn = Conn(sock)
        start, fields = conn.head()
        if not start.startswith("HTTP/1.1 200"):
            sys.exit(f"idle: answered {start!r}")
        conns.append(conn)
    # Let the allocators settle (mimalloc frees pages after a delay), and
    # Portcullis park the idle HTTP/1 connections (within a second) and
    # hand their freed buffers back (within two more: a second's purge
    # delay, checked once a second).
    time.sleep(4)
    print(f"{(rss_kib(pids) - before) / n:.0f}")


if __name__ == "__main__":
    if sys.argv[1] == "idle":
        idle(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), [int(p) for p in sys.argv[5:]])
    elif sys.argv[1] == "sink":
        sink(int(sys.argv[2]), int(sys.argv[3]))
    else:
        client(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), *sys.argv[6:8])
