"""bench.fleet's sweep: the order of its windows, and its summary (the held-out comparison
against the best manual budget)."""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

import pytest

from bench.fleet import held_out_comparison, pooled_held_out, round_order, summarize_sweep


def test_the_best_manual_budget_is_chosen_on_rounds_it_is_not_scored_on():
    # "64" wins two rounds by luck and loses the others; "128" is steady. On the same rounds
    # the ratio of medians scores tuned against whichever median is higher; held out, each
    # round's choice is made without that round's lucky draw.
    rps = {
        "tuned": [100.0, 100.0, 100.0, 100.0],
        "64": [130.0, 90.0, 130.0, 90.0],
        "128": [105.0, 105.0, 105.0, 105.0],
    }
    held_out = held_out_comparison(rps)
    assert held_out["held_out_best_budgets"] == [128, 64, 128, 64]
    # Round 1: chosen on rounds 2-4 (64's median 90 < 128's 105): 100 / 105.
    assert held_out["held_out_ratios"] == [100 / 105, 100 / 90, 100 / 105, 100 / 90]
    assert (
        summarize_sweep(rps)["ratio_tuned_to_held_out_best"]
        == held_out["ratio_tuned_to_held_out_best"]
    )


def test_one_round_has_nothing_to_hold_out():
    assert held_out_comparison({"tuned": [100.0], "64": [110.0]}) == {}


def test_pooled_rounds_keep_each_sweeps_own_held_out_choice():
    # Sweep A's manual 64 is steady at 100; sweep B's manual 128 at 125. Pooled, each round
    # is still scored against its own sweep's choice (tuned / 100 and tuned / 125), not
    # against the other sweep's budgets or rates.
    sweep_a = {"tuned": [95.0, 100.0, 105.0], "64": [100.0, 100.0, 100.0]}
    sweep_b = {"tuned": [100.0, 125.0, 150.0], "128": [125.0, 125.0, 125.0]}
    pooled = pooled_held_out([sweep_a, sweep_b])
    assert pooled["rounds"] == 6
    assert pooled["median_held_out_ratio"] == 1.0
    low, high = pooled["bootstrap_ratio_5_95"]
    assert 0.8 <= low <= 1.0 <= high <= 1.2
    assert pooled_held_out([{"tuned": [100.0], "64": [110.0]}]) == {}


@pytest.mark.parametrize("count", [2, 3, 4, 5, 6])
def test_every_configuration_runs_in_every_position_and_after_every_other(count):
    configs = ["tuned", *(str(2**i) for i in range(5, 5 + count - 1))]
    cycle = count if count % 2 == 0 else 2 * count
    rows = [round_order(configs, r) for r in range(cycle)]
    assert all(sorted(row) == sorted(configs) for row in rows)
    for position in range(count):
        assert Counter(row[position] for row in rows) == Counter(
            {c: cycle // count for c in configs}
        )
    follows = Counter((a, b) for row in rows for a, b in pairwise(row))
    assert set(follows.values()) == {cycle // count}
    assert len(follows) == count * (count - 1)
    assert round_order(configs, cycle) == rows[0]
