"""bench.embeddings_throughput's per-round ratio: each cluster window against its own round's
in-process window, not against the other rounds'."""

from __future__ import annotations

import pytest

from bench.embeddings_throughput import median_paired_ratio


def test_each_round_is_compared_with_its_own_in_process_window():
    # The machine is slower in round 2 and both sides fall together: paired by round, the
    # cluster is a steady 0.9 of in-process; paired across rounds it would read 1.35 and 0.6.
    cluster = [270.0, 180.0]
    in_process = [300.0, 200.0]
    assert median_paired_ratio(cluster, in_process) == pytest.approx(0.9)
    assert median_paired_ratio(cluster, list(reversed(in_process))) == pytest.approx(0.975)


def test_rounds_must_pair_up():
    with pytest.raises(ValueError):
        median_paired_ratio([270.0, 180.0], [300.0])
