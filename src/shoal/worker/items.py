"""Work items as the worker sees them, what goes back for each, and forming a batch.

No NATS here: a work item holds its message (anything with `headers`, `data`, `metadata`,
`ack` and `in_progress`, a nats.py `Msg` in practice) but the tasks and schedulers that
import this module never touch the connection.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shoal.api.errors import ApiError
from shoal.protocol import Endpoint, Header

if TYPE_CHECKING:
    from nats.aio.msg import Msg


@dataclass(slots=True)
class WorkItem:
    """One queued request: its routing metadata from the headers and its opaque body."""

    msg: Msg
    request_id: str
    reply_to: str
    deadline_ms: int
    sent_ms: int
    cost: int
    endpoint: Endpoint | None  # None: a header this worker does not know
    stream: bool = False
    deliveries: int = 1
    adapter: str | None = None  # the LoRA deployment it was sent to, served by its base

    @classmethod
    def from_msg(cls, msg: Msg) -> WorkItem:
        headers = msg.headers or {}
        return cls(
            msg=msg,
            request_id=headers.get(Header.REQUEST_ID, ""),
            reply_to=headers.get(Header.REPLY_TO, ""),
            deadline_ms=int(headers.get(Header.DEADLINE) or 0),
            sent_ms=int(headers.get(Header.SENT) or 0),
            cost=max(1, int(headers.get(Header.COST) or 1)),
            endpoint=_endpoint(headers.get(Header.ENDPOINT)),
            stream=headers.get(Header.STREAM) == "1",
            deliveries=msg.metadata.num_delivered or 1,
        )

    def expired(self, now_ms: int) -> bool:
        return bool(self.deadline_ms) and self.deadline_ms <= now_ms

    @property
    def body(self) -> bytes:
        return self.msg.data


def _endpoint(value: str | None) -> Endpoint | None:
    try:
        return Endpoint(value or Endpoint.EMBEDDINGS)
    except ValueError:
        return None


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
