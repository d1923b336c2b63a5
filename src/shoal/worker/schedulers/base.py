"""What every scheduler shares: the sidecar's parts it uses, and the skeleton both build on.

A scheduler turns pulled work items into runtime calls and answers them. `BatchScheduler`
(embeddings and rerank, worker/schedulers/batch.py) runs whole batches; `ContinuousScheduler`
(generation, worker/schedulers/continuous.py) keeps decode slots full. Both inherit accepting
pulled items, stopping, answering (reply, then ack), rejecting what cannot run here and the
per-batch accounting from `SchedulerBase`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from shoal.api.errors import ApiError
from shoal.config import WorkerSettings
from shoal.observability.metrics import BusyMeter, WorkerMetrics
from shoal.protocol import Task, now_ms
from shoal.worker.items import Reply, WorkItem, WorkMessage
from shoal.worker.outbox import Outbox
from shoal.worker.profiling import ProfileAudit

_CLIENT_CLOSED = 499  # nginx's "client closed request": metrics only
CANCELLED_MEMORY_S = 300.0  # how long a cancel is remembered for a request not yet met
CANCELS_KEPT = 10_000  # past this many, cancels older than CANCELLED_MEMORY_S are forgotten


@dataclass(slots=True)
class WorkerCounters:
    """Totals the worker reports in its status."""

    items_done: int = 0
    redelivered: int = 0
    batches: int = 0  # embedding batches, or decode steps
    largest_batch: int = 0  # the most items (or sequences) seen in one batch (or step)
    running_sequences: int = 0
    tokens_generated: int = 0
    cancelled: int = 0

    def finished(self, item: WorkItem) -> None:
        self.items_done += 1
        if item.deliveries > 1:
            self.redelivered += 1


@dataclass
class SchedulerContext:
    """The sidecar's parts a scheduler uses. `room_changed` wakes the fill loop."""

    settings: WorkerSettings
    outbox: Outbox
    executor: ThreadPoolExecutor
    metrics: WorkerMetrics
    busy: BusyMeter
    counters: WorkerCounters = field(default_factory=WorkerCounters)
    room_changed: asyncio.Event = field(default_factory=asyncio.Event)
    # Seconds per batch size from the model's profile (seeds the adaptive batch wait).
    profiled_latency_s: dict[int, float] = field(default_factory=dict)
    # Checks the profile against batches in service (None: the budget was set by hand), and
    # what to call, once, when service contradicts it (the model server profiles again).
    audit: ProfileAudit | None = None
    on_profile_contradicted: Callable[[], None] | None = None


class Scheduler(Protocol):
    """Turns pulled work items into runtime calls and answers them."""

    def accept(self, item: WorkItem) -> None:
        """A message was pulled for this worker."""
        ...

    def room(self) -> int:
        """How many more items to pull now: never more than can start soon."""
        ...

    def held(self) -> list[WorkItem]:
        """Every item pulled and not yet acked (for in-progress acks)."""
        ...

    def pull_after_s(self) -> float:
        """Seconds to leave the queue's items to other workers before pulling again (0: pull
        now); `room_changed` cuts the wait short."""
        ...

    def cancel(self, request_id: str) -> None:
        """The client went away: stop work on that request if held, or skip it later."""
        ...

    def arrivals_expected(self, change: int) -> None:
        """`change` (+1, -1) sources of items still to come: an open pull request, or a
        message being read before its items are accepted (a suspect's attempt record, a
        stored body). A known culprit waits for them to end (worker/poison.py)."""
        ...

    def stop_accepting(self) -> None:
        """No more items will arrive: `run` returns once everything held is answered."""
        ...

    def release_unstarted(self) -> list[WorkMessage]:
        """Remove the messages none of whose requests has started, for a draining worker to
        hand back (nak): another worker runs them at once, not after the ack wait."""
        ...

    async def run(self) -> None: ...


