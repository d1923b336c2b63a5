"""Results larger than a message: cut into parts by the worker, joined by the gateway."""

from __future__ import annotations

import asyncio

from shoal.gateway.replies import ReplyRouter
from shoal.protocol import Result, decode_results
from shoal.worker.outbox import reply_messages

LIMIT = 64 * 1024


def _results(*sizes: int) -> list[Result]:
    return [Result(f"r{i}", 200, bytes([i]) * size) for i, size in enumerate(sizes)]


def test_small_results_share_one_message():
    messages = list(reply_messages(_results(100, 200, 300), LIMIT, "w1"))
    assert len(messages) == 1
    assert [r.request_id for r in decode_results(messages[0]).results] == ["r0", "r1", "r2"]


def test_every_message_fits_and_the_parts_rebuild_each_body():
    results = _results(10, 5 * LIMIT, 30_000, 40_000, 3)
    messages = list(reply_messages(results, LIMIT, "w1"))
    assert all(len(message) <= LIMIT for message in messages)
    parts = [r for message in messages for r in decode_results(message).results]
    rebuilt: dict[str, bytes] = {}
    for part in parts:
        rebuilt[part.request_id] = rebuilt.get(part.request_id, b"") + part.body
    assert rebuilt == {r.request_id: r.body for r in results}
    big = [p for p in parts if p.request_id == "r1"]
    assert [p.part for p in big] == list(range(len(big))) and len(big) >= 5
    assert [p.more for p in big] == [True] * (len(big) - 1) + [False]


def _route(router: ReplyRouter, results: list[Result], sender: str = "w1") -> None:
    for message in reply_messages(results, LIMIT, sender):
        for result in decode_results(message).results:
            router._deliver(result)


def test_the_gateway_joins_one_senders_parts_and_never_mixes_two():
    async def run() -> None:
        dropped = []
        router = ReplyRouter("reply", lambda: dropped.append(1))
        whole = Result("a", 200, bytes(range(256)) * 1000)
        future = router.expect("a")
        _route(router, [whole])
        assert (await future).body == whole.body

        # Two workers answering the same request at once: their parts interleave. The body
        # delivered is one sender's, whole: the sequence begun last.
        future = router.expect("b")
        first = list(reply_messages([Result("b", 200, b"x" * 3 * LIMIT)], LIMIT, "w1"))
        second = list(reply_messages([Result("b", 200, b"y" * 3 * LIMIT)], LIMIT, "w2"))
        assert len(first) == len(second) >= 4
        for one, other in zip(first, second, strict=True):
            router._deliver(decode_results(one).results[0])
            assert not future.done()
            router._deliver(decode_results(other).results[0])
        assert (await future).body == b"y" * 3 * LIMIT

        # A sequence cut off (its worker died) and sent again whole by another worker.
        future = router.expect("c")
        cut = list(reply_messages([Result("c", 200, b"u" * 3 * LIMIT)], LIMIT, "w1"))
        for message in cut[:2]:
            router._deliver(decode_results(message).results[0])
        _route(router, [Result("c", 200, b"v" * 3 * LIMIT)], sender="w3")
        assert (await future).body == b"v" * 3 * LIMIT

        # Parts for a request nobody waits for any more: dropped, counted once.
        _route(router, [Result("gone", 200, b"q" * 3 * LIMIT)])
        assert len(dropped) == 1

    asyncio.run(run())
