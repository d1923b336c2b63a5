"""The fleet dashboard: `GET /dashboard` (a static page) and `GET /dashboard/data` (a snapshot).

The page (`dashboard.html` beside this module) polls the snapshot once a second and keeps the
last minutes client-side for its plots, drawn as inline SVG by a few lines of script: no chart
library, no build step, nothing fetched from elsewhere. Both routes are read-only.

The snapshot joins what the gateway can see without asking any worker directly:

- the deployments (the gateway's in-memory `ModelDirectory`);
- the workers' status reports (bucket `shoal_workers`): state, busy fraction, counters;
- each model's consumer on the work stream: messages queued (backlog) and held by workers;
- this gateway's own request counters and latency histogram (`GatewayMetrics`).

Rates and percentiles are over the last `WINDOW_S` seconds, from differences between the
snapshots this process built (kept in `WindowHistory`): throughput from the workers' cumulative
`items_done` (every gateway's requests), latency percentiles from this gateway's histogram
(only the requests that came through this gateway, or through this port's processes when the
gateway runs several).

Access: with an admin token set, `/dashboard/data` needs it (`Authorization: Bearer`), like the
admin API; the page itself holds no data and is served to anyone, and reads the token from
its URL fragment (`/dashboard#token=...`, never sent to the server in the URL) or a form.
Without an admin token the snapshot is open, like `/metrics`.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import math
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import msgspec
import nats.js.errors
from nats.js import JetStreamContext

from shoal.api.errors import ApiError
from shoal.gateway.admin import check_token
from shoal.gateway.readiness import STALE_S
from shoal.observability.metrics import GatewayMetrics
from shoal.protocol import WORK_STREAM, ModelSpec, Task, consumer_name, encode_json, now_ms
from shoal.runtimes.registry import is_simulated
from shoal.state.workers import WorkerState, WorkerStatus, read_worker_statuses

PAGE_PATH = "/dashboard"
DATA_PATH = "/dashboard/data"
PAGE_FILE = "dashboard.html"

WINDOW_S = 10.0  # rates and percentiles are over this much of the recent past
# Several viewers polling once a second share one snapshot: the KV and consumer reads behind
# it happen at most this often, whatever the number of open pages.
MIN_REBUILD_S = 0.5
# A snapshot that cannot be read from NATS in this long is a 503: the page shows it and retries.
READ_TIMEOUT_S = 3.0
_HISTORY_KEEP_S = WINDOW_S + 5.0

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


# -- the snapshot's shape (also its schema in openapi.json) ----------------------------------


class WorkerRow(msgspec.Struct, kw_only=True):
    """One worker's last report about one model, and its rates over the window."""

    worker_id: str
    state: str  # loading, ready, draining, failed
    stale: bool  # no report for STALE_S: the worker may be gone (its report not yet expired)
    age_s: float  # since the report was written (by the worker's clock)
    busy_fraction: float  # share of the worker's last 10 s spent executing batches
    items_done: int
    items_per_s: float | None  # None until two reports are WINDOW_S apart or less
    batches: int  # batches, or decode steps for a generative model
    mean_batch: float | None  # items per batch (generation: sequences per decode step)
    largest_batch: int
    max_batch_items: int
    slots: int
    running_sequences: int
    tokens_generated: int
    redelivered: int
    cancelled: int
    pinned: bool
    memory_mb: float
    error: str = ""


class LoadFailure(msgspec.Struct, kw_only=True):
    worker_id: str
    error: str


class GatewayFigures(msgspec.Struct, kw_only=True):
    """Requests for one model answered by this gateway: totals since it started, and the
    window's rate and latency percentiles (None while the window saw no request)."""

    requests: int = 0
    errors: int = 0  # answered with a status other than 200
    by_status: dict[str, int] = msgspec.field(default_factory=dict)
    requests_per_s: float | None = None
    errors_per_s: float | None = None
    p50_s: float | None = None
    p99_s: float | None = None


