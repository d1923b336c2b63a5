"""The benchmarks' reader of worker metrics, on what a worker's /metrics really renders."""

from __future__ import annotations

import pytest

from bench.fleet_metrics import parse_counters, window
from shoal.observability.metrics import WorkerMetrics


def _rendered(*served: tuple[str, list[int], float, float]) -> str:
    """One worker's /metrics holding a deployment per entry: (model, batch sizes, busy
    seconds, seconds waited for fuller batches)."""
    texts = []
    for model, sizes, busy_s, waited_s in served:
        metrics = WorkerMetrics(model, "sim", simulated=True)
        for size in sizes:
            metrics.batch_items.observe(size)
        metrics.busy_seconds.inc(busy_s)
        metrics.batch_wait.observe(waited_s)
        texts.append(metrics.render().decode())
    return "".join(texts)


def test_counters_sum_a_workers_deployments_or_read_one():
    text = _rendered(("alpha", [4, 6], 1.5, 0.25), ("beta", [10], 0.5, 0.0))
    both = parse_counters(text)
    assert (both.batch_items, both.batches) == (20, 3)
    assert both.busy_s == pytest.approx(2.0)
    assert both.batch_wait_s == pytest.approx(0.25)
    beta = parse_counters(text, "beta")
    assert (beta.batch_items, beta.batches, beta.busy_s) == (10, 1, 0.5)
    assert parse_counters(text, "gamma").batches == 0


def test_a_window_is_the_difference_of_two_readings():
    before = parse_counters(_rendered(("alpha", [4], 1.0, 0.1)))
    after = parse_counters(_rendered(("alpha", [4, 8, 12], 3.0, 0.4)))
    figures = window([before], [after], seconds=4.0)
    assert figures.items == 20 and figures.batches == 2
    assert figures.mean_batch == 10
    assert figures.busy_fractions == [0.5]
    assert figures.batch_wait_s == pytest.approx(0.3)
