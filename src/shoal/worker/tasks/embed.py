"""The embeddings task: embeddings requests, and rerank by cosine, on an embedding model.

This is where such a request body is decoded, once (invariant 5). It knows the runtime
interface and nothing of NATS, so it runs in the executor thread and is tested on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shoal.api.embeddings import (
    EmbeddingInput,
    EmbeddingsRequest,
    encode_embeddings_response,
    parse_embeddings_request,
)
from shoal.api.rerank import RerankJob, encode_rerank_response, parse_rerank_request
from shoal.protocol import Endpoint
from shoal.runtimes.base import EmbeddingRuntime, EmbedOutput, takes_token_ids
from shoal.worker.tasks.isolate import BatchTask


@dataclass(slots=True)
class _Job:
    """One valid item: the inputs it needs embedded, its adapter, how its answer is written."""

    texts: list[EmbeddingInput]  # texts, or token-id lists of the model's own tokenizer
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

    def __init__(self, runtime: Any, model: str, options: dict[str, Any] | None = None) -> None:
        super().__init__(runtime, model)
        self.vocab_size = takes_token_ids(runtime)
        self.shorter_dimensions = matryoshka_dimensions(runtime, options or {})

    def parse(self, body: bytes, adapter: str | None, endpoint: Endpoint | None) -> _Job:
        if endpoint is Endpoint.RERANK:
            rerank = parse_rerank_request(body)
            return _Job([rerank.query, *rerank.documents], rerank, adapter)
        request, inputs = parse_embeddings_request(
            body, self.runtime.dimensions, self.vocab_size, self.shorter_dimensions
        )
        return _Job(inputs, request, adapter)

    def run(self, jobs: Sequence[_Job]) -> list[bytes]:
        inputs = [item for job in jobs for item in job.texts]
        input_adapters = [job.adapter for job in jobs for _ in job.texts]
        output = self._embed(inputs, input_adapters if any(input_adapters) else None)
        bodies, offset = [], 0
        for job in jobs:
            end = offset + len(job.texts)
            vectors, counts = output.vectors[offset:end], output.token_counts[offset:end]
            bodies.append(job.encode(vectors, counts, job.adapter or self.model))
            offset = end
        return bodies

    def size(self, job: _Job) -> int:
        return len(job.texts)

    def _embed(
        self, inputs: list[EmbeddingInput], adapters: list[str | None] | None
    ) -> EmbedOutput:
        """Texts in one runtime call, token-id inputs in another; rows back in input order."""
        ids_at = [i for i, item in enumerate(inputs) if not isinstance(item, str)]
        if not ids_at:
            return self._call(self.runtime.embed, inputs, adapters)
        texts_at = [i for i, item in enumerate(inputs) if isinstance(item, str)]
        # Parsing let token ids through only for a runtime that has this method.
        embed_token_ids = self.runtime.embed_token_ids  # type: ignore[attr-defined]
        parts = [(ids_at, self._call(embed_token_ids, inputs, adapters, ids_at))]
        if texts_at:
            parts.append((texts_at, self._call(self.runtime.embed, inputs, adapters, texts_at)))
        width = parts[0][1].vectors.shape[1]
        vectors = np.empty((len(inputs), width), dtype=np.float32)
        counts = [0] * len(inputs)
        for positions, output in parts:
            vectors[positions] = output.vectors
            for position, count in zip(positions, output.token_counts, strict=True):
                counts[position] = count
        return EmbedOutput(vectors, counts)

    @staticmethod
    def _call(
        embed: Any,
        inputs: list[Any],
        adapters: list[str | None] | None,
        positions: list[int] | None = None,
    ) -> EmbedOutput:
        if positions is not None:
            inputs = [inputs[i] for i in positions]
            adapters = [adapters[i] for i in positions] if adapters else None
        # Adapters are passed only when some input has one: a runtime without LoRA support
        # takes the inputs alone.
        return embed(inputs, adapters) if adapters and any(adapters) else embed(inputs)


def matryoshka_dimensions(runtime: Any, options: dict[str, Any]) -> tuple[int, ...]:
    """The shorter sizes a model's vectors may be cut to (its `dimensions` choices).

    The deployment's option `matryoshka_dimensions` (a list of sizes, or "768,512,256")
    declares them; otherwise the runtime's own reading of the model's files
    (`runtime.matryoshka_dimensions`, e.g. a sentence-transformers card trained with
    MatryoshkaLoss); otherwise none, and `dimensions` must be the model's own size.
    """
    declared = options.get("matryoshka_dimensions")
    if declared is None:
        return tuple(getattr(runtime, "matryoshka_dimensions", ()) or ())
    if isinstance(declared, int):
        declared = [declared]
    elif isinstance(declared, str):
        declared = [part for part in declared.replace(" ", "").split(",") if part]
    try:
        return tuple(int(size) for size in declared)
    except (TypeError, ValueError):
        raise ValueError(
            f"option matryoshka_dimensions must list sizes, e.g. [256, 128] (got {declared!r})"
        ) from None


def cosine_scores(query: np.ndarray, documents: np.ndarray) -> np.ndarray:
    """Cosine similarity of one query vector with each document vector (row)."""
    query = query.astype(np.float32, copy=False)
    documents = documents.astype(np.float32, copy=False)
    norms = np.linalg.norm(documents, axis=1) * np.linalg.norm(query)
    # A zero vector has no direction: its similarity is 0, not NaN.
    return np.divide(
        documents @ query, norms, out=np.zeros(len(documents), np.float32), where=norms > 0
    )
