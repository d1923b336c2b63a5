"""Results back to gateways: one reply per request, or a numbered stream of chunks."""

from __future__ import annotations

import logging

from nats.aio.client import Client

from shoal.observability.metrics import WorkerMetrics
from shoal.protocol import Header
from shoal.worker.items import Reply, WorkItem

log = logging.getLogger(__name__)


class Outbox:
    """Publishes on the request's reply subject, on the worker's one connection.

    One connection keeps order: chunks arrive in the order sent, and an ack sent after a
    result reaches the server after it.
    """

    def __init__(self, nc: Client, metrics: WorkerMetrics) -> None:
        self._nc = nc
        self._metrics = metrics

    async def reply(self, item: WorkItem, reply: Reply) -> None:
        """The one and only answer to a request."""
        self._metrics.count_item(reply.status)
        await self._publish(item, reply.body, {Header.STATUS: str(reply.status)})

    async def chunk(self, item: WorkItem, seq: int, body: bytes) -> None:
        """Chunk `seq` (from 0) of a streamed answer."""
        await self._publish(item, body, {Header.STATUS: "200", Header.SEQ: str(seq)})

    async def last_chunk(self, item: WorkItem, seq: int, reply: Reply) -> None:
        """The final message of a streamed answer: its usage, or the error that ended it."""
        self._metrics.count_item(reply.status)
        headers = {Header.STATUS: str(reply.status), Header.SEQ: str(seq), Header.FINAL: "1"}
        await self._publish(item, reply.body, headers)

    async def _publish(self, item: WorkItem, body: bytes, headers: dict[str, str]) -> None:
        if not item.reply_to:
            log.warning("work item %s has no reply subject; dropped", item.request_id)
            return
        headers[Header.REQUEST_ID] = item.request_id
        await self._nc.publish(item.reply_to, body, headers=headers)

    async def ack(self, item: WorkItem) -> None:
        """Done with the message: JetStream will not deliver it again."""
        try:
            await item.msg.ack()
        except Exception as err:  # already acked, or the connection is gone: redelivered later
            log.debug("ack of %s failed: %s", item.request_id, err)
