"""Suffix decoding without a draft model: the sequence's own context, plus the model's recent outputs.

Like suffix decoding (arXiv 2411.04975), a draft may come from text the model wrote for *other*
requests: agents, tools and repeated questions make a model say the same things again. Recent
finished outputs are kept in a store shared by every sequence of the model, bounded in tokens
(oldest output evicted first), and indexed by every n-gram (n in [min_n, max_n]) → where it last
ended. A lookup tries the sequence's own prompt and output (``NgramIndex``) and the shared store,
and takes the longer match (the sequence's own on a tie, being the likelier to continue alike).

Bounded: the store holds at most ``max_stored_tokens`` tokens and its index at most
(max_n - min_n + 1) entries per stored token; an eviction removes its output's entries. A lookup is
O(max_n - min_n + 1) dictionary operations; adding an output is O(its length · (max_n - min_n + 1)).
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence as Tokens

from services.engine.core.proposers.ngram import NgramIndex, NgramProposer


class OutputStore:
    """Recent outputs of one model, indexed by n-gram; bounded in tokens."""

    def __init__(self, min_n: int, max_n: int, max_stored_tokens: int, min_output_tokens: int = 4):
        if max_stored_tokens <= 0:
            raise ValueError("max_stored_tokens must be > 0")
        self.min_n, self.max_n = min_n, max_n
        self.max_stored_tokens = max_stored_tokens
        self.min_output_tokens = min_output_tokens
        self._docs: OrderedDict[int, tuple[int, ...]] = OrderedDict()   # oldest first
        self._index: dict[tuple[int, ...], tuple[int, int]] = {}        # n-gram -> (doc, index past it)
        self._ids = itertools.count()
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self._docs)

    @property
    def num_index_entries(self) -> int:
        return len(self._index)

    def add(self, output: Tokens[int]) -> None:
        """Remember one finished output (the newest); the oldest go while the store is over its bound."""
        doc = tuple(output[-self.max_stored_tokens:])
        if len(doc) < max(self.min_output_tokens, self.min_n + 1):
            return
        doc_id = next(self._ids)
        self._docs[doc_id] = doc
        self.num_tokens += len(doc)
        for end, n in self._ngram_ends(doc):
            self._index[doc[end - n:end]] = (doc_id, end)
        while self.num_tokens > self.max_stored_tokens:
            self._evict()

    def _ngram_ends(self, doc: tuple[int, ...]):
        # An n-gram ending at the doc's end has no continuation: not worth an entry.
        for end in range(self.min_n, len(doc)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                yield end, n

    def _evict(self) -> None:
        doc_id, doc = self._docs.popitem(last=False)
        self.num_tokens -= len(doc)
        for end, n in self._ngram_ends(doc):
            key = doc[end - n:end]
            if self._index.get(key, (None,))[0] == doc_id:
                del self._index[key]

    def match(self, tokens: Tokens[int], k: int) -> tuple[list[int], int]:
        """(up to ``k`` tokens that followed the longest stored match of ``tokens``' suffix, its length)."""
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            hit = self._index.get(tuple(tokens[len(tokens) - n:]))
            if hit is not None:
                doc_id, end = hit
                return list(self._docs[doc_id][end:end + k]), n
        return [], 0


class SuffixProposer:
    """The sequence's own context (prompt lookup) and the shared store of recent outputs."""

    def __init__(self, min_n: int = 2, max_n: int = 4, max_stored_tokens: int = 65536):
        self.own = NgramProposer(min_n, max_n)
        self.store = OutputStore(min_n, max_n, max_stored_tokens)

    def propose(self, seq_id: int, tokens: Tokens[int], k: int) -> tuple[list[int], int]:
        own, own_n = self.own.propose(seq_id, tokens, k)
        if own_n >= self.store.max_n:
            return own, own_n
        shared, shared_n = self.store.match(tokens, k)
        return (shared, shared_n) if shared_n > own_n else (own, own_n)

    def forget(self, seq_id: int) -> None:
        self.own.forget(seq_id)

    def on_finished(self, output: Tokens[int]) -> None:
        self.store.add(output)
