"""Metrics counted in plain Python and flushed in bulk (the gateway's requests, the worker's
items and queue waits) read the same as prometheus_client's own values observed one at a
time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from shoal.observability.metrics import LATENCY_BUCKETS, GatewayMetrics, WorkerMetrics

# Bounds themselves (a value equal to a bound is in that bucket), between them, zero, and past
# the last bound (+Inf).
LATENCIES = (0.0, 0.0005, 0.0007, 0.001, 0.003, 0.5, 0.5000001, 2.0, 60.0, 61.0, 1000.0)
REQUESTS = [
    ("/v1/embeddings", "a", 200),
    ("/v1/embeddings", "a", 429),
    ("/v1/embeddings", "b", 200),
    ("/v1/rerank", "a", 200),
]


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in registry.collect()
        for sample in family.samples
        if family.name.startswith("shoal_gateway_request") and not sample.name.endswith("_created")
    }


def _latency_histogram(name: str, labels: list[str], registry: CollectorRegistry) -> Histogram:
    return Histogram(name, "", labels, buckets=LATENCY_BUCKETS, registry=registry)


def _observed_one_by_one(requests) -> CollectorRegistry:
    registry = CollectorRegistry()
    counter = Counter("shoal_gateway_requests", "", ["route", "model", "status"], registry=registry)
    histogram = _latency_histogram("shoal_gateway_request_seconds", ["route", "model"], registry)
    for route, model, status, seconds in requests:
        counter.labels(route, model, str(status)).inc()
        histogram.labels(route, model).observe(seconds)
    return registry


def test_flushed_counts_equal_the_values_observed_one_by_one():
    requests = [
        (*key, seconds * (1 + i)) for i, key in enumerate(REQUESTS) for seconds in LATENCIES
    ]
    metrics = GatewayMetrics()
    for request in requests[:20]:
        metrics.observe_request(*request)
    metrics.flush()  # a flush between requests: the next ones add to what it wrote
    for request in requests[20:]:
        metrics.observe_request(*request)

    expected = _samples(_observed_one_by_one(requests))
    assert _samples(metrics.readable_registry()) == expected
    # 4 counts; 3 histograms of a bucket a bound, +Inf, _count and _sum.
    assert len(expected) == 4 + 3 * (len(LATENCY_BUCKETS) + 3)
    assert b'shoal_gateway_requests_total{model="a",route="/v1/embeddings",status="429"} 11.0' in (
        metrics.render()
    )


def test_counts_wait_for_the_flush_and_are_written_once():
    metrics = GatewayMetrics()
    metrics.observe_request("/v1/embeddings", "a", 200, 0.01)
    count = (
        "shoal_gateway_requests_total",
        (("model", "a"), ("route", "/v1/embeddings"), ("status", "200")),
    )
    latencies = (
        "shoal_gateway_request_seconds_count",
        (("model", "a"), ("route", "/v1/embeddings")),
    )
    unflushed = _samples(metrics.registry)
    assert unflushed[count] == 0 and unflushed[latencies] == 0  # counted, not yet written
    metrics.flush()
    metrics.flush()  # nothing new: nothing written twice
    written = _samples(metrics.registry)
    assert written[count] == 1.0 and written[latencies] == 1.0


def test_the_workers_items_and_queue_waits_are_written_at_the_flush():
    metrics = WorkerMetrics("m", "sim", simulated=True)
    for seconds in LATENCIES:
        metrics.count_item(200)
        metrics.queue_wait.observe(seconds)
    metrics.count_item(400)
    labels = {"model": "m", "runtime": "sim"}
    expected = CollectorRegistry()
    items = Counter("shoal_worker_items", "", ["model", "runtime", "status"], registry=expected)
    waits = _latency_histogram(
        "shoal_worker_queue_wait_seconds", ["model", "runtime"], expected
    ).labels(**labels)
    for seconds in LATENCIES:
        items.labels(status="200", **labels).inc()
        waits.observe(seconds)
    items.labels(status="400", **labels).inc()

    def read(registry: CollectorRegistry) -> dict[tuple[str, tuple], float]:
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in registry.collect()
            if family.name in ("shoal_worker_items", "shoal_worker_queue_wait_seconds")
            for sample in family.samples
            if not sample.name.endswith("_created")
        }

    unflushed = read(metrics.registry)
    assert unflushed[("shoal_worker_queue_wait_seconds_count", tuple(sorted(labels.items())))] == 0
    metrics.flush()
    assert read(metrics.registry) == read(expected)
    metrics.count_item(400)
    assert b'shoal_worker_items_total{model="m",runtime="sim",status="400"} 2.0' in metrics.render()
