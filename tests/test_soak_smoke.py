"""A seconds-long soak (bench/soak.py) on the SIMULATED accelerator: the harness runs, every
request is answered, and it reports RSS for every component (and its anonymous part) and,
with `--nats-diag`, what the embedded nats-server's heap and streams hold."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TEST_ENV

from bench.soak import trend_growth
from shoal.broker.embedded import diagnostic_args


def test_short_soak_answers_everything_and_samples_memory(tmp_path: Path):
    out = tmp_path / "soak.json"
    command = [sys.executable, "-m", "bench.soak", "--model", "sim-embed", "--minutes", "0.25"]
    command += ["--window-s", "5", "--saturation-s", "3", "--load", "0.5", "--out", str(out)]
    command += ["--saturation-warmup-s", "2", "--saturation-windows", "2"]
    command += ["--capacity-s", "3", "--capacity-steps", "2"]
    command += ["--nats-diag", "4"]
    # The verdict's memory bound is not asserted here: seconds are too few to judge growth.
    subprocess.run(
        command,
        cwd=Path(__file__).parent.parent,
        env={**os.environ, **TEST_ENV},
        timeout=180,
        check=False,
    )
    result = json.loads(out.read_text())
    assert len(result["windows"]) == 3
    closed = result["closed_loop_rps"]
    assert closed > 0 and len(result["saturation_windows_rps"]) == 2
    # Saturation is bisected with open-loop probes between half the closed-loop rate and all
    # of it: the second probe went up from the first if it kept up, down if it fell behind;
    # saturation is the highest rate kept up with (the lower bound if none was), and the rate
    # offered is --load of it.
    first, second = result["capacity_probes"]
    assert first["offered_rps"] == pytest.approx(0.75 * closed)
    assert second["offered_rps"] == pytest.approx((0.875 if first["kept_up"] else 0.625) * closed)
    kept = [p["offered_rps"] for p in (first, second) if p["kept_up"]]
    assert result["saturation_rps"] == pytest.approx(max(kept, default=0.5 * closed))
    assert result["offered_rps"] == pytest.approx(0.5 * result["saturation_rps"])
    assert all(0 < p["busy"] <= 1 for p in (first, second))
    assert result["errors"] == 0 and result["lost"] == 0
    assert all(w["p99_ms"] > 0 and 0 < w["busy"] <= 1 for w in result["windows"])
    for component in ("gateway", "worker", "nats"):
        assert result["rss_final_mb"][component] > 10, result["rss_final_mb"]
        assert result["rss_peak_after_warmup_mb"][component] >= result["rss_final_mb"][component]
        # Its anonymous part beside it: some, and less than all (code pages are file-backed).
        anon = result["rss_final_mb"][f"{component} anon"]
        assert 0 < anon < result["rss_final_mb"][component]
    # nats-server's monitoring and profiling ports were open, and read, for this run only.
    diagnostics = result["nats_diagnostics"]
    assert diagnostics["errors"] == [] and len(diagnostics["samples"]) >= 3
    last = diagnostics["samples"][-1]
    assert last["rss_mb"] > 5 and last["memstats"]["HeapInuse"] > 0
    assert last["memstats"]["HeapAlloc"] <= last["memstats"]["HeapInuse"]
    assert last["heap_sites"], "the heap profile named no allocation site"
    assert last["streams"]["SHOAL_WORK"]["last_seq"] > 0  # the soak's work went through it
    assert "SHOAL_WORK" in last["store_files"]


def test_nats_diagnostic_ports_are_off_unless_asked_for():
    assert diagnostic_args({}) == []
    asked = {"SHOAL_NATS_MONITOR_PORT": "8222", "SHOAL_NATS_PROFILE_PORT": " 6060 "}
    assert diagnostic_args(asked) == ["--http_port", "8222", "--profile", "6060"]
    with pytest.raises(ValueError, match="SHOAL_NATS_PROFILE_PORT"):
        diagnostic_args({"SHOAL_NATS_PROFILE_PORT": "yes"})


def test_rss_growth_is_judged_by_its_trend_not_the_phase_of_a_saw_tooth():
    def saw(t: float) -> float:  # nats-server's RSS in the 30-minute run: 6 MB up and down
        return 30.0 + 6.0 * abs((t % 360) / 180 - 1)

    level = [(float(t), {"nats": saw(t)}) for t in range(0, 1800, 5)]
    assert abs(trend_growth(level, "nats", 60.0)) < 0.03
    rising = [(t, {"nats": rss["nats"] * (1 + 0.15 * t / 1800)}) for t, rss in level]
    assert trend_growth(rising, "nats", 0.0) == pytest.approx(0.15, abs=0.03)
    assert trend_growth(level[:1], "nats", 0.0) == 0.0  # too few samples to say
