"""API keys for the inference routes, as keys of the `shoal_keys` KV bucket.

Bucket `shoal_keys`, key `<key id>`, value an `ApiKey` (JSON). A key's secret is
`sk-shoal-<id>-<random>`: `create_key` returns it once and stores only its SHA-256. The id in
the secret is what makes checking a request cheap: one dict lookup by id, one hash, one
constant-time comparison, whatever the number of keys.

Why a plain SHA-256 and not a salted or slow hash: the random part is 256 bits from
`secrets`, so the bucket's hashes give an attacker nothing to brute-force (salts and slow
hashes protect low-entropy passwords against tables and guessing; a 2^256 search is out of
reach at any hash speed). A slow hash would cost milliseconds on every request; a keyed hash
(a server-side pepper) would be one more secret to hand to every gateway, for no gain with
secrets this strong. Anyone who can write the bucket can add a key of their own anyway:
protecting the bucket is the job of NATS permissions (gateways read it, only operators write).

Revoking keeps the record (`revoked`, `revoked_ms`) so `shoal keys list` shows what was
revoked and when; every gateway follows the bucket with a `KeyDirectory` (a KV watch), so a
revoke takes effect everywhere within milliseconds.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import secrets

import msgspec
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from shoal.protocol import encode_json, is_valid_model_name, now_ms
from shoal.state.kv import ensure_bucket, follow, is_removal, read_all, read_value

log = logging.getLogger(__name__)

KEYS_BUCKET = "shoal_keys"
SECRET_PREFIX = "sk-shoal-"

_ID_BYTES = 6  # 12 hex digits: ids are not secret, only unique (create retries a collision)
_SECRET_BYTES = 32  # 256 bits of randomness in every secret
_VALID_ID = re.compile(r"^[0-9a-f]{12}$")
_VALID_NAME = re.compile(r"^[\w.@:/ -]{1,128}$")


class ApiKeyError(ValueError):
    """A key operation that cannot be done: the message says why; nothing was written."""


class ApiKey(msgspec.Struct, kw_only=True):
    """One API key as stored: never its secret, only the secret's SHA-256 (hex)."""

    id: str
    name: str
    hash: str
    created_ms: int
    revoked: bool = False
    revoked_ms: int = 0
    # The models this key may use, by deployment name; empty: every model.
    models: tuple[str, ...] = ()

    def allows(self, model: str) -> bool:
        return not self.models or model in self.models


_decode_key = msgspec.json.Decoder(ApiKey).decode


def hash_secret(secret: str | bytes) -> str:
    """The stored form of a secret: SHA-256, hex."""
    return hashlib.sha256(secret.encode() if isinstance(secret, str) else secret).hexdigest()


def key_id_of(secret: str | bytes) -> str | None:
    """The id inside a secret `sk-shoal-<id>-<random>`, or None if it has not that form."""
    text = secret.decode("ascii", "replace") if isinstance(secret, bytes) else secret
    if not text.startswith(SECRET_PREFIX):
        return None
    key_id, sep, rest = text.removeprefix(SECRET_PREFIX).partition("-")
    if not sep or not rest or not _VALID_ID.match(key_id):
        return None
    return key_id


async def ensure_keys_kv(js: JetStreamContext) -> KeyValue:
    """The keys bucket: key id -> ApiKey (JSON)."""
    return await ensure_bucket(js, KEYS_BUCKET)


async def create_key(
    js: JetStreamContext, name: str, models: tuple[str, ...] | list[str] = ()
) -> tuple[ApiKey, str]:
    """Make a key; returns its record and its secret, the only time the secret is seen."""
    if not _VALID_NAME.match(name):
        raise ApiKeyError(f"invalid key name {name!r}: letters, digits, space and ._@:/-")
    models = tuple(dict.fromkeys(models))  # in order, once each
    bad = [m for m in models if not is_valid_model_name(m)]
    if bad:
        raise ApiKeyError(f"invalid model name {bad[0]!r}")
    kv = await ensure_keys_kv(js)
    for _ in range(5):
        key_id = secrets.token_hex(_ID_BYTES)
        secret = f"{SECRET_PREFIX}{key_id}-{secrets.token_urlsafe(_SECRET_BYTES)}"
        record = ApiKey(
            id=key_id, name=name, hash=hash_secret(secret), created_ms=now_ms(), models=models
        )
        try:
            # create, not put: two keys never share an id, even if two operators race.
            await kv.create(key_id, encode_json(record))
        except nats.js.errors.KeyWrongLastSequenceError:
            continue
        return record, secret
    raise ApiKeyError("could not find a free key id")  # 5 collisions in 2^48: not in practice


