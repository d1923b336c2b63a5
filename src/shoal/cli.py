"""The `shoal` command. Every flag has a `SHOAL_*` environment variable; the flag wins."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from typing import TYPE_CHECKING

import msgspec

from shoal.catalog import BUILTIN_MODELS, DEFAULT_MODEL, resolve_model
from shoal.cli_dlq import add_dlq_parser, run_dlq
from shoal.cli_keys import add_keys_parser, run_keys
from shoal.cluster_file import (
    ClusterInfo,
    add_nats_arguments,
    nats_auth_from_args,
    remove_cluster_info,
    resolve_nats,
    state_dir,
    write_cluster_info,
)
from shoal.config import (
    API_KEY_MODES,
    BATCH_WAITS,
    HTTP_SERVERS,
    GatewaySettings,
    HttpTimeouts,
    LatencyTargets,
    QueueSettings,
    WorkerSettings,
    default_memory_budget_mb,
    env_choice,
    env_default,
    local_gateway_processes,
    refuse_setting,
)
from shoal.process import free_port
from shoal.protocol import ModelSpec, Task, is_valid_model_name
from shoal.runtimes.registry import check_runtime

if TYPE_CHECKING:
    from nats.aio.client import Client

    from shoal.state.workers import WorkerStatus

# How long a command waits for NATS before it says it cannot reach it (a service waits forever).
CONNECT_TIMEOUT_S = 10.0


def nats_unreachable(url: str, timeout_s: float) -> str:
    """The message for a NATS that did not answer: the URL tried and what to check."""
    return (
        f"cannot reach NATS at {url} within {timeout_s:g} s: check that the server runs "
        "(`shoal up` or `shoal nats`), that the URL is right (--nats or SHOAL_NATS), and that "
        "the credentials and TLS files suit it (--nats-user, --nats-creds, --nats-tls-ca)"
    )


def _parse_option(text: str) -> tuple[str, object]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        value: object = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        value = raw  # a bare string
    return key, value


def _add_nats(parser: argparse.ArgumentParser) -> None:
    add_nats_arguments(parser)


def _add_model(parser: argparse.ArgumentParser, default: str | None = DEFAULT_MODEL) -> None:
    parser.add_argument(
        "--model",
        default=env_default("MODEL", default or ""),
        help=f"deployment name (env SHOAL_MODEL, default {DEFAULT_MODEL})",
    )
    _add_spec_flags(parser)


def _add_spec_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--runtime", default=None, help="runtime: torch, llamacpp or sim (simulated)"
    )
    parser.add_argument(
        "--task", default=None, choices=[t.value for t in Task], help="default: embeddings"
    )
    parser.add_argument("--source", default=None, help="model path or package:NAME")
    parser.add_argument(
        "--option",
        action="append",
        type=_parse_option,
        default=[],
        metavar="KEY=VALUE",
        help="runtime option, repeatable",
    )


def _add_batching(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-batch-items",
        type=int,
        default=env_default("MAX_BATCH_ITEMS", WorkerSettings.max_batch_items),
        help="items per batch (generation: sequences decoded together); default 0: profiled "
        "on first load and stored (zero tuning)",
    )
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=env_default("MAX_BATCH_TOKENS", WorkerSettings.max_batch_tokens),
    )
    parser.add_argument(
        "--batch-wait",
        choices=BATCH_WAITS,
        default=env_choice("BATCH_WAIT", "adaptive", BATCH_WAITS),
        help="adaptive: wait a little for a fuller batch when the measured cost curve says it "
        "pays (default); off: run whatever is held at once (eager)",
    )


def _add_gateway(parser: argparse.ArgumentParser, processes: int) -> None:
    """The gateway's flags; `processes`: --gateways' default (before SHOAL_GATEWAYS)."""
    parser.add_argument("--host", default=env_default("HOST", GatewaySettings.host))
    parser.add_argument("--port", type=int, default=env_default("PORT", GatewaySettings.port))
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=env_default("REQUEST_TIMEOUT", GatewaySettings.request_timeout_s),
        help="seconds",
    )
    parser.add_argument(
        "--stream-idle-timeout",
        type=float,
        default=env_default("STREAM_IDLE_TIMEOUT", GatewaySettings.stream_idle_timeout_s),
        help="seconds a started stream may stay silent before it ends with an error",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=env_default("MAX_BODY_BYTES", GatewaySettings.max_body_bytes),
    )
    admin = parser.add_mutually_exclusive_group()
    admin.add_argument(
        "--admin-token",
        default=env_default("ADMIN_TOKEN", ""),
        help="token for the admin API (/admin/models); without one the API is off. A flag "
        "shows in the process list (ps): prefer env SHOAL_ADMIN_TOKEN or --admin-token-file",
    )
    admin.add_argument(
        "--admin-token-file",
        default="",
        metavar="PATH",
        help="read the admin token from this file (env SHOAL_ADMIN_TOKEN_FILE)",
    )
    keys = parser.add_mutually_exclusive_group()
    keys.add_argument(
        "--require-api-keys",
        dest="api_keys",
        action="store_const",
        const="required",
        help="inference routes need an API key (`shoal keys create`) even on loopback",
    )
    keys.add_argument(
        "--no-auth",
        dest="api_keys",
        action="store_const",
        const="off",
        help="no API keys, even off loopback: anyone who reaches the gateway uses every model",
    )
    # Default (env SHOAL_API_KEYS=auto|required|off): keys required unless on loopback only.
    parser.set_defaults(api_keys=env_choice("API_KEYS", GatewaySettings.api_keys, API_KEY_MODES))
    parser.add_argument(
        "--http-server",
        choices=HTTP_SERVERS,
        default=env_choice("HTTP_SERVER", GatewaySettings.http_server, HTTP_SERVERS),
    )
    parser.add_argument(
        "--gateways",
        type=int,
        default=env_default("GATEWAYS", processes),
        help="gateway processes sharing the port; one serves about a core's worth of requests "
        f"(default here: {processes})",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="embedded NATS + gateway + workers, in the foreground")
    _add_nats(up)
    _add_gateway(up, local_gateway_processes(os.cpu_count()))
    _add_model(up)
    _add_batching(up)
    _add_placement(up)
    up.add_argument("--workers", type=int, default=env_default("WORKERS", 1))

    gateway = commands.add_parser("gateway", help="the HTTP gateway alone")
    _add_nats(gateway)
    _add_gateway(gateway, GatewaySettings.processes)

    worker = commands.add_parser("worker", help="a worker sidecar: one model, or a fleet")
    _add_nats(worker)
    _add_model(worker, default=None)
    _add_batching(worker)
    _add_placement(worker)
    worker.add_argument(
        "--fleet",
        action="store_true",
        help="place models by pulling: load any deployed model with a backlog nobody serves",
    )
    worker.add_argument("--model-json", default=None, help=argparse.SUPPRESS)
    worker.add_argument(
        "--metrics-port",
        type=int,
        default=env_default("METRICS_PORT", WorkerSettings.metrics_port),
        help="port of the worker's /metrics (0: a free port)",
    )
    worker.add_argument(
        "--metrics-host",
        default=env_default("METRICS_HOST", WorkerSettings.metrics_host),
        help="address the worker's /metrics listens on (0.0.0.0 in a container)",
    )

    nats_cmd = commands.add_parser("nats", help="the embedded nats-server alone")
    nats_cmd.add_argument("--port", type=int, default=env_default("NATS_PORT", -1))
    nats_cmd.add_argument(
        "--cluster",
        type=int,
        default=1,
        metavar="N",
        help="run N nodes joined into one JetStream cluster on this machine (each on a free "
        "port; --port is then ignored), to try replication and failover",
    )

    status = commands.add_parser("status", help="the workers of a cluster and what they do")
    _add_nats(status)
    status.add_argument("--json", action="store_true", help="one JSON document")
    status.add_argument(
        "--watch", action="store_true", help="refresh every --interval seconds until Ctrl-C"
    )
    status.add_argument(
        "--interval", type=float, default=2.0, help="seconds between refreshes (default 2)"
    )

    deploy = commands.add_parser("deploy", help="deploy a model (no restart anywhere)")
    deploy.add_argument("name", help="the name clients use; a built-in name needs no flags")
    _add_nats(deploy)
    _add_spec_flags(deploy)
    deploy.add_argument("--base", default=None, help="the deployment a LoRA adapter is for")
    deploy.add_argument("--lora", default=None, help="a PEFT LoRA adapter directory (--base)")
    deploy.add_argument(
        "--wait",
        action="store_true",
        help="wait until a worker reports it ready, printing its load states; exit 1 if a "
        "worker fails to load it or after --timeout",
    )
    deploy.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds --wait waits for a ready worker (default 300)",
    )

    undeploy = commands.add_parser("undeploy", help="remove a deployment")
    undeploy.add_argument("name")
    _add_nats(undeploy)

    models = commands.add_parser("models", help="deployments, their workers, backlog, budget")
    _add_nats(models)
    models.add_argument("--json", action="store_true", help="one JSON document")

    runtimes = commands.add_parser("runtimes", help="the runtimes, what each serves, installed?")
    runtimes.add_argument("--json", action="store_true", help="one JSON document")
    add_keys_parser(commands)
    add_dlq_parser(commands)
    return parser


def _add_placement(parser: argparse.ArgumentParser) -> None:
    defaults = WorkerSettings(nats_url="")
    parser.add_argument(
        "--memory-budget-mb",
        type=float,
        default=env_default("MEMORY_BUDGET_MB", 0.0),
        help="memory a worker's models may take (default: half of the machine's, shared "
        "among `shoal up`'s workers)",
    )
    parser.add_argument(
        "--idle-unload",
        type=float,
        default=env_default("IDLE_UNLOAD", defaults.idle_unload_s),
        help="seconds without work before a placed model is unloaded (0: never)",
    )
    parser.add_argument(
        "--min-residency",
        type=float,
        default=env_default("MIN_RESIDENCY", defaults.min_residency_s),
        help="seconds a placed model stays loaded before it may be evicted",
    )


def _model_spec(args: argparse.Namespace, name: str | None = None) -> ModelSpec:
    if getattr(args, "model_json", None):
        return msgspec.json.decode(args.model_json, type=ModelSpec)
    name = name or args.model
    if not is_valid_model_name(name):
        raise SystemExit(f"invalid model name {name!r}")
    try:
        spec = resolve_model(
            name,
            runtime=args.runtime,
            source=args.source,
            task=args.task,
            options=dict(args.option),
        )
        check_runtime(spec)
        return spec
    except ValueError as err:
        raise SystemExit(str(err)) from None


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(
        level=os.environ.get("SHOAL_LOG_LEVEL", "WARNING").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    args = build_parser().parse_args(argv)
    handler = {
        "up": _up,
        "gateway": _gateway,
        "worker": _worker,
        "nats": _nats,
        "status": _status,
        "deploy": _deploy,
        "undeploy": _undeploy,
        "models": _models,
        "runtimes": _runtimes,
        "keys": run_keys,
        "dlq": run_dlq,
    }[args.command]
    sys.exit(handler(args) or 0)


def _up(args: argparse.Namespace) -> int:
    from shoal.supervisor import Supervisor, UpOptions

    nats_url = args.nats or os.environ.get("SHOAL_NATS") or None
    # Credentials for a NATS given with --nats; the embedded one makes its own.
    nats_auth = nats_auth_from_args(args)
    batching = ["--max-batch-tokens", str(args.max_batch_tokens), "--batch-wait", args.batch_wait]
    if args.max_batch_items:
        batching += ["--max-batch-items", str(args.max_batch_items)]
    gateway = [
        "--request-timeout",
        str(args.request_timeout),
        "--stream-idle-timeout",
        str(args.stream_idle_timeout),
        "--max-body-bytes",
        str(args.max_body_bytes),
        "--http-server",
        args.http_server,
        "--gateways",
        str(args.gateways),
    ]
    gateway += {"required": ["--require-api-keys"], "off": ["--no-auth"]}.get(args.api_keys, [])
    admin_token = _admin_token(args)
    if admin_token:  # to the gateway child through its environment, not argv
        os.environ["SHOAL_ADMIN_TOKEN"] = admin_token
    # Each of N workers gets an equal share of the machine's model memory by default.
    budget = args.memory_budget_mb or default_memory_budget_mb() / max(1, args.workers)
    placement = [
        "--fleet",
        "--memory-budget-mb",
        f"{budget:.0f}",
        "--idle-unload",
        str(args.idle_unload),
        "--min-residency",
        str(args.min_residency),
    ]
    options = UpOptions(
        model=_model_spec(args),
        host=args.host,
        port=args.port or free_port(args.host),
        workers=args.workers,
        nats_url=nats_url,
        nats_auth=nats_auth,
        gateway_admin=bool(admin_token),
        gateway_args=gateway,
        worker_args=[*batching, *placement],
    )
    return Supervisor(options).run()


def _gateway(args: argparse.Namespace) -> int:
    from shoal.gateway.server import serve

    admin_token = _admin_token(args)
    # The admin API deploys and manages dead letters: on the local cluster that takes the
    # admin role; without the API the gateway gets only the gateway role's subjects.
    role = "admin" if admin_token else "gateway"
    nats_url, nats_auth = resolve_nats(args.nats, nats_auth_from_args(args), role)
    settings = GatewaySettings(
        nats_url=nats_url,
        nats_auth=nats_auth,
        host=args.host,
        port=args.port,
        max_body_bytes=args.max_body_bytes,
        request_timeout_s=args.request_timeout,
        stream_idle_timeout_s=args.stream_idle_timeout,
        http_server=args.http_server,
        processes=args.gateways,
        admin_token=admin_token,
        api_keys=args.api_keys,
        queue=QueueSettings.from_environment(),
        http_timeouts=HttpTimeouts.from_environment(),
    )
    serve(settings)
    return 0


def _admin_token(args: argparse.Namespace) -> str:
    """The admin token, read once: the first line of `--admin-token-file`, else `--admin-token`
    or SHOAL_ADMIN_TOKEN, else the first line of the file SHOAL_ADMIN_TOKEN_FILE names."""
    path = args.admin_token_file or (
        "" if args.admin_token else os.environ.get("SHOAL_ADMIN_TOKEN_FILE", "")
    )
    if not path:
        return args.admin_token
    try:
        with open(path, encoding="utf-8") as file:
            token = file.readline().strip()
    except OSError as err:
        raise SystemExit(f"shoal: cannot read the admin token file: {err}") from None
    if not token:
        raise SystemExit(f"shoal: the admin token file {path} is empty")
    return token


def _worker(args: argparse.Namespace) -> int:
    import uvloop

    from shoal.process import tune_garbage_collector
    from shoal.worker.heap import DEFAULT_TRIM_INTERVAL_S, start_heap_trimmer
    from shoal.worker.sidecar import ModelLoadError, WorkerSidecar

    tune_garbage_collector()
    # A CPU model's batches of changing sizes fragment the C heap; trimming it keeps RSS flat.
    try:
        start_heap_trimmer(env_default("MALLOC_TRIM_S", DEFAULT_TRIM_INTERVAL_S))
    except ValueError as err:
        refuse_setting(f"shoal worker: {err}")
    given = bool(args.model or args.model_json)
    if not given and not args.fleet:
        args.model = DEFAULT_MODEL
    models: tuple[ModelSpec, ...] = ()
    deployed: tuple[str, ...] = ()
    if _names_a_deployment(args):
        deployed = (args.model,)  # its spec comes from the cluster's deployments
    elif given or not args.fleet:
        models = (_model_spec(args),)
    nats_url, nats_auth = resolve_nats(args.nats, nats_auth_from_args(args), "worker")
    settings = WorkerSettings(
        nats_url=nats_url,
        nats_auth=nats_auth,
        models=models,
        deployed_models=deployed,
        max_batch_items=args.max_batch_items,
        max_batch_tokens=args.max_batch_tokens,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        fleet=args.fleet,
        memory_budget_mb=args.memory_budget_mb or default_memory_budget_mb(),
        idle_unload_s=args.idle_unload,
        min_residency_s=args.min_residency,
        queue=QueueSettings.from_environment(),
        latency_targets=LatencyTargets.from_environment(),
        adaptive_batch_wait=args.batch_wait == "adaptive",
        runtime_threads=env_default("THREADS", 0),
    )
    sidecar = WorkerSidecar(settings)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, sidecar.request_stop)
        await sidecar.run()

    try:
        uvloop.run(run())
    except ModelLoadError as err:
        print(f"shoal worker: {err}", file=sys.stderr)
        return 1
    return 0


def _names_a_deployment(args: argparse.Namespace) -> bool:
    """`--model NAME` alone, for a name that is not built in: a deployment to look up."""
    return (
        bool(args.model)
        and not args.model_json
        and args.model not in BUILTIN_MODELS
        and not (args.runtime or args.source or args.task or args.option)
    )


def _nats(args: argparse.Namespace) -> int:
    from shoal.broker.cluster import LocalCluster
    from shoal.broker.embedded import EmbeddedNats
    from shoal.cluster_auth import create_cluster_credentials

    credentials = create_cluster_credentials(state_dir() / "nats-auth")
    server: EmbeddedNats | LocalCluster
    if args.cluster > 1:
        server = LocalCluster(
            args.cluster, state_dir() / "nats-cluster", config_file=credentials.config_file
        )
    else:
        server = EmbeddedNats(
            store_dir=state_dir() / "nats", port=args.port, config_file=credentials.config_file
        )
    url = server.start()
    write_cluster_info(ClusterInfo(url, "", os.getpid(), str(credentials.directory)))
    print(
        f"nats {url}\n"
        f"  credentials  {credentials.directory} (admin, gateway, worker; `shoal` commands "
        "here find them)\nPress Ctrl-C to stop.",
        flush=True,
    )
    stop_signals = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    try:
        signal.sigwait(stop_signals)
    finally:
        server.stop()
        remove_cluster_info(os.getpid())
    return 0


def _status(args: argparse.Namespace) -> int:
    from shoal.state.workers import read_worker_statuses

    if args.interval <= 0:
        raise SystemExit("shoal status: --interval must be more than 0 seconds")
    # Clearing the screen only makes sense on a terminal; piped output keeps every refresh.
    clear = args.watch and sys.stdout.isatty()

    async def show() -> None:
        stopped = _stop_on_ctrl_c() if args.watch else asyncio.Event()
        nc = await _connect(args, "shoal-status")
        try:
            while True:
                statuses = await read_worker_statuses(nc.jetstream())
                if clear:
                    print("\x1b[H\x1b[2J", end="")
                if args.watch and not args.json:
                    print(f"shoal status, every {args.interval:g} s: {time.strftime('%H:%M:%S')}")
                _print_statuses(statuses, args.json)
                sys.stdout.flush()
                if not args.watch:
                    return
                if await _pause_unless_stopped(stopped, args.interval):
                    return
        finally:
            await nc.close()

    with contextlib.suppress(KeyboardInterrupt):  # how --watch ends
        asyncio.run(show())
    return 0


def _stop_on_ctrl_c() -> asyncio.Event:
    """An event Ctrl-C sets, for a polling loop to read between its NATS requests
    (`_pause_unless_stopped`); a second Ctrl-C stops at once. Not asyncio.run's own handling,
    which cancels the task wherever it waits: inside nats.py, some awaits swallow the
    CancelledError (`Client._flush_pending`), and the loop would run on."""
    stopped = asyncio.Event()

    def on_ctrl_c() -> None:
        if stopped.is_set():
            raise KeyboardInterrupt
        stopped.set()

    asyncio.get_running_loop().add_signal_handler(signal.SIGINT, on_ctrl_c)
    return stopped


async def _pause_unless_stopped(stopped: asyncio.Event, seconds: float) -> bool:
    """Wait `seconds` between two polls; True (at once) once `stopped` is set."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stopped.wait(), seconds)
    return stopped.is_set()


