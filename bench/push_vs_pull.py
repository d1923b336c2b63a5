"""Push vs pull, side by side, on the same workers (issue 4).

    python -m bench.push_vs_pull --runtime sim --workers 1,2,4 [--systems shoal,rr,lor,p2c]
        [--seconds 5] [--sizes small|mixed] [--cap 64] [--out push_vs_pull_sim]

For each worker count N, each system is started in turn on the same runtime and model spec:
Shoal (`shoal up --workers N`: gateway -> JetStream -> N pulling workers; `shoal-eager`: the
same with the adaptive batch wait off) and the push
baselines (bench.push: router -> N push workers, policies rr, lor, p2c, with a per-worker
in-flight cap). Each gets, in the same run:
1. saturation: a closed loop of `connections` clients for `seconds` (throughput, latency,
   busy fraction, mean batch);
2. constant load: open loop (Poisson) at 50/70/90% of *Shoal's* saturated rate, so every
   system gets the same offered load: busy fraction (mean and min over workers), p50/p99
   latency, mean batch.
Busy fraction and batch sizes come from the workers' own /metrics (same BusyMeter and metric
names for both kinds, see bench/fleet_metrics.py) over exactly the measured window.

`--runtime sim` uses a SIMULATED accelerator (sleeping, GPU-like: a fixed cost per batch that
dominates small batches) with `--batch-ms` and `--token-us`; `--runtime torch` the real
all-MiniLM-L6-v2. Results are merged into bench/results/<out>.json by worker count, so a sweep
can be split over several commands. `--systems` may also name peers (`ray`, `infinity`,
installed by bench/peers/install.sh; torch runtime only, N ignored).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import AbstractContextManager
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.fleet_metrics import scrape, window
from bench.harness import RESULTS_DIR, UpCluster, cpu_share, machine_facts
from bench.loadgen import LoadSpec, run_load, run_load_in_window
from bench.push.cluster import PushCluster
from bench.push.router import POLICIES
from shoal.catalog import resolve_model
from shoal.config import env_default, local_gateway_processes
from shoal.protocol import ModelSpec

PEERS = ("ray", "infinity")
SIM_MODEL = "sim-embed"
TORCH_MODEL = "all-MiniLM-L6-v2"


class System:
    """One system under test, started: its URL, its workers' metrics, its CPU accounting."""

    def __init__(self, name: str, cluster: Any, metrics_urls: list[str]) -> None:
        self.name = name
        self.cluster = cluster
        self.url: str = cluster.url
        self.metrics_urls = metrics_urls

    def cpu(self) -> dict[str, float]:
        return self.cluster.component_cpu_seconds()


def model_spec(args: argparse.Namespace) -> ModelSpec:
    if args.runtime == "sim":
        return resolve_model(
            SIM_MODEL, options={"batch_ms": args.batch_ms, "token_us": args.token_us}
        )
    return resolve_model(TORCH_MODEL)


def start(name: str, workers: int, spec: ModelSpec, args: argparse.Namespace):
    """A context manager that yields a started System."""
    batch = ["--max-batch-items", str(args.max_batch_items)]
    if name in ("shoal", "shoal-eager"):
        options = [f"--option={k}={v}" for k, v in spec.options.items()]
        extra = ["--model", spec.name, *options] if spec.runtime == "sim" else []
        # shoal-eager: the same cluster with the adaptive batch wait off.
        wait = ["--batch-wait", "off" if name == "shoal-eager" else "adaptive"]
        gateways = ["--gateways", str(args.gateways)] if args.gateways else []
        cluster = UpCluster(*extra, *batch, *wait, *gateways, "--workers", str(workers))
        return _Started(name, cluster, UpCluster.metrics_urls)
    if name in POLICIES:
        cluster = PushCluster(
            spec,
            workers=workers,
            policy=name,
            cap=args.cap,
            max_batch_items=args.max_batch_items,
            max_wait_ms=args.max_wait_ms,
        )
        return _Started(name, cluster, None)
    if name in PEERS:
        from bench.peers.servers import PeerServer

        return _Started(name, PeerServer(name, args.max_batch_items), None)
    known = ", ".join(["shoal", "shoal-eager", *POLICIES, *PEERS])
    raise SystemExit(f"unknown system {name!r}: {known}")


