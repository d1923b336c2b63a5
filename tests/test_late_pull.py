"""A worker running a long batch leaves the queue's items to other workers until the batch
nears its end (schedulers/batch.py, `pull_after_s`), then pulls for the next batch at once;
such a batch ends the pull request left open when it starts (`Puller.end_request`).

Real NATS (the answers go out through it) and the SIMULATED accelerator (runtime `sim`), a
batch scheduler driven directly; the latency this buys at 90% load with 16 and 32 workers is
measured in bench.push_vs_pull (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import time

from conftest import scheduler_context

from shoal.broker.connection import connect
from shoal.broker.jetstream import ensure_model_consumer, ensure_work_stream, read_backlog
from shoal.broker.publish import publish_work
from shoal.broker.puller import Puller
from shoal.config import QueueSettings, WorkerSettings
from shoal.protocol import WORK_STREAM, Endpoint, Task, now_ms, work_subject
from shoal.runtimes.sim import SimEmbeddingRuntime
from shoal.worker.items import WorkItem
from shoal.worker.schedulers.batch import PULL_LEAD_S, BatchScheduler
from shoal.worker.tasks.embed import EmbeddingsHandler


async def _pull_after_during_a_batch(url: str, batch_s: float) -> tuple[float, float, float, int]:
    """One item through a scheduler on a device of `batch_s` a batch whatever its size (its
    profile says so): `pull_after_s` while the batch runs, how long the batch took,
    `pull_after_s` once it ended, and how often the batch asked to end the open pulls."""
    nc = await connect(url, name="late-pull")
    answers = await nc.subscribe("test.late-pull.replies")
    settings = WorkerSettings(nats_url=url, max_batch_items=32, adaptive_batch_wait=False)
    profile = {n: batch_s for n in (1, 8, 32)}
    ends: list[float] = []
    ctx = scheduler_context(
        nc,
        settings,
        "sim-late",
        profiled_latency_s=profile,
        end_open_pulls=lambda: ends.append(time.monotonic()),
    )
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
        ctx.room_changed.clear()
        await answers.next_msg(timeout=batch_s + 2)  # answered
        took = time.monotonic() - began
        await asyncio.sleep(0.05)  # its acks, then the end of the batch
        # The batch's end wakes a fill loop waiting to pull.
        assert ctx.room_changed.is_set()
        return during, took, scheduler.pull_after_s(), len(ends)
    finally:
        scheduler.stop_accepting()
        await asyncio.wait_for(running, 5)
        ctx.executor.shutdown()
        await nc.close()


def test_a_long_batch_leaves_the_queue_to_others_until_near_its_end(nats_server):
    during, took, after, ends = asyncio.run(_pull_after_during_a_batch(nats_server.url, 0.4))
    # 50 ms into a 400 ms batch: pull 10 ms before its end, ~340 ms from now.
    assert 0.25 < during <= 0.4 - PULL_LEAD_S - 0.05 + 0.01
    assert took >= 0.4 and after == 0.0
    assert ends == 1  # at its start: a pull left open would fill up behind it


def test_a_batch_shorter_than_the_lead_pulls_at_once(nats_server):
    during, _, after, ends = asyncio.run(_pull_after_during_a_batch(nats_server.url, 0.008))
    assert during == 0.0 and after == 0.0
    assert ends == 0  # its pull for the next batch stays open: that batch is due at once


async def _an_ended_pull_request(url: str) -> tuple[list[bytes], list[bytes], int, list[bytes]]:
    """Two messages pulled on a request for ten, the request ended, three more published:
    what the ended request took, what it took after the three, the backlog then, and what
    a new request takes."""
    model = "sim-end-pull"
    nc = await connect(url, name="end-pull")
    js = nc.jetstream()
    await ensure_work_stream(js, QueueSettings())
    consumer = await ensure_model_consumer(js, model, QueueSettings())
    pulled: list = []
    puller = Puller(nc, WORK_STREAM, consumer, pulled.append)
    await puller.start()
    try:
        for i in range(2):
            await publish_work(js, work_subject(model), f"m{i}".encode(), {})
        open_request = asyncio.create_task(puller.pull(10, 5.0))
        for _ in range(100):
            if len(pulled) == 2:
                break
            await asyncio.sleep(0.02)
        assert puller.request_open()
        await puller.end_request()
        await asyncio.wait_for(open_request, 1.0)  # `pull` returned at once
        assert not puller.request_open()
        first = [msg.data for msg in pulled]
        for i in range(2, 5):
            await publish_work(js, work_subject(model), f"m{i}".encode(), {})
        await asyncio.sleep(0.3)
        after_end = [msg.data for msg in pulled[2:]]
        backlog = await read_backlog(js, model) or 0
        began = time.monotonic()
        await puller.pull(3, 5.0)  # a new request: it ends when the three have come
        assert time.monotonic() - began < 2.0, "a pull after an end waited out its expiry"
        later = [msg.data for msg in pulled[2:]]
        for msg in pulled:
            await msg.ack()
        return first, after_end, backlog, later
    finally:
        await puller.stop()
        await nc.close()


def test_an_ended_pull_request_takes_no_more_and_the_next_takes_the_rest(nats_server):
    """JetStream has no cancel for a pull request; it is ended by dropping interest in its
    inbox. Without that, the three would have gone to the open request for ten."""
    first, after_end, backlog, later = asyncio.run(_an_ended_pull_request(nats_server.url))
    assert first == [b"m0", b"m1"]
    assert after_end == []  # nothing dealt to the ended request
    assert backlog == 3  # still in the queue, for whichever worker pulls first
    assert later == [b"m2", b"m3", b"m4"]


def test_a_worker_with_long_batches_asks_for_small_envelopes(nats_server):
    """Long batches: an eighth of the budget (what overflows a batch's room waits a whole
    batch); short ones: half (sharing the publish matters more)."""

    async def asked(batch_s: float) -> int:
        nc = await connect(nats_server.url, name="envelope-ask")
        settings = WorkerSettings(nats_url=nats_server.url, max_batch_items=32)
        profile = {n: batch_s for n in (1, 8, 32)}
        ctx = scheduler_context(nc, settings, "sim-ask", profiled_latency_s=profile)
        runtime = SimEmbeddingRuntime("sim-ask", {"batch_ms": batch_s * 1000, "token_us": 0})
        handler = EmbeddingsHandler(runtime, "sim-ask", {})
        try:
            return BatchScheduler(ctx, handler, Task.EMBEDDINGS).envelope_requests()
        finally:
            ctx.executor.shutdown()
            await nc.close()

    assert asyncio.run(asked(0.1)) == 4
    assert asyncio.run(asked(0.005)) == 16
