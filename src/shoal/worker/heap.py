"""Handing the C heap's free pages back to the system now and then, so a worker's RSS stays flat.

A torch model on the CPU allocates its activations with glibc's malloc, at sizes set by each
batch (items x padded length). After the first large tensor is freed glibc raises its mmap
threshold (up to 32 MiB), so later tensors come from its arenas, and batches of ever-changing
sizes leave free chunks between live ones that glibc keeps rather than returning: RSS grows in
steps while the bytes in use stay level. The default model alone, 800 batches of 1-256 items
in one thread, went 760 -> 986 MB of RSS with its arenas' bytes in use at 200-209 MB and their
free bytes 206 -> 423 MB (`bench/memprobe/batches.py`); `shoal up` under the soak's load, 624
-> 656 MB in four minutes, all of it free arena bytes (issue 13 part 7, docs/benchmarks.md).

What keeps those chunks apart is, most likely, small ones: the pieces `posix_memalign` (torch's
CPU allocator) cuts off around an aligned block, and other small frees, wait in glibc's
per-thread cache and fast bins unmerged with their free neighbours, so two freed tensors side
by side do not make one hole that a larger tensor fits. With both caches off
(`GLIBC_TUNABLES=glibc.malloc.tcache_count=0:glibc.malloc.mxfast=0`) the same mix levelled off
at 90-113 MB free within 300 batches, against 328-438 MB and growing with them on, at about
the same speed.

`malloc_trim(0)` merges the fast bins (glibc's `mtrim` begins with `malloc_consolidate`) and
returns every whole free page in every arena (madvise), so RSS falls back to what is in use;
under `shoal up` it also stopped the arenas' growth (234 MB from start to end of a 10-minute
soak, against 201 -> 266 MB in four minutes untrimmed). Every `SHOAL_MALLOC_TRIM_S` seconds
(default 10; 0 turns it off) a daemon thread calls it: about a millisecond a call, and the
pages a later batch needs again are faulted back in once per interval (no throughput lost that
could be measured). Under a far faster churn (the runtime alone, flat out) ten seconds bounds
RSS (peaks 820-835 MB against 986-996 untrimmed) without holding it level. Fixing glibc's
mmap threshold instead (`MALLOC_MMAP_THRESHOLD_`) also held RSS flat but cost 19-25% of the
model's throughput, every tensor over it then being mapped and unmapped at each use. Where the
C library has no `malloc_trim` (not glibc) there is nothing to do.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
import time

log = logging.getLogger(__name__)

DEFAULT_TRIM_INTERVAL_S = 10.0


def _malloc_trim() -> ctypes._CFuncPtr | None:
    """glibc's malloc_trim, or None where the C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def start_heap_trimmer(interval_s: float) -> threading.Thread | None:
    """Start the daemon thread that trims the heap every `interval_s` seconds (0: none; it
    lives as long as the process); None when trimming is off or unavailable."""
    if interval_s < 0:
        raise ValueError(f"SHOAL_MALLOC_TRIM_S={interval_s:g} is negative")
    trim = _malloc_trim() if interval_s > 0 else None
    if trim is None:
        return None

    def run() -> None:
        while True:
            time.sleep(interval_s)
            trim(0)

    thread = threading.Thread(target=run, name="shoal-heap-trim", daemon=True)
    thread.start()
    log.debug("trimming the C heap every %g s", interval_s)
    return thread
