"""A push cluster as child processes: N push workers and one router, on free loopback ports.

The counterpart of bench.harness.UpCluster for the push baselines; the workers get the same
ModelSpec and the same thread share (`SHOAL_THREADS` = cores / N) as `shoal up` gives its own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench.harness import process_cpu_seconds
from shoal.process import child_preexec, free_ports
from shoal.protocol import ModelSpec, encode_json

READY_TIMEOUT_S = 300.0
# Ports come from free_ports(): a probe, then the child's bind. Between the two, another socket
# can take one, and that child exits with "address already in use": the cluster starts again
# on new ports. (Chosen one at a time, two children could be handed the same port, and the
# second's exit went unseen behind the first's health check: free_ports() chooses them together.)
START_ATTEMPTS = 3
_ROOT = Path(__file__).resolve().parent.parent.parent


class PushCluster:
    """`with PushCluster(spec, workers=4, policy="lor", cap=64) as push: push.url ...`"""

    def __init__(
        self,
        spec: ModelSpec,
        *,
        workers: int,
        policy: str,
        cap: int,
        max_batch_items: int,
        max_batch_tokens: int = 8192,
        max_wait_ms: float = 0.0,
    ) -> None:
        self.spec = spec
        self.workers = workers
        self.policy = policy
        self.cap = cap
        self.max_batch_items = max_batch_items
        self.max_batch_tokens = max_batch_tokens
        self.max_wait_ms = max_wait_ms
        self._router: subprocess.Popen[bytes] | None = None
        self._workers: list[subprocess.Popen[bytes]] = []
        self._choose_ports()

    def _choose_ports(self) -> None:
        self.port, *self.worker_ports = free_ports(1 + self.workers)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}/metrics" for p in self.worker_ports]

    def __enter__(self) -> PushCluster:
        for _ in range(START_ATTEMPTS - 1):
            try:
                self._start()
                return self
            except ChildExited:
                self._choose_ports()
        self._start()  # the last attempt: its failure is the caller's
        return self

    def _start(self) -> None:
        self._workers, self._router = [], None  # a failed attempt's are stopped already
        threads = max(1, (os.cpu_count() or 1) // self.workers)
        env = {
            **os.environ,
            "SHOAL_THREADS": os.environ.get("SHOAL_THREADS", str(threads)),
            # Keep a PYTHONPATH the caller set (e.g. a snapshot of shoal's source) in front.
            "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(_ROOT)])),
        }
        try:
            for port in self.worker_ports:
                self._workers.append(
                    self._spawn(
                        [
                            "bench.push.worker",
                            "--port",
                            str(port),
                            "--model-json",
                            encode_json(self.spec).decode(),
                            "--max-batch-items",
                            str(self.max_batch_items),
                            "--max-batch-tokens",
                            str(self.max_batch_tokens),
                            "--max-wait-ms",
                            str(self.max_wait_ms),
                        ],
                        env,
                    )
                )
            self._router = self._spawn(
                [
                    "bench.push.router",
                    "--port",
                    str(self.port),
                    "--policy",
                    self.policy,
                    "--cap",
                    str(self.cap),
                    "--workers",
                    ",".join(f"127.0.0.1:{p}" for p in self.worker_ports),
                ],
                env,
            )
            deadline = time.monotonic() + READY_TIMEOUT_S
            for port in [*self.worker_ports, self.port]:
                _wait_healthy(f"http://127.0.0.1:{port}/healthz", deadline, self._processes())
        except BaseException:
            self.__exit__()
            raise

    def __exit__(self, *exc: object) -> None:
        for process in self._processes():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self._processes():
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def component_cpu_seconds(self) -> dict[str, float]:
        """CPU time so far of the router and of all workers together."""
        totals = {"router": 0.0, "worker": 0.0}
        if self._router is not None:
            totals["router"] = process_cpu_seconds(self._router.pid)
        totals["worker"] = sum(process_cpu_seconds(p.pid) for p in self._workers)
        return totals

    def _processes(self) -> list[subprocess.Popen[bytes]]:
        return [*self._workers, *([self._router] if self._router else [])]

    @staticmethod
    def _spawn(args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", *args], env=env, cwd=_ROOT, preexec_fn=child_preexec
        )


def _wait_healthy(url: str, deadline: float, processes: list[subprocess.Popen[bytes]]) -> None:
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in processes):
            raise ChildExited("a push cluster process exited while starting")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not healthy within {READY_TIMEOUT_S:.0f} s")


class ChildExited(RuntimeError):
    """A push cluster process exited before it answered its health check."""
