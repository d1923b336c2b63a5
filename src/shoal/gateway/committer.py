"""Group commit: the requests for one model that arrive while the gateway's previous publish
for that model is in flight go to the queue together, in one JetStream message.

No timer: an idle gateway publishes a request the moment it arrives (one event-loop turn
later), so nothing waits that would not have waited anyway; under load each JetStream
publish, its acknowledgement and each worker's fetch and ack are shared by many requests.
A request learns that it was stored (or why not) when its envelope's publish returns; one
that only waits for its reply learns only why not, on its reply's future (`submit_nowait`),
so its task wakes once a request instead of twice.
Generation requests travel alone: a generative worker pulls exactly as many as it has free
decode slots.

An envelope holds at most half the batch budget of the smallest worker serving its model
(`envelope_cap`): a worker takes a whole envelope, so an envelope larger than one batch
leaves its tail waiting a whole batch behind while other workers idle, and one of half a
batch lets a worker fill a batch from two gateways' or two turns' envelopes. Measured at 32
simulated workers, budget 32, 90% load: envelopes of 16 put p99 at 1.17x the best push
router's, envelopes of 64 at 1.61x (docs/benchmarks.md). A quarter of the budget (8 there)
cost the gateway +20% and nats-server +21% CPU a request at saturation with 16 workers, for a
p99 lower in 2 of 4 pairs (docs/benchmarks.md, "Envelopes of a quarter of the budget
and idle one-message pulls"). A one-worker model with a large budget keeps envelopes of 64,
where sharing the publish matters most.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

from shoal.broker.bodies import INLINE_BODY_BYTES
from shoal.protocol import (
    UniqueIds,
    WorkEnvelope,
    WorkRequest,
    encode_msgpack,
    now_ms,
    work_subject,
)

MAX_REQUESTS_PER_ENVELOPE = 64
# Well under NATS's default 1 MB max_payload, with room for the envelope's framing; a larger
# body does not travel in an envelope at all (broker/bodies.py).
MAX_ENVELOPE_BYTES = INLINE_BODY_BYTES

# (subject, payload, envelope id) -> stored; raises to refuse every request in the envelope
Publish = Callable[[str, bytes, str], Awaitable[None]]
# model -> the smallest batch budget among the workers serving it (None: none reported yet)
SmallestBudget = Callable[[str], int | None]


class GroupCommitter:
    """One per gateway process; publishes envelopes on `reply_to`'s behalf."""

    def __init__(self, reply_to: str, publish: Publish, smallest_budget: SmallestBudget) -> None:
        self._reply_to = reply_to
        self._publish = publish
        self._smallest_budget = smallest_budget
        self._pending: dict[str, list[_Entry]] = {}  # by model
        self._flushing: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._envelope_ids = UniqueIds()  # JetStream deduplicates a retried publish on them

    async def submit(self, model: str, request: WorkRequest, *, alone: bool = False) -> None:
        """Queue one request for `model`; returns once JetStream has stored it (raises if it
        was not)."""
        if alone:
            await self._send(work_subject(model), [request])
            return
        stored: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._add(model, _Entry(request, stored, True))
        await stored

    def submit_nowait(self, model: str, request: WorkRequest, refused: asyncio.Future[Any]) -> None:
        """Queue one request for `model` and return at once: if JetStream does not store it,
        the error is set on `refused` (the future its client waits on for the reply), which is
        otherwise left alone."""
        self._add(model, _Entry(request, refused, False))

    def _add(self, model: str, entry: _Entry) -> None:
        self._pending.setdefault(model, []).append(entry)
        if model not in self._flushing:
            self._flushing.add(model)
            task = asyncio.create_task(self._flush(model))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _flush(self, model: str) -> None:
        subject = work_subject(model)
        try:
            while pending := self._pending.get(model):
                taken = _take(pending, envelope_cap(self._smallest_budget(model)))
                del pending[: len(taken)]
                try:
                    await self._send(subject, [entry.request for entry in taken])
                except Exception as err:
                    for entry in taken:
                        if not entry.future.done():
                            entry.future.set_exception(err)
                else:
                    for entry in taken:
                        if entry.told_stored and not entry.future.done():
                            entry.future.set_result(None)
        finally:
            self._flushing.discard(model)
            if not self._pending.get(model):
                self._pending.pop(model, None)

    async def _send(self, subject: str, requests: list[WorkRequest]) -> None:
        envelope = WorkEnvelope(self._reply_to, now_ms(), requests)
        await self._publish(subject, encode_msgpack(envelope), self._envelope_ids.new())


def envelope_cap(smallest_budget: int | None) -> int:
    """The most requests in one envelope for a model whose smallest worker batch budget (in
    items) is `smallest_budget` (None or 0: no worker has reported one yet)."""
    if not smallest_budget:
        return MAX_REQUESTS_PER_ENVELOPE
    return max(1, min(MAX_REQUESTS_PER_ENVELOPE, smallest_budget // 2))


class _Entry(NamedTuple):
    """A request waiting for its envelope, and the future that hears how its publish went."""

    request: WorkRequest
    future: asyncio.Future[Any]
    told_stored: bool  # False: the future hears only a refusal (submit_nowait)


def _take(pending: list[_Entry], max_requests: int) -> list[_Entry]:
    """The next envelope's requests: the first always, then while they fit the limits."""
    taken = [pending[0]]
    size = len(pending[0].request.body)
    for entry in pending[1:max_requests]:
        size += len(entry.request.body)
        if size > MAX_ENVELOPE_BYTES:
            break
        taken.append(entry)
    return taken
