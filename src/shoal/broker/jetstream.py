"""JetStream objects Shoal uses: the work stream and one durable pull consumer per model.

(KV buckets belong to `shoal.state`, one module per bucket.)

Every component calls these on start; each creates what is missing and leaves alone what
exists, so the first component to start (normally `shoal up`) sets the stream's limits.
"""

from __future__ import annotations

import contextlib
import logging

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from shoal.broker.cluster import report_replicas, stream_replicas
from shoal.config import QueueSettings
from shoal.protocol import WORK_STREAM, WORK_SUBJECT_PREFIX, consumer_name, work_subject

log = logging.getLogger(__name__)


async def ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    """Create the stream unless it exists, replicated as the cluster allows
    (`stream_replicas`); an existing one with fewer replicas is kept and reported."""
    wanted = stream_replicas(js)
    try:
        info = await js.stream_info(config.name or "")
    except nats.js.errors.NotFoundError:
        pass
    else:
        report_replicas(f"stream {config.name}", info.config.num_replicas or 1, wanted)
        return
    config.num_replicas = wanted
    try:
        await js.add_stream(config)
    except nats.js.errors.BadRequestError as err:
        # Another component created it between our look and our add.
        if err.err_code != 10058:
            raise


async def ensure_work_stream(js: JetStreamContext, queue: QueueSettings) -> None:
    """The work stream: work-queue retention, bounded per model, deduplicated on request id."""
    config = StreamConfig(
        name=WORK_STREAM,
        subjects=[f"{WORK_SUBJECT_PREFIX}.>"],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        # A full queue refuses new work (the gateway answers 429) instead of dropping old work.
        max_msgs_per_subject=queue.max_queued_per_model,
        discard=DiscardPolicy.NEW,
        discard_new_per_subject=True,
        duplicate_window=queue.duplicate_window_s,
    )
    await ensure_stream(js, config)


async def ensure_model_consumer(js: JetStreamContext, model: str, queue: QueueSettings) -> str:
    """The durable pull consumer every worker serving `model` shares; returns its name."""
    name = consumer_name(model)
    try:
        await js.consumer_info(WORK_STREAM, name)
        return name
    except nats.js.errors.NotFoundError:
        pass
    config = ConsumerConfig(
        name=name,
        durable_name=name,
        filter_subject=work_subject(model),
        deliver_policy=DeliverPolicy.ALL,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=queue.ack_wait_s,
        max_deliver=queue.max_deliver,
        max_ack_pending=-1,
        max_waiting=4096,
    )
    await js.add_consumer(WORK_STREAM, config)
    return name


async def read_backlog(js: JetStreamContext, model: str) -> int | None:
    """Requests queued for `model` that no worker has pulled yet; None without a consumer."""
    try:
        info = await js.consumer_info(WORK_STREAM, consumer_name(model))
    except nats.js.errors.NotFoundError:
        return None
    return int(info.num_pending or 0)


async def purge_model_queue(js: JetStreamContext, model: str) -> None:
    """Drop every request queued for `model` (it was undeployed)."""
    with contextlib.suppress(nats.js.errors.NotFoundError):
        await js.purge_stream(WORK_STREAM, subject=work_subject(model))
