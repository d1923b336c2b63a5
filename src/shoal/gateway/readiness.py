"""Readiness: whether every pinned model has a worker that can serve it, kept from a KV watch.

`/readyz` answers 200 only when the gateway can serve: connected to NATS, the deployments
read, and every pinned model (one that a worker was started with: its status says
`pinned`) has at least one READY worker. The answer is computed from what this watch of the
`shoal_workers` bucket holds in memory, so a probe costs no NATS round trip.

A worker reports each of its models once a second. A report not renewed for `STALE_S` is a
worker that died without removing it (SIGKILL): it no longer counts as READY, but its model
stays pinned until the report would have expired from the bucket (`WORKER_STATUS_TTL_S`),
which covers the time a supervisor takes to start its replacement (whose LOADING report
keeps the pin from then on). A worker that drains removes its reports, so a pinned model
whose workers were all stopped on purpose no longer holds readiness back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from shoal.state.deployments import ModelDirectory
from shoal.state.kv import follow, is_removal
from shoal.state.workers import (
    WORKER_STATUS_TTL_S,
    WorkerState,
    WorkerStatus,
    decode_worker_status,
    ensure_workers_kv,
)

log = logging.getLogger(__name__)

# Workers report once a second (worker/sidecar.py): three missed reports is a dead worker.
STALE_S = 3.5


@dataclass(slots=True)
class _Seen:
    status: WorkerStatus
    at: float  # time.monotonic() when the report was written (as far as this gateway knows)


class Readiness:
    """Follows worker reports; says which pinned models have no READY worker."""

    def __init__(self, directory: ModelDirectory) -> None:
        self._directory = directory
        self._seen: dict[str, _Seen] = {}  # by KV key: <worker id>.<model token>
        # By model: the smallest batch budget a live worker reported for it (the committer's
        # envelope size follows it); kept up to date as reports arrive, so a lookup is cheap.
        self._smallest_budget: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None
        self._watcher = None
        self._replaying = True

    async def start(self, js: JetStreamContext) -> None:
        """Watch the bucket (again, after a reconnect: the old watch may have lost its
        consumer with the server that held it; the new one starts from every key's last
        report)."""
        await self.stop()
        self._watcher = await (await ensure_workers_kv(js)).watchall()
        self._replaying = True  # the bucket's current values come first
        self._task = asyncio.create_task(follow(self._watcher, self._on_entry, "worker status"))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._watcher is not None:
            with contextlib.suppress(Exception):
                await self._watcher.stop()
            self._watcher = None

    def ready_workers(self) -> dict[str, int]:
        """Every pinned, deployed model and how many workers report it READY right now."""
        now = time.monotonic()
        counts: dict[str, int] = {}
        for key, seen in list(self._seen.items()):
            age = now - seen.at
            if age > WORKER_STATUS_TTL_S:  # expired from the bucket too (no delete is sent)
                del self._seen[key]
                continue
            status = seen.status
            if not status.pinned or self._directory.get(status.model) is None:
                continue
            ready = status.state == WorkerState.READY and age <= STALE_S
            counts[status.model] = counts.get(status.model, 0) + int(ready)
        return counts

    def smallest_budget(self, model: str) -> int | None:
        """The smallest batch budget (items) among the workers reporting `model` lately."""
        return self._smallest_budget.get(model)

    def missing(self) -> list[str]:
        """The pinned models without a READY worker, sorted."""
        return sorted(model for model, ready in self.ready_workers().items() if not ready)

    def _on_entry(self, entry: KeyValue.Entry | None) -> None:
        if entry is None:  # the bucket's current values have been replayed
            self._replaying = False
            return
        if is_removal(entry):
            removed = self._seen.pop(entry.key, None)
            if removed is not None:
                self._update_budget(removed.status.model)
            return
        try:
            status = decode_worker_status(entry.value)
        except Exception as err:
            log.debug("ignoring an unreadable worker status %s: %s", entry.key, err)
            return
        now = time.monotonic()
        at = now
        if self._replaying and entry.created is not None:
            # A report replayed when the watch began may be old (its worker may be dead):
            # date it by when it was stored. Live updates are dated by their arrival, so a
            # clock difference with the server matters only until the next report.
            at = now - max(0.0, time.time() - entry.created.timestamp())
        self._seen[entry.key] = _Seen(status, at)
        self._update_budget(status.model)

    def _update_budget(self, model: str) -> None:
        now = time.monotonic()
        budgets = [
            seen.status.max_batch_items
            for seen in self._seen.values()
            if seen.status.model == model
            and seen.status.max_batch_items > 0
            and seen.status.state != WorkerState.FAILED
            and now - seen.at <= STALE_S
        ]
        if budgets:
            self._smallest_budget[model] = min(budgets)
        else:
            self._smallest_budget.pop(model, None)
