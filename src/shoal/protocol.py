"""What travels between gateway and workers: subjects, header names and wire types.

(What is stored in KV buckets, and their types, is in `shoal.state`.)

Both sides import this module and nothing of each other. Request and response bodies are
opaque bytes here: the gateway never decodes more than routing needs, the worker decodes once.
"""

from __future__ import annotations

import itertools
import re
import secrets
import time
from collections.abc import Iterable
from enum import StrEnum
from typing import Any

import msgspec

WORK_STREAM = "SHOAL_WORK"
WORK_SUBJECT_PREFIX = "shoal.work"
REPLY_SUBJECT_PREFIX = "shoal.reply"
CANCEL_SUBJECT_PREFIX = "shoal.cancel"


class Header:
    """NATS header names. Work and results travel in msgpack bodies (below), so the one header
    is JetStream's own: parsing a dozen header lines per message cost more than the rest of
    the worker's handling of it."""

    MSG_ID = "Nats-Msg-Id"  # JetStream deduplicates a retried publish on it


class Task(StrEnum):
    """What a deployment does; it decides which endpoints it serves."""

    EMBEDDINGS = "embeddings"
    GENERATE = "generate"
    RERANK = "rerank"  # a cross-encoder: scores (query, document) pairs


class Endpoint(StrEnum):
    """The API a work item came through: the worker decodes the body accordingly."""

    EMBEDDINGS = "embeddings"
    COMPLETIONS = "completions"
    CHAT_COMPLETIONS = "chat.completions"
    RERANK = "rerank"

    def served_by(self, task: Task) -> bool:
        """Whether a deployment of that task answers this endpoint."""
        return self in TASK_ENDPOINTS[task]


# An embedding model also reranks (cosine of query and document vectors).
TASK_ENDPOINTS: dict[Task, frozenset[Endpoint]] = {
    Task.EMBEDDINGS: frozenset({Endpoint.EMBEDDINGS, Endpoint.RERANK}),
    Task.GENERATE: frozenset({Endpoint.COMPLETIONS, Endpoint.CHAT_COMPLETIONS}),
    Task.RERANK: frozenset({Endpoint.RERANK}),
}


_UNSAFE_TOKEN_CHAR = re.compile(r"[^A-Za-z0-9-]")
_VALID_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


def is_valid_model_name(name: str) -> bool:
    return bool(_VALID_MODEL_NAME.match(name))


def name_token(name: str) -> str:
    """Encode a model name as one NATS subject token, consumer name and KV key.

    Model names often hold dots ("Qwen2.5-0.5B"), which separate subject tokens, so every
    character outside [A-Za-z0-9-] becomes `_xx` (its hex code). The mapping is one to one.
    """
    # One regex pass (~0.3 us for a usual name; a per-character loop cost ~8 us a request).
    return _UNSAFE_TOKEN_CHAR.sub(_escape_token_char, name)


def _escape_token_char(match: re.Match[str]) -> str:
    return f"_{ord(match.group()):02x}"


def work_subject(model: str) -> str:
    return f"{WORK_SUBJECT_PREFIX}.{name_token(model)}"


def consumer_name(model: str) -> str:
    return f"work-{name_token(model)}"


def reply_subject(gateway_id: str) -> str:
    return f"{REPLY_SUBJECT_PREFIX}.{gateway_id}"


def cancel_subject(model: str) -> str:
    """Core NATS subject on which gateways cancel a model's requests (body: `encode_cancels`)."""
    return f"{CANCEL_SUBJECT_PREFIX}.{name_token(model)}"


def encode_cancels(request_ids: Iterable[str]) -> bytes:
    """A cancel message's body: the request ids, one per line (an id has no line break: it is
    the gateway's, or a client's HTTP header value)."""
    return "\n".join(request_ids).encode()


def decode_cancels(body: bytes) -> list[str]:
    """The request ids of a cancel message (`encode_cancels`)."""
    return [request_id for request_id in body.decode(errors="replace").split("\n") if request_id]


class UniqueIds:
    """Ids unique across processes and restarts without a system call each: a random 64-bit
    prefix drawn once, then a counter; 32 hex digits, as a uuid4's. `uuid.uuid4()` reads the
    OS's random source on every call (~1.8 us against ~0.15 here), and the gateway draws one
    for every request and every envelope."""

    def __init__(self) -> None:
        self._prefix = secrets.token_hex(8)
        self._count = itertools.count()

    def new(self) -> str:
        return f"{self._prefix}{next(self._count):016x}"


def now_ms() -> int:
    return int(time.time() * 1000)


class ModelSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A deployment: the name clients use, and how a worker loads and runs it."""

    name: str
    runtime: str
    task: Task = Task.EMBEDDINGS
    source: str = ""
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    # A LoRA fine-tune: a PEFT adapter directory on another deployment (the base). Its
    # requests are served by the base's workers, in the same batches as the base's.
    base: str = ""
    adapter: str = ""


class WorkRequest(msgspec.Struct, array_like=True, frozen=True):
    """One client request inside a work envelope: its metadata and its body as sent."""

    request_id: str
    endpoint: str  # an Endpoint value
    deadline_ms: int  # unix ms after which the result is useless
    cost: int  # estimated tokens (batch forming)
    body: bytes
    stream: bool = False  # reply with numbered chunks, not one body
    # Set when the body was too large for a work message: it waits in the object store under
    # this key (broker/bodies.py) and `body` is empty.
    body_key: str = ""
    # The client's Idempotency-Key, as the key of its record (state/idempotency.py): the
    # worker keeps its answer there.
    idempotency_key: str = ""


class WorkEnvelope(msgspec.Struct, array_like=True, frozen=True):
    """One JetStream work message: the requests for one model that one gateway queued while
    its previous publish for that model was in flight (group commit), all answered on
    `reply_to`. It is acked once every request in it is answered."""

    reply_to: str
    sent_ms: int  # unix ms of the publish, for queue-wait metrics
    requests: list[WorkRequest]


class Result(msgspec.Struct, array_like=True, frozen=True):
    """One request's answer (or one chunk of a streamed answer) on its way back."""

    request_id: str
    status: int  # HTTP status
    body: bytes  # the response body, or the chunk, ready for the client
    seq: int = -1  # a streamed chunk's position from 0; -1: a whole answer
    final: bool = False  # the last message of a streamed answer
    # A body larger than a message can carry travels in parts, in order, on one connection:
    # `part` counts them from 0, `more` says the body goes on in the next part, and `sender`
    # names the connection, so parts of two workers answering one request are never mixed.
    more: bool = False
    part: int = 0
    sender: str = ""


class ResultBatch(msgspec.Struct, array_like=True, frozen=True):
    """One reply message: every result of a batch for one gateway."""

    results: list[Result]


encode_msgpack = msgspec.msgpack.Encoder().encode
decode_envelope = msgspec.msgpack.Decoder(WorkEnvelope).decode
decode_results = msgspec.msgpack.Decoder(ResultBatch).decode
encode_json = msgspec.json.Encoder().encode
decode_model_spec = msgspec.json.Decoder(ModelSpec).decode
