"""Poison messages: requests that crash (or hang) the worker that runs them, every time.

Three parts, all off the normal path (they act only on redelivered messages):

- **Isolation** (`take_batch` in worker/items.py): a redelivered message's requests never
  share a batch with anyone else's; from its third delivery each runs alone.
- **Attempt records** (`AttemptRecorder`, state/attempts.py): before a request of a message
  on its third delivery or later runs alone, the worker records it under the message's work
  sequence, and deletes the record when the runtime returns. A record still there when the
  message comes back names the culprit: the next worker quarantines it (schedulers/batch.py):
  it pulls nothing more, runs everything else it holds first, then the culprit alone, so
  nothing else is held when it takes the worker down again.
- **Dead letters** (`DeadLetterer`, broker/dlq.py): when JetStream gives up on a message
  (`max_deliver` deliveries, none acked) it says so in an advisory; one worker of the model
  (a queue group) moves the message into `SHOAL_DLQ`, with the attempt record as its last
  error, and answers every request in it with a 502 `dead_lettered` error, so clients learn
  at once instead of at their deadline. Requests of the message that were answered before
  get the error too; their gateway already has their answer and drops it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.js.kv import KeyValue

from shoal.api.errors import ApiError
from shoal.broker.dlq import MaxDeliveries, dead_letter, watch_max_deliveries
from shoal.protocol import Endpoint, WorkEnvelope, now_ms
from shoal.state.attempts import Attempt, clear_attempt, mark_attempt, read_attempt
from shoal.worker.items import BatchOutcome, Reply, WorkItem, WorkMessage
from shoal.worker.outbox import Outbox

log = logging.getLogger(__name__)

DEAD_LETTER_STATUS = 502  # the workers (upstream of the gateway) failed on it
KV_TIMEOUT_S = 2.0
# Expected lone runs are forgotten past this many (an item rejected before it ran, as an
# expired one is, never reaches the handler to be taken out).
_MAX_EXPECTED = 10_000


class AttemptRecorder:
    """Writes an attempt record around every lone run of a suspect item."""

    def __init__(self, kv: KeyValue, worker_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self._kv = kv
        self._worker_id = worker_id
        self._loop = loop
        # Keyed by the identity of the item's body: the batch scheduler hands the handler the
        # bodies themselves, and the item holds its body, so the id is not reused meanwhile.
        self._expected: dict[int, WorkItem] = {}

    async def culprit_of(self, message: WorkMessage) -> str | None:
        """The request that was running alone when an earlier delivery's worker stopped."""
        try:
            attempt = await asyncio.wait_for(
                read_attempt(self._kv, message.stream_seq), KV_TIMEOUT_S
            )
        except Exception as err:  # no record then: every request runs in order
            log.warning("cannot read the attempt record of %d: %s", message.stream_seq, err)
            return None
        if attempt is None or attempt.delivery >= message.deliveries:
            return None
        return attempt.request_id

    def expect(self, item: WorkItem) -> None:
        """`item` will run alone: record the attempt when it does."""
        if len(self._expected) >= _MAX_EXPECTED:
            self._expected.clear()
        self._expected[id(item.body)] = item

    def wrap(self, handler: Any) -> GuardedHandler:
        return GuardedHandler(handler, self)

    def _started(self, bodies: Sequence[bytes]) -> WorkItem | None:
        """Called in the executor thread before a batch runs: records a lone suspect."""
        if len(bodies) != 1:
            return None
        item = self._expected.pop(id(bodies[0]), None)
        if item is None or item.message is None:
            return None
        attempt = Attempt(item.request_id, self._worker_id, item.deliveries, now_ms())
        # Blocking this thread (not the event loop) until the record is stored: if the
        # runtime kills the process, the record must already be there.
        self._call(mark_attempt(self._kv, item.message.stream_seq, attempt))
        return item

    def _finished(self, item: WorkItem) -> None:
        assert item.message is not None
        self._call(clear_attempt(self._kv, item.message.stream_seq))

    def _call(self, coroutine) -> None:
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            future.result(KV_TIMEOUT_S)
        except Exception as err:  # without a record the next delivery runs them in order
            future.cancel()
            log.warning("attempt record not written: %s", err)


class GuardedHandler:
    """A batch handler whose lone suspect runs are recorded (same `handle` as `BatchTask`)."""

    def __init__(self, handler: Any, recorder: AttemptRecorder) -> None:
        self._handler = handler
        self._recorder = recorder

    def handle(
        self,
        bodies: list[bytes],
        adapters: list[str | None] | None = None,
        endpoints: list[Endpoint | None] | None = None,
    ) -> BatchOutcome:
        item = self._recorder._started(bodies)
        try:
            return self._handler.handle(bodies, adapters, endpoints)
        finally:
            if item is not None:
                self._recorder._finished(item)


class DeadLetterer:
    """Moves messages JetStream gave up on into the DLQ and tells their clients."""

    def __init__(self, nc: Client, outbox: Outbox, kv: KeyValue) -> None:
        self._nc = nc
        self._outbox = outbox
        self._kv = kv

    async def watch(self, consumer: str, model: str) -> Subscription:
        """Handle the max-deliveries advisories of `consumer` (the queue of `model`)."""

        async def on_advisory(advisory: MaxDeliveries) -> None:
            try:
                await self._dead_letter(advisory, model)
            except Exception as err:  # another worker of the group gets the next one
                log.error("dead-lettering %d failed: %s", advisory.stream_seq, err)

        return await watch_max_deliveries(self._nc, consumer, on_advisory)

    async def _dead_letter(self, advisory: MaxDeliveries, model: str) -> None:
        seq = advisory.stream_seq
        try:
            attempt = await read_attempt(self._kv, seq)
        except Exception:
            attempt = None
        if attempt is not None:
            last_error = attempt.describe(advisory.deliveries)
        else:
            last_error = (
                f"not answered on any of {advisory.deliveries} deliveries: each worker that "
                "held it stopped (crashed, was killed, hung) or failed before answering"
            )
        moved = await dead_letter(
            self._nc.jetstream(),
            seq,
            model=model,
            deliveries=advisory.deliveries,
            last_error=last_error,
        )
        if moved is None:
            return  # already moved (or purged) by someone else
        dlq_seq, envelope = moved
        await clear_attempt(self._kv, seq)
        log.error("%s: work message %d dead-lettered as %d: %s", model, seq, dlq_seq, last_error)
        if envelope is not None:
            await self._tell_clients(envelope, dlq_seq, advisory.deliveries, last_error)

    async def _tell_clients(
        self, envelope: WorkEnvelope, dlq_seq: int, deliveries: int, last_error: str
    ) -> None:
        error = ApiError(
            DEAD_LETTER_STATUS,
            f"The request was delivered to workers {deliveries} times (max_deliver) and never "
            f"answered: {last_error}. It was moved to the dead-letter queue as entry {dlq_seq} "
            "(`shoal dlq show`); sending it again will likely fail the same way.",
            code="dead_lettered",
        )
        reply = Reply.from_error(error)
        answers = [
            (
                WorkItem(
                    message=None,
                    request_id=request.request_id,
                    reply_to=envelope.reply_to,
                    deadline_ms=request.deadline_ms,
                    sent_ms=envelope.sent_ms,
                    cost=1,
                    endpoint=None,
                ),
                reply,
            )
            for request in envelope.requests
        ]
        await self._outbox.replies(answers)
