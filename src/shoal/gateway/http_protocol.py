"""The gateway's HTTP/1.1 connection: httptools parsing, an ASGI app, and the limits uvicorn's
own protocol lacks. uvicorn's `Server` still binds, accepts, runs several processes and
shuts down gracefully; it makes one of these per accepted socket (`uvicorn.Config(http=...)`).

Why not uvicorn's `HttpToolsProtocol`: per request it builds a scope with a copy of the
app's state, an `asyncio.Event`, a request cycle of twenty attributes and an exception
wrapper around the app, and its `send` checks every header against two regular expressions.
For a fixed answer to a POST (`python -m bench.http_floor`: one process, wrk 64 connections)
uvicorn's protocol cost 51-76 us of CPU a request, this one 32-38 and a bare httptools
protocol with a task a request 21-24 (docs/benchmarks.md, "The gateway's own HTTP
protocol").

Limits: a connection whose headers are not complete within `HttpTimeouts.header_s` of its
request's first byte, or whose body is not complete within `HttpTimeouts.body_s` of its
headers, is answered 408 and closed; headers past `MAX_HEADER_BYTES` get 431; a request that
is not HTTP gets 400: all in the OpenAI error shape, as the app's own errors are. A timer is
armed only for a request still incomplete when a read has been parsed: nearly every request
arrives whole in one read and costs no timer. Keep-alive is one timer a connection, which
looks at how long the connection has been idle when it fires.

Each request is an `Exchange`: the ASGI `receive` and `send`, plus `send_whole` (a response
whose body the app holds whole leaves in one socket write, with no ASGI messages) and
`on_lost` (called at once when the connection is lost before the response is complete; the
app's waiting request sets it, so a client that leaves is noticed with no polling).
"""

from __future__ import annotations

import asyncio
import logging
import urllib.parse
from collections import deque
from collections.abc import Awaitable, Callable
from enum import Enum
from functools import partial
from typing import Any

import httptools
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT, FlowControl

# uvicorn's status lines, and its checks that a response header cannot split the response
# (RFC 9110's token characters in a name, no control characters but tab in a value).
from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, STATUS_LINE

from shoal.api.errors import ApiError
from shoal.config import HttpTimeouts

log = logging.getLogger(__name__)

App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]

