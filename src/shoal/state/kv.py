"""What every bucket module shares: making a bucket, reading all of its values, following a
watch."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TypeVar

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.kv import KeyValue

from shoal.broker.cluster import report_replicas, stream_replicas

T = TypeVar("T")

log = logging.getLogger(__name__)

_DELETE_OPS = frozenset({"DEL", "PURGE"})


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
    except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
        return None
    return decode(entry.value) if entry.value else None


async def list_keys(kv: KeyValue) -> list[str]:
    """Every key with a message in the bucket: a deleted key's marker counts (`read_value`
    reads it as None).

    From the stream's subjects, one request, a snapshot. Not a watch: nats.py's `kv.keys()`
    leaves its consumer on the server for 5 minutes (a caller that polls piled up hundreds,
    until the server refused new consumers), its "all seen" marker can come before the first
    entry has been read (a key written just before was missing 30 times in 1,000), and with
    one value a key, a key rewritten while the watch reads loses the message the watch was
    about to deliver (16 keys rewritten every 10 ms: listings of 10 to 16)."""
    # nats.py's KeyValue keeps its JetStream context, stream and key prefix private.
    info = await kv._js.stream_info(kv._stream, subjects_filter=f"{kv._pre}>")
    prefix = len(kv._pre)
    return [subject[prefix:] for subject in (info.state.subjects or {})]


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
