"""Text assembly for generation: token bytes to text, ended at the first stop string."""

from __future__ import annotations

import codecs


class TextAssembler:
    """Turns a sequence's token bytes into text, ending it at the first stop string.

    Text that might be the start of a stop string is held back until the next tokens show
    whether it is, so a streamed client never sees part of a stop string.
    """

    def __init__(self, stops: list[str]) -> None:
        self._stops = stops
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.text = ""  # everything decoded so far, up to a stop string
        self._released = 0
        self.stopped = False

    def add(self, piece: bytes) -> str:
        """Add one token's bytes; returns the text that may be released now."""
        self.text += self._decoder.decode(piece)
        for stop in self._stops:
            at = self.text.find(stop, self._released)
            if at >= 0:
                self.text = self.text[:at]
                self.stopped = True
        if self.stopped:
            return self._release(len(self.text))
        return self._release(len(self.text) - self._held_back())

    def finish(self) -> str:
        """The sequence ended without a stop string: release what is left."""
        if not self.stopped:
            self.text += self._decoder.decode(b"", final=True)
        return self._release(len(self.text))

    def _held_back(self) -> int:
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(self.text) - self._released), 0, -1):
                if self.text.endswith(stop[:size]):
                    longest = max(longest, size)
                    break
        return longest

    def _release(self, end: int) -> str:
        released = self.text[self._released : end]
        self._released = max(self._released, end)
        return released
