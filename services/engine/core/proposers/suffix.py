"""Suffix decoding without a draft model: the sequence's own context, plus the model's recent outputs.

Like suffix decoding (arXiv 2411.04975), a draft may come from text the model wrote for *other*
requests: agents, tools and repeated questions make a model say the same things again. Both sources are
suffix automata (``suffix_automaton.py``), so a match may be of any length, not only up to the n-gram
lookup's ``max_n``:

- the sequence's own prompt and output (all but its last token, extended incrementally as it grows);
- the recent finished outputs of the model, shared by every sequence (``OutputAutomaton``, bounded in
  tokens, evicted by generation).

A lookup takes the longest suffix of the sequence's last ``window`` tokens found in either (at least
``min_n`` tokens; the sequence's own on a tie, being the likelier to continue alike) and drafts the
tokens that followed it.

Bounded: the shared automaton holds at most ``max_stored_tokens`` tokens, in at most two states per
token; a sequence's own automaton two states per token of its context (bounded by the context length),
dropped when it finishes. A lookup walks at most ``window`` tokens in each automaton; extending one is
amortized O(1) per token.
"""
from __future__ import annotations

from collections.abc import Sequence as Tokens

from services.engine.core.proposers.suffix_automaton import OutputAutomaton, SuffixAutomaton

WINDOW = 32     # the sequence's latest tokens a lookup matches (the longest match considered)


class SuffixProposer:
    """The sequence's own context and the shared store of recent outputs, as suffix automata."""

    def __init__(self, min_n: int = 2, max_stored_tokens: int = 65536, window: int = WINDOW):
        self.min_n, self.window = min_n, window
        self.store = OutputAutomaton(min_n, max_stored_tokens, window)
        self._own: dict[int, SuffixAutomaton] = {}

    def propose(self, seq_id: int, tokens: Tokens[int], k: int, known: int | None = None) -> tuple[list[int], int]:
        """(draft of up to ``k`` tokens, length of the match it came from) for the sequence whose prompt +
        output is ``tokens``; only its first ``known`` tokens are its own for sure (the rest a draft in flight,
        matched but not remembered)."""
        if k <= 0 or len(tokens) <= self.min_n:
            return [], 0
        own = self._own.get(seq_id)
        if own is None:
            own = self._own[seq_id] = SuffixAutomaton()
        sure = len(tokens) if known is None else min(known, len(tokens))
        for token in tokens[len(own.text):sure - 1]:   # an occurrence must end before the last token
            own.extend(token)
        window = tokens[max(0, len(tokens) - self.window):]
        n, end = own.longest_suffix(window)
        mine = (list(tokens[end + 1:end + 1 + k]), n) if n >= self.min_n else ([], 0)
        shared = self.store.match(tokens, k)
        return shared if shared[1] > mine[1] else mine

    def forget(self, seq_id: int) -> None:
        self._own.pop(seq_id, None)

    def on_finished(self, output: Tokens[int]) -> None:
        self.store.add(output)
