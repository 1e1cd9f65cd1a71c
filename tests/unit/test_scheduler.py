"""Scheduler tests with no model: step outputs are written by hand."""
import random

import pytest

from services.engine.core.block_manager import BlockManager
from services.engine.core.scheduler import SampledToken, Scheduler, SchedulerConfig, SchedulerOutput
from services.common.sampling import SamplingOptions
from services.engine.core.sequence import FinishReason, Sequence, SequenceStatus

EOS = 2


def make(num_blocks=64, block_size=4, max_seqs=8, budget=32, max_len=1024, prefix_caching=True,
         long_prefill=0, max_long=1) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_len,
                          eos_token_ids=frozenset({EOS}), long_prefill_token_threshold=long_prefill,
                          max_long_partial_prefills=max_long)
    return Scheduler(cfg, BlockManager(num_blocks, block_size, enable_prefix_caching=prefix_caching))


_prompts = iter(range(10**6))


def seq(n_prompt: int, max_tokens: int = 4, prompt: list[int] | None = None, **kw) -> Sequence:
    """A sequence with a prompt no other test sequence shares (unless ``prompt`` is given)."""
    base = 1000 * next(_prompts) + 10
    return Sequence(prompt_token_ids=prompt or [base + i for i in range(n_prompt)],
                    sampling=SamplingOptions(max_tokens=max_tokens, **kw))


def fake_step(sched: Scheduler, out: SchedulerOutput, token: int = 7) -> list[Sequence]:
    """What the worker would return: one token for every sequence that samples."""
    return sched.update(out, {s.seq.seq_id: SampledToken(token) for s in out.scheduled if s.sample})


def test_new_sequence_is_prefilled_then_decodes_one_token_per_step():
    sched = make()
    s = seq(5, max_tokens=3)
    sched.add(s)
    out = sched.schedule()
    assert [(x.start_pos, x.num_tokens, x.sample) for x in out.scheduled] == [(0, 5, True)]
    fake_step(sched, out)
    out = sched.schedule()
    assert [(x.start_pos, x.num_tokens, x.sample) for x in out.scheduled] == [(5, 1, True)]
    fake_step(sched, out)
    fake_step(sched, sched.schedule())
    assert s.is_finished and s.finish_reason is FinishReason.LENGTH and s.num_output_tokens == 3
    assert sched.block_manager.num_free_blocks == 64


def test_token_budget_and_chunked_prefill():
    sched = make(budget=8)
    long = seq(20, max_tokens=2)
    sched.add(long)
    chunks = []
    while not long.output_token_ids:
        out = sched.schedule()
        assert out.num_batched_tokens <= 8
        chunks.append((out.scheduled[0].num_tokens, out.scheduled[0].sample))
        fake_step(sched, out)
    assert chunks == [(8, False), (8, False), (4, True)]


def test_decodes_keep_flowing_while_a_long_prompt_prefills():
    sched = make(budget=6)
    short = seq(2, max_tokens=10)
    sched.add(short)
    fake_step(sched, sched.schedule())
    sched.add(seq(30, max_tokens=1))
    for _ in range(4):
        out = sched.schedule()
        ids = {x.seq.seq_id: x for x in out.scheduled}
        assert ids[short.seq_id].num_tokens == 1  # the running decode is served first, every step
        assert out.num_batched_tokens <= 6
        fake_step(sched, out)


def test_a_long_prefill_leaves_room_for_the_short_prompts_behind_it():
    """With the cap, a long prompt takes at most 8 of the 32 tokens a step: the short prompts
    queued behind it start in the same step instead of waiting for its whole prefill."""
    for cap, short_starts in ((0, 3), (8, 0)):  # uncapped, 100 tokens fill steps 0-2 and most of 3
        sched = make(budget=32, num_blocks=128, long_prefill=cap)
        long = seq(100, max_tokens=1)
        shorts = [seq(5, max_tokens=3) for _ in range(3)]
        for s in (long, *shorts):
            sched.add(s)
        first_step = {}
        for step in range(8):
            out = sched.schedule()
            for x in out.scheduled:
                first_step.setdefault(x.seq.seq_id, step)
                if x.seq is long and len(out.scheduled) > 1:   # alone, it is not capped
                    assert x.num_tokens <= (cap or 32)
            fake_step(sched, out)
        assert [first_step[s.seq_id] for s in shorts] == [short_starts] * 3, (cap, first_step)
        sched.block_manager.check_invariants()


