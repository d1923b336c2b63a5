"""Cancels: telling a model's workers that requests' clients have gone.

Every worker of a model hears every cancel (the request may be queued, pulled or running on
any of them), so a cancel costs one delivery per worker. Clients leave in bursts (a load
balancer's timeout, a crashed caller with many connections, a benchmark's end): 1,536
clients leaving at once with 16 workers was ~22,000 deliveries, each a callback in a worker
(bench/cancel_flood.py; 146-188 grouped as below). So
the cancels raised in one turn of the event loop go out together: one message per model with
the request ids one per line (`protocol.encode_cancels`), at most `IDS_PER_MESSAGE` each.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from shoal.protocol import cancel_subject, encode_cancels

# ~33 bytes an id: a message of ~33 KB, far below NATS's 1 MB default payload limit.
IDS_PER_MESSAGE = 1000

Publish = Callable[[str, bytes], Awaitable[None]]


class CancelSender:
    """Collects a turn's cancels by model and publishes them together (fire and forget: a
    cancel that is lost leaves work whose answer nobody reads, never a wrong answer)."""

    def __init__(self, publish: Publish) -> None:
        self._publish = publish
        self._pending: dict[str, list[str]] = {}
        self._sending: set[asyncio.Task[None]] = set()

    def cancel(self, model: str, request_id: str) -> None:
        """Cancel `request_id` of `model`, with the other cancels of this turn."""
        ids = self._pending.setdefault(model, [])
        ids.append(request_id)
        if len(ids) == 1:  # the turn's first for this model: send after the turn
            asyncio.get_running_loop().call_soon(self._send, model)

    def _send(self, model: str) -> None:
        ids = self._pending.pop(model, [])
        subject = cancel_subject(model)
        for start in range(0, len(ids), IDS_PER_MESSAGE):
            body = encode_cancels(ids[start : start + IDS_PER_MESSAGE])
            task = asyncio.ensure_future(self._send_one(subject, body))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send_one(self, subject: str, body: bytes) -> None:
        with contextlib.suppress(Exception):
            await self._publish(subject, body)
