"""The embeddings task: decode and validate OpenAI requests, run them as one batch, encode.

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
from shoal.protocol import encode_json
from shoal.runtimes.base import EmbeddingRuntime
from shoal.worker.outbox import Reply

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


class EmbeddingsHandler:
    """Runs a batch of embeddings requests on one runtime call; isolates bad items."""

    def __init__(self, runtime: EmbeddingRuntime, model: str) -> None:
        self.runtime = runtime
        self.model = model

    def handle(self, bodies: list[bytes], adapters: list[str | None] | None = None) -> BatchOutcome:
        """Answer each body; `adapters[i]` is the LoRA deployment body i was sent to (or None)."""
        adapters = adapters or [None] * len(bodies)
        replies: list[Reply | None] = [None] * len(bodies)
        parsed: list[tuple[int, EmbeddingsRequest, list[str]]] = []
        for i, body in enumerate(bodies):
            try:
                request, texts = parse_request(body, self.runtime.dimensions)
            except ApiError as err:
                replies[i] = Reply.from_error(err)
                continue
            parsed.append((i, request, texts))
        started = time.perf_counter()
        if parsed:
            self._run(parsed, replies, adapters)
        runtime_seconds = time.perf_counter() - started
        done = [
            r if r is not None else Reply.from_error(ApiError(500, "no result")) for r in replies
        ]
        return BatchOutcome(done, runtime_seconds, sum(len(t) for _, _, t in parsed))

    def _run(
        self,
        parsed: list[tuple[int, EmbeddingsRequest, list[str]]],
        replies: list[Reply | None],
        adapters: list[str | None],
    ) -> None:
        all_texts = [text for _, _, texts in parsed for text in texts]
        text_adapters = [adapters[index] for index, _, texts in parsed for _ in texts]
        try:
            output = self.runtime.embed(all_texts, text_adapters if any(text_adapters) else None)
        except Exception:
            # One item broke the batch: run each alone so only that item fails.
            for index, request, texts in parsed:
                replies[index] = self._run_alone(request, texts, adapters[index])
            return
        offset = 0
        for index, request, texts in parsed:
            end = offset + len(texts)
            replies[index] = Reply(
                200,
                encode_response(
                    request,
                    output.vectors[offset:end],
                    output.token_counts[offset:end],
                    adapters[index] or self.model,
                ),
            )
            offset = end

    def _run_alone(
        self, request: EmbeddingsRequest, texts: list[str], adapter: str | None
    ) -> Reply:
        try:
            output = self.runtime.embed(texts, [adapter] * len(texts) if adapter else None)
        except ValueError as err:
            return Reply.from_error(ApiError(400, f"The model cannot take this input: {err}"))
        except Exception as err:
            return Reply.from_error(ApiError(500, f"The runtime failed on this item: {err}"))
        model = adapter or self.model
        return Reply(200, encode_response(request, output.vectors, output.token_counts, model))
