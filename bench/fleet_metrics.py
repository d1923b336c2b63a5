"""Per-worker counters from workers' Prometheus /metrics, for Shoal and push workers alike.

Both kinds export Shoal's metric names (shoal.observability.metrics.WorkerMetrics), so busy
fraction and batch sizes over a measured window are computed the same way for both: the
difference of `shoal_worker_busy_seconds_total` (time inside the runtime's batch call, from
BusyMeter) and of the `shoal_worker_batch_items` histogram between two scrapes. This is the
benchmarks' one reader of worker metrics.
"""

from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerCounters:
    """One worker's cumulative counters at one moment."""

    busy_s: float
    batch_items: float
    batches: float
    batch_wait_s: float  # seconds spent waiting for fuller batches (the adaptive wait)


@dataclass(frozen=True)
class WindowFigures:
    """What the workers did between two scrapes."""

    busy_fractions: list[float]  # one per worker
    busy_mean: float
    busy_min: float
    mean_batch: float
    batches: float
    items: float
    batch_wait_s: float  # all workers together


def scrape(urls: list[str], model: str | None = None) -> list[WorkerCounters]:
    """Every worker's counters now (one GET each): summed over the deployments a worker
    holds, or only `model`'s series where it is given."""
    counters = []
    for url in urls:
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        counters.append(parse_counters(text, model))
    return counters


def parse_counters(text: str, model: str | None = None) -> WorkerCounters:
    """One worker's counters from its /metrics text (see `scrape`)."""
    return WorkerCounters(
        busy_s=_metric(text, "shoal_worker_busy_seconds_total", model),
        batch_items=_metric(text, "shoal_worker_batch_items_sum", model),
        batches=_metric(text, "shoal_worker_batch_items_count", model),
        batch_wait_s=_metric(text, "shoal_worker_batch_wait_seconds_sum", model),
    )


def window(
    before: list[WorkerCounters], after: list[WorkerCounters], seconds: float
) -> WindowFigures:
    fractions = [
        round((a.busy_s - b.busy_s) / seconds, 4) for b, a in zip(before, after, strict=True)
    ]
    items = sum(a.batch_items - b.batch_items for b, a in zip(before, after, strict=True))
    batches = sum(a.batches - b.batches for b, a in zip(before, after, strict=True))
    waited = sum(a.batch_wait_s - b.batch_wait_s for b, a in zip(before, after, strict=True))
    return WindowFigures(
        busy_fractions=fractions,
        busy_mean=round(sum(fractions) / len(fractions), 4) if fractions else 0.0,
        busy_min=min(fractions) if fractions else 0.0,
        mean_batch=round(items / batches, 2) if batches else 0.0,
        batches=batches,
        items=items,
        batch_wait_s=round(waited, 4),
    )


def _metric(text: str, name: str, model: str | None) -> float:
    """The sum of the series of `name` (only those labelled `model`, where given)."""
    total = 0.0
    for match in re.finditer(rf"^{name}(?:{{([^}}]*)}})? (\S+)$", text, re.MULTILINE):
        labels = (match.group(1) or "").split(",")
        if model is None or f'model="{model}"' in labels:
            total += float(match.group(2))
    return total
