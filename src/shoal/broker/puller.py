"""Pulling from a durable JetStream consumer with explicit pull requests.

nats.py's `fetch(n)` waits out its whole timeout for the n-th message once the queue is empty,
which adds up to a second of latency at low load. Here messages are handed on as they arrive,
one pull request is outstanding at a time, and the caller decides how many to ask for.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

_STATUS = "Status"
_HEARTBEAT = "100"


class Puller:
    """Sends pull requests for one consumer; delivered messages go to `on_message`."""

    def __init__(
        self, nc: Client, stream: str, consumer: str, on_message: Callable[[Msg], None]
    ) -> None:
        self._nc = nc
        self._next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self._on_message = on_message
        self._inbox = nc.new_inbox()
        self._sub: Subscription | None = None
        self._remaining = 0
        self._request_done = asyncio.Event()

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(
            self._inbox, cb=self._on_inbox, pending_msgs_limit=-1, pending_bytes_limit=-1
        )

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    async def pull(self, batch: int, expires_s: float) -> None:
        """Ask for up to `batch` messages and return when the request has ended.

        It ends when `batch` messages have arrived or the server expires it after
        `expires_s`; messages are handed to `on_message` as they arrive, not at the end.
        """
        self._remaining = batch
        self._request_done.clear()
        request = {"batch": batch, "expires": int(expires_s * 1e9)}
        await self._nc.publish(self._next_subject, json.dumps(request).encode(), self._inbox)
        # The grace covers a status lost to a reconnect: then a new request is sent.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._request_done.wait(), expires_s + 1.0)

    async def _on_inbox(self, msg: Msg) -> None:
        status = msg.headers.get(_STATUS) if msg.headers else None
        if status is None:
            self._on_message(msg)
            self._remaining -= 1
            if self._remaining <= 0:
                self._request_done.set()
        elif status != _HEARTBEAT:
            # 404 no messages, 408 request expired, 409 limits or leadership: request over.
            self._request_done.set()
