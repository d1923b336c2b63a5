"""The fleet as `shoal models` and `GET /admin/models` show it: a read model over the buckets.

It joins the deployments, the workers' statuses, the stored profiles and each model's
backlog; it writes nothing.
"""

from __future__ import annotations

from typing import Any

import msgspec
from nats.js import JetStreamContext

from shoal.broker.jetstream import read_backlog
from shoal.runtimes.registry import is_simulated
from shoal.state.deployments import list_deployments
from shoal.state.profiles import read_profiles
from shoal.state.workers import WorkerState, read_worker_statuses


class ModelView(msgspec.Struct, kw_only=True):
    """One deployment with who holds it, its backlog and its batch budget."""

    name: str
    task: str
    runtime: str
    source: str
    simulated: bool
    workers_ready: int  # workers holding it, loaded
    workers_loading: int
    backlog: int  # queued requests no worker has pulled yet
    max_batch_items: int  # the batch budget: the tuned profile's, or what its workers run with
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    errors: list[str] = msgspec.field(default_factory=list)  # why workers failed to load it
    quality: dict[str, float] = msgspec.field(default_factory=dict)  # e.g. ONNX int8 cosine


async def model_views(js: JetStreamContext) -> list[ModelView]:
    """The deployments with who holds each, its backlog and its batch budget."""
    statuses = await read_worker_statuses(js)
    profiles = {p.model: p.max_batch_items for p in await read_profiles(js)}
    views = []
    for spec in await list_deployments(js):
        mine = [s for s in statuses if s.model == spec.name]
        budgets = [s.max_batch_items for s in mine if s.max_batch_items]
        views.append(
            ModelView(
                name=spec.name,
                task=spec.task.value,
                runtime=spec.runtime,
                source=spec.source,
                simulated=is_simulated(spec.runtime),
                workers_ready=sum(s.state is WorkerState.READY for s in mine),
                workers_loading=sum(s.state is WorkerState.LOADING for s in mine),
                backlog=await read_backlog(js, spec.name) or 0,
                max_batch_items=profiles.get(spec.name) or max(budgets, default=0),
                options=spec.options,
                errors=sorted({s.error for s in mine if s.state is WorkerState.FAILED}),
                quality=next((s.quality for s in mine if s.quality), {}),
            )
        )
    return views
