"""Shared pieces of the benchmarks: a real `shoal up` cluster and load generators.

Throughput is measured with wrk (C, a small fraction of a core) where it is installed: a Python
client spends a whole core on its own side above ~100 requests/s on this machine. The Python
closed-loop client exists for the smoke test, which must run where wrk is not installed.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

from bench.loadgen import SMALL_TEXT, LoadResult, quantile
from shoal.process import child_preexec, free_port

RESULTS_DIR = Path(__file__).parent / "results"

SENTENCE = SMALL_TEXT  # the one short sentence every benchmark sends


class UpCluster:
    """`shoal up` as a child process, in its own state directory, stopped with SIGINT."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.state_dir = tempfile.mkdtemp(prefix="shoal-bench-")
        self.args = ["--port", str(self.port), *args]
        self.env = {**os.environ, "SHOAL_STATE_DIR": self.state_dir, **(env or {})}
        self.env.pop("SHOAL_NATS", None)
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[str] | None = None
        self.output: collections.deque[str] = collections.deque(maxlen=200)  # its last lines

    def __enter__(self) -> UpCluster:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "shoal", "up", *self.args],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=child_preexec,  # a benchmark killed mid-run leaves no cluster behind
        )
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.output.append(line)
            if "Ctrl-C" in line:
                # Keep reading: a cluster that logs more than a pipe holds (64 KiB; a stop
                # with requests in flight can) would block on its next write.
                threading.Thread(target=self._read_output, daemon=True).start()
                return self
        raise RuntimeError(f"shoal up did not start (exit {self.process.wait()})")

    def _read_output(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for line in self.process.stdout:
            self.output.append(line)

    def __exit__(self, *exc: object) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGINT)
        self.process.wait(60)
        shutil.rmtree(self.state_dir, ignore_errors=True)

    def logged_warnings(self) -> list[str]:
        """The cluster's warnings and errors among its last 200 lines of output (a worker
        that profiles again says so: a stall in a bench's figures can be told apart)."""
        return [line.rstrip() for line in self.output if " WARNING " in line or " ERROR " in line]

    @property
    def nats_url(self) -> str:
        """The cluster's embedded NATS, as `shoal up` wrote it into its state directory."""
        return json.loads((Path(self.state_dir) / "cluster.json").read_text())["nats_url"]

    @property
    def nats_auth(self):
        """The `admin` credentials `shoal up` generated for its NATS (NATS admits no one
        without them), as every `shoal` command run with this state directory finds them."""
        from shoal.cluster_auth import ADMIN, ClusterCredentials

        info = json.loads((Path(self.state_dir) / "cluster.json").read_text())
        return ClusterCredentials(Path(info["nats_auth_dir"])).auth(ADMIN)

    def _with_jetstream(self, read):
        """`await read(js)` on a connection of its own to the cluster's NATS."""
        from shoal.broker.connection import connect

        async def run():
            nc = await connect(self.nats_url, name="bench", auth=self.nats_auth)
            try:
                return await read(nc.jetstream())
            finally:
                await nc.close()

        return asyncio.run(run())

    def worker_statuses(self) -> list:
        """Every worker status report (one per worker and model it holds)."""
        from shoal.state.workers import read_worker_statuses

        return self._with_jetstream(read_worker_statuses)

    def work_messages_stored(self) -> int:
        """Messages the work stream has stored since it was made (its last sequence): with
        the requests sent over a window, the requests a JetStream message carried (envelopes
        of group commit, gateway/committer.py)."""
        from shoal.protocol import WORK_STREAM

        async def last_sequence(js) -> int:
            return (await js.stream_info(WORK_STREAM)).state.last_seq

        return self._with_jetstream(last_sequence)

    def metrics_urls(self) -> list[str]:
        """Each worker process's /metrics, once (a worker reports once per model it holds)."""
        return sorted({status.metrics_url for status in self.worker_statuses()})

    def reported_metrics_urls(self, timeout: float = 20.0) -> list[str]:
        """`metrics_urls`, waiting up to `timeout` for the first worker's status report."""
        deadline = time.monotonic() + timeout
        while not (urls := self.metrics_urls()) and time.monotonic() < deadline:
            time.sleep(0.25)  # a worker reports once a second
        if not urls:
            raise RuntimeError(f"no worker reported within {timeout:g} s")
        return urls

    def component_cpu_seconds(self) -> dict[str, float]:
        """CPU time so far of each part of the cluster: nats, gateway, workers, supervisor."""
        assert self.process is not None
        totals: dict[str, float] = {}
        for pid, name in component_tree(self.process.pid).items():
            totals[name] = totals.get(name, 0.0) + process_cpu_seconds(pid)
        return totals


