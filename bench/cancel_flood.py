"""What a burst of clients leaving costs: messages through NATS and CPU of each part.

`shoal up` with N workers of a SIMULATED slow model (1 s a batch, so the abandoned requests
are still queued or pulled when their clients go); `--abandon` raw connections each send one
request and then all close at once. Over the seconds after the close, from nats-server's
/varz and the processes' CPU time: the messages nats-server delivered (every worker of the
model hears every cancel) and the CPU each part spent.

    python -m bench.cancel_flood [--workers 16] [--abandon 1536] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import urllib.request

from bench.harness import UpCluster, machine_facts, write_result
from shoal.process import free_port

MODEL = "sim-flood"


def _varz(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/varz", timeout=5) as answer:
        return json.load(answer)


async def _connect_and_send(url: str, count: int) -> list[asyncio.StreamWriter]:
    """`count` connections, each with one embeddings request sent and not read."""
    host, port = url.removeprefix("http://").split(":")
    writers = []
    for i in range(count):
        body = json.dumps({"model": MODEL, "input": f"abandoned {i}"}).encode()
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            f"POST /v1/embeddings HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        writers.append(writer)
    await asyncio.gather(*(writer.drain() for writer in writers))
    return writers


def one_round(up: UpCluster, monitor_port: int, abandon: int, settle_s: float) -> dict:
    """Send, let the requests reach the queue, close every connection at once, measure."""
    loop = asyncio.new_event_loop()
    try:
        writers = loop.run_until_complete(_connect_and_send(up.url, abandon))
        loop.run_until_complete(asyncio.sleep(1.0))  # queued, some pulled
        varz, cpu = _varz(monitor_port), up.component_cpu_seconds()
        for writer in writers:
            writer.close()
        loop.run_until_complete(asyncio.sleep(settle_s))
    finally:
        loop.close()
    after_varz, after_cpu = _varz(monitor_port), up.component_cpu_seconds()
    return {
        "nats_in_msgs": after_varz["in_msgs"] - varz["in_msgs"],
        "nats_out_msgs": after_varz["out_msgs"] - varz["out_msgs"],
        "cpu_ms": {
            name: round(1000 * (after_cpu.get(name, 0.0) - cpu.get(name, 0.0)), 1)
            for name in after_cpu
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--abandon", type=int, default=1536)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settle", type=float, default=2.0, help="seconds measured after")
    parser.add_argument("--out", default="cancel_flood")
    args = parser.parse_args()
    monitor_port = free_port()
    sim = ["--runtime", "sim", "--option", "batch_ms=1000", "--option", "token_us=0"]
    rounds = []
    with UpCluster(
        "--model",
        MODEL,
        *sim,
        "--max-batch-items",
        "32",
        "--workers",
        str(args.workers),
        env={"SHOAL_NATS_MONITOR_PORT": str(monitor_port)},
    ) as up:
        up.reported_metrics_urls()
        for i in range(args.rounds):
            result = one_round(up, monitor_port, args.abandon, args.settle)
            rounds.append(result)
            print(
                f"round {i + 1}: {args.abandon} clients gone: nats-server delivered "
                f"{result['nats_out_msgs']} messages, took in {result['nats_in_msgs']}; "
                f"CPU ms {result['cpu_ms']}",
                flush=True,
            )
            time.sleep(args.abandon / (32 * args.workers) + 1)  # what was not cancelled runs
    path = write_result(
        args.out,
        {"machine": machine_facts(), "args": vars(args), "rounds": rounds},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
