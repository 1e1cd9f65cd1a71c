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


def _ran(bm: BlockManager, tokens: list[int], outputs: list[int] = ()) -> Sequence:
    """A sequence whose prompt ``tokens`` and ``outputs`` were run (all but the last token computed), then freed."""
    s = Sequence(prompt_token_ids=list(tokens), sampling=SamplingOptions())
    s.output_token_ids = list(outputs)
    prefix = bm.find_prefix(s)
    bm.take_prefix(s, prefix)
    bm.allocate(s, s.num_tokens - s.num_computed_tokens)
    s.num_computed_tokens = s.num_tokens - 1
    bm.cache_full_blocks(s, s.num_computed_tokens)
    return s


def test_a_freed_sequences_last_block_is_taken_in_part_by_a_prompt_that_continues_it():
    """A conversation's next turn: the new prompt is the old prompt, its answer and more. Its whole blocks come
    from the cache and so do the first tokens of the old sequence's last, partly filled block (a tail), so only
    what follows them is computed; the tail is then the new sequence's block and nobody else's."""
    bm = BlockManager(num_blocks=16, block_size=4)
    old = _ran(bm, list(range(100, 110)), outputs=[7, 8, 9])    # 13 tokens: 12 computed, blocks 0-2 full
    tail_block = old.block_table[3]
    bm.free(old)
    bm.check_invariants()
    turn = Sequence(prompt_token_ids=list(range(100, 110)) + [7, 8, 9, 55, 56, 57], sampling=SamplingOptions())
    prefix = bm.find_prefix(turn)
    # 12 of its 13 tokens computed: three whole blocks, and no partly filled block to keep
    assert prefix.num_tokens == 12 and len(prefix.blocks) == 3 and tail_block not in prefix.blocks
    old2 = _ran(bm, list(range(200, 210)), outputs=[1, 2, 3, 4])   # 14 tokens: 13 computed, the tail holds [3]
    tail_block = old2.block_table[3]
    bm.free(old2)
    bm.check_invariants()
    follow = Sequence(prompt_token_ids=list(range(200, 210)) + [1, 2, 3, 4, 99], sampling=SamplingOptions())
    prefix = bm.find_prefix(follow)
    assert prefix.num_tokens == 13 and prefix.blocks[-1] == tail_block
    assert bm.can_allocate_with_prefix(follow, prefix, 2)
    bm.take_prefix(follow, prefix)
    assert follow.num_computed_tokens == 13 and follow.block_table[-1] == tail_block
    bm.check_invariants()
    # held now: a second prompt like it finds the whole blocks only
    other = Sequence(prompt_token_ids=list(follow.prompt_token_ids), sampling=SamplingOptions())
    assert bm.find_prefix(other).num_tokens == 12
    bm.free(follow)
    bm.check_invariants()


def test_a_block_is_taken_in_part_only_by_a_prompt_that_continues_it_or_ends_inside_it():
    """A tail is taken by a prompt that continues all it holds; a cached full block by a prompt that ends inside it
    (a repeat: its last token is left to run). A prompt that shares only a few of a block's tokens and goes on
    differently takes neither: that would destroy a block a repeat could find whole."""
    bm = BlockManager(num_blocks=16, block_size=4)
    system = list(range(300, 308))                                  # two whole blocks
    a = _ran(bm, system + [1, 2, 3, 9])                             # 11 computed: a tail holding [1, 2, 3]
    b = _ran(bm, system + [1, 2, 5, 6, 7])                          # 12 computed: its third block [1, 2, 5, 6] full
    tail_a, full_b = a.block_table[2], b.block_table[2]
    bm.free(a)
    bm.free(b)
    assert tail_a in bm._tail and full_b in bm._cached.values()
    bm.check_invariants()
    ask = lambda *t: bm.find_prefix(Sequence(prompt_token_ids=system + list(t), sampling=SamplingOptions()))
    # continues the tail: 11 tokens; shares two tokens with each block and goes on: whole blocks only
    assert ask(1, 2, 3, 4, 4).num_tokens == 11 and ask(1, 2, 3, 4, 4).blocks[-1] == tail_a
    assert ask(1, 2, 9, 9, 9).num_tokens == 8
    # ends inside the full block (its last token runs): 11 tokens from the cache
    repeat = Sequence(prompt_token_ids=system + [1, 2, 5, 6], sampling=SamplingOptions())
    prefix = bm.find_prefix(repeat)
    assert prefix.num_tokens == 11 and prefix.blocks[-1] == full_b
    bm.take_prefix(repeat, prefix)
    assert full_b not in bm._cached.values()                         # matched in part: it leaves the cache
    assert repeat.num_computed_tokens == 11
    bm.check_invariants()


def test_no_tail_is_kept_from_a_failed_sequence_or_after_a_reset():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = _ran(bm, list(range(400, 406)))
    bm.free(s, keep_tail=False)
    again = Sequence(prompt_token_ids=list(range(400, 407)), sampling=SamplingOptions())
    assert bm.find_prefix(again).num_tokens == 4
    s = _ran(bm, list(range(400, 406)))
    bm.free(s)
    assert bm.find_prefix(again).num_tokens == 5
    bm.reset_prefix_cache()
    assert bm.find_prefix(again).num_tokens == 0
    bm.check_invariants()
    # a tail handed out to another sequence (a plain allocation) is forgotten
    s = _ran(bm, list(range(400, 406)))
    bm.free(s)
    hog = Sequence(prompt_token_ids=list(range(32)), sampling=SamplingOptions())
    bm.allocate(hog, 32)
    assert bm.find_prefix(again).num_tokens == 0
    bm.check_invariants()
