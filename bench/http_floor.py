"""What an HTTP layer costs a request, with no gateway behind it: uvicorn's own protocol, the
gateway's protocol (gateway/http_protocol.py) and a bare httptools protocol, side by side.

    python -m bench.http_floor [--connections 64 --seconds 8 --rounds 2]

Each server is one process on uvloop answering every POST with the same small JSON body,
after awaiting a future that the event loop sets on its next turn (where the gateway awaits
its result). wrk sends the benchmarks' embeddings request. Reported per round and server:
requests/s and the server's CPU microseconds a request (utime + stime from /proc over the
window). The servers run one after another with their order rotated each round, since the
machine's speed drifts from minute to minute.

- `uvicorn`: an ASGI app under uvicorn's own `HttpToolsProtocol` (head and body as two ASGI
  messages, the way any ASGI app answers).
- `gateway`: the same app under the gateway's protocol, answering with `send_whole`, as the
  gateway does.
- `bare`: an asyncio protocol over httptools with a task a request and no ASGI: the floor a
  Python HTTP layer on this event loop can reach.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import time
from typing import Any

from bench.harness import process_cpu_seconds, run_wrk, wrk_available
from shoal.process import child_preexec, free_port

SERVERS = ("uvicorn", "gateway", "bare")
_BODY = (
    b'{"object":"list","data":[{"object":"embedding","index":0,"embedding":"AAAA"}],'
    b'"model":"m","usage":{"prompt_tokens":3,"total_tokens":3}}'
)
_HEADERS = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(_BODY))]


async def _answer_soon() -> bytes:
    """The result a request waits for, set on the event loop's next turn."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    loop.call_soon(future.set_result, _BODY)
    return await future


async def _asgi_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await receive()
    body = await _answer_soon()
    send_whole = getattr(getattr(send, "__self__", None), "send_whole", None)
    if send_whole is not None:
        await send_whole(200, _HEADERS, body)
        return
    await send({"type": "http.response.start", "status": 200, "headers": _HEADERS})
    await send({"type": "http.response.body", "body": body})


class _BareProtocol(asyncio.Protocol):
    """The least a keep-alive HTTP/1.1 server does a request: parse, run a task, write."""

    def __init__(self) -> None:
        import httptools

        self._parser = httptools.HttpRequestParser(self)
        self._body: list[bytes] = []
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._body = []
        asyncio.get_running_loop().create_task(self._respond())

    async def _respond(self) -> None:
        body = await _answer_soon()
        head = b"HTTP/1.1 200 OK\r\n" + b"".join(b"%s: %s\r\n" % pair for pair in _HEADERS)
        transport = self._transport
        if transport is not None and not transport.is_closing():  # wrk may have gone
            transport.write(head + b"\r\n" + body)


def serve(server: str, port: int) -> None:
    import uvicorn
    import uvloop

    from shoal.config import HttpTimeouts
    from shoal.gateway.http_protocol import protocol_factory
    from shoal.process import tune_garbage_collector

    tune_garbage_collector()  # as every gateway process does
    if server == "bare":
        uvloop.install()

        async def run() -> None:
            loop = asyncio.get_running_loop()
            listening = await loop.create_server(_BareProtocol, "127.0.0.1", port)
            await listening.serve_forever()

        asyncio.run(run())
        return
    http: Any = protocol_factory(HttpTimeouts()) if server == "gateway" else "httptools"
    uvicorn.Server(
        uvicorn.Config(
            _asgi_app,
            host="127.0.0.1",
            port=port,
            loop="uvloop",
            http=http,
            ws="none",
            lifespan="on",
            access_log=False,
            proxy_headers=False,
            log_level="warning",
        )
    ).run()


def measure(server: str, connections: int, seconds: int) -> tuple[float, float]:
    """(requests/s, server CPU us a request) of one wrk window against a fresh `server`."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.http_floor", "--serve", server, "--port", str(port)],
        preexec_fn=child_preexec,
    )
    try:
        _wait_for_port(port)
        url = f"http://127.0.0.1:{port}"
        run_wrk(url, "m", connections, 1)  # warm-up
        before = process_cpu_seconds(process.pid)
        load = run_wrk(url, "m", connections, seconds)
        used = process_cpu_seconds(process.pid) - before
        if load.errors:
            raise RuntimeError(f"{server}: {load.errors} errors")
        return load.rps, 1e6 * used / load.requests
    finally:
        process.terminate()
        process.wait(10)


def _wait_for_port(port: int, timeout_s: float = 20.0) -> None:
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"no server on port {port} after {timeout_s} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--seconds", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument("--serve", choices=SERVERS, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port)
        return
    if not wrk_available():
        raise SystemExit("bench.http_floor needs wrk on PATH")
    servers = args.servers.split(",")
    for round_ in range(1, args.rounds + 1):
        shift = (round_ - 1) % len(servers)
        for server in servers[shift:] + servers[:shift]:
            rps, us = measure(server, args.connections, args.seconds)
            print(f"round {round_} {server:8} {rps:8.0f} req/s  {us:5.1f} us/req", flush=True)


if __name__ == "__main__":
    main()