@pytest.mark.parametrize("max_long", [1, 2])
def test_long_prompts_prefill_max_long_at_a_time_and_short_ones_behind_them_go_first(max_long):
    """Three long prompts arrive before four short ones. At most ``max_long`` long prompts prefill in
    a step; the short ones start in the first step anyway, and every prompt finishes."""
    sched = make(budget=32, num_blocks=256, long_prefill=8, max_long=max_long)
    longs = [seq(60, max_tokens=2) for _ in range(3)]
    shorts = [seq(5, max_tokens=2) for _ in range(4)]
    for s in (*longs, *shorts):
        sched.add(s)
    first_step: dict[int, int] = {}
    for step in range(60):
        if not sched.has_work():
            break
        out = sched.schedule()
        # still long: more than the threshold left before this step (a last short chunk is not long)
        prefilling = [x for x in out.scheduled if x.seq.num_tokens - x.start_pos > 8]
        assert len(prefilling) <= max_long, (step, [x.seq.seq_id for x in prefilling])
        assert all(x.num_tokens <= 8 for x in prefilling) or len(out.scheduled) == 1
        for x in out.scheduled:
            first_step.setdefault(x.seq.seq_id, step)
        fake_step(sched, out)
        sched.block_manager.check_invariants()
    assert not sched.has_work()
    assert [first_step[s.seq_id] for s in shorts] == [0] * 4
    # the long prompts start in arrival order, max_long at a time
    starts = [first_step[s.seq_id] for s in longs]
    assert starts == sorted(starts) and starts.count(0) == max_long, starts
    assert all(s.finish_reason is FinishReason.LENGTH for s in (*longs, *shorts))
    assert sched.block_manager.num_free_blocks == 256


def test_a_long_prompt_alone_is_not_capped():
    """Nothing else runs or waits: the threshold leaves room for nobody, so the long prompt takes the budget;
    once another request arrives it is capped again."""
    sched = make(budget=32, num_blocks=128, long_prefill=8)
    long = seq(100, max_tokens=1)
    sched.add(long)
    assert [x.num_tokens for x in fake_step_out(sched)] == [32]
    assert [x.num_tokens for x in fake_step_out(sched)] == [32]
    sched.add(seq(5, max_tokens=3))
    assert [x.num_tokens for x in fake_step_out(sched)] == [8, 5]


def fake_step_out(sched: Scheduler) -> list:
    out = sched.schedule()
    fake_step(sched, out)
    return out.scheduled


def test_the_next_step_is_scheduled_before_this_ones_tokens_are_known():
    """One step in flight: a sequence that samples in step 1 decodes its pending token in step 2 (a row
    past its known tokens), and no step is scheduled for a token past max_tokens."""
    sched = make(budget=32)
    s = seq(5, max_tokens=3, ignore_eos=True)
    sched.add(s)
    first = sched.schedule()
    assert [(x.start_pos, x.num_tokens, x.sample) for x in first.scheduled] == [(0, 5, True)]
    second = sched.schedule()                       # before first's token is known
    assert [(x.start_pos, x.num_tokens, x.sample) for x in second.scheduled] == [(5, 1, True)]
    assert s.num_tokens == 5 and s.num_pending_tokens == 2
    fake_step(sched, first, token=11)
    third = sched.schedule()
    assert [(x.start_pos, x.num_tokens) for x in third.scheduled] == [(6, 1)]
    fake_step(sched, second, token=12)
    assert sched.schedule().is_empty                # third samples the last of its 3 tokens
    fake_step(sched, third, token=13)
    assert s.output_token_ids == [11, 12, 13] and s.finish_reason is FinishReason.LENGTH
    assert s.num_pending_tokens == 0 and sched.block_manager.num_used_blocks == 0


def test_a_step_in_flight_for_a_sequence_that_has_ended_is_dropped():
    sched = make(budget=32)
    s = seq(5, max_tokens=10)
    sched.add(s)
    first = sched.schedule()
    second = sched.schedule()
    fake_step(sched, first, token=EOS)              # ends in step 1; step 2 already ran a row for it
    assert s.finish_reason is FinishReason.STOP and sched.block_manager.num_used_blocks == 0
    assert fake_step(sched, second, token=9) == []  # its token is dropped
    assert s.output_token_ids == [EOS]
    sched.add(seq(3))
    assert s.seq_id in sched.schedule().released_seq_ids   # the worker drops its state with the next step


