"""Incremental detokenization with stop strings. Plain Python.

Each new token re-decodes the output so far and emits only the new suffix. Text that might be
the start of a stop string is held back until it is known not to be; a matched stop string ends
the sequence and is not part of the text. An incomplete UTF-8 character (decoded as U+FFFD) is
held back until its last byte arrives.
"""
from __future__ import annotations

from typing import Callable


class Detokenizer:
    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...] = (), emitted: int = 0):
        self._decode = decode
        self._stop = tuple(s for s in stop if s)
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self._emitted = emitted  # characters of the text already handed out (here or, resumed, elsewhere)
        self.text = ""          # the output text (final once the sequence ends)

    def step(self, output_token_ids: list[int], final: bool) -> tuple[str, bool]:
        """Text decoded so far → (new text to emit, stop string matched)."""
        text = self._decode(output_token_ids)
        if self._stop:
            search_from = max(0, self._emitted - self._max_stop + 1)
            hits = [i for i in (text.find(s, search_from) for s in self._stop) if i != -1]
            if hits:
                self.text = text[: min(hits)]
                return self._emit(len(self.text)), True
        self.text = text
        if final:
            return self._emit(len(text)), False
        safe = len(text)
        while safe > self._emitted and text[safe - 1] == "\ufffd":
            safe -= 1
        safe -= self._held_back(text[:safe])
        return self._emit(safe), False

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        for n in range(min(self._max_stop - 1, len(text) - self._emitted), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0

    def _emit(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        delta = self.text[self._emitted:end] if end <= len(self.text) else ""
        self._emitted = end
        return delta
