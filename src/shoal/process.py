"""Process-level setup shared by Shoal's processes: child-process hygiene for everything that
starts processes, and the garbage collector's setting for those that serve requests."""

from __future__ import annotations

import ctypes
import gc
import signal
import sys

_PR_SET_PDEATHSIG = 1


def child_preexec() -> None:
    """Runs in a child before exec: the child gets SIGTERM if its parent dies.

    So a supervisor killed with SIGKILL still leaves no nats-server, gateway or worker behind.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


# CPython runs a young-generation collection whenever the container objects allocated and not
# yet freed pass this count. Its default, 700, is below what a loaded gateway or worker holds
# for its requests in flight (a request's scope, task, futures and structs), so the count
# passed it every few requests: the gateway ran ~110 collections a second at 6,000-7,600
# requests/s and spent 9-10% of its CPU in them (timed with gc.callbacks under bench.hotpath's
# load; docs/benchmarks.md, "The garbage collector"). Above the working set, the count rises
# only with objects that outlive their request, and collections become rare.
YOUNG_GENERATION_THRESHOLD = 10_000


def tune_garbage_collector() -> None:
    """Raise the young generation's collection threshold (`YOUNG_GENERATION_THRESHOLD`) in a
    process that serves requests; the older generations keep their ratios."""
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_GENERATION_THRESHOLD, older, oldest)
