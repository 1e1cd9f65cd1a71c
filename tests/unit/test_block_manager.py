import pytest

from services.common.sampling import SamplingOptions
from services.engine.core.block_manager import BlockManager, chain_hash
from services.engine.core.sequence import Sequence


def seq(n_prompt: int) -> Sequence:
    return Sequence(prompt_token_ids=list(range(n_prompt)), sampling=SamplingOptions())


def test_allocate_covers_tokens_and_free_returns_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(10)
    assert bm.num_new_blocks(s, 10) == 3
    assert bm.can_allocate(s, 10)
    bm.allocate(s, 10)
    s.num_computed_tokens = 10
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    # two more tokens fit in the third block; a third one needs a fourth block
    assert bm.num_new_blocks(s, 2) == 0
    assert bm.num_new_blocks(s, 3) == 1
    bm.check_invariants()
    bm.free(s)
    assert s.block_table == [] and bm.num_free_blocks == 8
    bm.check_invariants()


def test_cannot_allocate_past_capacity():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = seq(9)
    assert not bm.can_allocate(s, 9)
    with pytest.raises(RuntimeError):
        bm.allocate(s, 9)
    assert bm.num_free_blocks == 2
    bm.check_invariants()


def test_blocks_are_distinct_across_sequences():
    bm = BlockManager(num_blocks=6, block_size=2)
    a, b = seq(4), seq(4)
    bm.allocate(a, 4)
    bm.allocate(b, 4)
    assert not set(a.block_table) & set(b.block_table)
    bm.free(a)
    bm.check_invariants()
    assert bm.num_used_blocks == 2


def test_check_invariants_detects_corruption():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq(2)
    bm.allocate(a, 2)
    a.block_table.append(a.block_table[0])  # a block twice in one table, not reference-counted
    with pytest.raises(AssertionError):
        bm.check_invariants()


def _cache_prompt(bm: BlockManager, tokens: list[int]) -> Sequence:
    s = Sequence(prompt_token_ids=tokens, sampling=SamplingOptions())
    bm.allocate(s, len(tokens))
    s.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(s, s.num_computed_tokens)
    return s


def test_block_hashes_are_sha256_of_parent_and_tokens():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = _cache_prompt(bm, list(range(9)))
    assert len(s.block_hashes) == 2 and all(len(h) == 32 for h in s.block_hashes)
    assert s.block_hashes[1] == chain_hash(s.block_hashes[0], (4, 5, 6, 7))
    bm.check_invariants()


def test_a_colliding_hash_is_not_a_cache_hit(monkeypatch):
    """Even if an attacker finds a block whose hash collides with a cached one, the tokens differ,
    so the lookup misses: the hash alone never decides what a request attends to."""
    import services.engine.core.block_manager as block_manager

    monkeypatch.setattr(block_manager, "chain_hash", lambda parent, tokens: b"\0" * 32)
    bm = BlockManager(num_blocks=8, block_size=4)
    victim = _cache_prompt(bm, [10, 11, 12, 13, 14])
    bm.free(victim)
    attacker = seq(5)  # tokens 0..4: a different first block with the same (forced) hash
    assert bm.find_cached_prefix(attacker) == []
    same = Sequence(prompt_token_ids=[10, 11, 12, 13, 99], sampling=SamplingOptions())
    assert len(bm.find_cached_prefix(same)) == 1


def test_reset_prefix_cache_forgets_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = _cache_prompt(bm, list(range(13)))
    again = Sequence(prompt_token_ids=list(range(13)), sampling=SamplingOptions())
    with pytest.raises(RuntimeError):
        bm.reset_prefix_cache()  # blocks still held: their memory may be in use
    bm.free(s)
    assert len(bm.find_cached_prefix(again)) == 3
    bm.reset_prefix_cache()
    assert bm.find_cached_prefix(again) == [] and bm.num_cached_blocks == 0
    bm.check_invariants()


def _churn(bm: BlockManager, rng: "random.Random", rounds: int) -> None:
    """Many short sequences at once, growing a token at a time and ending in random order: afterwards the
    free list's LRU order is scattered through the pool and every full block is cached."""
    for r in range(rounds):
        live = [Sequence(prompt_token_ids=[rng.randrange(50_000) for _ in range(3)], sampling=SamplingOptions())
                for _ in range(12)]
        for s in live:
            bm.allocate(s, 3)
            s.num_computed_tokens = 3
        for _ in range(14):
            for s in live:
                bm.allocate(s, 1)
                s.output_token_ids.append(rng.randrange(50_000))
                s.num_computed_tokens += 1
                bm.cache_full_blocks(s, s.num_computed_tokens)
            done = rng.sample(live, k=min(len(live), rng.randrange(3)))
            for s in done:
                bm.free(s)
                live.remove(s)
        for s in live:
            bm.free(s)
        bm.check_invariants()


def test_a_sequence_gets_consecutive_blocks_after_churn():
    """After a busy load the LRU free list is scattered through the pool; a new long sequence, prefilled in
    chunks and then decoded a token at a time, still gets mostly consecutive blocks (the worker's attention
    reads them faster), and the prefix cache and reference counts stay consistent."""
    import random

    rng = random.Random(7)
    bm = BlockManager(num_blocks=160, block_size=4)
    _churn(bm, rng, rounds=6)
    scattered = list(bm._free)[:30]   # what strict LRU order would hand out
    assert sum(b == a + 1 for a, b in zip(scattered, scattered[1:])) < 10
    long = Sequence(prompt_token_ids=[rng.randrange(50_000) for _ in range(100)], sampling=SamplingOptions())
    for start in range(0, 100, 16):       # chunked prefill
        n = min(16, 100 - start)
        bm.allocate(long, n)
        long.num_computed_tokens += n
        bm.cache_full_blocks(long, long.num_computed_tokens)
    for _ in range(20):                   # decode
        bm.allocate(long, 1)
        long.output_token_ids.append(1)
        long.num_computed_tokens += 1
    t = long.block_table
    assert len(t) == 30
    assert sum(b == a + 1 for a, b in zip(t, t[1:])) >= 24
    bm.check_invariants()


def test_recently_freed_cached_blocks_are_not_taken_out_of_turn():
    """The block after a sequence's last one is skipped when it holds a cached prefix freed among the most
    recent half of the free list: that prefix stays findable. A block holding nothing is taken."""
    bm = BlockManager(num_blocks=8, block_size=4)
    b = seq(8)
    bm.allocate(b, 8)                      # blocks 0, 1
    a = _cache_prompt(bm, [900 + i for i in range(9)])   # blocks 2, 3 (cached), 4
    bm.free(a)                              # the most recently freed: 4, 3, 2
    b.num_computed_tokens = 8
    bm.allocate(b, 1)
    assert b.block_table == [0, 1, 5]       # not 2: a's cached first block, freed just now
    again = Sequence(prompt_token_ids=[900 + i for i in range(9)], sampling=SamplingOptions())
    assert bm.find_cached_prefix(again) == [2, 3]
    b.num_computed_tokens = 9
    bm.allocate(b, 4)
    assert b.block_table == [0, 1, 5, 6]    # 6 holds nothing: consecutive
    bm.check_invariants()
