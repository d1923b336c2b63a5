"""Under `shoal up`, a child that dies is restarted while the rest keeps serving.

Real processes throughout: `shoal up` with the simulated runtime, its own nats-server, gateway
and workers, each killed with SIGKILL as a crash would.
"""

from __future__ import annotations

import asyncio
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
from conftest import TEST_ENV, cluster_admin_auth, worker_status

from shoal.broker.connection import connect
from shoal.broker.jetstream import WORK_STREAM, consumer_name
from shoal.process import free_port
from shoal.runtimes.sim import pseudo_embedding
from shoal.state.workers import WorkerState

MODEL = "sim-embed"


class Up:
    """`shoal up` as a child of the test, its output collected line by line."""

    def __init__(self, tmp_path: Path, workers: int, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, **TEST_ENV, "SHOAL_STATE_DIR": str(tmp_path / "state")}
        env.pop("SHOAL_NATS", None)
        self.state_dir = tmp_path / "state"  # its NATS credentials are under it
        args = ["--model", MODEL, "--port", str(self.port), "--workers", str(workers)]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "shoal", "up", *args, "--request-timeout", "10", *extra],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.nats_url = ""

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.output.append(line)
            self.lines.put(line)

    def text(self) -> str:
        return "".join(self.output)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                if self.process.poll() is not None:
                    break
                continue
            if match := re.search(pattern, line):
                return match
        raise AssertionError(f"no line matching {pattern!r}; output:\n{self.text()}")

    def wait_up(self) -> None:
        self.nats_url = self.wait_for(r"nats\s+(nats://\S+)", 60).group(1)
        self.wait_for("Ctrl-C", 5)

    def children(self) -> dict[str, list[int]]:
        """The pids of `shoal up`'s children by role: nats, gateway, worker."""
        roles: dict[str, list[int]] = {"nats": [], "gateway": [], "worker": []}
        for child in psutil.Process(self.process.pid).children():
            try:
                argv = child.cmdline()
                if child.status() == psutil.STATUS_ZOMBIE:
                    continue
            except psutil.NoSuchProcess:
                continue
            if argv and argv[0].endswith("nats-server"):
                roles["nats"].append(child.pid)
            elif "gateway" in argv[:4]:
                roles["gateway"].append(child.pid)
            elif "worker" in argv[:4]:
                roles["worker"].append(child.pid)
        return {role: sorted(pids) for role, pids in roles.items()}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(40)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture
def start_up(tmp_path: Path) -> Iterator[Callable[..., Up]]:
    started: list[Up] = []

    def start(workers: int, *extra: str) -> Up:
        up = Up(tmp_path, workers, *extra)
        started.append(up)
        return up

    yield start
    for up in started:
        up.stop()
        assert up.process.returncode == 0, up.text()


def wait_until(check: Callable[[], object], timeout: float, what: str, up: Up) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        assert up.process.poll() is None, f"shoal up exited:\n{up.text()}"
        time.sleep(0.05)
    raise AssertionError(f"{what} not within {timeout} s; output:\n{up.text()}")


def http_status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=1).status_code
    except httpx.HTTPError:
        return None


def assert_embeds(url: str, text: str) -> None:
    response = httpx.post(
        f"{url}/v1/embeddings", json={"model": MODEL, "input": [text]}, timeout=15
    )
    assert response.status_code == 200, response.text
    vector = response.json()["data"][0]["embedding"]
    np.testing.assert_allclose(vector, pseudo_embedding(text, 384), atol=1e-6)


class Load:
    """Clients that keep sending requests, `threads` at a time, until stopped."""

    def __init__(self, url: str, threads: int = 4) -> None:
        self.url = url
        self.results: list[tuple[float, float, int | str]] = []  # (sent, done, status or error)
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._send, args=(i,), daemon=True) for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def _send(self, index: int) -> None:
        with httpx.Client(base_url=self.url, timeout=20) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                sent = time.monotonic()
                body = {"model": MODEL, "input": [f"load {index} {n}"]}
                try:
                    result: int | str = client.post("/v1/embeddings", json=body).status_code
                except httpx.HTTPError as err:
                    result = type(err).__name__
                self.results.append((sent, time.monotonic(), result))
                time.sleep(0.02)

    def stop(self) -> list[tuple[float, float, int | str]]:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)
            assert not thread.is_alive(), "a client is stuck"
        return self.results


def stream_state(up: Up) -> tuple[int, bool]:
    """The work stream's last sequence and whether the model's consumer exists."""

    async def read() -> tuple[int, bool]:
        nc = await connect(up.nats_url, name="test", auth=cluster_admin_auth(up.state_dir))
        try:
            js = nc.jetstream()
            info = await js.stream_info(WORK_STREAM)
            consumers = [c.name for c in await js.consumers_info(WORK_STREAM)]
            return info.state.last_seq, consumer_name(MODEL) in consumers
        finally:
            await nc.close()

    return asyncio.run(asyncio.wait_for(read(), 10))


def listens_on(pid: int, port: int) -> bool:
    try:
        connections = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.NoSuchProcess:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in connections)