def _print_statuses(statuses: list[WorkerStatus], as_json: bool) -> None:
    """The workers' reports as a table, or as one JSON document (a list of WorkerStatus)."""
    from shoal.protocol import encode_json

    if as_json:
        print(encode_json(statuses).decode())
        return
    print(
        f"{'WORKER':<36} {'MODEL':<22} {'RUNTIME':<12} {'STATE':<9} "
        f"{'ITEMS':>8} {'BUDGET':>6} {'LARGEST':>7} {'BUSY':>6}"
    )
    for s in statuses:
        runtime = f"{s.runtime} (sim)" if s.simulated else s.runtime
        print(
            f"{s.worker_id:<36} {s.model:<22} {runtime:<12} {s.state.value:<9} "
            f"{s.items_done:>8} {s.max_batch_items:>6} {s.largest_batch:>7} "
            f"{s.busy_fraction:>6.0%}"
        )
    if not statuses:
        print("(no worker reports: none running, or none has reported yet)")


def _deploy(args: argparse.Namespace) -> int:
    from shoal.state.deployments import DeploymentError, deploy, lora_spec

    if bool(args.base) != bool(args.lora):
        raise SystemExit("shoal deploy: --base and --lora go together")

    async def run() -> int:
        # Before "deployed" is printed: a Ctrl-C right after it (the CLI test sends one then)
        # could land before the wait had set its handler (it first imports its modules: slow
        # on a busy machine), in asyncio.run's own, whose cancel nats.py can swallow, and the
        # wait ran on to its timeout (the likely cause of that test's one timeout in CI).
        stopped = _stop_on_ctrl_c() if args.wait else None
        async with _jetstream(args, "shoal-deploy") as js:
            if args.lora:
                spec = await lora_spec(js, args.name, args.base, args.lora)
            else:
                spec = _model_spec(args, name=args.name)
            await deploy(js, spec, QueueSettings.from_environment())
        print(f"deployed {spec.name} ({spec.runtime}, {spec.task.value})", flush=True)
        if stopped is None:
            return 0
        if stopped.is_set():
            return 130  # Ctrl-C while deploying: deployed, not waited for
        return await _wait_until_loaded(args, spec.name, stopped)

    # One event loop for both steps: a Ctrl-C between two loops could land in the first one's
    # teardown (printed as an ignored exception, then lost).
    try:
        return asyncio.run(run())
    except DeploymentError as err:
        raise SystemExit(f"shoal deploy: {err}") from None
    except KeyboardInterrupt:
        return 130


