"""Gateway and queue overhead, with the SIMULATED runtime at zero cost (`sim-zero`).

With no compute, a request's whole latency is what the cluster adds: HTTP, the partial
decode, the JetStream publish and its ack, the pull, the worker's decode and encode, the
reply over core NATS. Measured for each HTTP server the gateway can run on.

    python -m bench.overhead [--seconds 10] [--client wrk|python]
"""

from __future__ import annotations

import argparse
import time

from bench.harness import (
    UpCluster,
    cpu_share,
    machine_facts,
    run_load,
    write_result,
    wrk_available,
)

MODEL = "sim-zero"


def measure(http_server: str, seconds: float, client: str, workers: int) -> dict:
    with UpCluster("--model", MODEL, "--workers", str(workers), "--http-server", http_server) as up:
        run_load(up.url, MODEL, 8, min(2.0, seconds), client)  # warm up
        idle = run_load(up.url, MODEL, 1, seconds, client)
        before, started = up.component_cpu_seconds(), time.monotonic()
        saturated = run_load(up.url, MODEL, 64, seconds, client)
        cores = cpu_share(before, up.component_cpu_seconds(), time.monotonic() - started)
    return {
        "http_server": http_server,
        "workers": workers,
        "one_client": idle,
        "saturated_64": saturated,
        "cores_used_at_saturation": cores,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument(
        "--client", choices=("wrk", "python"), default="wrk" if wrk_available() else "python"
    )
    parser.add_argument("--servers", default="uvicorn,granian")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--out", default="overhead")
    args = parser.parse_args()
    runs = [measure(s, args.seconds, args.client, args.workers) for s in args.servers.split(",")]
    print(
        f"{'server':<9} {'p50 ms (1 client)':>18} {'p99 ms':>8} {'req/s (64)':>11} "
        f"{'p50 ms (64)':>12} {'p99 ms':>8}  cores used (64)"
    )
    for run in runs:
        one, sat = run["one_client"], run["saturated_64"]
        print(
            f"{run['http_server']:<9} {one.p50_ms:>18.2f} {one.p99_ms:>8.2f} {sat.rps:>11.0f} "
            f"{sat.p50_ms:>12.2f} {sat.p99_ms:>8.2f}  {run['cores_used_at_saturation']}"
        )
    path = write_result(
        args.out,
        {
            "machine": machine_facts(),
            "client": args.client,
            "runtime": "sim (simulated, zero cost)",
            "runs": runs,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
