"""Speculative decoding in the engine loop, with a fake model that knows each sequence's true output.

The fake worker keeps a KV memory of its own, slot by slot (block table entry × offset), writes every
row's tokens into it, and checks that each row's context slots hold the sequence's true tokens: so a
rejected draft whose KV was not rolled back, or a block given back and reused too early, fails the test.
A draft row is verified as the real worker does greedily: accepted while it matches the truth, then the
true token; at a "near tie" position a draft row stops and gives no token of its own.
"""
from __future__ import annotations

import queue
import time

import pytest

from services.common.sampling import SamplingOptions
from services.engine.core.block_manager import BlockManager
from services.engine.core.engine import LLMEngine
from services.engine.core.scheduler import SampledToken, Scheduler, SchedulerConfig, SchedulerOutput
from services.engine.core.sequence import FinishReason, SeqEvent, Sequence
from services.engine.core.speculation import SpeculationGate, SpeculativeConfig, Speculator

WAIT = 20.0
EOS = 3


def decode(ids: list[int]) -> str:
    return "".join(chr(t) for t in ids)


def toks(text: str) -> list[int]:
    return [ord(c) for c in text]


class TruthWorker:
    """An executor whose model writes ``truth[seq_id]`` (output tokens), whatever the batch. A guessed row (its
    sequence's row in the step before was not read when it was sent) is resolved as the real worker resolves it
    (``ModelRunner._resolve``): as sent when its guess is the token the row before sampled, at the position that
    row left off; else that token alone, there."""

    def __init__(self, truth: dict[int, list[int]], ties: dict[int, set[int]] | None = None):
        self.truth = truth
        self.ties = ties or {}           # seq_id → output indices a draft row must not decide
        self.kv: dict[tuple[int, int], int] = {}
        self.block_size = 4
        self.restarts = 0
        self.rows: list[tuple[int, int, int]] = []    # (seq_id, tokens in the row, tokens it gave)
        self.decided_by_plain_row: set[tuple[int, int]] = set()
        self.guessed: list[bool] = []                  # per guessed row with a guess: whether it ran as sent
        self.errors: list[str] = []
        self._next: dict[int, tuple[int, int]] = {}    # seq_id → (its last sampled token, that token's position)
        self._sent: list[tuple[SchedulerOutput, dict[int, SampledToken]]] = []

    def true_tokens(self, seq: Sequence) -> list[int]:
        return seq.prompt_token_ids + self.truth[seq.seq_id]

    def send(self, out: SchedulerOutput) -> None:
        bs = self.block_size
        result: dict[int, SampledToken] = {}
        for s in out.scheduled:
            seq, table = s.seq, list(s.seq.block_table)
            true = self.true_tokens(seq)
            start, draft, known = s.start_pos, s.draft, s.num_tokens - len(s.draft)
            if s.guess is not None:
                token, pos = self._next[seq.seq_id]
                if s.guess >= 0:
                    self.guessed.append(s.guess == token and pos == start)
                if not (s.guess == token and pos == start):
                    start, draft = pos, ()
                known = 1
            for p in range(start):
                held = self.kv.get((table[p // bs], p % bs))
                if held != true[p]:
                    self.errors.append(f"seq {seq.seq_id} row at {start}: slot of position {p} holds {held}, "
                                       f"not {true[p]}")
                    break
            row = true[start:start + known] + list(draft)
            for j, token in enumerate(row):
                p = start + j
                self.kv[(table[p // bs], p % bs)] = token
            if not s.sample:
                continue
            index = start + known - seq.num_prompt_tokens   # the output index the row samples first
            truth, ties = self.truth[seq.seq_id], self.ties.get(seq.seq_id, set())
            if not draft:
                self.decided_by_plain_row.add((seq.seq_id, index))
                result[seq.seq_id] = SampledToken(truth[index])
                self._next[seq.seq_id] = (truth[index], start + known)
                self.rows.append((seq.seq_id, 1, 1))
                continue
            a = 0
            while a < len(draft) and index + a not in ties and draft[a] == truth[index + a]:
                a += 1
            bonus = -1 if index + a in ties else truth[index + a]
            result[seq.seq_id] = SampledToken(bonus, accepted=tuple(draft[:a]))
            last = start + known - 1 + a
            self._next[seq.seq_id] = (bonus, last + 1) if bonus >= 0 else (row[known - 1 + a], last)
            self.rows.append((seq.seq_id, len(row), a + (bonus >= 0)))
        self._sent.append((out, result))

    def receive(self, out: SchedulerOutput) -> dict[int, SampledToken]:
        sent, result = self._sent.pop(0)
        assert sent is out
        return result

    def restart(self) -> None:
        raise AssertionError("no restarts here")


def run(prompts: list[str], truths: list[str], spec: SpeculativeConfig, num_blocks: int = 256,
        sampling: list[SamplingOptions] | None = None, ties: list[set[int]] | None = None,
        max_len: int = 4096, budget: int = 64):
    """Runs the sequences to the end in a real engine loop; → (events per sequence, worker, scheduler)."""
    bm = BlockManager(num_blocks, 4)
    cfg = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=budget, max_model_len=max_len,
                          eos_token_ids=frozenset({EOS}))
    sched = Scheduler(cfg, bm, Speculator(spec, max_len))
    seqs = [Sequence(prompt_token_ids=toks(p), sampling=(sampling[i] if sampling else
                                                          SamplingOptions(max_tokens=len(t), temperature=0.0)))
            for i, (p, t) in enumerate(zip(prompts, truths))]
    worker = TruthWorker({s.seq_id: toks(t) for s, t in zip(seqs, truths)},
                         {s.seq_id: tie for s, tie in zip(seqs, ties)} if ties else None)
    engine = LLMEngine(sched, worker, decode, max_queue=100, max_worker_restarts=0)
    got: dict[int, queue.Queue] = {s.seq_id: queue.Queue() for s in seqs}
    engine.start()
    try:
        for s in seqs:
            engine.submit(s, got[s.seq_id].put)
        events = {}
        deadline = time.monotonic() + WAIT
        for s in seqs:
            evs: list[SeqEvent] = []
            while not evs or evs[-1].finish_reason is None:
                evs.append(got[s.seq_id].get(timeout=max(0.1, deadline - time.monotonic())))
            events[s.seq_id] = (s, evs)
    finally:
        engine.stop()
    assert worker.errors == []
    bm.check_invariants()
    assert bm.num_used_blocks == 0
    return events, worker, sched


COPY_PROMPT = "Repeat: the quick brown fox jumps over the lazy dog; the quick brown fox jumps.\n"
COPY_TRUTH = "the quick brown fox jumps over the lazy dog; the quick brown fox jumps over it"
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=6, prompt_lookup_min=2, prompt_lookup_max=4, max_batch=4)


def text_and_ids(evs: list[SeqEvent]) -> tuple[str, list[int]]:
    return "".join(e.text for e in evs), [t for e in evs for t in e.token_ids]


def test_greedy_output_is_the_true_output_with_several_tokens_per_step():
    events, worker, sched = run([COPY_PROMPT], [COPY_TRUTH], NGRAM)
    (seq, evs), = events.values()
    text, ids = text_and_ids(evs)
    assert text == COPY_TRUTH and ids == toks(COPY_TRUTH)
    assert evs[-1].finish_reason is FinishReason.LENGTH
    c = sched.speculator.counters
    assert c.num_drafts > 0 and c.num_accepted_tokens > len(COPY_TRUTH) // 2
    assert max(n for _, _, n in worker.rows) > 1                    # a step gave more than one token
    assert len(worker.rows) < len(COPY_TRUTH) * 0.6                 # far fewer steps than tokens
    assert sum(n for _, _, n in worker.rows) == len(COPY_TRUTH)
    assert any(len(e.token_ids) > 1 for e in evs)                    # the stream got several tokens at once
    assert sum(c.accepted_per_pos) == c.num_accepted_tokens and c.accepted_per_pos[0] >= c.accepted_per_pos[-1]
    assert seq.spec_accepted_tokens == c.num_accepted_tokens and seq.spec_drafts == c.num_drafts


def test_eos_inside_an_accepted_draft_ends_the_sequence_there():
    truth = "the quick brown fox jumps" + chr(EOS) + " over the lazy dog"
    events, _, _ = run([COPY_PROMPT], [truth], NGRAM)
    (_, evs), = events.values()
    text, ids = text_and_ids(evs)
    assert ids == toks(truth[:26]) and evs[-1].finish_reason is FinishReason.STOP


def test_max_tokens_and_the_context_limit_hold_with_drafts():
    events, _, _ = run([COPY_PROMPT], [COPY_TRUTH], NGRAM, sampling=[SamplingOptions(max_tokens=13, temperature=0.0)])
    (_, evs), = events.values()
    assert text_and_ids(evs)[1] == toks(COPY_TRUTH[:13]) and evs[-1].finish_reason is FinishReason.LENGTH
    limit = len(COPY_PROMPT) + 17
    events, _, _ = run([COPY_PROMPT], [COPY_TRUTH], NGRAM, max_len=limit)
    (seq, evs), = events.values()
    assert seq.num_tokens == limit and evs[-1].finish_reason is FinishReason.LENGTH
    assert text_and_ids(evs)[1] == toks(COPY_TRUTH[:17])


def test_a_stop_string_inside_an_accepted_draft_ends_the_output_where_it_completes():
    stop = SamplingOptions(max_tokens=len(COPY_TRUTH), temperature=0.0, stop=("lazy",))
    events, _, _ = run([COPY_PROMPT], [COPY_TRUTH], NGRAM, sampling=[stop])
    (seq, evs), = events.values()
    text, ids = text_and_ids(evs)
    end = COPY_TRUTH.index("lazy") + len("lazy")
    assert text == COPY_TRUTH[:COPY_TRUTH.index("lazy")]
    assert seq.output_token_ids == toks(COPY_TRUTH[:end]) and ids == seq.output_token_ids
    assert evs[-1].finish_reason is FinishReason.STOP


def test_a_near_tie_is_decided_by_a_one_token_row():
    ties = {10, 11, 30}
    events, worker, _ = run([COPY_PROMPT], [COPY_TRUTH], NGRAM, ties=[ties])
    (seq, evs), = events.values()
    assert text_and_ids(evs)[0] == COPY_TRUTH
    assert {(seq.seq_id, i) for i in ties} <= worker.decided_by_plain_row


def test_many_sequences_under_block_pressure_get_their_true_outputs():
    """Few KV blocks: sequences are preempted and recomputed mid-draft; each still gets exactly its text,
    and every row's context holds the right tokens (the fake worker checks each slot)."""
    prompts = [COPY_PROMPT.replace("fox", f"fox{i}") for i in range(6)]
    truths = [COPY_TRUTH.replace("fox", f"fox{i}") for i in range(6)]
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=6, max_batch=8)
    events, worker, sched = run(prompts, truths, spec, num_blocks=120)
    for (seq, evs), truth in zip(events.values(), truths):
        assert text_and_ids(evs)[0] == truth
    assert sched.num_preemptions > 0 and sched.speculator.counters.num_accepted_tokens > 0


def test_an_opted_out_request_and_a_wide_batch_are_not_speculated():
    out = SamplingOptions(max_tokens=len(COPY_TRUTH), temperature=0.0, speculate=False)
    events, worker, _ = run([COPY_PROMPT], [COPY_TRUTH], NGRAM, sampling=[out])
    assert all(n == 1 for _, n, _ in worker.rows)
    assert text_and_ids(next(iter(events.values()))[1])[0] == COPY_TRUTH
    narrow = SpeculativeConfig(method="ngram", max_batch=1)
    events, worker, _ = run([COPY_PROMPT] * 3, [COPY_TRUTH] * 3, narrow)
    assert sum(n > 1 for _, n, _ in worker.rows) < 5    # only once the others have finished


def test_a_constrained_request_is_speculated_like_a_free_one():
    """The worker keeps drafts inside the grammar (it cuts them, masks each row, rolls back its matcher:
    test_constraint_drafts.py), so the engine drafts for a constrained sequence as for any other."""
    constrained = SamplingOptions(max_tokens=len(COPY_TRUTH), temperature=0.0, grammar='{"grammars": []}')
    events, worker, _ = run([COPY_PROMPT], [COPY_TRUTH], NGRAM, sampling=[constrained])
    assert any(n > 1 for _, n, _ in worker.rows)
    assert text_and_ids(next(iter(events.values()))[1])[0] == COPY_TRUTH


def test_rejected_drafts_back_off():
    """A model that never says what the context suggests: its output is the true one. With the step overlap the
    drafts are guessed after a token in flight, and a guess that does not hold costs the worker nothing (its row
    runs as a one-token row). One step at a time (each draft follows a known token) the drafts are verified and
    rejected: after the first ones it drafts less and less."""
    prompt = "pqrsc" * 12
    truth = "".join("pq" + chr(200 + i) for i in range(24))   # after every "pq" the context says "rsc"; it is not
    events, worker, sched = run([prompt], [truth], NGRAM)
    assert text_and_ids(next(iter(events.values()))[1])[0] == truth
    c = sched.speculator.counters
    made, held = sched.speculator.counters.num_guesses, sched.speculator.counters.num_guesses_held
    # (only the first "p", after the prompt's "...sc", is guessed right: the draft after it is rejected at "r")
    assert made >= 10 and held <= 1 and worker.guessed.count(False) == made - held and c.num_drafts == held
    assert sum(n > 1 for _, n, _ in worker.rows) <= 1
    # one step at a time (nothing in flight: each draft follows a known token): misses, then backed off 4, 8, 16, 32
    bm = BlockManager(256, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=4096, eos_token_ids=frozenset({EOS})),
                      bm, Speculator(NGRAM, 4096))
    seq = Sequence(prompt_token_ids=toks(prompt), sampling=SamplingOptions(max_tokens=len(truth), temperature=0.0))
    worker = TruthWorker({seq.seq_id: toks(truth)})
    sched.add(seq)
    for _ in range(10 * len(truth)):
        if not sched.has_work():
            break
        out = sched.schedule()
        worker.send(out)
        sched.update(out, worker.receive(out))
    assert seq.output_token_ids == toks(truth) and worker.errors == []
    assert 2 <= sched.speculator.counters.num_drafts <= 6 and sched.speculator.counters.num_accepted_tokens <= 1


def test_the_suffix_method_drafts_from_an_earlier_requests_output():
    spec = SpeculativeConfig(method="suffix", num_speculative_tokens=6)
    bm = BlockManager(128, 4)
    sched = Scheduler(SchedulerConfig(max_model_len=4096, eos_token_ids=frozenset({EOS})), bm, Speculator(spec, 4096))
    answer = "SELECT name, total FROM orders WHERE total > 100 ORDER BY total DESC;"
    first = Sequence(prompt_token_ids=toks("Q1?"), sampling=SamplingOptions(max_tokens=len(answer), temperature=0.0))
    first.output_token_ids = toks(answer)
    sched.speculator.on_finished(first)
    second = Sequence(prompt_token_ids=toks("Q2? SELECT name"), sampling=SamplingOptions(max_tokens=20, temperature=0.0))
    assert sched.speculator.propose(second, 64) == toks(", tota")   # a first draft: FIRST_DRAFT tokens, at most k
    assert sched.speculator.propose(second, 64, num_running=8) == toks(", ")   # a wider step: 16 / 8 - 1 = 1 -> MIN_DRAFT


def drive_with_costs(spec: SpeculativeConfig, seconds_for_rows, n: int = 4, length: int = 400):
    """``n`` copy-heavy sequences through the scheduler and the fake worker, one step at a time, each step
    timed by ``seconds_for_rows(rows)`` instead of a clock; → (rows of each step, the speculator)."""
    text = "".join(f"item {i}: the {['red', 'blue', 'green'][i % 3]} box weighs {i * 7 % 50} kg. " for i in range(40))
    prompts, truths = [f"Copy {j}: {text}\n" for j in range(n)], [text[:length] for _ in range(n)]
    bm = BlockManager(2048, 4)
    cfg = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=4096, max_model_len=8192, eos_token_ids=frozenset({EOS}))
    sched = Scheduler(cfg, bm, Speculator(spec, 8192))
    seqs = [Sequence(prompt_token_ids=toks(p), sampling=SamplingOptions(max_tokens=length, temperature=0.0))
            for p in prompts]
    worker = TruthWorker({s.seq_id: toks(t) for s, t in zip(seqs, truths)})
    for s in seqs:
        sched.add(s)
    steps: list[tuple[int, bool]] = []     # (rows, any draft)
    for _ in range(20 * length):
        if not sched.has_work():
            break
        out = sched.schedule()
        if out.is_empty:
            continue
        worker.send(out)
        sampled = worker.receive(out)
        out.seconds = seconds_for_rows(out.num_batched_tokens)
        sched.update(out, sampled)
        if out.speculated is not None and out.batch == n:
            steps.append((out.num_batched_tokens, any(s.draft for s in out.scheduled)))
    assert not sched.has_work() and worker.errors == []
    for s in seqs:
        assert s.output_token_ids == toks(text[:length])
    return steps, sched.speculator


def test_the_gate_switches_speculation_off_where_verification_rows_cost_more_than_they_yield():
    """Rows that cost their square (a machine where a wide step is much dearer than a narrow one): after
    trying both, 4 sequences run plain steps, drafting again only in the gate's short retries."""
    steps, spec = drive_with_costs(SpeculativeConfig(method="ngram", max_batch=8), lambda rows: 1e-4 * rows ** 2)
    gate_steps = spec.config.gate_steps
    assert sum(d for _, d in steps[:gate_steps]) >= gate_steps // 2     # it tried speculating first
    later = steps[3 * gate_steps:]
    assert len(later) > 40 and sum(d for _, d in later) <= 0.15 * len(later)
    off, on = spec.gate.rates()[4]
    assert off > on


def test_the_gate_keeps_speculation_on_where_verification_rows_are_nearly_free():
    """A fixed cost a step and little a row (a weight-read-bound step): drafts pay, and the gate keeps them."""
    steps, spec = drive_with_costs(SpeculativeConfig(method="ngram", max_batch=8), lambda rows: 4e-3 + 1e-4 * rows)
    later = steps[3 * spec.config.gate_steps:]
    assert len(later) > 5 and sum(d for _, d in later) >= 0.6 * len(later)
    off, on = spec.gate.rates()[4]
    assert on > off
    assert max(rows for rows, _ in steps) <= 4 * (1 + 3)    # 16 rows at most: drafts of 16 / 4 - 1 = 3


def test_without_the_gate_every_allowed_step_may_speculate():
    steps, _ = drive_with_costs(SpeculativeConfig(method="ngram", max_batch=8, gate_steps=0), lambda rows: 1e-4 * rows ** 2)
    assert sum(d for _, d in steps) >= 0.6 * len(steps)


def test_the_gate_learns_each_batch_size_on_its_own_and_retries_the_slower_side():
    gate = SpeculationGate(4)
    seen = []
    for _ in range(2 * SpeculationGate.RETRY):
        on = gate.allow(2)
        seen.append(on)
        gate.record(2, on, 10 if on else 4, 0.01)   # at 2 running speculation: 1,000 tokens/s; plain: 400
        on = gate.allow(3)
        gate.record(3, on, 4 if on else 10, 0.01)   # at 3 the other way round
    assert seen[:4] == [True] * 4 and seen[4:8] == [False] * 4    # both sides tried first
    assert seen[8:8 + 2 * 4] == [True] * 8                       # then the faster side at once, not a retry
    assert 4 <= sum(not on for on in seen[8:]) <= 2 * 4 + 1     # and plain only in the retries, which do come
    assert gate.rates()[2][1] > gate.rates()[2][0] and gate.rates()[3][0] > gate.rates()[3][1]


@pytest.mark.parametrize("n,drafting", [(1, 1), (4, 1), (4, 2), (4, 4), (8, 3)])
def test_drafting_sequences_keep_the_step_overlap(n, drafting):
    """One step in flight: while a sequence's draft is verified, its next row is already in the next step, a
    guess of the token being sampled and a draft after it (the context's match continued past the draft). Every
    running sequence has a row in every step, guesses of copied text hold and their drafts run, and every output
    is the true one (the fake worker checks each row's context slots)."""
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4,
                             max_batch=8, gate_steps=0)
    bm = BlockManager(512, 4)
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=4096,
                          eos_token_ids=frozenset({EOS}))
    sched = Scheduler(cfg, bm, Speculator(spec, 4096))
    seqs = [Sequence(prompt_token_ids=toks(COPY_PROMPT),
                     sampling=SamplingOptions(max_tokens=len(COPY_TRUTH), temperature=0.0, speculate=i < drafting))
            for i in range(n)]
    worker = TruthWorker({s.seq_id: toks(COPY_TRUTH) for s in seqs})
    for s in seqs:
        sched.add(s)
    steps = 0
    in_flight: list[SchedulerOutput] = []   # as the engine loop: a step is sent, then the one before it is read
    for _ in range(2000):
        if not sched.has_work() and not in_flight:
            break
        # every running sequence whose steps in flight do not already bring its last token has a row
        due = {q.seq_id for q in sched.running if not sched._will_finish(q)}
        out = sched.schedule()
        assert due <= {s.seq.seq_id for s in out.scheduled}
        if not out.is_empty:
            worker.send(out)
            in_flight.append(out)
            steps += 1
        if in_flight and (out.is_empty or len(in_flight) > 1):
            done = in_flight.pop(0)
            sched.update(done, worker.receive(done))
    assert worker.errors == [] and not in_flight
    for s in seqs:
        assert s.output_token_ids == toks(COPY_TRUTH)
    made, held = sched.speculator.counters.num_guesses, sched.speculator.counters.num_guesses_held
    assert held >= 5 and worker.guessed.count(True) == held and len(worker.guessed) == made
    for s in seqs[:drafting]:   # several tokens a step for the drafting sequences
        assert sum(row[0] == s.seq_id for row in worker.rows) < len(COPY_TRUTH) * 0.7
    assert steps >= len(COPY_TRUTH) if drafting < n else steps < len(COPY_TRUTH) * 0.7
    bm.check_invariants()
    assert bm.num_used_blocks == 0


