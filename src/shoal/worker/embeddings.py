"""The embeddings task: decode and validate OpenAI requests, run them as one batch, encode.

An embedding model also answers rerank requests (worker/rerank.py), by cosine similarity.

This is where a request body is decoded, once (invariant 5). It knows the runtime interface
and nothing of NATS, so it runs in the executor thread and is tested on its own.
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import numpy as np

from shoal.errors import ApiError, invalid_body
from shoal.protocol import Endpoint, encode_json
from shoal.runtimes.base import EmbeddingRuntime, EmbedOutput
from shoal.worker.outbox import Reply
from shoal.worker.rerank import (
    RerankJob,
    cosine_scores,
    encode_rerank_response,
    parse_rerank_request,
)

MAX_INPUTS_PER_REQUEST = 2048


class EmbeddingsRequest(msgspec.Struct):
    model: str
    input: str | list[Any]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class EmbeddingFloat(msgspec.Struct):
    index: int
    embedding: list[float]
    object: str = "embedding"


class EmbeddingBase64(msgspec.Struct):
    index: int
    embedding: str
    object: str = "embedding"


class Usage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(msgspec.Struct):
    data: list[EmbeddingFloat] | list[EmbeddingBase64]
    model: str
    usage: Usage
    object: str = "list"


@dataclass(slots=True)
class BatchOutcome:
    replies: list[Reply]
    runtime_seconds: float
    texts: int


_decode_request = msgspec.json.Decoder(EmbeddingsRequest).decode


def parse_request(body: bytes, dimensions: int) -> tuple[EmbeddingsRequest, list[str]]:
    """Decode and validate one request; raises ApiError(400) with OpenAI's kind of message."""
    try:
        request = _decode_request(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as err:
        raise invalid_body(err) from None
    texts = [request.input] if isinstance(request.input, str) else request.input
    if not texts:
        raise ApiError(400, "'input' must not be empty", param="input")
    if len(texts) > MAX_INPUTS_PER_REQUEST:
        raise ApiError(
            400,
            f"'input' holds {len(texts)} items; at most {MAX_INPUTS_PER_REQUEST}",
            param="input",
        )
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise ApiError(
                400,
                f"'input[{i}]' must be a string: token-id inputs are not supported",
                param="input",
            )
        if not text:
            raise ApiError(400, f"'input[{i}]' must not be an empty string", param="input")
    if request.dimensions is not None and request.dimensions != dimensions:
        raise ApiError(
            400,
            f"'dimensions' must be {dimensions} for this model (got {request.dimensions})",
            param="dimensions",
        )
    return request, texts


def encode_response(
    request: EmbeddingsRequest, vectors: np.ndarray, token_counts: list[int], model: str
) -> bytes:
    if request.encoding_format == "base64":
        little_endian = vectors.astype("<f4", copy=False)
        data: list[Any] = [
            EmbeddingBase64(i, base64.b64encode(row.tobytes()).decode())
            for i, row in enumerate(little_endian)
        ]
    else:
        data = [EmbeddingFloat(i, row) for i, row in enumerate(vectors.tolist())]
    tokens = sum(token_counts)
    return encode_json(EmbeddingsResponse(data, model, Usage(tokens, tokens)))


@dataclass(slots=True)
class _Job:
    """One valid item: the texts it needs embedded, and how its answer is written."""

    index: int
    texts: list[str]
    request: EmbeddingsRequest | RerankJob

    def encode(self, vectors: np.ndarray, token_counts: list[int], model: str) -> bytes:
        if isinstance(self.request, RerankJob):
            # texts[0] is the query, the rest are the documents in order.
            scores = cosine_scores(vectors[0], vectors[1:])
            return encode_rerank_response(self.request, scores, sum(token_counts), model)
        return encode_response(self.request, vectors, token_counts, model)


class EmbeddingsHandler:
    """Runs a batch of requests to an embedding model on one runtime call; isolates bad items.

    It answers embeddings requests and rerank requests (cosine of query and documents); a
    batch may mix both, and every text of the batch goes into the same `embed` call.
    """

    def __init__(self, runtime: EmbeddingRuntime, model: str) -> None:
        self.runtime = runtime
        self.model = model

    def handle(
        self,
        bodies: list[bytes],
        adapters: list[str | None] | None = None,
        endpoints: list[Endpoint | None] | None = None,
    ) -> BatchOutcome:
        """Answer each body; `adapters[i]` is the LoRA deployment body i was sent to (or None).

        `endpoints[i]` says how body i is decoded (default: embeddings).
        """
        adapters = adapters or [None] * len(bodies)
        endpoints = endpoints or [Endpoint.EMBEDDINGS] * len(bodies)
        replies: list[Reply | None] = [None] * len(bodies)
        jobs: list[_Job] = []
        for i, body in enumerate(bodies):
            try:
                jobs.append(self._parse(i, body, endpoints[i]))
            except ApiError as err:
                replies[i] = Reply.from_error(err)
        started = time.perf_counter()
        if jobs:
            self._run(jobs, replies, adapters)
        runtime_seconds = time.perf_counter() - started
        done = [
            r if r is not None else Reply.from_error(ApiError(500, "no result")) for r in replies
        ]
        return BatchOutcome(done, runtime_seconds, sum(len(job.texts) for job in jobs))

    def _parse(self, index: int, body: bytes, endpoint: Endpoint | None) -> _Job:
        if endpoint is Endpoint.RERANK:
            rerank = parse_rerank_request(body)
            return _Job(index, [rerank.query, *rerank.documents], rerank)
        request, texts = parse_request(body, self.runtime.dimensions)
        return _Job(index, texts, request)

    def _run(
        self, jobs: list[_Job], replies: list[Reply | None], adapters: list[str | None]
    ) -> None:
        all_texts = [text for job in jobs for text in job.texts]
        text_adapters = [adapters[job.index] for job in jobs for _ in job.texts]
        try:
            output = self._embed(all_texts, text_adapters if any(text_adapters) else None)
        except Exception:
            # One item broke the batch: run each alone so only that item fails.
            for job in jobs:
                replies[job.index] = self._run_alone(job, adapters[job.index])
            return
        offset = 0
        for job in jobs:
            end = offset + len(job.texts)
            model = adapters[job.index] or self.model
            vectors, counts = output.vectors[offset:end], output.token_counts[offset:end]
            replies[job.index] = Reply(200, job.encode(vectors, counts, model))
            offset = end

    def _embed(self, texts: list[str], adapters: list[str | None] | None) -> EmbedOutput:
        # Adapters are passed only when some text has one: a runtime without LoRA support
        # (or one written before it) takes the texts alone.
        return self.runtime.embed(texts, adapters) if adapters else self.runtime.embed(texts)

    def _run_alone(self, job: _Job, adapter: str | None) -> Reply:
        try:
            output = self._embed(job.texts, [adapter] * len(job.texts) if adapter else None)
        except ValueError as err:
            return Reply.from_error(ApiError(400, f"The model cannot take this input: {err}"))
        except Exception as err:
            return Reply.from_error(ApiError(500, f"The runtime failed on this item: {err}"))
        model = adapter or self.model
        return Reply(200, job.encode(output.vectors, output.token_counts, model))