def test_preemption_drops_the_pending_tokens_and_recomputes():
    sched = make(num_blocks=4, block_size=4, budget=32)
    a, b = seq(6, max_tokens=8, ignore_eos=True), seq(6, max_tokens=8, ignore_eos=True)
    sched.add(a)
    sched.add(b)
    sent = [sched.schedule()]                        # both prefill: 2 blocks each, all 4 used
    while not sched.num_preemptions:
        sent.append(sched.schedule())                # b's decodes need a 3rd block: b is preempted
        fake_step(sched, sent.pop(0))
    assert b.num_pending_tokens == 0 and b.num_computed_tokens == 0
    for _ in range(100):
        if not sched.has_work():
            break
        sent.append(sched.schedule())
        fake_step(sched, sent.pop(0))
    for done in sent:
        fake_step(sched, done)
    assert a.num_output_tokens == b.num_output_tokens == 8
    assert sched.block_manager.num_used_blocks == 0


def test_max_num_seqs_caps_a_step():
    sched = make(max_seqs=3)
    for _ in range(5):
        sched.add(seq(2))
    out = sched.schedule()
    assert len(out.scheduled) == 3 and len(sched.waiting) == 2


def test_eos_stops_unless_ignore_eos():
    sched = make()
    a, b = seq(3, max_tokens=5), seq(3, max_tokens=5, ignore_eos=True)
    sched.add(a)
    sched.add(b)
    fake_step(sched, sched.schedule(), token=EOS)
    assert a.is_finished and a.finish_reason is FinishReason.STOP
    assert not b.is_finished


def test_preempts_newest_when_blocks_run_out_and_resumes_by_recompute():
    sched = make(num_blocks=4, block_size=2, budget=64)
    old, new = seq(4, max_tokens=4), seq(4, max_tokens=4)
    sched.add(old)
    sched.add(new)
    fake_step(sched, sched.schedule())        # both prefilled: 2 blocks each, pool full
    out = sched.schedule()                     # old needs a 3rd block for its next token → new is preempted
    assert [x.seq for x in out.scheduled] == [old]
    assert new.status is SequenceStatus.PREEMPTED and new.num_computed_tokens == 0 and new.block_table == []
    assert new.seq_id in out.released_seq_ids  # the worker drops its per-sequence state
    assert sched.num_preemptions == 1
    fake_step(sched, out)
    while not old.is_finished:
        fake_step(sched, sched.schedule())
    # new resumes: prompt + its one output token are recomputed in one chunk, then it samples
    out = sched.schedule()
    assert [(x.seq, x.start_pos, x.num_tokens, x.sample) for x in out.scheduled] == [(new, 0, 5, True)]
    while not new.is_finished:
        fake_step(sched, out)
        out = sched.schedule()
    assert new.num_output_tokens == 4
    sched.block_manager.check_invariants()
    assert sched.block_manager.num_free_blocks == 4


def test_finish_frees_blocks_in_any_state():
    sched = make(max_seqs=1)
    running, waiting = seq(4), seq(4)
    sched.add(running)
    sched.add(waiting)
    sched.schedule()
    sched.finish(running, FinishReason.CANCELLED)
    sched.finish(waiting, FinishReason.CANCELLED)
    sched.finish(waiting, FinishReason.CANCELLED)  # twice is harmless
    assert not sched.has_work()
    assert sched.block_manager.num_free_blocks == 64
    assert sched.schedule().released_seq_ids == []   # an empty step is not sent: the releases wait
    sched.add(seq(4))
    assert set(sched.schedule().released_seq_ids) == {running.seq_id, waiting.seq_id}


def test_preempt_all_requeues_every_running_sequence_in_order():
    sched = make()
    seqs = [seq(3) for _ in range(3)]
    for s in seqs:
        sched.add(s)
    fake_step(sched, sched.schedule())
    sched.preempt_all()
    assert list(sched.waiting) == seqs and not sched.running
    assert sched.block_manager.num_free_blocks == 64
    out = sched.schedule()
    assert [x.num_tokens for x in out.scheduled] == [4, 4, 4]  # prompt + one output token each


@pytest.mark.parametrize("seed,prefix_caching,long_prefill,in_flight", [
    (0, True, 0, 0), (1, True, 0, 1), (2, False, 0, 0), (3, True, 6, 1), (4, False, 6, 1), (5, True, 0, 1)])
