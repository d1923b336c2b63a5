"""The worker sidecar: owns the NATS connection, pulling, batching, deadlines, acks and status.

Two loops share a buffer of pulled items. The fill loop keeps one pull request outstanding
for as many items as the next batch has room for, so while the runtime executes one batch the
next one is already arriving (the runtime never waits for the network). The run loop takes a
batch from the buffer within the item and token budgets and runs it in the executor thread.
A message is acked only after its result is published; an unacked message is redelivered to
another worker, so a worker that dies loses nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import nats.js.errors
from nats.aio.client import Client
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
from shoal.errors import ApiError
from shoal.observability.metrics import BusyMeter, WorkerMetrics
from shoal.protocol import (
    WORK_STREAM,
    Header,
    ModelSpec,
    WorkerState,
    WorkerStatus,
    encode_json,
    name_token,
    now_ms,
)
from shoal.runtimes import load_runtime
from shoal.worker.batching import WorkItem, take_batch
from shoal.worker.embeddings import EmbeddingsHandler, Reply

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
        self._pending: deque[WorkItem] = deque()
        self._running: list[WorkItem] = []
        self._arrived = asyncio.Event()
        self._room = asyncio.Event()
        self._stopping = asyncio.Event()
        self._filling = True
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="shoal-runtime")
        self._busy = BusyMeter()
        self._state = WorkerState.LOADING
        self._simulated = self.spec.runtime == "sim"
        self._metrics = WorkerMetrics(self.spec.name, self.spec.runtime, self._simulated)
        self._metrics_url = ""
        self._items_done = 0
        self._redelivered = 0
        self._batches = 0
        self._max_batch_items = 0

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
        # Only a model that loaded becomes known to gateways: a bad spec is never deployed.
        await register_model(await ensure_models_kv(js), self.spec)
        handler = EmbeddingsHandler(runtime, self.spec.name)
        puller = Puller(nc, WORK_STREAM, consumer, self._on_message)
        await puller.start()
        self._state = WorkerState.READY
        log.info("worker %s ready for %s (%s)", self.worker_id, self.spec.name, self.spec.runtime)
        fill_task = asyncio.create_task(self._fill(puller))
        run_task = asyncio.create_task(self._run_batches(nc, handler))
        keepalive_task = asyncio.create_task(self._keep_alive())
        await self._stopping.wait()

        self._state = WorkerState.DRAINING
        await fill_task  # ends when its outstanding pull request ends (at most poll_s)
        self._filling = False
        self._arrived.set()
        await run_task  # runs and acks everything pulled
        keepalive_task.cancel()
        await puller.stop()
        status_task.cancel()
        with contextlib.suppress(Exception):
            await workers_kv.delete(self.worker_id)
        await nc.flush()
        await nc.close()
        metrics_server.shutdown()
        runtime.close()
        self._executor.shutdown()
        log.info("worker %s drained and stopped", self.worker_id)

    def _on_message(self, msg: Msg) -> None:
        self._pending.append(WorkItem.from_msg(msg))
        self._arrived.set()

    async def _fill(self, puller: Puller) -> None:
        budget = self.settings.max_batch_items
        while not self._stopping.is_set():
            room = budget - len(self._pending)
            if room <= 0:
                self._room.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._room.wait(), self.settings.poll_s)
                continue
            try:
                await puller.pull(room, self.settings.poll_s)
            except Exception as err:  # a reconnect in progress: try again shortly
                log.warning("pull failed: %s", err)
                await asyncio.sleep(0.2)

    async def _run_batches(self, nc: Client, handler: EmbeddingsHandler) -> None:
        settings = self.settings
        while True:
            if not self._pending:
                if not self._filling:
                    return
                self._arrived.clear()
                await self._arrived.wait()
                continue
            batch = take_batch(self._pending, settings.max_batch_items, settings.max_batch_tokens)
            self._room.set()
            try:
                await self._run_batch(nc, handler, batch)
            except Exception:
                # Unacked items are redelivered after ack_wait; nothing is lost.
                log.exception("batch of %d failed", len(batch))

    async def _run_batch(
        self, nc: Client, handler: EmbeddingsHandler, batch: list[WorkItem]
    ) -> None:
        now = now_ms()
        live: list[WorkItem] = []
        for item in batch:
            if item.deadline_ms and item.deadline_ms <= now:
                error = ApiError(504, "The request's deadline passed before it was run")
                await self._reply(nc, item, Reply.from_error(error))
            else:
                live.append(item)
                self._metrics.queue_wait.observe(max(0, now - item.sent_ms) / 1000)
        if live:
            self._running = live
            self._busy.start()
            try:
                outcome = await asyncio.get_running_loop().run_in_executor(
                    self._executor, handler.handle, [item.body for item in live]
                )
            finally:
                busy_s = self._busy.stop()
            self._metrics.busy_seconds.inc(busy_s)
            self._metrics.batch_seconds.observe(busy_s)
            self._metrics.batch_items.observe(len(live))
            self._batches += 1
            self._max_batch_items = max(self._max_batch_items, len(live))
            for item, reply in zip(live, outcome.replies, strict=True):
                await self._reply(nc, item, reply)
        # Same connection, so each ack leaves after the result it follows.
        for item in batch:
            with contextlib.suppress(nats.errors.MsgAlreadyAckdError):
                await item.msg.ack()
        self._running = []
        self._items_done += len(batch)
        self._redelivered += sum(1 for item in batch if item.deliveries > 1)

    async def _reply(self, nc: Client, item: WorkItem, reply: Reply) -> None:
        self._metrics.count_item(reply.status)
        if not item.reply_to:
            log.warning("work item %s has no reply subject; dropped", item.request_id)
            return
        headers = {Header.REQUEST_ID: item.request_id, Header.STATUS: str(reply.status)}
        await nc.publish(item.reply_to, reply.body, headers=headers)

    async def _keep_alive(self) -> None:
        """In-progress acks for everything held, so JetStream does not redeliver running work."""
        interval = max(0.2, self.settings.queue.ack_wait_s / 3)
        while True:
            await asyncio.sleep(interval)
            for item in [*self._running, *self._pending]:
                with contextlib.suppress(Exception):
                    await item.msg.in_progress()

    async def _report_status(self, kv: KeyValue) -> None:
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
                items_done=self._items_done,
                redelivered=self._redelivered,
                batches=self._batches,
                max_batch_items=self._max_batch_items,
                busy_fraction=round(busy, 4),
                updated_ms=now_ms(),
            )
            try:
                await kv.put(self.worker_id, encode_json(status))
            except Exception as err:
                log.debug("status report failed: %s", err)
            await asyncio.sleep(STATUS_INTERVAL_S)
