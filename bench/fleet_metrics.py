"""Per-worker counters from workers' Prometheus /metrics, for Shoal and push workers alike.

Both kinds export Shoal's metric names (shoal.observability.metrics.WorkerMetrics), so busy
fraction and batch sizes over a measured window are computed the same way for both: the
difference of `shoal_worker_busy_seconds_total` (time inside the runtime's batch call, from
BusyMeter) and of the `shoal_worker_batch_items` histogram between two scrapes.
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


@dataclass(frozen=True)
class WindowFigures:
    """What the workers did between two scrapes."""

    busy_fractions: list[float]  # one per worker
    busy_mean: float
    busy_min: float
    mean_batch: float
    batches: float
    items: float


def scrape(urls: list[str]) -> list[WorkerCounters]:
    """Every worker's counters now (one GET each)."""
    counters = []
    for url in urls:
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        counters.append(
            WorkerCounters(
                busy_s=_metric(text, "shoal_worker_busy_seconds_total"),
                batch_items=_metric(text, "shoal_worker_batch_items_sum"),
                batches=_metric(text, "shoal_worker_batch_items_count"),
            )
        )
    return counters


def window(
    before: list[WorkerCounters], after: list[WorkerCounters], seconds: float
) -> WindowFigures:
    fractions = [
        round((a.busy_s - b.busy_s) / seconds, 4) for b, a in zip(before, after, strict=True)
    ]
    items = sum(a.batch_items - b.batch_items for b, a in zip(before, after, strict=True))
    batches = sum(a.batches - b.batches for b, a in zip(before, after, strict=True))
    return WindowFigures(
        busy_fractions=fractions,
        busy_mean=round(sum(fractions) / len(fractions), 4) if fractions else 0.0,
        busy_min=min(fractions) if fractions else 0.0,
        mean_batch=round(items / batches, 2) if batches else 0.0,
        batches=batches,
        items=items,
    )


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0
