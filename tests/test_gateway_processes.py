"""Several gateway processes on one port (`--gateways N`): each serves, /metrics is their sum,
and one that dies is started again while the others keep serving."""

from __future__ import annotations

import contextlib
import gc
import os
import re
import signal
import socket
import time
from collections import Counter

import httpx
import psutil
from conftest import wait_until

from shoal.config import GatewaySettings, NatsAuth
from shoal.gateway import server
from shoal.gateway.app import FIRST_CONNECTION_WAIT_S
from shoal.process import YOUNG_GENERATION_THRESHOLD, free_port, free_ports

MODEL = "sim-gateways"
ROUTE = "/v1/embeddings"


def _served_requests(metrics: str) -> float:
    labels = rf'[^}}]*model="{MODEL}"[^}}]*status="200"[^}}]*'
    pattern = rf"shoal_gateway_requests_total{{{labels}}} (\S+)"
    return sum(float(value) for value in re.findall(pattern, metrics))


def _server_processes(gateway_pid: int) -> list[psutil.Process]:
    """The gateway's serving processes: uvicorn's children started by multiprocessing."""
    children = psutil.Process(gateway_pid).children()
    return [c for c in children if "spawn_main" in " ".join(c.cmdline())]


def _embed_each_on_a_new_connection(url: str, count: int) -> list[int]:
    statuses = []
    for i in range(count):
        # A new connection each time: the kernel spreads connections, not requests.
        with httpx.Client(timeout=20) as client:
            body = {"model": MODEL, "input": f"sentence {i}"}
            statuses.append(client.post(f"{url}{ROUTE}", json=body).status_code)
    return statuses


def _every_scrape_counts(url: str, served: int) -> None:
    """A kept connection reaches one process: the others' counts reach its scrapes only
    through their timed flush (SHARED_FLUSH_INTERVAL_S), with no more traffic. Then every
    scrape, each on a new connection, whichever process answers it, counts all `served`."""
    with httpx.Client(timeout=10) as client:
        wait_until(lambda: _served_requests(client.get(f"{url}/metrics").text) == served, 5)
    for _ in range(6):
        with httpx.Client(timeout=10) as client:
            assert _served_requests(client.get(f"{url}/metrics").text) == served


def test_two_gateway_processes_share_a_port_and_their_metrics(nats_server, launcher):
    launcher.worker(nats_server.url, MODEL, "--runtime", "sim", "--option", "batch_ms=1")
    gateway, url = launcher.gateway(nats_server.url, "--gateways", "2")
    servers = wait_until(lambda: len(s := _server_processes(gateway.pid)) == 2 and s, 30)

    assert _embed_each_on_a_new_connection(url, 40) == [200] * 40
    _every_scrape_counts(url, 40)

    # One serving process dies: uvicorn starts another, the port keeps answering meanwhile.
    victim = servers[0]
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    wait_until(
        lambda: len(s := _server_processes(gateway.pid)) == 2 and victim not in s,
        30,
        gateway,
    )
    assert _embed_each_on_a_new_connection(url, 20) == [200] * 20
    with httpx.Client(timeout=10) as client:
        # The dead process's counts stay in the sum: counters never go back.
        wait_until(lambda: _served_requests(client.get(f"{url}/metrics").text) == 60, 5)

    assert gateway.stop() == 0
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in servers[1:])


def test_granians_gateway_processes_share_their_metrics(nats_server, launcher):
    launcher.worker(nats_server.url, MODEL, "--runtime", "sim", "--option", "batch_ms=1")
    gateway, url = launcher.gateway(nats_server.url, "--gateways", "2", "--http-server", "granian")
    assert _embed_each_on_a_new_connection(url, 40) == [200] * 40
    _every_scrape_counts(url, 40)
    assert gateway.stop() == 0


def test_a_gateway_process_serves_only_once_it_can_queue(nats_server, launcher):
    """With several processes on one port, none accepts before its NATS connection: a client
    that reached a serving process must not meet a sibling that answers 503. /readyz, each
    time on a new connection, as fast as it answers from the moment the first process serves,
    for 1.5 s: before `Gateway.startup` waited, 5-7 of ~3,700 such answers were 503s
    (3 runs)."""
    port = free_port()
    gateway = launcher.spawn(
        "gateway", "--nats", nats_server.url, "--port", str(port), "--gateways", "3"
    )
    wait_until(lambda: _listens(port), 30, gateway)
    statuses: Counter[bytes] = Counter()
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
            connection.sendall(b"GET /readyz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            statuses[connection.recv(12)[9:12]] += 1
    assert set(statuses) == {b"200"} and statuses[b"200"] > 100, statuses
    assert gateway.stop() == 0


def test_a_gateway_process_serves_after_a_bounded_wait_for_nats(launcher):
    """NATS away: the processes serve after `FIRST_CONNECTION_WAIT_S`, alive and not ready."""
    port, nats_port = free_ports(2)
    nats_url = f"nats://127.0.0.1:{nats_port}"
    started = time.monotonic()
    gateway = launcher.spawn("gateway", "--nats", nats_url, "--port", str(port), "--gateways", "2")
    wait_until(lambda: _listens(port), 30, gateway)
    assert time.monotonic() - started >= FIRST_CONNECTION_WAIT_S
    with httpx.Client(timeout=10) as client:
        assert client.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
        assert client.get(f"http://127.0.0.1:{port}/readyz").status_code == 503
    assert gateway.stop() == 0


def _listens(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


def test_the_processes_get_the_nats_password_from_its_file_not_the_environment(
    tmp_path, monkeypatch
):
    """The settings go to uvicorn's processes through the environment, which /proc shows
    for as long as they run: the NATS password stays out; each process reads its file."""
    password = "secret-" + "p" * 24
    password_file = tmp_path / "password"
    password_file.write_text(password + "\n")
    auth = NatsAuth.read(user="gateway", password_file=str(password_file))
    settings = GatewaySettings(nats_url="nats://127.0.0.1:1", nats_auth=auth, processes=2)
    monkeypatch.delenv("SHOAL_NATS_PASSWORD", raising=False)
    monkeypatch.setenv(server._SETTINGS_ENV, "")  # removed again after the test
    server._settings_to_environment(settings)
    assert not any(password in value for value in os.environ.values())
    assert server.app_from_environment().settings.nats_auth.password == password


def test_each_serving_process_raises_the_young_generations_threshold(monkeypatch):
    """A spawned serving process starts with CPython's garbage-collector defaults; building
    its app sets the threshold that keeps collections rare under load."""
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, before[1], before[2])  # CPython's default
        monkeypatch.setenv(server._SETTINGS_ENV, "")
        server._settings_to_environment(GatewaySettings(nats_url="nats://127.0.0.1:1"))
        server.app_from_environment()
        assert gc.get_threshold() == (YOUNG_GENERATION_THRESHOLD, before[1], before[2])
    finally:
        gc.set_threshold(*before)