class _Started(AbstractContextManager):
    def __init__(self, name: str, cluster: Any, urls_of) -> None:
        self.name, self.cluster, self.urls_of = name, cluster, urls_of

    def __enter__(self) -> System:
        self.cluster.__enter__()
        if self.urls_of is not None:  # known once the workers have reported
            urls = _retry(lambda: self.urls_of(self.cluster))
        else:
            urls = list(getattr(self.cluster, "metrics_urls", []))
        return System(self.name, self.cluster, urls)

    def __exit__(self, *exc: object) -> None:
        self.cluster.__exit__(*exc)


def _retry(read, attempts: int = 20):
    for _ in range(attempts - 1):
        try:
            urls = read()
            if urls:
                return urls
        except Exception:
            pass
        time.sleep(0.5)
    return read()


def measure(system: System, spec: LoadSpec) -> dict[str, Any]:
    """Offer one load to a started system; what the client and the workers saw, the workers'
    busy share and batches and each component's cores over the load's window alone."""

    def read() -> tuple[dict[str, float], list]:
        counters = scrape(system.metrics_urls) if system.metrics_urls else []
        return system.cpu(), counters

    load, readings = run_load_in_window(spec, read)
    (cpu_before, before), (cpu_after, after) = readings.before, readings.after
    cores = cpu_share(cpu_before, cpu_after, readings.seconds)
    figures = asdict(window(before, after, readings.seconds)) if before else None
    return {"load": load.summary(), "workers": figures, "cores": cores}


def run_system(
    name: str, workers: int, spec: ModelSpec, args: argparse.Namespace, shoal_rps: float | None
) -> dict[str, Any]:
    model = spec.name if name not in PEERS else TORCH_MODEL
    connections = args.connections or min(2048, max(64, 3 * args.max_batch_items * workers))
    with start(name, workers, spec, args) as system:
        closed = LoadSpec(
            system.url,
            model,
            mode="closed",
            connections=connections,
            seconds=args.warmup,
            sizes=args.sizes,
        )
        run_load(closed)  # warm up: connections, caches, first batches
        closed.seconds = args.seconds
        saturation = measure(system, closed)
        rate_base = shoal_rps if shoal_rps is not None else saturation["load"]["rps"]
        loads = {}
        for fraction in args.loads:
            spec_open = LoadSpec(
                system.url,
                model,
                mode="open",
                rate=fraction * rate_base,
                connections=min(1024, connections),
                seconds=args.seconds,
                sizes=args.sizes,
                seed=int(fraction * 100),
            )
            loads[f"{fraction:.2f}"] = measure(system, spec_open)
    _print(name, workers, saturation, loads)
    return {
        "system": name,
        "workers": workers,
        "connections": connections,
        "saturation": saturation,
        "loads": loads,
        "rate_base_rps": rate_base,
    }


