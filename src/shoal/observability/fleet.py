"""The fleet as the workers report it in the workers KV bucket."""

from __future__ import annotations

from typing import Any

import msgspec
import nats.js.errors
from nats.js import JetStreamContext

from shoal.broker.jetstream import ensure_workers_kv, read_backlog
from shoal.protocol import WorkerState, WorkerStatus, decode_worker_status


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


class ModelView(msgspec.Struct, kw_only=True):
    """One deployment as `shoal models` and `GET /admin/models` show it."""

    name: str
    task: str
    runtime: str
    source: str
    simulated: bool
    workers_ready: int  # workers holding it, loaded
    workers_loading: int
    backlog: int  # queued requests no worker has pulled yet
    batch_budget: int  # items per batch: the tuned profile's, or what its workers run with
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    errors: list[str] = msgspec.field(default_factory=list)  # why workers failed to load it


async def model_views(js: JetStreamContext) -> list[ModelView]:
    """The deployments with who holds each, its backlog and its batch budget."""
    from shoal.deployments import list_deployments
    from shoal.worker.profiling import read_profiles

    statuses = await read_worker_statuses(js)
    profiles = {p.model: p.max_batch_items for p in await read_profiles(js)}
    views = []
    for spec in await list_deployments(js):
        mine = [s for s in statuses if s.model == spec.name]
        budgets = [s.max_batch for s in mine if s.max_batch]
        views.append(
            ModelView(
                name=spec.name,
                task=spec.task.value,
                runtime=spec.runtime,
                source=spec.source,
                simulated=spec.runtime == "sim",
                workers_ready=sum(s.state is WorkerState.READY for s in mine),
                workers_loading=sum(s.state is WorkerState.LOADING for s in mine),
                backlog=await read_backlog(js, spec.name) or 0,
                batch_budget=profiles.get(spec.name) or max(budgets, default=0),
                options=spec.options,
                errors=sorted({s.error for s in mine if s.state is WorkerState.FAILED}),
            )
        )
    return views
