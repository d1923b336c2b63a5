"""Placement by pulling: which deployed models a worker loads, and which it evicts.

There is no central scheduler. Each fleet worker looks at the queue (every deployed model's
backlog) and at the fleet (which workers hold which model, from their status reports), and
decides for itself:

- load a deployed model that has a backlog and no worker holding it, or whose backlog has
  grown at every look for a while although workers hold it (they cannot keep up);
- when its memory budget would be exceeded, evict its least recently used models first,
  but only models loaded for at least `min_residency_s` that are idle, or that another
  worker holds too (so a model nobody serves is never starved by two workers busy with the
  same other model); a model that only this worker serves and that has work stays, so two
  workers never pass a model back and forth (no thrashing);
- unload a placed model that has had no work for `idle_unload_s` (scale to zero).

The functions here decide; `worker/placer.py` acts.
"""

from __future__ import annotations

import importlib.util
import os
from collections import deque
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

from shoal.protocol import ModelSpec
from shoal.runtimes.registry import estimate_memory_mb as registry_estimate
from shoal.runtimes.registry import is_simulated

GROWTH_SAMPLES = 4  # looks in a row with a growing backlog before a second worker loads
IDLE_FOR_EVICTION_S = 2.0  # a model with work this recently is never evicted


@dataclass(slots=True)
class Resident:
    """A model loaded in this worker, as eviction sees it."""

    name: str
    memory_mb: float
    idle_s: float
    resident_s: float
    pinned: bool
    other_holders: int = 0  # other workers that hold it too


@dataclass
class BacklogHistory:
    """The last few backlog readings of each model."""

    samples: dict[str, deque[int]] = field(default_factory=dict)

    def record(self, model: str, pending: int) -> None:
        self.samples.setdefault(model, deque(maxlen=GROWTH_SAMPLES + 1)).append(pending)

    def growing(self, model: str) -> bool:
        readings = list(self.samples.get(model, ()))
        if len(readings) <= GROWTH_SAMPLES:
            return False
        return all(later > earlier for earlier, later in pairwise(readings))

    def forget(self, keep: set[str]) -> None:
        for model in list(self.samples):
            if model not in keep:
                del self.samples[model]


def models_to_load(
    deployed: list[ModelSpec],
    loaded: set[str],
    backlog: dict[str, int],
    holders: dict[str, int],
    history: BacklogHistory,
) -> list[ModelSpec]:
    """Deployed models this worker should load, most urgent first."""
    wanted = [
        spec
        for spec in deployed
        if spec.name not in loaded
        and backlog.get(spec.name, 0) > 0
        and (holders.get(spec.name, 0) == 0 or history.growing(spec.name))
    ]
    # Models nobody serves come first; among them, the longest queue.
    return sorted(wanted, key=lambda s: (holders.get(s.name, 0) > 0, -backlog.get(s.name, 0)))


def evictions(
    residents: list[Resident], need_mb: float, budget_mb: float, min_residency_s: float
) -> list[str] | None:
    """Models to evict, least recently used first, so `need_mb` fits; None if it cannot."""
    free = budget_mb - sum(r.memory_mb for r in residents)
    if free >= need_mb:
        return []
    evictable = sorted(
        (
            r
            for r in residents
            if not r.pinned
            and r.resident_s >= min_residency_s
            and (r.idle_s >= IDLE_FOR_EVICTION_S or r.other_holders > 0)
        ),
        # Models served elsewhere too go first, then the least recently used.
        key=lambda r: (r.other_holders == 0, -r.idle_s),
    )
    chosen = []
    for resident in evictable:
        if free >= need_mb:
            break
        chosen.append(resident.name)
        free += resident.memory_mb
    return chosen if free >= need_mb else None


def estimate_memory_mb(spec: ModelSpec, measured: dict[str, float]) -> float:
    """What loading a model will take: as measured last time, else from its weights' size
    and its runtime's factor (runtimes/registry.py)."""
    if spec.name in measured:
        return measured[spec.name]
    if is_simulated(spec.runtime):
        return registry_estimate(spec, 0.0)
    return registry_estimate(spec, _source_size_mb(spec.source))


def _source_size_mb(source: str) -> float:
    if source.startswith("package:"):
        found = importlib.util.find_spec(source.removeprefix("package:"))
        if found is None or not found.submodule_search_locations:
            return 0.0
        path = Path(next(iter(found.submodule_search_locations)))
    else:
        path = Path(source).expanduser()
    if path.is_file():
        return path.stat().st_size / 2**20
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                continue
    return total / 2**20
