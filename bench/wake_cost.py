"""What the same Python work costs right after a pause: the worker's batch of requests, run
back to back and run after sleeping.

    python -m bench.wake_cost [--batch 32 --pauses 0,0.01,0.1 --repeats 3]

A worker on a slow device (100 ms a batch) does its Python work in bursts between sleeps; on
the fast GPU-like device it works without pause. Measured in the cluster, its CPU per request
at 200 req/s in batches of 32 was 2-4x what it is at ~10,000 req/s in batches of ~110
(docs/benchmarks.md, "One worker at 200 req/s with batches of 32"), with no one function
to blame. This measures, in one process, the CPU time (`time.thread_time`) of one batch of
the worker's own per-item work (decode each request, encode its embedding response) run
after sleeping each of `--pauses` seconds: the median over many batches. A pause lets the
core's caches and predictors go to other processes and the core itself go idle, and the next
burst pays for it; how much is the machine's, not Shoal's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import msgspec
import numpy as np

from bench.harness import SENTENCE
from shoal.api.embeddings import EmbeddingsRequest, encode_embeddings_response

DIMENSIONS = 384  # all-MiniLM-L6-v2's
BATCHES_PER_PAUSE_S = 6.0  # each pause length runs for about this many seconds (at least 50)


def worker_batch(bodies: list[bytes], vector: np.ndarray) -> None:
    """One batch of the worker's per-item Python work: parse each request, encode its answer."""
    for body in bodies:
        request = msgspec.json.decode(body, type=EmbeddingsRequest)
        encode_embeddings_response(request, vector, [17], request.model)


def median_batch_us(bodies: list[bytes], vector: np.ndarray, pause_s: float) -> float:
    """Median CPU microseconds of a batch run `pause_s` after the previous one ended."""
    count = max(50, min(2000, round(BATCHES_PER_PAUSE_S / max(pause_s, 0.003))))
    costs = []
    for _ in range(count):
        if pause_s:
            time.sleep(pause_s)
        started = time.thread_time_ns()
        worker_batch(bodies, vector)
        costs.append(time.thread_time_ns() - started)
    return statistics.median(costs) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32, help="requests in a batch")
    parser.add_argument("--pauses", default="0,0.01,0.1", help="seconds of sleep before a batch")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over all the pauses")
    args = parser.parse_args()
    pauses = [float(p) for p in args.pauses.split(",")]
    bodies = [
        msgspec.json.encode(
            {"model": "m", "input": SENTENCE.format(i=n), "encoding_format": "base64"}
        )
        for n in range(args.batch)
    ]
    vector = np.random.default_rng(0).random((1, DIMENSIONS), dtype=np.float32)
    worker_batch(bodies, vector)  # imports and first-call costs out of the way
    print(f"CPU us a batch of {args.batch} (median); ratio to back to back in the same round")
    print("round " + "".join(f"{f'pause {p:g} s':>22}" for p in pauses))
    for round_ in range(1, args.repeats + 1):
        costs = [median_batch_us(bodies, vector, pause) for pause in pauses]
        base = costs[pauses.index(0)] if 0 in pauses else costs[0]
        cells = "".join(f"{f'{cost:8.1f} ({cost / base:4.2f}x)':>22}" for cost in costs)
        print(f"{round_:5d} {cells}", flush=True)


if __name__ == "__main__":
    main()
