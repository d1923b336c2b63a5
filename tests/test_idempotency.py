"""Idempotent retries: the same Idempotency-Key returns the first answer and computes once,
also at another gateway, and also when the first gateway died mid-request.

Real nats-server, gateways and a worker on the SIMULATED accelerator (runtime `sim`), slowed
so a retry can arrive while the first request still runs.
"""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest
from conftest import wait_until, worker_status

MODEL = "sim-idempotent"


@pytest.fixture(scope="module")
def two_gateways(nats_server, session_launcher):
    _, first = session_launcher.gateway(nats_server.url)
    _, second = session_launcher.gateway(nats_server.url)
    worker = session_launcher.worker(
        nats_server.url, MODEL, "--runtime", "sim", "--option", "batch_ms=1500"
    )
    return first, second, worker


def _post(url: str, text: str, key: str | None, **extra) -> httpx.Response:
    headers = {"Idempotency-Key": key} if key is not None else {}
    body = {"model": MODEL, "input": text, **extra}
    return httpx.post(f"{url}/v1/embeddings", json=body, headers=headers, timeout=60)


def _items_done(nats_url: str, pid: int) -> int:
    status = worker_status(nats_url, pid)
    return status.items_done if status is not None else 0


def _settled_items_done(nats_url: str, pid: int) -> int:
    """The worker's count once its once-a-second report has caught up."""
    time.sleep(1.5)
    return _items_done(nats_url, pid)


def test_a_retry_gets_the_first_answer_without_computing_again(nats_server, two_gateways):
    first, _, worker = two_gateways
    before = _settled_items_done(nats_server.url, worker.pid)
    original = _post(first, "retry me", "key-retry-1")
    assert original.status_code == 200, original.text
    assert "idempotent-replayed" not in original.headers
    retry = _post(first, "retry me", "key-retry-1")
    assert retry.status_code == 200
    assert retry.headers["idempotent-replayed"] == "true"
    assert retry.json() == original.json()
    assert _settled_items_done(nats_server.url, worker.pid) - before == 1
    # Another key is another request.
    other = _post(first, "retry me", "key-retry-2")
    assert other.status_code == 200 and "idempotent-replayed" not in other.headers
    assert _settled_items_done(nats_server.url, worker.pid) - before == 2


def test_the_same_key_with_another_body_is_a_422(two_gateways):
    first, second, _ = two_gateways
    assert _post(first, "one body", "key-conflict").status_code == 200
    conflict = _post(second, "another body", "key-conflict")
    assert conflict.status_code == 422
    error = conflict.json()["error"]
    assert error["code"] == "idempotency_key_reused" and error["param"] == "Idempotency-Key"


def test_a_retry_at_another_gateway_while_it_runs_waits_for_the_one_answer(
    nats_server, two_gateways
):
    first, second, worker = two_gateways
    before = _settled_items_done(nats_server.url, worker.pid)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(_post, first, "in flight", "key-in-flight")
        time.sleep(0.5)  # the first is in its 1.5 s batch
        retry = pool.submit(_post, second, "in flight", "key-in-flight")
        original, replayed = running.result(), retry.result()
    assert original.status_code == replayed.status_code == 200
    assert replayed.headers["idempotent-replayed"] == "true"
    assert replayed.json() == original.json()
    assert _settled_items_done(nats_server.url, worker.pid) - before == 1


def test_the_first_gateway_killed_mid_request_the_retry_gets_the_answer(
    nats_server, session_launcher, two_gateways
):
    _, second, worker = two_gateways
    doomed, doomed_url = session_launcher.gateway(nats_server.url)
    before = _settled_items_done(nats_server.url, worker.pid)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        lost = pool.submit(_post, doomed_url, "orphaned", "key-orphaned")
        time.sleep(0.5)
        doomed.kill()
        with pytest.raises(httpx.TransportError):
            lost.result()
    retry = _post(second, "orphaned", "key-orphaned")
    assert retry.status_code == 200, retry.text
    assert retry.headers["idempotent-replayed"] == "true"
    assert len(retry.json()["data"]) == 1
    wait_until(lambda: _items_done(nats_server.url, worker.pid) - before >= 1, 5)
    assert _settled_items_done(nats_server.url, worker.pid) - before == 1


def test_a_bad_request_is_kept_too_and_a_too_long_key_is_400(two_gateways):
    first, _, _ = two_gateways
    bad = _post(first, "x", "key-bad-input", encoding_format="nope")
    assert bad.status_code == 400
    again = _post(first, "x", "key-bad-input", encoding_format="nope")
    assert again.status_code == 400 and again.headers["idempotent-replayed"] == "true"
    assert _post(first, "x", "k" * 256).status_code == 400