_WRK_SCRIPT = """
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local models = {MODELS}
local n = 0
request = function()
  n = n + 1
  local body = '{"model":"' .. models[(n % #models) + 1] .. '","encoding_format":"ENCODING",' ..
    '"input":"' .. string.format("SENTENCE", n) .. '"}'
  return wrk.format(nil, "/v1/embeddings", nil, body)
end
"""


def wrk_available() -> bool:
    return shutil.which("wrk") is not None


def run_wrk(
    url: str,
    model: str,
    connections: int,
    seconds: float,
    also: tuple[str, ...] = (),
    encoding: str = "base64",
) -> LoadResult:
    """Closed loop: `connections` clients, each sending the next request on its reply.

    With `also`, requests go round-robin to `model` and those models (a mixed load).
    `encoding` is the request's `encoding_format`: "base64" or "float" (JSON numbers, what
    curl and most non-Python clients get).
    """
    names = ", ".join(f'"{name}"' for name in (model, *also))
    script = (
        _WRK_SCRIPT.replace("MODELS", names)
        .replace("SENTENCE", SENTENCE.format(i="%d"))
        .replace("ENCODING", encoding)
    )
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as handle:
        handle.write(script)
    command = [
        "wrk",
        "-t1",
        f"-c{connections}",
        f"-d{seconds:g}s",
        "--latency",
        "--timeout",
        "30s",
        "-s",
        handle.name,
        url,
    ]
    started = _self_children_cpu()
    output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    os.unlink(handle.name)
    requests = int(re.search(r"(\d+) requests in", output).group(1))
    errors = _wrk_errors(output)
    client_cpu_s = _self_children_cpu() - started
    return LoadResult(
        client="wrk",
        mode="closed",
        sizes="small",
        offered_rps=0.0,
        connections=connections,
        seconds=seconds,
        sent=requests,
        answered=requests,
        ok=requests - errors,
        statuses={},
        rps=float(re.search(r"Requests/sec:\s+([\d.]+)", output).group(1)),
        p50_ms=_wrk_ms(re.search(r"\s50%\s+([\d.]+\w+)", output).group(1)),
        p90_ms=_wrk_ms(re.search(r"\s90%\s+([\d.]+\w+)", output).group(1)),
        p99_ms=_wrk_ms(re.search(r"\s99%\s+([\d.]+\w+)", output).group(1)),
        max_ms=_wrk_ms(_wrk_latency(output)[2]),
        mean_ms=_wrk_ms(_wrk_latency(output)[0]),
        client_cpu_s=client_cpu_s,
        client_cores=client_cpu_s / seconds,
    )


def _wrk_latency(output: str) -> tuple[str, str, str]:
    """wrk's "Latency avg stdev max" line."""
    match = re.search(r"Latency\s+([\d.]+\w+)\s+([\d.]+\w+)\s+([\d.]+\w+)", output)
    return match.groups() if match else ("0ms", "0ms", "0ms")


def _wrk_errors(output: str) -> int:
    match = re.search(r"Non-2xx or 3xx responses: (\d+)", output)
    return int(match.group(1)) if match else 0


def _wrk_ms(text: str) -> float:
    value, unit = re.match(r"([\d.]+)(\w+)", text).groups()
    return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 6e4}[unit]