async def _wait_until_loaded(args: argparse.Namespace, model: str, stopped: asyncio.Event) -> int:
    """`deploy --wait`: print each worker's load state as it changes until one is READY (0);
    1 when a worker reports FAILED or after --timeout; 130 once `stopped` (Ctrl-C) is set."""
    from shoal.state.fleet import LoadProgress
    from shoal.state.workers import WorkerState, read_worker_statuses

    progress = LoadProgress(model)
    deadline = time.monotonic() + args.timeout
    seen_any = False
    nc = await _connect(args, "shoal-deploy-wait")
    try:
        while time.monotonic() < deadline:
            statuses = await read_worker_statuses(nc.jetstream())
            for status, line in progress.changes(statuses, lambda s: f"worker {s.worker_id}"):
                seen_any = True
                print(line, flush=True)
                if status.state is WorkerState.READY:
                    return 0
                if status.state is WorkerState.FAILED:
                    print(f"shoal deploy: {model} failed to load: {status.error}", file=sys.stderr)
                    return 1
            if await _pause_unless_stopped(stopped, 0.25):
                return 130  # Ctrl-C, as when it lands before the loop
    finally:
        await nc.close()
    why = (
        "workers took it up but none became ready"
        if seen_any
        else "no worker picked it up: a fleet worker loads a model only when requests for it "
        f"are queued (send one), or start a worker for it: `shoal worker --model {model}`"
    )
    print(
        f"shoal deploy: no worker reported {model} ready within {args.timeout:g} s; {why}",
        file=sys.stderr,
    )
    return 1


