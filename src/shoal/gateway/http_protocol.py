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
"""

from __future__ import annotations

import asyncio
from enum import Enum
from functools import partial
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

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

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # A connection that sends nothing is idle, as one between two requests is: it gets the
        # keep-alive timeout (uvicorn starts that only after a first response) and a quiet
        # close. The header timeout starts with its first byte.
        self._timer = self.loop.call_later(self.timeout_keep_alive, self._timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_timer()
        super().connection_lost(exc)

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

    def on_message_complete(self) -> None:
        self._reading = _Reading.DONE
        self._disarm_timer()
        super().on_message_complete()

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