def test_killed_nats_server_comes_back_on_its_port_with_its_stream(start_up):
    # Batches of 300 ms: the load always has requests in flight.
    up = start_up(1, "--option", "batch_ms=300")
    up.wait_up()
    nats_port = int(up.nats_url.rpartition(":")[2])
    before = up.children()
    assert len(before["nats"]) == 1 and len(before["gateway"]) == 1, before
    for i in range(5):
        assert_embeds(up.url, f"before {i}")
    last_seq, has_consumer = stream_state(up)
    assert last_seq >= 5 and has_consumer

    load = Load(up.url)
    time.sleep(0.5)  # requests in flight when the server dies
    killed_at = time.monotonic()
    os.kill(before["nats"][0], signal.SIGKILL)
    new_nats = wait_until(
        lambda: [p for p in up.children()["nats"] if p != before["nats"][0]],
        10,
        "a new nats-server",
        up,
    )[0]
    wait_until(lambda: listens_on(new_nats, nats_port), 5, "nats-server on its old port", up)
    wait_until(lambda: http_status(f"{up.url}/readyz") == 200, 10, "readyz 200 again", up)
    recovered_at = time.monotonic()
    time.sleep(2.0)  # new requests keep coming after the recovery
    results = load.stop()
    assert recovered_at - killed_at < 8, recovered_at - killed_at
    assert_embeds(up.url, "after the restart")
    # The gateway answered every request: served, or a 503 while NATS was away (at once,
    # also for the requests in flight: never a 504 at their deadline).
    in_flight = [(done, r) for sent, done, r in results if sent < killed_at < done]
    assert in_flight, "none in flight"
    assert all(r in (200, 503) and done - killed_at < 3 for done, r in in_flight), in_flight
    statuses = {result for _, _, result in results}
    assert statuses <= {200, 503}, statuses
    assert [r for sent, _, r in results if sent > recovered_at + 0.2 and r != 200] == []
    assert sum(1 for sent, _, r in results if sent > recovered_at and r == 200) >= 3
    # Same store: the stream kept its history and the model's consumer.
    last_seq_after, has_consumer_after = stream_state(up)
    assert last_seq_after > last_seq and has_consumer_after
    # Nothing else was restarted.
    after = up.children()
    assert after["gateway"] == before["gateway"] and after["worker"] == before["worker"]
    assert re.search(rf"nats-server \(pid {before['nats'][0]}\) was killed by SIGKILL", up.text())
    assert f"nats-server restarted (pid {new_nats}) on {up.nats_url}" in up.text()


def test_killed_gateway_comes_back_on_its_port_and_nothing_else_restarts(start_up):
    up = start_up(1)
    up.wait_up()
    before = up.children()
    old_gateway = before["gateway"][0]
    assert_embeds(up.url, "before")

    os.kill(old_gateway, signal.SIGKILL)
    new_gateway = wait_until(
        lambda: [p for p in up.children()["gateway"] if p != old_gateway], 10, "a new gateway", up
    )[0]
    wait_until(lambda: http_status(f"{up.url}/readyz") == 200, 15, "readyz 200 again", up)
    assert listens_on(new_gateway, up.port)
    assert_embeds(up.url, "after the restart")

    after = up.children()
    assert after["nats"] == before["nats"] and after["worker"] == before["worker"]
    assert after["gateway"] == [new_gateway]
    assert f"gateway (pid {old_gateway}) was killed by SIGKILL" in up.text()
    assert f"gateway restarted (pid {new_gateway})" in up.text()


def test_killed_worker_is_restarted_while_starting_and_after(start_up):
    up = start_up(2)
    # A worker that dies before the cluster is up is restarted; start-up goes on.
    first_worker = wait_until(lambda: up.children()["worker"], 30, "a worker process", up)[0]
    os.kill(first_worker, signal.SIGKILL)
    up.wait_up()
    text = up.text()
    restart_line = f"worker 1 (pid {first_worker}) was killed by SIGKILL"
    assert restart_line in text and text.index(restart_line) < text.index("Shoal is up"), text
    before = up.children()
    assert len(before["worker"]) == 2 and first_worker not in before["worker"], before

    # After start-up: one worker dies under load; the others are untouched, nothing fails.
    load = Load(up.url)
    time.sleep(0.5)
    victim, survivor = before["worker"]
    os.kill(victim, signal.SIGKILL)
    replacement = wait_until(
        lambda: [p for p in up.children()["worker"] if p not in before["worker"]],
        10,
        "a new worker",
        up,
    )[0]
    wait_until(
        lambda: worker_status(
            up.nats_url, replacement, WorkerState.READY, cluster_admin_auth(up.state_dir)
        ),
        20,
        "the new worker READY",
        up,
    )
    time.sleep(0.5)
    results = load.stop()

    statuses = [result for _, _, result in results]
    assert statuses and set(statuses) == {200}, sorted(set(statuses), key=str)
    after = up.children()
    assert sorted(after["worker"]) == sorted([survivor, replacement])
    assert after["gateway"] == before["gateway"] and after["nats"] == before["nats"]
    assert f"(pid {victim}) was killed by SIGKILL" in up.text()
    assert f"restarted (pid {replacement})" in up.text()
    assert_embeds(up.url, "after the restart")


def test_a_gateway_port_held_by_another_process_ends_up_with_a_clear_message(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = {**os.environ, **TEST_ENV, "SHOAL_STATE_DIR": str(tmp_path / "state")}
        env.pop("SHOAL_NATS", None)
        done = subprocess.run(
            [sys.executable, "-m", "shoal", "up", "--model", MODEL, "--port", str(port)],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert done.returncode == 1
    assert f"port 127.0.0.1:{port} is in use" in done.stderr