def test_randomized_operations_keep_invariants_and_free_everything(seed, prefix_caching, long_prefill, in_flight):
    """``in_flight=1``: as the engine runs it, each step is scheduled before the previous one is updated."""
    rng = random.Random(seed)
    sched = make(num_blocks=24, block_size=4, max_seqs=6, budget=20, max_len=64, prefix_caching=prefix_caching,
                 long_prefill=long_prefill)
    sent: list[SchedulerOutput] = []
    prefixes = [[rng.randint(200, 210) for _ in range(20)] for _ in range(3)]
    live: list[Sequence] = []
    for op in range(3000):
        r = rng.random()
        if r < 0.15 and len(live) < 40:
            # prompts share prefixes, so the prefix cache is hit, shared and evicted
            prompt = rng.choice(prefixes)[: rng.randint(0, 20)] + [rng.randint(100, 110) for _ in range(rng.randint(1, 10))]
            s = seq(0, max_tokens=rng.randint(1, 20), prompt=prompt, ignore_eos=rng.random() < 0.5)
            sched.add(s)
            live.append(s)
        elif r < 0.2 and live:
            sched.finish(rng.choice(live), FinishReason.CANCELLED)
        else:
            out = sched.schedule()
            assert out.num_batched_tokens <= 20 and len(out.scheduled) <= 6
            for x in out.scheduled:   # never past a length limit, counting the tokens steps in flight sample
                assert x.seq.num_output_tokens + x.seq.num_pending_tokens <= x.seq.sampling.max_tokens
                assert x.start_pos + x.num_tokens <= 64
            if not out.is_empty:
                sent.append(out)
            if len(sent) > in_flight or (out.is_empty and sent):
                done = sent.pop(0)
                sampled = {x.seq.seq_id: SampledToken(rng.choice([EOS, 5, 6, 7])) for x in done.scheduled if x.sample}
                sched.update(done, sampled)
        sched.block_manager.check_invariants()
        for s in sched.running:
            assert s.status is SequenceStatus.RUNNING
        live = [s for s in live if not s.is_finished]
    # drain: everything finishes and every block comes back
    for done in sent:
        fake_step(sched, done)
    for _ in range(5000):
        if not sched.has_work():
            break
        fake_step(sched, sched.schedule())
    assert not sched.has_work()
    assert sched.block_manager.num_free_blocks == 24
    sched.block_manager.check_invariants()
    if prefix_caching:
        assert sched.block_manager.num_prefix_hits > 0


def test_prefix_cache_reuses_full_blocks_of_a_shared_prompt():
    sched = make(num_blocks=16, block_size=4, budget=64)
    system = [5000 + i for i in range(10)]           # two full blocks + 2 tokens
    first = seq(0, max_tokens=2, prompt=system + [1, 2, 3])
    sched.add(first)
    while not first.is_finished:
        fake_step(sched, sched.schedule())
    bm = sched.block_manager
    assert bm.num_cached_blocks >= 3 and bm.num_free_blocks == 16  # finished, but contents still cached
    second = seq(0, max_tokens=2, prompt=system + [7, 8])
    sched.add(second)
    out = sched.schedule()
    # the two full blocks of the shared prefix are taken from the cache: only 4 tokens run
    assert [(x.start_pos, x.num_tokens) for x in out.scheduled] == [(8, 4)]
    assert second.block_table[:2] == first_blocks_of(bm, system)
    assert bm.num_prefix_hits == 8 and 0 < bm.prefix_hit_rate < 1
    bm.check_invariants()


def first_blocks_of(bm: BlockManager, tokens: list[int]) -> list[int]:
    probe = seq(0, prompt=tokens + [0])
    return bm.find_cached_prefix(probe)[:2]


def test_prefix_cache_shares_blocks_between_running_sequences_with_ref_counts():
    sched = make(num_blocks=16, block_size=4, budget=64)
    system = [6000 + i for i in range(8)]
    a = seq(0, max_tokens=5, prompt=system + [1])
    sched.add(a)
    fake_step(sched, sched.schedule())
    b = seq(0, max_tokens=5, prompt=system + [2])
    sched.add(b)
    fake_step(sched, sched.schedule())
    assert a.block_table[:2] == b.block_table[:2]
    sched.block_manager.check_invariants()
    sched.finish(a, FinishReason.CANCELLED)
    sched.block_manager.check_invariants()
    assert all(blk not in sched.block_manager._free for blk in b.block_table)  # still held by b
    sched.finish(b, FinishReason.CANCELLED)
    assert sched.block_manager.num_free_blocks == 16


def test_cached_blocks_are_evicted_lru_when_space_is_needed():
    sched = make(num_blocks=4, block_size=4, budget=64)
    old = seq(0, max_tokens=1, prompt=[7000 + i for i in range(9)])
    sched.add(old)
    fake_step(sched, sched.schedule())
    assert old.is_finished and sched.block_manager.num_cached_blocks == 2
    big = seq(15, max_tokens=1)   # needs all 4 blocks: the cached ones are evicted
    sched.add(big)
    fake_step(sched, sched.schedule())
    assert big.is_finished
    assert sched.block_manager.num_cached_blocks == 3  # big's own full blocks replaced the old ones
    again = seq(0, max_tokens=1, prompt=[7000 + i for i in range(9)])
    assert sched.block_manager.find_cached_prefix(again) == []
    sched.block_manager.check_invariants()