async def list_keys(js: JetStreamContext) -> list[ApiKey]:
    """Every readable key, revoked ones included, oldest first."""
    keys = await read_all(await ensure_keys_kv(js), _decode_or_skip)
    return sorted((k for k in keys if k is not None), key=lambda k: (k.created_ms, k.id))


def _decode_or_skip(value: bytes) -> ApiKey | None:
    # An unreadable record (written by hand, or by a newer version) must not break listing;
    # gateways ignore it too (KeyDirectory), so it authorizes nothing.
    try:
        return _decode_key(value)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        log.warning("skipping an unreadable API key record: %s", err)
        return None


async def read_key(js: JetStreamContext, key_id: str) -> ApiKey | None:
    if not _VALID_ID.match(key_id):
        return None
    return await read_value(await ensure_keys_kv(js), key_id, _decode_or_skip)


async def revoke_key(js: JetStreamContext, key_id: str) -> ApiKey:
    """Revoke a key by id; returns the revoked record. Revoking twice is not an error."""
    kv = await ensure_keys_kv(js)
    for _ in range(5):
        try:
            entry = await kv.get(key_id) if _VALID_ID.match(key_id) else None
        except nats.js.errors.KeyNotFoundError:
            entry = None
        if entry is None or not entry.value:
            raise ApiKeyError(f"no API key with id {key_id!r} (see `shoal keys list`)")
        try:
            record = _decode_key(entry.value)
        except (msgspec.DecodeError, msgspec.ValidationError):
            raise ApiKeyError(
                f"the record of key {key_id!r} is unreadable: no gateway accepts it already"
            ) from None
        if record.revoked:
            return record
        record.revoked, record.revoked_ms = True, now_ms()
        try:
            # update at the read revision: a concurrent change is retried, never overwritten.
            await kv.update(key_id, encode_json(record), last=entry.revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            continue
        return record
    raise ApiKeyError(f"key {key_id!r} kept changing while being revoked; try again")


class _Held(msgspec.Struct):
    """A key as a gateway holds it: its digest as bytes and its allowlist as a set."""

    key: ApiKey
    digest: bytes
    models: frozenset[str]


class KeyDirectory:
    """The API keys, kept current by watching the KV bucket (as `ModelDirectory` does)."""

    def __init__(self) -> None:
        self._keys: dict[str, _Held] = {}
        self.loaded = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def get(self, key_id: str) -> ApiKey | None:
        held = self._keys.get(key_id)
        return held.key if held is not None else None

    def lookup(self, key_id: str) -> tuple[ApiKey, bytes, frozenset[str]] | None:
        """The key, its SHA-256 digest (bytes) and its allowlist: what a check needs."""
        held = self._keys.get(key_id)
        return (held.key, held.digest, held.models) if held is not None else None

    def active_count(self) -> int:
        return sum(1 for held in self._keys.values() if not held.key.revoked)

    async def start(self, js: JetStreamContext) -> None:
        """Follow the bucket; `loaded` is set once its current keys have all been read."""
        watcher = await (await ensure_keys_kv(js)).watchall()
        if self._task is not None:  # a retried start: one watch, not two
            self._task.cancel()
        self._task = asyncio.create_task(follow(watcher, self._on_entry, "API key"))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def _apply(self, entry: KeyValue.Entry) -> None:
        key = entry.key
        if is_removal(entry):
            self._keys.pop(key, None)
            return
        try:
            record = _decode_key(entry.value)
            digest = bytes.fromhex(record.hash)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as err:
            # An unreadable record authorizes nothing: drop what was held under that key.
            self._keys.pop(key, None)
            log.warning("ignoring unreadable API key %s: %s", key, err)
            return
        if record.id != key:
            self._keys.pop(key, None)
            log.warning("ignoring API key stored under %s with id %s", key, record.id)
            return
        self._keys[key] = _Held(record, digest, frozenset(record.models))

    def _on_entry(self, entry: KeyValue.Entry | None) -> None:
        if entry is None:  # the initial values have all been seen
            self.loaded.set()
            return
        self._apply(entry)
