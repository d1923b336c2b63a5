"""A worker running a long batch leaves the queue's items to other workers until the batch
nears its end (schedulers/batch.py, `pull_after_s`), then pulls for the next batch at once.

Real NATS (the answers go out through it) and the SIMULATED accelerator (runtime `sim`), a
batch scheduler driven directly; the latency this buys at 90% load with 16 and 32 workers is
measured in bench.push_vs_pull (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import NamedTuple

from conftest import scheduler_context
from nats.aio.subscription import Subscription

from shoal.broker.connection import connect
from shoal.config import WorkerSettings
from shoal.protocol import Endpoint, Task, decode_results, now_ms
from shoal.runtimes.sim import SimEmbeddingRuntime
from shoal.worker.items import WorkItem
from shoal.worker.schedulers.base import SchedulerContext
from shoal.worker.schedulers.batch import PULL_LEAD_S, BatchScheduler
from shoal.worker.tasks.embed import EmbeddingsHandler


class _Harness(NamedTuple):
    """A batch scheduler running on the SIMULATED runtime, answering on `answers`."""

    scheduler: BatchScheduler
    ctx: SchedulerContext
    answers: Subscription

    def item(self, request_id: str) -> WorkItem:
        """A request for the harness's model, due in a minute."""
        sent = now_ms()
        body = b'{"model": "sim", "input": "one"}'
        return WorkItem(
            None,
            request_id,
            self.answers.subject,
            sent + 60_000,
            sent,
            1,
            Endpoint.EMBEDDINGS,
            body,
        )


@contextlib.asynccontextmanager
async def _running_scheduler(
    url: str, batch_s: float, budget: int, handler_class: type[EmbeddingsHandler], **parts
) -> AsyncIterator[_Harness]:
    """A scheduler run on a device of `batch_s` a batch, stopped and cleaned up after."""
    nc = await connect(url, name="scheduler-test")
    answers = await nc.subscribe(nc.new_inbox())
    settings = WorkerSettings(nats_url=url, max_batch_items=budget, adaptive_batch_wait=False)
    ctx = scheduler_context(nc, settings, "sim", **parts)
    runtime = SimEmbeddingRuntime("sim", {"batch_ms": batch_s * 1000, "token_us": 0})
    scheduler = BatchScheduler(ctx, handler_class(runtime, "sim", {}), Task.EMBEDDINGS)
    running = asyncio.create_task(scheduler.run())
    try:
        yield _Harness(scheduler, ctx, answers)
    finally:
        scheduler.stop_accepting()
        await asyncio.wait_for(running, 5)
        ctx.executor.shutdown()
        await nc.close()


async def _pull_after_during_a_batch(url: str, batch_s: float) -> tuple[float, float, float]:
    """One item through a scheduler on a device of `batch_s` a batch whatever its size (its
    profile says so): `pull_after_s` while the batch runs, how long the batch took, and
    `pull_after_s` once it ended."""
    profile = {n: batch_s for n in (1, 8, 32)}
    async with _running_scheduler(
        url, batch_s, 32, EmbeddingsHandler, profiled_latency_s=profile
    ) as harness:
        scheduler, ctx, answers = harness
        item = harness.item("late-1")
        began = time.monotonic()
        scheduler.accept(item)
        await asyncio.sleep(min(0.05, batch_s / 4))  # the batch runs
        assert scheduler.held() == [item]
        during = scheduler.pull_after_s()
        ctx.room_changed.clear()
        await answers.next_msg(timeout=batch_s + 2)  # answered
        took = time.monotonic() - began
        await asyncio.sleep(0.05)  # its acks, then the end of the batch
        # The batch's end wakes a fill loop waiting to pull.
        assert ctx.room_changed.is_set()
        return during, took, scheduler.pull_after_s()


def test_a_long_batch_leaves_the_queue_to_others_until_near_its_end(nats_server):
    during, took, after = asyncio.run(_pull_after_during_a_batch(nats_server.url, 0.4))
    # 50 ms into a 400 ms batch: pull 10 ms before its end, ~340 ms from now.
    assert 0.25 < during <= 0.4 - PULL_LEAD_S - 0.05 + 0.01
    assert took >= 0.4 and after == 0.0


def test_a_batch_shorter_than_the_lead_pulls_at_once(nats_server):
    during, _, after = asyncio.run(_pull_after_during_a_batch(nats_server.url, 0.008))
    assert during == 0.0 and after == 0.0


class _FailsOnce(EmbeddingsHandler):
    """The simulated runtime's handler, but its first batch raises out of `handle` (a bug or
    a runtime crash that the per-item isolation does not catch)."""

    failed = False

    def handle(self, bodies, adapters=None, endpoints=None):
        if not self.failed:
            self.failed = True
            raise RuntimeError("the runtime crashed")
        return super().handle(bodies, adapters, endpoints)


async def _a_failed_batch(url: str) -> tuple[list[WorkItem], bytes]:
    """What the scheduler still holds after a batch whose handler raised, and the answer to
    the next item."""
    async with _running_scheduler(url, 0.001, 8, _FailsOnce) as harness:
        scheduler = harness.scheduler
        scheduler.accept(harness.item("fails"))
        for _ in range(100):  # the batch fails at once; its end is logged
            await asyncio.sleep(0.01)
            if scheduler.held() == []:
                break
        held_after_failure = scheduler.held()
        scheduler.accept(harness.item("runs"))
        answer = await harness.answers.next_msg(timeout=5)
        return held_after_failure, answer.data


def test_a_failed_batch_is_let_go_so_jetstream_redelivers_it(nats_server):
    # Held items get in-progress acks (the model server's keep-alive): a failed batch still
    # held would never be redelivered, and its clients would wait out their deadlines.
    held, next_answer = asyncio.run(_a_failed_batch(nats_server.url))
    assert held == []
    (result,) = decode_results(next_answer).results  # the scheduler goes on with the next
    assert result.request_id == "runs" and result.status == 200
