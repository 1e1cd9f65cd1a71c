"""Prompt lookup: the next tokens after the latest earlier occurrence of the sequence's own suffix.

For each n from ``max_n`` down to ``min_n``, the sequence's last n tokens are looked up among the
n-grams it holds earlier (prompt and output); the first n that matches wins (the longest match),
its most recent earlier occurrence is taken, and the up to k tokens that followed it are the draft.

Bounded: each sequence keeps an index from every n-gram (n in [min_n, max_n]) to where it last
ended, updated only for the tokens added since the last call, so a step costs O(max_n - min_n + 1)
dictionary operations plus the new tokens' updates, and the index holds at most
(max_n - min_n + 1) entries per token of the sequence (its length is bounded by the context).
"""
from __future__ import annotations

from collections.abc import Sequence as Tokens


class NgramIndex:
    """Where each n-gram (n in [min_n, max_n]) of a growing token list last ended."""

    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._last: dict[tuple[int, ...], int] = {}   # n-gram -> index just past its latest occurrence
        self._indexed = 0                              # positions whose ending n-grams are in the index

    def __len__(self) -> int:
        return len(self._last)

    def extend(self, tokens: Tokens[int], upto: int) -> None:
        """Index the n-grams of ``tokens`` ending before ``upto`` (``tokens`` only ever grows)."""
        for end in range(max(self._indexed, self.min_n), upto + 1):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self._last[tuple(tokens[end - n:end])] = end
        self._indexed = max(self._indexed, upto + 1)

    def match(self, tokens: Tokens[int]) -> tuple[int, int]:
        """(n, index just past the latest earlier occurrence of ``tokens``' last n tokens) for the
        longest n that occurs; (0, -1) when none does."""
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            end = self._last.get(tuple(tokens[len(tokens) - n:]))
            if end is not None:
                return n, end
        return 0, -1


class NgramProposer:
    """One ``NgramIndex`` per sequence; ``propose`` returns up to ``k`` draft tokens."""

    def __init__(self, min_n: int = 2, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[int, NgramIndex] = {}

    def propose(self, seq_id: int, tokens: Tokens[int], k: int, known: int | None = None) -> tuple[list[int], int]:
        """(draft of up to ``k`` tokens, length of the match it came from) for the sequence whose
        prompt + output is ``tokens``; only its first ``known`` tokens are its own for sure (the rest a draft
        in flight, matched but not indexed)."""
        if k <= 0 or len(tokens) <= self.min_n:
            return [], 0
        index = self._indexes.get(seq_id)
        if index is None:
            index = self._indexes[seq_id] = NgramIndex(self.min_n, self.max_n)
        # n-grams ending at len - 1 or before: the suffix itself (ending at len) is what is looked up.
        index.extend(tokens, (len(tokens) if known is None else min(known, len(tokens))) - 1)
        n, end = index.match(tokens)
        if n == 0:
            return [], 0
        return list(tokens[end:end + k]), n

    def forget(self, seq_id: int) -> None:
        self._indexes.pop(seq_id, None)

    def on_finished(self, output: Tokens[int]) -> None:
        """Outputs of other sequences are not looked up here (``SuffixProposer`` does)."""
