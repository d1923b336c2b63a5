"""One model loaded in a worker process: its runtime, scheduler, pull loop and status.

A worker process holds one or more of these (placement by pulling loads and unloads them).
Each pulls only from its own model's consumer, for as many items as its scheduler has room
for, runs them on its runtime in its own executor thread, and reports itself in the workers
KV bucket under `<worker id>.<model token>`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.kv import KeyValue

from shoal.api.errors import ApiError
from shoal.broker.bodies import BodyMissingError
from shoal.broker.jetstream import ensure_model_consumer
from shoal.broker.puller import Puller
from shoal.config import WorkerSettings
from shoal.observability.metrics import BusyMeter, WorkerMetrics
from shoal.protocol import (
    WORK_STREAM,
    ModelSpec,
    Task,
    WorkEnvelope,
    cancel_subject,
    decode_cancels,
    decode_envelope,
    now_ms,
)
from shoal.runtimes.base import AdapterHost
from shoal.runtimes.registry import is_simulated, load_runtime, runtime_record
from shoal.state.attempts import ensure_attempts_kv
from shoal.state.workers import WorkerState, WorkerStatus, put_status
from shoal.worker.items import (
    RUN_ALONE_FROM_DELIVERY,
    Reply,
    WorkItem,
    WorkMessage,
    ack_fields,
)
from shoal.worker.outbox import Outbox
from shoal.worker.poison import AttemptRecorder, DeadLetterer
from shoal.worker.profiling import BatchBudget, ProfileAudit, reprofile, tuned_budget
from shoal.worker.pull_sizing import RecentMessages
from shoal.worker.schedulers.base import Scheduler, SchedulerContext
from shoal.worker.schedulers.batch import BatchScheduler, batch_handler
from shoal.worker.schedulers.continuous import ContinuousScheduler

log = logging.getLogger(__name__)


class ModelLoadError(RuntimeError):
    """The model could not be loaded: a clear message, no traceback needed."""


@dataclass
class _AdapterFeed:
    """A LoRA deployment served by this model: its own queue, pulled into the same batches."""

    spec: ModelSpec
    puller: Puller
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    fill: asyncio.Task[None] | None = None


class ModelServer:
    """Serves one model inside a worker process, from load to drained unload."""

    def __init__(
        self,
        nc: Client,
        worker_id: str,
        spec: ModelSpec,
        settings: WorkerSettings,
        *,
        pinned: bool,
    ) -> None:
        self.nc = nc
        self.worker_id = worker_id
        self.spec = spec
        self.settings = settings
        self.pinned = pinned
        self.state = WorkerState.LOADING
        self.memory_mb = 0.0
        self.loaded_at = time.monotonic()
        self.last_used = time.monotonic()
        self.budget = BatchBudget(settings.max_batch_items or 0, settings.max_batch_tokens)
        self._simulated = is_simulated(spec.runtime)
        self.metrics = WorkerMetrics(spec.name, spec.runtime, self._simulated)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"shoal-{spec.name}")
        self._reprofiling: asyncio.Task[None] | None = None
        self._busy = BusyMeter()
        self._runtime = None
        self._scheduler: Scheduler | None = None
        self._ctx: SchedulerContext | None = None
        self._puller: Puller | None = None
        self._cancels = None
        self._tasks: list[asyncio.Task[None]] = []  # fill loop, keep-alive
        self._run_task: asyncio.Task[None] | None = None  # the scheduler
        self._stopping = asyncio.Event()
        self.adapters: dict[str, _AdapterFeed] = {}
        self.quality: dict[str, float] = {}
        # The last pulled messages' sizes (envelopes: group commit at the gateway), to size
        # pulls to the room (worker/pull_sizing.py).
        self._recent_messages = RecentMessages()
        self._background_tasks: set[asyncio.Task] = set()
        # Poison messages (worker/poison.py): attempt records and dead letters.
        self._recorder: AttemptRecorder | None = None
        self._dead_letterer: DeadLetterer | None = None
        self._dead_letter_subs: dict[str, Any] = {}

    # -- life cycle ------------------------------------------------------------------------

    async def load(self) -> None:
        """Load the runtime (in the executor) and start pulling; ModelLoadError if it fails."""
        settings, spec = self.settings, self.spec
        js = self.nc.jetstream()
        consumer = await ensure_model_consumer(js, spec.name, settings.queue)
        loop = asyncio.get_running_loop()
        before = _rss_mb()
        try:
            runtime = await loop.run_in_executor(self._executor, load_runtime, self._load_spec())
        except Exception as err:
            self._executor.shutdown(wait=False)
            raise ModelLoadError(f"cannot load {spec.name} on {spec.runtime}: {err}") from err
        self._runtime = runtime
        # What a lossy runtime measured of itself at load (ONNX int8: its cosine to fp32).
        cosine = getattr(runtime, "int8_cosine", None)
        self.quality = {"int8_cosine": round(float(cosine), 6)} if cosine is not None else {}
        # A simulated model declares its footprint; a real one is measured.
        declared = spec.options.get("memory_mb") if self._simulated else None
        self.memory_mb = float(declared) if declared is not None else max(0.0, _rss_mb() - before)
        engine = runtime_record(spec.runtime).engine
        if engine:  # a server child: its memory is its own; it batches for itself
            from shoal.worker.schedulers.relay import DEFAULT_CONCURRENCY  # imports httpx

            self.memory_mb = runtime.memory_mb()
            limit = runtime.concurrency or settings.max_batch_items
            if limit:
                self.budget = BatchBudget(limit, settings.max_batch_tokens)
            else:  # neither given: the engine's concurrency from its profile
                self.budget = await self._engine_budget(runtime, DEFAULT_CONCURRENCY)
        elif not settings.max_batch_items:
            self.budget = await tuned_budget(
                js,
                spec,
                runtime,
                self._executor,
                self.worker_id,
                settings.max_batch_tokens,
                settings.latency_targets,
            )
        batch_settings = _with_budget(settings, self.budget)
        self._ctx = SchedulerContext(
            batch_settings,
            Outbox(self.nc, self.metrics),
            self._executor,
            self.metrics,
            self._busy,
            profiled_latency_s=self.budget.latency_s,
        )
        if not settings.max_batch_items and spec.task is not Task.GENERATE and not engine:
            self._ctx.audit = ProfileAudit(self.budget.latency_s)
            self._ctx.on_profile_contradicted = self._reprofile_soon
        attempts = await ensure_attempts_kv(js)
        self._recorder = AttemptRecorder(attempts, self.worker_id, loop)
        self._dead_letterer = DeadLetterer(self.nc, self._ctx.outbox, attempts)
        self._scheduler = self._make_scheduler(runtime)
        # Before the first pull: pulling is what makes JetStream give up on a message.
        self._dead_letter_subs[spec.name] = await self._dead_letterer.watch(consumer, spec.name)
        self._cancels = await self.nc.subscribe(cancel_subject(spec.name), cb=self._on_cancel)
        self._puller = Puller(self.nc, WORK_STREAM, consumer, self._on_message)
        await self._puller.start()
        self.state = WorkerState.READY
        self.loaded_at = self.last_used = time.monotonic()
        self._tasks = [
            asyncio.create_task(self._fill(self._puller, self._stopping)),
            asyncio.create_task(self._keep_alive()),
        ]
        self._run_task = asyncio.create_task(self._scheduler.run())
        log.info("%s ready on %s (%.0f MB)", spec.name, spec.runtime, self.memory_mb)

    async def _engine_budget(self, runtime: Any, fallback: int) -> BatchBudget:
        """The relay's concurrency from the engine's stored profile, profiling it first if
        there is none; `fallback` if profiling fails (the engine still serves)."""
        settings = self.settings
        try:
            return await tuned_budget(
                self.nc.jetstream(),
                self.spec,
                runtime,
                self._executor,
                self.worker_id,
                settings.max_batch_tokens,
                settings.latency_targets,
            )
        except Exception as err:  # e.g. an engine that serves chat only: no completions
            log.warning(
                "%s: profiling the engine failed (%s); %d requests in flight",
                self.spec.name,
                err,
                fallback,
            )
            return BatchBudget(fallback, settings.max_batch_tokens)

    def _reprofile_soon(self) -> None:
        """The stored profile was contradicted in service: profile again, once, meanwhile
        serving on (the profile's timings queue in the executor between two batches)."""
        # Not while stopping: the drain's last batches still feed the audit, and a profile
        # started then would run on into the runtime's close.
        if self._reprofiling is None and not self._stopping.is_set():
            self._reprofiling = asyncio.get_running_loop().create_task(self._reprofile())

    async def _reprofile(self) -> None:
        try:
            budget = await reprofile(
                self.nc.jetstream(),
                self.spec,
                self._runtime,
                self._executor,
                self.worker_id,
                self.budget.max_batch_tokens or self.settings.max_batch_tokens,
                self.settings.latency_targets,
            )
        except Exception as err:  # the old budget still serves
            log.warning("%s: profiling again failed: %s", self.spec.name, err)
            return
        if budget is None:  # another worker's claim stands: the budget stays
            return
        log.info(
            "%s: batch budget %d -> %d items",
            self.spec.name,
            self.budget.max_batch_items,
            budget.max_batch_items,
        )
        self.budget = budget
        self._ctx.settings = _with_budget(self.settings, budget)
        self._ctx.profiled_latency_s = budget.latency_s  # the batch wait's curve follows
        self._ctx.room_changed.set()  # more room: the fill loop pulls for the larger budget

    async def _abandon_reprofile(self) -> None:
        """End a profile in progress: its timings would queue ahead of the batches the drain
        finishes, and the runtime closes under it (it failed with the runtime's attribute
        gone). A timing already running finishes first (the executor runs one job at a time,
        the close queues behind it). Unless the cancel lands during the store itself, the
        stored profile stays as it was, and the next worker's audit may start again."""
        task = self._reprofiling
        if task is None or task.done():
            return
        log.warning("%s: profiling again abandoned: the worker is stopping", self.spec.name)
        task.cancel()
        # asyncio.wait, not awaiting the task: the task's CancelledError stays in it, while a
        # cancel of the drain itself still reaches the drain.
        await asyncio.wait({task})

    async def drain(self) -> None:
        """Stop pulling, hand back (nak) the messages not started, finish and ack the rest,
        release the model."""
        self.state = WorkerState.DRAINING
        self._stopping.set()
        await self._abandon_reprofile()
        for name in list(self.adapters):
            await self.detach(name)
        if self._scheduler is not None and self._run_task is not None:
            await self._tasks[0]  # the fill loop ends with its pull request (at most poll_s)
            self._scheduler.stop_accepting()
            # Work not started goes back to the queue now, for the workers that stay.
            released = self._scheduler.release_unstarted()
            if released and self._ctx is not None:
                log.info("%s: handing back %d unstarted message(s)", self.spec.name, len(released))
                for message in released:
                    await self._ctx.outbox.hand_back(message)
            await self._run_task
        for task in self._tasks[1:]:
            task.cancel()
        if self._puller is not None:
            await self._puller.stop()
        if self._cancels is not None:
            with contextlib.suppress(Exception):
                await self._cancels.unsubscribe()
        for subscription in self._dead_letter_subs.values():
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()
        self._dead_letter_subs.clear()
        if self._runtime is not None:
            await asyncio.get_running_loop().run_in_executor(self._executor, self._runtime.close)
            self._runtime = None
        self._executor.shutdown()

    # -- what placement reads -------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.state is WorkerState.READY

    def held(self) -> int:
        return len(self._scheduler.held()) if self._scheduler is not None else 0

    def idle_s(self) -> float:
        """Seconds since this model last had work (0 while it holds some)."""
        if self.held():
            return 0.0
        return time.monotonic() - self.last_used

    # -- pulling ---------------------------------------------------------------------------

    def _load_spec(self) -> ModelSpec:
        """The spec as the runtime loads it: the worker's thread setting unless it names one."""
        threads = self.settings.runtime_threads
        if not threads or "threads" in self.spec.options:
            return self.spec
        return msgspec.structs.replace(self.spec, options={**self.spec.options, "threads": threads})

    def _make_scheduler(self, runtime) -> Scheduler:
        assert self._ctx is not None
        if runtime_record(self.spec.runtime).engine:
            from shoal.worker.schedulers.relay import RelayScheduler

            limit = self.budget.max_batch_items
            return RelayScheduler(self._ctx, runtime, self.spec.task, self.spec.name, limit)
        if self.spec.task is Task.GENERATE:
            return ContinuousScheduler(self._ctx, runtime)
        assert self._recorder is not None
        handler = self._recorder.wrap(batch_handler(self.spec, runtime))
        return BatchScheduler(self._ctx, handler, self.spec.task)

    def _on_message(self, msg: Msg) -> None:
        self._accept(msg, None)

    def _accept(self, msg: Msg, adapter: str | None) -> None:
        """Unpack a pulled work envelope into its requests, one work item each."""
        assert self._scheduler is not None
        self.last_used = time.monotonic()
        try:
            envelope = decode_envelope(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            # Not Shoal's work format: nobody can answer it, so it must not come back.
            log.error("dropped an unreadable work message (%d bytes): %s", len(msg.data), err)
            self._background(msg.term())
            return
        if not envelope.requests:
            self._background(msg.ack())
            return
        deliveries, stream_seq = ack_fields(msg.reply)
        size = len(envelope.requests)
        message = WorkMessage(msg, size, deliveries, stream_seq)
        self._recent_messages.observe(size)
        if any(request.body_key for request in envelope.requests):
            self._scheduler.arrivals_expected(+1)
            self._background(self._accept_stored(message, envelope, adapter))
            return
        self._accept_envelope(message, envelope, adapter)

    def _accept_envelope(
        self, message: WorkMessage, envelope: WorkEnvelope, adapter: str | None
    ) -> None:
        assert self._scheduler is not None
        if message.deliveries >= RUN_ALONE_FROM_DELIVERY and self.spec.task is not Task.GENERATE:
            # Suspect: its requests run alone, a known culprit last (worker/poison.py).
            self._scheduler.arrivals_expected(+1)
            self._background(self._accept_suspect(message, envelope, adapter))
            return
        accept = self._scheduler.accept
        for request in envelope.requests:
            accept(WorkItem.from_request(message, envelope, request, adapter))

    async def _accept_stored(
        self, message: WorkMessage, envelope: WorkEnvelope, adapter: str | None
    ) -> None:
        """Read back the bodies that came through the object store, then accept as usual.

        A body that is gone (expired, or deleted after an earlier delivery was answered) is
        answered with a 503 at once; a NATS error hands the whole message back for later.
        """
        assert self._scheduler is not None
        try:
            await self._accept_read_bodies(message, envelope, adapter)
        finally:
            self._scheduler.arrivals_expected(-1)

    async def _accept_read_bodies(
        self, message: WorkMessage, envelope: WorkEnvelope, adapter: str | None
    ) -> None:
        assert self._ctx is not None
        outbox = self._ctx.outbox
        bodies: dict[str, bytes | None] = {}
        try:
            for request in envelope.requests:
                if request.body_key:
                    bodies[request.body_key] = await _stored_body(outbox, request.body_key)
        except Exception as err:
            log.warning("%s: cannot read a stored request body: %s", self.spec.name, err)
            await outbox.hand_back(message)
            return
        requests = []
        for request in envelope.requests:
            if not request.body_key:
                requests.append(request)
                continue
            body = bodies[request.body_key]
            if body is not None:
                requests.append(msgspec.structs.replace(request, body=body))
                continue
            item = WorkItem.from_request(message, envelope, request)
            error = ApiError(
                503, "The request's body is no longer stored; send it again", retry_after=1
            )
            await outbox.reply(item, Reply.from_error(error))
            await outbox.ack(item)
        if requests:
            readable = msgspec.structs.replace(envelope, requests=requests)
            self._accept_envelope(message, readable, adapter)

    async def _accept_suspect(
        self, message: WorkMessage, envelope: WorkEnvelope, adapter: str | None
    ) -> None:
        assert self._scheduler is not None and self._recorder is not None
        try:
            culprit = await self._recorder.culprit_of(message)
            for request in envelope.requests:
                item = WorkItem.from_request(message, envelope, request, adapter)
                item.culprit = request.request_id == culprit
                self._recorder.expect(item)
                self._scheduler.accept(item)
        finally:
            self._scheduler.arrivals_expected(-1)

    def _background(self, work) -> None:
        task = asyncio.ensure_future(work)
        self._background_tasks.add(task)
        task.add_done_callback(self._background_tasks.discard)

    async def _on_cancel(self, msg: Msg) -> None:
        if self._scheduler is not None:
            for request_id in decode_cancels(msg.data):
                self._scheduler.cancel(request_id)

    async def _fill(self, puller: Puller, stopped: asyncio.Event) -> None:
        assert self._scheduler is not None and self._ctx is not None
        room_changed = self._ctx.room_changed
        recent = self._recent_messages
        while not stopped.is_set():
            room = self._scheduler.room()
            # No room, or a long batch running: the queue's items are left to other workers
            # until the batch nears its end (schedulers/batch.py).
            wait_s = self.settings.poll_s if room <= 0 else self._scheduler.pull_after_s()
            if wait_s > 0:
                room_changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(room_changed.wait(), wait_s)
                continue
            messages = recent.messages_for_room(room)
            self._scheduler.arrivals_expected(+1)
            try:
                await puller.pull(messages, self.settings.poll_s)
            except Exception as err:  # a reconnect in progress: try again shortly
                log.warning("pull failed: %s", err)
                await asyncio.sleep(0.2)
            finally:
                self._scheduler.arrivals_expected(-1)

    async def _keep_alive(self) -> None:
        """In-progress acks for everything held, so JetStream does not redeliver running work."""
        interval = max(0.2, self.settings.queue.ack_wait_s / 3)
        while True:
            await asyncio.sleep(interval)
            held = self._scheduler.held() if self._scheduler is not None else []
            if held:
                self.last_used = time.monotonic()
            messages = {id(item.message): item.message for item in held if item.message}
            for message in messages.values():
                with contextlib.suppress(Exception):
                    await message.msg.in_progress()

    # -- LoRA adapters ---------------------------------------------------------------------

    async def attach(self, spec: ModelSpec) -> None:
        """Serve a LoRA deployment on this base: load its adapter, pull its queue."""
        if spec.name in self.adapters:
            await self.detach(spec.name)
        assert self._runtime is not None
        if not runtime_record(self.spec.runtime).serves_adapters(self.spec.task):
            raise ModelLoadError(f"{self.spec.runtime} cannot serve the adapter {spec.name}")
        runtime: AdapterHost = self._runtime
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._executor, runtime.add_adapter, spec.name, spec.adapter)
        except Exception as err:
            raise ModelLoadError(f"cannot load the adapter {spec.name}: {err}") from err
        consumer = await ensure_model_consumer(self.nc.jetstream(), spec.name, self.settings.queue)

        def on_message(msg: Msg) -> None:
            self._accept(msg, spec.name)

        feed = _AdapterFeed(spec, Puller(self.nc, WORK_STREAM, consumer, on_message))
        if self._dead_letterer is not None:
            subscription = await self._dead_letterer.watch(consumer, spec.name)
            self._dead_letter_subs[spec.name] = subscription
        await feed.puller.start()
        feed.fill = asyncio.create_task(self._fill(feed.puller, feed.stopped))
        self.adapters[spec.name] = feed
        log.info("%s: serving the adapter %s", self.spec.name, spec.name)

    async def detach(self, name: str) -> None:
        """Stop pulling for an adapter, answer what was pulled for it, then remove it from
        the runtime (its memory is freed; a redeploy loads it anew)."""
        feed = self.adapters.pop(name, None)
        if feed is None:
            return
        feed.stopped.set()
        if feed.fill is not None:
            await feed.fill  # ends with its pull request (at most poll_s)
        await feed.puller.stop()
        subscription = self._dead_letter_subs.pop(name, None)
        if subscription is not None:
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()
        while self._scheduler is not None and any(
            item.adapter == name for item in self._scheduler.held()
        ):
            await asyncio.sleep(0.05)
        if self._runtime is not None:
            runtime: AdapterHost = self._runtime
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(self._executor, runtime.remove_adapter, name)
            except Exception as err:  # the base still serves; the adapter's memory may stay
                log.warning("%s: removing the adapter %s failed: %s", self.spec.name, name, err)

    def served_models(self) -> list[str]:
        """The names this server reports a status under: its model and its adapters."""
        return [self.spec.name, *self.adapters]

    # -- status ----------------------------------------------------------------------------

    def status(self, metrics_url: str) -> WorkerStatus:
        busy = self._busy.fraction()
        self.metrics.busy_fraction.set(busy)
        status = new_status(self.worker_id, self.spec, self.state, metrics_url, self.pinned)
        status.slots = getattr(self._scheduler, "slots", 0)
        status.busy_fraction = round(busy, 4)
        status.memory_mb = round(self.memory_mb, 1)
        status.max_batch_items = self.budget.max_batch_items
        status.quality = self.quality
        status.last_used_ms = now_ms() - int(1000 * (time.monotonic() - self.last_used))
        if self._ctx is not None:
            counters = self._ctx.counters
            status.items_done = counters.items_done
            status.redelivered = counters.redelivered
            status.batches = counters.batches
            status.largest_batch = counters.largest_batch
            status.running_sequences = counters.running_sequences
            status.tokens_generated = counters.tokens_generated
            status.cancelled = counters.cancelled
        return status

    async def report(self, kv: KeyValue, metrics_url: str) -> None:
        """Its status, and one per adapter it serves (they share its counters)."""
        status = self.status(metrics_url)
        await put_status(kv, status)
        for name in list(self.adapters):
            await put_status(kv, msgspec.structs.replace(status, model=name))


def new_status(
    worker_id: str, spec: ModelSpec, state: WorkerState, metrics_url: str, pinned: bool
) -> WorkerStatus:
    """A worker's status about one deployment, before any counters (also for a failed load)."""
    return WorkerStatus(
        worker_id=worker_id,
        model=spec.name,
        runtime=spec.runtime,
        simulated=is_simulated(spec.runtime),
        pid=os.getpid(),
        state=state,
        metrics_url=metrics_url,
        pinned=pinned,
        updated_ms=now_ms(),
    )


def _with_budget(settings: WorkerSettings, budget: BatchBudget) -> WorkerSettings:
    return replace(
        settings,
        max_batch_items=budget.max_batch_items or settings.max_batch_items or 128,
        max_batch_tokens=budget.max_batch_tokens or settings.max_batch_tokens,
    )


def _rss_mb() -> float:
    """This process's resident memory, from /proc (Linux); 0 where there is none."""
    try:
        with open("/proc/self/statm") as statm:
            pages = int(statm.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


async def _stored_body(outbox: Outbox, key: str) -> bytes | None:
    """A body from the object store; None when it is gone."""
    try:
        return await outbox.bodies.get(key)
    except BodyMissingError:
        return None
