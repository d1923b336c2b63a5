"""A seconds-long push-vs-pull run on the simulated runtime, so the harness keeps working."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import TEST_ENV

ROOT = Path(__file__).parent.parent
SYSTEMS = ("shoal", "rr", "lor", "p2c")


def test_push_vs_pull_smoke(tmp_path: Path):
    out = tmp_path / "push_vs_pull.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.push_vs_pull",
            "--runtime=sim",
            "--workers=2",
            f"--systems={','.join(SYSTEMS)}",
            "--seconds=0.6",
            "--warmup=0.2",
            "--loads=0.5",
            "--batch-ms=5",
            "--token-us=5",
            "--max-batch-items=8",
            f"--out={out}",
        ],
        cwd=ROOT,
        env={**os.environ, **TEST_ENV, "PYTHONPATH": _pythonpath()},
        check=True,
        timeout=180,
    )
    result = json.loads(out.read_text())
    assert result["setup"]["simulated"] is True
    runs = result["by_workers"]["2"]
    assert set(SYSTEMS) <= set(runs)
    for name in SYSTEMS:
        for measured in (runs[name]["saturation"], runs[name]["loads"]["0.50"]):
            load = measured["load"]
            # Every request answered, and answered 200.
            assert load["sent"] > 0 and load["ok"] == load["sent"] == load["answered"], load
            assert set(load["statuses"]) == {"200"}
            assert 0 < load["p50_ms"] <= load["p99_ms"]
            workers = measured["workers"]
            assert len(workers["busy_fractions"]) == 2  # both workers' own counters were read
            assert all(0.0 <= f <= 1.05 for f in workers["busy_fractions"])
            assert workers["items"] >= 1 and workers["mean_batch"] >= 1
        assert runs[name]["saturation"]["load"]["rps"] > 0


def _pythonpath() -> str:
    """The repository root (for `bench`), after whatever PYTHONPATH the run was given."""
    return os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))


def test_a_push_cluster_whose_port_was_taken_starts_again_on_new_ports():
    """free_ports() probes the ports and the children bind them later: another socket can
    take one in between. The cluster notices its child's exit and starts again on new ports."""
    import socket
    import urllib.request

    from bench.push.cluster import PushCluster
    from shoal.catalog import resolve_model

    cluster = PushCluster(
        resolve_model("sim-zero"), workers=1, policy="rr", cap=8, max_batch_items=8
    )
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cluster.port = taken.getsockname()[1]  # the router's port, in use
        with cluster:
            assert cluster.port != taken.getsockname()[1]
            with urllib.request.urlopen(f"{cluster.url}/healthz", timeout=5) as response:
                assert response.status == 200
