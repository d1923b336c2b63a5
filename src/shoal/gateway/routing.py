"""The partial decode: the only fields of a request (body and headers) the gateway reads.

It is also the gateway's guard against bodies that no decoder should see: JSON nested
deeper than `MAX_NESTING` levels is refused with a 400 here, before it is queued. msgspec
recurses once per level (even through the fields it skips) and raises RecursionError near
Python's recursion limit (~1000 levels less the caller's stack), so without this guard the
gateway answered a plain-text 500, and a body just shallow enough for the gateway could still
fail in a worker, whose stack at its decode is deeper or shallower than the gateway's.
"""

from __future__ import annotations

import re
from array import array
from itertools import accumulate

import msgspec

from shoal.api.errors import ApiError

# Deepest nesting of arrays and objects a request may have. serde_json's default; OpenAI
# bodies nest 3-5 levels (chat content parts), JSON schemas in `tools` a few tens at most,
# and it stays far below what msgspec can decode anywhere (~900 levels).
MAX_NESTING = 128


def request_header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """The first value of a request header, None if absent.

    `name` lower-case: ASGI servers lower-case header names.
    """
    for key, value in headers:
        if key == name:
            return value
    return None


class RoutingFields(msgspec.Struct):
    """msgspec skips every other field without building objects for it."""

    model: str = ""
    stream: bool = False


_decode_routing = msgspec.json.Decoder(RoutingFields).decode

# A JSON string (escapes included), removed before brackets are counted.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
# Keep only brackets, then map openers to +1 and closers to -1 (as signed bytes).
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_BRACKET_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")


def read_routing_fields(body: bytes) -> RoutingFields:
    """Decode `model` and `stream` from a request body; raises ApiError(400) when it cannot."""
    try:
        fields = _decode_routing(body)
    except msgspec.ValidationError as err:
        raise ApiError(400, f"Invalid request: {err}", param="model") from None
    except msgspec.DecodeError as err:
        raise ApiError(400, f"Request body is not valid JSON: {err}") from None
    except RecursionError:
        raise _too_deep() from None
    if nesting_exceeds(body, MAX_NESTING):
        raise _too_deep()
    if not fields.model:
        raise ApiError(400, "'model' is required", param="model")
    return fields


def nesting_exceeds(body: bytes, limit: int) -> bool:
    """Whether arrays and objects in a JSON document nest deeper than `limit` levels.

    Exact for valid JSON: brackets inside strings do not count, escaped quotes do not end a
    string. A body with at most `limit` opening brackets cannot nest deeper, and counting
    them is the only work for a usual request; the exact check runs only past that count.
    """
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    structure = _STRING.sub(b"", body).translate(_BRACKET_STEPS, _NOT_BRACKETS)
    return max(accumulate(array("b", structure)), default=0) > limit


def _too_deep() -> ApiError:
    return ApiError(
        400,
        f"The request body nests arrays or objects deeper than {MAX_NESTING} levels",
        code="nesting_too_deep",
    )


def estimate_tokens(body: bytes) -> int:
    """A cost estimate for batch forming at the worker: about four bytes a token."""
    return max(1, len(body) // 4)
