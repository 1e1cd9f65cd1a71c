"""Speculative decoding's proposers (plain Python, no model): prompt lookup and the shared output store."""
from __future__ import annotations

import pytest

from services.engine.core.proposers.ngram import NgramIndex, NgramProposer
from services.engine.core.proposers.suffix import OutputStore, SuffixProposer


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


def test_prompt_lookup_is_incremental_and_bounded():
    """Each call indexes only the tokens added since the last one; the index holds at most
    (max_n - min_n + 1) entries per token, however often the sequence is looked up."""
    p = NgramProposer(min_n=2, max_n=4)
    tokens: list[int] = []
    for i in range(3000):
        tokens.append((i * 7919) % 50)
        p.propose(9, tokens, 5)
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
    s = SuffixProposer(min_n=2, max_n=4, max_stored_tokens=1000)
    answer = [40, 41, 42, 43, 44, 45, 46, 47]
    s.on_finished(answer)                                # one request's output...
    draft, n = s.propose(2, [7, 8, 9, 40, 41, 42], 4)    # ...drafts for another request writing it again
    assert n == 3 and draft == [43, 44, 45, 46]
    # the sequence's own context wins a tie: it is the likelier to continue alike
    own = [40, 41, 42, 90, 91, 5, 40, 41, 42]
    assert s.propose(3, own, 2) == ([90, 91], 3)


def test_the_store_is_bounded_and_evicts_the_oldest_output_with_its_index_entries():
    store = OutputStore(min_n=2, max_n=3, max_stored_tokens=100)
    for i in range(50):
        store.add([1000 + i] + [i * 10 + j for j in range(9)])   # 10 tokens each
    assert store.num_tokens <= 100 and len(store) == 10
    assert store.num_index_entries <= 2 * store.num_tokens
    assert store.match([1049, 490, 491], 2) == ([492, 493], 3)   # the newest is there
    assert store.match([1000, 0, 1], 2) == ([], 0)               # the oldest is gone, index entries too
    assert all(doc in store._docs for doc, _ in store._index.values())


def test_short_outputs_are_not_stored():
    store = OutputStore(min_n=2, max_n=3, max_stored_tokens=100)
    store.add([1, 2])
    assert len(store) == 0 and store.num_tokens == 0
