"""`shoal up`: an embedded NATS (unless given one), a gateway and N workers, as child processes.

The supervisor deploys the model, starts the children, waits until the gateway is ready and
every worker has loaded its model, prints where the cluster is, and from then on (and already
while it starts) restarts any child that dies, with exponential backoff, while the others keep
serving: nats-server on the same port and store (every client's reconnect finds it, and the
queued work is still there), the gateway on the same port, a worker as a new process. Only a
failed initial deploy, a gateway port held by another process, or a child that refuses its
command line or settings (`USAGE_EXIT_CODE`) ends `shoal up`. On SIGINT or SIGTERM it stops
every child it started: workers first (they drain), then the gateway, then nats-server; no
child is restarted once the stop has begun.

The embedded nats-server runs with fresh credentials (`cluster_auth.py`): the supervisor
connects as `admin`, the gateway as `gateway` (`admin` when its admin API is on), each worker
as `worker`, each child told its user and the path of its password file through its
environment. A NATS given with `--nats` is used with the credentials given for it.

Everything runs on the main thread: the children get SIGTERM when the thread that started them
ends (PR_SET_PDEATHSIG), and one thread makes "restart" and "stop" unable to race.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from nats.aio.client import Client

from shoal.broker.connection import connect
from shoal.broker.dlq import ensure_dlq_stream
from shoal.broker.embedded import EmbeddedNats
from shoal.cluster_auth import (
    ADMIN,
    GATEWAY,
    WORKER,
    ClusterCredentials,
    create_cluster_credentials,
)
from shoal.cluster_file import (
    ClusterInfo,
    read_cluster_info,
    remove_cluster_info,
    state_dir,
    write_cluster_info,
)
from shoal.config import USAGE_EXIT_CODE, NatsAuth, QueueSettings
from shoal.process import child_preexec
from shoal.protocol import ModelSpec, encode_json
from shoal.state.attempts import ensure_attempts_kv
from shoal.state.deployments import DeploymentError, deploy
from shoal.state.fleet import LoadProgress
from shoal.state.keys import ensure_keys_kv
from shoal.state.profiles import ensure_profiles_kv
from shoal.state.workers import WorkerStatus, ensure_workers_kv, read_worker_statuses

STOP_TIMEOUT_S = 30.0
READY_TIMEOUT_S = 300.0
TICK_S = 0.1
PROGRESS_INTERVAL_S = 0.5  # how often `shoal up` looks at the workers' reports while starting
# A gateway that dies this many times in a row while another process holds its port ends
# `shoal up`: waiting longer would not free the port.
GATEWAY_BIND_ATTEMPTS = 5


@dataclass
class UpOptions:
    model: ModelSpec
    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1
    nats_url: str | None = None
    # Credentials for `nats_url` (every child uses them); the embedded server makes its own.
    nats_auth: NatsAuth = field(default_factory=NatsAuth)
    # The gateway's admin API is on: it deploys and handles dead letters (the admin role).
    gateway_admin: bool = False
    gateway_args: list[str] = field(default_factory=list)
    worker_args: list[str] = field(default_factory=list)


@dataclass
class Backoff:
    """Delay before restarting a child: `initial`, doubling up to `maximum` while it keeps dying,
    back to `initial` once it has stayed up `reset_after` seconds."""

    initial: float = 0.5
    maximum: float = 10.0
    reset_after: float = 30.0
    _next: float = 0.0

    def after_exit(self, uptime: float) -> float:
        """The delay before the next start of a child that ran `uptime` seconds."""
        if self._next == 0.0 or uptime >= self.reset_after:
            self._next = self.initial
        delay = self._next
        self._next = min(self.maximum, self._next * 2)
        return delay


class Child:
    """One supervised process: how to start it, when it started, when it is due to restart."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.backoff = Backoff()
        self.started_at = 0.0
        self.restart_at: float | None = None  # set while it is dead and waiting for its restart
        self.starts = 0

    def start(self) -> None:
        self._start()
        self.started_at = time.monotonic()
        self.restart_at = None
        self.starts += 1

    def _start(self) -> None:
        raise NotImplementedError

    def poll(self) -> int | None:
        """None while it runs (or was never started); else its exit status."""
        raise NotImplementedError

    @property
    def pid(self) -> int | None:
        raise NotImplementedError

    def clean_up_exited(self) -> None:
        """After it exited: end whatever it left behind."""


