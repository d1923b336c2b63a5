"""Small statistics the benchmarks share: paired ratios and bootstrap intervals of medians.

This machine is shared and noisy, so a benchmark compares two things measured side by side
in the same round (a paired ratio) and says how sure a median is from its rounds (a
bootstrap). One home for both, so the benchmarks' summaries compute them the same way.
"""

from __future__ import annotations

import random
import statistics


def median_paired_ratio(numerators: list[float], denominators: list[float]) -> float:
    """The median over rounds of numerator / denominator measured in the same round."""
    return statistics.median(n / d for n, d in zip(numerators, denominators, strict=True))


def two_level_bootstrap_median(
    groups: list[list[float]], resamples: int = 5000, seed: int = 0
) -> tuple[float, float]:
    """The 5th and 95th percentiles of the median of `groups`' values pooled, resampling the
    groups and then the values within each drawn group.

    Rounds of one sweep share that sweep's machine state, so they are not independent draws;
    resampling only the pooled values would give an interval as if they were, too narrow
    when the groups differ.
    """
    rng = random.Random(seed)
    medians = sorted(
        statistics.median(
            value
            for group in rng.choices(groups, k=len(groups))
            for value in rng.choices(group, k=len(group))
        )
        for _ in range(resamples)
    )
    return medians[resamples // 20], medians[resamples - resamples // 20]
