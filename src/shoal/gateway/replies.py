"""One reply subscription per gateway process; results are matched to waiters by request id."""

from __future__ import annotations

import asyncio

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shoal.protocol import Header


class ReplyRouter:
    """Hands each result to the request waiting for it; duplicates and late results are dropped.

    A unary request waits on a future that takes one reply. A streamed request reads a queue
    that takes every message for its id until the request forgets it.
    """

    def __init__(self, subject: str, on_dropped=lambda: None) -> None:
        self.subject = subject
        self._waiting: dict[str, asyncio.Future[Msg]] = {}
        self._streams: dict[str, asyncio.Queue[Msg]] = {}
        self._sub: Subscription | None = None
        self._on_dropped = on_dropped

    async def start(self, nc: Client) -> None:
        self._sub = await nc.subscribe(
            self.subject, cb=self._on_reply, pending_msgs_limit=-1, pending_bytes_limit=-1
        )

    def expect(self, request_id: str) -> asyncio.Future[Msg]:
        future: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        return future

    def expect_stream(self, request_id: str) -> asyncio.Queue[Msg]:
        queue: asyncio.Queue[Msg] = asyncio.Queue()
        self._streams[request_id] = queue
        return queue

    def forget(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)
        self._streams.pop(request_id, None)

    async def _on_reply(self, msg: Msg) -> None:
        request_id = msg.headers.get(Header.REQUEST_ID, "") if msg.headers else ""
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(msg)
            return
        future = self._waiting.pop(request_id, None)
        if future is None or future.done():
            self._on_dropped()
            return
        future.set_result(msg)
