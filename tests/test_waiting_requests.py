"""The gateway's sweep over waiting requests: deadlines, and clients that left.

Under uvicorn a long-waiting request's client is checked through its request cycle's
`disconnected` flag (no task per request); under a server without one, a task reads the
connection. Both must fail the request's future with ClientGone once the client is gone, and
neither may touch a request younger than the watch delay. (The same through a real gateway and
real clients: tests/test_cancellation.py.)
"""

from __future__ import annotations

import asyncio
import time

import pytest

from shoal.gateway.streaming import ClientGone, WaitingRequests


class _Cycle:
    """Shaped as uvicorn's RequestResponseCycle: `receive` is bound to it."""

    def __init__(self) -> None:
        self.disconnected = False
        self.reads = 0

    async def receive(self) -> dict:
        self.reads += 1
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}


def test_a_flagged_disconnect_fails_the_future_without_reading_the_connection():
    async def run() -> None:
        waiting = WaitingRequests(watch_after_s=0.5)
        cycle, future = _Cycle(), asyncio.get_running_loop().create_future()
        waiting.add(future, cycle.receive, timeout_s=60)
        now = time.monotonic()
        cycle.disconnected = True
        waiting.sweep(now + 0.1)  # younger than the watch delay: left alone
        assert not future.done()
        waiting.sweep(now + 1.0)
        with pytest.raises(ClientGone):
            await asyncio.wait_for(future, 2)
        assert cycle.reads == 0  # the flag, not a task reading the connection
        waiting.remove(future)
        waiting.stop()

    asyncio.run(run())


def test_a_connected_client_keeps_its_request_and_the_deadline_still_applies():
    async def run() -> None:
        waiting = WaitingRequests(watch_after_s=0.5)
        cycle, future = _Cycle(), asyncio.get_running_loop().create_future()
        waiting.add(future, cycle.receive, timeout_s=5)
        now = time.monotonic()
        for offset in (1.0, 2.0, 3.0):  # looked at on every sweep, still connected
            waiting.sweep(now + offset)
        assert not future.done() and cycle.reads == 0
        waiting.sweep(now + 6.0)
        with pytest.raises(TimeoutError):
            await future
        waiting.stop()

    asyncio.run(run())


def test_without_a_flag_a_task_reads_the_connection():
    async def run() -> None:
        waiting = WaitingRequests(watch_after_s=0.5)
        gone = asyncio.Event()

        async def receive() -> dict:
            await gone.wait()
            return {"type": "http.disconnect"}

        future = asyncio.get_running_loop().create_future()
        waiting.add(future, receive, timeout_s=60)
        waiting.sweep(time.monotonic() + 1.0)
        await asyncio.sleep(0)
        assert not future.done()
        gone.set()
        with pytest.raises(ClientGone):
            await asyncio.wait_for(future, 5)
        waiting.remove(future)
        waiting.stop()

    asyncio.run(run())
