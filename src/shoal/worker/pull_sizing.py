"""How much a pull request asks for, so that what comes fits the next batch's room.

A work message is an envelope of one or more requests (group commit at the gateway), so a pull
for n messages can bring more requests than the room the next batch has left; the excess then
waits in this worker for a whole batch while another worker could have run it.

- A pull asks for as many messages as fit even if each is as large as the largest lately
  (`RecentMessages.messages_for_room`). Sized on the average, a pull overshot the room about
  half the time (docs/benchmarks.md, "Pulls that fit the room").
- An idle worker on a long-batch device asks for one message at a time (the scheduler's
  `PullWindow.messages`), but only while the queue ahead holds less than a batch's time of
  work for all the model's workers together (`RecentMessages.queue_ahead_s`: its length over
  the rate at which JetStream delivers the consumer's messages, both read from the messages'
  ack subjects). Past that an item waits about as long in the queue as in this worker, and a
  batch started on one envelope would run short of its budget.

No NATS here: the model server reads the messages it pulls and sends the requests.
"""

from __future__ import annotations

from collections import deque

MESSAGES_KEPT = 32


class RecentMessages:
    """The sizes (requests per message) and queue positions of the last work messages pulled."""

    def __init__(self, kept: int = MESSAGES_KEPT) -> None:
        self._requests: deque[int] = deque(maxlen=kept)
        # (when, the consumer's delivery sequence) of each: the consumer's delivery rate.
        self._deliveries: deque[tuple[float, int]] = deque(maxlen=kept)
        self._queued_after = 0  # messages the queue still held after the last one

    def observe(
        self, requests: int, queued_after: int = 0, consumer_seq: int = 0, at: float = 0.0
    ) -> None:
        """A message of `requests` requests, delivered at `at` (monotonic) as the consumer's
        `consumer_seq`-th delivery with `queued_after` messages still queued behind it
        (0: unknown)."""
        self._requests.append(requests)
        self._queued_after = queued_after
        if consumer_seq:
            self._deliveries.append((at, consumer_seq))

    def messages_for_room(self, room: int, at_most: int = 0, unless_queued_s: float = 0.0) -> int:
        """How many messages to pull for `room` requests: as many as fit even if each is as
        large as the largest lately, and at least one (a room smaller than one message still
        pulls one); no more than `at_most` (0: no bound) while the queue ahead holds less than
        `unless_queued_s` of work.

        One until a message has been seen: a fresh worker cannot know how large the gateways'
        envelopes are (up to 64 requests), and counting each as one request let its first
        pull take `room` envelopes, many batches of work that waited behind it while the
        workers already running had room."""
        if not self._requests:
            return 1
        messages = max(1, room // max(self._requests))
        if at_most and self.queue_ahead_s() < unless_queued_s:
            return min(messages, at_most)
        return messages

    def queue_ahead_s(self) -> float:
        """How long the queue left behind the last message takes to be delivered, at the rate
        the consumer delivered lately to all its workers (0 until two deliveries are apart)."""
        if len(self._deliveries) < 2:
            return 0.0
        (first_at, first_seq), (last_at, last_seq) = self._deliveries[0], self._deliveries[-1]
        if last_at <= first_at or last_seq <= first_seq:
            return 0.0
        return self._queued_after * (last_at - first_at) / (last_seq - first_seq)
