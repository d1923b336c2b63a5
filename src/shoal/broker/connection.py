"""Connecting to NATS the same way everywhere: reconnect forever, quietly."""

from __future__ import annotations

import logging

import nats
from nats.aio.client import Client

log = logging.getLogger(__name__)


async def connect(url: str, name: str) -> Client:
    """A connection that keeps reconnecting; the first attempt waits until the server is up."""

    async def on_error(err: Exception) -> None:
        log.debug("nats: %s", err)

    async def on_disconnect() -> None:
        # Also called on a deliberate close, so not a warning.
        log.info("nats: disconnected from %s", url)

    async def on_reconnect() -> None:
        log.warning("nats: reconnected to %s", url)

    return await nats.connect(
        url,
        name=name,
        connect_timeout=2,
        reconnect_time_wait=0.5,
        max_reconnect_attempts=-1,
        allow_reconnect=True,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
    )
