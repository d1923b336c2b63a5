"""What travels between gateway and workers: subjects, header names and wire types.

Both sides import this module and nothing of each other. Request and response bodies are
opaque bytes here: the gateway never decodes more than routing needs, the worker decodes once.
"""

from __future__ import annotations

import re
import time
from enum import StrEnum
from typing import Any

import msgspec

WORK_STREAM = "SHOAL_WORK"
WORK_SUBJECT_PREFIX = "shoal.work"
REPLY_SUBJECT_PREFIX = "shoal.reply"
CANCEL_SUBJECT_PREFIX = "shoal.cancel"
MODELS_BUCKET = "shoal_models"
WORKERS_BUCKET = "shoal_workers"
PROFILES_BUCKET = "shoal_profiles"
WORKER_STATUS_TTL_S = 15.0


class Header:
    """NATS header names on work and reply messages."""

    MSG_ID = "Nats-Msg-Id"  # JetStream deduplicates a retried publish on it
    REQUEST_ID = "Shoal-Request-Id"
    REPLY_TO = "Shoal-Reply-To"
    DEADLINE = "Shoal-Deadline"  # unix time in milliseconds
    SENT = "Shoal-Sent"  # unix time in milliseconds, for queue-wait metrics
    COST = "Shoal-Cost"  # estimated tokens
    TASK = "Shoal-Task"  # the API endpoint: an Endpoint value
    STREAM = "Shoal-Stream"  # "1": reply with a sequence of chunks, not one body
    STATUS = "Shoal-Status"  # HTTP status of a reply
    SEQ = "Shoal-Seq"  # position of a chunk in a streamed reply, from 0
    FINAL = "Shoal-Final"  # "1" on the last message of a streamed reply


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


_SAFE_TOKEN_CHAR = re.compile(r"[A-Za-z0-9-]")
_VALID_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


def is_valid_model_name(name: str) -> bool:
    return bool(_VALID_MODEL_NAME.match(name))


def name_token(name: str) -> str:
    """Encode a model name as one NATS subject token, consumer name and KV key.

    Model names often hold dots ("Qwen2.5-0.5B"), which separate subject tokens, so every
    character outside [A-Za-z0-9-] becomes `_xx` (its hex code). The mapping is one to one.
    """
    return "".join(c if _SAFE_TOKEN_CHAR.match(c) else f"_{ord(c):02x}" for c in name)


def worker_status_key(worker_id: str, model: str) -> str:
    """The workers-KV key of one worker's report about one model (or adapter) it serves."""
    return f"{worker_id}.{name_token(model)}"


def work_subject(model: str) -> str:
    return f"{WORK_SUBJECT_PREFIX}.{name_token(model)}"


def consumer_name(model: str) -> str:
    return f"work-{name_token(model)}"


def reply_subject(gateway_id: str) -> str:
    return f"{REPLY_SUBJECT_PREFIX}.{gateway_id}"


def cancel_subject(model: str) -> str:
    """Core NATS subject on which gateways cancel a model's requests (body: request id)."""
    return f"{CANCEL_SUBJECT_PREFIX}.{name_token(model)}"


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


class WorkerState(StrEnum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"  # the model (or adapter) failed to load here; `error` says why


class WorkerStatus(msgspec.Struct, kw_only=True):
    """What a worker reports about itself in the workers KV bucket, about once a second."""

    worker_id: str
    model: str
    runtime: str
    simulated: bool
    pid: int
    state: WorkerState
    metrics_url: str = ""
    items_done: int = 0
    redelivered: int = 0  # items this worker got after another delivery was not acked
    batches: int = 0
    max_batch_items: int = 0
    slots: int = 0  # generative workers: sequences decoded together at most
    running_sequences: int = 0
    max_running_sequences: int = 0  # the most sequences seen in one decode step
    tokens_generated: int = 0
    cancelled: int = 0
    busy_fraction: float = 0.0
    updated_ms: int = 0
    # Placement (issue 5): a pinned model was named when the worker started and is never
    # evicted; memory is what loading the model took (measured; declared by `sim`).
    pinned: bool = True
    memory_mb: float = 0.0
    max_batch: int = 0  # the batch budget in items the worker runs with (tuned or given)
    last_used_ms: int = 0
    error: str = ""  # state FAILED: why the load failed


class BatchProfile(msgspec.Struct, kw_only=True):
    """A batch budget found by profiling a model on one kind of hardware (the profiles KV)."""

    model: str
    runtime: str
    hardware: str
    max_batch_items: int
    max_batch_tokens: int
    # batch size -> items per second and seconds per batch, as measured
    throughput: dict[int, float] = msgspec.field(default_factory=dict)
    latency_s: dict[int, float] = msgspec.field(default_factory=dict)
    profiled_by: str = ""
    profiled_ms: int = 0


encode_json = msgspec.json.Encoder().encode
decode_model_spec = msgspec.json.Decoder(ModelSpec).decode
decode_worker_status = msgspec.json.Decoder(WorkerStatus).decode
decode_batch_profile = msgspec.json.Decoder(BatchProfile).decode
