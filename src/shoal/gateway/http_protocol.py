"""uvicorn's httptools protocol with the limits it lacks: read timeouts, header size.

uvicorn times out only idle keep-alive connections; a client that sends its request line and
then a header a second (slowloris), or a body a byte a second, held its connection forever,
and httptools buffers a header of any length. This protocol closes a connection whose headers
are not complete within `HttpTimeouts.header_s` of its request's first byte,
or whose body is not complete within `HttpTimeouts.body_s` of its headers (408), or whose
headers pass `MAX_HEADER_BYTES` (431), and answers a request it cannot parse with a 400: all
in the OpenAI error shape, as the app's own errors are.

A timer is armed only for a request that is still incomplete when a read has been parsed:
nearly every request arrives whole in one read and costs no timer at all (a timer armed and
cancelled per request, and the app's own body timeout, cost ~7 us a request: bench.hotpath).

The keep-alive timeout is one timer per connection, not one per response as uvicorn's.
Each request's cycle also offers `send_whole` (`WholeResponseCycle`): a response whose body
the app holds whole leaves in one write, with no ASGI messages; through `send`, uvicorn
writes the head and the body in two.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from enum import Enum
from functools import partial
from typing import Any

from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from shoal.api.errors import ApiError
from shoal.config import HttpTimeouts

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


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """One connection; uvicorn makes one per accepted socket.

    Pass `protocol_factory(seconds)` as `uvicorn.Config(http=...)`: uvicorn calls it with its
    own keyword arguments only, and a partial of this class pickles into worker processes.
    """

    def __init__(
        self, *args: Any, header_timeout_s: float, body_timeout_s: float, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self._timer: asyncio.TimerHandle | None = None
        self._reading = _Reading.IDLE
        self._header_bytes = 0
        self._keep_alive_timer: asyncio.TimerHandle | None = None
        self._idle_since = 0.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # A connection that sends nothing is idle, as one between two requests is: it gets the
        # keep-alive timeout (uvicorn starts that only after a first response) and a quiet
        # close. The header timeout starts with its first byte.
        self._timer = self.loop.call_later(self.timeout_keep_alive, self._timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_timer()
        if self._keep_alive_timer is not None:
            self._keep_alive_timer.cancel()
            self._keep_alive_timer = None
        cycle = self.cycle
        super().connection_lost(exc)
        on_lost = getattr(cycle, "on_lost", None)  # a cycle made before its headers is not ours
        if on_lost is not None and cycle.disconnected:
            on_lost()

    def data_received(self, data: bytes) -> None:
        if self._reading is _Reading.CLOSING:
            return  # answered and closing: the rest of a request nobody will read
        if self._reading is _Reading.IDLE:  # its first bytes: no longer idle
            self._disarm_timer()
            self._reading = _Reading.HEADERS
        if self._reading is _Reading.HEADERS:
            self._header_bytes += len(data)
        super().data_received(data)
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

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._reading = _Reading.HEADERS
        self._header_bytes = 0

    def on_headers_complete(self) -> None:
        self._reading = _Reading.BODY
        self._disarm_timer()
        super().on_headers_complete()
        # uvicorn has just made this request's cycle and scheduled (not yet run) its task.
        # Making it ours by its class costs nothing a request; building it ourselves would mean
        # copying uvicorn's on_headers_complete.
        self.cycle.__class__ = WholeResponseCycle

    def on_message_complete(self) -> None:
        self._reading = _Reading.DONE
        self._disarm_timer()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        # uvicorn's, but for the keep-alive timeout: uvicorn arms a timer after every response
        # and cancels it on the next request's first bytes (~3 us a request in the gateway's
        # profile); here one timer per connection looks, when it fires, at how long the
        # connection has been idle.
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:  # pipelined requests: the next one starts now
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        self._idle_since = self.loop.time()
        if self._keep_alive_timer is None:
            self._keep_alive_timer = self.loop.call_later(
                self.timeout_keep_alive, self._keep_alive_expired
            )

    def _keep_alive_expired(self) -> None:
        self._keep_alive_timer = None
        if self.transport.is_closing():
            return
        if self._reading is not _Reading.DONE or not self.cycle.response_complete:
            return  # a request is under way: its response arms the timer again
        idle_s = self.loop.time() - self._idle_since
        if idle_s >= self.timeout_keep_alive - _TIMER_SLACK_S:
            self.transport.close()
            return
        self._keep_alive_timer = self.loop.call_later(
            self.timeout_keep_alive - idle_s, self._keep_alive_expired
        )

    def send_400_response(self, msg: str) -> None:
        # uvicorn's own 400 is plain text; the message names no detail either way.
        self._reply_and_close(400, "The request is not valid HTTP/1.1", "invalid_http")

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
        if self.cycle is not None and not self.cycle.response_complete:
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
        cycle = self.cycle
        if cycle is not None and cycle.response_started and not cycle.response_complete:
            self.transport.close()  # a response is half out: only closing tells the client
            return
        if cycle is not None and not cycle.response_complete:
            # The app is still reading this request's (broken) body: it answers nobody now.
            cycle.disconnected = True
        self.transport.write(b"".join(head) + body)
        self._close_lingering()

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


class WholeResponseCycle(RequestResponseCycle):
    """uvicorn's request cycle, plus `send_whole`: a response in one write, and `on_lost`:
    what to call, at once, when the connection is lost before the response is complete (the
    app's waiting request sets it, so a client that leaves is noticed with no polling)."""

    on_lost: Callable[[], None] | None = None

    async def send_whole(
        self, status: int, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> None:
        """What `send` does for `http.response.start` and then `http.response.body` with the
        whole body, in one socket write and with no ASGI messages.

        Through `send`, uvicorn writes a response's head and its body separately, and checks
        every header against its regular expressions: its `send` was 24% of the gateway's
        samples (py-spy at 1,000 Hz, bench.hotpath --profile). `headers` are the app's own and
        must carry the content-length; they are written as given.
        """
        if self.access_log:  # uvicorn logs the response in `send`; rare, so take that path
            await self.send({"type": "http.response.start", "status": status, "headers": headers})
            await self.send({"type": "http.response.body", "body": body})
            return
        if self.flow.write_paused and not self.disconnected:
            await self.flow.drain()
        if self.disconnected:
            return
        if self.response_started:
            raise RuntimeError("send_whole after the response started")
        self.response_started = True
        self.waiting_for_100_continue = False
        content = [STATUS_LINE[status]]
        for name, value in self.default_headers:
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
        self.response_complete = True
        self.message_event.set()
        if not self.keep_alive:
            self.transport.close()
        self.on_response()


def protocol_factory(timeouts: HttpTimeouts) -> Any:
    """What `uvicorn.Config(http=...)` takes: builds one guarded protocol per connection."""
    return partial(
        GuardedHttpToolsProtocol,
        header_timeout_s=timeouts.header_s,
        body_timeout_s=timeouts.body_s,
    )


class _Reading(Enum):
    IDLE = 0  # a new connection that has sent nothing yet
    HEADERS = 1
    BODY = 2
    DONE = 3  # the whole request is in; a keep-alive connection waits for the next
    CLOSING = 4  # answered with an error and half-closed: the client's bytes are discarded
