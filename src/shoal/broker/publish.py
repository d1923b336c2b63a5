"""Putting work on the queue, with JetStream's failures turned into typed errors.

The gateway maps these errors to HTTP statuses; it never reads JetStream error codes.
"""

from __future__ import annotations

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

# max messages per subject / max messages / max bytes: the stream refuses new work
_QUEUE_FULL_CODES = {10077, 10047, 10078}
PUBLISH_TIMEOUT_S = 2.0


class PublishError(Exception):
    """The queue did not take the work; `retry` says whether trying again soon may help."""

    retry = True


class QueueFullError(PublishError):
    """The model's queue is at its limit: the request was refused, not queued."""


class QueueUnavailableError(PublishError):
    """NATS is not reachable, the stream does not exist, or the publish was not acknowledged."""


class QueueRefusedError(PublishError):
    """JetStream refused the message for another reason (the message says which)."""

    retry = False


async def publish_work(
    js: JetStreamContext, subject: str, body: bytes, headers: dict[str, str]
) -> None:
    """Publish one work message and wait for JetStream to store it.

    A publish whose acknowledgement was lost is retried once; the `Nats-Msg-Id` header makes
    the retry a no-op if the first one was stored (the stream's duplicate window).
    """
    for attempt in range(2):
        try:
            await js.publish(subject, body, timeout=PUBLISH_TIMEOUT_S, headers=headers)
            return
        except nats.js.errors.APIError as err:
            if err.err_code in _QUEUE_FULL_CODES:
                raise QueueFullError(str(err)) from None
            raise QueueRefusedError(str(err)) from None
        except nats.errors.NoRespondersError:
            raise QueueUnavailableError("the work stream does not exist") from None
        except (TimeoutError, nats.errors.TimeoutError):
            if attempt == 1:
                raise QueueUnavailableError("the queue did not acknowledge in time") from None
        except nats.errors.ConnectionClosedError:
            raise QueueUnavailableError("the queue (NATS) is not reachable") from None
