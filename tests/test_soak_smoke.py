"""A seconds-long soak (bench/soak.py) on the SIMULATED accelerator: the harness runs, every
request is answered, and it reports RSS for every component."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import TEST_ENV


def test_short_soak_answers_everything_and_samples_memory(tmp_path: Path):
    out = tmp_path / "soak.json"
    command = [sys.executable, "-m", "bench.soak", "--model", "sim-embed", "--minutes", "0.25"]
    command += ["--window-s", "5", "--saturation-s", "3", "--load", "0.5", "--out", str(out)]
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
    assert result["saturation_rps"] > 0 and result["offered_rps"] > 0
    assert result["errors"] == 0 and result["lost"] == 0
    assert all(w["p99_ms"] > 0 for w in result["windows"])
    for component in ("gateway", "worker", "nats"):
        assert result["rss_final_mb"][component] > 10, result["rss_final_mb"]
