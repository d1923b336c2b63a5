"""Results back to gateways, and acks, over the worker's one connection.

Results go in `ResultBatch` messages: every result of a batch for one gateway in one message
(a batch of 64 requests from one gateway costs one publish, not 64), and each streamed chunk
in a message of its own. One connection keeps order: chunks arrive in the order sent, and an
ack sent after a result reaches the server after it.

No message is larger than the server's `max_payload` (1 MB by default): results that do not fit
one message go in several, and a body that alone does not fit (a float response to 2,048
inputs is ~8 MB) is cut into parts sent in order, each but the last marked `more`.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterable, Iterator

import msgspec
from nats.aio.client import Client
from nats.js.kv import KeyValue

from shoal.broker.bodies import BodyStore
from shoal.observability.metrics import WorkerMetrics
from shoal.protocol import Result, ResultBatch, encode_msgpack
from shoal.state.idempotency import open_idempotency_kv, pending_record, store_answer
from shoal.worker.items import Reply, WorkItem, WorkMessage

log = logging.getLogger(__name__)

# Room kept in a reply message for the framing around the bodies: per result (its request id,
# status and flags in msgpack) and per message (the subject and the protocol line).
RESULT_FRAMING_BYTES = 64
MESSAGE_FRAMING_BYTES = 4096


class Outbox:
    """Publishes results on their gateways' reply subjects and acks work messages."""

    def __init__(self, nc: Client, metrics: WorkerMetrics) -> None:
        self._nc = nc
        self._metrics = metrics
        self.bodies = BodyStore(nc.jetstream())
        self._sender = uuid.uuid4().hex[:12]  # tags the parts of large bodies
        self._deleting: set[asyncio.Task[None]] = set()
        self._idempotency: KeyValue | None = None  # opened on first use

    async def reply(self, item: WorkItem, reply: Reply) -> None:
        """The one and only answer to a request."""
        await self.replies([(item, reply)])

    async def replies(self, answers: Iterable[tuple[WorkItem, Reply]]) -> None:
        """The answers to many requests: one message per gateway."""
        by_gateway: dict[str, list[Result]] = {}
        kept: list[tuple[WorkItem, Reply]] = []
        for item, reply in answers:
            self._metrics.count_item(reply.status)
            result = Result(item.request_id, reply.status, reply.body)
            by_gateway.setdefault(item.reply_to, []).append(result)
            if item.idempotency_key:
                kept.append((item, reply))
        for reply_to, results in by_gateway.items():
            await self._publish(reply_to, results)
        for item, reply in kept:  # before the ack: a retry finds the answer, not the work
            await self._keep_answer(item, reply)

    async def _keep_answer(self, item: WorkItem, reply: Reply) -> None:
        """Keep an idempotent request's answer for its retries (state/idempotency.py). A 5xx
        is not kept: it says "try again", and the retry should run the request anew."""
        if reply.status >= 500:
            return
        try:
            if self._idempotency is None:
                self._idempotency = await open_idempotency_kv(self._nc.jetstream())
            pending = pending_record(item.body, item.request_id, item.deadline_ms)
            await store_answer(
                self._idempotency,
                self.bodies,
                item.idempotency_key,
                pending,
                reply.status,
                reply.body,
            )
        except Exception as err:  # the retry runs the request again after its deadline
            log.warning("keeping the answer to %s failed: %s", item.request_id, err)

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
        for message in reply_messages(results, self._nc.max_payload, self._sender):
            await self._nc.publish(reply_to, message)

    async def hand_back(self, message: WorkMessage) -> None:
        """Give back a message none of whose requests was started (nak): JetStream redelivers
        it at once, to whichever worker pulls next."""
        try:
            await message.msg.nak()
        except Exception as err:  # the connection is gone: redelivered after the ack wait
            log.debug("nak failed: %s", err)

    async def _delete_body(self, key: str) -> None:
        try:
            await self.bodies.delete(key)
        except Exception as err:  # it expires with the bucket's TTL
            log.debug("deleting the stored body %s failed: %s", key, err)

    async def ack(self, item: WorkItem) -> None:
        """Done with the item; its message is acked once all of its requests are done."""
        await self.ack_all((item,))

    async def ack_all(self, items: Iterable[WorkItem]) -> None:
        """`ack` for each item, in one coroutine: a batch's items share a few messages."""
        for item in items:
            if item.body_key:  # answered: its stored body is no longer needed
                task = asyncio.create_task(self._delete_body(item.body_key))
                self._deleting.add(task)
                task.add_done_callback(self._deleting.discard)
            message = item.message
            if message is None or not message.answered_one():
                continue
            try:
                await message.msg.ack()
            except Exception as err:  # already acked, or the connection is gone: redelivered
                log.debug("ack of %s failed: %s", item.request_id, err)


def reply_messages(results: list[Result], max_payload: int, sender: str) -> Iterator[bytes]:
    """`results` as encoded `ResultBatch` messages of at most `max_payload` bytes each, in
    order; a body too large for one message is cut into parts (numbered, tagged with
    `sender`, `more` on all but the last)."""
    room = max_payload - MESSAGE_FRAMING_BYTES
    if sum(len(result.body) for result in results) + RESULT_FRAMING_BYTES * len(results) <= room:
        yield encode_msgpack(ResultBatch(results))  # nearly always: one message
        return
    batch: list[Result] = []
    size = 0
    for result in results:
        for part in _parts(result, room - RESULT_FRAMING_BYTES, sender):
            cost = len(part.body) + RESULT_FRAMING_BYTES
            if batch and size + cost > room:
                yield encode_msgpack(ResultBatch(batch))
                batch, size = [], 0
            batch.append(part)
            size += cost
    if batch:
        yield encode_msgpack(ResultBatch(batch))


def _parts(result: Result, part_bytes: int, sender: str) -> Iterator[Result]:
    body = result.body
    if len(body) <= part_bytes:
        yield result
        return
    for part, start in enumerate(range(0, len(body), part_bytes)):
        more = start + part_bytes < len(body)
        chunk = body[start : start + part_bytes]
        yield msgspec.structs.replace(result, body=chunk, more=more, part=part, sender=sender)
