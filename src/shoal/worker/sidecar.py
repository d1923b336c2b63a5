"""The worker sidecar: one process, its NATS connection, and the models it has loaded.

Each loaded model is a `ModelServer` (worker/model_server.py) with its own pull loop,
scheduler and runtime thread. The sidecar starts the models it was given (pinned: kept for
the life of the process), reports every model's status once a second, follows the
deployments (a model that is undeployed or changed is drained and unloaded), and, as a fleet
worker (`--fleet`), places models by pulling (worker/placement.py): it loads deployed models
with a backlog nobody serves, evicts least recently used idle ones when its memory budget is
full, and unloads models idle for long (scale to zero).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import time
import uuid
from dataclasses import dataclass

import nats.js.errors
from nats.aio.client import Client
from nats.js.kv import KeyValue
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import Metric

from shoal.broker.connection import connect
from shoal.broker.jetstream import (
    ensure_model_consumer,
    ensure_models_kv,
    ensure_work_stream,
    ensure_workers_kv,
    read_backlog,
)
from shoal.config import WorkerSettings
from shoal.deployments import ModelDirectory
from shoal.observability.fleet import read_worker_statuses
from shoal.protocol import (
    ModelSpec,
    WorkerState,
    WorkerStatus,
    decode_model_spec,
    encode_json,
    name_token,
    now_ms,
    worker_status_key,
)
from shoal.worker.model_server import ModelLoadError, ModelServer
from shoal.worker.placement import (
    BacklogHistory,
    Resident,
    estimate_memory_mb,
    evictions,
    models_to_load,
)

log = logging.getLogger(__name__)

STATUS_INTERVAL_S = 1.0
RETRY_FAILED_S = 60.0  # a model or adapter that failed to load here is not tried sooner

__all__ = ["ModelLoadError", "WorkerSidecar", "register_model"]


async def register_model(kv: KeyValue, spec: ModelSpec) -> None:
    """Make the model known to gateways, unless a deployment of that name exists already."""
    with contextlib.suppress(nats.js.errors.KeyWrongLastSequenceError):
        await kv.create(name_token(spec.name), encode_json(spec))


class WorkerSidecar:
    """One worker process. `run()` returns after a graceful drain of every model."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.worker_id = f"{name_token(socket.gethostname())}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.servers: dict[str, ModelServer] = {}
        self._stopping = asyncio.Event()
        self._directory = ModelDirectory()
        self._history = BacklogHistory()
        self._measured_mb: dict[str, float] = {}
        # Models and adapters that failed to load here, by name, reported while they stand.
        self._failed_loads: dict[str, _FailedLoad] = {}
        self._metrics_url = ""
        self._nc: Client | None = None
        self._workers_kv: KeyValue | None = None

    def request_stop(self) -> None:
        """Begin a graceful drain: stop pulling, finish and ack what is held, then exit."""
        self._stopping.set()

    async def run(self) -> None:
        settings = self.settings
        nc = self._nc = await connect(settings.nats_url, name=f"shoal-worker-{self.worker_id}")
        js = nc.jetstream()
        await ensure_work_stream(js, settings.queue)
        self._workers_kv = await ensure_workers_kv(js)
        models_kv = await ensure_models_kv(js)
        registry = CollectorRegistry()
        registry.register(_ModelsCollector(self.servers))
        metrics_server, _ = start_http_server(
            settings.metrics_port, settings.metrics_host, registry=registry
        )
        self._metrics_url = f"http://{settings.metrics_host}:{metrics_server.server_port}/metrics"
        status_task = asyncio.create_task(self._report_status())
        try:
            for spec in [*settings.models, *await self._deployed_specs(models_kv)]:
                await self._load(spec, pinned=True)
                # Only a model that loaded becomes known to gateways: a bad spec never is.
                await register_model(models_kv, spec)
        except ModelLoadError:
            status_task.cancel()
            await self._drain_all()
            await nc.close()
            metrics_server.shutdown()
            raise
        await self._directory.start(models_kv)
        log.info("worker %s ready (%s)", self.worker_id, ", ".join(self.servers) or "fleet")
        placement_task = asyncio.create_task(self._follow_deployments())
        await self._stopping.wait()

        placement_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await placement_task
        await self._drain_all()
        status_task.cancel()
        await self._forget_status([failed.key for failed in self._failed_loads.values()])
        await self._directory.stop()
        await nc.flush()
        await nc.close()
        metrics_server.shutdown()
        log.info("worker %s drained and stopped", self.worker_id)

    async def _deployed_specs(self, kv: KeyValue) -> list[ModelSpec]:
        specs = []
        for name in self.settings.deployed_models:
            try:
                entry = await kv.get(name_token(name))
            except nats.js.errors.KeyNotFoundError:
                entry = None
            if entry is None or not entry.value:
                raise ModelLoadError(
                    f"no deployment named {name!r}: deploy it (shoal deploy) or give --runtime"
                )
            specs.append(decode_model_spec(entry.value))
        return specs

    # -- loading and unloading ---------------------------------------------------------------

    async def _load(self, spec: ModelSpec, *, pinned: bool) -> ModelServer:
        return await self._finish_load(await self._announce(spec, pinned=pinned))

    async def _announce(self, spec: ModelSpec, *, pinned: bool) -> ModelServer:
        """Report the model as loading here, so other workers leave it to this one."""
        assert self._nc is not None and self._workers_kv is not None
        server = ModelServer(self._nc, self.worker_id, spec, self.settings, pinned=pinned)
        self.servers[spec.name] = server
        await server.report(self._workers_kv, self._metrics_url)
        return server

    async def _finish_load(self, server: ModelServer) -> ModelServer:
        assert self._workers_kv is not None
        spec = server.spec
        try:
            await server.load()
        except ModelLoadError:
            del self.servers[spec.name]
            await self._forget_status(server.status_keys())
            raise
        # Memory freed by an earlier unload stays with the process, so a reload can measure
        # next to nothing: the first (largest) measurement stands.
        server.memory_mb = max(server.memory_mb, self._measured_mb.get(spec.name, 0.0))
        self._measured_mb[spec.name] = server.memory_mb
        self._failed_loads.pop(spec.name, None)  # its READY status replaces a FAILED one
        await server.report(self._workers_kv, self._metrics_url)
        return server

    async def _unload(self, name: str, reason: str) -> None:
        server = self.servers.get(name)
        if server is None:
            return
        log.info("unloading %s: %s", name, reason)
        keys = server.status_keys()
        await server.drain()
        del self.servers[name]
        await self._forget_status(keys)

    async def _drain_all(self) -> None:
        await asyncio.gather(*(self._unload(name, "stopping") for name in list(self.servers)))

    async def _forget_status(self, keys: list[str]) -> None:
        assert self._workers_kv is not None
        for key in keys:
            with contextlib.suppress(Exception):
                await self._workers_kv.delete(key)

    # -- following the deployments, placing by pulling ---------------------------------------

    async def _follow_deployments(self) -> None:
        settings = self.settings
        while True:
            await asyncio.sleep(settings.placement_interval_s)
            try:
                await self._unload_stale()
                await self._follow_adapters()
                if settings.fleet:
                    await self._unload_idle()
                    await self._place()
            except asyncio.CancelledError:
                raise
            except ModelLoadError as err:
                log.warning("%s", err)
            except Exception:
                log.exception("placement step failed")

    async def _unload_stale(self) -> None:
        """Drain models that were undeployed or whose deployment changed."""
        if not self._directory.loaded.is_set():
            return
        for name, server in list(self.servers.items()):
            if not server.ready:
                continue
            current = self._directory.get(name)
            if current is None:
                await self._unload(name, "undeployed")
            elif current != server.spec:
                await self._unload(name, "its deployment changed")
                if server.pinned:
                    await self._load(current, pinned=True)

    async def _follow_adapters(self) -> None:
        """Serve every LoRA deployment whose base is loaded here; stop serving removed ones."""
        assert self._workers_kv is not None
        if not self._directory.loaded.is_set():
            return
        wanted = {s.name: s for s in self._directory.all() if s.base}
        for server in self.servers.values():
            if not server.ready:
                continue
            for name, feed in list(server.adapters.items()):
                if wanted.get(name) != feed.spec:
                    await server.detach(name)
                    await self._forget_status([worker_status_key(self.worker_id, name)])
            for spec in wanted.values():
                if spec.base != server.spec.name or spec.name in server.adapters:
                    continue
                if self._failed_recently(spec.name):
                    continue
                try:
                    await server.attach(spec)
                except ModelLoadError as err:
                    await self._remember_failure(spec, err)
                    continue
                # Its status replaces a FAILED one at once, not at the next report.
                self._failed_loads.pop(spec.name, None)
                await server.report(self._workers_kv, self._metrics_url)

    async def _unload_idle(self) -> None:
        limit = self.settings.idle_unload_s
        if limit <= 0:
            return
        for name, server in list(self.servers.items()):
            if not server.pinned and server.ready and server.idle_s() >= limit:
                await self._unload(name, f"no work for {limit:g} s")

    async def _place(self) -> None:
        assert self._nc is not None
        js = self._nc.jetstream()
        everything = self._directory.all()
        # An adapter is served by its base's workers: its backlog counts as the base's.
        deployed = [s for s in everything if not s.base and not self._failed_recently(s.name)]
        self._history.forget({spec.name for spec in deployed})
        backlog: dict[str, int] = {}
        for spec in everything:
            target = spec.base or spec.name
            if target not in self.servers:
                backlog[target] = backlog.get(target, 0) + await self._backlog(js, spec)
        for name, pending in backlog.items():
            self._history.record(name, pending)
        if not any(backlog.values()):
            return
        holders = await self._holders()
        for spec in models_to_load(deployed, set(self.servers), backlog, holders, self._history):
            if holders.get(spec.name, 0) == 0 and not await self._still_unserved(spec.name):
                continue  # another worker took it while we waited our turn
            # Announced before evicting anything: a worker that looks now sees it taken.
            server = await self._announce(spec, pinned=False)
            if await self._make_room(spec, holders):
                try:
                    await self._finish_load(server)
                except ModelLoadError as err:
                    await self._remember_failure(spec, err)
                return  # one load per step: the next step sees the fleet anew
            del self.servers[spec.name]
            await self._forget_status(server.status_keys())

    def _failed_recently(self, name: str) -> bool:
        """True while a load of this deployment failed here less than RETRY_FAILED_S ago.

        A deploy of the same name (a new KV revision) is tried at once.
        """
        failed = self._failed_loads.get(name)
        return failed is not None and (
            failed.revision == self._directory.revision(name)
            and time.monotonic() - failed.when < RETRY_FAILED_S
        )

    async def _remember_failure(self, spec: ModelSpec, err: ModelLoadError) -> None:
        # Not every 0.5 s: a broken model would be loaded again and again, and logged as often.
        # Its FAILED status tells `shoal models` why the deployment is not served.
        log.error("%s (tried again in %.0f s, or when deployed again)", err, RETRY_FAILED_S)
        status = WorkerStatus(
            worker_id=self.worker_id,
            model=spec.name,
            runtime=spec.runtime,
            simulated=spec.runtime == "sim",
            pid=os.getpid(),
            state=WorkerState.FAILED,
            metrics_url=self._metrics_url,
            pinned=False,
            error=str(err),
        )
        self._failed_loads[spec.name] = _FailedLoad(
            self._directory.revision(spec.name),
            time.monotonic(),
            worker_status_key(self.worker_id, spec.name),
            status,
        )
        await self._report_failures()

    async def _report_failures(self) -> None:
        """Refresh the FAILED status of each failure that stands; forget the others."""
        assert self._workers_kv is not None
        for name, failed in list(self._failed_loads.items()):
            if self._failed_recently(name):
                failed.status.updated_ms = now_ms()
                with contextlib.suppress(Exception):
                    await self._workers_kv.put(failed.key, encode_json(failed.status))
                continue
            if self._failed_loads.pop(name, None) is None:
                continue  # forgotten meanwhile
            served = name in self.servers or any(name in s.adapters for s in self.servers.values())
            if not served:  # not loaded here since: its key is the FAILED status alone
                await self._forget_status([failed.key])

    async def _backlog(self, js, spec: ModelSpec) -> int:
        pending = await read_backlog(js, spec.name)
        if pending is None:  # deployed by an older component: make its consumer now
            await ensure_model_consumer(js, spec.name, self.settings.queue)
            return 0
        return pending

    async def _holders(self) -> dict[str, int]:
        """How many other workers hold (or are loading) each model."""
        assert self._nc is not None
        counts: dict[str, int] = {}
        for status in await read_worker_statuses(self._nc.jetstream()):
            if status.worker_id != self.worker_id and status.state in (
                WorkerState.LOADING,
                WorkerState.READY,
            ):
                counts[status.model] = counts.get(status.model, 0) + 1
        return counts

    async def _still_unserved(self, model: str) -> bool:
        # Idle workers that see the same backlog at the same moment would all load the
        # model: each waits a random moment (longer the more it holds) and looks again.
        await asyncio.sleep(random.uniform(0.0, 0.4) + 0.2 * len(self.servers))
        return (await self._holders()).get(model, 0) == 0

    async def _make_room(self, spec: ModelSpec, holders: dict[str, int]) -> bool:
        need = estimate_memory_mb(spec, self._measured_mb)
        now = time.monotonic()
        residents = [
            Resident(
                name, s.memory_mb, s.idle_s(), now - s.loaded_at, s.pinned, holders.get(name, 0)
            )
            for name, s in self.servers.items()
            if s.ready
        ]
        settings = self.settings
        chosen = evictions(residents, need, settings.memory_budget_mb, settings.min_residency_s)
        if chosen is None:
            log.debug("no room for %s (%.0f MB)", spec.name, need)
            return False
        for name in chosen:
            await self._unload(name, f"evicted (least recently used) to load {spec.name}")
        return True

    # -- status ------------------------------------------------------------------------------

    async def _report_status(self) -> None:
        assert self._workers_kv is not None
        while True:
            for name, server in list(self.servers.items()):
                if self.servers.get(name) is server:  # not unloaded meanwhile
                    await server.report(self._workers_kv, self._metrics_url)
            await self._report_failures()
            await asyncio.sleep(STATUS_INTERVAL_S)


@dataclass(slots=True)
class _FailedLoad:
    """A model or adapter that failed to load here, and the status that says so."""

    revision: int  # of the deployment that failed
    when: float  # time.monotonic()
    key: str  # in the workers KV bucket
    status: WorkerStatus


class _ModelsCollector:
    """The metrics of every loaded model, served from the process's one /metrics."""

    def __init__(self, servers: dict[str, ModelServer]) -> None:
        self._servers = servers

    def collect(self):
        families: dict[str, Metric] = {}
        for server in list(self._servers.values()):
            for family in server.metrics.registry.collect():
                merged = families.get(family.name)
                if merged is None:
                    families[family.name] = family
                else:
                    merged.samples.extend(family.samples)
        yield from families.values()
