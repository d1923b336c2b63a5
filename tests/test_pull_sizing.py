"""Pulls sized to the room (worker/pull_sizing.py), and what a pulled message's ack subject
tells (worker/items.py, `ack_fields`). The last test runs a real worker process (SIMULATED
device) on a real nats-server."""

from __future__ import annotations

import asyncio
import time

from conftest import wait_until

from shoal.broker.connection import connect
from shoal.protocol import (
    WORK_STREAM,
    WorkEnvelope,
    WorkRequest,
    consumer_name,
    encode_msgpack,
    now_ms,
    work_subject,
)
from shoal.worker.items import ack_fields
from shoal.worker.pull_sizing import RecentMessages


def _recent(*requests: int) -> RecentMessages:
    recent = RecentMessages()
    for count in requests:
        recent.observe(count)
    return recent


def test_a_pull_fits_the_room_even_if_every_message_is_as_large_as_the_largest_lately():
    # Envelopes of 1-2 requests with one of 16 among them: 32 free slots take 2 messages (at
    # most 32 requests), not 32 / the mean (~21 messages, up to ~60 requests).
    assert _recent(1, 2, 1, 16, 2).messages_for_room(32) == 2
    assert _recent(1, 16).messages_for_room(10) == 1  # at least one
    assert _recent(*[1] * 32).messages_for_room(32) == 32
    assert RecentMessages().messages_for_room(32) == 1  # nothing seen: envelopes may be large


def test_a_messages_deliveries_and_stream_sequence_are_read_from_its_ack_subject():
    v1 = "$JS.ACK.SHOAL_WORK.work-m.3.77.70.1733000000000000000.12"
    assert ack_fields(v1) == (3, 77)  # deliveries, stream sequence
    v2 = "$JS.ACK.domain.account.SHOAL_WORK.work-m.1.77.70.1733000000000000000.5.token"
    assert ack_fields(v2) == (1, 77)
    # Unknown: a first delivery, nothing else known.
    assert ack_fields(None) == ack_fields("not.an.ack") == (1, 0)


async def _publish_envelopes(url: str, model: str, envelopes: int, requests: int) -> None:
    """`envelopes` work messages of `requests` requests each, as a gateway publishes them."""
    nc = await connect(url, name="cold-pull")
    try:
        js = nc.jetstream()
        for e in range(envelopes):
            body = f'{{"model": "{model}", "input": "envelope {e}"}}'.encode()
            work = [
                WorkRequest(f"cold-{e}-{i}", "embeddings", now_ms() + 60_000, 4, body)
                for i in range(requests)
            ]
            envelope = WorkEnvelope("test.cold-pull.replies", now_ms(), work)
            await js.publish(work_subject(model), encode_msgpack(envelope))
    finally:
        await nc.close()


async def _consumer_counts(url: str, model: str) -> tuple[int, int]:
    """(messages delivered to workers and not acked, messages still queued)."""
    nc = await connect(url, name="cold-pull-info")
    try:
        info = await nc.jetstream().consumer_info(WORK_STREAM, consumer_name(model))
        return int(info.num_ack_pending or 0), int(info.num_pending or 0)
    finally:
        await nc.close()


def test_a_fresh_worker_does_not_take_more_envelopes_than_its_batches_hold(nats_server, launcher):
    """Budget 8, a 1.5 s simulated batch, 6 envelopes of 4 requests queued at once: the
    worker holds its running batch and one budget of pulled work, at most 4 envelopes; the
    rest stays queued for other workers. Counting each unseen envelope as one request, its
    first pull asked for 8 messages and took all 6 (24 requests, three batches' worth)."""
    model = "sim-cold-pull"
    launcher.worker(
        nats_server.url,
        model,
        "--runtime",
        "sim",
        "--option",
        "batch_ms=1500",
        "--max-batch-items",
        "8",
    )
    asyncio.run(_publish_envelopes(nats_server.url, model, envelopes=6, requests=4))
    time.sleep(0.7)  # the first batch runs; what the worker took, it took by now
    taken, queued = wait_until(
        lambda: (counts := asyncio.run(_consumer_counts(nats_server.url, model)))[0] and counts,
        10,
    )
    # Acked envelopes leave both counts (the first batch ends 1.5 s in), so: at most 4 taken,
    # at least 2 still queued.
    assert taken <= 4 and queued >= 2, (taken, queued)
