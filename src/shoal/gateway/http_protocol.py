"""uvicorn's httptools protocol with the limits it lacks: header read timeout, header size.

uvicorn times out only idle keep-alive connections; a client that sends its request line and
then a header a second (slowloris) held its connection forever, and httptools buffers a
header of any length. This protocol closes a connection whose headers are not complete
within `HttpTimeouts.header_s` of its start or of its request's first byte (408), or whose
headers pass `MAX_HEADER_BYTES` (431), and answers a request it cannot parse with a 400: all
three in the OpenAI error shape, as the app's own errors are. The body's read timeout is the
app's (gateway/app.py), since the app reads the body.
"""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from shoal.api.errors import ApiError

# nginx allows 4 x 8 KiB of headers and Node.js 16 KiB; a request's headers here are a few
# hundred bytes (an API key, a content type).
MAX_HEADER_BYTES = 64 * 1024


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """One connection; uvicorn makes one per accepted socket.

    Pass `protocol_factory(seconds)` as `uvicorn.Config(http=...)`: uvicorn calls it with its
    own keyword arguments only, and a partial of this class pickles into worker processes.
    """

    def __init__(self, *args: Any, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self._header_timer: asyncio.TimerHandle | None = None
        self._reading_headers = True
        self._header_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._reading_headers:
            self._header_bytes += len(data)
        super().data_received(data)
        # Checked after parsing, so that a body that came in the same read does not count.
        if (
            self._reading_headers
            and self._header_bytes > MAX_HEADER_BYTES
            and not self.transport.is_closing()
        ):
            self._reply_and_close(
                431, f"The request's headers are larger than {MAX_HEADER_BYTES} bytes"
            )

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._reading_headers = True
        self._header_bytes = 0
        if self._header_timer is None:  # a keep-alive connection's next request
            self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._reading_headers = False
        self._disarm_header_timer()
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        # uvicorn's own 400 is plain text; the message names no detail either way.
        self._reply_and_close(400, "The request is not valid HTTP/1.1")

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_timed_out)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or not self._reading_headers:
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # A pipelined request behind one still being answered: closing now would cut that
            # answer off, so wait; the answer itself is bounded by the request timeout.
            self._arm_header_timer()
            return
        self._reply_and_close(
            408, f"The request's headers did not arrive within {self.header_timeout_s:g} s"
        )

    def _reply_and_close(self, status: int, message: str) -> None:
        body = ApiError(status, message, code=_CODES.get(status)).body()
        head = [
            STATUS_LINE[status],
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
        ]
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            self.transport.write(b"".join(head) + body)
        elif not cycle.response_started:
            # The app is still reading this request's (broken) body: it answers nobody now.
            cycle.disconnected = True
            self.transport.write(b"".join(head) + body)
        # else a response is half out: only closing tells the client it is cut off.
        self.transport.close()


def protocol_factory(header_timeout_s: float) -> Any:
    """What `uvicorn.Config(http=...)` takes: builds one guarded protocol per connection."""
    return partial(GuardedHttpToolsProtocol, header_timeout_s=header_timeout_s)


_CODES = {400: "invalid_http", 408: "header_timeout", 431: "headers_too_large"}
