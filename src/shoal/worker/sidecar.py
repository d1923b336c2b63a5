"""The worker sidecar: one process, its NATS connection, its metrics server, its life cycle.

The models it holds are `Holdings` (worker/holdings.py), each a `ModelServer` with its own
pull loop, scheduler and runtime thread. The sidecar starts the models it was given (pinned:
kept for the life of the process), reports every model's status once a second, follows the
deployments, and, as a fleet worker (`--fleet`), places models by pulling (worker/placer.py).
On SIGTERM it drains every model and exits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import socket
import uuid

import nats.errors
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import Metric

from shoal.broker.connection import connect
from shoal.broker.jetstream import ensure_work_stream
from shoal.config import WorkerSettings
from shoal.protocol import ModelSpec, name_token
from shoal.state.deployments import ModelDirectory, read_deployment, register_model
from shoal.state.workers import ensure_workers_kv
from shoal.worker.holdings import Holdings
from shoal.worker.model_server import ModelLoadError, ModelServer
from shoal.worker.placer import Placer

log = logging.getLogger(__name__)

STATUS_INTERVAL_S = 1.0
# A scrape waits this long for the event loop to flush the models' counts (`_ModelsCollector`).
FLUSH_WAIT_S = 1.0

__all__ = ["ModelLoadError", "WorkerSidecar"]


class WorkerSidecar:
    """One worker process. `run()` returns after a graceful drain of every model."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.worker_id = f"{name_token(socket.gethostname())}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.servers: dict[str, ModelServer] = {}  # the holdings' servers, once connected
        self._stopping = asyncio.Event()
        self._directory = ModelDirectory()

    def request_stop(self) -> None:
        """Begin a graceful drain: stop pulling, finish and ack what is held, then exit."""
        self._stopping.set()

    async def run(self) -> None:
        settings = self.settings
        nc = await connect(
            settings.nats_url, name=f"shoal-worker-{self.worker_id}", auth=settings.nats_auth
        )
        js = nc.jetstream()
        await ensure_work_stream(js, settings.queue)
        registry = CollectorRegistry()
        registry.register(_ModelsCollector(self.servers, asyncio.get_running_loop()))
        metrics_server, _ = start_http_server(
            settings.metrics_port, settings.metrics_host, registry=registry
        )
        metrics_url = f"http://{settings.metrics_host}:{metrics_server.server_port}/metrics"
        holdings = Holdings(
            nc, self.worker_id, settings, self._directory, await ensure_workers_kv(js), metrics_url
        )
        holdings.servers = self.servers
        status_task = asyncio.create_task(_report_status(holdings))
        try:
            for spec in [*settings.models, *await self._deployed_specs(js)]:
                await holdings.load(spec, pinned=True)
                # Only a model that loaded becomes known to gateways: a bad spec never is.
                await _register(js, spec)
        except ModelLoadError:
            status_task.cancel()
            await holdings.drain_all()
            await nc.close()
            metrics_server.shutdown()
            raise
        await self._directory.start(js)
        log.info("worker %s ready (%s)", self.worker_id, ", ".join(self.servers) or "fleet")
        follow_task = asyncio.create_task(
            _follow_deployments(holdings, Placer(holdings, js) if settings.fleet else None)
        )
        await self._stopping.wait()

        follow_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follow_task
        await holdings.drain_all()
        status_task.cancel()
        await self._directory.stop()
        await nc.flush()
        await nc.close()
        metrics_server.shutdown()
        log.info("worker %s drained and stopped", self.worker_id)

    async def _deployed_specs(self, js) -> list[ModelSpec]:
        specs = []
        for name in self.settings.deployed_models:
            spec = await read_deployment(js, name)
            if spec is None:
                raise ModelLoadError(
                    f"no deployment named {name!r}: deploy it (shoal deploy) or give --runtime"
                )
            specs.append(spec)
        return specs


async def _register(js, spec: ModelSpec) -> None:
    """Register a model this worker was started with, unless it is deployed already.

    Looking first matters: a worker's NATS role may read deployments but not write them (only
    `shoal deploy` and the admin API do), and `shoal up` deploys before it starts workers. A
    worker that may not write goes on serving; gateways know its model once it is deployed.
    """
    if await read_deployment(js, spec.name) is not None:
        return
    try:
        await register_model(js, spec)
    except (nats.errors.Error, TimeoutError) as err:  # refused: a publish without permission
        log.warning(
            "cannot register model %s (%s): deploy it with `shoal deploy` to route to it",
            spec.name,
            err,
        )


async def _follow_deployments(holdings: Holdings, placer: Placer | None) -> None:
    interval = holdings.settings.placement_interval_s
    while True:
        await asyncio.sleep(interval)
        try:
            await holdings.unload_stale()
            await holdings.follow_adapters()
            if placer is not None:
                await placer.step()
        except asyncio.CancelledError:
            raise
        except ModelLoadError as err:
            log.warning("%s", err)
        except Exception:
            log.exception("placement step failed")


async def _report_status(holdings: Holdings) -> None:
    while True:
        await holdings.report()
        await asyncio.sleep(STATUS_INTERVAL_S)


class _ModelsCollector:
    """The metrics of every loaded model, served from the process's one /metrics.

    prometheus_client serves the scrape on a thread of its own, while the models count on the
    event loop without locks (`WorkerMetrics`): the scrape asks the loop to flush the counts
    and waits for it (at most `FLUSH_WAIT_S`; past that, or once the loop has stopped, it
    reads what was flushed before).
    """

    def __init__(self, servers: dict[str, ModelServer], loop: asyncio.AbstractEventLoop) -> None:
        self._servers = servers
        self._loop = loop

    def collect(self):
        self._flush_on_loop()
        families: dict[str, Metric] = {}
        for server in list(self._servers.values()):
            for family in server.metrics.registry.collect():
                merged = families.get(family.name)
                if merged is None:
                    families[family.name] = family
                else:
                    merged.samples.extend(family.samples)
        yield from families.values()

    def _flush_on_loop(self) -> None:
        flushed: concurrent.futures.Future[None] = concurrent.futures.Future()

        def flush() -> None:
            for server in list(self._servers.values()):
                server.metrics.flush()
            flushed.set_result(None)

        # RuntimeError: the loop is closed; TimeoutError: it was busy past the wait.
        with contextlib.suppress(RuntimeError, TimeoutError):
            self._loop.call_soon_threadsafe(flush)
            flushed.result(timeout=FLUSH_WAIT_S)
