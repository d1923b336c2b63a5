"""The `shoal` command. Every flag has a `SHOAL_*` environment variable; the flag wins."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

import msgspec

from shoal.catalog import DEFAULT_MODEL, resolve_model
from shoal.cluster_file import (
    ClusterInfo,
    remove_cluster_info,
    resolve_nats_url,
    state_dir,
    write_cluster_info,
)
from shoal.config import GatewaySettings, WorkerSettings, env_default
from shoal.protocol import ModelSpec, Task, is_valid_model_name
from shoal.runtimes import check_runtime


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
    parser.add_argument(
        "--nats",
        default=None,
        help="NATS URL of an existing cluster (env SHOAL_NATS); default: the local cluster",
    )


def _add_model(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=env_default("MODEL", DEFAULT_MODEL),
        help=f"deployment name (env SHOAL_MODEL, default {DEFAULT_MODEL})",
    )
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
    )
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=env_default("MAX_BATCH_TOKENS", WorkerSettings.max_batch_tokens),
    )


def _add_gateway(parser: argparse.ArgumentParser) -> None:
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
    parser.add_argument(
        "--http-server",
        choices=("uvicorn", "granian"),
        default=env_default("HTTP_SERVER", GatewaySettings.http_server),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shoal", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="embedded NATS + gateway + workers, in the foreground")
    _add_nats(up)
    _add_gateway(up)
    _add_model(up)
    _add_batching(up)
    up.add_argument("--workers", type=int, default=env_default("WORKERS", 1))

    gateway = commands.add_parser("gateway", help="the HTTP gateway alone")
    _add_nats(gateway)
    _add_gateway(gateway)

    worker = commands.add_parser("worker", help="a worker sidecar for one model")
    _add_nats(worker)
    _add_model(worker)
    _add_batching(worker)
    worker.add_argument("--model-json", default=None, help=argparse.SUPPRESS)
    worker.add_argument(
        "--metrics-port",
        type=int,
        default=env_default("METRICS_PORT", WorkerSettings.metrics_port),
        help="port of the worker's /metrics (0: a free port)",
    )

    nats_cmd = commands.add_parser("nats", help="the embedded nats-server alone")
    nats_cmd.add_argument("--port", type=int, default=env_default("NATS_PORT", -1))

    status = commands.add_parser("status", help="the workers of a cluster and what they do")
    _add_nats(status)
    return parser


def _model_spec(args: argparse.Namespace) -> ModelSpec:
    if getattr(args, "model_json", None):
        return msgspec.json.decode(args.model_json, type=ModelSpec)
    if not is_valid_model_name(args.model):
        raise SystemExit(f"invalid model name {args.model!r}")
    try:
        spec = resolve_model(
            args.model,
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
    }[args.command]
    sys.exit(handler(args) or 0)


def _up(args: argparse.Namespace) -> int:
    from shoal.supervisor import Supervisor, UpOptions

    nats_url = args.nats or os.environ.get("SHOAL_NATS") or None
    batching = [
        "--max-batch-items",
        str(args.max_batch_items),
        "--max-batch-tokens",
        str(args.max_batch_tokens),
    ]
    gateway = [
        "--request-timeout",
        str(args.request_timeout),
        "--stream-idle-timeout",
        str(args.stream_idle_timeout),
        "--max-body-bytes",
        str(args.max_body_bytes),
        "--http-server",
        args.http_server,
    ]
    options = UpOptions(
        model=_model_spec(args),
        host=args.host,
        port=args.port or _free_port(args.host),
        workers=args.workers,
        nats_url=nats_url,
        gateway_args=gateway,
        worker_args=batching,
    )
    return Supervisor(options).run()


def _gateway(args: argparse.Namespace) -> int:
    from shoal.gateway.server import serve

    settings = GatewaySettings(
        nats_url=resolve_nats_url(args.nats),
        host=args.host,
        port=args.port,
        max_body_bytes=args.max_body_bytes,
        request_timeout_s=args.request_timeout,
        stream_idle_timeout_s=args.stream_idle_timeout,
        http_server=args.http_server,
    )
    serve(settings)
    return 0


def _worker(args: argparse.Namespace) -> int:
    import uvloop

    from shoal.worker.sidecar import ModelLoadError, WorkerSidecar

    settings = WorkerSettings(
        nats_url=resolve_nats_url(args.nats),
        model=_model_spec(args),
        max_batch_items=args.max_batch_items,
        max_batch_tokens=args.max_batch_tokens,
        metrics_port=args.metrics_port,
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


def _nats(args: argparse.Namespace) -> int:
    from shoal.broker.embedded import EmbeddedNats

    server = EmbeddedNats(store_dir=state_dir() / "nats", port=args.port)
    url = server.start()
    write_cluster_info(ClusterInfo(url, "", os.getpid()))
    print(f"nats {url}\nPress Ctrl-C to stop.", flush=True)
    stop_signals = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
    try:
        signal.sigwait(stop_signals)
    finally:
        server.stop()
        remove_cluster_info(os.getpid())
    return 0


def _status(args: argparse.Namespace) -> int:
    from shoal.broker.connection import connect
    from shoal.observability.fleet import read_worker_statuses

    async def show() -> None:
        nc = await connect(resolve_nats_url(args.nats), name="shoal-status")
        statuses = await read_worker_statuses(nc.jetstream())
        await nc.close()
        print(
            f"{'WORKER':<36} {'MODEL':<22} {'RUNTIME':<12} {'STATE':<9} "
            f"{'ITEMS':>8} {'MAXBATCH':>8} {'BUSY':>6}"
        )
        for s in statuses:
            runtime = f"{s.runtime} (sim)" if s.simulated else s.runtime
            print(
                f"{s.worker_id:<36} {s.model:<22} {runtime:<12} {s.state.value:<9} "
                f"{s.items_done:>8} {s.max_batch_items:>8} {s.busy_fraction:>6.0%}"
            )

    asyncio.run(show())
    return 0


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
