"""The push router: picks a worker for every request and forwards it over HTTP.

    python -m bench.push.router --port P --policy rr|lor|p2c --cap 64 --workers HOST:PORT,...

Policies, as production routers implement them:
- `rr`   round robin: the next worker in turn that is below its cap;
- `lor`  least outstanding requests: the worker with the fewest requests in flight;
- `p2c`  power of two choices: the less loaded of two workers drawn at random.
A worker never has more than `cap` requests in flight from the router (0: no cap), like Ray
Serve's `max_ongoing_requests` or Envoy's per-host request limits. When every worker is at its
cap, requests wait at the router in arrival order and go to the first worker that frees a slot.
Forwarding uses keep-alive connections (bench/http1.py), one per request in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from bench.http1 import Http1Connection, build_request
from bench.push.worker import JSON_TYPE, read_body, respond, serve

POLICIES = ("rr", "lor", "p2c")


@dataclass
class Upstream:
    """One worker as the router sees it."""

    host: str
    port: int
    outstanding: int = 0
    forwarded: int = 0
    idle: deque[Http1Connection] = field(default_factory=deque)


class PushRouter:
    """The ASGI app: POST /v1/embeddings is forwarded; GET /status, GET /healthz."""

    def __init__(self, upstreams: list[Upstream], policy: str, cap: int, seed: int = 1) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}: one of {', '.join(POLICIES)}")
        self.upstreams = upstreams
        self.policy = policy
        self.cap = cap
        self._rng = random.Random(seed)
        self._next = 0
        self._waiting: deque[asyncio.Future[int]] = deque()
        self.max_waiting = 0

    async def __call__(self, scope: dict[str, Any], receive, send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        path = scope["path"]
        if scope["method"] == "POST" and path.startswith("/v1/"):
            body = await read_body(receive)
            status, answer = await self._forward(path, body)
            if status == 0:
                status, answer = 502, b'{"error":{"message":"worker connection failed"}}'
            await respond(send, status, answer, JSON_TYPE)
        elif path == "/status":
            status = {
                "policy": self.policy,
                "cap": self.cap,
                "forwarded": [u.forwarded for u in self.upstreams],
                "outstanding": [u.outstanding for u in self.upstreams],
                "waiting": len(self._waiting),
                "max_waiting": self.max_waiting,
            }
            await respond(send, 200, json.dumps(status).encode(), JSON_TYPE)
        elif path == "/healthz":
            await respond(send, 200, b"{}", JSON_TYPE)
        else:
            await respond(send, 404, b'{"error":"not found"}', JSON_TYPE)

    async def _forward(self, path: str, body: bytes) -> tuple[int, bytes]:
        index = self._choose()
        if index is None:
            slot: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            self._waiting.append(slot)
            self.max_waiting = max(self.max_waiting, len(self._waiting))
            index = await slot  # a finishing request hands its worker slot over
        upstream = self.upstreams[index]
        upstream.outstanding += 1
        upstream.forwarded += 1
        try:
            conn = upstream.idle.pop() if upstream.idle else None
            if conn is None or conn.closed:
                conn = await Http1Connection.open(upstream.host, upstream.port, _on_response)
            answer: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
            conn.tag = answer
            conn.send(build_request(f"{upstream.host}:{upstream.port}", path, body))
            result = await answer
            if not conn.closed:
                upstream.idle.append(conn)
            return result
        except OSError:
            return 0, b""
        finally:
            self._release(index)

    def _release(self, index: int) -> None:
        upstream = self.upstreams[index]
        upstream.outstanding -= 1
        while self._waiting:
            slot = self._waiting.popleft()
            if not slot.done():
                # The freed slot goes straight to the longest-waiting request.
                upstream.outstanding += 1  # held for it until it runs
                slot.add_done_callback(lambda _, u=upstream: _unhold(u))
                slot.set_result(index)
                return

    def _has_room(self, upstream: Upstream) -> bool:
        return self.cap <= 0 or upstream.outstanding < self.cap

    def _choose(self) -> int | None:
        count = len(self.upstreams)
        if self.policy == "rr":
            for step in range(count):
                index = (self._next + step) % count
                if self._has_room(self.upstreams[index]):
                    self._next = index + 1
                    return index
            return None
        candidates = [i for i, u in enumerate(self.upstreams) if self._has_room(u)]
        if not candidates:
            return None
        if self.policy == "p2c":
            if len(candidates) == 1:
                return candidates[0]
            a, b = self._rng.sample(candidates, 2)
            return a if self.upstreams[a].outstanding <= self.upstreams[b].outstanding else b
        # lor: rotate the starting point so that ties do not always favour worker 0.
        self._next = (self._next + 1) % count
        return min(
            candidates,
            key=lambda i: (self.upstreams[i].outstanding, (i - self._next) % count),
        )


def _unhold(upstream: Upstream) -> None:
    upstream.outstanding -= 1  # _forward counts it again when the waiter runs


def _on_response(conn: Http1Connection, status: int, body: bytes) -> None:
    answer = conn.tag
    if isinstance(answer, asyncio.Future) and not answer.done():
        answer.set_result((status, body))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--policy", choices=POLICIES, default="lor")
    parser.add_argument("--cap", type=int, default=64, help="in-flight cap per worker; 0: none")
    parser.add_argument("--workers", required=True, help="HOST:PORT,HOST:PORT,...")
    args = parser.parse_args()
    upstreams = []
    for address in args.workers.split(","):
        host, port = address.rsplit(":", 1)
        upstreams.append(Upstream(host, int(port)))
    serve(PushRouter(upstreams, args.policy, args.cap), args.host, args.port)


if __name__ == "__main__":
    main()
