"""Connecting to NATS the same way everywhere: reconnect forever, quietly."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import nats
from nats.aio.client import Client

log = logging.getLogger(__name__)

# Called from nats.py's reconnect task: it must return quickly.
ConnectionCallback = Callable[[], Awaitable[None]]


async def connect(
    url: str,
    name: str,
    *,
    on_disconnect: ConnectionCallback | None = None,
    on_reconnect: ConnectionCallback | None = None,
) -> Client:
    """A connection that keeps reconnecting; the first attempt waits until the server is up.

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

    return await nats.connect(
        url,
        name=name,
        connect_timeout=2,
        reconnect_time_wait=0.5,
        max_reconnect_attempts=-1,
        allow_reconnect=True,
        error_cb=on_error,
        disconnected_cb=disconnected,
        reconnected_cb=reconnected,
    )
