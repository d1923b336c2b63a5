"""A seconds-long run of the overhead benchmark, so the harness keeps working."""

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
