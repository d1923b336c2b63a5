"""Batch profiles: the batch budget found by profiling a model on one kind of hardware.

Bucket `shoal_profiles`, key `<model token>.<runtime token>.<digest of source, options,
hardware>`, value a `BatchProfile` (JSON). An empty value is a claim: the worker that created
it is profiling now, the others wait for its result (worker/profiling.py).

Bucket `shoal_reprofiles`, same keys, entries expiring after `REPROFILE_EVERY_S`: a claim to
profile a model again because service contradicted its stored profile. While one stands, no
other worker of the fleet profiles that model again, whether the claimant is still at it,
stored its profile, or was stopped first: a re-profile costs seconds of the executor under
traffic, and every worker of a fleet timed on a busy machine would otherwise start one at
once, and workers that live shorter than a re-profile would start it again and again.
"""

from __future__ import annotations

import hashlib

import msgspec
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from shoal.protocol import ModelSpec, encode_json, name_token
from shoal.state.kv import ensure_bucket, read_all, read_value

PROFILES_BUCKET = "shoal_profiles"
REPROFILES_BUCKET = "shoal_reprofiles"
REPROFILE_EVERY_S = 600.0  # at most one re-profile a model (and hardware) this often


class BatchProfile(msgspec.Struct, kw_only=True):
    """A batch budget found by profiling a model on one kind of hardware."""

    model: str
    runtime: str
    hardware: str
    max_batch_items: int  # the budget chosen
    max_batch_tokens: int
    # batch size -> items per second and seconds per batch, as measured
    throughput: dict[int, float] = msgspec.field(default_factory=dict)
    latency_s: dict[int, float] = msgspec.field(default_factory=dict)
    profiled_by: str = ""
    profiled_ms: int = 0


decode_batch_profile = msgspec.json.Decoder(BatchProfile).decode


def profile_key(spec: ModelSpec, hardware: str) -> str:
    identity = encode_json([spec.source, spec.options, hardware])
    digest = hashlib.sha256(identity).hexdigest()[:16]
    return f"{name_token(spec.name)}.{name_token(spec.runtime)}.{digest}"


async def ensure_profiles_kv(js: JetStreamContext) -> KeyValue:
    return await ensure_bucket(js, PROFILES_BUCKET)


async def read_profile(kv: KeyValue, key: str) -> BatchProfile | None:
    """The stored profile; None when there is none yet (or only a claim)."""
    return await read_value(kv, key, decode_batch_profile)


async def claim_profile(kv: KeyValue, key: str) -> bool:
    """True when the caller is the one to profile (it created the key)."""
    try:
        await kv.create(key, b"")
    except nats.js.errors.KeyWrongLastSequenceError:
        return False
    return True


async def claim_reprofile(js: JetStreamContext, key: str, worker_id: str) -> bool:
    """True when the caller is the one to profile `key` again: no worker of the fleet has
    claimed that within `REPROFILE_EVERY_S`."""
    kv = await ensure_bucket(js, REPROFILES_BUCKET, ttl_s=REPROFILE_EVERY_S)
    try:
        await kv.create(key, worker_id.encode())
    except nats.js.errors.KeyWrongLastSequenceError:
        return False
    return True


async def store_profile(kv: KeyValue, key: str, profile: BatchProfile) -> None:
    await kv.put(key, encode_json(profile))


async def read_profiles(js: JetStreamContext) -> list[BatchProfile]:
    """Every stored profile (for `shoal models`)."""
    return await read_all(await ensure_profiles_kv(js), decode_batch_profile)
