"""Shoal's hot path on a GPU-like SIMULATED device: throughput against the device's own limit,
and CPU per request of every component (issue 11).

    python -m bench.hotpath [--batch-ms 1 --token-us 2 --budget 256 --connections 256
        --gateways 1 --seconds 20] [--rounds 1] [--json PATH] [--profile DIR --profile-seconds 10]

One `shoal up` (embedded nats-server, one gateway, ONE worker) serving the simulated
embedding device `sim` at `batch_ms + token_us * tokens` per batch (sleeping, so the device
itself costs no CPU), with a batch budget of `--budget` items. wrk sends short sentences
(`bench.harness.run_wrk`: one ~17-token sentence per request, base64) from `--connections`
connections. Each measured window reports:

- throughput, and its ratio to the device's own limit at that budget:
  budget / (batch_ms + budget * tokens_per_item * token_us), i.e. full batches back to back;
- the device's busy fraction and mean batch, from the worker's /metrics over the window
  (`bench.fleet_metrics`; busy is the time in the worker's batch call: the device's sleep plus
  the host-side decode and encode in the runtime thread);
- CPU microseconds per request of the gateway, nats-server, the worker and the supervisor
  (utime + stime from /proc over the window, for the processes `shoal up` started) and of wrk;
- the requests a JetStream message carried (the gateway's envelopes: requests sent over the
  work stream's messages stored in the window).

With `--profile DIR`, one more measured window runs py-spy on the gateway and the worker
(`py-spy record --format raw --gil --nonblocking`, or `--native` for C frames too, which
pauses the process at each sample), writes the raw stacks to DIR and adds each one's top
functions by self time to the report. py-spy costs CPU on the same cores, so that window is
not one of the measured rounds.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from bench.fleet_metrics import scrape, window
from bench.harness import (
    SENTENCE,
    UpCluster,
    component_tree,
    machine_facts,
    run_wrk,
    write_result,
    wrk_available,
)
from shoal.runtimes.sim import simulated_token_count

MODEL = "sim-embed"
PROFILED = ("gateway", "worker")  # the Python components; nats-server is Go


def device_limit(budget: int, batch_ms: float, token_us: float, tokens_per_item: float) -> float:
    """Items per second the simulated device runs at full batches of `budget`, back to back."""
    return budget / (batch_ms / 1e3 + budget * tokens_per_item * token_us / 1e6)


def mean_tokens(requests: int) -> float:
    """Mean simulated tokens of the sentences wrk sent: request n carries sentence n."""
    count = max(1, requests)
    step = max(1, count // 10_000)  # a sample is enough: the length changes with n's digits
    sample = range(1, count + 1, step)
    return statistics.fmean(simulated_token_count(SENTENCE.format(i=n)) for n in sample)


def component_pids(up: UpCluster) -> dict[str, list[int]]:
    """The processes of a running `shoal up`, by component (gateway, worker, nats, ...)."""
    assert up.process is not None
    pids: dict[str, list[int]] = {}
    for pid, name in component_tree(up.process.pid).items():
        pids.setdefault(name, []).append(pid)
    return pids


def measure(up: UpCluster, urls: list[str], args: argparse.Namespace, seconds: float) -> dict:
    """One measured window of wrk load: throughput, the device's figures, CPU per request."""
    before, messages_before = scrape(urls), up.work_messages_stored()
    cpu_before, started = up.component_cpu_seconds(), time.monotonic()
    load = run_wrk(up.url, MODEL, args.connections, seconds)
    elapsed = time.monotonic() - started
    cpu_after = up.component_cpu_seconds()
    device = window(before, scrape(urls), elapsed)
    messages = up.work_messages_stored() - messages_before
    requests = max(1, load.requests)
    cpu_s = {name: cpu_after[name] - cpu_before.get(name, 0.0) for name in cpu_after}
    cpu_s["wrk"] = load.client_cpu_s
    us_per_request = {name: round(1e6 * cpu / requests, 1) for name, cpu in cpu_s.items()}
    us_per_request["path"] = round(
        sum(us_per_request.get(name, 0.0) for name in ("gateway", "nats", "worker")), 1
    )
    tokens = mean_tokens(load.requests)
    limit = device_limit(args.budget, args.batch_ms, args.token_us, tokens)
    return {
        "load": load.summary(),
        "rps": load.rps,
        "tokens_per_item": round(tokens, 2),
        "device_limit_rps": round(limit, 1),
        "ratio_to_limit": round(load.rps / limit, 4),
        "device": asdict(device),
        # Requests a JetStream message carried (the gateway's envelopes).
        "requests_per_message": round(load.requests / max(1, messages), 2),
        "cpu_s": {name: round(cpu, 3) for name, cpu in cpu_s.items()},
        "cores": {name: round(cpu / elapsed, 3) for name, cpu in cpu_s.items()},
        "cpu_us_per_request": us_per_request,
        "window_s": round(elapsed, 3),
    }


