"""The worker sidecar: owns the NATS connection, pulling, deadlines, acks, cancels and status.

The fill loop keeps one pull request outstanding for as many items as the task's scheduler
has room for (the next embedding batch, or free decode slots), so work arrives while the
runtime runs. The scheduler (embedding_scheduler, generation_scheduler) turns items into
runtime calls and answers them. A message is acked only after its result is published; an
unacked message is redelivered to another worker, so a worker that dies loses nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from concurrent.futures import ThreadPoolExecutor

import nats.js.errors
from nats.aio.msg import Msg
from nats.js.kv import KeyValue
from prometheus_client import start_http_server

from shoal.broker.connection import connect
from shoal.broker.jetstream import (
    ensure_model_consumer,
    ensure_models_kv,
    ensure_work_stream,
    ensure_workers_kv,
)
from shoal.broker.puller import Puller
from shoal.config import WorkerSettings
from shoal.observability.metrics import BusyMeter, WorkerMetrics
from shoal.protocol import (
    WORK_STREAM,
    ModelSpec,
    Task,
    WorkerState,
    WorkerStatus,
    cancel_subject,
    encode_json,
    name_token,
    now_ms,
)
from shoal.runtimes import load_runtime
from shoal.worker.batching import WorkItem
from shoal.worker.embedding_scheduler import EmbeddingScheduler
from shoal.worker.embeddings import EmbeddingsHandler
from shoal.worker.generation_scheduler import GenerationScheduler
from shoal.worker.outbox import Outbox
from shoal.worker.scheduler import Scheduler, SchedulerContext

log = logging.getLogger(__name__)

STATUS_INTERVAL_S = 1.0


async def register_model(kv: KeyValue, spec: ModelSpec) -> None:
    """Make the model known to gateways, unless a deployment of that name exists already."""
    with contextlib.suppress(nats.js.errors.KeyWrongLastSequenceError):
        await kv.create(name_token(spec.name), encode_json(spec))


class ModelLoadError(RuntimeError):
    """The worker's model could not be loaded: a clear message, no traceback needed."""


