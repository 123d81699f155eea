#!/usr/bin/env python3
"""One HTTP/3 request with aioquic (a QUIC and HTTP/3 stack of its own,
not quinn/h3 as the proxy's): a second, independent client for the
routing core's and the tunnel server's HTTP/3.

Usage: h3_client.py HOST PORT SERVER_NAME CA_FILE METHOD PATH [BODY_BYTES]
Prints the answer as JSON: status, headers, body (text).
"""
import asyncio
import json
import sys

from aioquic.asyncio.client import connect
from aioquic.asyncio.protocol import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration


class Client(QuicConnectionProtocol):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.h3 = H3Connection(self._quic)
        self.waiting = {}
        self.answers = {}

    def quic_event_received(self, event):
        for e in self.h3.handle_event(event):
            if not isinstance(e, (HeadersReceived, DataReceived)):
                continue
            answer = self.answers.setdefault(e.stream_id, {"headers": [], "body": b""})
            if isinstance(e, HeadersReceived):
                answer["headers"] += e.headers
            else:
                answer["body"] += e.data
            if e.stream_ended:
                self.waiting.pop(e.stream_id).set_result(answer)

    async def request(self, authority, method, path, body):
        stream = self._quic.get_next_available_stream_id()
        head = [
            (b":method", method.encode()),
            (b":scheme", b"https"),
            (b":authority", authority.encode()),
            (b":path", path.encode()),
        ]
        self.h3.send_headers(stream, head, end_stream=not body)
        if body:
            self.h3.send_data(stream, body, end_stream=True)
        answered = asyncio.get_running_loop().create_future()
        self.waiting[stream] = answered
        self.transmit()
        return await asyncio.wait_for(answered, 20)


async def main():
    host, port, name, ca, method, path = sys.argv[1:7]
    body = b"x" * int(sys.argv[7]) if len(sys.argv) > 7 else b""
    config = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name=name)
    config.load_verify_locations(ca)
    async with connect(host, int(port), configuration=config, create_protocol=Client) as client:
        answer = await client.request(name, method, path, body)
    headers = {k.decode(): v.decode() for k, v in answer["headers"]}
    status = int(headers.pop(":status"))
    text = answer["body"].decode("utf-8", "replace")
    print(json.dumps({"status": status, "headers": headers, "body": text}))


asyncio.run(main())