class ProcessChild(Child):
    """A `python -m shoal ...` child (the gateway or a worker) in its own process group."""

    def __init__(self, name: str, spawn: Callable[[], subprocess.Popen[bytes]]) -> None:
        super().__init__(name)
        self._spawn = spawn
        self.process: subprocess.Popen[bytes] | None = None

    def _start(self) -> None:
        self.process = self._spawn()

    def poll(self) -> int | None:
        return self.process.poll() if self.process is not None else None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def clean_up_exited(self) -> None:
        # A killed gateway can leave server workers (granian's) holding its port, and a worker
        # can leave an engine it started: end its whole process group.
        if self.process is not None:
            _kill_group(self.process.pid)

    def stop_wait(self, deadline: float) -> None:
        """Wait for the SIGTERM already sent, until `deadline`; then SIGKILL."""
        if self.process is None:
            return
        try:
            self.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        _kill_group(self.process.pid)


class NatsChild(Child):
    """The embedded nats-server: every start after the first is on the same port and store."""

    def __init__(self, server: EmbeddedNats) -> None:
        super().__init__("nats-server")
        self.server = server

    def _start(self) -> None:
        if self.starts == 0:
            self.server.start()
        else:
            self.server.restart()

    def poll(self) -> int | None:
        return self.server.poll()

    @property
    def pid(self) -> int | None:
        return self.server.pid


