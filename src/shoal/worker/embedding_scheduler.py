"""Batches for embeddings and rerank: take what was pulled within the item and token budgets,
run it as one handler call.

The fill loop keeps one pull request outstanding for as many items as the next batch has room
for, so while the runtime executes one batch the next is already arriving and the runtime
never waits for the network.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Protocol

from shoal.protocol import Endpoint, ModelSpec, Task, now_ms
from shoal.worker.batching import WorkItem, take_batch
from shoal.worker.cross_encoder import RerankHandler
from shoal.worker.embeddings import BatchOutcome, EmbeddingsHandler
from shoal.worker.scheduler import SchedulerContext, reject_if_unservable

log = logging.getLogger(__name__)


class BatchHandler(Protocol):
    """Answers a whole batch of bodies in the executor thread (one runtime call)."""

    def handle(
        self,
        bodies: list[bytes],
        adapters: list[str | None] | None = None,
        endpoints: list[Endpoint | None] | None = None,
    ) -> BatchOutcome: ...


def make_scheduler(ctx: SchedulerContext, spec: ModelSpec, runtime) -> EmbeddingScheduler:
    """The scheduler for a deployment that is not generative: embeddings or rerank."""
    if spec.task is Task.RERANK:
        return EmbeddingScheduler(ctx, RerankHandler(runtime, spec.name), Task.RERANK)
    return EmbeddingScheduler(ctx, EmbeddingsHandler(runtime, spec.name), spec.task)


class EmbeddingScheduler:
    """Runs pulled embeddings and rerank requests batch by batch (implements `Scheduler`).

    `task` is the deployment's: it decides which endpoints run here (`make_scheduler` picks
    the handler for it).
    """

    def __init__(self, ctx: SchedulerContext, handler: BatchHandler, task: Task) -> None:
        self._ctx = ctx
        self._handler = handler
        self._task = task
        self._pending: deque[WorkItem] = deque()
        self._running: list[WorkItem] = []
        self._arrived = asyncio.Event()
        self._accepting = True

    def accept(self, item: WorkItem) -> None:
        self._pending.append(item)
        self._arrived.set()

    def room(self) -> int:
        return self._ctx.settings.max_batch_items - len(self._pending)

    def held(self) -> list[WorkItem]:
        return [*self._running, *self._pending]

    def cancel(self, request_id: str) -> None:
        # An embedding batch is short; cancelling one item in it would save nothing.
        pass

    def stop_accepting(self) -> None:
        self._accepting = False
        self._arrived.set()

    async def run(self) -> None:
        settings = self._ctx.settings
        while True:
            if not self._pending:
                if not self._accepting:
                    return
                self._arrived.clear()
                await self._arrived.wait()
                continue
            batch = take_batch(self._pending, settings.max_batch_items, settings.max_batch_tokens)
            self._ctx.room_changed.set()
            try:
                await self._run_batch(batch)
            except Exception:
                # Unacked items are redelivered after ack_wait; nothing is lost.
                log.exception("batch of %d failed", len(batch))

    async def _run_batch(self, batch: list[WorkItem]) -> None:
        ctx = self._ctx
        live = [item for item in batch if not await reject_if_unservable(ctx, item, self._task)]
        if not live:
            return
        now = now_ms()
        for item in live:
            ctx.metrics.queue_wait.observe(max(0, now - item.sent_ms) / 1000)
        self._running = live
        ctx.busy.start()
        try:
            outcome = await asyncio.get_running_loop().run_in_executor(
                ctx.executor,
                self._handler.handle,
                [item.body for item in live],
                [item.adapter for item in live],
                [item.endpoint for item in live],
            )
        finally:
            busy_s = ctx.busy.stop()
        ctx.metrics.busy_seconds.inc(busy_s)
        ctx.metrics.batch_seconds.observe(busy_s)
        ctx.metrics.batch_items.observe(len(live))
        ctx.counters.batches += 1
        ctx.counters.max_batch_items = max(ctx.counters.max_batch_items, len(live))
        for item, reply in zip(live, outcome.replies, strict=True):
            await ctx.outbox.reply(item, reply)
        for item in live:
            await ctx.outbox.ack(item)
            ctx.counters.finished(item)
        self._running = []
