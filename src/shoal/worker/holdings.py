"""The models one worker process holds: loading, unloading, following the deployments.

`Holdings` owns the process's `ModelServer`s (one per loaded model), reports their statuses,
remembers loads that failed (reported as FAILED statuses while the failure stands), drains
models that were undeployed or changed, and serves every LoRA deployment whose base it holds.
Placement by pulling (worker/placer.py) decides what else to load and evict; it acts
through `announce`, `finish_load` and `unload` here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from nats.aio.client import Client
from nats.js.kv import KeyValue

from shoal.config import WorkerSettings
from shoal.protocol import ModelSpec, now_ms
from shoal.state.deployments import ModelDirectory
from shoal.state.workers import WorkerState, WorkerStatus, forget_statuses, put_status
from shoal.worker.model_server import ModelLoadError, ModelServer, new_status

log = logging.getLogger(__name__)

RETRY_FAILED_S = 60.0  # a model or adapter that failed to load here is not tried sooner


@dataclass(slots=True)
class _FailedLoad:
    """A model or adapter that failed to load here, and the status that says so."""

    revision: int  # of the deployment that failed
    when: float  # time.monotonic()
    status: WorkerStatus


class Holdings:
    """The models loaded in this process, by name."""

    def __init__(
        self,
        nc: Client,
        worker_id: str,
        settings: WorkerSettings,
        directory: ModelDirectory,
        workers_kv: KeyValue,
        metrics_url: str,
    ) -> None:
        self.nc = nc
        self.worker_id = worker_id
        self.settings = settings
        self.directory = directory
        self.servers: dict[str, ModelServer] = {}
        self.measured_mb: dict[str, float] = {}  # first (largest) measurement per model
        self._kv = workers_kv
        self._metrics_url = metrics_url
        self._failed: dict[str, _FailedLoad] = {}

    # -- loading and unloading ---------------------------------------------------------------

    async def load(self, spec: ModelSpec, *, pinned: bool) -> ModelServer:
        return await self.finish_load(await self.announce(spec, pinned=pinned))

    async def announce(self, spec: ModelSpec, *, pinned: bool) -> ModelServer:
        """Report the model as loading here, so other workers leave it to this one."""
        server = ModelServer(self.nc, self.worker_id, spec, self.settings, pinned=pinned)
        self.servers[spec.name] = server
        await server.report(self._kv, self._metrics_url)
        return server

    async def withdraw(self, server: ModelServer) -> None:
        """Take back an announcement that will not be loaded after all."""
        del self.servers[server.spec.name]
        await self._forget(server.served_models())

    async def finish_load(self, server: ModelServer) -> ModelServer:
        spec = server.spec
        try:
            await server.load()
        except ModelLoadError:
            await self.withdraw(server)
            raise
        # Memory freed by an earlier unload stays with the process, so a reload can measure
        # next to nothing: the first (largest) measurement stands.
        server.memory_mb = max(server.memory_mb, self.measured_mb.get(spec.name, 0.0))
        self.measured_mb[spec.name] = server.memory_mb
        self._failed.pop(spec.name, None)  # its READY status replaces a FAILED one
        await server.report(self._kv, self._metrics_url)
        return server

    async def unload(self, name: str, reason: str) -> None:
        server = self.servers.get(name)
        if server is None:
            return
        log.info("unloading %s: %s", name, reason)
        models = server.served_models()
        await server.drain()
        del self.servers[name]
        await self._forget(models)

    async def drain_all(self) -> None:
        await asyncio.gather(*(self.unload(name, "stopping") for name in list(self.servers)))
        failed = list(self._failed)
        self._failed.clear()
        await self._forget(failed)

    async def _forget(self, models: list[str]) -> None:
        await forget_statuses(self._kv, self.worker_id, models)

    # -- failed loads ------------------------------------------------------------------------

    def failed_recently(self, name: str) -> bool:
        """True while a load of this deployment failed here less than RETRY_FAILED_S ago.

        A deploy of the same name (a new KV revision) is tried at once.
        """
        failed = self._failed.get(name)
        return failed is not None and (
            failed.revision == self.directory.revision(name)
            and time.monotonic() - failed.when < RETRY_FAILED_S
        )

    async def remember_failure(self, spec: ModelSpec, err: ModelLoadError) -> None:
        # Not every 0.5 s: a broken model would be loaded again and again, and logged as often.
        # Its FAILED status tells `shoal models` why the deployment is not served.
        log.error("%s (tried again in %.0f s, or when deployed again)", err, RETRY_FAILED_S)
        status = new_status(
            self.worker_id, spec, WorkerState.FAILED, self._metrics_url, pinned=False
        )
        status.error = str(err)
        self._failed[spec.name] = _FailedLoad(
            self.directory.revision(spec.name), time.monotonic(), status
        )
        await self._report_failures()

    async def _report_failures(self) -> None:
        """Refresh the FAILED status of each failure that stands; forget the others."""
        for name, failed in list(self._failed.items()):
            if self.failed_recently(name):
                failed.status.updated_ms = now_ms()
                await put_status(self._kv, failed.status)
                continue
            if self._failed.pop(name, None) is None:
                continue  # forgotten meanwhile
            if not self.serves(name):  # not loaded here since: its key is the FAILED status alone
                await self._forget([name])

    def serves(self, name: str) -> bool:
        """Whether a model or an adapter of that name is held here."""
        return name in self.servers or any(name in s.adapters for s in self.servers.values())

    # -- status ------------------------------------------------------------------------------

    async def report(self) -> None:
        """Every held model's status, and every standing failure's."""
        for name, server in list(self.servers.items()):
            if self.servers.get(name) is server:  # not unloaded meanwhile
                await server.report(self._kv, self._metrics_url)
        await self._report_failures()

    # -- following the deployments -----------------------------------------------------------

    async def unload_stale(self) -> None:
        """Drain models that were undeployed or whose deployment changed."""
        if not self.directory.loaded.is_set():
            return
        for name, server in list(self.servers.items()):
            if not server.ready:
                continue
            current = self.directory.get(name)
            if current is None:
                await self.unload(name, "undeployed")
            elif current != server.spec:
                await self.unload(name, "its deployment changed")
                if server.pinned:
                    await self.load(current, pinned=True)

    async def follow_adapters(self) -> None:
        """Serve every LoRA deployment whose base is loaded here; stop serving removed ones."""
        if not self.directory.loaded.is_set():
            return
        wanted = {s.name: s for s in self.directory.all() if s.base}
        for server in self.servers.values():
            if not server.ready:
                continue
            for name, feed in list(server.adapters.items()):
                if wanted.get(name) != feed.spec:
                    await server.detach(name)
                    await self._forget([name])
            for spec in wanted.values():
                if spec.base != server.spec.name or spec.name in server.adapters:
                    continue
                if self.failed_recently(spec.name):
                    continue
                try:
                    await server.attach(spec)
                except ModelLoadError as err:
                    await self.remember_failure(spec, err)
                    continue
                # Its status replaces a FAILED one at once, not at the next report.
                self._failed.pop(spec.name, None)
                await server.report(self._kv, self._metrics_url)
