"""The gateway's HTTP layer alone: CPU a request on a route that touches no queue.

    python -m bench.http_layer [--connections 64 --seconds 8 --rounds 2]

One `shoal up` (SIMULATED model `sim-embed`); wrk sends `GET /v1/models`, which the gateway
answers from its deployment directory without NATS, so what is measured is the HTTP server,
the protocol (gateway/http_protocol.py) and the app's routing and response: the part of the
gateway's cost that every request pays. Reports requests/s and the gateway's CPU
microseconds a request (utime + stime from /proc over the window) per round. The figures of
two builds come from alternating runs of this command, each with the build on PYTHONPATH;
the rest of the machine's load moves them by ~10% from minute to minute.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import time

from bench.harness import UpCluster, wrk_available


def measure(up: UpCluster, connections: int, seconds: int) -> tuple[float, float]:
    """(requests/s, gateway CPU us a request) of one wrk window on GET /v1/models."""
    before = up.component_cpu_seconds()
    output = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", f"{up.url}/v1/models"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    after = up.component_cpu_seconds()
    found = re.search(r"(\d+) requests in", output)
    if found is None or " Non-2xx" in output:
        raise RuntimeError(f"wrk failed or got errors:\n{output}")
    requests = int(found.group(1))
    return requests / seconds, 1e6 * (after["gateway"] - before["gateway"]) / requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--seconds", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--label", default="", help="printed at the start of each line")
    args = parser.parse_args()
    if not wrk_available():
        raise SystemExit("bench.http_layer needs wrk on PATH")
    with UpCluster("--model", "sim-embed", "--runtime", "sim") as up:
        time.sleep(3)  # the gateway reads the deployment before it answers /v1/models
        measure(up, args.connections, 1)  # warm-up
        for round_ in range(1, args.rounds + 1):
            rps, gateway_us = measure(up, args.connections, args.seconds)
            print(
                f"{args.label} round {round_}: {rps:8.0f} req/s  gateway {gateway_us:5.1f} us/req",
                flush=True,
            )


if __name__ == "__main__":
    main()
