"""Speculative decoding's proposers (plain Python, no model): prompt lookup, the suffix automata and the
shared output store."""
from __future__ import annotations

import random

import pytest

from services.engine.core.proposers.ngram import NgramIndex, NgramProposer
from services.engine.core.proposers.suffix import SuffixProposer
from services.engine.core.proposers.suffix_automaton import OutputAutomaton, SuffixAutomaton


def test_prompt_lookup_takes_the_longest_suffix_match_and_the_tokens_after_it():
    p = NgramProposer(min_n=1, max_n=3)
    # ...5 6 7 8 9 | ...1 6 7 8 | ...2 7 8 — suffix "6 7 8": the 3-gram match wins over the later "7 8"
    tokens = [5, 6, 7, 8, 9, 10, 11, 1, 6, 7, 8, 12, 13, 2, 7, 8, 14, 3, 6, 7, 8]
    draft, n = p.propose(1, tokens, 3)
    assert n == 3
    assert draft == [12, 13, 2]     # the most recent earlier occurrence of "6 7 8" (at index 8..10)


def test_prompt_lookup_without_a_match_proposes_nothing():
    p = NgramProposer(min_n=2, max_n=4)
    assert p.propose(1, [1, 2, 3, 4, 5, 6], 4) == ([], 0)
    assert p.propose(1, [1, 2], 4) == ([], 0)
    assert p.propose(1, [1, 2, 3, 1, 2], 0) == ([], 0)


def grow(p: NgramProposer | SuffixProposer, count: int, modulus: int) -> list[int]:
    """Sequence 9 grows one token at a time, looked up after each."""
    tokens: list[int] = []
    for i in range(count):
        tokens.append((i * 7919) % modulus)
        p.propose(9, tokens, 5)
    return tokens


def test_prompt_lookup_is_incremental_and_bounded():
    """Each call indexes only the tokens added since the last one; the index holds at most
    (max_n - min_n + 1) entries per token, however often the sequence is looked up."""
    p = NgramProposer(min_n=2, max_n=4)
    tokens = grow(p, 3000, 50)
    index = p._indexes[9]
    assert len(index) <= 3 * len(tokens)
    # the draft is what followed the latest earlier occurrence of the longest matching suffix
    draft, n = p.propose(9, tokens, 5)
    assert n >= 2
    suffix = tokens[-n:]
    ends = [e for e in range(n, len(tokens)) if tokens[e - n:e] == suffix]
    assert draft == tokens[ends[-1]:ends[-1] + 5]
    p.forget(9)
    assert 9 not in p._indexes


def test_repeating_text_drafts_its_own_continuation():
    p = NgramProposer(min_n=2, max_n=4)
    tokens = [1, 2, 3, 4] * 5
    draft, n = p.propose(1, tokens, 6)
    assert n == 4 and draft == [1, 2, 3, 4][:4]   # what followed the previous "1 2 3 4": the last repeat, cut at the end


def test_index_validates_its_bounds():
    with pytest.raises(ValueError):
        NgramIndex(0, 3)
    with pytest.raises(ValueError):
        NgramIndex(3, 2)


def test_the_store_of_recent_outputs_serves_other_sequences():
    s = SuffixProposer(min_n=2, max_stored_tokens=1000)
    answer = [40, 41, 42, 43, 44, 45, 46, 47]
    s.on_finished(answer)                                # one request's output...
    draft, n = s.propose(2, [7, 8, 9, 40, 41, 42], 4)    # ...drafts for another request writing it again
    assert n == 3 and draft == [43, 44, 45, 46]
    # the sequence's own context wins a tie: it is the likelier to continue alike
    own = [40, 41, 42, 90, 91, 5, 40, 41, 42]
    assert s.propose(3, own, 2) == ([90, 91], 3)
    # a longer match than the n-gram lookup's max_n: the longest wins, whichever side it is on
    s.on_finished([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert s.propose(5, [0, 3, 4, 5, 6, 7], 3) == ([8, 9, 10], 5)


def brute_longest_suffix(text: list[int], window: list[int]) -> int:
    for n in range(len(window), 0, -1):
        suffix = window[-n:]
        if any(text[i:i + n] == suffix for i in range(len(text) - n + 1)):
            return n
    return 0


def test_the_automaton_finds_the_longest_suffix_and_its_first_occurrence():
    rng = random.Random(5)
    sam = SuffixAutomaton()
    text: list[int] = []
    for _ in range(400):
        token = rng.randrange(6)
        sam.extend(token)
        text.append(token)
    for _ in range(200):
        window = [rng.randrange(6) for _ in range(rng.randrange(1, 12))]
        n, end = sam.longest_suffix(window)
        assert n == brute_longest_suffix(text, window)
        if n:
            first = min(i for i in range(len(text) - n + 1) if text[i:i + n] == window[-n:])
            assert end == first + n - 1
            assert sam.continuation(end, 3) == text[end + 1:end + 4]


def test_the_automaton_is_bounded_in_states_transitions_and_work():
    """At most 2n - 1 states and 3n - 4 transitions for n tokens, built in amortized O(1) a token; a lookup
    walks its window once (its suffix-link steps never outnumber its steps)."""
    rng = random.Random(9)
    sam = SuffixAutomaton()
    n = 5000
    for i in range(n):
        sam.extend(rng.randrange(50) if i % 7 else 3)
    assert sam.num_states <= 2 * n and sam.num_transitions <= 3 * n
    assert sam.work <= 4 * n
    before = sam.work
    window = [rng.randrange(50) for _ in range(32)]
    sam.longest_suffix(window)
    assert sam.work - before <= 2 * len(window)


def test_the_store_is_bounded_and_evicts_the_oldest_generation():
    store = OutputAutomaton(min_n=2, max_stored_tokens=100)
    for i in range(50):
        store.add([1000 + i] + [i * 10 + j for j in range(9)])   # 10 tokens each (+ a separator)
        assert store.num_tokens <= 100
    assert store.num_states <= 2 * store.num_tokens + 2
    assert store.match([1049, 490, 491], 2) == ([492, 493], 3)   # the newest is there
    assert store.match([1000, 0, 1], 2) == ([], 0)               # the oldest is gone with its generation
    # a continuation stops at the end of its output: the separators keep outputs apart
    assert store.match([496, 497], 5) == ([498], 2)


def test_short_outputs_are_not_stored():
    store = OutputAutomaton(min_n=2, max_stored_tokens=100)
    store.add([1, 2])
    assert store.num_outputs == 0 and store.num_tokens == 0


def test_the_own_automaton_grows_incrementally_and_is_forgotten():
    p = SuffixProposer(min_n=3)
    tokens = grow(p, 600, 40)
    own = p._own[9]
    assert len(own.text) == len(tokens) - 1 and own.num_states <= 2 * len(tokens)
    draft, n = p.propose(9, tokens, 5)
    if n:
        suffix = tokens[-n:]
        firsts = [e for e in range(n, len(tokens)) if tokens[e - n:e] == suffix]
        assert draft == tokens[firsts[0]:firsts[0] + 5]
    p.forget(9)
    assert 9 not in p._own
