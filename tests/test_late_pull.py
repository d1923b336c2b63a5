"""A worker running a long batch leaves the queue's items to other workers until the batch
nears its end (schedulers/batch.py, `pull_after_s`), then pulls for the next batch at once;
idle, it pulls one message at a time, in pulls that live as long as it has been idle
(`pull_window`).

Real NATS (the answers go out through it) and the SIMULATED accelerator (runtime `sim`), a
batch scheduler driven directly; the latency this buys at 90% load with 16 and 32 workers is
measured in bench.push_vs_pull (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import time
from typing import NamedTuple

import pytest
from conftest import scheduler_context

from shoal.broker.connection import connect
from shoal.config import WorkerSettings
from shoal.protocol import Endpoint, Task, now_ms
from shoal.runtimes.sim import SimEmbeddingRuntime
from shoal.worker.items import WorkItem
from shoal.worker.schedulers.base import PullWindow
from shoal.worker.schedulers.batch import PULL_LEAD_S, SHORT_PULL_S, BatchScheduler
from shoal.worker.tasks.embed import EmbeddingsHandler


class PullTiming(NamedTuple):
    """A scheduler's pull timing around one batch (seconds)."""

    after_during: float  # `pull_after_s` while the batch runs
    took: float  # the batch, from accepting its item to its answer
    after_ended: float  # `pull_after_s` once it ended
    window_during: PullWindow  # `pull_window(1.0)` while the batch runs
    window_ended: PullWindow  # the same just after it ended
    window_quiet: PullWindow  # the same after a quiet 0.3 s


async def _pull_after_during_a_batch(url: str, batch_s: float) -> PullTiming:
    """One item through a scheduler on a device of `batch_s` a batch whatever its size (its
    profile says so)."""
    nc = await connect(url, name="late-pull")
    answers = await nc.subscribe("test.late-pull.replies")
    settings = WorkerSettings(nats_url=url, max_batch_items=32, adaptive_batch_wait=False)
    profile = {n: batch_s for n in (1, 8, 32)}
    ctx = scheduler_context(nc, settings, "sim-late", profiled_latency_s=profile)
    runtime = SimEmbeddingRuntime("sim-late", {"batch_ms": batch_s * 1000, "token_us": 0})
    scheduler = BatchScheduler(ctx, EmbeddingsHandler(runtime, "sim-late", {}), Task.EMBEDDINGS)
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
        window_during = scheduler.pull_window(1.0)
        ctx.room_changed.clear()
        await answers.next_msg(timeout=batch_s + 2)  # answered
        took = time.monotonic() - began
        await asyncio.sleep(0.05)  # its acks, then the end of the batch
        # The batch's end wakes a fill loop waiting to pull.
        assert ctx.room_changed.is_set()
        after, window_ended = scheduler.pull_after_s(), scheduler.pull_window(1.0)
        await asyncio.sleep(0.3)
        quiet = scheduler.pull_window(1.0)
        return PullTiming(during, took, after, window_during, window_ended, quiet)
    finally:
        scheduler.stop_accepting()
        await asyncio.wait_for(running, 5)
        ctx.executor.shutdown()
        await nc.close()


def test_a_long_batch_leaves_the_queue_to_others_until_near_its_end(nats_server):
    timing = asyncio.run(_pull_after_during_a_batch(nats_server.url, 0.4))
    # 50 ms into a 400 ms batch: pull 10 ms before its end, ~340 ms from now.
    assert 0.25 < timing.after_during <= 0.4 - PULL_LEAD_S - 0.05 + 0.01
    assert timing.took >= 0.4 and timing.after_ended == 0.0


def test_an_idle_worker_on_long_batches_pulls_one_message_in_pulls_as_long_as_its_idleness(
    nats_server,
):
    timing = asyncio.run(_pull_after_during_a_batch(nats_server.url, 0.4))
    # The running batch's late pull asks for the room, open the longest time.
    assert timing.window_during == PullWindow(1.0, pytest.approx(0.4), 0)
    # Just after the batch: one message, in a short pull, the load being on; after a quiet
    # spell, a pull as long as the spell.
    assert timing.window_ended.messages == timing.window_quiet.messages == 1
    assert SHORT_PULL_S <= timing.window_ended.expires_s < 0.1
    assert 0.3 <= timing.window_quiet.expires_s < 0.5
    assert timing.window_quiet.batch_s == pytest.approx(0.4)


def test_a_batch_shorter_than_the_lead_pulls_at_once(nats_server):
    timing = asyncio.run(_pull_after_during_a_batch(nats_server.url, 0.008))
    assert timing.after_during == 0.0 and timing.after_ended == 0.0
    # Short batches: little arrives while one runs, so every pull asks for the room and
    # lives its full time.
    assert timing.window_during == timing.window_ended == timing.window_quiet == PullWindow(1.0)
