"""Cancels leave the gateway together: one message per model for a turn's cancels.

The publish here records what would go to NATS; the same path through a real gateway, real
NATS and a real worker is tests/test_cancellation.py (2,000 abandoned requests, each
dropped before it runs).
"""

from __future__ import annotations

import asyncio

from shoal.gateway.cancels import IDS_PER_MESSAGE, CancelSender
from shoal.protocol import cancel_subject, decode_cancels, encode_cancels


def _sent_by_turns(turns: list[list[tuple[str, str]]]) -> list[tuple[str, list[str]]]:
    """Cancels raised turn by turn; the messages published, decoded."""
    sent: list[tuple[str, list[str]]] = []

    async def publish(subject: str, body: bytes) -> None:
        sent.append((subject, decode_cancels(body)))

    async def run() -> None:
        sender = CancelSender(publish)
        for turn in turns:
            for model, request_id in turn:
                sender.cancel(model, request_id)
            for _ in range(3):  # the turn ends; its messages are sent
                await asyncio.sleep(0)

    asyncio.run(run())
    return sent


def test_a_turns_cancels_go_out_as_one_message_per_model():
    burst = [("a", f"r{i}") for i in range(50)] + [("b", "x1"), ("a", "r50"), ("b", "x2")]
    sent = _sent_by_turns([burst, [("a", "late")]])
    assert sent == [
        (cancel_subject("a"), [f"r{i}" for i in range(51)]),
        (cancel_subject("b"), ["x1", "x2"]),
        (cancel_subject("a"), ["late"]),  # a later turn: a message of its own
    ]


def test_a_large_burst_is_cut_into_messages_of_bounded_size():
    ids = [f"{i:032x}" for i in range(2 * IDS_PER_MESSAGE + 5)]
    sent = _sent_by_turns([[("m", request_id) for request_id in ids]])
    assert [len(batch) for _, batch in sent] == [IDS_PER_MESSAGE, IDS_PER_MESSAGE, 5]
    assert [request_id for _, batch in sent for request_id in batch] == ids
    assert len(encode_cancels(ids[:IDS_PER_MESSAGE])) < 64 * 1024


def test_one_id_reads_as_before():
    # A cancel of one id is the id itself, as gateways sent before cancels were grouped.
    assert encode_cancels(["request-1"]) == b"request-1"
    assert decode_cancels(b"request-1") == ["request-1"]
    assert decode_cancels(b"") == []
