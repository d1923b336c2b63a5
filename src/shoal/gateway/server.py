"""Serving the gateway app over HTTP (uvicorn with uvloop and httptools, or granian).

Both read a request's headers within `HttpTimeouts.header_s` or close the connection. Under
uvicorn the gateway's own HTTP protocol (http_protocol.py) also times the body out; under
granian, which has no body timeout, the app times the body out as it reads it (gateway/app.py).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import shutil
import tempfile
from dataclasses import replace

from shoal.config import GatewaySettings
from shoal.gateway.app import Gateway
from shoal.observability.metrics import MULTIPROCESS_DIR_ENV
from shoal.process import tune_garbage_collector

_SETTINGS_ENV = "SHOAL_GATEWAY_SETTINGS_JSON"


def serve(settings: GatewaySettings) -> None:
    """Serve until SIGINT or SIGTERM; both servers shut down gracefully on those."""
    tune_garbage_collector()
    try:
        if settings.http_server == "granian":
            _serve_granian(settings)
        else:
            _serve_uvicorn(settings)
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled; it is a normal stop
        pass


def _serve_uvicorn(settings: GatewaySettings) -> None:
    import uvicorn

    from shoal.gateway.http_protocol import protocol_factory

    options = {
        "host": settings.host,
        "port": settings.port,
        "loop": "uvloop",
        # httptools, with header and body read timeouts and a header size limit
        # (http_protocol.py).
        "http": protocol_factory(settings.http_timeouts),
        "ws": "none",  # no WebSocket routes: an upgrade request is an ordinary request
        "lifespan": "on",
        "access_log": False,
        # No X-Forwarded-* rewriting: the gateway reads no client address, and the middleware
        # cost ~9 us a request (py-spy, bench.hotpath).
        "proxy_headers": False,
        "log_level": "warning",
        "timeout_graceful_shutdown": 5,
        # Idle connections: new ones (http_protocol.py) and between requests (uvicorn).
        "timeout_keep_alive": settings.http_timeouts.keep_alive_s,
    }
    if settings.processes > 1:
        # uvicorn binds the port once and starts the processes on it; each builds its own
        # Gateway (own id, own reply subject), and a process that dies is started again.
        _settings_to_environment(settings)
        _share_metrics()
        uvicorn.run(
            "shoal.gateway.server:app_from_environment",
            factory=True,
            workers=settings.processes,
            **options,
        )
        return
    uvicorn.Server(uvicorn.Config(Gateway(settings), **options)).run()


def _serve_granian(settings: GatewaySettings) -> None:
    from granian.constants import Interfaces, Loops
    from granian.http import HTTP1Settings
    from granian.server import Server

    # granian imports the app in its own worker: hand it the settings through the environment.
    _settings_to_environment(settings)
    if settings.processes > 1:
        _share_metrics()
        # granian forks its processes by default, and a fork keeps the prometheus_client this
        # process imported before the metrics were shared: its values stay per process.
        multiprocessing.set_start_method("spawn", force=True)
    Server(
        "shoal.gateway.server:app_from_environment",
        address=settings.host,
        port=settings.port,
        interface=Interfaces.ASGI,
        http1_settings=HTTP1Settings(
            header_read_timeout=round(settings.http_timeouts.header_s * 1000)
        ),
        workers=settings.processes,
        loop=Loops.uvloop,
        factory=True,
        log_access=False,
        log_enabled=False,
    ).serve()


def _share_metrics() -> None:
    """Counters and histograms of every gateway process in files of one fresh directory
    (prometheus_client's multiprocess mode), so any process's /metrics shows their sum."""
    directory = tempfile.mkdtemp(prefix="shoal-gateway-metrics-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    os.environ[MULTIPROCESS_DIR_ENV] = directory


def _settings_to_environment(settings: GatewaySettings) -> None:
    """The settings for the server's own processes, less the NATS password: each process
    reads that again from where this one did (its file, else `SHOAL_NATS_PASSWORD`)."""
    import msgspec

    handed = replace(settings, nats_auth=settings.nats_auth.without_password())
    os.environ[_SETTINGS_ENV] = msgspec.json.encode(handed).decode()


def app_from_environment() -> Gateway:
    """The app in one of several serving processes (uvicorn's or granian's), from the
    settings its parent put in the environment."""
    import msgspec

    tune_garbage_collector()  # a spawned process starts with CPython's defaults
    settings = msgspec.json.decode(os.environ[_SETTINGS_ENV].encode(), type=GatewaySettings)
    return Gateway(replace(settings, nats_auth=settings.nats_auth.with_password_read()))
