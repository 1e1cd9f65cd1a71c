"""A bounded suffix automaton over the model's recent outputs: the longest match of any length, in bounded time.

Suffix decoding (arXiv 2411.04975) keeps a suffix tree of recent outputs and drafts what followed the
longest match of the sequence's latest tokens. A suffix automaton is the compact equivalent: its states are
the classes of substrings with the same end positions, at most 2n - 1 of them for n tokens and at most 3n - 4
transitions, built online in amortized O(1) per token (Blumer et al. 1985), and it answers "the longest
suffix of this window that occurs in the text" by one left-to-right walk of the window.

- Outputs are appended to one token text, each followed by a separator of its own (a negative id), so no
  match spans two outputs and a continuation stops at its output's end.
- Each state keeps the end of its substrings' first occurrence (firstpos; a clone copies it), so a
  match's continuation is the text after that position.
- Bounded memory by generations: outputs go into the current automaton until it holds half the budget;
  then it becomes the previous one and the one before is dropped whole (an automaton cannot forget a
  string, so eviction is by generation: the oldest half of the budget at once). At most
  ``max_stored_tokens`` tokens (+ one output) are held, in at most 2 states per token.
- Bounded time: adding an output is amortized O(its length); a lookup walks at most ``window`` tokens of the
  sequence (each step a dictionary lookup, plus suffix-link steps that never outnumber the steps taken).
"""
from __future__ import annotations

from collections.abc import Sequence as Tokens


class SuffixAutomaton:
    """The suffix automaton of one growing token text (outputs separated by unique negative ids)."""

    def __init__(self) -> None:
        self.next: list[dict[int, int]] = [{}]     # state → token → state
        self.link: list[int] = [-1]                # suffix link
        self.length: list[int] = [0]               # longest substring of the state
        self.firstpos: list[int] = [-1]            # text index of the last token of its first occurrence
        self.text: list[int] = []
        self._last = 0
        self.work = 0                              # loop steps taken (the time bound's witness, for tests)

    @property
    def num_states(self) -> int:
        return len(self.next)

    @property
    def num_transitions(self) -> int:
        return sum(len(t) for t in self.next)

    def extend(self, token: int) -> None:
        """Append one token (the online construction: one new state, at most one clone)."""
        pos = len(self.text)
        self.text.append(token)
        cur = len(self.next)
        self.next.append({})
        self.length.append(self.length[self._last] + 1)
        self.link.append(0)
        self.firstpos.append(pos)
        p = self._last
        while p != -1 and token not in self.next[p]:
            self.next[p][token] = cur
            p = self.link[p]
            self.work += 1
        if p != -1:
            q = self.next[p][token]
            if self.length[p] + 1 == self.length[q]:
                self.link[cur] = q
            else:
                clone = len(self.next)
                self.next.append(dict(self.next[q]))
                self.length.append(self.length[p] + 1)
                self.link.append(self.link[q])
                self.firstpos.append(self.firstpos[q])
                while p != -1 and self.next[p].get(token) == q:
                    self.next[p][token] = clone
                    p = self.link[p]
                    self.work += 1
                self.link[q] = clone
                self.link[cur] = clone
        self._last = cur

    def longest_suffix(self, window: Tokens[int]) -> tuple[int, int]:
        """(length, end index in the text of its first occurrence) of the longest suffix of ``window`` that
        occurs in the text; (0, -1) when none does. One walk over ``window``."""
        state, n = 0, 0
        for token in window:
            while state and token not in self.next[state]:
                state = self.link[state]
                n = self.length[state]
                self.work += 1
            state = self.next[state].get(token, 0)
            n = n + 1 if state else 0
            self.work += 1
        return (n, self.firstpos[state]) if n else (0, -1)

    def continuation(self, end: int, k: int) -> list[int]:
        """Up to ``k`` tokens after text index ``end``, stopping at its output's separator."""
        out = []
        for token in self.text[end + 1:end + 1 + k]:
            if token < 0:
                break
            out.append(token)
        return out


class OutputAutomaton:
    """Recent outputs of one model in two generations of suffix automata; bounded in tokens."""

    def __init__(self, min_n: int, max_stored_tokens: int, window: int = 32, min_output_tokens: int = 4):
        if max_stored_tokens <= 0:
            raise ValueError("max_stored_tokens must be > 0")
        self.min_n = min_n
        self.max_stored_tokens = max_stored_tokens
        self.window = window
        self.min_output_tokens = min_output_tokens
        self.current = SuffixAutomaton()
        self.previous: SuffixAutomaton | None = None
        self._separator = -1
        self.num_outputs = 0

    @property
    def num_tokens(self) -> int:
        return len(self.current.text) + (len(self.previous.text) if self.previous is not None else 0)

    @property
    def num_states(self) -> int:
        return self.current.num_states + (self.previous.num_states if self.previous is not None else 0)

    def add(self, output: Tokens[int]) -> None:
        """Remember one finished output; a full generation retires the one before it."""
        half = max(1, self.max_stored_tokens // 2)
        doc = list(output[-(half - 1):]) if half > 1 else []
        if len(doc) < max(self.min_output_tokens, self.min_n + 1):
            return
        if len(self.current.text) + len(doc) + 1 > half:
            self.previous, self.current = self.current, SuffixAutomaton()
        for token in doc:
            self.current.extend(token)
        self.current.extend(self._separator)
        self._separator -= 1
        self.num_outputs += 1

    def match(self, tokens: Tokens[int], k: int) -> tuple[list[int], int]:
        """(up to ``k`` tokens after the longest stored match of ``tokens``' last ``window`` tokens, its length);
        the newer generation wins a tie. Matches shorter than ``min_n`` do not count."""
        window = tokens[max(0, len(tokens) - self.window):]
        best: tuple[list[int], int] = ([], 0)
        for sam in (self.current, self.previous):
            if sam is None:
                continue
            n, end = sam.longest_suffix(window)
            if n >= self.min_n and n > best[1]:
                draft = sam.continuation(end, k)
                if draft:
                    best = (draft, n)
        return best