def _undeploy(args: argparse.Namespace) -> int:
    from shoal.state.deployments import DeploymentError, list_deployments, undeploy

    async def run() -> None:
        async with _jetstream(args, "shoal-undeploy") as js:
            try:
                await undeploy(js, args.name)
            except DeploymentError as err:
                names = [spec.name for spec in await list_deployments(js)]
                if args.name in names:  # it exists: the error is something else
                    raise
                deployed = ", ".join(names) if names else "none"
                raise DeploymentError(
                    f"{err}; deployed: {deployed} (`shoal models` lists them)"
                ) from None

    try:
        asyncio.run(run())
    except DeploymentError as err:
        raise SystemExit(f"shoal undeploy: {err}") from None
    print(f"undeployed {args.name}")
    return 0


def _models(args: argparse.Namespace) -> int:
    from shoal.protocol import encode_json
    from shoal.state.fleet import model_views

    async def run():
        async with _jetstream(args, "shoal-models") as js:
            return await model_views(js)

    views = asyncio.run(run())
    if args.json:
        print(encode_json(views).decode())
        return 0
    print(
        f"{'MODEL':<24} {'TASK':<11} {'RUNTIME':<12} {'READY':>5} {'LOADING':>7} "
        f"{'BACKLOG':>7} {'BATCH':>5}"
    )
    for v in views:
        runtime = f"{v.runtime} (sim)" if v.simulated else v.runtime
        batch = str(v.max_batch_items) if v.max_batch_items else "-"
        print(
            f"{v.name:<24} {v.task:<11} {runtime:<12} {v.workers_ready:>5} "
            f"{v.workers_loading:>7} {v.backlog:>7} {batch:>5}"
        )
    for v in views:
        for key, value in v.quality.items():
            print(f"{v.name}: {key} {value:.4f}")
        for error in v.errors:
            print(f"{v.name}: failed to load: {error}")
    return 0