def _print(name: str, workers: int, saturation: dict, loads: dict) -> None:
    sat, figs = saturation["load"], saturation["workers"] or {}
    line = (
        f"N={workers:<3} {name:<8} sat {sat['rps']:8.1f} req/s p50 {sat['p50_ms']:7.1f} "
        f"p99 {sat['p99_ms']:7.1f} ms batch {figs.get('mean_batch', 0):5.1f} "
        f"busy {figs.get('busy_mean', 0):.2f}/{figs.get('busy_min', 0):.2f} "
        f"errors {sat['sent'] - sat['ok']} client {sat['client_cores']:.2f} cores"
    )
    print(line, flush=True)
    for fraction, result in loads.items():
        load, figs = result["load"], result["workers"] or {}
        print(
            f"    at {fraction} ({load['offered_rps']:7.1f}/s): got {load['rps']:7.1f} "
            f"p50 {load['p50_ms']:7.1f} p99 {load['p99_ms']:7.1f} ms "
            f"busy {figs.get('busy_mean', 0):.2f}/{figs.get('busy_min', 0):.2f} "
            f"batch {figs.get('mean_batch', 0):5.1f} errors {load['sent'] - load['ok']} "
            f"client {load['client_cores']:.2f} cores",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtime", choices=("sim", "torch"), default="sim")
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--systems", default="shoal,rr,lor,p2c")
    parser.add_argument("--seconds", type=float, default=5.0, help="per measurement")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--sizes", choices=("small", "mixed"), default="small")
    parser.add_argument("--loads", default="0.5,0.7,0.9", help="fractions of Shoal's saturation")
    parser.add_argument("--connections", type=int, default=0, help="closed loop; 0: 3 x batch x N")
    parser.add_argument("--max-batch-items", type=int, default=0, help="0: 32 sim, 128 torch")
    parser.add_argument("--cap", type=int, default=0, help="push in-flight cap; 0: 2 x batch")
    parser.add_argument("--max-wait-ms", type=float, default=0.0, help="push workers' batch wait")
    parser.add_argument(
        "--gateways", type=int, default=0, help="Shoal's gateway processes; 0: shoal up's default"
    )
    parser.add_argument("--batch-ms", type=float, default=100.0, help="sim: fixed cost per batch")
    parser.add_argument("--token-us", type=float, default=100.0, help="sim: cost per token")
    parser.add_argument("--out", default=None, help="default push_vs_pull_<runtime>[_<sizes>]")
    args = parser.parse_args()
    args.loads = [float(x) for x in args.loads.split(",") if x]
    args.max_batch_items = args.max_batch_items or (32 if args.runtime == "sim" else 128)
    args.cap = args.cap or 2 * args.max_batch_items
    systems = args.systems.split(",")
    out = args.out or f"push_vs_pull_{args.runtime}" + ("" if args.sizes == "small" else "_mixed")
    path = Path(out) if "/" in out else RESULTS_DIR / f"{out}.json"
    spec = model_spec(args)

    for workers in [int(n) for n in args.workers.split(",")]:
        shoal_rps = None
        runs = []
        for name in systems:
            try:
                result = run_system(name, workers, spec, args, shoal_rps)
            except Exception as err:
                if name not in PEERS:
                    raise
                # A peer that cannot run here is reported as such, with the reason.
                print(f"N={workers:<3} {name:<8} FAILED: {err}", flush=True)
                result = {"system": name, "workers": workers, "error": str(err)}
            if name == "shoal":
                shoal_rps = result["saturation"]["load"]["rps"]
            runs.append(result)
        _merge(path, args, spec, workers, runs)
    print(f"wrote {path}")


def _merge(path: Path, args: argparse.Namespace, spec: ModelSpec, workers: int, runs) -> None:
    """Add this worker count's runs to the results file (replacing earlier ones for it)."""
    data = json.loads(path.read_text()) if path.exists() else {"by_workers": {}}
    import shoal

    data["machine"] = machine_facts()
    data["shoal_source"] = str(Path(shoal.__file__).parent)
    data["setup"] = {
        "runtime": args.runtime,
        "simulated": args.runtime == "sim",
        "model": spec.name,
        "options": spec.options,
        "max_batch_items": args.max_batch_items,
        "push_cap": args.cap,
        "push_max_wait_ms": args.max_wait_ms,
        # What `shoal up` ran: its default reads SHOAL_GATEWAYS first.
        "gateways": args.gateways
        or env_default("GATEWAYS", local_gateway_processes(os.cpu_count())),
        "sizes": args.sizes,
        "seconds": args.seconds,
        "loads": args.loads,
    }
    entry = data["by_workers"].setdefault(str(workers), {})
    command = " ".join(["python -m bench.push_vs_pull", *sys.argv[1:]])
    for run in runs:
        run["command"] = command
        run["when"] = time.strftime("%Y-%m-%d %H:%M:%S")
        entry[run["system"]] = run
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
