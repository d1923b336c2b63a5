"""A three-node NATS cluster loses a node under load, and no request.

Three nats-server nodes on loopback (`LocalCluster`), a gateway and a worker given all three
URLs, the SIMULATED accelerator (runtime `sim`). While clients send requests, the node that
leads the work stream is killed with SIGKILL, and later started again. Every request must end
in its one correct answer: a client told to retry (503 while its gateway moves to another node)
retries with the same Idempotency-Key, as a careful client does. The stream and the buckets
are replicated on three nodes, so nothing queued is lost with the node.
"""

from __future__ import annotations

import asyncio
import base64
import os
import signal

import httpx
import numpy as np
import pytest
from conftest import wait_until

from shoal.broker.cluster import LocalCluster
from shoal.broker.connection import connect
from shoal.protocol import WORK_STREAM
from shoal.runtimes.sim import pseudo_embedding

MODEL = "sim-cluster"
REQUESTS = 600
CONCURRENCY = 16


@pytest.fixture
def cluster(tmp_path):
    nodes = LocalCluster(3, tmp_path / "nats")
    nodes.start()
    try:
        wait_until(lambda: _cluster_formed(nodes.url), 30)
        yield nodes
    finally:
        nodes.stop()


def _cluster_formed(url: str) -> bool:
    async def check() -> bool:
        nc = await connect(url, name="test")
        try:
            if len(nc._server_info.get("connect_urls") or []) < 3:
                return False
            await nc.jetstream().account_info()  # a JetStream meta leader is elected
            return True
        except Exception:
            return False
        finally:
            await nc.close()

    return asyncio.run(check())


def _stream_cluster(url: str):
    async def read():
        nc = await connect(url, name="test")
        try:
            return (await nc.jetstream().stream_info(WORK_STREAM)).cluster
        finally:
            await nc.close()

    return asyncio.run(read())


async def _send_all(url: str, texts: list[str], sent: list[int]) -> list[httpx.Response]:
    semaphore = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:

        async def one(index: int, text: str) -> httpx.Response:
            body = {"model": MODEL, "input": text, "encoding_format": "base64"}
            headers = {"Idempotency-Key": f"cluster-{index}"}
            async with semaphore:
                for _ in range(100):
                    try:
                        response = await client.post("/v1/embeddings", json=body, headers=headers)
                    except httpx.TransportError:
                        await asyncio.sleep(0.2)
                        continue
                    if response.status_code not in (429, 503):
                        sent.append(index)
                        return response
                    await asyncio.sleep(0.2)  # told to retry
            raise AssertionError(f"request {index} was never answered")

        return await asyncio.gather(*(one(i, t) for i, t in enumerate(texts)))


def test_a_killed_stream_leader_loses_no_request_and_rejoins(cluster, launcher):
    _, url = launcher.gateway(cluster.url)
    launcher.worker(cluster.url, MODEL, "--runtime", "sim", "--option", "batch_ms=20")
    replicated = _stream_cluster(cluster.url)
    assert replicated is not None and len(replicated.replicas or []) == 2, replicated
    leader = cluster.node_named(replicated.leader)

    texts = [f"clustered sentence {i}" for i in range(REQUESTS)]
    answered: list[int] = []
    answered_before_kill: list[int] = []

    async def scenario() -> list[httpx.Response]:
        load = asyncio.ensure_future(_send_all(url, texts, answered))
        while len(answered) < REQUESTS // 3:
            await asyncio.sleep(0.05)
        os.kill(leader.pid, signal.SIGKILL)  # mid-load, without warning
        answered_before_kill.append(len(answered))
        return await load

    responses = asyncio.run(scenario())
    for text, response in zip(texts, responses, strict=True):
        assert response.status_code == 200, response.text
        vector = np.frombuffer(base64.b64decode(response.json()["data"][0]["embedding"]), "<f4")
        np.testing.assert_allclose(vector, pseudo_embedding(text, 384), rtol=0, atol=1e-6)
    assert sorted(answered) == list(range(REQUESTS))  # each exactly once
    assert answered_before_kill[0] < REQUESTS - 100  # most of the load came after the kill

    # A new leader took over; the killed node comes back on its ports and store and catches up.
    after = _stream_cluster(cluster.url)
    assert after.leader != replicated.leader
    leader.start()
    wait_until(
        lambda: (
            all(peer.current for peer in (_stream_cluster(cluster.url).replicas or []))
            and len(_stream_cluster(cluster.url).replicas or []) == 2
        ),
        60,
    )