class WorkerSidecar:
    """One worker process serving one model. `run()` returns after a graceful drain."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.spec = settings.model
        self.worker_id = f"{name_token(socket.gethostname())}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._stopping = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="shoal-runtime")
        self._busy = BusyMeter()
        self._state = WorkerState.LOADING
        self._simulated = self.spec.runtime == "sim"
        self._metrics = WorkerMetrics(self.spec.name, self.spec.runtime, self._simulated)
        self._metrics_url = ""
        self._scheduler: Scheduler | None = None
        self._slots = 0
        self._ctx: SchedulerContext | None = None

    def request_stop(self) -> None:
        """Begin a graceful drain: stop pulling, finish and ack what is held, then exit."""
        self._stopping.set()

    async def run(self) -> None:
        settings = self.settings
        nc = await connect(settings.nats_url, name=f"shoal-worker-{self.worker_id}")
        js = nc.jetstream()
        await ensure_work_stream(js, settings.queue)
        consumer = await ensure_model_consumer(js, self.spec.name, settings.queue)
        workers_kv = await ensure_workers_kv(js)
        metrics_server, _ = start_http_server(
            settings.metrics_port, settings.metrics_host, registry=self._metrics.registry
        )
        self._metrics_url = f"http://{settings.metrics_host}:{metrics_server.server_port}/metrics"
        self._ctx = SchedulerContext(
            settings, Outbox(nc, self._metrics), self._executor, self._metrics, self._busy
        )
        status_task = asyncio.create_task(self._report_status(workers_kv))
        loop = asyncio.get_running_loop()
        try:
            runtime = await loop.run_in_executor(self._executor, load_runtime, self.spec)
        except Exception as err:
            status_task.cancel()
            with contextlib.suppress(Exception):
                await workers_kv.delete(self.worker_id)
            await nc.close()
            metrics_server.shutdown()
            raise ModelLoadError(
                f"cannot load {self.spec.name} on {self.spec.runtime}: {err}"
            ) from err
        self._simulated = runtime.simulated
        scheduler = self._scheduler = self._make_scheduler(runtime)
        # Only a model that loaded becomes known to gateways: a bad spec is never deployed.
        await register_model(await ensure_models_kv(js), self.spec)
        cancels = await nc.subscribe(cancel_subject(self.spec.name), cb=self._on_cancel)
        puller = Puller(nc, WORK_STREAM, consumer, self._on_message)
        await puller.start()
        self._state = WorkerState.READY
        log.info("worker %s ready for %s (%s)", self.worker_id, self.spec.name, self.spec.runtime)
        fill_task = asyncio.create_task(self._fill(puller))
        run_task = asyncio.create_task(scheduler.run())
        keepalive_task = asyncio.create_task(self._keep_alive())
        await self._stopping.wait()

        self._state = WorkerState.DRAINING
        await fill_task  # ends when its outstanding pull request ends (at most poll_s)
        scheduler.stop_accepting()
        await run_task  # answers and acks everything pulled
        keepalive_task.cancel()
        await puller.stop()
        await cancels.unsubscribe()
        status_task.cancel()
        with contextlib.suppress(Exception):
            await workers_kv.delete(self.worker_id)
        await nc.flush()
        await nc.close()
        metrics_server.shutdown()
        runtime.close()
        self._executor.shutdown()
        log.info("worker %s drained and stopped", self.worker_id)

    def _make_scheduler(self, runtime) -> Scheduler:
        assert self._ctx is not None
        if self.spec.task is Task.GENERATE:
            self._slots = runtime.max_sequences
            return GenerationScheduler(self._ctx, runtime)
        return EmbeddingScheduler(self._ctx, EmbeddingsHandler(runtime, self.spec.name))

    def _on_message(self, msg: Msg) -> None:
        assert self._scheduler is not None
        self._scheduler.accept(WorkItem.from_msg(msg))

    async def _on_cancel(self, msg: Msg) -> None:
        if self._scheduler is not None:
            self._scheduler.cancel(msg.data.decode(errors="replace"))

    async def _fill(self, puller: Puller) -> None:
        assert self._scheduler is not None and self._ctx is not None
        room_changed = self._ctx.room_changed
        while not self._stopping.is_set():
            room = self._scheduler.room()
            if room <= 0:
                room_changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(room_changed.wait(), self.settings.poll_s)
                continue
            try:
                await puller.pull(room, self.settings.poll_s)
            except Exception as err:  # a reconnect in progress: try again shortly
                log.warning("pull failed: %s", err)
                await asyncio.sleep(0.2)

    async def _keep_alive(self) -> None:
        """In-progress acks for everything held, so JetStream does not redeliver running work."""
        interval = max(0.2, self.settings.queue.ack_wait_s / 3)
        while True:
            await asyncio.sleep(interval)
            held = self._scheduler.held() if self._scheduler is not None else []
            for item in held:
                with contextlib.suppress(Exception):
                    await item.msg.in_progress()

    async def _report_status(self, kv: KeyValue) -> None:
        assert self._ctx is not None
        counters = self._ctx.counters
        while True:
            busy = self._busy.fraction()
            self._metrics.busy_fraction.set(busy)
            status = WorkerStatus(
                worker_id=self.worker_id,
                model=self.spec.name,
                runtime=self.spec.runtime,
                simulated=self._simulated,
                pid=os.getpid(),
                state=self._state,
                metrics_url=self._metrics_url,
                items_done=counters.items_done,
                redelivered=counters.redelivered,
                batches=counters.batches,
                max_batch_items=counters.max_batch_items,
                slots=self._slots,
                running_sequences=counters.running_sequences,
                max_running_sequences=counters.max_running_sequences,
                tokens_generated=counters.tokens_generated,
                cancelled=counters.cancelled,
                busy_fraction=round(busy, 4),
                updated_ms=now_ms(),
            )
            try:
                await kv.put(self.worker_id, encode_json(status))
            except Exception as err:
                log.debug("status report failed: %s", err)
            await asyncio.sleep(STATUS_INTERVAL_S)
