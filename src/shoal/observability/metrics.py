"""Prometheus metrics. Each component owns its registry: no process-global state."""

from __future__ import annotations

import asyncio
import os
import time
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field
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


@dataclass(slots=True)
class _PendingRequests:
    """Requests of one (route, model, status) counted since the last flush."""

    count: int = 0
    seconds: float = 0.0
    # One a latency bound, then +Inf, as the histogram's.
    buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))


class GatewayMetrics:
    """The gateway's request counters and latency histogram, counted in plain Python and
    written to prometheus_client's values in bulk (`flush`).

    Written a request, the values cost ~2.4 us in one process and ~7 us with several gateway
    processes on one port (`shared`: prometheus_client's multiprocess files, where every
    increment takes a lock, asks the OS for the pid and writes to the file); counted here and
    flushed, ~1 us (bench.hotpath's gateway profile). Reading flushes first, so one process's
    `/metrics` is always current; with several, a scrape sees a sibling's counts once that
    sibling has flushed (`flush_every`, at most `SHARED_FLUSH_INTERVAL_S` later).
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
        self._pending: dict[tuple[str, str, int], _PendingRequests] = {}
        # Label lookups cost ~5 us (a lock and a tuple of strings): the children are kept
        # here, one per (route, model, status) seen; models are only deployed ones.
        self._request_children: dict[tuple[str, str, int], tuple[Any, Any]] = {}

    def observe_request(self, route: str, model: str, status: int, seconds: float) -> None:
        """Count one HTTP request and its latency (written out at the next flush)."""
        key = (route, model, status)
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = _PendingRequests()
        pending.count += 1
        pending.seconds += seconds
        # The histogram's rule: a value goes to the first bucket whose bound is >= it.
        pending.buckets[bisect_left(LATENCY_BUCKETS, seconds)] += 1

    def flush(self) -> None:
        """Write the requests counted since the last flush to the prometheus values."""
        pending, self._pending = self._pending, {}
        for key, requests in pending.items():
            counter, histogram = self._children(key)
            counter.inc(requests.count)
            # Histogram has no public way to add many observations at once; its values are
            # a sum and one count a bucket (tests/test_gateway_metrics.py checks the result against
            # the same values observed one by one).
            histogram._sum.inc(requests.seconds)
            for bucket, count in zip(histogram._buckets, requests.buckets, strict=True):
                if count:
                    bucket.inc(count)

    async def flush_every(self, interval_s: float = SHARED_FLUSH_INTERVAL_S) -> None:
        """Flush until cancelled; a gateway process whose metrics are shared runs this, so
        its siblings' scrapes see its counts."""
        while True:
            await asyncio.sleep(interval_s)
            if self._pending:
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

    def _children(self, key: tuple[str, str, int]) -> tuple[Any, Any]:
        children = self._request_children.get(key)
        if children is None:
            route, model, status = key
            children = (
                self.requests.labels(route, model, str(status)),
                self.latency.labels(route, model),
            )
            self._request_children[key] = children
        return children


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
        self._items_by_status: dict[int, Any] = {}
        self.queue_wait = Histogram(
            "shoal_worker_queue_wait_seconds",
            "Time from the gateway's publish to the start of the item's batch",
            ["model", "runtime"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(**labels)
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
        # A labelled child per status, looked up once: labels() costs 2 us, inc() 0.3 us.
        child = self._items_by_status.get(status)
        if child is None:
            child = self.items.labels(status=str(status), **self._items_labels)
            self._items_by_status[status] = child
        child.inc()

    def render(self) -> bytes:
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
