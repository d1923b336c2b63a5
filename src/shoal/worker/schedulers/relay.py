"""Feeding an inference server by pulling: the scheduler of the `engine` runtime.

The engine (vLLM, SGLang, llama.cpp's server, ...) batches for itself; the sidecar decides
how much work it holds. The relay keeps at most `concurrency` requests in flight to the engine
and pulls no more than it can send now, so queued work stays in the queue for other workers.
Each request goes to the engine as the client sent it, with `model` set to the name the
engine serves; a streamed answer is relayed event by event, in order, and the deployment's
name is written back into each answer. A cancel closes the HTTP request to the engine.

When the engine dies, nothing it held is acked: a stream that has sent chunks ends with an
error event (its tokens cannot be taken back), and everything else goes back to JetStream
(nak) for any worker to run again, while the engine restarts with backoff. This worker pulls
again once it is ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from shoal.api.embeddings import EmbeddingsRequest
from shoal.api.errors import ApiError, invalid_body
from shoal.api.generation import ChatRequest, CompletionsRequest
from shoal.protocol import Endpoint, Task, encode_json, now_ms
from shoal.runtimes.engine import (
    EngineRuntime,
    EngineStartError,
    EngineUnavailable,
    decode_object,
    with_model,
)
from shoal.worker.items import Reply, WorkItem, WorkMessage
from shoal.worker.schedulers.base import SchedulerBase, SchedulerContext

log = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = 8
CANCELLED_MEMORY_S = 300.0
WATCH_INTERVAL_S = 0.2
EXIT_GRACE_S = 1.0  # after a dropped connection, how long to look for the engine's death


class StreamCutShort(Exception):
    """The engine ended a stream (with `[DONE]`) before any choice had a finish reason."""


@dataclass(slots=True, eq=False)
class _Relay:
    """One request in flight to the engine."""

    item: WorkItem
    task: asyncio.Task[None] | None = None
    chunks_sent: int = 0
    cancelled: bool = False  # the client went away
    lost: bool = False  # the engine died under it: the death handler answers or returns it


class RelayScheduler(SchedulerBase):
    """Relays pulled requests to an engine child (implements `Scheduler`)."""

    def __init__(
        self, ctx: SchedulerContext, engine: EngineRuntime, task: Task, model: str, limit: int
    ) -> None:
        super().__init__(ctx, task)
        self._engine = engine
        self._model = model
        self._limit = max(1, limit)
        self._inflight: dict[str, _Relay] = {}  # by request id
        self._cancelled: dict[str, float] = {}
        self._up = True
        self._death = asyncio.Event()  # a relay saw the engine die
        self._busy_peak = 0

    @property
    def slots(self) -> int:
        """Requests in flight to the engine at most."""
        return self._limit

    # -- Scheduler interface ------------------------------------------------------------

    def room(self) -> int:
        if not self._up:
            return 0
        return self._limit - len(self._inflight) - len(self._pending)

    def held(self) -> list[WorkItem]:
        return [*(r.item for r in self._inflight.values()), *self._pending]

    def cancel(self, request_id: str) -> None:
        relay = self._inflight.get(request_id)
        if relay is not None:
            relay.cancelled = True
            if relay.task is not None:
                relay.task.cancel()  # closes the HTTP request: the engine stops generating
            return
        now = time.monotonic()
        self._cancelled[request_id] = now
        if len(self._cancelled) > 10_000:
            self._cancelled = {
                rid: t for rid, t in self._cancelled.items() if now - t < CANCELLED_MEMORY_S
            }

    async def run(self) -> None:
        watcher = asyncio.create_task(self._watch())
        try:
            while True:
                await self._start_pending()
                if not self._accepting and not self._pending and not self._inflight:
                    return
                if not self._up and not self._accepting:
                    # Draining while the engine is down: give the rest back to the queue.
                    await self._give_back(list(self._pending))
                    self._pending.clear()
                    if not self._inflight:
                        return
                self._arrived.clear()
                await self._arrived.wait()
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            for relay in list(self._inflight.values()):
                if relay.task is not None:
                    relay.task.cancel()
            await self._engine.aclose()

    # -- sending ----------------------------------------------------------------------------

    async def _start_pending(self) -> None:
        while self._up and self._pending and len(self._inflight) < self._limit:
            item = self._pending.popleft()
            if self._cancelled.pop(item.request_id, None) is not None:
                await self._drop_cancelled(item)
                continue
            if await self._reject_if_unservable(item):
                continue
            endpoint = item.endpoint.value if item.endpoint else ""
            if not self._engine.serves(endpoint):
                await self._answer(
                    item, Reply.from_error(ApiError(400, f"This engine does not serve {endpoint}"))
                )
                continue
            try:
                check_request(item.endpoint, item.body)
                body = with_model(item.body, self._engine.served_model)
            except ApiError as err:
                await self._answer(item, Reply.from_error(err))
                continue
            except ValueError as err:
                await self._answer(item, Reply.from_error(ApiError(400, str(err))))
                continue
            self._observe_queue_wait(item)
            relay = _Relay(item)
            self._inflight[item.request_id] = relay
            self._busy_started()
            relay.task = asyncio.create_task(self._relay(relay, endpoint, body))

    async def _relay(self, relay: _Relay, endpoint: str, body: bytes) -> None:
        item = relay.item
        remaining_s = (item.deadline_ms - now_ms()) / 1000 if item.deadline_ms else None
        try:
            async with asyncio.timeout(remaining_s):
                if item.stream:
                    await self._relay_stream(relay, endpoint, body)
                else:
                    await self._relay_whole(relay, endpoint, body)
        except asyncio.CancelledError:
            if relay.cancelled:
                await self._drop_cancelled(item)
            # else: lost with the engine (the death handler deals with it), or shutting down
        except TimeoutError:
            error = ApiError(504, "The request's deadline passed during generation", code="timeout")
            await self._end_with_error(relay, error)
        except StreamCutShort as err:
            await self._end_with_error(relay, ApiError(502, str(err), code="stream_interrupted"))
        except EngineUnavailable as err:
            await self._engine_dropped(relay, err)
        except Exception:  # a bug here must not leave the request unanswered
            log.exception("relaying %s failed", item.request_id)
            await self._end_with_error(relay, ApiError(502, "The engine's answer was unreadable"))
        finally:
            if not relay.lost:
                self._inflight.pop(item.request_id, None)
                self._busy_maybe_stopped()
                self._ctx.room_changed.set()
                self._arrived.set()

    async def _relay_whole(self, relay: _Relay, endpoint: str, body: bytes) -> None:
        reply = await self._engine.post(endpoint, body)
        if reply.status != 200:
            await self._answer(relay.item, self._error_reply(reply.status, reply.body))
            return
        document = decode_object(reply.body)
        if document is None:
            raise ValueError("not a JSON object")
        self._count_usage(document)
        document["model"] = self._model
        await self._answer(relay.item, Reply(200, encode_json(document)))

    async def _relay_stream(self, relay: _Relay, endpoint: str, body: bytes) -> None:
        item, outbox = relay.item, self._ctx.outbox
        async with self._engine.stream(endpoint, body) as stream:
            if stream.status != 200:
                await self._answer(item, self._error_reply(stream.status, await stream.read()))
                return
            # The gateway ends the SSE stream after the chunk marked final, so the chunk that
            # may be the last (a finish reason, or usage) is held until the next one arrives.
            held: bytes | None = None
            last: dict | None = None
            finished = False
            async for payload in stream.events():
                document = decode_object(payload)
                if document is None:
                    continue  # not a chunk (some servers send keep-alive data)
                self._count_chunk(relay, document)
                document["model"] = self._model
                chunk, last = encode_json(document), document
                finished = finished or _has_finish(document)
                if held is not None:
                    await self._send(relay, held)
                    held = None
                if _may_be_last(document):
                    held = chunk
                else:
                    await self._send(relay, chunk)
        if last is None:
            raise EngineUnavailable("the engine's stream held no chunk")
        if not finished:
            # [DONE] before any choice had a finish reason: the engine cut the stream short
            # (llama_cpp.server does, with --interrupt_requests on, when another request
            # waits). Passing it on as whole would hand the client a truncated answer.
            raise StreamCutShort("The engine ended the stream before its finish reason")
        if held is None:  # it ended on a content chunk: close with an empty one
            held = encode_json({**last, "choices": []})
        await outbox.last_chunk(item, relay.chunks_sent, Reply(200, held))
        await self._ack(item)

    async def _send(self, relay: _Relay, chunk: bytes) -> None:
        await self._ctx.outbox.chunk(relay.item, relay.chunks_sent, chunk)
        relay.chunks_sent += 1

    def _count_chunk(self, relay: _Relay, document: dict) -> None:
        choices = document.get("choices") or []
        if any(_has_text(choice) for choice in choices if isinstance(choice, dict)):
            self._count_tokens(1, first=relay.chunks_sent == 0, item=relay.item)

    def _count_usage(self, document: dict) -> None:
        usage = document.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self._count_tokens(usage["completion_tokens"], first=False, item=None)

    def _count_tokens(self, count: int, *, first: bool, item: WorkItem | None) -> None:
        self._ctx.counters.tokens_generated += count
        self._ctx.metrics.tokens.inc(count)
        if first and item is not None:
            self._ctx.metrics.first_token.observe(max(0, now_ms() - item.sent_ms) / 1000)

    def _error_reply(self, status: int, body: bytes) -> Reply:
        """The engine's error in OpenAI's shape: its own if it has one, else wrapped.

        A 5xx of the engine becomes a 502 (the engine failed, not Shoal), with its message.
        """
        document = decode_object(body)
        error = document.get("error") if document else None
        message = ""
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            message = error["message"]
            if status < 500:
                return Reply(status, body)
        elif document and "detail" in document:  # FastAPI's validation errors
            message = str(document["detail"])
        else:
            message = body.decode(errors="replace")[:1000]
        if status >= 500:
            return Reply.from_error(ApiError(502, f"The engine failed: {message}"))
        return Reply.from_error(ApiError(status, message or f"The engine answered {status}"))

    async def _end_with_error(self, relay: _Relay, error: ApiError) -> None:
        if relay.chunks_sent:
            await self._ctx.outbox.last_chunk(
                relay.item, relay.chunks_sent, Reply.from_error(error)
            )
            await self._ack(relay.item)
        else:
            await self._answer(relay.item, Reply.from_error(error))

    # -- the engine's life ------------------------------------------------------------------

    async def _engine_dropped(self, relay: _Relay, err: EngineUnavailable) -> None:
        """A request lost its connection: the engine died, or it dropped just this one."""
        deadline = time.monotonic() + EXIT_GRACE_S
        while self._engine.exited() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._engine.exited() is None and self._up:
            await self._end_with_error(relay, ApiError(502, f"The engine failed: {err}"))
            return
        relay.lost = True  # answered (or given back) by the death handler
        self._death.set()

    async def _watch(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._death.wait(), WATCH_INTERVAL_S)
            if self._engine.exited() is None and not self._death.is_set():
                continue
            self._death.clear()
            await self._engine_died()

    async def _engine_died(self) -> None:
        self._up = False
        log.warning(
            "%s: the engine exited (status %s); restarting. Its log ends:\n%s",
            self._model,
            self._engine.exited(),
            self._engine.log_tail()[-500:],
        )
        relays = list(self._inflight.values())
        for relay in relays:
            if not relay.lost and relay.task is not None and not relay.task.done():
                relay.lost = True
                relay.task.cancel()
        await asyncio.gather(*(r.task for r in relays if r.task), return_exceptions=True)
        self._inflight.clear()
        self._busy_maybe_stopped()
        back: list[WorkItem] = []
        for relay in relays:
            if relay.cancelled:
                await self._drop_cancelled(relay.item)
            elif relay.chunks_sent:
                error = ApiError(
                    502,
                    "The engine serving this stream died; its partial output cannot be continued",
                    code="stream_interrupted",
                )
                await self._end_with_error(relay, error)
            else:
                back.append(relay.item)
        back += list(self._pending)
        self._pending.clear()
        await self._give_back(back)
        while True:
            try:
                await self._engine.restart()
                break
            except EngineStartError as err:
                log.warning("%s: the engine did not restart: %s", self._model, err)
        log.warning(
            "%s: the engine is ready again (restart %d)", self._model, self._engine.restarts
        )
        self._up = True
        self._ctx.room_changed.set()
        self._arrived.set()

    async def _give_back(self, items: list[WorkItem]) -> None:
        """Return unanswered work to JetStream (nak) for any worker to run again.

        A message is one envelope of requests: it goes back only when none of its requests
        was answered here; otherwise its items stay and run after the restart (an answered
        request must not be run twice for nothing, and a message is acked only once).
        """
        by_message: dict[int, tuple[WorkMessage | None, list[WorkItem]]] = {}
        for item in items:
            key = id(item.message)
            by_message.setdefault(key, (item.message, []))[1].append(item)
        keep: list[WorkItem] = []
        for message, its_items in by_message.values():
            if message is not None and message.unanswered == len(its_items):
                with contextlib.suppress(Exception):  # gone: redelivered after ack_wait anyway
                    await message.msg.nak()
            else:
                keep += its_items
        self._pending.extendleft(reversed(keep))

    # -- accounting ---------------------------------------------------------------------------

    def _busy_started(self) -> None:
        if len(self._inflight) == 1:
            self._ctx.busy.start()
            self._busy_peak = 0
        self._busy_peak = max(self._busy_peak, len(self._inflight))
        self._ctx.counters.running_sequences = len(self._inflight)

    def _busy_maybe_stopped(self) -> None:
        self._ctx.counters.running_sequences = len(self._inflight)
        if not self._inflight and self._busy_peak:
            self._account_batch(self._ctx.busy.stop(), self._busy_peak)
            self._busy_peak = 0


def _has_text(choice: dict) -> bool:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return bool(delta.get("content"))
    return bool(choice.get("text"))


def _has_finish(chunk: dict) -> bool:
    choices = chunk.get("choices") or []
    return any(isinstance(c, dict) and c.get("finish_reason") for c in choices)


def _may_be_last(chunk: dict) -> bool:
    """A chunk with a finish reason, or without choices (usage), may end the stream."""
    choices = chunk.get("choices")
    if not choices:
        return True
    return any(isinstance(c, dict) and c.get("finish_reason") for c in choices)


_GENERATION_TYPES: dict[Endpoint, type[msgspec.Struct]] = {
    Endpoint.COMPLETIONS: CompletionsRequest,
    Endpoint.CHAT_COMPLETIONS: ChatRequest,
    Endpoint.EMBEDDINGS: EmbeddingsRequest,
}


def check_request(endpoint: Endpoint | None, body: bytes) -> None:
    """ApiError(400) for a body that is not a valid OpenAI request, before the engine sees it.

    Engines answer malformed bodies unevenly (llama_cpp.server with a 500, which the client
    would get as a 502), so the types and ranges OpenAI's API defines are checked here, with
    Shoal's own request types. What an engine may support beyond Shoal's own runtimes (`n`,
    `logprobs`, tools, penalties) is left to the engine to accept or refuse.
    """
    kind = _GENERATION_TYPES.get(endpoint) if endpoint is not None else None
    if kind is None:
        return
    try:
        request: Any = msgspec.json.decode(body, type=kind)
    except (msgspec.ValidationError, msgspec.DecodeError) as err:
        error = invalid_body(err)
        if error.param is None and "missing required field `" in str(err):
            # A top-level field: msgspec gives no `$.` path, only its name.
            error.param = str(err).split("missing required field `", 1)[1].split("`", 1)[0]
        raise error from None
    if isinstance(request, EmbeddingsRequest):
        if not request.input:
            raise ApiError(400, "'input' must not be empty", param="input")
        return
    for name in ("max_tokens", "max_completion_tokens"):
        value = getattr(request, name, None)
        if value is not None and value < 1:
            raise ApiError(400, f"'{name}' must be at least 1 (got {value})", param=name)
    if not 0.0 <= request.temperature <= 2.0:
        raise ApiError(400, "'temperature' must be between 0 and 2", param="temperature")
    if not 0.0 < request.top_p <= 1.0:
        raise ApiError(400, "'top_p' must be greater than 0 and at most 1", param="top_p")
    if isinstance(request, ChatRequest):
        if not request.messages:
            raise ApiError(400, "'messages' must not be empty", param="messages")
    elif not request.prompt:
        raise ApiError(400, "'prompt' must not be empty", param="prompt")
