"""The admin API's dead-letter routes: the same operations as `shoal dlq`.

    GET    /admin/dlq                 the entries, oldest first (without request bodies)
    GET    /admin/dlq/{seq}           one entry, with its headers and request bodies
    POST   /admin/dlq/{seq}/replay    put it back on its work queue (fresh deadlines)
    DELETE /admin/dlq/{seq}           delete one entry
    DELETE /admin/dlq                 delete every entry

The admin token is checked by the caller (gateway/admin.py). Errors are OpenAI-shaped: a
sequence that is not a number is a 400, one with no entry a 404.
"""

from __future__ import annotations

import msgspec
from nats.js import JetStreamContext

from shoal.api.errors import ApiError
from shoal.broker.dlq import (
    DeadLetter,
    DeadLetterError,
    get_dead_letter,
    list_dead_letters,
    purge,
    replay,
)
from shoal.protocol import encode_json

DLQ_PREFIX = "/admin/dlq"


class DeadLetterList(msgspec.Struct):
    data: list[DeadLetter]
    object: str = "list"


class Replayed(msgspec.Struct):
    replayed: int  # the DLQ sequence
    work_seq: int  # where it now is in the work stream


class Purged(msgspec.Struct):
    purged: int


def is_dlq_path(path: str) -> bool:
    return path == DLQ_PREFIX or path.startswith(DLQ_PREFIX + "/")


async def handle_dlq_admin(method: str, path: str, js: JetStreamContext) -> tuple[int, bytes]:
    """Run one dead-letter admin call; returns (status, JSON body)."""
    parts = [part for part in path.removeprefix(DLQ_PREFIX).split("/") if part]
    try:
        if not parts:
            if method == "GET":
                return 200, encode_json(DeadLetterList(await list_dead_letters(js)))
            if method == "DELETE":
                return 200, encode_json(Purged(await purge(js)))
        elif len(parts) == 1:
            seq = _seq(parts[0])
            if method == "GET":
                return 200, encode_json(await get_dead_letter(js, seq))
            if method == "DELETE":
                return 200, encode_json(Purged(await purge(js, seq)))
        elif len(parts) == 2 and parts[1] == "replay":
            seq = _seq(parts[0])
            if method == "POST":
                return 200, encode_json(Replayed(seq, await replay(js, seq)))
        else:
            raise ApiError(404, f"Unknown path {path}")
    except DeadLetterError as err:
        raise ApiError(404, str(err), code="dead_letter_not_found") from None
    raise ApiError(405, f"Method {method} is not allowed on {path}")


def _seq(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise ApiError(400, f"A dead letter is named by its sequence number, not {text!r}")
    return int(text)
