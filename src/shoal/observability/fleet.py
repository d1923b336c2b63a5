"""The fleet as the workers report it in the workers KV bucket."""

from __future__ import annotations

import nats.js.errors
from nats.js import JetStreamContext

from shoal.broker.jetstream import ensure_workers_kv
from shoal.protocol import WorkerStatus, decode_worker_status


async def read_worker_statuses(js: JetStreamContext) -> list[WorkerStatus]:
    """Every live worker's last report (reports expire a few seconds after a worker dies)."""
    kv = await ensure_workers_kv(js)
    try:
        keys = await kv.keys()
    except nats.js.errors.NoKeysError:
        return []
    statuses = []
    for key in keys:
        try:
            entry = await kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            continue  # it left between listing and reading
        if entry.value:
            statuses.append(decode_worker_status(entry.value))
    return sorted(statuses, key=lambda s: (s.model, s.worker_id))
