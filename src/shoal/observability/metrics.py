"""Prometheus metrics. Each component owns its registry: no process-global state."""

from __future__ import annotations

import os
import time
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


class GatewayMetrics:
    def __init__(self) -> None:
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

        # Label lookups cost ~5 us a request (a lock and a tuple of strings): the children are
        # kept here, one per (route, model, status) seen; models are only deployed ones.
        self._request_children: dict[tuple[str, str, int], tuple[Any, Any]] = {}

    def observe_request(self, route: str, model: str, status: int, seconds: float) -> None:
        """Count one HTTP request and its latency."""
        key = (route, model, status)
        children = self._request_children.get(key)
        if children is None:
            children = (
                self.requests.labels(route, model, str(status)),
                self.latency.labels(route, model),
            )
            self._request_children[key] = children
        children[0].inc()
        children[1].observe(seconds)

    def render(self) -> bytes:
        """This gateway's metrics; with several gateway processes on one port (their values in
        prometheus_client's multiprocess directory), the sum over all of them, so that a scrape
        reaching any one process sees the gateway's totals."""
        if os.environ.get(MULTIPROCESS_DIR_ENV):
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)


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
