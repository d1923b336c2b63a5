"""Embeddings: OpenAI's request and response shapes, their parse and encode.

`input` takes what OpenAI's API takes: a string, a list of strings, one token-id list
(`[int, ...]`) or a list of them. Token ids are the served MODEL'S OWN tokenizer's ids (what
`AutoTokenizer.from_pretrained(<model>)` gives), not tiktoken's: runtimes that can embed ids
directly say so (`TokenIdEmbeddingRuntime`), the others answer 400. `dimensions` shortens
vectors only for models trained for it (Matryoshka); see `allowed_dimensions`.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
import numpy as np
import orjson

from shoal.api.errors import ApiError, invalid_body
from shoal.protocol import encode_json

MAX_INPUTS_PER_REQUEST = 2048

# One input as the runtime gets it: a text, or token ids of the model's own tokenizer.
EmbeddingInput = str | list[int]


class EmbeddingsRequest(msgspec.Struct):
    model: str
    input: str | list[Any]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


class EmbeddingFloat(msgspec.Struct):
    """An embedding as a float list (written by `_encode_floats`; the type documents it)."""

    index: int
    embedding: list[float]
    object: str = "embedding"


class EmbeddingBase64(msgspec.Struct):
    index: int
    # The vector's little-endian float32 bytes: msgspec writes bytes as a base64 string, in C
    # (3.7 us a 384-dimension response less than `base64.b64encode` and a str).
    embedding: bytes
    object: str = "embedding"


class Usage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(msgspec.Struct):
    data: list[EmbeddingFloat] | list[EmbeddingBase64]
    model: str
    usage: Usage
    object: str = "list"


_decode_request = msgspec.json.Decoder(EmbeddingsRequest).decode


def parse_embeddings_request(
    body: bytes,
    dimensions: int,
    vocab_size: int | None = None,
    shorter_dimensions: tuple[int, ...] = (),
) -> tuple[EmbeddingsRequest, list[EmbeddingInput]]:
    """Decode and validate one request; raises ApiError(400) with OpenAI's kind of message.

    `vocab_size` is the model's vocabulary when its runtime takes token-id inputs (None: it
    does not); `shorter_dimensions` are the sizes below `dimensions` the model was trained
    to be cut to.
    """
    try:
        request = _decode_request(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as err:
        raise invalid_body(err) from None
    inputs = _inputs(request.input)
    if not inputs:
        raise ApiError(400, "'input' must not be empty", param="input")
    if len(inputs) > MAX_INPUTS_PER_REQUEST:
        raise ApiError(
            400,
            f"'input' holds {len(inputs)} items; at most {MAX_INPUTS_PER_REQUEST}",
            param="input",
        )
    for i, item in enumerate(inputs):
        if isinstance(item, str):
            if not item:
                raise ApiError(400, f"'input[{i}]' must not be an empty string", param="input")
        else:
            _check_token_ids(i, item, vocab_size)
    if request.dimensions is not None:
        _check_dimensions(request.dimensions, dimensions, shorter_dimensions)
    return request, inputs


def _inputs(value: str | list[Any]) -> list[EmbeddingInput]:
    """The inputs of `input`, one per output vector: a list of ints is ONE token-id input."""
    if isinstance(value, str):
        return [value]
    if value and all(_is_token_id(v) for v in value):
        return [value]
    inputs: list[EmbeddingInput] = []
    for i, item in enumerate(value):
        is_ids = isinstance(item, list) and all(_is_token_id(v) for v in item)
        if isinstance(item, str) or is_ids:
            inputs.append(item)
        else:
            raise ApiError(
                400,
                f"'input[{i}]' must be a string or a list of token ids (integers); 'input' is "
                "a string, a list of strings, a list of token ids or a list of such lists",
                param="input",
            )
    return inputs


def _is_token_id(value: Any) -> bool:
    # JSON true/false decode to bool, a subclass of int: they are not token ids.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_token_ids(index: int, ids: list[int], vocab_size: int | None) -> None:
    if vocab_size is None:
        raise ApiError(
            400,
            "This model's runtime does not take token-id inputs: send 'input' as text",
            param="input",
            code="token_ids_not_supported",
        )
    if not ids:
        raise ApiError(400, f"'input[{index}]' must not be an empty list", param="input")
    for token in ids:
        if not 0 <= token < vocab_size:
            # A hostile id may have thousands of digits: not echoed (nor turned into text).
            shown = f"token id {token}" if token.bit_length() <= 64 else "a token id"
            raise ApiError(
                400,
                f"'input[{index}]' holds {shown}, outside this model's vocabulary "
                f"(0 to {vocab_size - 1}); token ids are the model's own tokenizer's",
                param="input",
            )


def allowed_dimensions(dimensions: int, shorter: tuple[int, ...]) -> tuple[int, ...]:
    """The `dimensions` values a model answers: its own size, and the Matryoshka sizes below it.

    A model "allows" a shorter vector only when it was trained so that a prefix of its vector
    is itself an embedding (Matryoshka representation learning); cutting any other model's
    vectors would return numbers that look valid and rank badly, so those get a 400.
    """
    return tuple(sorted({dimensions, *(d for d in shorter if 0 < d < dimensions)}, reverse=True))


def _check_dimensions(wanted: int, dimensions: int, shorter: tuple[int, ...]) -> None:
    allowed = allowed_dimensions(dimensions, shorter)
    if wanted in allowed:
        return
    if len(allowed) == 1:
        message = (
            f"'dimensions' must be {dimensions} for this model (got {wanted}): it was not "
            "trained to be shortened (no Matryoshka dimensions are declared for it)"
        )
    else:
        sizes = ", ".join(str(d) for d in allowed)
        message = f"'dimensions' must be one of {sizes} for this model (got {wanted})"
    raise ApiError(400, message, param="dimensions")


def shorten(vectors: np.ndarray, dimensions: int | None) -> np.ndarray:
    """Matryoshka vectors cut to their first `dimensions` components.

    Rows the model wrote with unit length are scaled back to unit length (as OpenAI's shortened
    embeddings are), so cosine and dot product stay the same measure; other rows are only cut.
    """
    if dimensions is None or dimensions >= vectors.shape[1]:
        return vectors
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    cut = np.array(vectors[:, :dimensions], dtype=np.float32)
    cut_norms = np.linalg.norm(cut, axis=1, keepdims=True)
    unit = (np.abs(norms - 1.0) < 1e-3) & (cut_norms > 0)
    return np.divide(cut, cut_norms, out=cut, where=unit)


def encode_embeddings_response(
    request: EmbeddingsRequest, vectors: np.ndarray, token_counts: list[int], model: str
) -> bytes:
    """The response body, with vectors as float lists or base64 little-endian float32."""
    tokens = sum(token_counts)
    vectors = shorten(vectors, request.dimensions)
    if request.encoding_format == "base64":
        little_endian = vectors.astype("<f4", copy=False)
        data: list[Any] = [EmbeddingBase64(i, row.tobytes()) for i, row in enumerate(little_endian)]
        return encode_json(EmbeddingsResponse(data, model, Usage(tokens, tokens)))
    return _encode_floats(np.ascontiguousarray(vectors, dtype=np.float32), model, tokens)


def _encode_floats(vectors: np.ndarray, model: str, tokens: int) -> bytes:
    # orjson writes float32 arrays straight from the buffer, each number as the shortest text
    # that reads back as the same float32: 2.2x faster than tolist() + msgspec and 44% fewer
    # bytes for 384 dimensions (Python floats would print float64 digits of float32 values).
    data = [{"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(vectors)]
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    body = {"object": "list", "data": data, "model": model, "usage": usage}
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
