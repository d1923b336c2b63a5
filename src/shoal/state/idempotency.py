"""The `shoal_idempotency` bucket: one record per client `Idempotency-Key`, for a window.

A gateway that gets a request with an `Idempotency-Key` claims the key (a KV create, so one
request wins wherever the others arrive) with a PENDING record: a hash of the body and the
request's deadline. The worker that answers the request stores the answer in the record
(DONE), so the answer is kept even when the first gateway died meanwhile. A retry with the
same key and body, at any gateway, gets that answer without computing again; while the record
is PENDING it waits for the answer (a KV watch). A PENDING record whose deadline passed with
no answer stored was abandoned (its gateway died before publishing, or its answer was a 5xx,
which is not kept): the next retry takes it over and runs the request again.

Answers larger than a KV value can be (the server's `max_payload`) are kept in the object
store of large bodies (broker/bodies.py) under `result-<key>`, and the record says so.
"""

from __future__ import annotations

import contextlib
import hashlib
import time

import msgspec
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from shoal.broker.bodies import BodyMissingError, BodyStore
from shoal.protocol import now_ms
from shoal.state.kv import ensure_bucket

IDEMPOTENCY_BUCKET = "shoal_idempotency"
DEFAULT_WINDOW_S = 600.0
# An answer up to this size lives in the record itself; a larger one in the object store.
INLINE_ANSWER_BYTES = 256 * 1024
# A PENDING record is abandoned this long after its request's deadline with no answer.
ABANDONED_AFTER_S = 2.0
# A PENDING record not marked queued is abandoned this long after its claim.
UNQUEUED_GRACE_S = 5.0


class IdempotencyRecord(msgspec.Struct, array_like=True, frozen=True):
    """What a key holds: PENDING until an answer is stored (`done`)."""

    body_hash: str
    request_id: str
    deadline_ms: int
    done: bool = False
    status: int = 0
    body: bytes = b""
    body_stored: bool = False  # the answer is in the object store, not in `body`
    # Set once the request is on the queue. A claim whose request was never queued (its
    # gateway died, or NATS failed over between the claim and the publish) is abandoned
    # after `UNQUEUED_GRACE_S`, not at its deadline.
    queued: bool = False
    created_ms: int = 0

    def abandoned_at_ms(self) -> int:
        """When a PENDING record counts as abandoned (unix ms)."""
        if not self.queued:
            return self.created_ms + int(UNQUEUED_GRACE_S * 1000)
        return self.deadline_ms + int(ABANDONED_AFTER_S * 1000)

    def abandoned(self, now: int) -> bool:
        return not self.done and now > self.abandoned_at_ms()


class Claim(msgspec.Struct, frozen=True):
    """The outcome of claiming a key: `ours`, and the record holding it at `revision`."""

    ours: bool
    record: IdempotencyRecord
    revision: int


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(IdempotencyRecord).decode


def record_key(client_key: str, route: str, principal: str = "") -> str:
    """The bucket key for a client's key: scoped to the route and the API key that sent it,
    so two tenants choosing the same key never see each other's answers."""
    digest = hashlib.sha256(f"{principal}\0{route}\0{client_key}".encode()).hexdigest()
    return digest[:40]


def body_hash(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


async def ensure_idempotency_kv(js: JetStreamContext, window_s: float) -> KeyValue:
    """The bucket; whoever creates it sets the window (its TTL)."""
    return await ensure_bucket(js, IDEMPOTENCY_BUCKET, ttl_s=window_s)


async def open_idempotency_kv(js: JetStreamContext) -> KeyValue:
    """The bucket as a gateway made it (a worker stores answers in it, never creates it)."""
    return await js.key_value(IDEMPOTENCY_BUCKET)


async def claim(kv: KeyValue, key: str, record: IdempotencyRecord) -> Claim:
    """Claim `key` for a new request: ours (with our revision), or held by another record."""
    try:
        return Claim(True, record, await kv.create(key, _encode(record)))
    except nats.js.errors.KeyWrongLastSequenceError:
        pass
    entry = await kv.get(key)
    return Claim(False, _decode(entry.value or b""), entry.revision or 0)


async def take_over(
    kv: KeyValue, key: str, record: IdempotencyRecord, revision: int
) -> Claim | None:
    """Replace an abandoned record with a new PENDING one, unless another retry did first."""
    try:
        return Claim(True, record, await kv.update(key, _encode(record), last=revision))
    except nats.js.errors.KeyWrongLastSequenceError:
        return None


async def mark_queued(kv: KeyValue, key: str, claim: Claim) -> None:
    """Our claimed request is on the queue: it is abandoned only at its deadline now."""
    queued = msgspec.structs.replace(claim.record, queued=True)
    await kv.update(key, _encode(queued), last=claim.revision)


async def release(kv: KeyValue, key: str) -> None:
    """Give up a claim whose request was never queued (refused, or the publish failed);
    raises when NATS does not answer (the caller tries again once it is back)."""
    await kv.delete(key)


async def store_answer(
    kv: KeyValue, bodies: BodyStore, key: str, pending: IdempotencyRecord, status: int, body: bytes
) -> None:
    """Keep a request's answer under its key (called by the worker that answered it)."""
    stored = len(body) > INLINE_ANSWER_BYTES
    if stored:
        await bodies.put(f"result-{key}", body)
    done = msgspec.structs.replace(
        pending, done=True, status=status, body=b"" if stored else body, body_stored=stored
    )
    await kv.put(key, _encode(done))


async def answer_body(bodies: BodyStore, key: str, record: IdempotencyRecord) -> bytes | None:
    """The stored answer's body; None if it is gone from the object store."""
    if not record.body_stored:
        return record.body
    try:
        return await bodies.get(f"result-{key}")
    except BodyMissingError:
        return None


async def wait_for_change(
    kv: KeyValue, key: str, seen_revision: int, timeout_s: float
) -> tuple[IdempotencyRecord, int] | None:
    """The record once it changes past `seen_revision`, or None after `timeout_s` (or when
    it was deleted)."""
    deadline = time.monotonic() + timeout_s
    watcher = await kv.watch(key, include_history=False)
    try:
        while (left := deadline - time.monotonic()) > 0:
            try:
                entry = await watcher.updates(timeout=left)
            except (TimeoutError, nats.errors.TimeoutError):
                return None
            if entry is None or (entry.revision or 0) <= seen_revision:
                continue  # the "current values done" marker, or what we already saw
            if not entry.value:
                return None  # deleted: the request was never queued
            return _decode(entry.value), entry.revision or 0
        return None
    finally:
        with contextlib.suppress(Exception):
            await watcher.stop()


def pending_record(body: bytes, request_id: str, deadline_ms: int) -> IdempotencyRecord:
    return IdempotencyRecord(body_hash(body), request_id, deadline_ms, created_ms=now_ms())
