"""Worker statuses: what each worker reports about each model it serves, once a second.

Bucket `shoal_workers`, key `<worker id>.<model token>`, value a `WorkerStatus` (JSON). The
bucket's TTL makes a dead worker's reports expire on their own.
"""

from __future__ import annotations

import contextlib
import logging
from enum import StrEnum

import msgspec
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from shoal.protocol import encode_json, name_token
from shoal.state.kv import ensure_bucket, read_all

log = logging.getLogger(__name__)

WORKERS_BUCKET = "shoal_workers"
WORKER_STATUS_TTL_S = 15.0


class WorkerState(StrEnum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"  # the model (or adapter) failed to load here; `error` says why


class WorkerStatus(msgspec.Struct, kw_only=True):
    """What a worker reports about one model it serves (or failed to load)."""

    worker_id: str
    model: str
    runtime: str
    simulated: bool
    pid: int
    state: WorkerState
    metrics_url: str = ""
    items_done: int = 0
    redelivered: int = 0  # items this worker got after another delivery was not acked
    batches: int = 0  # embedding batches, or decode steps
    max_batch_items: int = 0  # the batch budget in items it runs with (profiled or given)
    largest_batch: int = 0  # the most items (or sequences) seen in one batch (or step)
    slots: int = 0  # generative workers: sequences decoded together at most
    running_sequences: int = 0
    tokens_generated: int = 0
    cancelled: int = 0
    busy_fraction: float = 0.0
    updated_ms: int = 0
    # A pinned model was named when the worker started and is never evicted; memory is what
    # loading the model took (measured; declared by a simulated runtime).
    pinned: bool = True
    memory_mb: float = 0.0
    last_used_ms: int = 0
    error: str = ""  # state FAILED: why the load failed
    # A lossy runtime's measured quality, e.g. ONNX int8's mean cosine to fp32 (`int8_cosine`).
    quality: dict[str, float] = msgspec.field(default_factory=dict)


decode_worker_status = msgspec.json.Decoder(WorkerStatus).decode


def worker_status_key(worker_id: str, model: str) -> str:
    """The key of one worker's report about one model (or adapter) it serves."""
    return f"{worker_id}.{name_token(model)}"


async def ensure_workers_kv(js: JetStreamContext) -> KeyValue:
    return await ensure_bucket(js, WORKERS_BUCKET, ttl_s=WORKER_STATUS_TTL_S)


async def put_status(kv: KeyValue, status: WorkerStatus) -> None:
    """Write a report; a failed write is logged, not raised (the next one comes in a second)."""
    try:
        await kv.put(worker_status_key(status.worker_id, status.model), encode_json(status))
    except Exception as err:
        log.debug("status report failed: %s", err)


async def forget_statuses(kv: KeyValue, worker_id: str, models: list[str]) -> None:
    """Remove this worker's reports about these models (unloaded, or no longer failed)."""
    for model in models:
        with contextlib.suppress(Exception):
            await kv.delete(worker_status_key(worker_id, model))


async def read_worker_statuses(js: JetStreamContext) -> list[WorkerStatus]:
    """Every live worker's last reports, by model then worker."""
    statuses = await read_all(await ensure_workers_kv(js), decode_worker_status)
    return sorted(statuses, key=lambda s: (s.model, s.worker_id))
