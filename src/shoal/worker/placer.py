"""Placement by pulling, acted on: a fleet worker loads what nobody serves, evicts, idles out.

The decisions are pure functions in worker/placement.py; this module gathers what they need
(every deployment's backlog, which other workers hold which model, what this worker holds)
and carries them out through `Holdings`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

from nats.js import JetStreamContext

from shoal.broker.jetstream import ensure_model_consumer, read_backlog
from shoal.protocol import ModelSpec
from shoal.state.workers import WorkerState, read_worker_statuses
from shoal.worker.holdings import Holdings
from shoal.worker.model_server import ModelLoadError
from shoal.worker.placement import (
    BacklogHistory,
    Resident,
    estimate_memory_mb,
    evictions,
    models_to_load,
)

log = logging.getLogger(__name__)


class Placer:
    """One look at the queue and the fleet per `step()`; at most one load per step."""

    def __init__(self, holdings: Holdings, js: JetStreamContext) -> None:
        self._holdings = holdings
        self._js = js
        self._history = BacklogHistory()

    async def step(self) -> None:
        await self._unload_idle()
        await self._place()

    async def _unload_idle(self) -> None:
        limit = self._holdings.settings.idle_unload_s
        if limit <= 0:
            return
        for name, server in list(self._holdings.servers.items()):
            if not server.pinned and server.ready and server.idle_s() >= limit:
                await self._holdings.unload(name, f"no work for {limit:g} s")

    async def _place(self) -> None:
        holdings = self._holdings
        everything = holdings.directory.all()
        # An adapter is served by its base's workers: its backlog counts as the base's.
        deployed = [s for s in everything if not s.base and not holdings.failed_recently(s.name)]
        self._history.forget({spec.name for spec in deployed})
        backlog: dict[str, int] = {}
        for spec in everything:
            target = spec.base or spec.name
            if target not in holdings.servers:
                backlog[target] = backlog.get(target, 0) + await self._backlog(spec)
        for name, pending in backlog.items():
            self._history.record(name, pending)
        if not any(backlog.values()):
            return
        holders = await self._holders()
        loaded = set(holdings.servers)
        for spec in models_to_load(deployed, loaded, backlog, holders, self._history):
            if holders.get(spec.name, 0) == 0 and not await self._still_unserved(spec.name):
                continue  # another worker took it while we waited our turn
            # Announced before evicting anything: a worker that looks now sees it taken.
            server = await holdings.announce(spec, pinned=False)
            if await self._make_room(spec, holders):
                try:
                    await holdings.finish_load(server)
                except ModelLoadError as err:
                    await holdings.remember_failure(spec, err)
                return  # one load per step: the next step sees the fleet anew
            await holdings.withdraw(server)

    async def _backlog(self, spec: ModelSpec) -> int:
        pending = await read_backlog(self._js, spec.name)
        if pending is None:  # deployed by an older component: make its consumer now
            await ensure_model_consumer(self._js, spec.name, self._holdings.settings.queue)
            return 0
        return pending

    async def _holders(self) -> dict[str, int]:
        """How many other workers hold (or are loading) each model."""
        counts: dict[str, int] = {}
        for status in await read_worker_statuses(self._js):
            if status.worker_id != self._holdings.worker_id and status.state in (
                WorkerState.LOADING,
                WorkerState.READY,
            ):
                counts[status.model] = counts.get(status.model, 0) + 1
        return counts

    async def _still_unserved(self, model: str) -> bool:
        # Idle workers that see the same backlog at the same moment would all load the
        # model: each waits a random moment (longer the more it holds) and looks again.
        await asyncio.sleep(random.uniform(0.0, 0.4) + 0.2 * len(self._holdings.servers))
        return (await self._holders()).get(model, 0) == 0

    async def _make_room(self, spec: ModelSpec, holders: dict[str, int]) -> bool:
        holdings = self._holdings
        need = estimate_memory_mb(spec, holdings.measured_mb)
        now = time.monotonic()
        residents = [
            Resident(
                name, s.memory_mb, s.idle_s(), now - s.loaded_at, s.pinned, holders.get(name, 0)
            )
            for name, s in holdings.servers.items()
            if s.ready
        ]
        settings = holdings.settings
        chosen = evictions(residents, need, settings.memory_budget_mb, settings.min_residency_s)
        if chosen is None:
            log.debug("no room for %s (%.0f MB)", spec.name, need)
            return False
        for name in chosen:
            await holdings.unload(name, f"evicted (least recently used) to load {spec.name}")
        return True
