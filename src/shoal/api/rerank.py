"""Rerank: the request and response shapes, their parse, and ranking into the response.

Request and response follow the common rerank APIs (Cohere v2, Jina, TEI-style):

    {"model", "query", "documents": [str | {"text": str}, ...], "top_n"?, "return_documents"?}
 -> {"id", "model", "results": [{"index", "relevance_score", "document"?: {"text"}}],
     "usage": {"total_tokens"}}

Results are sorted by score, highest first (ties: lower index first). Two kinds of model
answer it: a cross-encoder scores each (query, document) pair (worker/tasks/cross_encode.py,
one runtime `score` call per batch), and an embedding model scores by the cosine of the
query's and each document's vectors (worker/tasks/embed.py, one `embed` call per batch).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import numpy as np

from shoal.api.errors import ApiError, invalid_body
from shoal.protocol import encode_json

# Cohere's documented recommendation; a larger list is better split by the client, so that
# one request does not hold a batch alone for long.
MAX_DOCUMENTS_PER_REQUEST = 1000


class RerankRequest(msgspec.Struct):
    model: str
    query: Annotated[str, msgspec.Meta(min_length=1)]
    # Checked one by one below, for a message that names the bad document.
    documents: list[Any]
    top_n: Annotated[int, msgspec.Meta(ge=1)] | None = None
    return_documents: bool = False


class RerankDocument(msgspec.Struct):
    text: str


class RerankResult(msgspec.Struct, omit_defaults=True):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(msgspec.Struct):
    total_tokens: int


class RerankResponse(msgspec.Struct):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage


@dataclass(slots=True)
class RerankJob:
    """A validated rerank request: the query and its documents as plain strings."""

    request: RerankRequest
    documents: list[str]

    @property
    def query(self) -> str:
        return self.request.query


_decode_request = msgspec.json.Decoder(RerankRequest).decode


def parse_rerank_request(body: bytes) -> RerankJob:
    """Decode and validate one request; raises ApiError(400) naming the bad parameter."""
    try:
        request = _decode_request(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as err:
        raise invalid_body(err) from None
    if not request.documents:
        raise ApiError(400, "'documents' must not be empty", param="documents")
    if len(request.documents) > MAX_DOCUMENTS_PER_REQUEST:
        raise ApiError(
            400,
            f"'documents' holds {len(request.documents)} items; "
            f"at most {MAX_DOCUMENTS_PER_REQUEST}",
            param="documents",
        )
    documents = [_document_text(i, document) for i, document in enumerate(request.documents)]
    return RerankJob(request, documents)


def _document_text(i: int, document: Any) -> str:
    if isinstance(document, str):
        return document
    if isinstance(document, dict) and isinstance(document.get("text"), str):
        return document["text"]
    raise ApiError(
        400,
        f"'documents[{i}]' must be a string or an object {{\"text\": string}}",
        param="documents",
    )


def encode_rerank_response(
    job: RerankJob, scores: np.ndarray, total_tokens: int, model: str
) -> bytes:
    """The response body: documents by score, highest first, cut to `top_n`."""
    order = np.argsort(-scores, kind="stable")  # stable: equal scores keep document order
    if job.request.top_n is not None:
        order = order[: job.request.top_n]
    values = scores.tolist()
    with_text = job.request.return_documents
    results = [
        RerankResult(int(i), values[i], RerankDocument(job.documents[i]) if with_text else None)
        for i in order
    ]
    response = RerankResponse(
        f"rerank-{uuid.uuid4().hex}", model, results, RerankUsage(total_tokens)
    )
    return encode_json(response)
