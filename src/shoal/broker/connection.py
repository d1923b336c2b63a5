"""Connecting to NATS the same way everywhere: reconnect forever, quietly, with credentials."""

from __future__ import annotations

import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import nats
from nats.aio.client import Client

from shoal.config import NatsAuth

log = logging.getLogger(__name__)

# Called from nats.py's reconnect task: it must return quickly.
ConnectionCallback = Callable[[], Awaitable[None]]


async def connect(
    url: str,
    name: str,
    *,
    auth: NatsAuth | None = None,
    on_disconnect: ConnectionCallback | None = None,
    on_reconnect: ConnectionCallback | None = None,
) -> Client:
    """A connection that keeps reconnecting; the first attempt waits until the server is up.

    `auth` says who this process is (a user and password, or a `.creds` file), where its
    request inboxes are and which TLS files to use; None connects without any.
    `on_disconnect` runs the moment the connection drops (and on a deliberate close),
    `on_reconnect` once a reconnect has replayed the subscriptions and flushed what was
    buffered meanwhile.
    """

    async def on_error(err: Exception) -> None:
        log.debug("nats: %s", err)

    async def disconnected() -> None:
        # Also called on a deliberate close, so not a warning.
        log.info("nats: disconnected from %s", url)
        if on_disconnect is not None:
            await on_disconnect()

    async def reconnected() -> None:
        log.warning("nats: reconnected to %s", url)
        if on_reconnect is not None:
            await on_reconnect()

    # Several servers (a cluster) are given comma-separated: the first that answers is used,
    # and a reconnect tries the others (and those the servers advertise).
    servers = [server.strip() for server in url.split(",") if server.strip()]
    return await nats.connect(
        servers,
        name=name,
        **auth_options(url, auth or NatsAuth()),
        connect_timeout=2,
        reconnect_time_wait=0.5,
        max_reconnect_attempts=-1,
        allow_reconnect=True,
        error_cb=on_error,
        disconnected_cb=disconnected,
        reconnected_cb=reconnected,
    )


def auth_options(url: str, auth: NatsAuth) -> dict[str, Any]:
    """nats.py's connect options for `auth`: credentials, inbox prefix and TLS."""
    options: dict[str, Any] = {"inbox_prefix": auth.inbox_prefix}
    if auth.creds_file:
        options["user_credentials"] = auth.creds_file
    elif auth.user:
        options["user"] = auth.user
        options["password"] = auth.password
    if auth.tls_ca or auth.tls_cert or url.startswith("tls://"):
        # Verifies the server against the CA file (else the system's CAs), and presents a
        # client certificate when one is given (servers that require mutual TLS).
        context = ssl.create_default_context(cafile=auth.tls_ca or None)
        if auth.tls_cert:
            context.load_cert_chain(auth.tls_cert, auth.tls_key or None)
        options["tls"] = context
    return options
