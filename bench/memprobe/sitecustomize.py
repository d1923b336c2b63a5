"""Bench-only memory probe for the processes `shoal up` starts: why does a worker's RSS step?

Put this folder on `PYTHONPATH` and set `SHOAL_MEMPROBE_DIR`; every Python process whose
command line names a Shoal component (`worker`, `gateway`, `up`) then starts a daemon thread
that appends one JSON line every `SHOAL_MEMPROBE_INTERVAL` seconds (default 5) to
`<dir>/<component>-<pid>.jsonl`:

- `rss_mb`, `anon_mb` (from /proc/self/status) and the thread count;
- glibc's `mallinfo2`: bytes the allocator holds in its arenas (`arena_mb`), of which in use
  (`used_mb`) and free but kept (`free_mb`), mmapped chunks (`mmap_mb`), and the number of
  arenas, each arena's size and free bytes (`malloc_info`): RSS held by free-but-kept
  chunks is fragmentation, not a leak;
- in a worker, the largest batch run so far (items and padded width) and how many batches set a
  new high-water mark: a tensor larger than any before is one-time growth, not a leak;
- with `SHOAL_MEMPROBE_TRACEMALLOC=1`, Python's traced bytes and the ten allocation sites that
  grew most since the previous sample (tracemalloc slows the process: diagnosis only);
- with `SHOAL_MEMPROBE_TRIM=1`, RSS after `malloc_trim(0)` (`trimmed_rss_mb`): what glibc
  hands back when asked, i.e. how much of RSS was free memory it kept.

Nothing here changes Shoal; without `SHOAL_MEMPROBE_DIR` the module does nothing.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import sys
import threading
import time


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _component() -> str | None:
    for name in ("worker", "gateway", "up"):
        if name in sys.argv[1:3]:
            return name
    return None


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


class _Batches:
    """The largest batch a torch embedding runtime has run, patched into `_forward`."""

    def __init__(self) -> None:
        self.count = 0
        self.max_items = 0
        self.max_width = 0
        self.max_cells = 0  # items x padded width: what sizes the activations
        self.new_highs = 0
        self.patched = False

    def patch(self) -> None:
        module = sys.modules.get("shoal.runtimes.torch_st")
        if self.patched or module is None:
            return
        cls = module.TorchEmbeddingRuntime
        original = cls._forward
        batches = self

        def _forward(runtime, features, order, adapters):  # type: ignore[no-untyped-def]
            items, width = features["input_ids"].shape
            batches.count += 1
            batches.max_items = max(batches.max_items, int(items))
            batches.max_width = max(batches.max_width, int(width))
            if items * width > batches.max_cells:
                batches.max_cells = int(items * width)
                batches.new_highs += 1
            return original(runtime, features, order, adapters)

        cls._forward = _forward
        self.patched = True


def _run(directory: str, component: str) -> None:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    interval = float(os.environ.get("SHOAL_MEMPROBE_INTERVAL", "5"))
    trim = os.environ.get("SHOAL_MEMPROBE_TRIM") == "1"
    traced = os.environ.get("SHOAL_MEMPROBE_TRACEMALLOC") == "1"
    previous = None
    if traced:
        import tracemalloc

        tracemalloc.start(1)
    batches = _Batches()
    path = os.path.join(directory, f"{component}-{os.getpid()}.jsonl")
    started = time.monotonic()
    while True:
        time.sleep(interval)
        if component == "worker":
            batches.patch()
        info = libc.mallinfo2()
        sample: dict = {
            "t": round(time.monotonic() - started, 1),
            "rss_mb": round(_status_mb("VmRSS"), 1),
            "anon_mb": round(_status_mb("RssAnon"), 1),
            "threads": threading.active_count(),
            "os_threads": len(os.listdir("/proc/self/task")),
            "arena_mb": round(info.arena / 2**20, 1),
            "used_mb": round(info.uordblks / 2**20, 1),
            "free_mb": round(info.fordblks / 2**20, 1),
            "mmap_mb": round(info.hblkhd / 2**20, 1),
            "mmap_chunks": info.hblks,
            "arenas": _arenas(libc),
        }
        if batches.patched:
            sample["batches"] = batches.count
            sample["max_items"] = batches.max_items
            sample["max_width"] = batches.max_width
            sample["new_highs"] = batches.new_highs
        if traced:
            snapshot = tracemalloc.take_snapshot()
            current, _ = tracemalloc.get_traced_memory()
            sample["traced_mb"] = round(current / 2**20, 2)
            if previous is not None:
                growth = snapshot.compare_to(previous, "lineno")[:10]
                sample["grew"] = [
                    [str(stat.traceback), stat.size_diff, stat.count_diff] for stat in growth
                ]
            previous = snapshot
        if trim:
            libc.malloc_trim(0)
            sample["trimmed_rss_mb"] = round(_status_mb("VmRSS"), 1)
        with open(path, "a") as out:
            out.write(json.dumps(sample) + "\n")


def _arenas(libc: ctypes.CDLL) -> list[list[float]]:
    """Each malloc arena's [MB from the system, MB of it free] (glibc's `malloc_info` XML)."""
    libc.open_memstream.restype = ctypes.c_void_p
    buffer, size = ctypes.c_char_p(), ctypes.c_size_t()
    stream = libc.open_memstream(ctypes.byref(buffer), ctypes.byref(size))
    libc.malloc_info(0, ctypes.c_void_p(stream))
    libc.fclose(ctypes.c_void_p(stream))
    text = ctypes.string_at(buffer, size.value).decode()
    libc.free(buffer)
    arenas = []
    for heap in re.findall(r"<heap nr=.*?</heap>", text, re.S):
        current = re.search(r'<system type="current" size="(\d+)"', heap)
        free = re.search(r'<total type="rest" count="\d+" size="(\d+)"', heap)
        arenas.append(
            [
                round(int(current[1]) / 2**20, 1) if current else 0.0,
                round(int(free[1]) / 2**20, 1) if free else 0.0,
            ]
        )
    return arenas


def _start() -> None:
    directory = os.environ.get("SHOAL_MEMPROBE_DIR")
    component = _component() if directory else None
    if directory and component:
        os.makedirs(directory, exist_ok=True)
        threading.Thread(target=_run, args=(directory, component), daemon=True).start()


_start()
