"""The dead-letter stream: work messages that were delivered `max_deliver` times unanswered.

When a work message reaches its consumer's `max_deliver` without an ack (the workers holding
it crashed or hung each time), JetStream stops delivering it, leaves it in the work stream
(work-queue retention removes only what is acked) and publishes an advisory on
`$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.<stream>.<consumer>` with its stream sequence.
`dead_letter` moves that message, by sequence, into `SHOAL_DLQ`: its body and headers as
they were, plus headers that say where it came from, how often it was delivered and the last
error known for it; then it deletes it from the work stream (where it would otherwise count
against the model's queue bound forever). Listing, showing, replaying and purging are here
too, for `shoal dlq` and the admin API.

The broker knows no models: a model appears here only as the subject token of its queue, and
as a name given by the caller for the `Shoal-Model` header.
"""

from __future__ import annotations

import contextlib

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from shoal.broker.jetstream import ensure_stream
from shoal.protocol import (
    WORK_STREAM,
    WORK_SUBJECT_PREFIX,
    Header,
    WorkEnvelope,
    decode_envelope,
    encode_msgpack,
    now_ms,
)

DLQ_STREAM = "SHOAL_DLQ"
DLQ_SUBJECT_PREFIX = "shoal.dlq"
MAX_DELIVERIES_ADVISORY = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES"
# Dead letters are kept for a week, at most this many: an operator's queue, not an archive.
DLQ_MAX_AGE_S = 7 * 24 * 3600.0
DLQ_MAX_MESSAGES = 100_000


class DlqHeader:
    """Headers a dead letter carries besides the work message's own."""

    MODEL = "Shoal-Model"
    WORK_SUBJECT = "Shoal-Work-Subject"
    WORK_SEQ = "Shoal-Work-Seq"
    DELIVERIES = "Shoal-Deliveries"
    LAST_ERROR = "Shoal-Last-Error"
    DEAD_LETTERED_MS = "Shoal-Dead-Lettered-Ms"
    ORIGINAL_MSG_ID = "Shoal-Original-Msg-Id"
    REPLAYS = "Shoal-Replays"  # how often this payload was put back on the work queue before


class DeadLetterError(Exception):
    """A DLQ operation that cannot be done (no such entry, a payload that is not work)."""


class DeadRequest(msgspec.Struct, frozen=True):
    """One client request inside a dead letter."""

    request_id: str
    endpoint: str
    deadline_ms: int
    body_bytes: int
    body: str | None = None  # the body as text (shown only by `show`; bytes not UTF-8: \\ufffd)


class DeadLetter(msgspec.Struct, frozen=True, kw_only=True):
    """One entry of the dead-letter stream, as listed and shown."""

    seq: int  # its sequence in SHOAL_DLQ: what show, replay and purge take
    model: str
    work_subject: str
    work_seq: int
    deliveries: int
    last_error: str
    dead_lettered_ms: int
    replays: int
    reply_to: str
    bytes: int
    requests: list[DeadRequest]
    headers: dict[str, str] = msgspec.field(default_factory=dict)


class MaxDeliveries(msgspec.Struct, frozen=True):
    """The part of JetStream's max-deliveries advisory that matters here."""

    stream: str
    consumer: str
    stream_seq: int
    deliveries: int


_decode_advisory = msgspec.json.Decoder(MaxDeliveries).decode


def dlq_subject(work_subject: str) -> str:
    """`shoal.work.<model token>` -> `shoal.dlq.<model token>`."""
    return f"{DLQ_SUBJECT_PREFIX}.{work_subject.rsplit('.', 1)[-1]}"


async def ensure_dlq_stream(js: JetStreamContext) -> None:
    """The dead-letter stream: limits retention (entries stay until purged, replayed or a
    week old), file storage."""
    config = StreamConfig(
        name=DLQ_STREAM,
        subjects=[f"{DLQ_SUBJECT_PREFIX}.>"],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=DLQ_MAX_AGE_S,
        max_msgs=DLQ_MAX_MESSAGES,
        discard=DiscardPolicy.OLD,
        duplicate_window=120.0,
    )
    await ensure_stream(js, config)


