"""One reply subscription per gateway process; results are matched to waiters by request id.

A reply message is a `ResultBatch`: a worker sends every result of a batch for this gateway
in one message, and each chunk of a stream in one of its own.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shoal.api.errors import ApiError
from shoal.protocol import Result, decode_results

log = logging.getLogger(__name__)


class ReplyRouter:
    """Hands each result to the request waiting for it; duplicates and late results are dropped.

    A unary request waits on a future that takes one result. A streamed request reads a queue
    that takes every result for its id until the request forgets it.
    """

    def __init__(self, subject: str, on_dropped=lambda: None) -> None:
        self.subject = subject
        self._waiting: dict[str, asyncio.Future[Result]] = {}
        self._streams: dict[str, asyncio.Queue[Result]] = {}
        self._sub: Subscription | None = None
        self._on_dropped = on_dropped

    async def start(self, nc: Client) -> None:
        self._sub = await nc.subscribe(
            self.subject, cb=self._on_reply, pending_msgs_limit=-1, pending_bytes_limit=-1
        )

    def expect(self, request_id: str) -> asyncio.Future[Result]:
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        return future

    def expect_stream(self, request_id: str) -> asyncio.Queue[Result]:
        queue: asyncio.Queue[Result] = asyncio.Queue()
        self._streams[request_id] = queue
        return queue

    def forget(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)
        self._streams.pop(request_id, None)

    def fail_all(self, error: ApiError) -> int:
        """Answer every request still waiting with `error`; returns how many there were.

        For when the connection to NATS drops: a reply published meanwhile may never arrive
        (this subscription is gone until the reconnect replays it), so a waiting client is told
        now to retry instead of learning it at its deadline. A unary waiter gets `error` raised;
        a stream gets it as its whole answer (or, once started, as its last event). Results that
        still come for these ids are dropped as late.
        """
        waiting, streams = self._waiting, self._streams
        self._waiting, self._streams = {}, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(error)
                # Marked as seen: a request still publishing when the connection dropped
                # fails there and never awaits its future.
                future.exception()
        body = error.body()
        for request_id, queue in streams.items():
            queue.put_nowait(Result(request_id, error.status, body))
        return len(waiting) + len(streams)

    async def _on_reply(self, msg: Msg) -> None:
        try:
            results = decode_results(msg.data).results
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            log.warning("dropped an unreadable reply (%d bytes): %s", len(msg.data), err)
            self._on_dropped()
            return
        for result in results:
            self._deliver(result)

    def _deliver(self, result: Result) -> None:
        stream = self._streams.get(result.request_id)
        if stream is not None:
            stream.put_nowait(result)
            return
        future = self._waiting.pop(result.request_id, None)
        if future is None or future.done():
            self._on_dropped()
            return
        future.set_result(result)
