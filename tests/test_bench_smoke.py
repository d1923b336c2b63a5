"""Seconds-long runs of benchmarks, so their harnesses keep working."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import TEST_ENV


def test_overhead_benchmark_smoke(tmp_path: Path):
    out = tmp_path / "overhead.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.overhead",
            "--seconds",
            "1",
            "--client",
            "python",
            "--servers",
            "uvicorn",
            "--out",
            str(out),
        ],
        cwd=Path(__file__).parent.parent,
        env={**os.environ, **TEST_ENV},
        check=True,
        timeout=120,
    )
    result = json.loads(out.read_text())
    run = result["runs"][0]
    assert result["runtime"].startswith("sim (simulated")
    for load in (run["one_client"], run["saturated_64"]):
        assert load["requests"] > 0 and load["errors"] == 0
        assert 0 < load["p50_ms"] <= load["p99_ms"]
    assert run["cores_used_at_saturation"]["gateway"] > 0


def test_metrics_cost_benchmark_smoke():
    """Both of prometheus_client's modes, each in its own process, both ways of counting."""
    result = subprocess.run(
        [sys.executable, "-m", "bench.metrics_cost", "--requests", "3000", "--repeats", "1"],
        cwd=Path(__file__).parent.parent,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    rows = {line.split()[0]: line.split()[1:] for line in result.stdout.splitlines()[1:]}
    assert set(rows) == {"one_process", "shared"}
    assert all(float(value) > 0 for figures in rows.values() for value in figures)