async def watch_max_deliveries(
    nc: Client, consumer: str, on_advisory, queue: str = "shoal-dlq"
) -> Subscription:
    """Subscribe to the max-deliveries advisories of one work consumer.

    Every worker of a model subscribes in the same queue group, so one of them handles each
    advisory; `on_advisory(MaxDeliveries)` is awaited for each.
    """

    async def on_msg(msg) -> None:
        try:
            advisory = _decode_advisory(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        await on_advisory(advisory)

    subject = f"{MAX_DELIVERIES_ADVISORY}.{WORK_STREAM}.{consumer}"
    return await nc.subscribe(subject, queue=queue, cb=on_msg)


async def dead_letter(
    js: JetStreamContext, work_seq: int, *, model: str, deliveries: int, last_error: str
) -> tuple[int, WorkEnvelope | None] | None:
    """Move work message `work_seq` into the dead-letter stream.

    Returns (its DLQ sequence, its envelope, None if it is not one), or None if the message
    is no longer in the work stream (another worker moved it, or it was purged). Safe to run
    twice for one message: the DLQ deduplicates on the work sequence.
    """
    try:
        raw = await js.get_msg(WORK_STREAM, work_seq)
    except nats.js.errors.NotFoundError:
        return None
    await ensure_dlq_stream(js)
    headers = {k: v for k, v in (raw.headers or {}).items() if not k.startswith("Nats-")}
    original_id = (raw.headers or {}).get(Header.MSG_ID, "")
    headers.update(
        {
            Header.MSG_ID: f"dlq-{work_seq}-{original_id}",
            DlqHeader.MODEL: model,
            DlqHeader.WORK_SUBJECT: raw.subject,
            DlqHeader.WORK_SEQ: str(work_seq),
            DlqHeader.DELIVERIES: str(deliveries),
            # Header values are one line.
            DlqHeader.LAST_ERROR: " ".join(last_error.split())[:1000],
            DlqHeader.DEAD_LETTERED_MS: str(now_ms()),
            DlqHeader.ORIGINAL_MSG_ID: original_id,
        }
    )
    ack = await js.publish(dlq_subject(raw.subject), raw.data or b"", headers=headers)
    # Only once it is stored here does it leave the work stream: never lost in between.
    with contextlib.suppress(nats.js.errors.NotFoundError):
        await js.delete_msg(WORK_STREAM, work_seq)
    return ack.seq, _envelope_or_none(raw.data or b"")


async def list_dead_letters(js: JetStreamContext, limit: int = 1000) -> list[DeadLetter]:
    """The entries, oldest first, at most `limit` (without request bodies)."""
    try:
        info = await js.stream_info(DLQ_STREAM)
    except nats.js.errors.NotFoundError:
        return []
    entries: list[DeadLetter] = []
    seq = info.state.first_seq
    while seq and seq <= info.state.last_seq and len(entries) < limit:
        # Purged entries leave gaps: ask for the next stored one at or after `seq`.
        try:
            raw = await js.get_msg(DLQ_STREAM, seq, subject=f"{DLQ_SUBJECT_PREFIX}.>", next=True)
        except nats.js.errors.NotFoundError:
            break
        entries.append(_entry(raw, with_bodies=False))
        seq = raw.seq + 1
    return entries


async def get_dead_letter(js: JetStreamContext, seq: int) -> DeadLetter:
    """One entry with its request bodies; DeadLetterError if there is none."""
    return _entry(await _raw(js, seq), with_bodies=True)


async def replay(js: JetStreamContext, seq: int, timeout_s: float | None = None) -> int:
    """Put entry `seq` back on its work queue and remove it from the DLQ; returns the new
    work sequence.

    Each request gets a fresh deadline (its original budget, deadline minus send time, or
    `timeout_s`), since the old one has passed. Its client was already told it failed, so
    the results reach no one (the gateway drops them); if it fails again it comes back here
    after `max_deliver` more deliveries, with `Shoal-Replays` one higher.
    """
    raw = await _raw(js, seq)
    envelope = _envelope_or_none(raw.data or b"")
    if envelope is None:
        raise DeadLetterError(f"dead letter {seq} does not hold a work envelope")
    headers = raw.headers or {}
    subject = headers.get(DlqHeader.WORK_SUBJECT, "")
    if not subject.startswith(WORK_SUBJECT_PREFIX + "."):
        raise DeadLetterError(f"dead letter {seq} does not say which work queue it came from")
    sent = now_ms()
    requests = [
        msgspec.structs.replace(
            request,
            deadline_ms=sent + _budget_ms(request.deadline_ms, envelope.sent_ms, timeout_s),
        )
        for request in envelope.requests
    ]
    body = encode_msgpack(WorkEnvelope(envelope.reply_to, sent, requests))
    replays = int(headers.get(DlqHeader.REPLAYS, "0") or 0) + 1
    original_id = headers.get(DlqHeader.ORIGINAL_MSG_ID, "") or f"dlq-{seq}"
    out = {k: v for k, v in headers.items() if not k.startswith(("Nats-", "Shoal-"))}
    # A new id: the old one may still be inside the work stream's duplicate window.
    out[Header.MSG_ID] = f"{original_id}-replay-{seq}-{sent}"
    out[DlqHeader.REPLAYS] = str(replays)
    ack = await js.publish(subject, body, headers=out)
    with contextlib.suppress(nats.js.errors.NotFoundError):
        await js.delete_msg(DLQ_STREAM, seq)
    return ack.seq


async def purge(js: JetStreamContext, seq: int | None = None) -> int:
    """Delete entry `seq`, or every entry when None; returns how many were deleted."""
    if seq is not None:
        await _raw(js, seq)  # DeadLetterError if there is no such entry
        await js.delete_msg(DLQ_STREAM, seq)
        return 1
    try:
        info = await js.stream_info(DLQ_STREAM)
    except nats.js.errors.NotFoundError:
        return 0
    await js.purge_stream(DLQ_STREAM)
    return int(info.state.messages)


async def _raw(js: JetStreamContext, seq: int):
    try:
        return await js.get_msg(DLQ_STREAM, seq)
    except (nats.js.errors.NotFoundError, nats.errors.TimeoutError):
        raise DeadLetterError(f"no dead letter {seq}") from None


def _budget_ms(deadline_ms: int, sent_ms: int, timeout_s: float | None) -> int:
    if timeout_s is not None:
        return int(timeout_s * 1000)
    return max(1000, deadline_ms - sent_ms) if deadline_ms and sent_ms else 60_000


def _envelope_or_none(data: bytes) -> WorkEnvelope | None:
    try:
        return decode_envelope(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def _entry(raw, *, with_bodies: bool) -> DeadLetter:
    headers = dict(raw.headers or {})
    data = raw.data or b""
    envelope = _envelope_or_none(data)
    requests = [
        DeadRequest(
            r.request_id,
            r.endpoint,
            r.deadline_ms,
            len(r.body),
            r.body.decode(errors="replace") if with_bodies else None,
        )
        for r in (envelope.requests if envelope else [])
    ]
    return DeadLetter(
        seq=raw.seq,
        model=headers.get(DlqHeader.MODEL, ""),
        work_subject=headers.get(DlqHeader.WORK_SUBJECT, ""),
        work_seq=_int(headers.get(DlqHeader.WORK_SEQ)),
        deliveries=_int(headers.get(DlqHeader.DELIVERIES)),
        last_error=headers.get(DlqHeader.LAST_ERROR, ""),
        dead_lettered_ms=_int(headers.get(DlqHeader.DEAD_LETTERED_MS)),
        replays=_int(headers.get(DlqHeader.REPLAYS)),
        reply_to=envelope.reply_to if envelope else "",
        bytes=len(data),
        requests=requests,
        headers=headers if with_bodies else {},
    )


def _int(value: str | None) -> int:
    try:
        return int(value or 0)
    except ValueError:
        return 0


__all__ = [
    "DLQ_STREAM",
    "DeadLetter",
    "DeadLetterError",
    "DlqHeader",
    "MaxDeliveries",
    "dead_letter",
    "ensure_dlq_stream",
    "get_dead_letter",
    "list_dead_letters",
    "purge",
    "replay",
    "watch_max_deliveries",
]
