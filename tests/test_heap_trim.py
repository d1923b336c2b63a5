"""The worker's heap trimmer (shoal.worker.heap): a process whose C heap holds free pages
behind a live chunk gets them back to the system within an interval, in a real process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from shoal.worker.heap import start_heap_trimmer

# A child that leaves ~190 MB of free chunks in glibc's main arena under one live chunk (so
# glibc's own trim of the heap's top cannot return them), then starts the trimmer and reports
# its RSS before and after one interval.
_CHILD = textwrap.dedent(
    """
    import sys, time
    from shoal.worker.heap import start_heap_trimmer

    def rss_mb():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024

    blocks = [bytearray(100_000) for _ in range(2_000)]  # under the 128 KiB mmap threshold
    keep = blocks[-1]
    del blocks
    before = rss_mb()
    started = start_heap_trimmer(float(sys.argv[1]))
    time.sleep(1.0)
    print(before, rss_mb(), started is not None)
    """
)


def _child(interval_s: float) -> tuple[float, float, bool]:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(interval_s)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    return float(out[0]), float(out[1]), out[2] == "True"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_trimmer_returns_the_free_heap_to_the_system():
    before, after, started = _child(0.2)
    assert started
    assert before > 150, before  # the free chunks were resident
    assert after < before - 100, (before, after)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_without_the_trimmer_the_free_heap_stays_resident():
    before, after, started = _child(0)
    assert not started
    assert after > before - 20, (before, after)


def test_a_negative_interval_is_refused():
    with pytest.raises(ValueError, match="negative"):
        start_heap_trimmer(-1)
