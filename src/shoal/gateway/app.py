"""The gateway as a plain ASGI app: small enough that a framework would only add overhead.

Per request it reads the body, decodes only `model` and `stream`, publishes the body
unchanged to the model's work subject with metadata in headers, and waits for the result on
its process's reply subject. The result body is written out as the worker encoded it; a
streamed result is relayed chunk by chunk as server-sent events (gateway/streaming.py).
A generation request whose client disconnects is cancelled at the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.js.kv import KeyValue

from shoal.api.errors import ApiError
from shoal.api.models import encode_model, encode_model_list
from shoal.broker.bodies import INLINE_BODY_BYTES, BodyStore
from shoal.broker.connection import connect
from shoal.broker.jetstream import ensure_work_stream
from shoal.broker.publish import (
    PublishError,
    QueueFullError,
    QueueUnavailableError,
    publish_work,
)
from shoal.config import GatewaySettings
from shoal.gateway.admin import PREFIX as ADMIN_PREFIX
from shoal.gateway.admin import check_token, handle_admin
from shoal.gateway.auth import auth_for
from shoal.gateway.cancels import CancelSender
from shoal.gateway.committer import GroupCommitter
from shoal.gateway.dashboard import DATA_PATH, PAGE_PATH, Dashboard
from shoal.gateway.openapi import load_document
from shoal.gateway.readiness import Readiness
from shoal.gateway.replies import ReplyRouter
from shoal.gateway.routing import estimate_tokens, read_routing_fields, request_header
from shoal.gateway.streaming import (
    ClientGone,
    StreamRelay,
    WaitingRequests,
    wait_for_disconnect,
)
from shoal.observability.metrics import GatewayMetrics
from shoal.protocol import (
    Endpoint,
    Header,
    Task,
    UniqueIds,
    WorkRequest,
    encode_json,
    now_ms,
    reply_subject,
)
from shoal.state.deployments import ModelDirectory
from shoal.state.idempotency import (
    Claim,
    IdempotencyRecord,
    answer_body,
    claim,
    ensure_idempotency_kv,
    mark_queued,
    pending_record,
    record_key,
    release,
    take_over,
    wait_for_change,
)

log = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_JSON = (b"content-type", b"application/json")
_TEXT = (b"content-type", b"text/plain; version=0.0.4; charset=utf-8")
_CLIENT_CLOSED = 499  # nginx's status for "client closed request": metrics only
# A request that waits longer than this for its result starts watching for its client's
# disconnect (gateway/streaming.py, WaitingRequests).
DISCONNECT_WATCH_AFTER_S = 0.2
# How long one of several gateway processes on a port waits for NATS before it serves
# (`Gateway.startup`): a local connection takes well under a second.
FIRST_CONNECTION_WAIT_S = 5.0
# Stripe's limit; a key is a client's request id, not a payload.
MAX_IDEMPOTENCY_KEY_CHARS = 255
# Tries (0.5 s apart) to free an idempotency key while NATS is away: past them the claim is
# abandoned at its deadline anyway.
RELEASE_ATTEMPTS = 120
# Answered before the body was read to its end: the connection cannot carry another request.
_UNREAD_BODY = (408, 413)
_MODEL_PREFIX = "/v1/models/"  # GET /v1/models/{id}: the rest of the path is the model's name
_ROUTE_OF_TASK = {
    Task.EMBEDDINGS: "/v1/embeddings",
    Task.GENERATE: "/v1/chat/completions",
    Task.RERANK: "/v1/rerank",
}


class Gateway:
    """The ASGI application. Connects to NATS on lifespan startup and keeps retrying."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.gateway_id = uuid.uuid4().hex[:12]
        self._request_ids = UniqueIds()
        self.metrics = GatewayMetrics()
        self.replies = ReplyRouter(reply_subject(self.gateway_id), self.metrics.dropped_replies.inc)
        self.waiting = WaitingRequests(DISCONNECT_WATCH_AFTER_S)
        self.directory = ModelDirectory()
        self.readiness = Readiness(self.directory)
        self.committer = GroupCommitter(
            self.replies.subject, self._publish, self.readiness.smallest_budget
        )
        self.cancels = CancelSender(self._publish_cancels)
        # Done the moment the connection to NATS drops (a new one after each reconnect):
        # a publish waiting for its acknowledgement gives up then, instead of timing out.
        self._lost: asyncio.Future[None] | None = None
        self._rewatch: asyncio.Task[None] | None = None
        # None when API keys are not checked (loopback by default, or --no-auth).
        self.auth = auth_for(settings.api_keys, settings.host)
        self._nc: Client | None = None
        self._js = None
        self._bodies: BodyStore | None = None  # large request bodies (broker/bodies.py)
        self._idempotency: KeyValue | None = None  # opened at the first Idempotency-Key
        self._releases: set[asyncio.Task[None]] = set()  # idempotency keys being freed
        self._ready = asyncio.Event()
        self._connect_task: asyncio.Task[None] | None = None
        self._metrics_flush: asyncio.Task[None] | None = None  # with shared metrics only
        self._openapi_document = load_document()  # static: built from shoal.api's types
        self.dashboard = Dashboard(
            self.gateway_id,
            settings.admin_token,
            self.metrics,
            self.directory.all,
            self._connected_js,
        )
        self._routes: dict[tuple[str, str], Callable[[Scope, Receive, Send], Awaitable[None]]] = {
            ("POST", "/v1/embeddings"): partial(self._inference, Endpoint.EMBEDDINGS),
            ("POST", "/v1/completions"): partial(self._inference, Endpoint.COMPLETIONS),
            ("POST", "/v1/chat/completions"): partial(self._inference, Endpoint.CHAT_COMPLETIONS),
            ("POST", "/v1/rerank"): partial(self._inference, Endpoint.RERANK),
            ("GET", "/v1/models"): self._models,
            ("GET", "/healthz"): self._healthz,
            ("GET", "/readyz"): self._readyz,
            ("GET", "/metrics"): self._metrics,
            ("GET", "/openapi.json"): self._openapi,
            ("GET", PAGE_PATH): self.dashboard.page,  # read-only (gateway/dashboard.py)
            ("GET", DATA_PATH): self.dashboard.data,
        }
        self._paths = {path for _, path in self._routes}

    # -- lifecycle -----------------------------------------------------------------------

    async def startup(self) -> None:
        """Connect to NATS in the background; one of several processes on a port waits for
        the connection first (at most `FIRST_CONNECTION_WAIT_S`).

        uvicorn accepts on the port only once this returns. A process that accepted before
        it could queue would answer 503s while its siblings on the same port already serve:
        a client told the gateway is ready (`/readyz` from one process) could then meet a
        503 from another. A lone process serves at once (its `/readyz` says whether it can
        queue), and so does one whose NATS is still away after the wait.
        """
        self._connect_task = asyncio.create_task(self._connect())
        if self.metrics.shared:
            self._metrics_flush = asyncio.create_task(self.metrics.flush_every())
        if self.settings.processes > 1:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ready.wait(), FIRST_CONNECTION_WAIT_S)

    async def shutdown(self) -> None:
        self.waiting.stop()
        if self._connect_task is not None:
            self._connect_task.cancel()
        if self._metrics_flush is not None:
            self._metrics_flush.cancel()
        self.metrics.flush()
        await self.directory.stop()
        await self.readiness.stop()
        if self.auth is not None:
            await self.auth.stop()
        if self._nc is not None and not self._nc.is_closed:
            await self._nc.close()

    async def _connect(self) -> None:
        while True:
            try:
                nc = await connect(
                    self.settings.nats_url,
                    name=f"shoal-gateway-{self.gateway_id}",
                    auth=self.settings.nats_auth,
                    on_disconnect=self._on_nats_lost,
                    on_reconnect=self._on_nats_back,
                )
                js = nc.jetstream()
                await ensure_work_stream(js, self.settings.queue)
                await self.replies.start(nc)
                await self.directory.start(js)
                await self.directory.loaded.wait()
                await self.readiness.start(js)
                if self.auth is not None:  # ready only once the keys are held
                    await self.auth.start(js)
            except Exception as err:
                log.warning("gateway cannot reach NATS at %s yet: %s", self.settings.nats_url, err)
                await asyncio.sleep(1.0)
                continue
            self._nc, self._js, self._bodies = nc, js, BodyStore(js)
            self._lost = asyncio.get_running_loop().create_future()
            self._ready.set()
            return

    async def _on_nats_lost(self) -> None:
        """The connection dropped: everyone waiting is told to retry now, not at the deadline.

        A reply published while this gateway's subscription is gone is lost, so waiting on
        would end in a 504; the work itself is safe in the stream (or was never stored).
        """
        if not self._ready.is_set():
            return  # a connection still being set up: nothing waits on it
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(None)
        lost = ApiError(503, "The connection to the queue (NATS) was lost; retry", retry_after=1)
        failed = self.replies.fail_all(lost)
        if failed:
            log.warning("NATS connection lost: answered %d waiting request(s) with 503", failed)

    async def _on_nats_back(self) -> None:
        """Reconnected: watch the worker reports again, from their current values.

        The watch's consumer may have gone with the server; rewatching now beats waiting for
        its missed heartbeats to notice (readiness would lag by up to 10 s). In a task: this
        runs inside nats.py's reconnect, which must not wait on JetStream requests.
        """
        self._lost = asyncio.get_running_loop().create_future()
        if self._js is not None and self._ready.is_set():
            self._rewatch = asyncio.create_task(self._restart_readiness(self._js))

    async def _restart_readiness(self, js) -> None:
        while self._nc is not None and self._nc.is_connected:
            try:
                await self.readiness.start(js)
                return
            except Exception as err:  # JetStream may still be recovering its state
                log.warning("watching worker reports after a reconnect failed: %s", err)
                await asyncio.sleep(0.5)

    # -- ASGI ----------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path = scope["path"]
        handler = self._routes.get((scope["method"], path))
        if handler is None and (path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/")):
            handler = self._admin
        if handler is None and path.startswith(_MODEL_PREFIX):  # `client.models.retrieve`
            handler = self._model
        try:
            if handler is None:
                if path in self._paths:
                    raise ApiError(405, f"Method {scope['method']} is not allowed on {path}")
                raise ApiError(404, f"Unknown path {path}")
            await handler(scope, receive, send)
        except ApiError as err:
            await _respond_error(send, err)
        except nats.errors.Error as err:  # NATS away or failing over: a retry, not a 500
            log.warning("%s %s: NATS error: %r", scope["method"], path, err)
            error = ApiError(503, f"The queue (NATS) did not answer: {err}", retry_after=1)
            await _respond_error(send, error)
        except asyncio.CancelledError:
            # Only uvicorn cancels a request: one still running when its graceful shutdown
            # times out. Its client is told to retry (a streamed request, in its stream:
            # `_stream`), where uvicorn would answer a plain-text 500 and log a traceback.
            await _respond_error(send, _shutting_down())

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await self.startup()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- routes --------------------------------------------------------------------------

    async def _inference(
        self, endpoint: Endpoint, scope: Scope, receive: Receive, send: Send
    ) -> None:
        started = time.perf_counter()
        model_label = "-"  # only deployed names become labels, so the label set stays bounded
        status = 500
        try:
            # The key is checked on the headers alone: no body is read for a refused request.
            auth = self.auth
            key_id = auth.authenticate(scope["headers"]) if auth is not None else None
            body = await _read_body(receive, self.settings)
            fields = read_routing_fields(body)
            if auth is not None and key_id is not None:
                # Before the deployment check, so a model outside the allowlist gets the
                # same 404 whether it exists or not.
                auth.authorize(key_id, fields.model)
            self._check_model(fields.model, endpoint)
            model_label = fields.model
            client_key = _idempotency_key(scope["headers"])
            # Embeddings and rerank are never streamed.
            if fields.stream and endpoint not in (Endpoint.EMBEDDINGS, Endpoint.RERANK):
                if client_key is not None:
                    raise ApiError(
                        400,
                        "Idempotency-Key is not supported on streamed requests",
                        param="Idempotency-Key",
                    )
                status = await self._stream(fields.model, endpoint, body, receive, send)
            elif client_key is not None:
                principal = key_id or ""
                status, payload, replayed = await self._idempotent(
                    fields.model, endpoint, body, receive, client_key, principal
                )
                await _respond(send, status, payload, extra_headers=_replayed(replayed))
            else:
                status, payload = await self._dispatch(fields.model, endpoint, body, receive)
                await _respond(send, status, payload)
        except ApiError as err:
            status = err.status
            raise
        except asyncio.CancelledError:
            status = 503  # the gateway is stopping: answered in __call__
            raise
        except ClientGone:
            status = _CLIENT_CLOSED
        finally:
            elapsed = time.perf_counter() - started
            self.metrics.observe_request(endpoint.value, model_label, status, elapsed)

    def _check_model(self, model: str, endpoint: Endpoint) -> None:
        # Before the first connection the directory is empty: that is not a 404.
        if not self._ready.is_set():
            raise ApiError(503, "The queue (NATS) is not reachable", retry_after=1)
        spec = self.directory.get(model)
        if spec is None:
            raise ApiError(
                404, f"The model '{model}' does not exist", param="model", code="model_not_found"
            )
        if not endpoint.served_by(spec.task):
            raise ApiError(
                400,
                f"The model '{model}' serves {spec.task.value}: use {_ROUTE_OF_TASK[spec.task]}",
                param="model",
                code="model_not_supported",
            )

    def _work_request(
        self,
        request_id: str,
        endpoint: Endpoint,
        body: bytes,
        stream: bool,
        idempotency_key: str = "",
    ) -> WorkRequest:
        deadline = now_ms() + int(self.settings.request_timeout_s * 1000)
        return WorkRequest(
            request_id,
            endpoint.value,
            deadline,
            estimate_tokens(body),
            body,
            stream=stream,
            idempotency_key=idempotency_key,
        )

    async def _queue(self, model: str, endpoint: Endpoint, request: WorkRequest) -> None:
        """Put one request on the model's queue; returns once JetStream stored it."""
        self._connected_js()  # 503 at once while NATS is away
        if _shares_an_envelope(endpoint, request):
            await self.committer.submit(model, request)
            return
        if len(request.body) <= INLINE_BODY_BYTES:
            await self.committer.submit(model, request, alone=True)
            return
        # Too large for a work message on any NATS: the body waits beside the queue.
        await self._store_body(request)
        try:
            stored = msgspec.structs.replace(request, body=b"", body_key=request.request_id)
            await self.committer.submit(model, stored, alone=True)
        except BaseException:
            with contextlib.suppress(Exception):
                await self._store().delete(request.request_id)
            raise

    def _store(self) -> BodyStore:
        self._connected_js()
        assert self._bodies is not None
        return self._bodies

    async def _store_body(self, request: WorkRequest) -> None:
        try:
            await self._unless_lost(self._store().put(request.request_id, request.body))
        except ApiError:
            raise
        except Exception as err:
            raise ApiError(
                503, f"The queue did not take the request body: {err}", retry_after=1
            ) from None

    def _connected_js(self):
        nc, js = self._nc, self._js
        if nc is None or js is None or not nc.is_connected:
            raise ApiError(503, "The queue (NATS) is not reachable", retry_after=1)
        return js

    async def _dispatch(
        self,
        model: str,
        endpoint: Endpoint,
        body: bytes,
        receive: Receive,
        request_id: str = "",
        idempotency_key: str = "",
        on_queued: Callable[[], Awaitable[None]] | None = None,
    ) -> tuple[int, bytes]:
        """Queue one request and wait for its result; returns (HTTP status, response body).
        `on_queued` runs once JetStream has stored it.

        A client that disconnects while waiting cancels the request: its work is dropped
        before it runs, or stopped at the next step of a generation.
        """
        request_id = request_id or self._request_ids.new()
        timeout_s = self.settings.request_timeout_s
        future = self.replies.expect(request_id)
        self.waiting.add(future, receive, timeout_s)  # its deadline, its client leaving
        try:
            request = self._work_request(request_id, endpoint, body, False, idempotency_key)
            if on_queued is None and _shares_an_envelope(endpoint, request):
                # Not waiting for JetStream's answer saves a task wake-up a request; a refusal
                # (429, 503) comes on `future` instead.
                self._connected_js()
                self.committer.submit_nowait(model, request, future)
            else:
                await self._queue(model, endpoint, request)
                if on_queued is not None:
                    await on_queued()
            reply = await future
        except TimeoutError:
            raise ApiError(504, f"No result within {timeout_s:g} s", code="timeout") from None
        except ClientGone:
            self.cancels.cancel(model, request_id)
            raise
        finally:
            self.replies.forget(request_id)
            self.waiting.remove(future)
            future.cancel()  # a refusal that comes later has nobody to tell
        return reply.status, reply.body

    async def _idempotent(
        self,
        model: str,
        endpoint: Endpoint,
        body: bytes,
        receive: Receive,
        client_key: str,
        principal: str,
    ) -> tuple[int, bytes, bool]:
        """A request with an Idempotency-Key: (status, body, whether it is a replay).

        The first request with a key claims it and runs; the same key with the same body,
        at any gateway within the window, gets the first answer (waiting for it while it
        runs); with another body, a 422 (state/idempotency.py).
        """
        if not 0 < len(client_key) <= MAX_IDEMPOTENCY_KEY_CHARS:
            raise ApiError(
                400,
                f"Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY_CHARS} characters",
                param="Idempotency-Key",
            )
        with _unavailable_as_503():
            kv = await self._idempotency_kv()
        key = record_key(client_key, endpoint.value, principal)
        timeout_s = self.settings.request_timeout_s
        give_up = time.monotonic() + timeout_s
        while True:
            request_id = self._request_ids.new()
            pending = pending_record(body, request_id, now_ms() + int(timeout_s * 1000))
            with _unavailable_as_503():
                settled = await self._settle_claim(kv, key, pending, give_up)
            if settled is _CLAIM_AGAIN:
                continue
            if isinstance(settled, IdempotencyRecord):
                return settled.status, settled.body, True
            assert isinstance(settled, Claim)

            async def queued(claimed: Claim = settled) -> None:
                with contextlib.suppress(Exception):  # unmarked: abandoned after a grace
                    await mark_queued(kv, key, claimed)

            try:
                status, payload = await self._dispatch(
                    model, endpoint, body, receive, request_id, key, on_queued=queued
                )
            except ApiError as err:
                if err.status != 504:  # not queued, or told to retry: the key is free again
                    self._release_soon(kv, key)
                raise
            except ClientGone:
                self._release_soon(kv, key)  # cancelled: a retry runs it anew
                raise
            return status, payload, False

    def _release_soon(self, kv: KeyValue, key: str) -> None:
        """Free an idempotency key now or, while NATS is away (the usual reason the request
        failed), as soon as it is back: a retry waiting on the key then runs at once instead
        of waiting for the claim to be abandoned at its deadline."""

        async def release_until_done() -> None:
            for _ in range(RELEASE_ATTEMPTS):
                try:
                    await release(kv, key)
                    return
                except Exception as err:
                    log.debug("releasing an idempotency key failed, trying again: %s", err)
                    await asyncio.sleep(0.5)

        task = asyncio.ensure_future(release_until_done())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _settle_claim(
        self, kv: KeyValue, key: str, pending: IdempotencyRecord, give_up: float
    ) -> Claim | IdempotencyRecord | object:
        """Claim `key` for `pending`: our Claim when it is ours to run; the DONE record to
        replay; `_CLAIM_AGAIN` after waiting for another request's answer or losing a
        take-over."""
        claimed = await claim(kv, key, pending)
        if claimed.ours:
            return claimed
        record, revision = claimed.record, claimed.revision
        if record.body_hash != pending.body_hash:
            raise ApiError(
                422,
                "This Idempotency-Key was used with another request body",
                param="Idempotency-Key",
                code="idempotency_key_reused",
            )
        if record.done:
            answer = await answer_body(self._store(), key, record)
            if answer is not None:
                return msgspec.structs.replace(record, body=answer)
        if not (record.done or record.abandoned(now_ms())):
            # Running elsewhere: wait for its answer, or until it is abandoned.
            until_abandoned = (record.abandoned_at_ms() - now_ms()) / 1000
            wait_s = min(give_up - time.monotonic(), max(0.05, until_abandoned))
            if wait_s <= 0:
                timeout_s = self.settings.request_timeout_s
                raise ApiError(504, f"No result within {timeout_s:g} s", code="timeout")
            await wait_for_change(kv, key, revision, wait_s)
            return _CLAIM_AGAIN
        taken = await take_over(kv, key, pending, revision)
        return _CLAIM_AGAIN if taken is None else taken  # None: another retry was first

    async def _idempotency_kv(self) -> KeyValue:
        self._connected_js()
        if self._idempotency is None:
            assert self._js is not None
            self._idempotency = await ensure_idempotency_kv(
                self._js, self.settings.idempotency_window_s
            )
        return self._idempotency

    async def _stream(
        self, model: str, endpoint: Endpoint, body: bytes, receive: Receive, send: Send
    ) -> int:
        """Queue a streamed request and relay its chunks; returns the status for metrics."""
        request_id = self._request_ids.new()
        queue = self.replies.expect_stream(request_id)
        disconnected = asyncio.create_task(wait_for_disconnect(receive))
        relay = StreamRelay(queue, _retry_after_on_503(send), disconnected)
        try:
            await self._queue(model, endpoint, self._work_request(request_id, endpoint, body, True))
            settings = self.settings
            await relay.run(
                time.monotonic() + settings.request_timeout_s, settings.stream_idle_timeout_s
            )
        except (ClientGone, OSError):
            self.cancels.cancel(model, request_id)
            raise ClientGone from None
        except asyncio.CancelledError:  # the gateway is stopping (see __call__)
            await relay.fail(_shutting_down())
            self.cancels.cancel(model, request_id)
            return 503
        finally:
            self.replies.forget(request_id)
            disconnected.cancel()
        if relay.status != 200:
            self.cancels.cancel(model, request_id)  # whatever still runs has no reader
        return relay.status

    async def _publish_cancels(self, subject: str, body: bytes) -> None:
        """Publish one cancel message (CancelSender's publish); dropped while disconnected."""
        nc = self._nc
        if nc is not None and nc.is_connected:
            await nc.publish(subject, body)

    async def _publish(self, subject: str, payload: bytes, envelope_id: str) -> None:
        """Publish one work envelope (the committer's publish); ApiError if it was refused."""
        js = self._connected_js()
        try:
            await self._unless_lost(
                publish_work(js, subject, payload, {Header.MSG_ID: envelope_id})
            )
        except QueueFullError:
            raise ApiError(
                429,
                "The queue for this model is full; retry later",
                code="queue_full",
                retry_after=self.settings.retry_after_s,
            ) from None
        except PublishError as err:
            retry_after = 1 if err.retry else None
            raise ApiError(
                503, f"The queue did not take the request: {err}", retry_after=retry_after
            ) from None

    async def _unless_lost(self, work: Awaitable[None]) -> None:
        """Await `work`, unless the connection to NATS drops first: QueueUnavailableError.

        Whether a publish cut off this way was stored is unknown; its client is told to retry
        (the worker's result for it, if any, is dropped as late).
        """
        lost = self._lost
        if lost is None or lost.done():
            await work
            return
        task = asyncio.ensure_future(work)
        await asyncio.wait((task, lost), return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            raise QueueUnavailableError("the connection to the queue (NATS) was lost")
        task.result()

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        specs = self.directory.all()
        auth = self.auth
        if auth is not None:  # a key sees the models it may use
            specs = auth.visible(auth.authenticate(scope["headers"]), specs)
        await _respond(send, 200, encode_model_list(specs))

    async def _model(self, scope: Scope, receive: Receive, send: Send) -> None:
        """`GET /v1/models/{id}`: one model as in the list, 404 for one the key does not see."""
        if scope["method"] != "GET":
            raise ApiError(405, f"Method {scope['method']} is not allowed on {scope['path']}")
        model = scope["path"].removeprefix(_MODEL_PREFIX)  # ASGI paths arrive URL-decoded
        auth = self.auth
        key_id = auth.authenticate(scope["headers"]) if auth is not None else None
        if not self._ready.is_set():
            raise ApiError(503, "The queue (NATS) is not reachable", retry_after=1)
        spec = self.directory.get(model)
        # A model outside the key's allowlist gets the same 404 as one that does not exist.
        if spec is None or (auth is not None and not auth.visible(key_id or "", [spec])):
            raise ApiError(
                404, f"The model '{model}' does not exist", param="model", code="model_not_found"
            )
        await _respond(send, 200, encode_model(spec))

    async def _admin(self, scope: Scope, receive: Receive, send: Send) -> None:
        check_token(scope["headers"], self.settings.admin_token)
        body = await _read_body(receive, self.settings)
        js = self._connected_js()
        status, payload = await handle_admin(
            scope["method"], scope["path"], body, js, self.settings.queue
        )
        await _respond(send, status, payload)

    async def _healthz(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _respond(send, 200, b'{"status":"ok"}')

    async def _readyz(self, scope: Scope, receive: Receive, send: Send) -> None:
        """200 only when this gateway can serve: connected, deployments read, and every pinned
        model with a READY worker (gateway/readiness.py; from memory, no NATS round trip)."""
        if not (self._ready.is_set() and self._nc is not None and self._nc.is_connected):
            raise ApiError(503, "Not connected to the queue (NATS)", retry_after=1)
        ready_workers = self.readiness.ready_workers()
        missing = sorted(model for model, ready in ready_workers.items() if not ready)
        if missing:
            raise ApiError(
                503,
                f"No ready worker for the pinned model(s) {', '.join(missing)}",
                code="no_ready_worker",
                retry_after=1,
            )
        await _respond(send, 200, encode_json({"status": "ready", "ready_workers": ready_workers}))

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _respond(send, 200, self.metrics.render(), content_type=_TEXT)

    async def _openapi(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _respond(send, 200, self._openapi_document)


async def _read_body(receive: Receive, settings: GatewaySettings) -> bytes:
    """The whole body: 413 past `max_body_bytes`, 408 when it takes longer than its timeout.

    Under uvicorn the protocol times a trickling body out where the bytes arrive, with no
    timer for a body that came whole (http_protocol.py); granian has no body timeout, so
    there the app sets one.
    """
    if settings.http_server == "uvicorn":
        return await _receive_body(receive, settings.max_body_bytes)
    timeout_s = settings.http_timeouts.body_s
    try:
        async with asyncio.timeout(timeout_s):
            return await _receive_body(receive, settings.max_body_bytes)
    except TimeoutError:
        raise ApiError(
            408, f"The request body did not arrive within {timeout_s:g} s", code="body_timeout"
        ) from None


async def _receive_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ApiError(400, "The client disconnected before sending the body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"The request body is larger than the limit of {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _retry_after_on_503(send: Send) -> Send:
    """`send`, adding Retry-After to a 503 (a stream failed because NATS went away)."""

    async def wrapped(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start" and message["status"] == 503:
            message = {**message, "headers": [*message["headers"], (b"retry-after", b"1")]}
        await send(message)

    return wrapped


_CLAIM_AGAIN = object()  # `_settle_claim`: look at the key again


@contextlib.contextmanager
def _unavailable_as_503() -> Iterator[None]:
    """NATS errors (a node going away, a stream without a leader yet) become a 503 with
    Retry-After: the client is told to retry, not given a 500."""
    try:
        yield
    except nats.errors.Error as err:
        raise ApiError(503, f"The queue (NATS) did not answer: {err}", retry_after=1) from None


def _shutting_down() -> ApiError:
    return ApiError(
        503, "The gateway is shutting down; retry the request", code="shutting_down", retry_after=1
    )


def _shares_an_envelope(endpoint: Endpoint, request: WorkRequest) -> bool:
    """Whether a request goes to the queue in a shared envelope (gateway/committer.py).

    Generation travels alone (its worker pulls as many requests as it has free slots), and
    a body too large for an envelope waits beside the queue (broker/bodies.py).
    """
    generation = endpoint in (Endpoint.COMPLETIONS, Endpoint.CHAT_COMPLETIONS)
    return not generation and len(request.body) <= INLINE_BODY_BYTES


def _idempotency_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    value = request_header(headers, b"idempotency-key")
    return None if value is None else value.decode("latin-1").strip()


def _replayed(replayed: bool) -> list[tuple[bytes, bytes]]:
    return [(b"idempotent-replayed", b"true")] if replayed else []


async def _respond(
    send: Send,
    status: int,
    body: bytes,
    content_type: tuple[bytes, bytes] = _JSON,
    extra_headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    headers = [content_type, (b"content-length", str(len(body)).encode()), *(extra_headers or [])]
    # Under uvicorn, `send` is a method of the request's `Exchange`, which writes a whole
    # response at once (http_protocol.py); other servers get the two ASGI messages.
    send_whole = getattr(getattr(send, "__self__", None), "send_whole", None)
    if send_whole is not None:
        await send_whole(status, headers, body)
        return
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _respond_error(send: Send, err: ApiError) -> None:
    extra = []
    if err.retry_after is not None:
        extra.append((b"retry-after", str(max(1, round(err.retry_after))).encode()))
    if err.status in _UNREAD_BODY:
        extra.append((b"connection", b"close"))
    await _respond(send, err.status, err.body(), extra_headers=extra)
