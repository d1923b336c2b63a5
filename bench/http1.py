"""A minimal keep-alive HTTP/1.1 client on asyncio protocols, light enough for load generation.

A Python HTTP client library (httpx) spends a whole core above ~100-270 requests/s on this
machine (shared/MACHINE-FACTS.md), which distorts every throughput figure on 2 cores. This one
sends prebuilt request bytes and parses only the status line, `Content-Length` and chunked
framing, with a callback per response: no task, future or header dictionary per request.
The load generator and the push baselines' router both use it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

# on_response(connection, status, body): status 0 means the connection failed.
ResponseCallback = Callable[["Http1Connection", int, bytes], None]


def build_request(host: str, path: str, body: bytes, method: str = "POST") -> bytes:
    """The full bytes of one JSON request, ready to write on a keep-alive connection."""
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class Http1Connection(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time (no pipelining)."""

    def __init__(self, on_response: ResponseCallback) -> None:
        self.on_response = on_response
        self.transport: asyncio.Transport | None = None
        self.busy = False
        self.closed = False
        self.tag: object = None  # the owner's bookkeeping (send time, worker index, ...)
        self._buffer = bytearray()

    @classmethod
    async def open(cls, host: str, port: int, on_response: ResponseCallback) -> Http1Connection:
        loop = asyncio.get_running_loop()
        _, protocol = await loop.create_connection(lambda: cls(on_response), host, port)
        return protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, raw_request: bytes) -> None:
        """Write one request; its response comes to `on_response`."""
        self.busy = True
        if self.closed or self.transport is None:
            self._fail()
            return
        self.transport.write(raw_request)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.busy:
            self._fail()

    def _fail(self) -> None:
        self.busy = False
        self._buffer.clear()
        self.on_response(self, 0, b"")

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while self.busy:
            parsed = _parse_response(self._buffer)
            if parsed is None:
                return
            status, body, consumed = parsed
            del self._buffer[:consumed]
            self.busy = False
            self.on_response(self, status, body)


def _parse_response(buffer: bytearray) -> tuple[int, bytes, int] | None:
    """(status, body, bytes consumed) once a whole response is buffered, else None."""
    end = buffer.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = bytes(buffer[:end]).lower()
    status = int(head[9:12])
    start = end + 4
    marker = head.find(b"\r\ncontent-length:")
    if marker >= 0:
        line_end = head.find(b"\r\n", marker + 2)
        length = int(head[marker + 17 : line_end if line_end >= 0 else None])
        if len(buffer) < start + length:
            return None
        return status, bytes(buffer[start : start + length]), start + length
    if b"\r\ntransfer-encoding: chunked" in head:
        return _parse_chunked(buffer, status, start)
    return status, b"", start  # no body framing: an empty body (e.g. 204)


def _parse_chunked(buffer: bytearray, status: int, start: int) -> tuple[int, bytes, int] | None:
    body = bytearray()
    position = start
    while True:
        line_end = buffer.find(b"\r\n", position)
        if line_end < 0:
            return None
        size = int(bytes(buffer[position:line_end]).split(b";")[0], 16)
        chunk_start = line_end + 2
        if len(buffer) < chunk_start + size + 2:
            return None
        if size == 0:
            return status, bytes(body), chunk_start + 2
        body += buffer[chunk_start : chunk_start + size]
        position = chunk_start + size + 2
