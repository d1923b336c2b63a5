"""What every bucket module shares: making a bucket, reading all of its values, following a
watch."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TypeVar

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.kv import KeyValue

from shoal.broker.cluster import report_replicas, stream_replicas

T = TypeVar("T")

log = logging.getLogger(__name__)

_DELETE_OPS = frozenset({"DEL", "PURGE"})
# How long the server keeps a finished key listing's consumer (it has no subscriber by then).
KEYS_WATCH_INACTIVE_S = 5.0
# How long a key listing waits for the next of the entries the bucket held when it began.
_NEXT_ENTRY_TIMEOUT_S = 5.0


async def ensure_bucket(js: JetStreamContext, bucket: str, ttl_s: float | None = None) -> KeyValue:
    """The bucket, created if it is missing (whoever creates it first sets its TTL), replicated
    as the cluster allows; an existing one with fewer replicas is kept and reported."""
    wanted = stream_replicas(js)
    try:
        kv = await js.key_value(bucket)
    except nats.js.errors.BucketNotFoundError:
        pass
    else:
        if wanted > 1:  # on one server nothing can have fewer
            replicas = (await kv.status()).stream_info.config.num_replicas or 1
            report_replicas(f"bucket {bucket}", replicas, wanted)
        return kv
    config = KeyValueConfig(bucket=bucket, history=1, ttl=ttl_s, replicas=wanted)
    try:
        return await js.create_key_value(config)
    except nats.js.errors.BadRequestError:  # another component created it meanwhile
        return await js.key_value(bucket)


async def read_value(kv: KeyValue, key: str, decode: Callable[[bytes], T]) -> T | None:
    """The decoded value of a key; None when it is missing or empty (a claim, a delete)."""
    try:
        entry = await kv.get(key)
    except nats.js.errors.KeyNotFoundError:
        return None
    return decode(entry.value) if entry.value else None


async def list_keys(kv: KeyValue) -> list[str]:
    """Every key in the bucket (none: an empty list).

    Not nats.py's `kv.keys()`: its watch's consumer stays on the server for 5 minutes after the
    call returns, so a caller that polls (`shoal status --watch`, a test waiting for a worker)
    piles up hundreds of them until the server refuses new consumers ("maximum consumers
    limit reached", seen in the test suite). This one is dropped seconds after it is done.

    Nor its "all seen" marker: nats.py puts it first when the consumer has nothing pending
    and the client has not yet read a message, which is also the case while the bucket's
    entries are on their way, so a key written just before was missing about 1 time in 300
    (`shoal keys list` in the test suite). The listing ends at the entry delivered with
    nothing pending after it instead, and the bucket's message count says when there is none.
    """
    if (await kv.status()).values == 0:
        return []
    watcher = await kv.watchall(meta_only=True, inactive_threshold=KEYS_WATCH_INACTIVE_S)
    keys = []
    try:
        while True:
            try:
                entry = await watcher.updates(timeout=_NEXT_ENTRY_TIMEOUT_S)
            except nats.errors.TimeoutError:
                break  # the entries counted expired meanwhile (a bucket with a TTL)
            if entry is None:
                continue  # the marker, possibly early
            if entry.operation not in _DELETE_OPS:
                keys.append(entry.key)
            if entry.delta == 0:
                break
    finally:
        await watcher.stop()
    return keys


async def read_all(kv: KeyValue, decode: Callable[[bytes], T]) -> list[T]:
    """Every non-empty value in the bucket, decoded (keys removed meanwhile are skipped)."""
    keys = await list_keys(kv)
    values = []
    for key in keys:
        with contextlib.suppress(nats.js.errors.KeyNotFoundError):
            value = await read_value(kv, key, decode)
            if value is not None:
                values.append(value)
    return values


def is_removal(entry: KeyValue.Entry) -> bool:
    """A watch entry that says its key is gone (deleted, purged, or emptied)."""
    return entry.operation in _DELETE_OPS or not entry.value


async def follow(
    watcher: KeyValue.KeyWatcher, on_entry: Callable[[KeyValue.Entry | None], None], what: str
) -> None:
    """Hand each update of a KV watch to `on_entry` until the watch stops: first the current
    values, then None (they have all been seen), then every change. A failed read (a
    reconnect) is logged and retried; this runs until cancelled or the watcher is stopped."""
    while True:
        try:
            entry = await watcher.updates(timeout=None)
        except asyncio.CancelledError:
            raise
        except Exception as err:
            log.debug("%s watch: %s", what, err)
            await asyncio.sleep(0.5)
            continue
        if entry is KeyValue.KeyWatcher.STOP_ITER:
            return
        on_entry(entry)
