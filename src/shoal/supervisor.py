"""`shoal up`: an embedded NATS (unless given one), a gateway and N workers, as child processes.

The supervisor deploys the model, starts the children, waits until the gateway is ready and
every worker has loaded its model, prints where the cluster is, restarts a worker that dies,
and on SIGINT or SIGTERM stops every child it started (workers first, so they drain).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

from shoal.broker.connection import connect
from shoal.broker.embedded import EmbeddedNats
from shoal.cluster_file import (
    ClusterInfo,
    read_cluster_info,
    remove_cluster_info,
    state_dir,
    write_cluster_info,
)
from shoal.config import QueueSettings
from shoal.process import child_preexec
from shoal.protocol import ModelSpec, encode_json
from shoal.state.deployments import DeploymentError, deploy
from shoal.state.workers import WorkerState, read_worker_statuses

STOP_TIMEOUT_S = 30.0
READY_TIMEOUT_S = 300.0


@dataclass
class UpOptions:
    model: ModelSpec
    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1
    nats_url: str | None = None
    gateway_args: list[str] = field(default_factory=list)
    worker_args: list[str] = field(default_factory=list)


class Supervisor:
    def __init__(self, options: UpOptions) -> None:
        self.options = options
        self.nats: EmbeddedNats | None = None
        self.nats_url = options.nats_url or ""
        self.gateway: subprocess.Popen[bytes] | None = None
        self.workers: list[subprocess.Popen[bytes]] = []
        self._stop = False

    def run(self) -> int:
        running = read_cluster_info()
        if running is not None:
            print(
                f"a Shoal cluster is already running here (pid {running.pid}, "
                f"{running.gateway_url}); stop it or set SHOAL_STATE_DIR",
                file=sys.stderr,
            )
            return 1
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._on_signal)
        try:
            return self._run()
        finally:
            self.stop()

    def _on_signal(self, signum: int, frame: object) -> None:
        self._stop = True

    def _run(self) -> int:
        options = self.options
        if not self.nats_url:
            self.nats = EmbeddedNats(store_dir=state_dir() / "nats")
            self.nats_url = self.nats.start()
        try:
            asyncio.run(self._prepare_queue())
        except DeploymentError as err:
            print(f"shoal up: {err}", file=sys.stderr)
            return 1
        gateway_url = f"http://{options.host}:{options.port}"
        self.gateway = self._spawn(
            ["gateway", "--host", options.host, "--port", str(options.port), *options.gateway_args]
        )
        self.workers = [self._spawn_worker() for _ in range(options.workers)]
        if not self._wait_ready(gateway_url):
            return 1
        write_cluster_info(ClusterInfo(self.nats_url, gateway_url, os.getpid()))
        print(
            f"Shoal is up: {options.model.name} ({options.model.runtime}) on "
            f"{options.workers} worker(s)\n"
            f"  gateway  {gateway_url}/v1\n"
            f"  nats     {self.nats_url}\n"
            "Press Ctrl-C to stop.",
            flush=True,
        )
        while not self._stop:
            if self.gateway.poll() is not None:
                print(f"the gateway exited with {self.gateway.returncode}", file=sys.stderr)
                return 1
            for i, worker in enumerate(self.workers):
                if worker.poll() is not None and not self._stop:
                    print(
                        f"worker {worker.pid} exited ({worker.returncode}); restarting", flush=True
                    )
                    self.workers[i] = self._spawn_worker()
            time.sleep(0.2)
        return 0

    async def _prepare_queue(self) -> None:
        nc = await connect(self.nats_url, name="shoal-up")
        try:
            await deploy(nc.jetstream(), self.options.model, QueueSettings.from_environment())
        finally:
            await nc.close()

    def _spawn_worker(self) -> subprocess.Popen[bytes]:
        spec = self.options.model
        # Several workers on one machine share its cores instead of each taking all of them.
        threads = max(1, (os.cpu_count() or 1) // self.options.workers)
        env = {"SHOAL_THREADS": os.environ.get("SHOAL_THREADS", str(threads))}
        return self._spawn(
            ["worker", "--model-json", encode_json(spec).decode(), *self.options.worker_args], env
        )

    def _spawn(self, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "shoal", *args, "--nats", self.nats_url],
            env={**os.environ, **(env or {})},
            preexec_fn=child_preexec,
        )

    def _wait_ready(self, gateway_url: str) -> bool:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline and not self._stop:
            assert self.gateway is not None
            if self.gateway.poll() is not None:
                print(f"the gateway exited with {self.gateway.returncode}", file=sys.stderr)
                return False
            if any(w.poll() is not None for w in self.workers):
                print("a worker exited while starting", file=sys.stderr)
                return False
            if _http_ok(f"{gateway_url}/readyz") and asyncio.run(self._ready_workers()) >= len(
                self.workers
            ):
                return True
            time.sleep(0.2)
        if not self._stop:
            print(f"the cluster was not ready within {READY_TIMEOUT_S:g} s", file=sys.stderr)
        return False

    async def _ready_workers(self) -> int:
        pids = {w.pid for w in self.workers}
        nc = await connect(self.nats_url, name="shoal-up-wait")
        try:
            statuses = await read_worker_statuses(nc.jetstream())
        finally:
            await nc.close()
        return sum(1 for s in statuses if s.pid in pids and s.state == WorkerState.READY)

    def stop(self) -> None:
        """Workers first (they drain), then the gateway, then NATS; nothing is left running."""
        for group in (self.workers, [self.gateway] if self.gateway else []):
            for process in group:
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for process in group:
                try:
                    process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        if self.nats is not None:
            self.nats.stop()
        remove_cluster_info(os.getpid())


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return response.status == 200
    except OSError:
        return False