class ModelRow(msgspec.Struct, kw_only=True):
    name: str
    task: str
    runtime: str
    simulated: bool
    deployed: bool  # False: undeployed, but a worker still reports it (unloading)
    backlog: int | None  # messages (each up to 64 requests) no worker has pulled; None: no queue
    in_flight: int | None  # messages pulled by workers and not yet acknowledged
    max_batch_items: int  # the largest batch budget among its workers
    workers_ready: int
    workers_loading: int
    workers_failed: int
    busy_fraction: float | None  # mean over its ready workers
    items_done: int  # summed over the workers that report it now
    items_per_s: float | None  # answered by its workers, for every gateway
    mean_batch: float | None
    load_failures: list[LoadFailure]
    gateway: GatewayFigures
    workers: list[WorkerRow]


class FleetTotals(msgspec.Struct, kw_only=True):
    models: int
    workers: int  # worker processes with at least one live report
    workers_ready: int  # (worker, model) pairs READY and not stale
    backlog: int
    items_per_s: float | None
    requests_per_s: float | None  # through this gateway


class DashboardSnapshot(msgspec.Struct, kw_only=True):
    gateway_id: str
    time_ms: int
    window_s: float
    totals: FleetTotals
    models: list[ModelRow]
    # Requests that failed before their model was known (malformed, unknown model): the
    # gateway's `model="-"` label.
    unrouted: GatewayFigures


# -- windows over cumulative counters -------------------------------------------------------


def histogram_quantile(
    q: float, bounds: tuple[float, ...], counts: Iterable[float]
) -> float | None:
    """The q-quantile of observations in cumulative buckets, as Prometheus estimates it.

    `bounds` are the upper bounds, the last one `inf`; `counts` the cumulative counts in each.
    Linear within the bucket holding the rank; in the `+Inf` bucket, the largest finite bound.
    """
    counts = list(counts)
    total = counts[-1] if counts else 0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0  # the bucket's lower bound, and the count under it
    for bound, cumulative in zip(bounds, counts, strict=True):
        # The first bucket whose count reaches the rank (skipping empty ones, for q = 0).
        if cumulative >= rank and cumulative > below:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / (cumulative - below)
        lower, below = bound, cumulative
    return lower  # not reached: the last bucket holds every observation


@dataclass(slots=True)
class _ModelCounts:
    """This gateway's cumulative figures for one model at one moment."""

    buckets: tuple[float, ...]  # cumulative, over every route
    by_status: dict[str, int]


@dataclass(slots=True)
class _WorkerCounts:
    updated_ms: int
    items_done: int
    batches: int
    tokens_generated: int


@dataclass(slots=True)
class _Sample:
    at: float  # time.monotonic()
    gateway: dict[str, _ModelCounts]
    workers: dict[tuple[str, str], _WorkerCounts]  # by (worker id, model)


