"""Streamed replies to server-sent events, and noticing a client that went away.

A worker sends a streamed reply as numbered chunks (Shoal-Seq from 0) ending with a final
message (Shoal-Final), each body a ready OpenAI chunk. The relay writes each as one
`data: {...}` event and ends with `data: [DONE]`. A message without a sequence number before
the first chunk is a whole answer (an error found before generation started): it is sent as
a plain JSON response with its status. After the first chunk every failure becomes an error
event, as OpenAI sends one, and the stream ends; it never hangs:

- the worker died and another worker restarted the request (chunk 0 again): error event;
- a chunk is missing (a gap in the numbers): error event;
- nothing arrives before the request's deadline, or for `stream_idle_timeout_s` once the
  stream has started: error event (504).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from shoal.api.errors import ApiError
from shoal.protocol import Result

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # ask proxies not to buffer the stream
]
_DONE = b"data: [DONE]\n\n"


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was complete."""


async def wait_for_disconnect(receive: Receive) -> None:
    """Returns when the client disconnects (after the request body has been read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class WaitingRequests:
    """Every unary request waiting for its answer: its deadline, and its client leaving.

    One sweep a few times a second serves every deadline, instead of a timer each (a deadline
    and a disconnect watch cost ~6 us a request on the hot path, bench.hotpath): a request
    past its deadline gets TimeoutError on its future. Every request has the same timeout, so
    the oldest come first and a sweep stops at the first one still in time. A fast request
    pays a dict insert and delete.

    A client that leaves gets ClientGone on its future, so its work is dropped before it runs.
    Under uvicorn the request's `Exchange` (what `receive` is bound to, gateway/http_protocol.py)
    calls back when its connection is lost, so nothing is polled: a sweep that read every
    long-waiting request's disconnected flag cost 3.9 us a request with 16 workers, where
    requests wait ~0.5 s (py-spy). Under another server a request that waited
    `watch_after_s` gets a task reading its connection instead; that task, its `receive` and
    its cancellation were ~15% of the gateway's CPU with 32 workers (py-spy,
    bench.push_vs_pull).
    """

    def __init__(self, watch_after_s: float, tick_s: float = 0.05) -> None:
        self._watch_after_s = watch_after_s
        self._tick_s = tick_s
        # In arrival order: every request has the same timeout, so the oldest come first.
        self._waiting: dict[asyncio.Future[Any], _Waiting] = {}
        self._sweeper: asyncio.Task[None] | None = None

    def add(self, future: asyncio.Future[Any], receive: Receive, timeout_s: float) -> None:
        """Watch `future` until `remove`: its deadline is `timeout_s` from now."""
        now = time.monotonic()
        self._waiting[future] = _Waiting(future, receive, now, now + timeout_s)
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep_forever())

    def remove(self, future: asyncio.Future[Any]) -> None:
        waiting = self._waiting.pop(future, None)
        if waiting is None:
            return
        if waiting.exchange is not None:  # exchange -> hook -> this -> exchange: broken here
            waiting.exchange.on_lost = None
        elif waiting.watch is not None:
            waiting.watch.cancel()

    def sweep(self, now: float) -> None:
        """Time out what is past its deadline; under a server with no callback on a lost
        connection, watch the clients of what waited long."""
        young = now - self._watch_after_s
        # Nothing here changes the dict: set_exception and ensure_future only schedule.
        for future, waiting in self._waiting.items():
            if future.done():
                continue
            if now >= waiting.deadline:
                future.set_exception(TimeoutError())
            elif waiting.exchange is not None or waiting.started > young:
                break  # the rest are in time, and told or younger still
            elif waiting.watch is None:
                waiting.watch = asyncio.ensure_future(_fail_when_gone(waiting.receive, future))

    def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self._tick_s)
            self.sweep(time.monotonic())


class _Waiting:
    __slots__ = ("deadline", "exchange", "future", "receive", "started", "watch")

    def __init__(
        self, future: asyncio.Future[Any], receive: Receive, started: float, deadline: float
    ) -> None:
        self.future = future
        self.receive = receive
        self.started = started
        self.deadline = deadline
        self.watch: asyncio.Task[None] | None = None
        # The request's `Exchange` under the gateway's own protocol (gateway/http_protocol.py)
        # calls `on_lost` when its connection is lost; under another server `receive` carries
        # no such hook and the sweep watches instead.
        exchange = getattr(receive, "__self__", None)
        self.exchange = exchange if hasattr(exchange, "on_lost") else None
        if self.exchange is not None:
            if self.exchange.disconnected:  # gone before it got here
                self.client_gone()
            else:
                self.exchange.on_lost = self.client_gone

    def client_gone(self) -> None:
        if not self.future.done():
            self.future.set_exception(ClientGone())


async def _fail_when_gone(receive: Receive, future: asyncio.Future[Any]) -> None:
    await wait_for_disconnect(receive)
    if not future.done():
        future.set_exception(ClientGone())


async def next_or_gone(
    get: Awaitable[Result], disconnected: asyncio.Task[None], timeout_s: float
) -> Result:
    """The next reply, unless the client leaves first (ClientGone) or time runs out."""
    getter = asyncio.ensure_future(get)
    done, _ = await asyncio.wait(
        {getter, disconnected}, timeout=max(0.0, timeout_s), return_when=asyncio.FIRST_COMPLETED
    )
    if getter in done:
        return getter.result()
    getter.cancel()
    if disconnected in done:
        raise ClientGone
    raise TimeoutError


class StreamRelay:
    """Relays one request's streamed reply from its queue to the HTTP client."""

    def __init__(
        self, queue: asyncio.Queue[Result], send: Send, disconnected: asyncio.Task[None]
    ) -> None:
        self._queue = queue
        self._send = send
        self._disconnected = disconnected
        self._next_seq = 0
        self.started = False
        self.status = 200

    async def run(self, deadline: float, idle_timeout_s: float) -> None:
        """Relay until the final message, an error event, or ClientGone."""
        while True:
            now = time.monotonic()
            wait_s = min(deadline - now, idle_timeout_s) if self.started else deadline - now
            try:
                result = await next_or_gone(self._queue.get(), self._disconnected, wait_s)
            except TimeoutError:
                message = (
                    f"The stream sent nothing for {idle_timeout_s:g} s; its worker is gone"
                    if self.started and time.monotonic() < deadline
                    else "No complete answer within the request's time"
                )
                await self.fail(ApiError(504, message, code="timeout"))
                return
            if await self._relay(result):
                return

    async def _relay(self, result: Result) -> bool:
        """Handle one result; True when the stream is over."""
        status = result.status
        if result.seq < 0:  # a whole answer, not a chunk
            if not self.started:
                self.status = status
                await self._send_whole(status, result.body)
            else:
                await self._fail_with_body(status, result.body)
            return True
        seq = result.seq
        if seq != self._next_seq:
            if seq < self._next_seq and seq != 0:
                return False  # a duplicate: already relayed
            restarted = seq == 0
            message = (
                "The worker serving this stream failed; the request was restarted elsewhere "
                "and its partial output cannot be continued"
                if restarted
                else f"Stream chunk {self._next_seq} was lost"
            )
            await self.fail(ApiError(502, message, code="stream_interrupted"))
            return True
        self._next_seq += 1
        await self._start()
        final = result.final
        if final and status != 200:
            await self._fail_with_body(status, result.body)
            return True
        await self._event(result.body, more=True)
        if final:
            await self._send({"type": "http.response.body", "body": _DONE, "more_body": False})
        return final

    async def _start(self) -> None:
        if not self.started:
            self.started = True
            await self._send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})

    async def _event(self, data: bytes, more: bool) -> None:
        await self._send(
            {"type": "http.response.body", "body": b"data: " + data + b"\n\n", "more_body": more}
        )

    async def _send_whole(self, status: int, body: bytes) -> None:
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await self._send({"type": "http.response.start", "status": status, "headers": headers})
        await self._send({"type": "http.response.body", "body": body})

    async def fail(self, error: ApiError) -> None:
        """End the stream with `error`: an error event once it has started, else the error's
        own response."""
        await self._fail_with_body(error.status, error.body())

    async def _fail_with_body(self, status: int, body: bytes) -> None:
        self.status = status
        if not self.started:
            await self._send_whole(status, body)
            return
        await self._event(body, more=False)
