"""Fixtures that start real parts: a nats-server, gateways and workers as real processes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from shoal.broker.connection import connect
from shoal.broker.embedded import EmbeddedNats
from shoal.broker.jetstream import ensure_work_stream
from shoal.cluster_auth import ADMIN, ClusterCredentials
from shoal.config import NatsAuth, QueueSettings, WorkerSettings
from shoal.observability.metrics import BusyMeter, WorkerMetrics
from shoal.process import free_port
from shoal.protocol import ModelSpec, encode_json, name_token
from shoal.state.deployments import ensure_models_kv
from shoal.state.workers import WorkerState, WorkerStatus, read_worker_statuses
from shoal.worker.outbox import Outbox
from shoal.worker.schedulers.base import SchedulerContext

# Short enough that the SIGKILL test sees redelivery within seconds.
TEST_ENV = {"SHOAL_ACK_WAIT": "2", "SHOAL_THREADS": "1", "SHOAL_LOG_LEVEL": "WARNING"}


@dataclass
class ShoalProcess:
    """A `python -m shoal ...` child, its log in a file the test can show on failure."""

    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 30) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


class Launcher:
    """Starts shoal processes for a test and stops every one of them afterwards."""

    def __init__(self, tmp_path: Path, env: dict[str, str] | None = None) -> None:
        self.tmp_path = tmp_path
        self.env = {
            **os.environ,
            **TEST_ENV,
            "SHOAL_STATE_DIR": str(tmp_path / "state"),
            **(env or {}),
        }
        self.processes: list[ShoalProcess] = []

    def spawn(self, *args: str, env: dict[str, str] | None = None) -> ShoalProcess:
        log_path = self.tmp_path / f"{args[0]}-{len(self.processes)}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "shoal", *args],
                env={**self.env, **(env or {})},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        started = ShoalProcess(process, log_path)
        self.processes.append(started)
        return started

    def gateway(self, nats_url: str, *args: str, ready: bool = True) -> tuple[ShoalProcess, str]:
        port = free_port()
        process = self.spawn("gateway", "--nats", nats_url, "--port", str(port), *args)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _http_status(f"{url}/healthz") == 200, 30, process)
        if ready:
            wait_until(lambda: _http_status(f"{url}/readyz") == 200, 30, process)
        return process, url

    def worker(self, nats_url: str, model: str, *args: str, timeout: float = 120) -> ShoalProcess:
        process = self.spawn("worker", "--nats", nats_url, "--model", model, *args)
        wait_until(
            lambda: worker_status(nats_url, process.pid, WorkerState.READY), timeout, process
        )
        return process

    def stop_all(self) -> None:
        for process in reversed(self.processes):
            process.stop()


def _http_status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=1).status_code
    except httpx.HTTPError:
        return None


def wait_until(check: Callable[[], object], timeout: float, process: ShoalProcess | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        if process is not None and process.process.poll() is not None:
            raise AssertionError(f"process exited ({process.process.returncode}):\n{process.log()}")
        time.sleep(0.1)
    detail = f"\n{process.log()}" if process is not None else ""
    raise AssertionError(f"condition not met within {timeout} s{detail}")


async def wait_until_async(check: Callable[[], bool], timeout: float) -> float:
    """Seconds until `check()` holds, polled on the running event loop; fails after
    `timeout`."""
    began = time.monotonic()
    while not check():
        if time.monotonic() - began > timeout:
            raise AssertionError(f"not within {timeout} s")
        await asyncio.sleep(0.005)
    return time.monotonic() - began


def cluster_admin_auth(state_dir: Path) -> NatsAuth:
    """The admin credentials of the `shoal up` (or `shoal nats`) whose state is `state_dir`."""
    return ClusterCredentials(state_dir / "nats-auth").auth(ADMIN)


def worker_statuses(nats_url: str, auth: NatsAuth | None = None) -> list[WorkerStatus]:
    async def read() -> list[WorkerStatus]:
        nc = await connect(nats_url, name="test", auth=auth)
        try:
            return await read_worker_statuses(nc.jetstream())
        finally:
            await nc.close()

    return asyncio.run(read())


def worker_status(
    nats_url: str, pid: int, state: WorkerState | None = None, auth: NatsAuth | None = None
) -> WorkerStatus | None:
    for status in worker_statuses(nats_url, auth):
        if status.pid == pid and (state is None or status.state == state):
            return status
    return None


def scheduler_context(
    nc, settings: WorkerSettings, model: str, **parts: object
) -> SchedulerContext:
    """A scheduler's parts around a real NATS connection, for a test that drives a scheduler
    alone on the SIMULATED runtime; the caller shuts its executor down."""
    metrics = WorkerMetrics(model, "sim", simulated=True)
    return SchedulerContext(
        settings=settings,
        outbox=Outbox(nc, metrics),
        executor=ThreadPoolExecutor(1),
        metrics=metrics,
        busy=BusyMeter(),
        **parts,
    )


def deploy_without_workers(
    nats_url: str, spec: ModelSpec, queue: QueueSettings | None = None
) -> None:
    """Make a model known to gateways, as `shoal up` does, with no worker serving it."""

    async def put() -> None:
        nc = await connect(nats_url, name="test")
        try:
            await ensure_work_stream(nc.jetstream(), queue or QueueSettings())
            kv = await ensure_models_kv(nc.jetstream())
            await kv.put(name_token(spec.name), encode_json(spec))
        finally:
            await nc.close()

    asyncio.run(put())


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    server = EmbeddedNats(store_dir=tmp_path_factory.mktemp("nats-store"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def session_launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    launcher = Launcher(tmp_path_factory.mktemp("session"))
    yield launcher
    launcher.stop_all()


@pytest.fixture(scope="session")
def gateway_url(nats_server: EmbeddedNats, session_launcher: Launcher) -> str:
    """One gateway for the tests that share the session's NATS (each uses its own model)."""
    _, url = session_launcher.gateway(nats_server.url, "--max-body-bytes", str(256 * 1024))
    return url


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Launcher]:
    launcher = Launcher(tmp_path)
    yield launcher
    launcher.stop_all()
