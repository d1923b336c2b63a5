"""Group commit and batched replies: what the cheap path adds, on real processes.

Requests that reach a gateway together share one JetStream message (an envelope); a worker
answers a batch with one reply message per gateway. SIMULATED accelerator (runtime `sim`).
"""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import nats.js.errors
from conftest import wait_until, worker_status
from test_fleet import _assert_all_correct, _send_all

from shoal.broker.connection import connect
from shoal.protocol import WORK_STREAM, consumer_name, decode_envelope


def _stored_messages(nats_url: str) -> int:
    async def read() -> int:
        nc = await connect(nats_url, name="test")
        try:
            return (await nc.jetstream().stream_info(WORK_STREAM)).state.last_seq
        finally:
            await nc.close()

    return asyncio.run(read())


async def _wait_until_pulled(
    nats_url: str, model: str, after_seq: int, marker: bytes, count: int
) -> None:
    """Waits until `count` requests whose bodies hold `marker` are stored in work messages
    after `after_seq` and the model's workers have pulled every one of those messages."""
    nc = await connect(nats_url, name="test")
    js = nc.jetstream()
    seen: dict[int, int] = {}  # message sequence -> marked requests in it
    try:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            last_seq = (await js.stream_info(WORK_STREAM)).state.last_seq
            for seq in range(after_seq + 1, last_seq + 1):
                if seq in seen:
                    continue
                try:
                    envelope = decode_envelope((await js.get_msg(WORK_STREAM, seq)).data)
                except nats.js.errors.NotFoundError:
                    continue  # acked already (someone else's) or not readable: not ours to count
                seen[seq] = sum(marker in request.body for request in envelope.requests)
            marked = [seq for seq, n in seen.items() if n]
            if sum(seen.values()) >= count:
                delivered = (await js.consumer_info(WORK_STREAM, consumer_name(model))).delivered
                if delivered.stream_seq >= max(marked):
                    return
            await asyncio.sleep(0.02)
        raise AssertionError(f"{count} requests marked {marker!r} not pulled in 15 s: {seen}")
    finally:
        await nc.close()


def test_concurrent_requests_share_messages_and_get_their_own_answers(
    nats_server, session_launcher, gateway_url
):
    model = "sim-envelopes"
    worker = session_launcher.worker(
        nats_server.url,
        model,
        "--runtime",
        "sim",
        "--option",
        "batch_ms=20",
        "--max-batch-items",
        "64",
    )
    before = _stored_messages(nats_server.url)
    texts = [f"enveloped sentence {i}" for i in range(256)]
    responses = asyncio.run(_send_all(gateway_url, model, texts, concurrency=128))
    _assert_all_correct(responses, texts)
    messages = _stored_messages(nats_server.url) - before
    assert 1 <= messages < len(texts) / 2, messages  # shared: far fewer messages than requests
    status = wait_until(
        lambda: (s := worker_status(nats_server.url, worker.pid)) and s.items_done >= 256 and s, 10
    )
    assert status.items_done == 256 and status.redelivered == 0


def test_one_batch_answers_two_gateways(nats_server, session_launcher, gateway_url):
    """A batch holding requests of two gateways: each gets exactly its own results."""
    model = "sim-two-gateways"
    session_launcher.worker(
        nats_server.url,
        model,
        "--runtime",
        "sim",
        "--option",
        "batch_ms=50",
        "--max-batch-items",
        "64",
    )
    _, other_url = session_launcher.gateway(nats_server.url)
    texts_a = [f"gateway a {i}" for i in range(48)]
    texts_b = [f"gateway b {i}" for i in range(48)]

    async def both():
        return await asyncio.gather(
            _send_all(gateway_url, model, texts_a, concurrency=48),
            _send_all(other_url, model, texts_b, concurrency=48),
        )

    responses_a, responses_b = asyncio.run(both())
    _assert_all_correct(responses_a, texts_a)
    _assert_all_correct(responses_b, texts_b)


def test_a_gateway_killed_while_its_batch_runs_harms_no_other(
    nats_server, session_launcher, launcher, gateway_url
):
    model = "sim-gateway-killed"
    worker = session_launcher.worker(
        nats_server.url,
        model,
        "--runtime",
        "sim",
        "--option",
        "batch_ms=400",
        "--max-batch-items",
        "64",
    )
    doomed, doomed_url = launcher.gateway(nats_server.url)
    before = _stored_messages(nats_server.url)
    texts_doomed = [f"doomed {i}" for i in range(16)]
    texts_live = [f"live {i}" for i in range(16)]

    async def run():
        async def doomed_requests():
            try:
                return await _send_all(doomed_url, model, texts_doomed, concurrency=16)
            except httpx.HTTPError:
                return None

        doomed_task = asyncio.create_task(doomed_requests())
        live_task = asyncio.create_task(_send_all(gateway_url, model, texts_live, concurrency=16))
        # Killed only once the worker holds every one of its requests (a fixed sleep was too
        # short on a busy 2-core CI machine: none had been published yet).
        await _wait_until_pulled(nats_server.url, model, before, b"doomed", len(texts_doomed))
        doomed.process.send_signal(signal.SIGKILL)
        return await live_task, await doomed_task

    live, _ = asyncio.run(run())
    _assert_all_correct(live, texts_live)
    # Every request was answered once and its envelope acked: nothing comes back later.
    time.sleep(2.5)  # past the tests' ack wait (2 s)
    status = worker_status(nats_server.url, worker.pid)
    assert status.items_done == 32 and status.redelivered == 0, status


def test_envelopes_hold_at_most_half_the_smallest_workers_batch(
    nats_server, session_launcher, gateway_url
):
    """A worker takes whole envelopes: with budget 8 an envelope holds 4 requests at most, so
    a burst is spread over many messages instead of one worker's backlog."""
    model = "sim-small-budget"
    session_launcher.worker(
        nats_server.url,
        model,
        "--runtime",
        "sim",
        "--option",
        "batch_ms=20",
        "--max-batch-items",
        "8",
    )
    time.sleep(1.5)  # the gateway hears the worker's budget from its next status report
    before = _stored_messages(nats_server.url)
    texts = [f"small budget sentence {i}" for i in range(128)]
    responses = asyncio.run(_send_all(gateway_url, model, texts, concurrency=128))
    _assert_all_correct(responses, texts)
    messages = _stored_messages(nats_server.url) - before
    assert len(texts) / 4 <= messages < len(texts), messages
