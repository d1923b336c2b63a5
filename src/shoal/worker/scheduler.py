"""What the sidecar shares with its task scheduler (batches for embeddings, continuous
batching for generation), and the interface both schedulers implement."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from shoal.config import WorkerSettings
from shoal.errors import ApiError
from shoal.observability.metrics import BusyMeter, WorkerMetrics
from shoal.protocol import Task, now_ms
from shoal.worker.batching import WorkItem
from shoal.worker.outbox import Outbox, Reply


@dataclass(slots=True)
class WorkerCounters:
    """Totals the worker reports in its status."""

    items_done: int = 0
    redelivered: int = 0
    batches: int = 0  # embedding batches, or decode steps
    max_batch_items: int = 0
    running_sequences: int = 0
    max_running_sequences: int = 0
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

    def cancel(self, request_id: str) -> None:
        """The client went away: stop work on that request if held, or skip it later."""
        ...

    def stop_accepting(self) -> None:
        """No more items will arrive: `run` returns once everything held is answered."""
        ...

    async def run(self) -> None: ...


async def reject_if_unservable(ctx: SchedulerContext, item: WorkItem, task: Task) -> bool:
    """Answer and ack an item that cannot run here (expired, wrong endpoint): True if so.

    `task` is the deployment's task; it decides which endpoints run here (`Endpoint.served_by`).
    """
    error = None
    if item.endpoint is None or not item.endpoint.served_by(task):
        endpoint = item.endpoint.value if item.endpoint else "unknown"
        error = ApiError(400, f"This model serves {task.value}, not {endpoint}", param="model")
    elif item.expired(now_ms()):
        error = ApiError(504, "The request's deadline passed before it was run", code="timeout")
    if error is None:
        return False
    await ctx.outbox.reply(item, Reply.from_error(error))
    await ctx.outbox.ack(item)
    ctx.counters.finished(item)
    return True
