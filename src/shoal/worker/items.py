"""Work items as the worker sees them, what goes back for each, and forming a batch.

No NATS here: a work item points at the `WorkMessage` it came in (anything with `ack` and
`in_progress`, a nats.py `Msg` in practice), but the tasks and schedulers that import this
module never touch the connection.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from shoal.api.errors import ApiError
from shoal.protocol import Endpoint, WorkEnvelope, WorkRequest


@dataclass(slots=True, eq=False)
class WorkMessage:
    """A pulled JetStream message and how many of its requests are still unanswered.

    It is acked when the last one is answered (at-least-once: until then a worker's death
    makes JetStream redeliver the whole message, and the gateway drops duplicate results).
    """

    msg: Any
    unanswered: int
    deliveries: int = 1
    stream_seq: int = 0  # its sequence in the work stream (dead letters and attempts use it)

    def answered_one(self) -> bool:
        """Count one answer; True when it was the last (time to ack)."""
        self.unanswered -= 1
        return self.unanswered == 0


@dataclass(slots=True)
class WorkItem:
    """One queued request: its metadata, its body, and the message it came in."""

    message: WorkMessage | None
    request_id: str
    reply_to: str
    deadline_ms: int
    sent_ms: int
    cost: int
    endpoint: Endpoint | None  # None: an endpoint this worker does not know
    body: bytes = b""
    stream: bool = False
    body_key: str = ""  # its body came through the object store (broker/bodies.py)
    idempotency_key: str = ""  # its answer is kept for retries (state/idempotency.py)
    deliveries: int = 1
    adapter: str | None = None  # the LoRA deployment it was sent to, served by its base
    # Running alone when a worker stopped on an earlier delivery (state/attempts.py): it
    # runs after every other suspect item, so they are answered before it can crash again.
    culprit: bool = False

    @classmethod
    def from_request(
        cls,
        message: WorkMessage,
        envelope: WorkEnvelope,
        request: WorkRequest,
        adapter: str | None = None,
    ) -> WorkItem:
        return cls(
            message=message,
            request_id=request.request_id,
            reply_to=envelope.reply_to,
            deadline_ms=request.deadline_ms,
            sent_ms=envelope.sent_ms,
            cost=max(1, request.cost),
            endpoint=_endpoint(request.endpoint),
            body=request.body,
            stream=request.stream,
            body_key=request.body_key,
            idempotency_key=request.idempotency_key,
            deliveries=message.deliveries,
            adapter=adapter,
        )

    def expired(self, now_ms: int) -> bool:
        return bool(self.deadline_ms) and self.deadline_ms <= now_ms


# A dict lookup, not `Endpoint(value)`: the enum's call costs ~0.7 us an item, its miss a raise.
_ENDPOINTS: dict[str, Endpoint] = {endpoint.value: endpoint for endpoint in Endpoint}


def _endpoint(value: str) -> Endpoint | None:
    return _ENDPOINTS.get(value or Endpoint.EMBEDDINGS.value)


def ack_fields(reply_subject: str | None) -> tuple[int, int]:
    """(how often JetStream has delivered a pulled message, its sequence in the stream), read
    from its ack subject; (1, 0) if unknown.

    `$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>`, or with domain
    and account hash before the stream (12 tokens or more). Parsing it here costs one split
    for both (a named tuple cost more than the split); nats.py's `Msg.metadata` built objects
    for every field.
    """
    if not reply_subject:
        return 1, 0
    tokens = reply_subject.split(".")
    first = 4 if len(tokens) == 9 else 6
    try:
        return int(tokens[first]), int(tokens[first + 1])
    except (IndexError, ValueError):
        return 1, 0


@dataclass(slots=True)
class Reply:
    """What goes back to the gateway for one work item: an HTTP status and a ready body."""

    status: int
    body: bytes

    @classmethod
    def from_error(cls, error: ApiError) -> Reply:
        return cls(error.status, error.body())


@dataclass(slots=True)
class BatchOutcome:
    """A batch handler's answer: one reply per body, in order, and what the runtime did."""

    replies: list[Reply]
    runtime_seconds: float
    texts: int  # texts (or pairs) the runtime ran


# From this delivery on, each request of a redelivered message runs alone (with an attempt
# record): by then a worker stopped twice while holding it, so one of its requests may crash
# the runtime, and alone it takes nobody else down.
RUN_ALONE_FROM_DELIVERY = 3


def take_batch(pending: deque[WorkItem], max_items: int, max_tokens: int) -> list[WorkItem]:
    """Take items from the front of `pending` while they fit the item and token budgets.

    The first item is always taken, even when it alone exceeds the token budget, so that a
    large request is run on its own instead of waiting forever. Order is kept (FIFO).

    Redelivered items (their worker died or hung holding them) never share a batch with
    others, so a request that crashes the runtime takes as few others down with it as can
    be: on its second delivery a message's requests run as a batch of their own, from the
    third on each runs alone, and a known culprit only once no other item waits.
    """
    if pending and pending[0].deliveries > 1:
        return _take_redelivered(pending, max_items, max_tokens)
    batch: list[WorkItem] = []
    tokens = 0
    while pending and len(batch) < max_items:
        if pending[0].deliveries > 1:
            break  # it waits for a batch of its own
        cost = pending[0].cost
        if batch and tokens + cost > max_tokens:
            break
        batch.append(pending.popleft())
        tokens += cost
    return batch


def _take_redelivered(pending: deque[WorkItem], max_items: int, max_tokens: int) -> list[WorkItem]:
    """The batch for the redelivered item at the front of `pending` (see `take_batch`)."""
    if pending[0].culprit and not all(item.culprit for item in pending):
        # Move culprits behind everyone else, keeping everyone else's order: whatever is
        # held when a culprit crashes the worker again is delivered once more.
        kept = [item for item in pending if not item.culprit]
        culprits = [item for item in pending if item.culprit]
        pending.clear()
        pending.extend(kept + culprits)
        if pending[0].deliveries <= 1:
            return take_batch(pending, max_items, max_tokens)
    head = pending.popleft()
    batch = [head]
    if head.deliveries >= RUN_ALONE_FROM_DELIVERY or head.culprit:
        return batch
    # Second delivery: its own message's requests together, nobody else's.
    while pending and len(batch) < max_items and pending[0].message is head.message:
        batch.append(pending.popleft())
    return batch
