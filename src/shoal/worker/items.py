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
    deliveries: int = 1
    adapter: str | None = None  # the LoRA deployment it was sent to, served by its base

    @classmethod
    def from_request(
        cls, message: WorkMessage, envelope: WorkEnvelope, request: WorkRequest
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
            deliveries=message.deliveries,
        )

    def expired(self, now_ms: int) -> bool:
        return bool(self.deadline_ms) and self.deadline_ms <= now_ms


def _endpoint(value: str) -> Endpoint | None:
    try:
        return Endpoint(value or Endpoint.EMBEDDINGS)
    except ValueError:
        return None


def deliveries_of(reply_subject: str | None) -> int:
    """How often JetStream has delivered a message, read from its ack subject.

    `$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>`, or with domain
    and account hash before the stream (12 tokens or more). Parsing it here costs a split;
    nats.py's `Msg.metadata` built objects for every field.
    """
    if not reply_subject:
        return 1
    tokens = reply_subject.split(".")
    index = 4 if len(tokens) == 9 else 6
    try:
        return int(tokens[index])
    except (IndexError, ValueError):
        return 1


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


def take_batch(pending: deque[WorkItem], max_items: int, max_tokens: int) -> list[WorkItem]:
    """Take items from the front of `pending` while they fit the item and token budgets.

    The first item is always taken, even when it alone exceeds the token budget, so that a
    large request is run on its own instead of waiting forever. Order is kept (FIFO).
    """
    batch: list[WorkItem] = []
    tokens = 0
    while pending and len(batch) < max_items:
        cost = pending[0].cost
        if batch and tokens + cost > max_tokens:
            break
        batch.append(pending.popleft())
        tokens += cost
    return batch
