"""The gateway's waiting requests: deadlines, and clients that left.

Under uvicorn the gateway's protocol tells a waiting request at once when its connection is
lost (no polling, no task per request); under a server without that hook, a task reads the
connection of a request that waited long. Both must fail the request's future with
ClientGone once the client is gone. (The same through a real gateway and real clients:
tests/test_cancellation.py.)
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import uvicorn
from uvicorn.server import ServerState

from shoal.config import HttpTimeouts
from shoal.gateway.http_protocol import Exchange, protocol_factory
from shoal.gateway.streaming import ClientGone, WaitingRequests

_REQUEST = b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"


class _Transport:
    """A connection's transport as the protocol uses it (nothing is written in these tests)."""

    def __init__(self) -> None:
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 50000)}.get(name)

    def write(self, data: bytes) -> None:
        pass

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def _waiting_request(waiting: WaitingRequests, timeout_s: float = 60):
    """The gateway's own protocol with one request in: its app adds the request to `waiting`
    and awaits its future. Returns (protocol, future, the request's receive)."""
    added: asyncio.Queue = asyncio.Queue()

    async def app(scope, receive, send) -> None:
        future = asyncio.get_running_loop().create_future()
        waiting.add(future, receive, timeout_s)
        await added.put((future, receive))
        try:
            await future
        except (ClientGone, TimeoutError):
            pass
        finally:
            waiting.remove(future)

    config = uvicorn.Config(app, http=protocol_factory(HttpTimeouts()), lifespan="off")
    config.load()
    protocol = config.http_protocol_class(config=config, server_state=ServerState(), app_state={})
    protocol.connection_made(_Transport())
    protocol.data_received(_REQUEST)
    future, receive = await asyncio.wait_for(added.get(), 5)
    return protocol, future, receive


def test_a_lost_connection_fails_its_waiting_request_at_once():
    async def run() -> None:
        waiting = WaitingRequests(watch_after_s=60)  # no sweep will look in time
        protocol, future, receive = await _waiting_request(waiting)
        assert isinstance(receive.__self__, Exchange)
        await asyncio.sleep(0.01)
        assert not future.done()
        protocol.connection_lost(None)
        assert future.done()  # told by the protocol, not found by a sweep
        with pytest.raises(ClientGone):
            future.result()
        await asyncio.sleep(0)  # the app's `finally` drops the request and the hook
        assert receive.__self__.on_lost is None
        waiting.stop()

    asyncio.run(run())


def test_a_connected_client_keeps_its_request_and_the_deadline_still_applies():
    async def run() -> None:
        waiting = WaitingRequests(watch_after_s=0.5)
        _, future, _ = await _waiting_request(waiting, timeout_s=5)
        now = time.monotonic()
        for offset in (1.0, 2.0, 3.0):  # swept past the watch delay, still connected
            waiting.sweep(now + offset)
        assert not future.done()
        waiting.sweep(now + 6.0)
        with pytest.raises(TimeoutError):
            future.result()
        waiting.stop()

    asyncio.run(run())


def test_a_request_gone_before_it_waits_fails_at_once():
    async def run() -> None:
        waiting = WaitingRequests(watch_after_s=60)
        protocol, first, receive = await _waiting_request(waiting)
        waiting.remove(first)
        protocol.connection_lost(None)  # gone while the app had not yet added it
        future = asyncio.get_running_loop().create_future()
        waiting.add(future, receive, timeout_s=60)
        with pytest.raises(ClientGone):
            future.result()
        waiting.remove(future)
        waiting.stop()

    asyncio.run(run())


def test_without_a_hook_a_task_reads_the_connection():
    async def run() -> None:
        waiting = WaitingRequests(watch_after_s=0.5)
        gone = asyncio.Event()

        async def receive() -> dict:
            await gone.wait()
            return {"type": "http.disconnect"}

        future = asyncio.get_running_loop().create_future()
        waiting.add(future, receive, timeout_s=60)
        waiting.sweep(time.monotonic() + 0.1)  # younger than the watch delay: left alone
        await asyncio.sleep(0)
        assert not future.done()
        waiting.sweep(time.monotonic() + 1.0)
        await asyncio.sleep(0)
        assert not future.done()
        gone.set()
        with pytest.raises(ClientGone):
            await asyncio.wait_for(future, 5)
        waiting.remove(future)
        waiting.stop()

    asyncio.run(run())