@dataclass
class WindowHistory:
    """The last few snapshots' counters: rates are differences over (at most) WINDOW_S."""

    window_s: float = WINDOW_S
    samples: deque[_Sample] = field(default_factory=deque)

    def add(self, sample: _Sample) -> None:
        self.samples.append(sample)
        while self.samples and sample.at - self.samples[0].at > self.window_s + 5.0:
            self.samples.popleft()

    def _in_window(self) -> list[_Sample]:
        """The samples from the window's start to now, oldest first (the last one is now)."""
        if not self.samples:
            return []
        now = self.samples[-1].at
        return [s for s in self.samples if now - s.at <= self.window_s]

    def gateway_figures(self, model: str, bounds: tuple[float, ...]) -> GatewayFigures:
        window = self._in_window()
        if not window or model not in window[-1].gateway:
            return GatewayFigures()
        now = window[-1]
        current = now.gateway[model]
        requests = sum(current.by_status.values())
        errors = sum(n for status, n in current.by_status.items() if status != "200")
        figures = GatewayFigures(
            requests=requests, errors=errors, by_status=dict(sorted(current.by_status.items()))
        )
        base = window[0]
        elapsed = now.at - base.at
        if elapsed <= 0:
            return figures
        # A model absent from the base sample had no request before it: it started at zero.
        before = base.gateway.get(model) or _ModelCounts((0.0,) * len(bounds), {})
        figures.requests_per_s = (requests - sum(before.by_status.values())) / elapsed
        errors_before = sum(n for status, n in before.by_status.items() if status != "200")
        figures.errors_per_s = (errors - errors_before) / elapsed
        delta = [a - b for a, b in zip(current.buckets, before.buckets, strict=True)]
        figures.p50_s = histogram_quantile(0.5, bounds, delta)
        figures.p99_s = histogram_quantile(0.99, bounds, delta)
        return figures

    def worker_rates(self, key: tuple[str, str]) -> tuple[float | None, float | None, float | None]:
        """(items per second, items per batch, tokens per step) of one worker's model.

        Timed by the worker's own report times (`updated_ms`), not by when this gateway read
        them: reports come once a second, and reading one twice is no time passing.
        """
        window = self._in_window()
        first = next((s.workers[key] for s in window if key in s.workers), None)
        last = window[-1].workers.get(key) if window else None
        if first is None or last is None or last.updated_ms <= first.updated_ms:
            return None, None, None
        items = last.items_done - first.items_done
        batches = last.batches - first.batches
        tokens = last.tokens_generated - first.tokens_generated
        if items < 0 or batches < 0:  # the worker restarted under the same id
            return None, None, None
        elapsed = (last.updated_ms - first.updated_ms) / 1000
        return (
            items / elapsed,
            items / batches if batches else None,
            tokens / batches if batches and tokens >= 0 else None,
        )


def read_gateway_counts(
    metrics: GatewayMetrics,
) -> tuple[tuple[float, ...], dict[str, _ModelCounts]]:
    """(the histogram's bucket bounds, this gateway's cumulative counts by model).

    With several gateway processes on one port (prometheus_client's multiprocess directory),
    the sum over all of them, as `/metrics` shows it.
    """
    registry = metrics.readable_registry()
    buckets: dict[str, dict[float, float]] = {}
    statuses: dict[str, dict[str, int]] = {}
    for family in registry.collect():
        for sample in family.samples:
            model = sample.labels.get("model")
            if model is None:
                continue
            if sample.name == "shoal_gateway_request_seconds_bucket":
                bound = float(sample.labels["le"])
                per_model = buckets.setdefault(model, {})
                per_model[bound] = per_model.get(bound, 0.0) + sample.value
            elif sample.name == "shoal_gateway_requests_total":
                per_status = statuses.setdefault(model, {})
                status = sample.labels["status"]
                per_status[status] = per_status.get(status, 0) + int(sample.value)
    bounds = tuple(sorted({b for per_model in buckets.values() for b in per_model}))
    counts = {}
    for model in buckets.keys() | statuses.keys():
        per_model = buckets.get(model, {})
        counts[model] = _ModelCounts(
            tuple(per_model.get(b, 0.0) for b in bounds), statuses.get(model, {})
        )
    return bounds, counts


# -- the routes -------------------------------------------------------------------------------