class Supervisor:
    def __init__(self, options: UpOptions) -> None:
        self.options = options
        self.nats: EmbeddedNats | None = None
        self.nats_url = options.nats_url or ""
        self._credentials: ClusterCredentials | None = None  # the embedded server's
        self.gateway_url = f"http://{options.host}:{options.port}"
        self._nats_child: NatsChild | None = None
        self._gateway: ProcessChild | None = None
        self._workers: list[ProcessChild] = []
        self._stop = False
        self._gateway_bind_failures = 0
        self._fatal: str | None = None  # why `shoal up` must end, once a child cannot be kept up

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
        # Only a flag: the main loop sees it, restarts nothing more and stops everything.
        self._stop = True

    def _run(self) -> int:
        options = self.options
        if _port_in_use(options.host, options.port):
            print(
                f"shoal up: the gateway's port {options.host}:{options.port} is in use by "
                "another process; choose another with --port",
                file=sys.stderr,
            )
            return 1
        if not self.nats_url:
            self._credentials = create_cluster_credentials(state_dir() / "nats-auth")
            self.nats = EmbeddedNats(
                store_dir=state_dir() / "nats", config_file=self._credentials.config_file
            )
            self._nats_child = NatsChild(self.nats)
            self._nats_child.start()
            self.nats_url = self.nats.url
        try:
            asyncio.run(self._prepare_queue())
        except DeploymentError as err:
            print(f"shoal up: {err}", file=sys.stderr)
            return 1
        gateway_args = ["--host", options.host, "--port", str(options.port), *options.gateway_args]
        gateway_env = self._nats_environment(ADMIN if options.gateway_admin else GATEWAY)
        self._gateway = ProcessChild(
            "gateway", lambda: self._spawn(["gateway", *gateway_args], gateway_env)
        )
        self._gateway.start()
        for i in range(options.workers):
            worker = ProcessChild(f"worker {i + 1}", self._spawn_worker)
            worker.start()
            self._workers.append(worker)
        if not self._wait_ready():
            return 1
        auth_dir = str(self._credentials.directory) if self._credentials else ""
        write_cluster_info(ClusterInfo(self.nats_url, self.gateway_url, os.getpid(), auth_dir))
        print(
            f"Shoal is up: {options.model.name} ({options.model.runtime}) on "
            f"{options.workers} worker(s)\n"
            f"  gateway  {self.gateway_url}/v1\n"
            f"  nats     {self.nats_url}\n"
            "Press Ctrl-C to stop.",
            flush=True,
        )
        while not self._stop:
            self._tick()
            if self._fatal:
                print(f"shoal up: {self._fatal}", file=sys.stderr)
                return 1
            time.sleep(TICK_S)
        return 0

    def _children(self) -> list[Child]:
        """NATS first: in a tick where several are due, the others need it."""
        children: list[Child] = []
        if self._nats_child is not None:
            children.append(self._nats_child)
        if self._gateway is not None:
            children.append(self._gateway)
        children.extend(self._workers)
        return children

    def _tick(self) -> None:
        """Notice children that died and restart those whose backoff has passed."""
        for child in self._children():
            if self._stop:
                return
            now = time.monotonic()
            if child.restart_at is None:
                code = child.poll()
                if code is not None:
                    self._on_exit(child, code, now)
            elif now >= child.restart_at:
                self._restart(child)

    def _on_exit(self, child: Child, code: int, now: float) -> None:
        child.clean_up_exited()
        uptime = now - child.started_at
        delay = child.backoff.after_exit(uptime)
        child.restart_at = now + delay
        reason = describe_exit(code)
        if code == USAGE_EXIT_CODE and isinstance(child, ProcessChild):
            self._fatal = (
                f"{child.name} {reason}: it refused its command line or a SHOAL_* setting "
                "(its message is above), and would refuse it again if restarted"
            )
            return
        if child is self._gateway:
            if _port_in_use(self.options.host, self.options.port):
                self._gateway_bind_failures += 1
                reason += f"; its port {self.options.host}:{self.options.port} is in use"
                if self._gateway_bind_failures >= GATEWAY_BIND_ATTEMPTS:
                    self._fatal = (
                        f"the gateway cannot bind {self.options.host}:{self.options.port}: "
                        f"another process holds it ({self._gateway_bind_failures} attempts)"
                    )
                    return
            else:
                self._gateway_bind_failures = 0
        print(
            f"shoal up: {child.name} (pid {child.pid}) {reason} after {uptime:.1f} s; "
            f"restarting in {delay:g} s",
            flush=True,
        )

    def _restart(self, child: Child) -> None:
        try:
            child.start()
        except Exception as err:  # any failed start is retried after a backoff
            delay = child.backoff.after_exit(0.0)
            child.restart_at = time.monotonic() + delay
            print(
                f"shoal up: {child.name} failed to start ({err}); retrying in {delay:g} s",
                flush=True,
            )
            return
        where = f" on {self.nats_url}" if isinstance(child, NatsChild) else ""
        print(f"shoal up: {child.name} restarted (pid {child.pid}){where}", flush=True)

    def _nats_auth(self, role: str) -> NatsAuth:
        """A role's credentials: the embedded server's, else those given for `--nats`."""
        if self._credentials is not None:
            return self._credentials.auth(role)
        return self.options.nats_auth

    def _nats_environment(self, role: str) -> dict[str, str]:
        """What tells a child its NATS credentials (never argv, where `ps` shows it)."""
        if self._credentials is not None:
            return self._credentials.environment(role)
        return self.options.nats_auth.environment()

    async def _prepare_queue(self) -> None:
        nc = await connect(self.nats_url, name="shoal-up", auth=self._nats_auth(ADMIN))
        try:
            js = nc.jetstream()
            await deploy(js, self.options.model, QueueSettings.from_environment())
            # Everything else the children use exists before they start, made by the admin:
            # the roles may look these up but need not create them.
            for ensure in (
                ensure_workers_kv,
                ensure_keys_kv,
                ensure_profiles_kv,
                ensure_attempts_kv,
                ensure_dlq_stream,
            ):
                await ensure(js)
        finally:
            await nc.close()

    def _spawn_worker(self) -> subprocess.Popen[bytes]:
        spec = self.options.model
        # Several workers on one machine share its cores instead of each taking all of them.
        threads = max(1, (os.cpu_count() or 1) // self.options.workers)
        env = {
            "SHOAL_THREADS": os.environ.get("SHOAL_THREADS", str(threads)),
            **self._nats_environment(WORKER),
        }
        return self._spawn(
            ["worker", "--model-json", encode_json(spec).decode(), *self.options.worker_args], env
        )

    def _spawn(self, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "shoal", *args, "--nats", self.nats_url],
            env={**os.environ, **(env or {})},
            preexec_fn=child_preexec,
            # Its own process group: a terminal's Ctrl-C reaches only `shoal up`, which then
            # stops the children in order (workers drain while the gateway and NATS still run).
            process_group=0,
        )

    def _wait_ready(self) -> bool:
        """Until the gateway's /readyz is 200 and counts every worker READY for the model,
        restarting whatever dies meanwhile.

        "Is up" is the gateway's own readiness (a probe and `shoal up` agree), plus a count:
        before the workers first report, no model is pinned yet and /readyz alone says 200.
        """
        deadline = time.monotonic() + READY_TIMEOUT_S
        progress = LoadProgress(self.options.model.name)
        reader = _StatusReader(self.nats_url, self._nats_auth(ADMIN))
        next_look = 0.0
        try:
            while time.monotonic() < deadline and not self._stop:
                self._tick()
                if self._fatal:
                    print(f"shoal up: {self._fatal}", file=sys.stderr)
                    return False
                if time.monotonic() >= next_look:
                    self._show_progress(progress, reader.read())
                    next_look = time.monotonic() + PROGRESS_INTERVAL_S
                if self._all_running():
                    ready = _ready_workers(f"{self.gateway_url}/readyz", self.options.model.name)
                    if ready >= len(self._workers):
                        # The last worker may have become ready since the last look.
                        self._show_progress(progress, reader.read())
                        return True
                time.sleep(TICK_S)
        finally:
            reader.close()
        if not self._stop:
            print(f"the cluster was not ready within {READY_TIMEOUT_S:g} s", file=sys.stderr)
        return False

    def _show_progress(self, progress: LoadProgress, statuses: list[WorkerStatus]) -> None:
        """Print each worker's load state as it changes ("worker 1: loading ...")."""
        names = {w.pid: w.name for w in self._workers if w.pid is not None}
        for _, line in progress.changes(
            statuses, lambda s: names.get(s.pid, f"worker {s.worker_id}")
        ):
            print(line, flush=True)

    def _all_running(self) -> bool:
        return all(c.restart_at is None and c.poll() is None for c in self._children())

    def stop(self) -> None:
        """Workers first (they drain), then the gateway, then NATS; nothing is left running.

        Runs on the main thread after the loop, so no restart can start a child meanwhile.
        """
        self._stop = True
        for group in (self._workers, [self._gateway] if self._gateway else []):
            for child in group:
                if child.process is not None and child.process.poll() is None:
                    child.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for child in group:
                child.stop_wait(deadline)
        if self.nats is not None:
            self.nats.stop()
        remove_cluster_info(os.getpid())


