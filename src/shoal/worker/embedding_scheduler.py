"""Batches for embeddings: take what was pulled within the item and token budgets, run it.

The fill loop keeps one pull request outstanding for as many items as the next batch has room
for, so while the runtime executes one batch the next is already arriving and the runtime
never waits for the network.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from shoal.protocol import Task, now_ms
from shoal.worker.batching import WorkItem, take_batch
from shoal.worker.embeddings import EmbeddingsHandler
from shoal.worker.scheduler import SchedulerContext, reject_if_unservable

log = logging.getLogger(__name__)


class EmbeddingScheduler:
    """Runs pulled embeddings requests batch by batch (implements `Scheduler`)."""

    def __init__(self, ctx: SchedulerContext, handler: EmbeddingsHandler) -> None:
        self._ctx = ctx
        self._handler = handler
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
        live = [
            item for item in batch if not await reject_if_unservable(ctx, item, Task.EMBEDDINGS)
        ]
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