class Dashboard:
    """The two routes. `js` returns the gateway's JetStream context or raises ApiError 503."""

    def __init__(
        self,
        gateway_id: str,
        admin_token: str,
        metrics: GatewayMetrics,
        deployments: Callable[[], list[ModelSpec]],
        js: Callable[[], JetStreamContext],
    ) -> None:
        self._gateway_id = gateway_id
        self._admin_token = admin_token
        self._metrics = metrics
        self._deployments = deployments
        self._js = js
        self._page, self._page_headers = _load_page()
        self.history = WindowHistory()
        self._lock = asyncio.Lock()
        self._cached: bytes | None = None
        self._cached_at = -math.inf

    async def page(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The page: static, the same for everyone (it holds no data), so no token here."""
        await _respond(send, self._page, self._page_headers)

    async def data(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The snapshot as JSON; the admin token when one is set."""
        if self._admin_token:
            check_token(scope["headers"], self._admin_token)
        body = await self.snapshot()
        await _respond(send, body, [_JSON, _NO_STORE, _NOSNIFF])

    async def snapshot(self) -> bytes:
        """The encoded snapshot, rebuilt at most every MIN_REBUILD_S whoever asks."""
        async with self._lock:
            if time.monotonic() - self._cached_at < MIN_REBUILD_S and self._cached is not None:
                return self._cached
            js = self._js()  # 503 at once while NATS is away
            try:
                async with asyncio.timeout(READ_TIMEOUT_S):
                    snapshot = await self.build(js)
            except TimeoutError:
                raise ApiError(
                    503, "The fleet's state could not be read from NATS in time", retry_after=1
                ) from None
            self._cached = encode_json(snapshot)
            self._cached_at = time.monotonic()
            return self._cached

    async def build(self, js: JetStreamContext) -> DashboardSnapshot:
        """Read the fleet's state now, add it to the history, and join it into a snapshot."""
        statuses = await read_worker_statuses(js)
        specs = {spec.name: spec for spec in self._deployments()}
        names = sorted(specs.keys() | {s.model for s in statuses})
        queues = await asyncio.gather(*(_queue_depths(js, name) for name in names))
        bounds, gateway_counts = read_gateway_counts(self._metrics)
        clock_ms = now_ms()
        self.history.add(
            _Sample(
                time.monotonic(),
                gateway_counts,
                {
                    (s.worker_id, s.model): _WorkerCounts(
                        s.updated_ms, s.items_done, s.batches, s.tokens_generated
                    )
                    for s in statuses
                },
            )
        )
        models = [
            self._model_row(
                name,
                specs.get(name),
                [s for s in statuses if s.model == name],
                queues[i],
                bounds,
                clock_ms,
            )
            for i, name in enumerate(names)
        ]
        rates = [m.items_per_s for m in models if m.items_per_s is not None]
        requests = [
            m.gateway.requests_per_s for m in models if m.gateway.requests_per_s is not None
        ]
        return DashboardSnapshot(
            gateway_id=self._gateway_id,
            time_ms=clock_ms,
            window_s=self.history.window_s,
            totals=FleetTotals(
                models=len(specs),
                workers=len({s.worker_id for s in statuses}),
                workers_ready=sum(m.workers_ready for m in models),
                backlog=sum(m.backlog or 0 for m in models),
                items_per_s=sum(rates) if rates else None,
                requests_per_s=sum(requests) if requests else None,
            ),
            models=models,
            unrouted=self.history.gateway_figures("-", bounds),
        )

    def _model_row(
        self,
        name: str,
        spec: ModelSpec | None,
        mine: list[WorkerStatus],
        queue: tuple[int | None, int | None],
        bounds: tuple[float, ...],
        clock_ms: int,
    ) -> ModelRow:
        generative = spec is not None and spec.task is Task.GENERATE
        workers = [self._worker_row(status, generative, clock_ms) for status in mine]
        ready = [w for w in workers if w.state == WorkerState.READY and not w.stale]
        rates = [w.items_per_s for w in workers if w.items_per_s is not None]
        batch_sizes = [w.mean_batch for w in ready if w.mean_batch is not None]
        runtime = spec.runtime if spec is not None else (mine[0].runtime if mine else "")
        return ModelRow(
            name=name,
            task=spec.task.value if spec is not None else "",
            runtime=runtime,
            simulated=is_simulated(runtime) if runtime else False,
            deployed=spec is not None,
            backlog=queue[0],
            in_flight=queue[1],
            max_batch_items=max((s.max_batch_items for s in mine), default=0),
            workers_ready=len(ready),
            workers_loading=sum(w.state == WorkerState.LOADING for w in workers),
            workers_failed=sum(w.state == WorkerState.FAILED for w in workers),
            busy_fraction=sum(w.busy_fraction for w in ready) / len(ready) if ready else None,
            items_done=sum(w.items_done for w in workers),
            items_per_s=sum(rates) if rates else None,
            mean_batch=sum(batch_sizes) / len(batch_sizes) if batch_sizes else None,
            load_failures=[
                LoadFailure(worker_id=w.worker_id, error=w.error)
                for w in workers
                if w.state == WorkerState.FAILED
            ],
            gateway=self.history.gateway_figures(name, bounds),
            workers=workers,
        )

    def _worker_row(self, status: WorkerStatus, generative: bool, clock_ms: int) -> WorkerRow:
        items_per_s, per_batch, per_step = self.history.worker_rates(
            (status.worker_id, status.model)
        )
        age_s = max(0.0, (clock_ms - status.updated_ms) / 1000) if status.updated_ms else 0.0
        return WorkerRow(
            worker_id=status.worker_id,
            state=status.state.value,
            stale=age_s > STALE_S,
            age_s=round(age_s, 1),
            busy_fraction=status.busy_fraction,
            items_done=status.items_done,
            items_per_s=items_per_s,
            batches=status.batches,
            # A generative model's "batch" is a decode step, which makes one token for each
            # sequence running: tokens per step is the sequences decoded together.
            mean_batch=per_step if generative else per_batch,
            largest_batch=status.largest_batch,
            max_batch_items=status.max_batch_items,
            slots=status.slots,
            running_sequences=status.running_sequences,
            tokens_generated=status.tokens_generated,
            redelivered=status.redelivered,
            cancelled=status.cancelled,
            pinned=status.pinned,
            memory_mb=status.memory_mb,
            error=status.error,
        )


async def _queue_depths(js: JetStreamContext, model: str) -> tuple[int | None, int | None]:
    """(messages queued, messages held by workers unacknowledged); None without a consumer."""
    try:
        info = await js.consumer_info(WORK_STREAM, consumer_name(model))
    except nats.js.errors.NotFoundError:
        return None, None
    return int(info.num_pending or 0), int(info.num_ack_pending or 0)


# -- the page ----------------------------------------------------------------------------------

_JSON = (b"content-type", b"application/json")
_NO_STORE = (b"cache-control", b"no-store")
_NOSNIFF = (b"x-content-type-options", b"nosniff")
_BLOCKS = re.compile(rb"<(script|style)>(.*?)</\1>", re.S)


def _load_page() -> tuple[bytes, list[tuple[bytes, bytes]]]:
    """The page, and headers whose Content-Security-Policy allows exactly its own inline
    script and style (by hash): a model name or error message that slipped past the page's
    escaping could still not run as script, and the page can reach nothing but this gateway."""
    page = resources.files(__package__).joinpath(PAGE_FILE).read_bytes()
    hashes: dict[bytes, list[str]] = {b"script": [], b"style": []}
    for kind, body in _BLOCKS.findall(page):
        digest = base64.b64encode(hashlib.sha256(body).digest()).decode()
        hashes[kind].append(f"'sha256-{digest}'")
    policy = (
        "default-src 'none'; connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
        f"form-action 'none'; frame-ancestors 'none'; script-src {' '.join(hashes[b'script'])}; "
        f"style-src {' '.join(hashes[b'style'])}"
    )
    headers = [
        (b"content-type", b"text/html; charset=utf-8"),
        (b"content-security-policy", policy.encode()),
        (b"referrer-policy", b"no-referrer"),
        _NOSNIFF,
        _NO_STORE,
    ]
    return page, headers


async def _respond(send: Send, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    all_headers = [*headers, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": all_headers})
    await send({"type": "http.response.body", "body": body})
