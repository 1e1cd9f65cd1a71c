import pytest

from services.engine.core.block_manager import BlockManager
from services.common.sampling import SamplingOptions
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
