"""Several workers on one queue: sharing, SIGKILL mid-load, graceful drain (sim runtime)."""

from __future__ import annotations

import asyncio
import base64
import signal
import time

import httpx
import numpy as np
from conftest import wait_until, worker_status, worker_statuses

from shoal.runtimes.sim import pseudo_embedding


def _vector(item: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")


async def _send_all(
    url: str, model: str, texts: list[str], concurrency: int
) -> list[httpx.Response]:
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:

        async def one(text: str) -> httpx.Response:
            async with semaphore:
                body = {"model": model, "input": text, "encoding_format": "base64"}
                return await client.post("/v1/embeddings", json=body)

        return await asyncio.gather(*(one(t) for t in texts))


def _assert_all_correct(responses: list[httpx.Response], texts: list[str]) -> None:
    for text, response in zip(texts, responses, strict=True):
        assert response.status_code == 200, response.text
        vector = _vector(response.json()["data"][0])
        np.testing.assert_allclose(vector, pseudo_embedding(text, 384), rtol=0, atol=1e-6)


def test_two_workers_share_one_model(nats_server, session_launcher, gateway_url):
    model = "sim-shared"
    workers = [
        session_launcher.worker(
            nats_server.url,
            model,
            "--runtime",
            "sim",
            "--option",
            "batch_ms=10",
            "--max-batch-items",
            "8",
        )
        for _ in range(2)
    ]
    texts = [f"shared sentence {i}" for i in range(240)]
    responses = asyncio.run(_send_all(gateway_url, model, texts, concurrency=48))
    _assert_all_correct(responses, texts)

    def counts() -> list[int] | None:
        done = [worker_status(nats_server.url, w.pid).items_done for w in workers]
        return done if sum(done) == len(texts) else None

    done = wait_until(counts, 10)
    assert all(n > 0 for n in done), f"items per worker: {done}"
    for worker in workers:
        assert worker.stop() == 0


def test_sigkill_mid_load_loses_nothing(nats_server, session_launcher, gateway_url):
    model = "sim-kill"
    args = ("--runtime", "sim", "--option", "batch_ms=40", "--max-batch-items", "4")
    victim = session_launcher.worker(nats_server.url, model, *args)
    survivor = session_launcher.worker(nats_server.url, model, *args)
    # Two workers answer ~200 items a second; statuses come once a second, so the victim may
    # be seen to have started only a second or more into the load. With 200 texts the load
    # could be over by then, the victim holding nothing to redeliver (a CI failure); 600 last
    # ~3 s.
    texts = [f"kill test {i}" for i in range(600)]

    async def load_and_kill() -> list[httpx.Response]:
        load = asyncio.create_task(_send_all(gateway_url, model, texts, concurrency=32))
        # Kill once the victim is known to hold work: it has answered some already.
        while True:
            status = await asyncio.to_thread(worker_status, nats_server.url, victim.pid)
            if status is not None and status.items_done >= 8:
                break
            await asyncio.sleep(0.05)
        assert not load.done(), "the load ended before the victim was seen working"
        victim.process.send_signal(signal.SIGKILL)
        return await load

    responses = asyncio.run(load_and_kill())
    assert victim.process.wait(5) == -signal.SIGKILL
    _assert_all_correct(responses, texts)
    # The victim held unacked work when it died: JetStream redelivered it to the survivor.
    redelivered = wait_until(lambda: worker_status(nats_server.url, survivor.pid).redelivered, 5)
    assert redelivered > 0
    assert survivor.stop() == 0


def test_sigterm_drains_held_work(nats_server, session_launcher, gateway_url):
    model = "sim-drain"
    worker = session_launcher.worker(
        nats_server.url,
        model,
        "--runtime",
        "sim",
        "--option",
        "batch_ms=200",
        "--max-batch-items",
        "4",
    )
    texts = [f"drain test {i}" for i in range(8)]

    async def load_and_stop() -> list[httpx.Response]:
        load = asyncio.create_task(_send_all(gateway_url, model, texts, concurrency=8))
        await asyncio.sleep(0.3)  # the first batch runs and the second is pulled
        worker.process.send_signal(signal.SIGTERM)
        return await load

    started = time.monotonic()
    responses = asyncio.run(load_and_stop())
    # Everything answered by the draining worker itself (no redelivery wait of ack_wait).
    _assert_all_correct(responses, texts)
    assert worker.process.wait(10) == 0
    assert time.monotonic() - started < 5
    assert all(s.pid != worker.pid for s in worker_statuses(nats_server.url))
