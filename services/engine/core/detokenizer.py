"""Incremental detokenization with stop strings. Plain Python.

Each step decodes only a short window of the latest tokens (the offsets technique of vLLM and
TGI: the text of ``ids[prefix:]`` minus the text of ``ids[prefix:read]``), so the cost per token
stays constant however long the output grows. Text that might be
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
        self._prefix = 0        # token offsets of the decode window
        self._read = 0
        self._emitted = emitted  # characters of the text already handed out (here or, resumed, elsewhere)
        self.text = ""          # the output text (final once the sequence ends)

    @property
    def has_stop(self) -> bool:
        return bool(self._stop)

    def step(self, output_token_ids: list[int], final: bool) -> tuple[str, bool]:
        """Output tokens so far → (new text to emit, stop string matched)."""
        window = self._decode(output_token_ids[self._prefix:])
        known = self._decode(output_token_ids[self._prefix:self._read]) if self._read > self._prefix else ""
        # A window ending in U+FFFD is a character still missing bytes: wait for the next token.
        if len(window) > len(known) and (final or not window.endswith("\ufffd")):
            self.text += window[len(known):]
            self._prefix, self._read = self._read, len(output_token_ids)
        if self._stop:
            search_from = max(0, self._emitted - self._max_stop + 1)
            hits = [i for i in (self.text.find(s, search_from) for s in self._stop) if i != -1]
            if hits:
                self.text = self.text[: min(hits)]
                return self._emit(len(self.text)), True
        if final:
            return self._emit(len(self.text)), False
        return self._emit(len(self.text) - self._held_back(self.text)), False

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
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta
