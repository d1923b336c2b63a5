"""The embeddings task: embeddings requests, and rerank by cosine, on an embedding model.

This is where such a request body is decoded, once (invariant 5). It knows the runtime
interface and nothing of NATS, so it runs in the executor thread and is tested on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shoal.api.embeddings import (
    EmbeddingsRequest,
    encode_embeddings_response,
    parse_embeddings_request,
)
from shoal.api.rerank import RerankJob, encode_rerank_response, parse_rerank_request
from shoal.protocol import Endpoint
from shoal.runtimes.base import EmbeddingRuntime, EmbedOutput
from shoal.worker.tasks.isolate import BatchTask


@dataclass(slots=True)
class _Job:
    """One valid item: the texts it needs embedded, its adapter, how its answer is written."""

    texts: list[str]
    request: EmbeddingsRequest | RerankJob
    adapter: str | None

    def encode(self, vectors: np.ndarray, token_counts: list[int], model: str) -> bytes:
        if isinstance(self.request, RerankJob):
            # texts[0] is the query, the rest are the documents in order.
            scores = cosine_scores(vectors[0], vectors[1:])
            return encode_rerank_response(self.request, scores, sum(token_counts), model)
        return encode_embeddings_response(self.request, vectors, token_counts, model)


class EmbeddingsHandler(BatchTask[_Job]):
    """Runs a batch of requests to an embedding model on one runtime call; isolates bad items.

    It answers embeddings requests and rerank requests (cosine of query and documents); a
    batch may mix both, and every text of the batch goes into the same `embed` call.
    """

    runtime: EmbeddingRuntime

    def parse(self, body: bytes, adapter: str | None, endpoint: Endpoint | None) -> _Job:
        if endpoint is Endpoint.RERANK:
            rerank = parse_rerank_request(body)
            return _Job([rerank.query, *rerank.documents], rerank, adapter)
        request, texts = parse_embeddings_request(body, self.runtime.dimensions)
        return _Job(texts, request, adapter)

    def run(self, jobs: Sequence[_Job]) -> list[bytes]:
        texts = [text for job in jobs for text in job.texts]
        text_adapters = [job.adapter for job in jobs for _ in job.texts]
        output = self._embed(texts, text_adapters if any(text_adapters) else None)
        bodies, offset = [], 0
        for job in jobs:
            end = offset + len(job.texts)
            vectors, counts = output.vectors[offset:end], output.token_counts[offset:end]
            bodies.append(job.encode(vectors, counts, job.adapter or self.model))
            offset = end
        return bodies

    def size(self, job: _Job) -> int:
        return len(job.texts)

    def _embed(self, texts: list[str], adapters: list[str | None] | None) -> EmbedOutput:
        # Adapters are passed only when some text has one: a runtime without LoRA support
        # takes the texts alone.
        return self.runtime.embed(texts, adapters) if adapters else self.runtime.embed(texts)


def cosine_scores(query: np.ndarray, documents: np.ndarray) -> np.ndarray:
    """Cosine similarity of one query vector with each document vector (row)."""
    query = query.astype(np.float32, copy=False)
    documents = documents.astype(np.float32, copy=False)
    norms = np.linalg.norm(documents, axis=1) * np.linalg.norm(query)
    # A zero vector has no direction: its similarity is 0, not NaN.
    return np.divide(
        documents @ query, norms, out=np.zeros(len(documents), np.float32), where=norms > 0
    )