def test_a_conversations_next_turn_takes_the_last_turns_tail_and_its_slots_hold_the_right_tokens():
    """The next turn's prompt is the last turn's prompt and answer, and more: it takes the last turn's whole blocks
    and the tokens of its last, partly filled block (a tail), written by rows that were in flight when that turn
    ended. The fake worker checks every slot a row reads, so a tail token written wrongly, or overwritten by a row
    still in flight, fails the test; both turns write their true outputs, with speculation on and off."""
    for spec in (NGRAM, SpeculativeConfig(method="none")):
        bm = BlockManager(256, 4)
        cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=4096,
                              eos_token_ids=frozenset({EOS}))
        sched = Scheduler(cfg, bm, Speculator(spec, 4096))
        first = Sequence(prompt_token_ids=toks(COPY_PROMPT),
                         sampling=SamplingOptions(max_tokens=len(COPY_TRUTH) - 6, temperature=0.0))
        worker = TruthWorker({first.seq_id: toks(COPY_TRUTH)})
        engine = LLMEngine(sched, worker, decode, max_queue=100, max_worker_restarts=0)
        engine.start()
        try:
            def finish(seq: Sequence) -> list[SeqEvent]:
                got: queue.Queue = queue.Queue()
                engine.submit(seq, got.put)
                evs: list[SeqEvent] = []
                deadline = time.monotonic() + WAIT
                while not evs or evs[-1].finish_reason is None:
                    evs.append(got.get(timeout=max(0.1, deadline - time.monotonic())))
                return evs
            assert text_and_ids(finish(first))[0] == COPY_TRUTH[:len(COPY_TRUTH) - 6]
            turn = toks(COPY_PROMPT) + first.output_token_ids + toks("\nAgain: ")
            sound = first.num_tokens - 1    # its tokens with KV (not its last): 37 whole blocks and 3 in a tail
            assert sound % 4 == 3
            second = Sequence(prompt_token_ids=turn, sampling=SamplingOptions(max_tokens=20, temperature=0.0))
            worker.truth[second.seq_id] = toks(COPY_TRUTH[:20])
            hits = bm.num_prefix_hits
            assert text_and_ids(finish(second))[0] == COPY_TRUTH[:20]
        finally:
            engine.stop()
        # everything of the last turn that was computed came from the cache, its tail included
        assert bm.num_prefix_hits - hits == sound
        assert worker.errors == []
        bm.check_invariants()
