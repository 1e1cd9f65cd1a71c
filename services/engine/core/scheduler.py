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
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from services.engine.core.block_manager import BlockManager
from services.engine.core.sequence import FinishReason, Sequence, SequenceStatus, TokenLogprob
from services.engine.core.speculation import Speculator


# Below this many rows a decode step costs about what one row does (measured in process, native: 1 row 6.9 ms, 3
# rows 9.5, 4-8 rows 10-12, 16 rows 22): a step of so few sequences is worth holding back for the rest (schedule)
FEW_ROWS = 4


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


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    released_seq_ids: list[int] = field(default_factory=list)   # finished/preempted since the last step
    # For the speculation gate (speculation.SpeculationGate): the sequences running when it was scheduled, and
    # whether it ran with speculation allowed (None: not a step the gate measures: no speculation possible, or
    # a prefill chunk in it); the engine sets the send time and the seconds from the previous result to its own.
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
        self.block_manager.free(seq)
        seq.spec_in_flight = False
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
            self._preempt(seq)
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
        waiting_on_flight = self._waiting_on_flight(spec)
        others = len(self.running) - len(waiting_on_flight)
        if waiting_on_flight and (others <= len(waiting_on_flight) or others < FEW_ROWS):
            # Much of the batch waits on the step in flight: a step of the others would cost nearly what a full
            # one does (a row's cost is mostly the weights' read, under FEW_ROWS rows nearly all of it) for a few
            # tokens, and put off the waiting sequences' rows by a step. Read that step's result first; the next
            # step carries everyone (lockstep).
            return out
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.seq_id in waiting_on_flight or self._will_finish(seq):
                i += 1   # the step in flight verifies its draft or brings the token to draft after; or its last
                continue
            remaining = seq.num_tokens + seq.num_pending_tokens - seq.num_computed_tokens
            draft: list[int] = []
            if spec is not None and remaining == 1 and not seq.num_pending_tokens and spec.eligible(seq):
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
            self._schedule(out, seq, n, tuple(draft))
            budget -= n
            i += 1
        # New work only when nothing had to be preempted: admitting it would evict it again. In arrival
        # order, except that a long prompt with no free long-prefill slot lets the prompts behind it go.
        j = 0
        while (j < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs
               and not preempted):
            seq = self.waiting[j]
            cached = self.block_manager.find_cached_prefix(seq)
            remaining = seq.num_tokens - len(cached) * self.block_manager.block_size
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
        if out.speculated is not None and any(not s.sample or (s.num_tokens > 1 and not s.draft) for s in out.scheduled):
            out.speculated = None   # a prefill chunk's cost would swamp what the gate compares
        return out

    def _waiting_on_flight(self, spec: Speculator | None) -> set[int]:
        """The running sequences that skip this step for speculation: the step in flight verifies their draft,
        or samples the token after which they would probably draft (no overlap for them)."""
        waiting: set[int] = set()
        if self.speculator is None:
            return waiting   # no speculation: nobody waits (and no walk over the batch every step)
        for seq in self.running:
            if seq.spec_in_flight:
                waiting.add(seq.seq_id)
            elif (spec is not None and seq.num_pending_tokens and spec.eligible(seq)
                  and seq.num_tokens + seq.num_pending_tokens - seq.num_computed_tokens == 1 and spec.likely(seq)):
                waiting.add(seq.seq_id)
        return waiting

    def update(self, out: SchedulerOutput, sampled: dict[int, SampledToken]) -> list[Sequence]:
        """Apply a step's results; returns the sequences that got a new token (some now finished)."""
        got: list[Sequence] = []
        for s in out.scheduled:
            seq = s.seq
            if seq.is_finished or seq.status is not SequenceStatus.RUNNING:
                continue
            seq.num_new_tokens = 0
            token = sampled.get(seq.seq_id)
            if token is not None and token.error:
                # Its KV for this step is unreliable: nothing is cached, the blocks go back.
                self.finish(seq, FinishReason.ERROR, token.error)
                got.append(seq)
                continue
            if s.draft:
                self._verified(s, sampled[seq.seq_id])
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
            got.append(seq)
        if out.speculated is not None and self.speculator is not None:
            self.speculator.gate.record(out.batch, out.speculated, sum(seq.num_new_tokens for seq in got), out.seconds)
        return got

    def _verified(self, s: ScheduledSeq, token: SampledToken) -> None:
        """A draft row's result: the accepted draft tokens and the worker's own, appended one by one as
        a decode step at a time would (the first EOS, max_tokens or the context ends the sequence there);
        the KV of the rejected draft tokens is dropped and the blocks only they used are given back."""
        seq = s.seq
        seq.spec_in_flight = False
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
        self.block_manager.trim(seq, seq.num_tokens)
        self.block_manager.cache_full_blocks(seq, seq.num_computed_tokens)
        if reason is not None:
            self.finish(seq, reason)

    def _stop_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        if not seq.sampling.ignore_eos and token_id in self.config.eos_token_ids:
            return FinishReason.STOP
        if seq.num_output_tokens >= seq.sampling.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _will_finish(self, seq: Sequence) -> bool:
        """The tokens steps in flight will sample reach ``seq``'s length limit: nothing more to run."""
        return bool(seq.num_pending_tokens) and (
            seq.num_output_tokens + seq.num_pending_tokens >= seq.sampling.max_tokens
            or seq.num_tokens + seq.num_pending_tokens >= self.config.max_model_len)

    def _schedule(self, out: SchedulerOutput, seq: Sequence, n: int, draft: tuple[int, ...] = ()) -> None:
        """Run ``n`` more tokens of ``seq`` this step. They count as computed from now on, and a step that
        reaches the end samples a token not known until its result is read (pending): so the next step can
        be scheduled, and sent, while this one runs. A draft row (the last token and ``draft``) counts its
        whole row as computed until its result says how much of it holds."""
        self.block_manager.allocate(seq, n)
        start = seq.num_computed_tokens
        if draft:
            out.scheduled.append(ScheduledSeq(seq, start, n, True, draft))
            seq.num_computed_tokens = start + n
            seq.spec_in_flight = True
            return
        sample = start + n == seq.num_tokens + seq.num_pending_tokens
        out.scheduled.append(ScheduledSeq(seq, start, n, sample))
        seq.num_computed_tokens = start + n
        if sample:
            seq.num_pending_tokens += 1

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_pending_tokens = 0   # a step in flight samples for it no more: its result is dropped
        seq.spec_in_flight = False
        seq.status = SequenceStatus.PREEMPTED
        self.waiting.appendleft(seq)
        self._released.append(seq.seq_id)
        self.num_preemptions += 1