def describe_exit(code: int) -> str:
    """'was killed by SIGKILL' for a negative status, else 'exited with code N'."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _kill_group(pgid: int) -> None:
    # The usual case is that nothing of it is left.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _port_in_use(host: str, port: int) -> bool:
    """Whether another socket listens on host:port (connections in TIME_WAIT do not count)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


class _StatusReader:
    """Reads the workers' reports from the supervisor's synchronous loop: its own event loop
    and one connection, made at the first read. A failed read is an empty list (progress is
    only shown, never waited on)."""

    def __init__(self, nats_url: str, auth: NatsAuth) -> None:
        self._url = nats_url
        self._auth = auth
        self._loop = asyncio.new_event_loop()
        self._nc: Client | None = None

    def read(self) -> list[WorkerStatus]:
        try:
            return self._loop.run_until_complete(asyncio.wait_for(self._read(), 2))
        except Exception:  # NATS restarting, or the bucket not there yet: show nothing now
            return []

    async def _read(self) -> list[WorkerStatus]:
        if self._nc is None:
            self._nc = await connect(self._url, name="shoal-up-progress", auth=self._auth)
        return await read_worker_statuses(self._nc.jetstream())

    def close(self) -> None:
        if self._nc is not None:
            with contextlib.suppress(Exception):
                self._loop.run_until_complete(asyncio.wait_for(self._nc.close(), 2))
        self._loop.close()


def _ready_workers(readyz_url: str, model: str) -> int:
    """How many READY workers the gateway's /readyz counts for `model`; 0 unless it is 200."""
    try:
        with urllib.request.urlopen(readyz_url, timeout=1) as response:
            if response.status != 200:
                return 0
            counts = json.loads(response.read()).get("ready_workers", {})
    except (OSError, ValueError, AttributeError):  # not up, not ready (503), or not JSON
        return 0
    ready = counts.get(model, 0) if isinstance(counts, dict) else 0
    return ready if isinstance(ready, int) else 0
