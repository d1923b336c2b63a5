"""How many messages a pull request asks for, so that what comes fits the next batch's room.

A work message is an envelope of one or more requests (group commit at the gateway), so a pull
for n messages can bring more requests than the room the next batch has left; the excess then
waits in this worker for a whole batch while another worker could have run it. A pull asks
for as many messages as fit even if each is as large as the largest lately: sized on the
average, a pull overshot the room about half the time (docs/benchmarks.md, "Pulls that fit
the room").

No NATS here: the model server counts the requests in the messages it pulls.
"""

from __future__ import annotations

from collections import deque

MESSAGES_KEPT = 32


class RecentMessages:
    """The sizes (requests per message) of the last work messages pulled."""

    def __init__(self, kept: int = MESSAGES_KEPT) -> None:
        self._requests: deque[int] = deque(maxlen=kept)

    def observe(self, requests: int) -> None:
        """A message of `requests` requests was pulled."""
        self._requests.append(requests)

    def messages_for_room(self, room: int) -> int:
        """How many messages to pull for `room` requests: as many as fit even if each is as
        large as the largest lately, and at least one (a room smaller than one message still
        pulls one).

        One until a message has been seen (a fresh worker's pulls, one at a time): it cannot
        know how large the gateways' envelopes are (up to 64 requests), and counting each as
        one request let its first pull take `room` envelopes, many batches of work that
        waited behind it while the workers already running had room
        (tests/test_pull_sizing.py)."""
        if not self._requests:
            return 1
        return max(1, room // max(self._requests))
