"""Batches for embeddings and rerank: take what was pulled within the item and token budgets,
run it as one handler call.

The fill loop keeps one pull request outstanding for as many items as the next batch has room
for, so while the runtime executes one batch the next is already arriving and the runtime
never waits for the network. On a slow device it pulls late in the batch, not at its start
(`pull_after_s`): items that arrive while a batch runs stay in the shared queue, where a
worker that frees up first takes them, until `PULL_LEAD_S` before the batch is expected to
end. Pulled at the batch's start, they waited out the rest of it behind this worker while
another could have run them (simulated 100 ms device at 90% load, 16 and 32 workers: median
latency 240 / 255 ms pulling at once, 174 / 185 ms pulling late; docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from shoal.protocol import ModelSpec, Task, now_ms
from shoal.worker.batch_wait import CostCurve, CostFit, LoadMeter, plan_wait
from shoal.worker.items import Reply, WorkItem, take_batch
from shoal.worker.schedulers.base import SchedulerBase, SchedulerContext
from shoal.worker.tasks.cross_encode import RerankHandler
from shoal.worker.tasks.embed import EmbeddingsHandler
from shoal.worker.tasks.isolate import BatchTask

log = logging.getLogger(__name__)

# How long before a running batch's expected end the next batch is pulled: far more than a
# pull takes on a LAN (~1 ms), so the device does not wait for the network even when the
# curve overestimates the batch by a few ms. A batch shorter than this is pulled for at once.
PULL_LEAD_S = 0.010
# How long a known culprit waits for items still to come (an open pull request, which the
# server ends within `poll_s`; an attempt record read, bounded by poison.KV_TIMEOUT_S):
# past it, it runs.
CULPRIT_WAIT_S = 3.0


def batch_handler(spec: ModelSpec, runtime) -> BatchTask:
    """The handler for a deployment that is not generative: embeddings or rerank."""
    if spec.task is Task.RERANK:
        return RerankHandler(runtime, spec.name)
    return EmbeddingsHandler(runtime, spec.name, spec.options)


class BatchScheduler(SchedulerBase):
    """Runs pulled embeddings and rerank requests batch by batch (implements `Scheduler`)."""

    def __init__(self, ctx: SchedulerContext, handler: BatchTask, task: Task) -> None:
        super().__init__(ctx, task)
        self._handler = handler
        self._running: list[WorkItem] = []
        self._curve = CostCurve(ctx.profiled_latency_s)
        self._curve_profile = ctx.profiled_latency_s
        self._load = LoadMeter()
        self._running_until = 0.0  # the running batch's expected end (monotonic)

    def room(self) -> int:
        return self._ctx.settings.max_batch_items - len(self._pending)

    def held(self) -> list[WorkItem]:
        return [*self._running, *self._pending]

    def pull_after_s(self) -> float:
        if self._culprits_held:
            # Quarantine: a known culprit runs with nothing else held (`_hold_culprit`).
            return self._ctx.settings.poll_s
        if not self._running:
            return 0.0
        return max(0.0, self._running_until - PULL_LEAD_S - time.monotonic())

    def cancel(self, request_id: str) -> None:
        # A running batch is short and runs to its end; a cancelled item not yet run is
        # dropped before it runs (`_run_batch`), whenever it is pulled.
        self._remember_cancel(request_id)

    async def run(self) -> None:
        while await self._wait_for_work():
            settings = self._ctx.settings  # a new profile may have changed the budget
            if self._ctx.profiled_latency_s is not self._curve_profile:
                self._curve_profile = self._ctx.profiled_latency_s
                self._curve.use_profile(self._curve_profile)
            fit = self._curve.fit()  # once a batch: a least-squares fit over ~70 points
            if settings.adaptive_batch_wait:
                await self._wait_for_fuller_batch(fit)
            if self._culprits_held:
                await self._hold_culprit()
            batch = take_batch(self._pending, settings.max_batch_items, settings.max_batch_tokens)
            self._ctx.room_changed.set()
            try:
                await self._run_batch(batch, fit)
            except Exception:
                # Unacked items are redelivered after ack_wait; nothing is lost.
                log.exception("batch of %d failed", len(batch))
            finally:
                if self._culprits_held and batch and batch[0].culprit:
                    self._culprits_held -= 1  # it ran and returned: pull again
                    self._ctx.room_changed.set()

    async def _hold_culprit(self) -> None:
        """A known culprit runs alone and last: after every other item this worker holds or
        is still receiving, and with nothing pulled while it runs (`pull_after_s`).

        Every message a worker holds when it dies is delivered once more, and at
        `max_deliver` dead-lettered. An innocent message held beside the poison's through
        its crashes reached its last delivery; held once more while the known culprit ran,
        it was dead-lettered unanswered ("not answered on any of 4 deliveries": CI failures
        of tests/test_dlq.py). With the quarantine an innocent message is never held at the
        culprit's last crash, so it gets a delivery of its own.
        `take_batch` puts the items held first; this waits out those still coming: the open
        pull request, and messages being read (a suspect's attempt record, a stored body).
        """
        deadline = 0.0  # read the clock only when a culprit would run next
        while self._arrivals_expected > 0 and all(item.culprit for item in self._pending):
            deadline = deadline or time.monotonic() + CULPRIT_WAIT_S
            if not await self._wait_for_arrival(deadline):
                return

    async def _wait_for_arrival(self, deadline: float) -> bool:
        """Until an item (or a suspect's lookup) arrives or `deadline` (monotonic) passes;
        False, without waiting, once it has."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        self._arrived.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._arrived.wait(), remaining)
        return True

    async def _wait_for_fuller_batch(self, fit: CostFit | None) -> None:
        """Wait while waiting pays (worker/batch_wait.py): never past the plan's bound."""
        settings = self._ctx.settings
        budget = settings.max_batch_items
        began = time.monotonic()
        held = len(self._pending)
        plan = plan_wait(
            fit,
            held,
            budget,
            settings.latency_targets.batch_s,
            self._load.load(fit, budget, began),
        )
        if plan.max_wait_s <= 0:
            return
        deadline = began + plan.max_wait_s
        while self._accepting and len(self._pending) < plan.target_items:
            if sum(item.cost for item in self._pending) >= settings.max_batch_tokens:
                break
            if not await self._wait_for_arrival(deadline):
                break
        waited_s = time.monotonic() - began
        self._ctx.metrics.batch_wait.observe(waited_s)
        # `SHOAL_LOG_LEVEL=debug`: what each wait was planned on (how the closed-loop stall
        # on a bent curve was found; docs/benchmarks.md, "A cost curve that holds its shape").
        log.debug(
            "waited %.1f ms of %.1f for %d items, held %d -> %d; %s",
            waited_s * 1e3,
            plan.max_wait_s * 1e3,
            plan.target_items,
            held,
            len(self._pending),
            fit,
        )

    async def _run_batch(self, batch: list[WorkItem], fit: CostFit | None) -> None:
        ctx = self._ctx
        now = now_ms()  # one clock read a batch, for every item's deadline and queue wait
        live = []
        for item in batch:
            if self._take_cancel(item):
                await self._drop_cancelled(item)
            elif (error := self._unservable(item, now)) is not None:
                await self._answer(item, Reply.from_error(error))
            else:
                self._observe_queue_wait(item, now)
                live.append(item)
        if not live:
            return
        self._running = live
        try:
            await self._run_live(live, fit)
        finally:
            # After a failure too: what is held gets in-progress acks (the model server's
            # keep-alive), so a failed batch left here would never be redelivered.
            self._running = []
            ctx.room_changed.set()  # a fill loop waiting for the batch's end pulls now

    async def _run_live(self, live: list[WorkItem], fit: CostFit | None) -> None:
        """Run `live` in one handler call, then answer and ack every item."""
        ctx = self._ctx
        self._running_until = time.monotonic() + (fit.seconds(len(live)) if fit else 0.0)
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
        self._account_batch(busy_s, len(live))
        self._curve.observe(len(live), busy_s)
        self._load.observe(len(live), time.monotonic())
        contradicted = ctx.audit is not None and ctx.audit.observe(len(live), busy_s)
        if contradicted and ctx.on_profile_contradicted is not None:
            ctx.on_profile_contradicted()
        # Every result first, then every ack: a worker that dies between the two leaves its
        # items to be redelivered, and the gateway drops the duplicate results.
        await ctx.outbox.replies(zip(live, outcome.replies, strict=True))
        await self._ack_all(live)
