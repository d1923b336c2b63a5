"""The adaptive batch wait: when waiting a little for a fuller batch pays, and for how long.

A worker that runs whatever it holds the moment its runtime is free is busy all the time at
moderate load but runs small batches: with a large fixed cost per batch (a GPU's launch and
weight reads, the simulator's `batch_ms`) that wastes most of the device. So before a batch,
a worker holding fewer items than the batch's "knee" waits for more, within bounds:

- The cost curve is measured, not configured: seconds per batch against items per batch,
  fitted as `fixed + per_item * n` over this worker's recent batches and the model's profile
  (worker/profiling.py), so the first batches already know it and a run of batches all of
  one size cannot bend it (`CostCurve`).
- The knee is the smallest batch whose cost per item is within `KNEE_TOLERANCE` of the
  budget-sized batch's: past it, a larger batch saves little. A curve with no fixed cost has
  its knee at 1, so such a runtime never waits.
- It waits for the knee only while the fixed cost dominates the device's time: while the items
  arriving now would take at most half of it (r x per_item <= 1/2, r the rate the load meter
  measured). Otherwise it waits only while the batch it holds is fixed-cost dominated (`held
  <= fixed / per_item`), for the first size past that at most. A wait buys idle device time,
  never latency: with items arriving at a rate r, batches that wait w each settle at n = r x
  (fixed + w) / (1 - r x per_item), so the cycle between batches grows by w / (1 - r x
  per_item) and the device's idle share becomes (1 - r x per_item) x w / (fixed + w): where
  r x per_item <= 1/2 a wait lengthens the cycle by at most 2w and keeps the device idle for
  at least half of w / (fixed + w) (a GPU's launch and weight reads, the simulator's
  `batch_ms`); where the items dominate, each ms of wait costs the queue more and idles the
  device less: all-MiniLM-L6-v2 on this 2-core CPU measured fixed ~9 ms and ~1.75 ms an item
  in service, and at half load (r x per_item ~0.5-0.66 by its meter) waiting for its knee of
  35 only lengthened the queue (p99 130 against 90 ms with the wait off; docs/benchmarks.md).
  The rate, not the batch held, decides first: a closed loop of many connections keeps large
  batches waiting whatever the rate, and on the GPU-like hot-path device (1 ms + ~34 us an
  item, r x per_item ~0.36) stopping at `fixed / per_item` (30) instead of the knee (130)
  cost 5-9% of its throughput (bench.hotpath).
- It never waits when what it holds reaches the knee (or the token budget), and it waits at
  most one fixed cost (a longer wait cannot save more than the fixed cost it amortizes),
  never so long that the batch it waits for would end past the batch latency target.
- The bound shrinks with the load: at most `fixed x sqrt(1 - load)`, where load is the share
  of the device's capacity (a full batch's items per second, from the curve) that the items
  this worker ran lately used. Near capacity a wait buys little headroom and adds up to its
  bound to the tail latency of every request it holds; and when many workers of a model wait
  at once, JetStream deals new messages to their pull requests in turn, so each fills slowly
  and waits out its bound (measured: docs/benchmarks.md, "Adaptive batch wait"). At half load
  it may still wait 0.71 of a fixed cost (batches stay well above the eager policy's), at 90%
  load a third, at saturation not at all. The square root is that balance, not a law: with
  `1 - load`, a worker at half load of the simulated 100 ms device would form batches of
  about n = rate x (fixed + wait) / (1 - rate x per_item) = 18, barely 1.5x the eager 12.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

KNEE_TOLERANCE = 0.10
# Past this share of the device's time going to the items themselves, a wait for the knee
# lengthens the queue more than it idles the device (module docstring).
MAX_ITEMS_SHARE = 0.5
WINDOW = 64  # recent batches the curve is fitted on
MIN_SAMPLES = 8
# The load's memory: a change of load shows within a few seconds, on any device.
LOAD_TIME_CONSTANT_S = 2.0


@dataclass(frozen=True, slots=True)
class CostFit:
    """Seconds per batch of n items: `fixed_s + per_item_s * n`."""

    fixed_s: float
    per_item_s: float

    def seconds(self, items: int) -> float:
        return self.fixed_s + self.per_item_s * items


@dataclass(frozen=True, slots=True)
class WaitPlan:
    """Wait until `target_items` are held, or `max_wait_s` has passed; 0 s: run now."""

    target_items: int
    max_wait_s: float


class CostCurve:
    """What batches cost on this worker: the model's stored profile and its recent batches.

    The profile's points stay in every fit. The recent batches alone cannot always tell a
    line: a closed loop of fewer clients than the budget (64 connections, budget 128) runs
    batch after batch of one size, and once the window held only those, the fit swung with
    their noise (all-MiniLM-L6-v2: fixed 20 -> 81 ms and 1.15 -> 0.16 ms an item within 50
    batches) and the wait planned on it grew with each batch (17 -> 57 ms) for a knee the
    64 clients could never fill (docs/benchmarks.md, "A cost curve that holds its shape").
    With the profile's sizes in, the batches in service set the line's level where they
    run, and the profile keeps its slope."""

    def __init__(self, profile: dict[int, float] | None = None) -> None:
        self._profile: list[tuple[int, float]] = []
        self._samples: deque[tuple[int, float]] = deque(maxlen=WINDOW)
        self.use_profile(profile or {})

    def use_profile(self, profile: dict[int, float]) -> None:
        """Seconds per batch by size, as profiled (a new profile replaces the old one)."""
        self._profile = sorted((int(n), float(s)) for n, s in profile.items() if s > 0)

    def observe(self, items: int, seconds: float) -> None:
        self._samples.append((items, seconds))

    def fit(self) -> CostFit | None:
        """Least squares over the profile's points and the window; None until there are
        enough batches of different sizes to tell the fixed cost from the per-item cost."""
        if len(self._samples) < MIN_SAMPLES and len(self._profile) < 3:
            return None
        points = [*self._profile, *self._samples]
        count = len(points)
        mean_n = sum(n for n, _ in points) / count
        mean_s = sum(s for _, s in points) / count
        spread = sum((n - mean_n) ** 2 for n, _ in points)
        if spread < 1e-9:
            return None
        slope = sum((n - mean_n) * (s - mean_s) for n, s in points) / spread
        per_item = max(0.0, slope)
        fixed = mean_s - per_item * mean_n
        if fixed < 0:
            # A curve that bends up (torch on a CPU: 128 and 256 dearer an item than 32)
            # gives a line below zero at zero items. Clamping its fixed cost alone lifted the
            # line ~25% above the batches that run (all-MiniLM-L6-v2: 164 ms predicted for
            # 125 ms batches of 32), so the next batch was pulled only after this one ended.
            # The line through the origin and the points' centre keeps their level.
            return CostFit(0.0, mean_s / mean_n)
        return CostFit(fixed, per_item)


class LoadMeter:
    """The rate at which this worker's items arrive, measured as the items its batches ran per
    second (in a steady state the two are the same; at saturation it is capacity), with
    exponential decay in time, so that it follows a change of load within a few time
    constants whatever the batch length (a window of batches would lag by seconds on a slow
    device and by milliseconds on a fast one)."""

    def __init__(self, time_constant_s: float = LOAD_TIME_CONSTANT_S) -> None:
        self._tau = time_constant_s
        self._mass = 0.0  # items, each weighted by exp(-age / tau)
        self._at: float | None = None

    def observe(self, items: int, ended_at: float) -> None:
        self._mass = self._decayed(ended_at) + items
        self._at = ended_at

    def items_per_s(self, now: float) -> float:
        """Items per second lately (0 before the first batch, and falling in a quiet spell)."""
        return self._decayed(now) / self._tau

    def load(self, fit: CostFit | None, budget: int, now: float) -> float:
        """The share of the device's capacity (full batches back to back) in use, 0..1; 0
        while the curve is unknown."""
        if fit is None or budget <= 0:
            return 0.0
        capacity = budget / fit.seconds(budget)
        return min(1.0, max(0.0, self.items_per_s(now) / capacity))

    def _decayed(self, now: float) -> float:
        if self._at is None:
            return 0.0
        return self._mass * math.exp(-max(0.0, now - self._at) / self._tau)


def plan_wait(
    fit: CostFit | None, held: int, budget: int, latency_target_s: float, load: float = 0.0
) -> WaitPlan:
    """How long to wait for a fuller batch, holding `held` items, with a budget of `budget`,
    the device's recent `load` (0..1, `LoadMeter.load`) given.

    It waits for the knee while the items arriving now take at most half the device's time,
    and otherwise only while the batch held is fixed-cost dominated, for the first size past
    `fixed / per_item` at most (module docstring)."""
    if fit is None or budget <= 1 or held >= budget or fit.fixed_s <= 0:
        return WaitPlan(held, 0.0)
    target = knee_items(fit, budget)
    if items_share(fit, budget, load) > MAX_ITEMS_SHARE:
        target = min(target, fixed_dominated_items(fit, budget) + 1)
    if held >= target:
        return WaitPlan(held, 0.0)
    spare = math.sqrt(1.0 - min(1.0, max(0.0, load)))
    longest = min(fit.fixed_s * spare, latency_target_s - fit.seconds(target))
    return WaitPlan(target, max(0.0, longest))


def items_share(fit: CostFit, budget: int, load: float) -> float:
    """r x per_item: the share of the device's time the items arriving now take, from the
    load (a share of the capacity at full batches, `LoadMeter.load`)."""
    capacity = budget / fit.seconds(budget)
    return load * capacity * fit.per_item_s


def fixed_dominated_items(fit: CostFit, budget: int) -> int:
    """The largest batch whose fixed cost is at least its items' cost (`budget` when every
    batch's is: a curve with no per-item cost)."""
    if fit.per_item_s <= 0:
        return budget
    return min(budget, math.floor(fit.fixed_s / fit.per_item_s))


def knee_items(fit: CostFit, budget: int) -> int:
    """The smallest batch whose cost per item is within KNEE_TOLERANCE of a full batch's."""
    full = fit.seconds(budget) / budget
    room = (1 + KNEE_TOLERANCE) * full - fit.per_item_s
    if room <= 0:
        return budget
    return max(1, min(budget, math.ceil(fit.fixed_s / room)))
