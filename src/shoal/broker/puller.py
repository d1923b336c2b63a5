"""Pulling from a durable JetStream consumer with explicit pull requests.

nats.py's `fetch(n)` waits out its whole timeout for the n-th message once the queue is empty,
which adds up to a second of latency at low load. Here messages are handed on as they arrive,
one pull request is outstanding at a time, and the caller decides how many to ask for, and
may end the open request early (`end_request`).
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
        self._inbox = ""  # where the next pull request's messages come (`start`)
        self._sub: Subscription | None = None
        self._remaining = 0
        self._request_done = asyncio.Event()
        self._request_done.set()  # none outstanding yet
        self._ending = False

    async def start(self) -> None:
        await self._open_inbox()

    async def _open_inbox(self) -> Subscription | None:
        """Pull requests go to a new inbox from now on; returns the last one's subscription.

        Each inbox has its own callback: a delivered message's subject is the stream's, not
        the inbox, so the callback is what says which request a message came for."""
        inbox = self._nc.new_inbox()

        async def on_inbox(msg: Msg) -> None:
            self._on_inbox(msg, inbox)

        last = self._sub
        self._inbox = inbox
        self._sub = await self._nc.subscribe(
            inbox, cb=on_inbox, pending_msgs_limit=-1, pending_bytes_limit=-1
        )
        return last

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

    def request_open(self) -> bool:
        """Whether a pull request is outstanding (messages may still come for it)."""
        return not self._request_done.is_set() and not self._ending

    async def end_request(self) -> None:
        """End the outstanding pull request now, before its count or expiry ends it.

        JetStream has no cancel for a pull request, but deals a message only to a request
        whose reply subject someone subscribes to (nats-server `nextWaiting`): so the next
        requests go to a new inbox, and the old one is drained (its unsubscribe, then a round
        trip, the messages the server sent before it handed on as usual: none is left
        unanswered until `ack_wait`). Behind a NATS supercluster's gateways the server may
        still deal to a request made in the last seconds; such a message is redelivered
        after `ack_wait`, late but not lost.
        """
        if self._sub is None or not self.request_open():
            return
        self._ending = True
        try:
            ended = await self._open_inbox()
            self._request_done.set()  # the caller's `pull` returns and may pull again
        finally:
            self._ending = False
        if ended is None:
            return
        try:
            await ended.drain()
        except Exception:  # closed or reconnecting: the server has forgotten it anyway
            with contextlib.suppress(Exception):
                await ended.unsubscribe()

    def _on_inbox(self, msg: Msg, inbox: str) -> None:
        status = msg.headers.get(_STATUS) if msg.headers else None
        if inbox != self._inbox:  # an ended request's: its messages are still work
            if status is None:
                self._on_message(msg)
            return
        if status is None:
            self._on_message(msg)
            self._remaining -= 1
            if self._remaining <= 0:
                self._request_done.set()
        elif status != _HEARTBEAT:
            # 404 no messages, 408 request expired, 409 limits or leadership: request over.
            self._request_done.set()
