"""The `shoal_attempts` bucket: which request a worker was running alone when it stopped.

A work message delivered for the third time or more is suspect: some worker already died
(or hung past the ack wait) twice while holding it. Its requests then run one at a time, and
before each the worker writes `<work stream sequence>` -> `Attempt` here, and deletes the key
once the request has returned. A key still present when the message comes back names the
request that was running when its worker stopped: the culprit, which the next worker runs
last (after the rest of the message has been answered), and whose record becomes the dead
letter's "last error" if the message reaches `max_deliver`.

Only redelivered messages touch this bucket, so the normal path pays nothing for it.
"""

from __future__ import annotations

import contextlib

import msgspec
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from shoal.protocol import encode_json
from shoal.state.kv import ensure_bucket, read_value

ATTEMPTS_BUCKET = "shoal_attempts"
ATTEMPTS_TTL_S = 3600.0  # longer than any message can spend being redelivered


class Attempt(msgspec.Struct, frozen=True):
    """A request of a suspect message that a worker started alone."""

    request_id: str
    worker_id: str
    delivery: int  # the message's delivery count when it started
    started_ms: int

    def describe(self, max_deliver: int | None = None) -> str:
        """The "last error" of a message whose worker never came back from this attempt."""
        of = f" of {max_deliver}" if max_deliver else ""
        return (
            f"worker {self.worker_id} stopped (crashed, was killed or hung past the ack wait) "
            f"while running request {self.request_id} alone, on delivery {self.delivery}{of}"
        )


_decode_attempt = msgspec.json.Decoder(Attempt).decode


async def ensure_attempts_kv(js: JetStreamContext) -> KeyValue:
    return await ensure_bucket(js, ATTEMPTS_BUCKET, ttl_s=ATTEMPTS_TTL_S)


async def mark_attempt(kv: KeyValue, work_seq: int, attempt: Attempt) -> None:
    await kv.put(str(work_seq), encode_json(attempt))


async def clear_attempt(kv: KeyValue, work_seq: int) -> None:
    with contextlib.suppress(nats.js.errors.KeyNotFoundError):
        await kv.delete(str(work_seq))


async def read_attempt(kv: KeyValue, work_seq: int) -> Attempt | None:
    try:
        return await read_value(kv, str(work_seq), _decode_attempt)
    except msgspec.DecodeError:
        return None
