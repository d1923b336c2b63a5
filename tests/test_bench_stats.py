"""bench.stats: ratios paired by round, and a bootstrap that respects sweeps."""

from __future__ import annotations

import pytest

from bench.stats import median_paired_ratio, two_level_bootstrap_median


def test_each_round_is_compared_with_its_own_round():
    # The machine is slower in round 2 and both sides fall together: paired by round, the
    # cluster is a steady 0.9 of in-process; paired across rounds it would read 1.35 and 0.6.
    cluster = [270.0, 180.0]
    in_process = [300.0, 200.0]
    assert median_paired_ratio(cluster, in_process) == pytest.approx(0.9)
    assert median_paired_ratio(cluster, list(reversed(in_process))) == pytest.approx(0.975)


def test_rounds_must_pair_up():
    with pytest.raises(ValueError):
        median_paired_ratio([270.0, 180.0], [300.0])


def test_the_interval_resamples_whole_groups():
    # Nine rounds of one sweep at 1.0, one round of another at 0.8. Pooled as ten independent
    # values the median's 5th percentile is 1.0 (it would need six draws of the one 0.8);
    # resampling sweeps first, a quarter of the draws take only the second sweep.
    low, high = two_level_bootstrap_median([[1.0] * 9, [0.8]])
    assert (low, high) == (0.8, 1.0)
    assert two_level_bootstrap_median([[1.0, 1.0], [1.0]]) == (1.0, 1.0)
