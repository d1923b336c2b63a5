"""`shoal up` brings up a whole cluster and takes every process down with it."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import openai
import psutil
import pytest
from conftest import TEST_ENV, wait_until

from shoal.config import local_gateway_processes
from shoal.process import free_port, free_ports
from shoal.runtimes.sim import pseudo_embedding


class UpProcess:
    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.env = {**os.environ, **TEST_ENV, "SHOAL_STATE_DIR": str(tmp_path / "state")}
        self.env.pop("SHOAL_NATS", None)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "shoal", "up", *args],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.output.append(line)
            self.lines.put(line)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                if self.process.poll() is not None:
                    break
                continue
            if match := re.search(pattern, line):
                return match
        raise AssertionError(f"no line matching {pattern!r}; output:\n{''.join(self.output)}")

    def descendants(self) -> set[int]:
        parents: dict[int, int] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(stat.parent.name)] = int(fields[1])
        found, frontier = set(), {self.process.pid}
        while frontier:
            children = {pid for pid, ppid in parents.items() if ppid in frontier}
            found |= children
            frontier = children
        return found

    def shoal(self, *args: str) -> str:
        return subprocess.run(
            [sys.executable, "-m", "shoal", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout


def _gateway_serving_processes(up: UpProcess) -> list[psutil.Process]:
    """uvicorn's serving processes (started by multiprocessing) under up's gateway child."""
    gateway = next(
        c for c in psutil.Process(up.process.pid).children() if "gateway" in c.cmdline()[:4]
    )
    return [c for c in gateway.children() if "spawn_main" in " ".join(c.cmdline())]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _assert_stops_cleanly(up: UpProcess, signum: int) -> None:
    children = up.descendants()
    up.process.send_signal(signum)
    assert up.process.wait(40) == 0, "".join(up.output)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if _alive(pid)], "processes left behind"
    assert not (Path(up.env["SHOAL_STATE_DIR"]) / "cluster.json").exists()


def test_up_with_two_sim_workers(tmp_path):
    port = free_port()
    up = UpProcess(tmp_path, "--model", "sim-embed", "--port", str(port), "--workers", "2")
    gateway = up.wait_for(r"gateway\s+(http://\S+)", 60).group(1)
    assert gateway == f"http://127.0.0.1:{port}/v1"
    up.wait_for(r"nats\s+nats://127\.0\.0\.1:\d+", 5)
    up.wait_for("Ctrl-C", 5)

    client = openai.OpenAI(base_url=gateway, api_key="unused")
    result = client.embeddings.create(model="sim-embed", input=["one", "two"])
    for text, item in zip(["one", "two"], result.data, strict=True):
        np.testing.assert_allclose(item.embedding, pseudo_embedding(text, 384), atol=1e-6)

    # Other commands find the local cluster without flags.
    status = up.shoal("status")
    assert status.count("sim-embed") == 2 and "sim (sim)" in status
    assert len(up.descendants()) >= 4  # nats-server, gateway, two workers
    # The gateway's processes by the machine's cores: two on CI's two.
    expected = local_gateway_processes(os.cpu_count())
    if expected > 1:
        assert wait_until(lambda: len(_gateway_serving_processes(up)) == expected, 10)
    _assert_stops_cleanly(up, signal.SIGINT)


@pytest.mark.parametrize(
    ("cores", "processes"),
    [(None, 1), (1, 1), (2, 2), (4, 2), (8, 2), (12, 3), (16, 4), (32, 8), (128, 8)],
)
def test_up_gives_the_gateway_processes_by_cores(cores, processes):
    assert local_gateway_processes(cores) == processes


def test_a_second_up_on_the_same_state_dir_is_refused(tmp_path):
    ports = free_ports(2)
    first = UpProcess(tmp_path, "--model", "sim-zero", "--port", str(ports[0]))
    first.wait_for("Ctrl-C", 60)
    second = UpProcess(tmp_path, "--model", "sim-zero", "--port", str(ports[1]))
    assert second.process.wait(30) == 1
    assert "already running" in "".join(second.output)
    _assert_stops_cleanly(first, signal.SIGTERM)


@pytest.mark.torch
def test_up_default_model_serves_the_openai_client(tmp_path):
    up = UpProcess(tmp_path, "--port", str(free_port()))
    gateway = up.wait_for(r"gateway\s+(http://\S+)", 180).group(1)
    client = openai.OpenAI(base_url=gateway, api_key="unused")
    result = client.embeddings.create(model="all-MiniLM-L6-v2", input=["a", "b"])
    vectors = np.array([item.embedding for item in result.data])
    assert vectors.shape == (2, 384)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-3)
    assert [m.id for m in client.models.list()] == ["all-MiniLM-L6-v2"]
    _assert_stops_cleanly(up, signal.SIGTERM)
