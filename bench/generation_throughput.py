"""Generation through Shoal against raw batched decoding in-process, and time to first token.

Same machine, same run, same model file, same prompts, greedy. For each number of sequences
S (1, 4, 8, 16):

- raw: the runtime in this process (for llama.cpp: one context, a shared llama_batch, the
  low-level API, no Shoal code between the loop and `step()`), keeping S sequences decoding
  and starting a new one whenever one ends, so prefill is paid as in the cluster;
- Shoal: `shoal up --model M` with one worker, and S concurrent clients streaming chat-free
  completions (closed loop), aggregate completion tokens/s from each response's usage.

Then time to first token (TTFT) at a fixed Poisson arrival rate through Shoal.

    python -m bench.generation_throughput [--model gemma-3-270m] [--seconds 20] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time

import httpx

from bench.harness import UpCluster, cpu_share, machine_facts, write_result
from shoal.catalog import resolve_model
from shoal.runtimes.base import SamplingParams
from shoal.runtimes.registry import load_runtime

PROMPT = "Write a short note about item {i} in the warehouse inventory:"
CONCURRENCY = (1, 4, 8, 16)


def raw_tokens_per_s(runtime, sequences: int, max_tokens: int, seconds: float) -> float:
    """Aggregate tokens/s of the runtime alone with `sequences` always decoding."""
    made: dict[int, int] = {}
    started_prompts = 0

    def start(slot: int) -> None:
        nonlocal started_prompts
        prompt = runtime.tokenize(PROMPT.format(i=started_prompts))
        started_prompts += 1
        runtime.add_sequence(slot, prompt, SamplingParams(temperature=0.0))
        made[slot] = 0

    for slot in range(sequences):
        start(slot)
    tokens, began = 0, time.perf_counter()
    while time.perf_counter() - began < seconds:
        for slot, token in runtime.step().items():
            tokens += 1
            made[slot] += 1
            if made[slot] >= max_tokens or runtime.is_end_of_generation(token):
                runtime.remove_sequence(slot)
                start(slot)
    elapsed = time.perf_counter() - began
    for slot in range(sequences):
        runtime.remove_sequence(slot)
    return tokens / elapsed


async def stream_one(
    client: httpx.AsyncClient, url: str, model: str, i: int, max_tokens: int
) -> tuple[float, int]:
    """One streamed completion: (seconds to its first text chunk, completion tokens)."""
    body = {
        "model": model,
        "prompt": PROMPT.format(i=i),
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    sent = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.perf_counter() - sent
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return (first if first is not None else time.perf_counter() - sent), tokens


async def closed_loop(
    url: str, model: str | list[str], clients: int, max_tokens: int, seconds: float
):
    """`clients` concurrent streams back to back; returns (tokens/s, requests, errors).

    With a list of models, client i asks models[i % len(models)].
    """
    models = [model] if isinstance(model, str) else model
    tokens = requests = errors = 0
    deadline = time.perf_counter() + seconds
    counter = iter(range(10**9))

    async def client_loop(client: httpx.AsyncClient, model: str) -> None:
        nonlocal tokens, requests, errors
        while time.perf_counter() < deadline:
            try:
                _, made = await stream_one(client, url, model, next(counter), max_tokens)
                tokens += made
                requests += 1
            except Exception:
                errors += 1

    began = time.perf_counter()
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
        await asyncio.gather(
            *(client_loop(client, models[i % len(models)]) for i in range(clients))
        )
    return tokens / (time.perf_counter() - began), requests, errors


async def open_loop_ttft(url: str, model: str, rate: float, max_tokens: int, seconds: float):
    """Poisson arrivals at `rate`/s for `seconds`; returns TTFTs (s) and errors."""
    ttfts: list[float] = []
    errors = 0
    rng = random.Random(7)

    async def one(client: httpx.AsyncClient, i: int) -> None:
        nonlocal errors
        try:
            ttft, _ = await stream_one(client, url, model, i, max_tokens)
            ttfts.append(ttft)
        except Exception:
            errors += 1

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=256)) as client:
        tasks, i, began = [], 0, time.perf_counter()
        while time.perf_counter() - began < seconds:
            tasks.append(asyncio.create_task(one(client, i)))
            i += 1
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    return ttfts, errors


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--seconds", type=float, default=20, help="per measurement")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)))
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--ttft-rate", type=float, default=2.0, help="arrivals per second")
    parser.add_argument("--ttft-seconds", type=float, default=30)
    parser.add_argument("--out", default="generation_throughput")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    slots = max(16, *levels)

    spec = resolve_model(args.model, options={"max_sequences": slots, "threads": args.threads})
    runtime = load_runtime(spec)
    raw_tokens_per_s(runtime, 1, 8, 1.0)  # warm up
    options = [a for k, v in spec.options.items() for a in ("--option", f"{k}={v}")]
    rows = []
    with UpCluster("--model", args.model, *options) as up:
        asyncio.run(closed_loop(up.url, args.model, 2, args.max_tokens, 3))  # warm up
        for sequences in levels:
            raw, shoal, cores = [], [], []
            for _ in range(args.rounds):
                raw.append(raw_tokens_per_s(runtime, sequences, args.max_tokens, args.seconds))
                before, began = up.component_cpu_seconds(), time.monotonic()
                rate, requests, errors = asyncio.run(
                    closed_loop(up.url, args.model, sequences, args.max_tokens, args.seconds)
                )
                cores.append(
                    cpu_share(before, up.component_cpu_seconds(), time.monotonic() - began)
                )
                shoal.append({"tokens_per_s": rate, "requests": requests, "errors": errors})
            row = {
                "sequences": sequences,
                "raw_tokens_per_s": raw,
                "shoal": shoal,
                "cores_used": cores,
                "median_raw": statistics.median(raw),
                "median_shoal": statistics.median(s["tokens_per_s"] for s in shoal),
            }
            row["ratio"] = row["median_shoal"] / row["median_raw"]
            rows.append(row)
            print(
                f"S={sequences:2d}: raw {row['median_raw']:6.1f} tok/s, shoal "
                f"{row['median_shoal']:6.1f} tok/s, ratio {row['ratio']:.3f} "
                f"(rounds raw {[round(r) for r in raw]}, "
                f"shoal {[round(s['tokens_per_s']) for s in shoal]}, "
                f"errors {sum(s['errors'] for s in shoal)})"
            )
        ttfts, ttft_errors = asyncio.run(
            open_loop_ttft(up.url, args.model, args.ttft_rate, args.max_tokens, args.ttft_seconds)
        )
    runtime.close()
    ttft = {
        "rate_per_s": args.ttft_rate,
        "requests": len(ttfts),
        "errors": ttft_errors,
        "p50_ms": _percentile(ttfts, 0.5) * 1000,
        "p99_ms": _percentile(ttfts, 0.99) * 1000,
    }
    print(
        f"TTFT at {args.ttft_rate:g} req/s ({len(ttfts)} streams, max_tokens "
        f"{args.max_tokens}): p50 {ttft['p50_ms']:.0f} ms, p99 {ttft['p99_ms']:.0f} ms, "
        f"errors {ttft_errors}"
    )
    path = write_result(
        args.out,
        {
            "machine": machine_facts(),
            "model": args.model,
            "runtime": spec.runtime + (" (simulated)" if spec.runtime == "sim" else ""),
            "threads": args.threads,
            "slots": slots,
            "max_tokens": args.max_tokens,
            "seconds_per_measurement": args.seconds,
            "rows": rows,
            "ttft": ttft,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
