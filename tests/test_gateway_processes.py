"""Several gateway processes on one port (`--gateways N`): each serves, /metrics is their sum,
and one that dies is started again while the others keep serving."""

from __future__ import annotations

import re
import signal

import httpx
import psutil
from conftest import wait_until

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


def test_two_gateway_processes_share_a_port_and_their_metrics(nats_server, launcher):
    launcher.worker(nats_server.url, MODEL, "--runtime", "sim", "--option", "batch_ms=1")
    gateway, url = launcher.gateway(nats_server.url, "--gateways", "2")
    servers = wait_until(lambda: len(s := _server_processes(gateway.pid)) == 2 and s, 30)

    assert _embed_each_on_a_new_connection(url, 40) == [200] * 40
    # Every scrape, whichever process answers it, counts all 40.
    for _ in range(6):
        with httpx.Client(timeout=10) as client:
            assert _served_requests(client.get(f"{url}/metrics").text) == 40

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
        assert _served_requests(client.get(f"{url}/metrics").text) == 60

    assert gateway.stop() == 0
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in servers[1:])
