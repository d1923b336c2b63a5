"""The admin API's request and response shapes (`/admin/models`)."""

from __future__ import annotations

from typing import Any

import msgspec

from shoal.api.errors import invalid_body


class DeployRequest(msgspec.Struct, forbid_unknown_fields=True):
    """`PUT /admin/models/{name}`: a built-in name needs no fields."""

    runtime: str | None = None
    source: str | None = None
    task: str | None = None
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    base: str | None = None  # with lora: a LoRA adapter directory on this deployment
    lora: str | None = None


class Deleted(msgspec.Struct):
    """`DELETE /admin/models/{name}`."""

    id: str
    object: str = "model"
    deleted: bool = True


class AdminList(msgspec.Struct):
    """`GET /admin/models`: one entry per deployment (`shoal.state.fleet.ModelView`)."""

    data: list[Any]
    object: str = "list"


_decode_deploy = msgspec.json.Decoder(DeployRequest).decode


def parse_deploy_request(body: bytes) -> DeployRequest:
    """Decode a deploy call's body (empty: all defaults); ApiError(400) when it is invalid."""
    try:
        return _decode_deploy(body or b"{}")
    except (msgspec.ValidationError, msgspec.DecodeError) as err:
        raise invalid_body(err) from None
