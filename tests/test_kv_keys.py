"""Listing a bucket's keys leaves nothing behind on the server (real nats-server).

nats.py's `kv.keys()` leaves its watch's consumer on the server for 5 minutes; polled every
0.1 s (a test waiting for a vLLM worker to load, `shoal status --watch`), that piled up
consumers until the server refused new ones and unrelated tests failed.
"""

from __future__ import annotations

import asyncio
import time

from shoal.broker.connection import connect
from shoal.state.kv import KEYS_WATCH_INACTIVE_S, ensure_bucket, list_keys, read_all


def test_listing_keys_leaves_no_consumer_behind(nats_server):
    async def run() -> tuple[list[str], list[str], int, int]:
        nc = await connect(nats_server.url, name="test")
        try:
            js = nc.jetstream()
            kv = await ensure_bucket(js, "test_list_keys")
            empty = await list_keys(await ensure_bucket(js, "test_list_keys_empty"))
            await kv.put("a", b"1")
            await kv.put("b", b"2")
            for _ in range(20):
                await read_all(kv, bytes)
            keys = await list_keys(kv)
            just_after = (await js.stream_info("KV_test_list_keys")).state.consumer_count
            await asyncio.sleep(KEYS_WATCH_INACTIVE_S + 3)
            later = (await js.stream_info("KV_test_list_keys")).state.consumer_count
            return sorted(keys), empty, just_after, later
        finally:
            await nc.close()

    started = time.monotonic()
    keys, empty, just_after, later = asyncio.run(run())
    assert keys == ["a", "b"] and empty == []
    assert just_after >= 1  # the listings' consumers exist for a moment ...
    assert later == 0, f"{later} consumers left {time.monotonic() - started:.0f} s later"


def test_a_key_written_just_before_a_listing_is_in_it(nats_server):
    """nats.py's watch can say "all seen" before the first entry has been read: the listing
    missed a key written just before it ~30 times in 1,000 (the CLI test of `shoal keys
    list` failed so once in the suite). Deleted keys stay out."""

    async def run() -> list[tuple[int, list[str]]]:
        nc = await connect(nats_server.url, name="test")
        try:
            kv = await ensure_bucket(nc.jetstream(), "test_list_race")
            await kv.put("gone", b"x")
            await kv.delete("gone")
            wrong = []
            for i in range(300):
                await kv.put(f"k{i}", b"x" * 100)
                keys = await list_keys(kv)
                if sorted(keys) != sorted(f"k{n}" for n in range(i + 1)):
                    wrong.append((i, keys))
            return wrong
        finally:
            await nc.close()

    assert asyncio.run(run()) == []
