"""A seconds-long run of the hot-path benchmark (issue 11), so that it keeps working."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TEST_ENV

ROOT = Path(__file__).parent.parent
# bench/ is not an installed package: the repository root makes it importable under plain
# `pytest` as under `python -m pytest`.
sys.path.insert(0, str(ROOT))
from bench.hotpath import device_limit, top_functions  # noqa: E402


@pytest.mark.skipif(shutil.which("wrk") is None, reason="needs wrk (Debian package `wrk`)")
def test_hotpath_benchmark_smoke(tmp_path: Path):
    out = tmp_path / "hotpath.json"
    command = [sys.executable, "-m", "bench.hotpath", "--seconds", "3", "--warmup", "1"]
    command += ["--connections", "8", "--budget", "16", "--json", str(out)]
    subprocess.run(
        command,
        cwd=ROOT,
        env={**os.environ, **TEST_ENV},
        check=True,
        timeout=180,
    )
    result = json.loads(out.read_text())
    assert result["setup"]["budget"] == 16 and result["setup"]["workers"] == 1
    (run,) = result["rounds"]
    assert run["rps"] > 0 and run["load"]["requests"] > 0 and run["load"]["errors"] == 0
    assert 0 < run["ratio_to_limit"] < 1.0  # one worker cannot beat its own device
    assert 16 <= run["tokens_per_item"] <= 18  # ~17-token sentences
    us = run["cpu_us_per_request"]
    for component in ("gateway", "nats", "worker", "wrk"):
        assert us[component] > 0, (component, us)
    assert us["path"] == pytest.approx(us["gateway"] + us["nats"] + us["worker"], abs=0.2)
    device = run["device"]
    assert 0 < device["busy_mean"] <= 1.0
    assert 1 <= device["mean_batch"] <= 16  # within the budget the worker was given
    # 8 connections, envelopes of at most half the budget: 1 to 8 requests a message.
    assert 1 <= run["requests_per_message"] <= 8
    assert result["profiles"] is None  # not asked for


def test_device_limit_is_full_batches_back_to_back():
    # 1 ms + 256 items x 17 tokens x 2 us = 9.704 ms a batch of 256.
    assert device_limit(256, 1.0, 2.0, 17) == pytest.approx(256 / 0.009704)
    assert device_limit(1, 100.0, 0.0, 17) == pytest.approx(10.0)


def test_profile_aggregates_self_and_inclusive_time_by_function():
    raw = "\n".join(
        [
            "main (app.py:3);handle (app.py:10);encode (codec.py:5) 6",
            "main (app.py:3);handle (app.py:12);encode (codec.py:7) 2",  # other lines, same fn
            "main (app.py:3);handle (app.py:11) 2",
            "write (libc.so.6) 0",
        ]
    )
    figures = top_functions(raw, top=5, us_per_request=100.0)
    assert figures["samples"] == 10
    own = {row["function"]: row for row in figures["self"]}
    assert own["encode (codec.py)"]["share"] == pytest.approx(0.8)
    assert own["encode (codec.py)"]["us"] == pytest.approx(80.0)
    assert own["handle (app.py)"]["share"] == pytest.approx(0.2)
    inclusive = {row["function"]: row["share"] for row in figures["inclusive"]}
    assert inclusive["main (app.py)"] == pytest.approx(1.0)
    assert inclusive["handle (app.py)"] == pytest.approx(1.0)
