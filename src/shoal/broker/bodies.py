"""Request bodies too large for a work message travel beside the queue, in an object store.

NATS refuses messages over the server's `max_payload` (1 MB by default, an external
cluster's usual setting), but a request may be up to the gateway's body limit (4 MiB). The
gateway stores such a body in the JetStream object store `shoal_bodies` (which chunks it
into messages that fit) under the request's id and queues the request with that key instead
of the body; the worker that takes the request reads the body back and deletes it once the
request is answered. A body whose request is never answered (its worker died, the request
went to the dead-letter stream) expires after `BODIES_TTL_S`.

Only large requests pay for this: everything at or under `INLINE_BODY_BYTES` travels inside
its work message as before.
"""

from __future__ import annotations

import contextlib

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import ObjectStoreConfig
from nats.js.object_store import ObjectStore

from shoal.broker.cluster import stream_replicas

BODIES_BUCKET = "shoal_bodies"
# Longer than any request waits (its deadline) plus its redeliveries and a DLQ replay soon
# after; past it an unanswered body is removed by JetStream.
BODIES_TTL_S = 3600.0
# A body larger than this goes to the object store: the work envelope (whose size the
# gateway's group commit also bounds by this) then stays far under a 1 MB `max_payload`.
INLINE_BODY_BYTES = 256 * 1024


class BodyMissingError(LookupError):
    """A stored body is gone (expired, or deleted after an earlier answer)."""


class BodyStore:
    """The object store of large request bodies, opened (or made) on first use."""

    def __init__(self, js: JetStreamContext) -> None:
        self._js = js
        self._store: ObjectStore | None = None

    async def _bucket(self) -> ObjectStore:
        if self._store is None:
            self._store = await _ensure_store(self._js)
        return self._store

    async def put(self, key: str, body: bytes) -> None:
        """Store `body` under `key` (a request id); raises on a NATS error."""
        store = await self._bucket()
        await store.put(key, body)

    async def get(self, key: str) -> bytes:
        """The body stored under `key`; BodyMissingError if there is none."""
        store = await self._bucket()
        try:
            result = await store.get(key)
        except (nats.js.errors.ObjectNotFoundError, nats.js.errors.ObjectDeletedError) as err:
            raise BodyMissingError(key) from err
        return result.data or b""

    async def delete(self, key: str) -> None:
        """Remove the body under `key`, if it is still there."""
        store = await self._bucket()
        with contextlib.suppress(
            nats.js.errors.ObjectNotFoundError, nats.js.errors.ObjectDeletedError
        ):
            await store.delete(key)


async def _ensure_store(js: JetStreamContext) -> ObjectStore:
    try:
        return await js.object_store(BODIES_BUCKET)
    except nats.js.errors.BucketNotFoundError:
        pass
    try:
        replicas = stream_replicas(js)
        config = ObjectStoreConfig(bucket=BODIES_BUCKET, ttl=BODIES_TTL_S, replicas=replicas)
        return await js.create_object_store(BODIES_BUCKET, config)
    except nats.js.errors.BadRequestError:  # another component created it meanwhile
        return await js.object_store(BODIES_BUCKET)
