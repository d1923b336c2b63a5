"""Prometheus metrics. Each component owns its registry: no process-global state."""

from __future__ import annotations

import asyncio
import os
import time
from bisect import bisect_left
from collections import deque
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

# prometheus_client's own variable: where processes that share one set of metrics write them.
MULTIPROCESS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1,
    2,
    5,
    10,
    30,
    60,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


# How often a gateway process that shares its metrics with others writes its counts to the
# shared files: a scrape that reaches a sibling process sees them this much later.
SHARED_FLUSH_INTERVAL_S = 0.25


class PendingCount:
    """Increments of one counter child, kept in plain Python until `flush` adds them at once:
    prometheus_client's values take a lock on every increment and, shared by several
    processes, also ask the OS for the pid and write to a file (`python -m
    bench.metrics_cost`). Not thread-safe: count and flush on one thread (`PendingHistogram`
    alike)."""

    __slots__ = ("_child", "_count")

    def __init__(self, child: Any) -> None:
        self._child = child
        self._count = 0

    def inc(self) -> None:
        self._count += 1

    def flush(self) -> None:
        if self._count:
            count, self._count = self._count, 0
            self._child.inc(count)


class PendingHistogram:
    """Observations of one histogram child, counted in plain Python until `flush` adds them at
    once (the child's own `observe` increments two locked values an observation).

    Histogram has no public way to add many observations at once; its bounds (+Inf last), sum
    and one count a bucket are read and added to directly (tests/test_metrics_pending.py checks
    the result against the same values observed one by one).
    """

    __slots__ = ("_bounds", "_buckets", "_child", "_count", "_sum")

    def __init__(self, child: Any) -> None:
        self._child = child
        self._bounds: list[float] = child._upper_bounds
        self._count = 0
        self._sum = 0.0
        self._buckets = [0] * len(self._bounds)

    def observe(self, value: float) -> None:
        self._count += 1
        self._sum += value
        # The histogram's rule: a value goes to the first bucket whose bound is >= it.
        self._buckets[bisect_left(self._bounds, value)] += 1

    def flush(self) -> None:
        if not self._count:
            return
        self._child._sum.inc(self._sum)
        for bucket, count in zip(self._child._buckets, self._buckets, strict=True):
            if count:
                bucket.inc(count)
        self._count, self._sum = 0, 0.0
        self._buckets = [0] * len(self._buckets)