class SchedulerBase:
    """The skeleton of a scheduler: pending items, accepting, answering, accounting.

    `task` is the deployment's; it decides which endpoints run here (`Endpoint.served_by`).
    """

    def __init__(self, ctx: SchedulerContext, task: Task) -> None:
        self._ctx = ctx
        self._task = task
        self._pending: deque[WorkItem] = deque()
        self._arrived = asyncio.Event()
        self._accepting = True
        self._cancelled: dict[str, float] = {}  # request id -> when its cancel arrived
        self._arrivals_expected = 0
        # Known culprits pending or running (worker/poison.py): while there is one, the
        # worker pulls nothing, so a crash on it takes down only what it already holds.
        self._culprits_held = 0

    def accept(self, item: WorkItem) -> None:
        self._pending.append(item)
        if item.culprit:
            self._culprits_held += 1
        self._arrived.set()

    def arrivals_expected(self, change: int) -> None:
        self._arrivals_expected += change
        if self._culprits_held and not self._arrivals_expected:
            self._arrived.set()  # a culprit waits for this (schedulers/batch.py)

    def pull_after_s(self) -> float:
        return 0.0

    def stop_accepting(self) -> None:
        self._accepting = False
        self._arrived.set()

    def release_unstarted(self) -> list[WorkMessage]:
        # A message with a request running or answered stays: handing it back would run
        # those again; its remaining requests are run here before the worker exits.
        waiting: dict[int, int] = {}
        for item in self._pending:
            if item.message is not None:
                waiting[id(item.message)] = waiting.get(id(item.message), 0) + 1
        released = {
            id(item.message): item.message
            for item in self._pending
            if item.message is not None and waiting[id(item.message)] == item.message.unanswered
        }
        if released:  # in place: the deque is shared with whoever reads it
            kept = [i for i in self._pending if i.message is None or id(i.message) not in released]
            # A culprit may be running (not pending): count off only the released ones.
            self._culprits_held -= sum(i.culprit for i in self._pending) - sum(
                i.culprit for i in kept
            )
            self._pending.clear()
            self._pending.extend(kept)
        return list(released.values())

    async def _wait_for_work(self) -> bool:
        """Wait until something is pending; False once nothing is and nothing more will be."""
        while not self._pending:
            if not self._accepting:
                return False
            self._arrived.clear()
            await self._arrived.wait()
        return True

    async def _answer(self, item: WorkItem, reply: Reply) -> None:
        """The item's one answer, then its ack (never the other way round: invariant 4)."""
        await self._ctx.outbox.reply(item, reply)
        await self._ack(item)

    async def _ack(self, item: WorkItem) -> None:
        await self._ack_all((item,))

    async def _ack_all(self, items: Sequence[WorkItem]) -> None:
        """Ack and count items done: a batch's in one coroutine (not two an item)."""
        await self._ctx.outbox.ack_all(items)
        finished = self._ctx.counters.finished
        for item in items:
            finished(item)

    def _remember_cancel(self, request_id: str) -> None:
        """A cancel for a request not running here: pending, not yet pulled, or held by
        another worker (every worker of the model hears it). Remembered, so that whichever
        loop of this worker meets the request drops it before it runs, however late it
        arrives: no race between a cancel and the request's delivery."""
        now = time.monotonic()
        self._cancelled[request_id] = now
        if len(self._cancelled) > CANCELS_KEPT:
            recent = {r: t for r, t in self._cancelled.items() if now - t < CANCELLED_MEMORY_S}
            if len(recent) > CANCELS_KEPT:  # a flood: keep the newest half
                recent = dict(list(recent.items())[len(recent) // 2 :])
            self._cancelled = recent

    def _take_cancel(self, item: WorkItem) -> bool:
        """Whether the item's client went away (and forget the cancel)."""
        return bool(self._cancelled) and self._cancelled.pop(item.request_id, None) is not None

    async def _drop_cancelled(self, item: WorkItem) -> None:
        """Its client went away: no answer is read, so the item is only acked."""
        self._ctx.counters.cancelled += 1
        self._ctx.metrics.count_item(_CLIENT_CLOSED)
        await self._ack(item)

    async def _reject_if_unservable(self, item: WorkItem) -> bool:
        """Answer and ack an item that cannot run here (expired, wrong endpoint): True if so."""
        error = self._unservable(item, now_ms())
        if error is None:
            return False
        await self._answer(item, Reply.from_error(error))
        return True

    def _unservable(self, item: WorkItem, now: int) -> ApiError | None:
        """Why the item cannot run here at `now` (epoch ms): a wrong endpoint, or expired."""
        if item.endpoint is None or not item.endpoint.served_by(self._task):
            endpoint = item.endpoint.value if item.endpoint else "unknown"
            return ApiError(
                400, f"This model serves {self._task.value}, not {endpoint}", param="model"
            )
        if item.expired(now):
            return ApiError(504, "The request's deadline passed before it was run", code="timeout")
        return None

    def _observe_queue_wait(self, item: WorkItem, now: int | None = None) -> None:
        """Publish to start, for an item that starts at `now` (epoch ms; the clock if None)."""
        waited_ms = (now_ms() if now is None else now) - item.sent_ms
        self._ctx.metrics.queue_wait.observe(max(0, waited_ms) / 1000)

    def _account_batch(self, busy_s: float, size: int) -> None:
        """One batch (or decode step) of `size` items took `busy_s` of runtime."""
        ctx = self._ctx
        ctx.metrics.busy_seconds.inc(busy_s)
        ctx.metrics.batch_seconds.observe(busy_s)
        ctx.metrics.batch_items.observe(size)
        ctx.counters.batches += 1
        ctx.counters.largest_batch = max(ctx.counters.largest_batch, size)