def py_spy() -> str | None:
    """py-spy next to this Python (the venv's), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def profile(up: UpCluster, urls: list[str], args: argparse.Namespace) -> dict:
    """py-spy on the gateway and the worker during one more measured window.

    Each function's share of a component's samples is also put in microseconds per request
    (share x the component's CPU per request in that window): an estimate, since a sample
    that holds the GIL is not exactly a CPU-busy one.
    """
    binary = py_spy()
    if binary is None:
        raise SystemExit("--profile needs py-spy: pip install py-spy")
    out = Path(args.profile)
    out.mkdir(parents=True, exist_ok=True)
    pids = component_pids(up)
    spies = {}
    for name in PROFILED:
        raw = out / f"{name}{'-native' if args.native else ''}.txt"
        # --gil: only samples that hold the GIL, i.e. Python at work, not the event loop
        # waiting in epoll or a thread waiting on a lock. --nonblocking: the process is not
        # paused at each sample, which would slow it down (py-spy needs the pause for C frames).
        # --subprocesses: with several gateway processes, the first pid is their parent.
        command = [binary, "record", "--format", "raw", "--gil", "--subprocesses"]
        command += ["-r", str(args.rate)]
        command += ["--native"] if args.native else ["--nonblocking"]
        command += ["-d", str(args.profile_seconds), "-o", str(raw), "--pid", str(pids[name][0])]
        spies[name] = (raw, subprocess.Popen(command, stdout=subprocess.DEVNULL))
    # The load outlasts the recording by a second, so every sample is taken under load.
    measured = measure(up, urls, args, args.profile_seconds + 1)
    failed = [name for name, (_, spy) in spies.items() if spy.wait() != 0]
    if failed:
        raise RuntimeError(f"py-spy failed on {', '.join(failed)} (is ptrace allowed here?)")
    us = measured["cpu_us_per_request"]
    functions = {
        name: top_functions(raw.read_text(), args.top, us[name]) for name, (raw, _) in spies.items()
    }
    return {"native": args.native, "window": measured, "components": functions}


def top_functions(raw: str, top: int, us_per_request: float) -> dict:
    """Self and inclusive sample shares by function from py-spy's raw (folded) stacks.

    A line is `frame;frame;...;leaf count`, a frame `function (file:line)`; the line number is
    dropped so that a function's samples add up over its lines.
    """
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [_function(frame) for frame in stack.split(";")]
        samples = int(count)
        total += samples
        own[frames[-1]] += samples
        for frame in set(frames):
            inclusive[frame] += samples
    share = max(1, total)

    def rows(counts: Counter[str]) -> list[dict]:
        return [
            {
                "function": name,
                "share": round(n / share, 4),
                "us": round(us_per_request * n / share, 1),
            }
            for name, n in counts.most_common(top)
        ]

    return {"samples": total, "self": rows(own), "inclusive": rows(inclusive)}


def _function(frame: str) -> str:
    """`name (dir/file)` of a frame `name (path:line)` or, for C, `name (library)`."""
    name, _, where = frame.partition(" (")
    where = where.removesuffix(")")
    path, _, line = where.rpartition(":")
    if not line.isdigit():
        path = where
    return f"{name} ({'/'.join(Path(path).parts[-2:])})" if path else name


def report(args: argparse.Namespace, rounds: list[dict]) -> None:
    print(
        f"hot path: SIMULATED device {args.batch_ms:g} ms/batch + {args.token_us:g} us/token, "
        f"budget {args.budget}, {args.gateways} gateway process(es), {args.connections} wrk "
        f"connections, {args.seconds:g} s a round"
    )
    head = f"{'round':>5} {'req/s':>8} {'limit':>8} {'ratio':>6} {'busy':>5} {'batch':>6} "
    head += f"{'p50 ms':>7} {'p99 ms':>7} {'err':>4} | CPU us/request: "
    parts = ("gateway", "nats", "worker", "path", "supervisor", "wrk")
    print(head + " ".join(f"{name:>8}" for name in parts))
    for i, run in enumerate(rounds, 1):
        load, device, us = run["load"], run["device"], run["cpu_us_per_request"]
        print(
            f"{i:>5} {run['rps']:>8.0f} {run['device_limit_rps']:>8.0f} "
            f"{run['ratio_to_limit']:>6.3f} {device['busy_mean']:>5.2f} "
            f"{device['mean_batch']:>6.1f} {load['p50_ms']:>7.1f} {load['p99_ms']:>7.1f} "
            f"{load['errors']:>4} |                 "
            + " ".join(f"{us.get(name, 0.0):>8.1f}" for name in parts)
        )
    cores = rounds[-1]["cores"]
    print("cores used (last round): " + ", ".join(f"{k} {v:.2f}" for k, v in cores.items()))
    per_message = ", ".join(f"{run['requests_per_message']:g}" for run in rounds)
    print(f"requests a JetStream message (by round): {per_message}")


def print_profiles(profiles: dict) -> None:
    window = profiles["window"]
    print(
        f"\nprofiled window: {window['rps']:.0f} req/s, CPU us/request "
        + ", ".join(f"{k} {v:.0f}" for k, v in window["cpu_us_per_request"].items())
    )
    for name, figures in profiles["components"].items():
        print(
            f"\n{name}: top functions by self time ({figures['samples']} samples holding the GIL)"
        )
        for row in figures["self"][:15]:
            print(f"  {100 * row['share']:5.1f}%  ~{row['us']:5.1f} us/req  {row['function']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-ms", type=float, default=1.0, help="device: fixed cost a batch")
    parser.add_argument("--token-us", type=float, default=2.0, help="device: cost a token")
    parser.add_argument("--budget", type=int, default=256, help="worker batch budget, items")
    parser.add_argument("--connections", type=int, default=256)
    parser.add_argument("--gateways", type=int, default=1, help="gateway processes, one port")
    parser.add_argument("--seconds", type=float, default=20.0, help="a measured window")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=1, help="measured windows, one cluster")
    parser.add_argument("--json", default="hotpath", help="a path, or a name in bench/results")
    parser.add_argument("--profile", default=None, help="py-spy the gateway and worker into DIR")
    parser.add_argument("--profile-seconds", type=int, default=10)
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples a second")
    parser.add_argument("--native", action="store_true", help="py-spy: C frames too")
    parser.add_argument("--top", type=int, default=25, help="functions kept per profile")
    args = parser.parse_args()
    if not wrk_available():
        raise SystemExit("bench.hotpath needs wrk (Debian package `wrk`)")
    options = [f"--option=batch_ms={args.batch_ms:g}", f"--option=token_us={args.token_us:g}"]
    # The item budget is the one that binds: the token budget (on the cost header, body
    # bytes / 4, ~30 for these requests) gets room for `budget` items of up to 64.
    budget = ["--max-batch-items", str(args.budget), "--max-batch-tokens", str(64 * args.budget)]
    cluster = ["--workers", "1", "--gateways", str(args.gateways)]
    with UpCluster("--model", MODEL, *options, *budget, *cluster) as up:
        urls = up.reported_metrics_urls()
        run_wrk(up.url, MODEL, args.connections, args.warmup)  # connections, first batches
        rounds = [measure(up, urls, args, args.seconds) for _ in range(args.rounds)]
        profiles = profile(up, urls, args) if args.profile else None
    report(args, rounds)
    if profiles:
        print_profiles(profiles)
    path = write_result(
        args.json,
        {
            "machine": machine_facts(),
            "command": " ".join(["python -m bench.hotpath", *sys.argv[1:]]),
            "setup": {
                "runtime": "sim (SIMULATED device, sleeping)",
                "batch_ms": args.batch_ms,
                "token_us": args.token_us,
                "budget": args.budget,
                "connections": args.connections,
                "seconds": args.seconds,
                "workers": 1,
                "gateways": args.gateways,
                "client": "wrk",
            },
            "rounds": rounds,
            "median_rps": statistics.median(run["rps"] for run in rounds),
            "median_ratio_to_limit": statistics.median(run["ratio_to_limit"] for run in rounds),
            "profiles": profiles,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