class GatewayMetrics:
    """The gateway's request counters and latency histogram, counted in plain Python and
    written to prometheus_client's values in bulk (`flush`; `PendingCount`,
    `PendingHistogram`).

    Written a request, the values cost 2.65 us in one process and 4.82 us with several gateway
    processes on one port (`shared`: prometheus_client's multiprocess files), counted here
    0.63-0.65 us (`python -m bench.metrics_cost`). Reading flushes
    first, so one process's `/metrics` is always current; with several, a scrape sees a
    sibling's counts once that sibling has flushed (`flush_every`, at most
    `SHARED_FLUSH_INTERVAL_S` later).
    """

    def __init__(self) -> None:
        self.shared = bool(os.environ.get(MULTIPROCESS_DIR_ENV))
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "shoal_gateway_requests",
            "HTTP requests by route, model and status",
            ["route", "model", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "shoal_gateway_request_seconds",
            "End-to-end latency at the gateway, from request to response",
            ["route", "model"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.dropped_replies = Counter(
            "shoal_gateway_dropped_replies",
            "Results that matched no waiting request (duplicates or too late)",
            registry=self.registry,
        )
        # Label lookups cost ~5 us (a lock and a tuple of strings): the pending counts are
        # kept, one per (route, model, status) seen; models are only deployed ones.
        self._pending: dict[tuple[str, str, int], tuple[PendingCount, PendingHistogram]] = {}
        self._latencies: dict[tuple[str, str], PendingHistogram] = {}

    def observe_request(self, route: str, model: str, status: int, seconds: float) -> None:
        """Count one HTTP request and its latency (written out at the next flush)."""
        key = (route, model, status)
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = self._new_pending(key)
        pending[0].inc()
        pending[1].observe(seconds)

    def flush(self) -> None:
        """Write the requests counted since the last flush to the prometheus values."""
        for count, _ in self._pending.values():
            count.flush()
        for latency in self._latencies.values():
            latency.flush()

    async def flush_every(self, interval_s: float = SHARED_FLUSH_INTERVAL_S) -> None:
        """Flush until cancelled; a gateway process whose metrics are shared runs this, so
        its siblings' scrapes see its counts."""
        while True:
            await asyncio.sleep(interval_s)
            self.flush()

    def readable_registry(self) -> CollectorRegistry:
        """What a scrape reads, flushed: this gateway's registry, or with shared metrics the
        sum over every process's files, so a scrape reaching any one process sees the
        gateway's totals."""
        self.flush()
        if not self.shared:
            return self.registry
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return registry

    def render(self) -> bytes:
        """The text a Prometheus scrape reads (`readable_registry`)."""
        return generate_latest(self.readable_registry())

    def _new_pending(self, key: tuple[str, str, int]) -> tuple[PendingCount, PendingHistogram]:
        route, model, status = key
        latency = self._latencies.get((route, model))
        if latency is None:
            child = self.latency.labels(route, model)
            latency = self._latencies[route, model] = PendingHistogram(child)
        return PendingCount(self.requests.labels(route, model, str(status))), latency


class WorkerMetrics:
    def __init__(self, model: str, runtime: str, simulated: bool) -> None:
        self.registry = CollectorRegistry()
        labels = {"model": model, "runtime": runtime}
        Gauge(
            "shoal_worker_info",
            "The model and runtime this worker serves; simulated=true for the sim runtime",
            ["model", "runtime", "simulated"],
            registry=self.registry,
        ).labels(model, runtime, str(simulated).lower()).set(1)
        self.items = Counter(
            "shoal_worker_items",
            "Work items answered, by status",
            ["model", "runtime", "status"],
            registry=self.registry,
        )
        self._items_labels = labels
        self._items_by_status: dict[int, PendingCount] = {}
        # Observed an item, counted in plain Python until a scrape flushes (`flush`).
        self.queue_wait = PendingHistogram(
            Histogram(
                "shoal_worker_queue_wait_seconds",
                "Time from the gateway's publish to the start of the item's batch",
                ["model", "runtime"],
                buckets=LATENCY_BUCKETS,
                registry=self.registry,
            ).labels(**labels)
        )
        self.batch_items = Histogram(
            "shoal_worker_batch_items",
            "Work items per batch",
            ["model", "runtime"],
            buckets=BATCH_BUCKETS,
            registry=self.registry,
        ).labels(**labels)
        self.batch_wait = Histogram(
            "shoal_worker_batch_wait_seconds",
            "Time a worker waited for a fuller batch before running it (adaptive batch wait)",
            ["model", "runtime"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(**labels)
        self.batch_seconds = Histogram(
            "shoal_worker_batch_seconds",
            "Runtime execution time per batch",
            ["model", "runtime"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(**labels)
        self.busy_seconds = Counter(
            "shoal_worker_busy_seconds",
            "Wall time the runtime spent executing batches",
            ["model", "runtime"],
            registry=self.registry,
        ).labels(**labels)
        self.busy_fraction = Gauge(
            "shoal_worker_busy_fraction",
            "Share of wall time the runtime executed batches, over the last 10 s",
            ["model", "runtime"],
            registry=self.registry,
        ).labels(**labels)

        self.first_token = Histogram(
            "shoal_worker_first_token_seconds",
            "Generation: time from the gateway's publish to the first token",
            ["model", "runtime"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(**labels)
        self.tokens = Counter(
            "shoal_worker_generated_tokens",
            "Generation: completion tokens produced",
            ["model", "runtime"],
            registry=self.registry,
        ).labels(**labels)

    def count_item(self, status: int) -> None:
        """Count one answered item (written out at the next flush)."""
        # A labelled child per status, looked up once: labels() costs 2 us.
        pending = self._items_by_status.get(status)
        if pending is None:
            child = self.items.labels(status=str(status), **self._items_labels)
            pending = self._items_by_status[status] = PendingCount(child)
        pending.inc()

    def flush(self) -> None:
        """Write the items counted and queue waits observed since the last flush. Call it on
        the thread that counts (the worker's event loop): the pending counts have no lock."""
        for pending in self._items_by_status.values():
            pending.flush()
        self.queue_wait.flush()

    def render(self) -> bytes:
        """The text a scrape reads, flushed first; on the counting thread, as `flush` (the
        sidecar's scrape runs on prometheus_client's thread and asks the loop instead)."""
        self.flush()
        return generate_latest(self.registry)


class BusyMeter:
    """The share of recent wall time spent inside intervals (batches), over a sliding window."""

    def __init__(self, window_s: float = 10.0, clock=time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._created = clock()
        self._intervals: deque[tuple[float, float]] = deque()
        self._running_since: float | None = None

    def start(self) -> None:
        self._running_since = self._clock()

    def stop(self) -> float:
        """End the running interval; returns its length in seconds."""
        assert self._running_since is not None, "stop() without start()"
        end = self._clock()
        self._intervals.append((self._running_since, end))
        duration = end - self._running_since
        self._running_since = None
        return duration

    def fraction(self) -> float:
        now = self._clock()
        window_start = max(now - self.window_s, self._created)
        while self._intervals and self._intervals[0][1] <= window_start:
            self._intervals.popleft()
        busy = sum(min(end, now) - max(start, window_start) for start, end in self._intervals)
        if self._running_since is not None:
            busy += now - max(self._running_since, window_start)
        span = now - window_start
        return min(1.0, busy / span) if span > 0 else 0.0
