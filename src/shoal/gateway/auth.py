"""API keys on the inference routes: `Authorization: Bearer sk-shoal-<id>-<random>`.

Checking a request costs one header scan, one dict lookup by the id in the secret, one
SHA-256 of the secret and one `hmac.compare_digest`, against keys held in memory and kept
current by a KV watch (state/keys.py): no NATS round trip per request, and a revoke reaches
every gateway within milliseconds.

Errors come as OpenAI gives them: 401 `invalid_api_key` for a missing, wrong or revoked key;
404 `model_not_found` ("does not exist or you do not have access to it") for a model outside
the key's allowlist, which OpenAI also answers with a 404, so a key learns nothing about
models it may not use.

When keys are required (`api_keys_required`): `"auto"` requires them unless the gateway
listens on a loopback address only; `"required"` always; `"off"` never (`--no-auth`). The
existence of keys never switches checking on or off: creating the first key must not lock
out a running loopback cluster's clients unannounced, and revoking the last key must never
open the door.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging

from nats.js import JetStreamContext

from shoal.api.errors import ApiError
from shoal.config import API_KEY_MODES
from shoal.gateway.routing import request_header
from shoal.protocol import ModelSpec
from shoal.state.keys import KeyDirectory, hash_secret, key_id_of

log = logging.getLogger(__name__)

_BEARER = b"bearer "
_MAX_SECRET_BYTES = 256  # a real secret is 65 bytes; longer is not one of ours, unhashed
# Compared against when the id is unknown, so an unknown id costs what a wrong secret does.
_DUMMY_DIGEST = bytes.fromhex(hash_secret("sk-shoal-000000000000-unknown"))


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (or `localhost`); a name or `0.0.0.0` is not."""
    host = host.strip().strip("[]")
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False  # a host name may resolve to any interface: treat it as reachable
    mapped = getattr(address, "ipv4_mapped", None)
    return bool(address.is_loopback or (mapped is not None and mapped.is_loopback))


def api_keys_required(mode: str, host: str) -> bool:
    """Whether a gateway listening on `host` checks API keys, for mode auto|required|off."""
    if mode == "required":
        return True
    if mode == "off":
        return False
    if mode == "auto":
        return not is_loopback(host)
    raise ValueError(f"API key mode {mode!r} is not one of {', '.join(API_KEY_MODES)}")


def auth_for(mode: str, host: str) -> ApiKeyAuth | None:
    """The gateway's key check for its settings, or None when keys are not checked."""
    if api_keys_required(mode, host):
        return ApiKeyAuth()
    if not is_loopback(host):
        log.warning(
            "API keys are off (--no-auth) on %s: anyone who can reach the gateway may use "
            "every model",
            host or "every address",
        )
    return None


class ApiKeyAuth:
    """Checks inference requests against the keys of the `shoal_keys` bucket."""

    def __init__(self, directory: KeyDirectory | None = None) -> None:
        self.directory = directory if directory is not None else KeyDirectory()

    async def start(self, js: JetStreamContext) -> None:
        """Follow the keys bucket; returns once its current keys are held."""
        await self.directory.start(js)
        await self.directory.loaded.wait()
        if self.directory.active_count() == 0:
            log.warning(
                "API keys are required and none exists: every inference request gets 401 "
                "until one is made with `shoal keys create --name NAME`"
            )

    async def stop(self) -> None:
        await self.directory.stop()

    def authenticate(self, headers: list[tuple[bytes, bytes]]) -> str:
        """The id of the valid key the request carries; ApiError 401 (or 503) otherwise.

        Needs only the headers, so a request without a valid key is refused before its
        body is read or parsed.
        """
        if not self.directory.loaded.is_set():
            # Keys not read yet: a 401 would tell a valid key it is wrong.
            raise ApiError(503, "The API keys are not loaded yet", retry_after=1)
        secret = bearer_token(headers)
        if not secret:
            raise ApiError(
                401,
                "You didn't provide an API key: send it as 'Authorization: Bearer sk-shoal-...' "
                "(an operator makes one with `shoal keys create`)",
                code="invalid_api_key",
            )
        key_id = key_id_of(secret) if len(secret) <= _MAX_SECRET_BYTES else None
        held = self.directory.lookup(key_id) if key_id is not None else None
        digest = hashlib.sha256(secret).digest()
        expected = held[1] if held is not None else _DUMMY_DIGEST
        if not hmac.compare_digest(digest, expected) or held is None:
            raise ApiError(401, "Incorrect API key provided", code="invalid_api_key")
        if held[0].revoked:  # said only to whoever holds the whole secret
            raise ApiError(401, "This API key has been revoked", code="invalid_api_key")
        return held[0].id

    def authorize(self, key_id: str, model: str) -> None:
        """ApiError 404 unless the key (from `authenticate`) may use `model`."""
        held = self.directory.lookup(key_id)
        if held is None or held[0].revoked:  # revoked between the two calls
            raise ApiError(401, "This API key has been revoked", code="invalid_api_key")
        allowed = held[2]
        if allowed and model not in allowed:
            raise ApiError(
                404,
                f"The model '{model}' does not exist or you do not have access to it",
                param="model",
                code="model_not_found",
            )

    def check(self, headers: list[tuple[bytes, bytes]], model: str) -> None:
        """`authenticate` then `authorize`: ApiError 401/404/503 unless the request may go."""
        self.authorize(self.authenticate(headers), model)

    def visible(self, key_id: str, specs: list[ModelSpec]) -> list[ModelSpec]:
        """The deployments a key may use, for /v1/models."""
        held = self.directory.lookup(key_id)
        if held is None:
            return []
        allowed = held[2]
        return [spec for spec in specs if not allowed or spec.name in allowed]


def bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes:
    """The token of the first `Authorization: Bearer` header (the scheme in any case); b""
    when there is none."""
    value = request_header(headers, b"authorization")
    if value is None or value[:7].lower() != _BEARER:
        return b""
    return value[7:].strip()
