"""Results back to gateways, and acks, over the worker's one connection.

Results go in `ResultBatch` messages: every result of a batch for one gateway in one message
(a batch of 64 requests from one gateway costs one publish, not 64), and each streamed chunk
in a message of its own. One connection keeps order: chunks arrive in the order sent, and an
ack sent after a result reaches the server after it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from nats.aio.client import Client

from shoal.observability.metrics import WorkerMetrics
from shoal.protocol import Result, ResultBatch, encode_msgpack
from shoal.worker.items import Reply, WorkItem, WorkMessage

log = logging.getLogger(__name__)


class Outbox:
    """Publishes results on their gateways' reply subjects and acks work messages."""

    def __init__(self, nc: Client, metrics: WorkerMetrics) -> None:
        self._nc = nc
        self._metrics = metrics

    async def reply(self, item: WorkItem, reply: Reply) -> None:
        """The one and only answer to a request."""
        await self.replies([(item, reply)])

    async def replies(self, answers: Iterable[tuple[WorkItem, Reply]]) -> None:
        """The answers to many requests: one message per gateway."""
        by_gateway: dict[str, list[Result]] = {}
        for item, reply in answers:
            self._metrics.count_item(reply.status)
            result = Result(item.request_id, reply.status, reply.body)
            by_gateway.setdefault(item.reply_to, []).append(result)
        for reply_to, results in by_gateway.items():
            await self._publish(reply_to, results)

    async def chunk(self, item: WorkItem, seq: int, body: bytes) -> None:
        """Chunk `seq` (from 0) of a streamed answer."""
        await self._publish(item.reply_to, [Result(item.request_id, 200, body, seq)])

    async def last_chunk(self, item: WorkItem, seq: int, reply: Reply) -> None:
        """The final message of a streamed answer: its usage, or the error that ended it."""
        self._metrics.count_item(reply.status)
        result = Result(item.request_id, reply.status, reply.body, seq, final=True)
        await self._publish(item.reply_to, [result])

    async def _publish(self, reply_to: str, results: list[Result]) -> None:
        if not reply_to:
            log.warning("%d results have no reply subject; dropped", len(results))
            return
        await self._nc.publish(reply_to, encode_msgpack(ResultBatch(results)))

    async def hand_back(self, message: WorkMessage) -> None:
        """Give back a message none of whose requests was started (nak): JetStream redelivers
        it at once, to whichever worker pulls next."""
        try:
            await message.msg.nak()
        except Exception as err:  # the connection is gone: redelivered after the ack wait
            log.debug("nak failed: %s", err)

    async def ack(self, item: WorkItem) -> None:
        """Done with the item; its message is acked once all of its requests are done."""
        message = item.message
        if message is None or not message.answered_one():
            return
        try:
            await message.msg.ack()
        except Exception as err:  # already acked, or the connection is gone: redelivered later
            log.debug("ack of %s failed: %s", item.request_id, err)
