"""The fleet as `shoal models` and `GET /admin/models` show it: a read model over the buckets,
and the load progress `shoal up` and `shoal deploy --wait` print.

It joins the deployments, the workers' statuses, the stored profiles and each model's
backlog; it writes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec
from nats.js import JetStreamContext

from shoal.broker.jetstream import read_backlog
from shoal.runtimes.registry import is_simulated
from shoal.state.deployments import list_deployments
from shoal.state.profiles import read_profiles
from shoal.state.workers import WorkerState, WorkerStatus, read_worker_statuses


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


class LoadProgress:
    """One line per change in how workers hold one model, for `shoal up` and `deploy --wait`.

    Fed successive reads of the workers' statuses; remembers each worker's last state, so a
    status that is reported again every second prints nothing.
    """

    def __init__(self, model: str) -> None:
        self.model = model
        self._states: dict[str, WorkerState] = {}
        self._loading_since: dict[str, float] = {}
        self._started = time.monotonic()

    def changes(
        self, statuses: list[WorkerStatus], label: Callable[[WorkerStatus], str]
    ) -> list[tuple[WorkerStatus, str]]:
        """The statuses of this model whose state changed since the last call, each with its
        line: `label(status)` names the worker (e.g. "worker 1" for `shoal up`'s own)."""
        lines: list[tuple[WorkerStatus, str]] = []
        now = time.monotonic()
        for s in statuses:
            if s.model != self.model or self._states.get(s.worker_id) is s.state:
                continue
            self._states[s.worker_id] = s.state
            who = label(s)
            if s.state is WorkerState.LOADING:
                self._loading_since[s.worker_id] = now
                line = f"{who}: loading {s.model} ({s.runtime}) ..."
            elif s.state is WorkerState.READY:
                # From when this worker was seen loading; from the first look if it never was.
                took = now - self._loading_since.get(s.worker_id, self._started)
                budget = f"budget {s.max_batch_items}" if s.max_batch_items else "no batch budget"
                line = f"{who}: {s.model} ready ({budget}) in {took:.1f} s"
            elif s.state is WorkerState.FAILED:
                line = f"{who}: {s.model} failed to load: {s.error}"
            else:
                line = f"{who}: {s.model} {s.state.value}"
            lines.append((s, line))
        return lines
