"""One reply subscription per gateway process; results are matched to waiters by request id.

A reply message is a `ResultBatch`: a worker sends every result of a batch for this gateway
in one message, and each chunk of a stream in one of its own. A body larger than a message
can carry comes in parts, in order (`Result.more` on all but the last), joined here before
its request sees it.
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
        # Bodies still arriving in parts: request id -> (sender, the parts so far).
        self._parts: dict[str, tuple[str, list[bytes]]] = {}
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
        self._parts.pop(request_id, None)

    def fail_all(self, error: ApiError) -> int:
        """Answer every request still waiting with `error`; returns how many there were.

        For when the connection to NATS drops: a reply published meanwhile may never arrive
        (this subscription is gone until the reconnect replays it), so a waiting client is told
        now to retry instead of learning it at its deadline. A unary waiter gets `error` raised;
        a stream gets it as its whole answer (or, once started, as its last event). Results that
        still come for these ids are dropped as late.
        """
        waiting, streams = self._waiting, self._streams
        self._waiting, self._streams, self._parts = {}, {}, {}
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
        request_id = result.request_id
        if result.more or result.part:
            joined = self._join_part(result)
            if joined is None:
                return
            result = joined
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(result)
            return
        future = self._waiting.pop(request_id, None)
        if future is None or future.done():
            self._on_dropped()
            return
        future.set_result(result)

    def _join_part(self, result: Result) -> Result | None:
        """Keep one part of a body; the whole result once its last part is in, else None.

        A body is built from one sender's parts only, in order: when two workers answer the
        same request at once (a redelivery while the first still ran), the sequence begun last
        wins and the other's parts are ignored, never mixed in.
        """
        request_id = result.request_id
        if request_id not in self._waiting and request_id not in self._streams:
            self._parts.pop(request_id, None)
            if not result.more:
                self._on_dropped()  # a late answer, counted once
            return None
        if result.part == 0:
            self._parts[request_id] = (result.sender, [])
        sender, parts = self._parts.get(request_id, ("", []))
        if sender != result.sender or result.part != len(parts):
            return None  # another sender's, or a gap: not part of the body being built
        parts.append(result.body)
        if result.more:
            return None
        del self._parts[request_id]
        return msgspec.structs.replace(result, body=b"".join(parts), part=0, sender="")
