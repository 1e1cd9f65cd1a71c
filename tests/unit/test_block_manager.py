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
