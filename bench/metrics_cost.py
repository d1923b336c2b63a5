"""What counting one request costs the gateway: prometheus_client's values written a request
against Shoal's counts kept in plain Python and flushed in bulk (`GatewayMetrics`).

    python -m bench.metrics_cost [--requests 200000 --repeats 5]

Each way runs in one process with one gateway's metrics (`--shared`: prometheus_client's
multiprocess files, as with several gateway processes on one port, in a fresh directory),
counting the same requests (four statuses, latencies across the buckets); the figure is the
fastest of `--repeats` runs, in microseconds a request, flushes included. Without `--shared`
it runs both modes, each in its own process, since prometheus_client chooses its values
when it is first imported.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from shoal.observability.metrics import MULTIPROCESS_DIR_ENV

FLUSH_EVERY = 1_000  # requests between two flushes: at 4,000/s, 0.25 s's worth


def _requests(count: int) -> list[tuple[str, str, int, float]]:
    statuses = (200, 200, 200, 429)
    return [
        ("/v1/embeddings", "sim-embed", statuses[i % 4], 0.0003 * (1 + i % 97))
        for i in range(count)
    ]


def measure(count: int, repeats: int) -> dict[str, float]:
    """µs a request for each way, in this process's prometheus mode."""
    from shoal.observability.metrics import GatewayMetrics

    requests = _requests(count)
    best = {"prometheus_each_request": float("inf"), "counted_then_flushed": float("inf")}
    for _ in range(repeats):
        metrics = GatewayMetrics()
        children: dict[tuple[str, str, int], tuple] = {}
        began = time.perf_counter()
        for route, model, status, seconds in requests:  # the gateway before 06f5fbd
            key = (route, model, status)
            pair = children.get(key)
            if pair is None:
                pair = children[key] = (
                    metrics.requests.labels(route, model, str(status)),
                    metrics.latency.labels(route, model),
                )
            pair[0].inc()
            pair[1].observe(seconds)
        each = (time.perf_counter() - began) / count * 1e6

        metrics = GatewayMetrics()
        began = time.perf_counter()
        for i, request in enumerate(requests):
            metrics.observe_request(*request)
            if i % FLUSH_EVERY == 0:
                metrics.flush()
        metrics.flush()
        counted = (time.perf_counter() - began) / count * 1e6
        best["prometheus_each_request"] = min(best["prometheus_each_request"], each)
        best["counted_then_flushed"] = min(best["counted_then_flushed"], counted)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shared", action="store_true", help="in this process: shared mode")
    parser.add_argument("--one", action="store_true", help="in this process: as it is")
    args = parser.parse_args()
    if args.one or args.shared:
        print(json.dumps(measure(args.requests, args.repeats)))
        return
    results = {}
    for mode in ("one_process", "shared"):
        env = dict(os.environ)
        env.pop(MULTIPROCESS_DIR_ENV, None)
        with tempfile.TemporaryDirectory(prefix="shoal-metrics-cost-") as directory:
            flag = "--one"
            if mode == "shared":
                env[MULTIPROCESS_DIR_ENV] = directory
                flag = "--shared"
            command = [sys.executable, "-m", "bench.metrics_cost", flag]
            command += ["--requests", str(args.requests), "--repeats", str(args.repeats)]
            out = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
        results[mode] = json.loads(out.stdout)
    print(f"{'mode':<12} {'prometheus each request':>24} {'counted, then flushed':>22}  us/request")
    for mode, figures in results.items():
        each, counted = figures["prometheus_each_request"], figures["counted_then_flushed"]
        print(f"{mode:<12} {each:>24.2f} {counted:>22.2f}")


if __name__ == "__main__":
    main()
