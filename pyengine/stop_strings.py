"""Stop strings that may span tokens: text that could still become a stop string is held back until decided,
and a matched stop string is cut from the output (vLLM semantics; the Rust project only matched inside one
token)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class StopMatch:
    """Where the output ends when a stop string matched."""

    stop: str
    end: int  # length of the text to keep


class StopStringMatcher:
    """Tracks one choice's text and decides how much of it is safe to emit."""

    __slots__ = ("_floor", "_include", "_max_len", "_stops", "text")

    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self._stops = [s for s in stops if s]
        self._max_len = max((len(s) for s in self._stops), default=0)
        self._include = include_stop_str_in_output
        self.text = ""
        self._floor = 0  # stop strings start here or later (text before it was made within min_tokens)

    def append(self, new_text: str, searchable: bool = True) -> StopMatch | None:
        """Add decoded text; return the earliest stop-string match that ends in the new text, if any. Text added
        with ``searchable`` False (the first ``min_tokens`` tokens' text, as vLLM treats it) is never part of a
        match."""
        old_len = len(self.text)
        self.text += new_text
        if not searchable:
            self._floor = len(self.text)
            return None
        if not self._stops or not new_text:
            return None
        start = max(self._floor, old_len - self._max_len + 1)
        best: StopMatch | None = None
        for stop in self._stops:
            pos = self.text.find(stop, start)
            # at equal starts the shorter stop string completed first
            if pos >= 0 and (best is None or (pos, len(stop)) < (best.end, len(best.stop))):
                best = StopMatch(stop, pos)
        if best is None:
            return None
        best.end = best.end + len(best.stop) if self._include else best.end
        self.text = self.text[: best.end]
        return best

    def safe_length(self) -> int:
        """Length of the text prefix that can no longer become part of a stop string."""
        if not self._stops:
            return len(self.text)
        text = self.text
        hold = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(text) - self._floor), hold, -1):
                if text.endswith(stop[:k]):
                    hold = k
                    break
        return len(text) - hold
