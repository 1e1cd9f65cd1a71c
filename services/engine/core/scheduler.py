"""Continuous-batching scheduler (vLLM V1 style). Plain Python: no torch, no gRPC.

There are no prefill and decode phases: every sequence has computed tokens catching up to its
tokens. Each step gets a token budget (``max_num_batched_tokens``) and a cap on sequences
(``max_num_seqs``). Running sequences are served first (one decode token each, or the next
chunk of a long prefill), then waiting ones in arrival order (their prompt, chunked to the budget
that is left, after the part of their prompt found in the prefix cache). When KV blocks run out, the newest running sequence is preempted: its blocks are
freed and it goes back to the front of the queue, to be recomputed later.

With a ``Speculator`` (speculative decoding, ``speculation.py``), a decode row may carry a draft: the
sequence's last token and k guessed tokens, one multi-token row. Its KV slots are allocated with the
row; when the step's result is read, the accepted tokens are appended (stopping at EOS, max_tokens or
the context, as one token at a time would) and the blocks past them are given back.

One step stays in flight, so a sequence's next row is scheduled before its row in flight has been read.
After a plain row the next row's input is the token the worker sampled (``input_is_last_sampled``). After
a draft row even the position of that token is not known (it depends on how much of the draft holds), so
the next row is a *guessed* row: the worker runs it at the position the draft row left, and, where the
speculator could guess that row's token and draft after it (the context's match continued past the draft
in flight), the guess and the draft run too when the guess holds. When the row in flight is read the guessed
row is resolved to what the worker runs (``_settle``), so that its own result is read like any other row.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from services.engine.core.block_manager import BlockManager
from services.engine.core.sequence import FinishReason, Sequence, SequenceStatus, TokenLogprob
from services.engine.core.speculation import Speculator


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64                 # sequences in one step
    max_num_batched_tokens: int = 512      # tokens (prefill + decode) in one step
    max_model_len: int = 8192              # context length of the model
    eos_token_ids: frozenset[int] = frozenset()
    # Most prompt tokens one sequence may prefill in one step (0 = the whole budget). A long prompt
    # then leaves room in every step for the decodes and the short prompts queued behind it
    # (vLLM's long_prefill_token_threshold).
    long_prefill_token_threshold: int = 0
    # Most long prompts (more than the threshold left to prefill) prefilling at once; a short prompt
    # queued behind a long one that has to wait goes first (vLLM's max_long_partial_prefills). So a
    # few long prompts take one share of each step, not the whole budget, and short prompts keep
    # their time to first token.
    max_long_partial_prefills: int = 1

    def is_long(self, remaining: int) -> bool:
        return 0 < self.long_prefill_token_threshold < remaining

    def prefill_chunk(self, remaining: int, budget: int, alone: bool = False) -> int:
        """Tokens of a sequence with ``remaining`` uncomputed tokens to run in a step with ``budget`` left.
        A sequence ``alone`` (nothing else running or waiting) is not capped: there is nobody to leave room for."""
        cap = self.long_prefill_token_threshold
        return min(remaining, budget, cap) if cap > 0 and not alone else min(remaining, budget)


class ScheduledSeq(NamedTuple):
    seq: Sequence
    start_pos: int          # tokens already computed before this step
    num_tokens: int         # tokens run this step
    sample: bool            # the step reaches the sequence's last token, so a new token is sampled
    draft: tuple[int, ...] = ()   # speculative draft: the row is the last token + these (num_tokens = 1 + len)
    # A guessed row (the sequence's draft row, or its plain row, is in flight): its first token is the token that
    # row samples, guessed (-1: no guess), and start_pos assumes its whole draft holds; the worker runs the guess
    # and the draft only when both hold, else the sampled token alone where the row in flight left off.
    guess: int | None = None


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    released_seq_ids: list[int] = field(default_factory=list)   # finished/preempted since the last step
    guessed: dict[int, int] = field(default_factory=dict)   # seq id -> index in scheduled of its guessed row
    # For the speculation gate (speculation.SpeculationGate): the sequences running when it was scheduled, and
    # whether speculation was allowed (None: not a step the gate measures: no speculation possible, or a prefill
    # chunk in it; the gate records whether a draft row ran); the engine sets the send time and the seconds from
    # the previous result to its own.
    batch: int = 0
    speculated: bool | None = None
    sent_at: float = 0.0
    seconds: float = 0.0

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class SampledToken(NamedTuple):
    token_id: int
    logprob: TokenLogprob | None = None
    error: str = ""          # the worker could not run or sample this sequence: it fails alone
    accepted: tuple[int, ...] = ()   # a draft row: the draft tokens verified, which come before token_id


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, speculator: Speculator | None = None):
        self.config = config
        self.block_manager = block_manager
        self.speculator = speculator if speculator is not None and speculator.enabled else None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._released: list[int] = []
        self._latest: SchedulerOutput | None = None   # the last step scheduled (in flight while the one before is read)
        self.num_preemptions = 0
        self.num_finished = 0

    # -- requests in and out -------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: FinishReason, detail: str = "") -> None:
        """End ``seq`` (any state) and free its blocks at once. No-op if already finished.
        ``detail`` says why, for the error reasons."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        # (a failed sequence's KV is not trusted: no tail of it is kept for a later prompt to continue)
        self.block_manager.free(seq, keep_tail=reason not in (FinishReason.ERROR, FinishReason.UNAVAILABLE))
        seq.draft_in_flight = ()
        if self.speculator is not None:
            self.speculator.on_finished(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_detail = detail
        self._released.append(seq.seq_id)
        self.num_finished += 1

    def preempt_all(self) -> list[Sequence]:
        """Send every running sequence back to the queue (the worker lost its KV memory)."""
        victims = list(self.running)
        for seq in reversed(victims):
            self._preempt(seq, kv_lost=True)
        return victims

    # -- one step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        long_slots = self.config.max_long_partial_prefills
        preempted = False
        spec = None
        out.batch = len(self.running)
        if self.speculator is not None and self.speculator.step_allowed(out.batch):
            # Without a sequence that may speculate the step is a plain one, measured as such.
            out.speculated = (any(self.speculator.eligible(seq) for seq in self.running)
                              and self.speculator.gate.allow(out.batch))
            spec = self.speculator if out.speculated else None
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self._will_finish(seq):
                i += 1   # the steps in flight bring its last token
                continue
            remaining = seq.num_tokens + seq.num_pending_tokens - seq.num_computed_tokens
            draft: list[int] = []
            guess: int | None = None
            if seq.draft_in_flight or seq.num_pending_tokens:
                # Its row in flight samples the token this row starts with: guess it and draft after it.
                guessed = (spec.propose_after(seq, budget, len(self.running))
                           if spec is not None and spec.eligible(seq) else [])
                if len(guessed) >= 2:
                    guess, draft = guessed[0], guessed[1:]
                elif seq.draft_in_flight:
                    guess = -1   # no guess: the sampled token, where the draft in flight leaves off
                remaining = 1
            elif spec is not None and remaining == 1 and spec.eligible(seq):
                draft = spec.propose(seq, budget, len(self.running))
            if self.config.is_long(remaining):
                if long_slots <= 0:
                    i += 1   # another long prompt has this step's share
                    continue
                long_slots -= 1
            n = 1 + len(draft) if draft else self.config.prefill_chunk(
                remaining, budget, alone=len(self.running) == 1 and not self.waiting)
            while not self.block_manager.can_allocate(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # seq preempted itself: nothing newer is left to run
            self._schedule(out, seq, n, tuple(draft), guess)
            budget -= n
            i += 1
        # New work only when nothing had to be preempted: admitting it would evict it again. In arrival
        # order, except that a long prompt with no free long-prefill slot lets the prompts behind it go.
        j = 0
        while (j < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs
               and not preempted):
            seq = self.waiting[j]
            cached = self.block_manager.find_prefix(seq)
            remaining = seq.num_tokens - cached.num_tokens
            if self.config.is_long(remaining):
                if long_slots <= 0:
                    j += 1
                    continue
                long_slots -= 1
            n = self.config.prefill_chunk(remaining, budget, alone=not self.running and len(self.waiting) == 1)
            if not self.block_manager.can_allocate_with_prefix(seq, cached, n):
                break
            self.block_manager.take_prefix(seq, cached)
            del self.waiting[j]
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._schedule(out, seq, n)
            budget -= n
        if out.scheduled:   # an empty step is not sent: its releases wait for the next one
            out.released_seq_ids, self._released = self._released, []
            self._latest = out
        if out.speculated is not None and any(not s.sample or (s.num_tokens > 1 and not s.draft) for s in out.scheduled):
            out.speculated = None   # a prefill chunk's cost would swamp what the gate compares
        return out

    def update(self, out: SchedulerOutput, sampled: dict[int, SampledToken]) -> list[Sequence]:
        """Apply a step's results; returns the sequences that got a new token (some now finished)."""
        got: list[Sequence] = []
        following = self._latest if self._latest is not out else None   # the step in flight after this one
        for s in out.scheduled:
            seq = s.seq
            if seq.is_finished or seq.status is not SequenceStatus.RUNNING:
                continue   # (its result dropped: a guessed row of a sequence that ended is never settled)
            assert s.guess is None, "a guessed row is settled when the row before it is read"
            seq.num_new_tokens = 0
            token = sampled.get(seq.seq_id)
            if token is not None and token.error:
                # Its KV for this step is unreliable: nothing is cached, the blocks go back.
                self.finish(seq, FinishReason.ERROR, token.error)
                got.append(seq)
                continue
            if s.draft:
                self._verified(s, sampled[seq.seq_id], following)
                got.append(seq)
                continue
            self.block_manager.cache_full_blocks(seq, s.start_pos + s.num_tokens)
            if not s.sample:
                continue
            token = sampled[seq.seq_id]
            seq.num_pending_tokens -= 1
            seq.num_new_tokens = 1
            seq.output_token_ids.append(token.token_id)
            if token.logprob is not None:
                seq.output_logprobs.append(token.logprob)
            reason = self._stop_reason(seq, token.token_id)
            if reason is not None:
                self.finish(seq, reason)
            else:
                self._settle(seq, following)
            got.append(seq)
        if out.speculated is not None and self.speculator is not None:
            # What ran (its guessed rows settled): a step with a draft row against a step without one.
            self.speculator.gate.record(out.batch, any(s.draft for s in out.scheduled),
                                        sum(seq.num_new_tokens for seq in got), out.seconds)
        return got

    def _verified(self, s: ScheduledSeq, token: SampledToken, following: SchedulerOutput | None) -> None:
        """A draft row's result: the accepted draft tokens and the worker's own, appended one by one as
        a decode step at a time would (the first EOS, max_tokens or the context ends the sequence there);
        the KV of the rejected draft tokens is dropped and the blocks only they used are given back."""
        seq = s.seq
        seq.draft_in_flight = ()
        accepted = token.accepted[:len(s.draft)]
        assert self.speculator is not None
        # No token of the worker's own (-1): it stopped at a near tie, which a one-token step decides next.
        self.speculator.on_verified(seq, len(s.draft), len(accepted), tie=token.token_id < 0)
        reason = None
        for token_id in (*accepted, *((token.token_id,) if token.token_id >= 0 else ())):
            seq.output_token_ids.append(token_id)
            seq.num_new_tokens += 1
            reason = self._stop_reason(seq, token_id)
            if reason is not None:
                break
        # KV holds: the row's first token and the accepted drafts (the last token appended has none yet).
        seq.num_computed_tokens = min(s.start_pos + 1 + len(accepted), seq.num_tokens - 1)
        self.block_manager.cache_full_blocks(seq, seq.num_computed_tokens)
        if reason is not None:
            self.finish(seq, reason)
        elif not self._settle(seq, following):
            self.block_manager.trim(seq, seq.num_tokens)

    def _settle(self, seq: Sequence, following: SchedulerOutput | None) -> bool:
        """``seq``'s row in flight has just been read: resolve its guessed row in ``following`` (the step sent
        after it) to what the worker runs, exactly as the worker does (``ModelRunner._resolve``): the guess and
        its draft when the guess is the token just sampled at the position the guessed row assumed; else the
        sampled token alone, a plain row where the sequence stands. False when it has no guessed row."""
        i = following.guessed.get(seq.seq_id) if following is not None else None
        if i is None:
            return False
        g = following.scheduled[i]
        assert g.seq is seq and g.guess is not None
        held = g.guess >= 0 and seq.num_tokens - 1 == g.start_pos and seq.output_token_ids[-1] == g.guess
        if g.guess >= 0 and self.speculator is not None:
            self.speculator.on_guess(held)
        if held:
            following.scheduled[i] = ScheduledSeq(seq, g.start_pos, g.num_tokens, True, g.draft)
            seq.num_computed_tokens = g.start_pos + g.num_tokens
            seq.draft_in_flight = g.draft   # (a row with a guess always carries a draft: schedule)
            seq.num_pending_tokens = 0
        else:
            following.scheduled[i] = ScheduledSeq(seq, seq.num_tokens - 1, 1, True)
            seq.num_computed_tokens = seq.num_tokens
            seq.draft_in_flight = ()
            seq.num_pending_tokens = 1
            self.block_manager.trim(seq, seq.num_tokens)   # the slots the guess and its draft were given
        return True

    def _stop_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        if not seq.sampling.ignore_eos and token_id in self.config.eos_token_ids:
            return FinishReason.STOP
        if seq.num_output_tokens >= seq.sampling.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _will_finish(self, seq: Sequence) -> bool:
        """The tokens steps in flight may sample reach ``seq``'s length limit: nothing more to run (until the
        step in flight is read, for a draft that may not hold in full)."""
        ahead = seq.num_pending_tokens + (1 + len(seq.draft_in_flight) if seq.draft_in_flight else 0)
        return bool(ahead) and (seq.num_output_tokens + ahead >= seq.sampling.max_tokens
                                or seq.num_tokens + ahead >= self.config.max_model_len)

    def _schedule(self, out: SchedulerOutput, seq: Sequence, n: int, draft: tuple[int, ...] = (),
                  guess: int | None = None) -> None:
        """Run ``n`` more tokens of ``seq`` this step. They count as computed from now on, and a step that
        reaches the end samples a token not known until its result is read (pending): so the next step can
        be scheduled, and sent, while this one runs. A draft row (the last token and ``draft``) counts its
        whole row as computed until its result says how much of it holds. A guessed row (``guess`` not None)
        follows the sequence's row in flight; it is settled when that row is read (``_settle``)."""
        self.block_manager.allocate(seq, n)
        start = seq.num_computed_tokens
        if guess is not None:
            out.guessed[seq.seq_id] = len(out.scheduled)
            out.scheduled.append(ScheduledSeq(seq, start, n, True, draft, guess))
            seq.num_computed_tokens = start + n
            return
        if draft:
            out.scheduled.append(ScheduledSeq(seq, start, n, True, draft))
            seq.num_computed_tokens = start + n
            seq.draft_in_flight = draft
            return
        sample = start + n == seq.num_tokens + seq.num_pending_tokens
        out.scheduled.append(ScheduledSeq(seq, start, n, sample))
        seq.num_computed_tokens = start + n
        if sample:
            seq.num_pending_tokens += 1

    def _preempt(self, seq: Sequence, kv_lost: bool = False) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq, keep_tail=not kv_lost)
        seq.num_computed_tokens = 0
        seq.num_pending_tokens = 0   # a step in flight samples for it no more: its result is dropped
        seq.draft_in_flight = ()
        seq.status = SequenceStatus.PREEMPTED
        self.waiting.appendleft(seq)
        self._released.append(seq.seq_id)
        self.num_preemptions += 1
