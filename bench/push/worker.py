"""A push worker: one model behind its own HTTP server, batching what was pushed to it.

    python -m bench.push.worker --port P --model-json SPEC [--max-batch-items 32]
        [--max-batch-tokens 8192] [--max-wait-ms 0]

Requests wait in a local FIFO; the batch loop takes from its front within the same item and
token budgets as Shoal's worker (shoal.worker.batching.take_batch, cost = body bytes / 4 as
the gateway estimates it), optionally waits up to `max_wait_ms` for a fuller batch, and runs
it through Shoal's own EmbeddingsHandler in one executor thread. Busy time is measured around
that call with Shoal's BusyMeter and exported under Shoal's metric names at /metrics.
With `max_wait_ms` 0 (the default) the policy is the same as Shoal's eager worker.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec

from shoal.gateway.routing import estimate_tokens
from shoal.observability.metrics import BusyMeter, WorkerMetrics
from shoal.protocol import ModelSpec
from shoal.runtimes.registry import load_runtime
from shoal.worker.items import Reply, take_batch
from shoal.worker.tasks.embed import EmbeddingsHandler

JSON_TYPE = (b"content-type", b"application/json")
_TEXT = (b"content-type", b"text/plain; version=0.0.4; charset=utf-8")


@dataclass(slots=True)
class PushedItem:
    """One pushed request: what take_batch needs (`cost`) and where its answer goes."""

    body: bytes
    cost: int
    answer: asyncio.Future[Reply] = field(repr=False)
    # take_batch keeps redelivered items apart; a pushed request is never redelivered.
    deliveries: int = 1
    culprit: bool = False


@dataclass(frozen=True)
class PushWorkerSettings:
    spec: ModelSpec
    max_batch_items: int = 32
    max_batch_tokens: int = 8192
    max_wait_s: float = 0.0


class PushWorker:
    """The ASGI app: POST /v1/embeddings, GET /metrics, GET /status, GET /healthz."""

    def __init__(self, settings: PushWorkerSettings) -> None:
        self.settings = settings
        self.metrics = WorkerMetrics(
            settings.spec.name, settings.spec.runtime, settings.spec.runtime == "sim"
        )
        self.busy = BusyMeter()
        self.items_done = 0
        self.batches = 0
        self.max_batch = 0
        self._pending: deque[PushedItem] = deque()
        self._arrived: asyncio.Event | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="push-runtime")
        self._handler: EmbeddingsHandler | None = None
        self._loop_task: asyncio.Task[None] | None = None

    async def __call__(self, scope: dict[str, Any], receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        path, method = scope["path"], scope["method"]
        if method == "POST" and path == "/v1/embeddings":
            body = await read_body(receive)
            reply = await self._enqueue(body)
            await respond(send, reply.status, reply.body, JSON_TYPE)
        elif path == "/metrics":
            await respond(send, 200, self.metrics.render(), _TEXT)
        elif path == "/status":
            status = {
                "busy_fraction": self.busy.fraction(),
                "items_done": self.items_done,
                "batches": self.batches,
                "max_batch_items": self.max_batch,
                "queued": len(self._pending),
            }
            await respond(send, 200, json.dumps(status).encode(), JSON_TYPE)
        elif path == "/healthz":
            await respond(send, 200 if self._handler else 503, b"{}", JSON_TYPE)
        else:
            await respond(send, 404, b'{"error":"not found"}', JSON_TYPE)

    async def _lifespan(self, receive, send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                loop = asyncio.get_running_loop()
                runtime = await loop.run_in_executor(
                    self._executor, load_runtime, self.settings.spec
                )
                self._handler = EmbeddingsHandler(runtime, self.settings.spec.name)
                self._arrived = asyncio.Event()
                self._loop_task = asyncio.create_task(self._run())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._loop_task is not None:
                    self._loop_task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await self._loop_task
                self._executor.shutdown(wait=False)
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _enqueue(self, body: bytes) -> Reply:
        assert self._arrived is not None
        answer: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._pending.append(PushedItem(body, estimate_tokens(body), answer))
        self._arrived.set()
        return await answer

    async def _run(self) -> None:
        """The batch loop: the same eager policy as Shoal's worker, plus an optional wait."""
        assert self._arrived is not None and self._handler is not None
        settings = self.settings
        loop = asyncio.get_running_loop()
        while True:
            if not self._pending:
                self._arrived.clear()
                await self._arrived.wait()
                continue
            if settings.max_wait_s > 0 and len(self._pending) < settings.max_batch_items:
                await self._wait_for_more(settings.max_wait_s)
            batch = take_batch(
                self._pending,  # type: ignore[arg-type]  # take_batch only reads .cost
                settings.max_batch_items,
                settings.max_batch_tokens,
            )
            self.busy.start()
            try:
                outcome = await loop.run_in_executor(
                    self._executor, self._handler.handle, [item.body for item in batch]
                )
            finally:
                busy_s = self.busy.stop()
            self.metrics.busy_seconds.inc(busy_s)
            self.metrics.batch_seconds.observe(busy_s)
            self.metrics.batch_items.observe(len(batch))
            self.batches += 1
            self.max_batch = max(self.max_batch, len(batch))
            for item, reply in zip(batch, outcome.replies, strict=True):
                self.metrics.count_item(reply.status)
                self.items_done += 1
                if not item.answer.done():
                    item.answer.set_result(reply)

    async def _wait_for_more(self, max_wait_s: float) -> None:
        assert self._arrived is not None
        deadline = asyncio.get_running_loop().time() + max_wait_s
        while len(self._pending) < self.settings.max_batch_items:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), remaining)


async def read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def respond(send, status: int, body: bytes, content_type: tuple[bytes, bytes]) -> None:
    headers = [content_type, (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-json", required=True, help="a ModelSpec as JSON")
    parser.add_argument("--max-batch-items", type=int, default=32)
    parser.add_argument("--max-batch-tokens", type=int, default=8192)
    parser.add_argument("--max-wait-ms", type=float, default=0.0)
    args = parser.parse_args()
    settings = PushWorkerSettings(
        spec=msgspec.json.decode(args.model_json.encode(), type=ModelSpec),
        max_batch_items=args.max_batch_items,
        max_batch_tokens=args.max_batch_tokens,
        max_wait_s=args.max_wait_ms / 1000,
    )
    serve(PushWorker(settings), args.host, args.port)


def serve(app: Any, host: str, port: int) -> None:
    """uvicorn with uvloop and httptools, as Shoal's gateway runs (shoal.gateway.server)."""
    import uvicorn

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        log_level="warning",
        timeout_graceful_shutdown=5,
        backlog=4096,
        # The router keeps connections to workers open; uvicorn's 5 s default would close idle
        # ones, and a request sent just as the worker closes one fails.
        timeout_keep_alive=3600,
    )
    with contextlib.suppress(KeyboardInterrupt):
        uvicorn.Server(config).run()


if __name__ == "__main__":
    main()
