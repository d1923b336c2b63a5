"""The partial decode: the only fields of a request body the gateway reads."""

from __future__ import annotations

import msgspec

from shoal.api.errors import ApiError


class RoutingFields(msgspec.Struct):
    """msgspec skips every other field without building objects for it."""

    model: str = ""
    stream: bool = False


_decode_routing = msgspec.json.Decoder(RoutingFields).decode


def read_routing_fields(body: bytes) -> RoutingFields:
    try:
        fields = _decode_routing(body)
    except msgspec.ValidationError as err:
        raise ApiError(400, f"Invalid request: {err}", param="model") from None
    except msgspec.DecodeError as err:
        raise ApiError(400, f"Request body is not valid JSON: {err}") from None
    if not fields.model:
        raise ApiError(400, "'model' is required", param="model")
    return fields


def estimate_tokens(body: bytes) -> int:
    """A cost estimate for batch forming at the worker: about four bytes a token."""
    return max(1, len(body) // 4)