# nginx allows 4 x 8 KiB of headers and Node.js 16 KiB; a request's headers here are a few
# hundred bytes (an API key, a content type).
MAX_HEADER_BYTES = 64 * 1024
# After answering a request it did not read whole (431, 408, 400), the connection stops
# writing and discards what still comes in, and closes when the client does or after this
# long. Closing at once with unread bytes in the socket makes the kernel send a reset, which
# can destroy the answer before the client reads it (a 431 to a client still sending 200 KiB
# of headers was lost that way, tests/test_hostile.py); nginx's "lingering close".
LINGER_S = 2.0
# uvloop's timers count whole milliseconds: one may fire a little before its time.
_TIMER_SLACK_S = 0.01
_ASGI = {"version": "3.0", "spec_version": "2.3"}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class GatewayHttpProtocol(asyncio.Protocol):
    """One connection. uvicorn's server calls it with its own keyword arguments; pass
    `protocol_factory(timeouts)` as `uvicorn.Config(http=...)` (a partial of this class, which
    pickles into uvicorn's worker processes)."""

    def __init__(
        self,
        config: Any,  # uvicorn.Config
        server_state: Any,  # uvicorn.server.ServerState
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        *,
        header_timeout_s: float,
        body_timeout_s: float,
    ) -> None:
        if not config.loaded:
            config.load()
        self.app: App = config.loaded_app
        self.loop = _loop or asyncio.get_event_loop()
        self.server_state = server_state
        self.keep_alive_s: float = config.timeout_keep_alive
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.parser = httptools.HttpRequestParser(self)
        # Answer the first of several pipelined requests even when a later one is broken.
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)  # httptools >= 0.6.3
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.flow: FlowControl = None  # type: ignore[assignment]
        self.server: tuple[str, int] | None = None
        self.client: tuple[str, int] | None = None
        self.exchange: Exchange | None = None  # the request read last (or being read)
        self.answering: Exchange | None = None  # the request whose app runs (or ran last)
        self.pipeline: deque[Exchange] = deque()  # read, waiting for the one before
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._expect_continue = False
        self._reading = _Reading.IDLE
        self._header_bytes = 0
        self._timer: asyncio.TimerHandle | None = None
        self._keep_alive_timer: asyncio.TimerHandle | None = None
        self._idle_since = 0.0

    # -- the transport's calls -------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.server_state.connections.add(self)
        self.transport = transport
        self.flow = FlowControl(transport)
        self.server = _address(transport.get_extra_info("sockname"))
        self.client = _address(transport.get_extra_info("peername"))
        # A connection that sends nothing is idle, as one between two requests is: it gets the
        # keep-alive timeout and a quiet close. The header timeout starts with its first byte.
        self._timer = self.loop.call_later(self.keep_alive_s, self._timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server_state.connections.discard(self)
        self._disarm_timer()
        if self._keep_alive_timer is not None:
            self._keep_alive_timer.cancel()
            self._keep_alive_timer = None
        self._abandon_requests()
        if self.flow is not None:
            self.flow.resume_writing()  # a response waiting to drain learns it is gone
        self.parser = None  # type: ignore[assignment]

    def eof_received(self) -> None:
        pass  # close when the transport does: a half-closed client may still read

    def pause_writing(self) -> None:
        self.flow.pause_writing()

    def resume_writing(self) -> None:
        self.flow.resume_writing()

    def data_received(self, data: bytes) -> None:
        if self._reading is _Reading.CLOSING:
            return  # answered and closing: the rest of a request nobody will read
        if self._reading is _Reading.IDLE:  # its first bytes: no longer idle
            self._disarm_timer()
            self._reading = _Reading.HEADERS
        if self._reading is _Reading.HEADERS:
            self._header_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # no protocol to upgrade to: the request was served as an ordinary one
        except httptools.HttpParserError:
            self._reply_and_close(400, "The request is not valid HTTP/1.1", "invalid_http")
            return
        if self.transport.is_closing():
            return
        # Checked after parsing, so that a body that came in the same read does not count.
        if self._reading is _Reading.HEADERS and self._header_bytes > MAX_HEADER_BYTES:
            self._reply_and_close(
                431,
                f"The request's headers are larger than {MAX_HEADER_BYTES} bytes",
                "headers_too_large",
            )
        elif self._reading is not _Reading.DONE and self._timer is None:
            self._arm_timer()  # a request still incomplete after this read: a slow one

    def shutdown(self) -> None:
        """uvicorn's graceful shutdown: close now if idle, else after the last request read
        is answered (requests are answered in order: when it is, all are)."""
        exchange = self.exchange
        if exchange is None or exchange.response_complete:
            self.transport.close()
        else:
            exchange.keep_alive = False

    # -- httptools' calls ------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._reading = _Reading.HEADERS
        self._header_bytes = 0
        self._url = b""
        self._headers = []
        self._expect_continue = False

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        # llhttp keeps trailing whitespace, which RFC 9110 section 5.5 excludes from a value.
        value = value.rstrip(b" \t")
        if name == b"expect" and value.lower() == b"100-continue":
            self._expect_continue = True
        self._headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._reading = _Reading.BODY
        self._disarm_timer()
        parser = self.parser
        version = parser.get_http_version()
        url = httptools.parse_url(self._url)
        path = url.path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        scope = {
            "type": "http",
            "asgi": _ASGI,
            "http_version": version,
            "scheme": "http",
            "method": parser.get_method().decode("ascii"),
            "path": path,
            "raw_path": url.path,
            "query_string": url.query or b"",
            "root_path": "",
            "headers": self._headers,
            "server": self.server,
            "client": self.client,
        }
        keep_alive = version != "1.0" and parser.should_keep_alive()
        exchange = Exchange(self, scope, keep_alive, self._expect_continue)
        previous, self.exchange = self.exchange, exchange
        if previous is None or previous.response_complete:
            self._start(exchange)
        else:  # pipelined behind a request still being answered
            self.flow.pause_reading()
            self.pipeline.append(exchange)

    def on_body(self, body: bytes) -> None:
        exchange = self.exchange
        if exchange is None or exchange.response_complete:
            return  # answered before its body was read (413, 408): nobody reads the rest
        exchange.body_arrived(body)
        if exchange.buffered > HIGH_WATER_LIMIT:
            self.flow.pause_reading()

    def on_message_complete(self) -> None:
        self._reading = _Reading.DONE
        self._disarm_timer()
        exchange = self.exchange
        if exchange is not None and not exchange.response_complete:
            exchange.body_complete()

    # -- requests and responses ------------------------------------------------------------

    def _start(self, exchange: Exchange) -> None:
        self.answering = exchange
        task = self.loop.create_task(exchange.run(self.app))
        tasks = self.server_state.tasks  # uvicorn's shutdown waits for these
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def response_complete(self, exchange: Exchange) -> None:
        """An exchange's last byte is written: start the next pipelined request, or wait."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:
            self._start(self.pipeline.popleft())
            return
        self._idle_since = self.loop.time()
        if self._keep_alive_timer is None:
            self._keep_alive_timer = self.loop.call_later(
                self.keep_alive_s, self._keep_alive_expired
            )

    def _keep_alive_expired(self) -> None:
        self._keep_alive_timer = None
        if self.transport.is_closing():
            return
        exchange = self.exchange
        if self._reading is not _Reading.DONE or (
            exchange is not None and not exchange.response_complete
        ):
            return  # a request is under way: its response arms the timer again
        idle_s = self.loop.time() - self._idle_since
        if idle_s >= self.keep_alive_s - _TIMER_SLACK_S:
            self.transport.close()
            return
        self._keep_alive_timer = self.loop.call_later(
            self.keep_alive_s - idle_s, self._keep_alive_expired
        )

    # -- slow and broken requests ----------------------------------------------------------

    def _arm_timer(self) -> None:
        self._disarm_timer()
        reading_body = self._reading is _Reading.BODY
        seconds = self.body_timeout_s if reading_body else self.header_timeout_s
        self._timer = self.loop.call_later(seconds, self._timed_out)

    def _disarm_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_out(self) -> None:
        self._timer = None
        if self.transport.is_closing() or self._reading is _Reading.DONE:
            return
        if self._reading is _Reading.IDLE:
            self.transport.close()  # nothing was asked: nothing to answer
            return
        if self._reading is _Reading.BODY:
            self._reply_and_close(
                408,
                f"The request body did not arrive within {self.body_timeout_s:g} s",
                "body_timeout",
            )
            return
        exchange = self.exchange
        if exchange is not None and not exchange.response_complete:
            # A pipelined request behind one still being answered: closing now would cut that
            # answer off, so wait; the answer itself is bounded by the request timeout.
            self._arm_timer()
            return
        self._reply_and_close(
            408,
            f"The request's headers did not arrive within {self.header_timeout_s:g} s",
            "header_timeout",
        )

    def _reply_and_close(self, status: int, message: str, code: str) -> None:
        body = ApiError(status, message, code=code).body()
        head = [
            STATUS_LINE[status],
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
        ]
        answering = self.answering
        if answering is not None and answering.response_started and not answering.response_complete:
            self.transport.close()  # a response is half out: only closing tells the client
            return
        # The app may still be reading this request's (broken) body, and pipelined requests
        # wait behind it: none of them is answered now.
        self._abandon_requests()
        self.transport.write(b"".join(head) + body)
        self._close_lingering()

    def _abandon_requests(self) -> None:
        """Every request on this connection not yet answered will not be: each is told."""
        for exchange in {self.answering, self.exchange, *self.pipeline}:
            if exchange is not None and not exchange.response_complete:
                exchange.lost()
        self.pipeline.clear()

    def _close_lingering(self) -> None:
        """Send what was written and a FIN, discard what still arrives, close within
        LINGER_S (at once where the transport cannot half-close)."""
        self._disarm_timer()
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self._reading = _Reading.CLOSING
        self.transport.write_eof()
        self._timer = self.loop.call_later(LINGER_S, self.transport.close)


class Exchange:
    """One request and its response on a connection: the ASGI `receive` and `send` the app
    is given, `send_whole`, and `on_lost`."""

    on_lost: Callable[[], None] | None = None

    def __init__(
        self,
        connection: GatewayHttpProtocol,
        scope: dict[str, Any],
        keep_alive: bool,
        expect_continue: bool,
    ) -> None:
        self.connection = connection
        self.transport = connection.transport
        self.scope = scope
        self.keep_alive = keep_alive
        self.waiting_for_continue = expect_continue
        self.disconnected = False
        self.response_started = False
        self.response_complete = False
        self.buffered = 0
        self._chunks: list[bytes] = []
        self._more_body = True
        self._body_delivered = False
        # Set by whatever `receive` waits for (a body chunk, the body's end, the connection's
        # loss, the response's end); made only when it waits: a whole request never does.
        self._wake: asyncio.Future[None] | None = None
        self._chunked = False
        self._length_left = 0

    async def run(self, app: App) -> None:
        """The app's call for this request, with uvicorn's guarantees: an error before the
        response becomes a 500, one during it closes the connection."""
        try:
            await app(self.scope, self.receive, self.send)
        except asyncio.CancelledError:  # uvicorn's shutdown, past its grace: nothing to answer
            if not self.response_complete:
                self.transport.close()
            raise
        except Exception as err:
            log.error("Exception in the ASGI app", exc_info=err)
            await self._fail("The gateway failed on this request")
            return
        if not (self.disconnected or self.response_complete):
            log.error("The ASGI app returned without completing its response")
            await self._fail("The gateway returned no response")

    async def _fail(self, message: str) -> None:
        """A 500 in the error shape, closing the connection; only a close where a response
        is already half out (or its client gone)."""
        if self.response_started or self.disconnected:
            self.transport.close()
            return
        body = ApiError(500, message, code="internal_error").body()
        self.keep_alive = False
        await self.send_whole(500, _json_headers(body), body)

    # -- the protocol's calls --------------------------------------------------------------

    def body_arrived(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self.buffered += len(chunk)
        self._wake_receive()

    def body_complete(self) -> None:
        self._more_body = False
        self._wake_receive()

    def lost(self) -> None:
        """The connection is gone (or answered for this request already): the app's next
        `receive` is a disconnect, its response goes nowhere."""
        self.disconnected = True
        self._wake_receive()
        on_lost = self.on_lost
        if on_lost is not None:
            on_lost()

    def _wake_receive(self) -> None:
        wake = self._wake
        if wake is not None:
            self._wake = None
            if not wake.done():
                wake.set_result(None)

    # -- ASGI ------------------------------------------------------------------------------

    async def receive(self) -> dict[str, Any]:
        """The body as it arrives; then, once the response is complete or the client has
        gone, `http.disconnect` (until then a call after the body waits)."""
        if self.waiting_for_continue and not self.transport.is_closing():
            self.transport.write(_CONTINUE)
            self.waiting_for_continue = False
        while True:
            if self.disconnected or self.response_complete:
                return {"type": "http.disconnect"}
            if self._chunks or (not self._more_body and not self._body_delivered):
                return self._take_body()
            self.connection.flow.resume_reading()
            self._wake = self.connection.loop.create_future()
            await self._wake

    def _take_body(self) -> dict[str, Any]:
        chunks = self._chunks
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = []
        self.buffered = 0
        self._body_delivered = not self._more_body
        return {"type": "http.request", "body": body, "more_body": self._more_body}

    async def send(self, message: dict[str, Any]) -> None:
        """ASGI's `http.response.start` and `http.response.body` (a streamed response without
        a content-length goes out chunked)."""
        flow = self.connection.flow
        if flow.write_paused and not self.disconnected:
            await flow.drain()
        if self.disconnected:
            return
        kind = message["type"]
        if not self.response_started:
            if kind != "http.response.start":
                raise RuntimeError(f"Expected 'http.response.start', got {kind!r}")
            self._send_head(message["status"], list(message.get("headers", ())))
            return
        if self.response_complete or kind != "http.response.body":
            raise RuntimeError(f"Unexpected ASGI message {kind!r}")
        body = message.get("body", b"")
        more_body = message.get("more_body", False)
        if self.scope["method"] == "HEAD":
            self._length_left = 0
        elif self._chunked:
            content = [b"%x\r\n" % len(body), body, b"\r\n"] if body else []
            if not more_body:
                content.append(b"0\r\n\r\n")
            if content:
                self.transport.write(b"".join(content))
        else:
            if len(body) > self._length_left:
                raise RuntimeError("Response content longer than its content-length")
            self._length_left -= len(body)
            self.transport.write(body)
        if not more_body:
            if self._length_left:
                raise RuntimeError("Response content shorter than its content-length")
            self._complete()

    def _send_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.response_started = True
        self.waiting_for_continue = False
        content = [STATUS_LINE[status]]
        length: int | None = None
        close = False
        for name, value in (*self.connection.server_state.default_headers, *headers):
            if HEADER_RE.search(name) or HEADER_VALUE_RE.search(value):
                raise RuntimeError(f"Invalid response header {name!r}")
            name = name.lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"connection" and b"close" in value.lower():
                close = True
            content += (name, b": ", value, b"\r\n")
        if close:
            self.keep_alive = False
        elif not self.keep_alive:
            content.append(b"connection: close\r\n")
        if length is not None:
            self._length_left = length
        elif self.scope["method"] != "HEAD" and status not in (204, 304):
            self._chunked = True
            content.append(b"transfer-encoding: chunked\r\n")
        content.append(b"\r\n")
        self.transport.write(b"".join(content))

    async def send_whole(
        self, status: int, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> None:
        """The whole response in one socket write, with no ASGI messages.

        Writing the head and the body apart costs a second write (on loopback a write also
        pays for the receiver's TCP work): bench.hotpath --profile put uvicorn's `send` at 24%
        of the gateway's samples. `headers` are the app's own, carry the content-length and
        are written as given (no check: nothing in them comes from a client).
        """
        flow = self.connection.flow
        if flow.write_paused and not self.disconnected:
            await flow.drain()
        if self.disconnected:
            return
        if self.response_started:
            raise RuntimeError("send_whole after the response started")
        self.response_started = True
        self.waiting_for_continue = False
        content = [STATUS_LINE[status]]
        for name, value in self.connection.server_state.default_headers:
            content += (name, b": ", value, b"\r\n")
        for name, value in headers:
            content += (name, b": ", value, b"\r\n")
        if (b"connection", b"close") in headers:
            self.keep_alive = False
        elif not self.keep_alive:
            content.append(b"connection: close\r\n")
        content.append(b"\r\n")
        if self.scope["method"] != "HEAD":
            content.append(body)
        self.transport.write(b"".join(content))
        self._complete()

    def _complete(self) -> None:
        self.response_complete = True
        self._wake_receive()  # a `receive` after the body now returns the disconnect
        if not self.keep_alive:
            self.transport.close()
        self.connection.response_complete(self)


def protocol_factory(timeouts: HttpTimeouts) -> Any:
    """What `uvicorn.Config(http=...)` takes: builds one gateway protocol per connection."""
    return partial(
        GatewayHttpProtocol,
        header_timeout_s=timeouts.header_s,
        body_timeout_s=timeouts.body_s,
    )


def _json_headers(body: bytes) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]


def _address(info: Any) -> tuple[str, int] | None:
    """A socket's (host, port), as ASGI's scope carries it; None for other transports."""
    if isinstance(info, tuple) and len(info) >= 2:
        return (str(info[0]), int(info[1]))
    return None


class _Reading(Enum):
    IDLE = 0  # a new connection that has sent nothing yet
    HEADERS = 1
    BODY = 2
    DONE = 3  # the whole request is in; a keep-alive connection waits for the next
    CLOSING = 4  # answered with an error and half-closed: the client's bytes are discarded