def run_python_load(
    url: str, model: str, connections: int, seconds: float, encoding: str = "base64"
) -> LoadResult:
    """The same closed loop in Python (httpx): for the smoke test, not for throughput figures."""
    import httpx

    latencies: list[float] = []
    errors = 0

    async def client_loop(client: httpx.AsyncClient, start: int, end_at: float) -> None:
        nonlocal errors
        i = start
        while time.monotonic() < end_at:
            body = {"model": model, "encoding_format": encoding, "input": SENTENCE.format(i=i)}
            sent = time.perf_counter()
            response = await client.post("/v1/embeddings", json=body)
            latencies.append(time.perf_counter() - sent)
            errors += response.status_code != 200
            i += connections

    async def run() -> float:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            started = time.monotonic()
            end_at = started + seconds
            await asyncio.gather(*(client_loop(client, c, end_at) for c in range(connections)))
            return time.monotonic() - started

    cpu_before = time.process_time()
    elapsed = asyncio.run(run())
    latencies.sort()
    cpu = time.process_time() - cpu_before
    return LoadResult(
        client="python-httpx",
        mode="closed",
        sizes="small",
        offered_rps=0.0,
        connections=connections,
        seconds=elapsed,
        sent=len(latencies),
        answered=len(latencies),
        ok=len(latencies) - errors,
        statuses={},
        rps=len(latencies) / elapsed,
        p50_ms=1000 * quantile(latencies, 0.50),
        p90_ms=1000 * quantile(latencies, 0.90),
        p99_ms=1000 * quantile(latencies, 0.99),
        max_ms=1000 * (latencies[-1] if latencies else 0.0),
        mean_ms=1000 * (sum(latencies) / len(latencies) if latencies else 0.0),
        client_cpu_s=cpu,
        client_cores=cpu / elapsed if elapsed > 0 else 0.0,
    )


def run_load(
    url: str, model: str, connections: int, seconds: float, client: str, encoding: str = "base64"
) -> LoadResult:
    """A closed loop of single-sentence /v1/embeddings requests, by wrk or (smoke) httpx."""
    if client == "wrk":
        return run_wrk(url, model, connections, seconds, encoding=encoding)
    return run_python_load(url, model, connections, seconds, encoding)


def hot_load_adapter(
    up: UpCluster, name: str, base: str, adapter: Path, route: str, body: dict
) -> dict[str, float]:
    """`shoal deploy NAME --base BASE --lora ADAPTER` on a running cluster, then one request
    sent the moment the command returns: seconds to the command's return and to the first 200.
    """
    import httpx

    began = time.perf_counter()
    command = [sys.executable, "-m", "shoal", "deploy", name, "--base", base]
    # The cluster's environment: its state directory holds the credentials its NATS asks for.
    subprocess.run(
        [*command, "--lora", str(adapter), "--nats", up.nats_url],
        env=up.env,
        check=True,
        capture_output=True,
    )
    returned = time.perf_counter() - began
    while True:
        response = httpx.post(f"{up.url}{route}", json={"model": name, **body}, timeout=120)
        if response.status_code == 200:
            break
        time.sleep(0.05)  # not yet known to the gateway: 404
    return {"deploy_returns_s": returned, "first_200_s": time.perf_counter() - began}


def write_result(name: str, payload: dict) -> Path:
    """Write `bench/results/<name>.json`, or to `name` itself when it is a path."""
    path = Path(name) if "/" in name else RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=_jsonable) + "\n")
    return path


def _jsonable(value: object) -> object:
    if isinstance(value, LoadResult):
        return value.summary()
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)  # type: ignore[arg-type]
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


def machine_facts() -> dict[str, object]:
    return {
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _parents() -> dict[int, int]:
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    return parents


def process_tree(root: int) -> list[int]:
    """`root` and its descendants, parents before their children."""
    parents = _parents()
    found, frontier = [root], {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier}
        found.extend(sorted(frontier))
    return found


def component_tree(root: int) -> dict[int, str]:
    """Each process under `root` by component. A child whose command line names none (the
    gateway's server processes, started by multiprocessing) belongs to its parent's."""
    parents = _parents()
    components: dict[int, str] = {}
    for pid in process_tree(root):
        name = component_of(pid)
        if name == "other" and parents.get(pid) in components:
            name = components[parents[pid]]
        components[pid] = name
    return components


def component_of(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "gone"
    if argv and argv[0].endswith(b"nats-server"):
        return "nats"
    for name in (b"gateway", b"worker", b"up"):
        if name in argv:
            return "supervisor" if name == b"up" else name.decode()
    return "other"


def cpu_share(
    before: dict[str, float], after: dict[str, float], seconds: float
) -> dict[str, float]:
    """Cores used by each component between two readings (1.0 = one core busy)."""
    return {k: round((after.get(k, 0) - before.get(k, 0)) / seconds, 3) for k in after}


def process_cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _self_children_cpu() -> float:
    usage = os.times()
    return usage.children_user + usage.children_system
