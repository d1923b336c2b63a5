"""Continuous batching, slot discipline and worker faults, on the SIMULATED generative runtime.

The sim runtime sleeps a fixed time per decode step (no model runs), which makes generation
long enough to kill a worker in the middle of it, on a real nats-server with real processes.
"""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from conftest import wait_until, worker_status


def _sim_worker(launcher, nats_url: str, model: str, step_ms: int, slots: int):
    return launcher.worker(
        nats_url,
        model,
        "--runtime",
        "sim",
        "--task",
        "generate",
        "--option",
        f"step_ms={step_ms}",
        "--option",
        f"max_sequences={slots}",
    )


def _client(gateway_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0)


def test_new_request_joins_the_running_batch(nats_server, session_launcher, gateway_url):
    model = "sim-gen-join"
    worker = _sim_worker(session_launcher, nats_server.url, model, step_ms=20, slots=4)
    client = _client(gateway_url)
    long_stream = client.completions.create(
        model=model, prompt="long", max_tokens=150, temperature=0, stream=True
    )
    for seen, _chunk in enumerate(long_stream, 1):
        if seen == 5:
            break
    # While the long sequence decodes, a short request starts between two of its steps
    # and finishes long before it.
    short = client.completions.create(model=model, prompt="short", max_tokens=5, temperature=0)
    assert short.usage.completion_tokens == 5
    rest = sum(1 for chunk in long_stream if chunk.choices and chunk.choices[0].text)
    assert rest > 50, "the long stream should still have been running"
    status = wait_until(
        lambda: (s := worker_status(nats_server.url, worker.pid)) and s.items_done >= 2 and s, 10
    )
    assert status.largest_batch == 2


def test_workers_pull_no_more_than_their_free_slots(nats_server, session_launcher, gateway_url):
    model = "sim-gen-slots"
    workers = [
        _sim_worker(session_launcher, nats_server.url, model, step_ms=20, slots=2) for _ in range(2)
    ]
    client = _client(gateway_url)
    results: list[int] = []

    def one(i: int) -> None:
        response = client.completions.create(model=model, prompt=f"p{i}", max_tokens=40)
        results.append(response.usage.completion_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert results == [40] * 4

    def done() -> list | None:
        statuses = [worker_status(nats_server.url, w.pid) for w in workers]
        # A status read can miss a key that its worker is rewriting (KV keys, then get).
        if not all(statuses):
            return None
        return statuses if sum(s.items_done for s in statuses) == 4 else None

    statuses = wait_until(done, 10)
    # Had one worker pulled all four, the other would have done nothing.
    assert [s.items_done for s in statuses] == [2, 2]
    assert all(s.largest_batch <= 2 for s in statuses)


def _wait_for_tokens(nats_url: str, pid: int) -> None:
    wait_until(lambda: (s := worker_status(nats_url, pid)) and s.tokens_generated > 0, 10)


def test_non_streamed_generation_is_redelivered_when_its_worker_dies(
    nats_server, session_launcher, gateway_url
):
    model = "sim-gen-kill"
    victim = _sim_worker(session_launcher, nats_server.url, model, step_ms=50, slots=4)
    client = _client(gateway_url)
    outcome: dict[str, object] = {}

    def request() -> None:
        try:
            outcome["result"] = client.completions.create(
                model=model, prompt="survive", max_tokens=60, temperature=0, timeout=40
            )
        except Exception as err:
            outcome["error"] = err

    thread = threading.Thread(target=request)
    thread.start()
    _wait_for_tokens(nats_server.url, victim.pid)
    victim.kill()
    survivor = _sim_worker(session_launcher, nats_server.url, model, step_ms=50, slots=4)
    thread.join(40)
    assert "error" not in outcome, outcome
    result = outcome["result"]
    assert result.usage.completion_tokens == 60
    status = wait_until(
        lambda: (s := worker_status(nats_server.url, survivor.pid)) and s.items_done and s, 10
    )
    assert status.redelivered == 1


def test_streamed_generation_ends_with_an_error_when_its_worker_dies(
    nats_server, session_launcher, gateway_url
):
    model = "sim-gen-kill-stream"
    victim = _sim_worker(session_launcher, nats_server.url, model, step_ms=50, slots=4)
    client = _client(gateway_url)
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "stream"}],
        max_tokens=200,
        stream=True,
        timeout=40,
    )
    received = []
    with pytest.raises(openai.APIError) as raised:
        for chunk in stream:
            received.append(chunk)
            if len(received) == 5:
                victim.kill()
                _sim_worker(session_launcher, nats_server.url, model, step_ms=50, slots=4)
    assert len(received) >= 5
    assert "restarted" in str(raised.value)


def test_streamed_request_with_no_worker_left_ends_with_an_error(
    nats_server, session_launcher, launcher
):
    model = "sim-gen-orphan"
    _, url = launcher.gateway(nats_server.url, "--stream-idle-timeout", "3")
    victim = _sim_worker(session_launcher, nats_server.url, model, step_ms=50, slots=4)
    with httpx.stream(
        "POST",
        f"{url}/v1/completions",
        json={"model": model, "prompt": "x", "max_tokens": 200, "stream": True},
        timeout=30,
    ) as response:
        lines = []
        for line in response.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
            if len(lines) == 3:
                victim.kill()
    assert '"error"' in lines[-1] and "worker is gone" in lines[-1]
    assert "[DONE]" not in lines[-1]
