"""Serving the gateway app over HTTP (uvicorn with uvloop and httptools, or granian)."""

from __future__ import annotations

import os

from shoal.config import GatewaySettings
from shoal.gateway.app import Gateway

HTTP_SERVERS = ("uvicorn", "granian")
_SETTINGS_ENV = "SHOAL_GATEWAY_SETTINGS_JSON"


def serve(settings: GatewaySettings) -> None:
    """Serve until SIGINT or SIGTERM; both servers shut down gracefully on those."""
    try:
        if settings.http_server == "granian":
            _serve_granian(settings)
        else:
            _serve_uvicorn(settings)
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled; it is a normal stop
        pass


def _serve_uvicorn(settings: GatewaySettings) -> None:
    import uvicorn

    config = uvicorn.Config(
        Gateway(settings),
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        # No X-Forwarded-* rewriting: the gateway reads no client address, and the middleware
        # cost ~9 us a request (py-spy, bench.hotpath).
        proxy_headers=False,
        log_level="warning",
        timeout_graceful_shutdown=5,
    )
    uvicorn.Server(config).run()


def _serve_granian(settings: GatewaySettings) -> None:
    import msgspec
    from granian.constants import Interfaces, Loops
    from granian.server import Server

    # granian imports the app in its own worker: hand it the settings through the environment.
    os.environ[_SETTINGS_ENV] = msgspec.json.encode(settings).decode()
    Server(
        "shoal.gateway.server:app_from_environment",
        address=settings.host,
        port=settings.port,
        interface=Interfaces.ASGI,
        loop=Loops.uvloop,
        factory=True,
        log_access=False,
        log_enabled=False,
    ).serve()


def app_from_environment() -> Gateway:
    import msgspec

    return Gateway(msgspec.json.decode(os.environ[_SETTINGS_ENV].encode(), type=GatewaySettings))
