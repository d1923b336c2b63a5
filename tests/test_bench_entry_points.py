"""Every benchmark entry point still imports and parses its flags after a change in src/.

The longer smoke runs (tests/test_bench_smoke.py, test_push_vs_pull_smoke.py,
test_bench_hotpath.py) exercise a few of them end to end; this catches a renamed or removed
name in any of them in seconds.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _bench_modules() -> list[Path]:
    """bench/'s own modules: not what lies in its hidden directories (the peers' virtualenvs
    that bench/peers/install.sh makes under bench/.peers/, results)."""
    return [
        path
        for path in (ROOT / "bench").rglob("*.py")
        if not any(part.startswith(".") for part in path.relative_to(ROOT).parts)
    ]


ENTRY_POINTS = sorted(
    ".".join(path.relative_to(ROOT).with_suffix("").parts)
    for path in _bench_modules()
    if 'if __name__ == "__main__"' in path.read_text()
)


def test_there_are_entry_points():
    assert "bench.push_vs_pull" in ENTRY_POINTS and "bench.fleet" in ENTRY_POINTS


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_entry_point_help(module: str):
    result = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "usage" in result.stdout.lower()