def _runtimes(args: argparse.Namespace) -> int:
    from shoal.protocol import encode_json
    from shoal.runtimes.registry import RUNTIME_RECORDS

    rows = [
        {
            "name": r.name,
            "tasks": [t.value for t in r.tasks],
            "adapters": [t.value for t in r.adapter_tasks],
            "adapter_formats": list(r.adapter_formats),
            "simulated": r.simulated,
            "installed": r.installed(),
            "extra": r.extra,
            "summary": r.summary,
        }
        for r in RUNTIME_RECORDS.values()
    ]
    if args.json:
        print(encode_json(rows).decode())
        return 0
    print(f"{'RUNTIME':<10} {'TASKS':<28} {'LORA':<20} {'INSTALLED':<10} SUMMARY")
    for row in rows:
        installed = "yes" if row["installed"] else f"no: pip install 'shoal[{row['extra']}]'"
        tasks = ",".join(row["tasks"])
        lora = ",".join(row["adapters"]) or "-"
        print(f"{row['name']:<10} {tasks:<28} {lora:<20} {installed:<10} {row['summary']}")
    return 0


async def _connect(args: argparse.Namespace, name: str) -> Client:
    """An admin connection for a command; exits with what to check when NATS is unreachable
    (connect() itself waits for a server forever, right for a service)."""
    from shoal.broker.connection import connect

    url, auth = resolve_nats(args.nats, nats_auth_from_args(args), "admin")
    try:
        return await asyncio.wait_for(connect(url, name=name, auth=auth), CONNECT_TIMEOUT_S)
    except TimeoutError:
        raise SystemExit(
            f"shoal {args.command}: {nats_unreachable(url, CONNECT_TIMEOUT_S)}"
        ) from None


@contextlib.asynccontextmanager
async def _jetstream(args: argparse.Namespace, name: str):
    nc = await _connect(args, name)
    try:
        yield nc.jetstream()
    finally:
        await nc.close()
