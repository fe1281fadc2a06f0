"""Token bytes -> printable text: incremental UTF-8 decoding and stop strings."""
from __future__ import annotations

import codecs
from typing import Sequence


class StopStrings:
    """Feed text with `push`; it returns the text that is safe to show now.

    A tail that could be the start of a stop string is held until it is known. When a stop string completes,
    `stopped` turns true and only the text before it is returned; `flush` returns what is held (text that
    something other than text follows, or the end).
    """

    def __init__(self, stops: Sequence[str] = ()):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    @property
    def holding(self) -> bool:
        return bool(self._held)

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        text = self._held + text
        if not self.stops:
            self._held = ""
            return text
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return text[:cut]
        hold = max((n for s in self.stops for n in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:n])), default=0)
        self._held = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold]

    def flush(self) -> str:
        text, self._held = ("" if self.stopped else self._held), ""
        return text


class TextStream:
    """Feed each token's bytes with `push`; it returns the text that is safe to show now.

    A character split across tokens is held until complete, and so is any tail that could be the start of
    a stop string. When a stop string completes, `stopped` turns true and only the text before it is
    returned. `flush` returns what is still held once generation ends.
    """

    def __init__(self, stops: Sequence[str] = ()):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = StopStrings(stops)

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    @property
    def holding(self) -> bool:
        return self._stops.holding or bool(self._decoder.getstate()[0])

    def push(self, data: bytes) -> str:
        return self._stops.push(self._decoder.decode(data))

    def flush(self) -> str:
        if self.stopped:
            return ""
        return self._stops.push(self._decoder.decode(b"", final=True)) + self._stops.flush()
