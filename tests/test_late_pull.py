"""A worker running a long batch leaves the queue's items to other workers until the batch
nears its end (schedulers/batch.py, `pull_after_s`), then pulls for the next batch at once;
on such a device its pull requests end soon (`pull_expires_s`), so that one still open when a
batch starts stops taking items early in that batch.

Real NATS (the answers go out through it) and the SIMULATED accelerator (runtime `sim`), a
batch scheduler driven directly; the latency this buys at 90% load with 16 and 32 workers is
measured in bench.push_vs_pull (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from shoal.broker.connection import connect
from shoal.broker.jetstream import ensure_model_consumer, ensure_work_stream
from shoal.broker.puller import Puller
from shoal.config import QueueSettings, WorkerSettings
from shoal.observability.metrics import BusyMeter, WorkerMetrics
from shoal.protocol import WORK_STREAM, Endpoint, Task, now_ms
from shoal.runtimes.sim import SimEmbeddingRuntime
from shoal.worker.items import WorkItem
from shoal.worker.outbox import Outbox
from shoal.worker.schedulers.base import SchedulerContext
from shoal.worker.schedulers.batch import PULL_LEAD_S, SHORT_PULL_EXPIRES_S, BatchScheduler
from shoal.worker.tasks.embed import EmbeddingsHandler


def _scheduler(nc, url: str, batch_s: float) -> tuple[BatchScheduler, SchedulerContext]:
    """A batch scheduler on a SIMULATED device of `batch_s` a batch whatever its size (its
    profile says so)."""
    metrics = WorkerMetrics("sim-late", "sim", simulated=True)
    ctx = SchedulerContext(
        settings=WorkerSettings(nats_url=url, max_batch_items=32, adaptive_batch_wait=False),
        outbox=Outbox(nc, metrics),
        executor=ThreadPoolExecutor(1),
        metrics=metrics,
        busy=BusyMeter(),
        profiled_latency_s={n: batch_s for n in (1, 8, 32)},
    )
    runtime = SimEmbeddingRuntime("sim-late", {"batch_ms": batch_s * 1000, "token_us": 0})
    handler = EmbeddingsHandler(runtime, "sim-late", {})
    return BatchScheduler(ctx, handler, Task.EMBEDDINGS), ctx


async def _pull_after_during_a_batch(url: str, batch_s: float) -> tuple[float, float, float]:
    """One item through a scheduler on a device of `batch_s` a batch: `pull_after_s` while
    the batch runs, how long the batch took, and `pull_after_s` once it ended."""
    nc = await connect(url, name="late-pull")
    answers = await nc.subscribe("test.late-pull.replies")
    scheduler, ctx = _scheduler(nc, url, batch_s)
    running = asyncio.create_task(scheduler.run())
    try:
        sent = now_ms()
        body = b'{"model": "sim-late", "input": "one"}'
        item = WorkItem(
            None, "late-1", answers.subject, sent + 60_000, sent, 1, Endpoint.EMBEDDINGS, body
        )
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
    finally:
        scheduler.stop_accepting()
        await asyncio.wait_for(running, 5)
        ctx.executor.shutdown()
        await nc.close()


def test_a_long_batch_leaves_the_queue_to_others_until_near_its_end(nats_server):
    during, took, after = asyncio.run(_pull_after_during_a_batch(nats_server.url, 0.4))
    # 50 ms into a 400 ms batch: pull 10 ms before its end, ~340 ms from now.
    assert 0.25 < during <= 0.4 - PULL_LEAD_S - 0.05 + 0.01
    assert took >= 0.4 and after == 0.0


def test_a_batch_shorter_than_the_lead_pulls_at_once(nats_server):
    during, _, after = asyncio.run(_pull_after_during_a_batch(nats_server.url, 0.008))
    assert during == 0.0 and after == 0.0


async def _pull_ends(url: str, batch_s: float) -> tuple[float, float]:
    """The expiry a scheduler on a device of `batch_s` gives a pull, and how long such a pull
    on a real, empty queue lasted before the server ended it."""
    nc = await connect(url, name="pull-expiry")
    scheduler, ctx = _scheduler(nc, url, batch_s)
    js = nc.jetstream()
    await ensure_work_stream(js, QueueSettings())
    consumer = await ensure_model_consumer(js, "sim-expiry", QueueSettings())
    puller = Puller(nc, WORK_STREAM, consumer, lambda msg: None)
    await puller.start()
    try:
        expires_s = scheduler.pull_expires_s(1.0)
        began = time.monotonic()
        await puller.pull(32, expires_s)
        return expires_s, time.monotonic() - began
    finally:
        await puller.stop()
        ctx.executor.shutdown()
        await nc.close()


def test_a_long_batch_device_ends_its_pull_requests_early_in_a_batch(nats_server):
    expires_s, lasted_s = asyncio.run(_pull_ends(nats_server.url, 0.1))
    assert expires_s == SHORT_PULL_EXPIRES_S
    # The server ends it (its 408), not the client's grace a second later.
    assert SHORT_PULL_EXPIRES_S - 0.005 <= lasted_s < 0.5


def test_a_short_batch_device_keeps_the_long_pull(nats_server):
    # 8 ms batches: a pull open at a batch's start costs its items a few ms; a short expiry
    # would cost an idle worker 50 pull requests a second.
    expires_s, _ = asyncio.run(_pull_ends(nats_server.url, 0.008))
    assert expires_s == 1.0
