"""Draft-free speculative decoding in the scheduler: when a decode row carries a draft, and how long.

A speculating decode row runs the sequence's last token and a draft of k tokens guessed by a proposer
(``proposers/``) as one multi-token row of the ragged step; the worker verifies the draft (exact for
greedy, rejection sampling otherwise) and returns the accepted draft tokens plus one token of its own,
so a step yields 1 to k + 1 tokens for that sequence.

One step stays in flight, and a draft must follow the token the step in flight samples, which the
engine does not know yet. So the row after a sequence's row in flight starts with a *guess* of that token:
the proposer's continuation of the context (with the draft in flight taken as accepted), whose first token
is the guess and the rest a draft after it (``propose_after``). The worker runs the guess and its draft
when the guess is the token it sampled, at the position the guess assumed (the draft in flight held in
full), and otherwise the sampled token alone, where the row in flight left off (scheduler.py). So a
speculating sequence keeps the step overlap: it never sits out a step (see docs/speculative-decoding.md).

Never slower: speculation is off for a step when more sequences run than ``max_batch`` (8 by default), and
below that a measured gate (``SpeculationGate``) decides per batch size: it times the steps with a draft row
and without (tokens a second of the worker's results) and keeps the faster, trying the other again now and
then. Whether verification rows pay depends on the CPU (a
16-row step costs 2.1x a 4-row one on a Xeon's AMX tiles, four 9-token rows 7.7x four one-token rows on an
AMD Zen 4), the batch and the text; the gate finds out on the machine it runs on (docs/speculative-decoding.md).
Drafts shrink as the batch widens (a step's rows at most ``STEP_ROWS``:
drafts of at most STEP_ROWS / sequences - 1, at least ``MIN_DRAFT``), and per sequence it backs off after
drafts that were rejected: after ``n`` drafts in a row with nothing accepted it stops for 2^(n+1) tokens
(at most ``MAX_BACKOFF``). The draft length follows the sequence's acceptance: twice the last number
of accepted tokens plus one (at least ``MIN_DRAFT``; ``FIRST_DRAFT`` before any), at most k.

Exact where it must be: requests that want logprobs are not speculated (a draft's logprobs would come
from a different row shape), nor requests that opt out (``SamplingOptions.speculate``). Constrained
requests are: the worker cuts a draft at the first token the grammar forbids, masks each verification
row, and rolls its matcher back over what verification rejects (``services/worker/constraints.py``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

from services.engine.core.proposers.ngram import NgramProposer
from services.engine.core.proposers.suffix import SuffixProposer
from services.engine.core.sequence import Sequence

log = logging.getLogger("llmserve.engine.speculation")

METHODS = ("none", "ngram", "suffix")
MAX_BACKOFF = 64    # most tokens a sequence decodes plainly after failed drafts before it tries again
MIN_DRAFT = 2
FIRST_DRAFT = 7     # a sequence's first draft, before any acceptance is known: the default k. An 8-row step costs
                    # 1.5-1.7 one-token steps (native, avx512 build, tiles in pairs; 2.95 when this was 4), so
                    # a full first draft pays from about one accepted token (docs/speculative-decoding.md)
STEP_ROWS = 16      # a wider step's drafts fill at most this many rows: one pass of the 16-row kernel tiles


def draft_cap(num_running: int) -> int:
    """The most draft tokens a row may carry while ``num_running`` sequences share a step: the step's rows within
    ``STEP_ROWS``, at least ``MIN_DRAFT``."""
    return max(MIN_DRAFT, STEP_ROWS // max(1, num_running) - 1)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "none"                 # none | ngram | suffix
    num_speculative_tokens: int = 7      # most draft tokens per step (k): 1 + 7 rows, one pass of the block kernels
    prompt_lookup_min: int = 3           # shortest suffix match that proposes
    prompt_lookup_max: int = 4           # longest suffix match looked up
    max_batch: int = 8                   # speculate only while at most this many sequences run (see below)
    gate_steps: int = 16                 # steps with drafts and without at a batch size before the gate compares (0: no gate)
    suffix_cache_tokens: int = 65536     # tokens of recent outputs the suffix method keeps

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"--speculative-method must be one of {', '.join(METHODS)}, not {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError("--num-speculative-tokens must be in [1, 32]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 16:
            raise ValueError("need 1 <= --prompt-lookup-min <= --prompt-lookup-max <= 16")
        if self.max_batch < 1:
            raise ValueError("--speculative-max-batch must be >= 1")
        if self.suffix_cache_tokens < 1:
            raise ValueError("--suffix-cache-tokens must be >= 1")
        if not 0 <= self.gate_steps <= SpeculationGate.RETRY // 2:
            # (more would leave the retries, the last gate_steps decisions of every RETRY, no room for the faster side)
            raise ValueError(f"--speculative-gate-steps must be in [0, {SpeculationGate.RETRY // 2}]")

    @property
    def enabled(self) -> bool:
        return self.method != "none"


class Proposer(Protocol):
    def propose(self, seq_id: int, tokens: list[int], k: int, known: int | None = None) -> tuple[list[int], int]: ...
    def forget(self, seq_id: int) -> None: ...
    def on_finished(self, output: list[int]) -> None: ...


@dataclass
class _SeqState:
    misses_in_a_row: int = 0
    resume_at: int = 0          # output length from which it may speculate again (backoff)
    last_accepted: int = -1     # accepted tokens of its last draft (-1: none yet)


@dataclass
class SpecCounters:
    """vLLM's spec-decode counters (read by the metrics observer)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    num_guesses: int = 0          # guesses of a token in flight (guessed rows with a guess)
    num_guesses_held: int = 0     # of those, the ones that held (their drafts then ran)


@dataclass
class _Rate:
    """A side's recent tokens and seconds, exponentially weighted (each new step WEIGHT of the sums)."""

    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    def add(self, tokens: int, seconds: float, weight: float) -> None:
        keep = 1.0 - weight if self.steps else 0.0
        self.tokens = keep * self.tokens + weight * tokens
        self.seconds = keep * self.seconds + weight * seconds
        self.steps += 1

    @property
    def per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class SpeculationGate:
    """Per batch size (sequences running), whether decode steps with a draft row yield more tokens a second than
    steps without one, measured on this machine: speculation is allowed until ``steps`` steps with drafts are
    measured, then (if fewer than ``steps`` without were) it is not until those are, then the faster side runs,
    and every ``RETRY`` decisions the slower one runs ``steps`` steps again (so a change in the workload or the
    machine is seen). A step's seconds run from the previous step's result to its own (from its sending if the
    worker was idle). What is compared is what ran: a step where speculation was allowed but nothing was drafted
    (text the model writes anew, a guess that did not hold) is a step without; so the rate with drafts is not
    diluted by stretches with nothing to copy, where it would be a coin toss against the rate without and, lost,
    would keep speculation off through the next copy-heavy stretch. (Since a speculating sequence keeps the step
    overlap, a draft costs nothing outside its own step.) ``steps`` 0: no gate, speculation always allowed."""

    WEIGHT = 1 / 16
    RETRY = 512

    def __init__(self, steps: int):
        self.steps = steps
        self._rates: dict[int, tuple[_Rate, _Rate]] = {}    # batch size -> (without, with)
        self._decisions: dict[int, int] = {}
        self._open: dict[int, bool] = {}

    def allow(self, batch: int) -> bool:
        if self.steps == 0:
            return True
        off, on = self._rates.setdefault(batch, (_Rate(), _Rate()))
        if on.steps < self.steps:
            return True
        if off.steps < self.steps:
            return False
        n = self._decisions[batch] = self._decisions.get(batch, 0) + 1
        better = on.per_second >= off.per_second
        if self._open.get(batch) != better:
            self._open[batch] = better
            log.info("speculation at %d running: %s (%.0f tokens/s with, %.0f without)", batch,
                     "on" if better else "off", on.per_second, off.per_second)
        # The slower side's retry closes each window of RETRY decisions (not opens it: right after both sides
        # are measured, the faster one runs).
        return (not better) if n % self.RETRY >= self.RETRY - self.steps else better

    def record(self, batch: int, speculated: bool, tokens: int, seconds: float) -> None:
        if self.steps and seconds > 0:
            self._rates.setdefault(batch, (_Rate(), _Rate()))[int(speculated)].add(tokens, seconds, self.WEIGHT)

    def rates(self) -> dict[int, tuple[float, float]]:
        """batch size -> (tokens/s without, with), for the metrics and tests."""
        # (a copy first: the engine loop may add a batch size while the metrics read)
        return {b: (off.per_second, on.per_second) for b, (off, on) in sorted(list(self._rates.items()))}


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        config.validate()
        self.config = config
        self.max_model_len = max_model_len
        self.proposer: Proposer | None = None
        if config.method == "ngram":
            self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        elif config.method == "suffix":
            self.proposer = SuffixProposer(config.prompt_lookup_min,
                                           config.suffix_cache_tokens)
        self._state: dict[int, _SeqState] = {}
        self.counters = SpecCounters(accepted_per_pos=[0] * config.num_speculative_tokens)
        self.gate = SpeculationGate(config.gate_steps)

    @property
    def enabled(self) -> bool:
        return self.proposer is not None

    def step_allowed(self, num_running: int) -> bool:
        """Whether a step of ``num_running`` sequences may carry drafts at all (``max_batch``); the gate then
        decides from its measurements (``gate.allow``)."""
        return self.proposer is not None and num_running <= self.config.max_batch

    def eligible(self, seq: Sequence) -> bool:
        s = seq.sampling
        if self.proposer is None or not s.speculate or s.logprobs is not None:
            return False
        state = self._state.get(seq.seq_id)
        return state is None or seq.num_output_tokens >= state.resume_at

    def propose(self, seq: Sequence, budget: int, num_running: int = 1) -> list[int]:
        """A draft for ``seq`` (no token in flight), cut to its limits: max_tokens (each accepted draft token
        and the bonus token are outputs), the context, ``budget`` tokens of this step (the row's own first
        token included), and ``STEP_ROWS`` / ``num_running`` - 1 (at least ``MIN_DRAFT``): the step's rows stay
        within one pass of the kernels' 16-row tiles, where a row costs less than past it."""
        assert self.proposer is not None
        k = self._draft_length(seq, budget, num_running, 0)
        if k <= 0:
            return []
        draft, _ = self.proposer.propose(seq.seq_id, seq.token_ids(0, seq.num_tokens), k)
        return draft[:k]

    def propose_after(self, seq: Sequence, budget: int, num_running: int = 1) -> list[int]:
        """For ``seq`` with a row in flight (a plain one, or a draft row taken as accepted in full): a guess of the
        token that row samples, then a draft after it (cut as ``propose`` cuts one); [] or the guess alone when
        there is no draft to verify after it."""
        assert self.proposer is not None
        ahead = seq.draft_in_flight
        k = self._draft_length(seq, budget - 1, num_running, len(ahead) + 1)
        if k <= 0:
            return []
        tokens = seq.token_ids(0, seq.num_tokens) + list(ahead)
        guessed, _ = self.proposer.propose(seq.seq_id, tokens, k + 1, known=seq.num_tokens)
        return guessed[:k + 1]

    def _draft_length(self, seq: Sequence, budget: int, num_running: int, ahead: int) -> int:
        """The most draft tokens for ``seq``'s next row, ``ahead`` tokens after its last known one."""
        state = self._state.setdefault(seq.seq_id, _SeqState())
        k = self.config.num_speculative_tokens
        k = min(k, draft_cap(num_running))
        k = min(k, max(MIN_DRAFT, 2 * state.last_accepted + 1) if state.last_accepted >= 0 else FIRST_DRAFT)
        return min(k, seq.sampling.max_tokens - seq.num_output_tokens - ahead - 1,
                   self.max_model_len - seq.num_tokens - ahead, budget - 1)

    def on_guess(self, held: bool) -> None:
        self.counters.num_guesses += 1
        self.counters.num_guesses_held += held

    @staticmethod
    def _missed(state: _SeqState, num_output_tokens: int) -> None:
        state.misses_in_a_row += 1
        state.resume_at = num_output_tokens + min(MAX_BACKOFF, 2 ** (state.misses_in_a_row + 1))

    def on_verified(self, seq: Sequence, num_draft: int, num_accepted: int, tie: bool = False) -> None:
        """A draft row's result; ``tie``: it stopped at a near tie, so the sequence's next row is a one-token
        decode (it decides the tie as speculation off would)."""
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += num_draft
        c.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            c.accepted_per_pos[pos] += 1
        state = self._state.setdefault(seq.seq_id, _SeqState())
        state.last_accepted = num_accepted
        if num_accepted == 0:
            self._missed(state, seq.num_output_tokens)
        else:
            state.misses_in_a_row = 0
        if tie:
            state.resume_at = max(state.resume_at, seq.num_output_tokens + num_accepted + 1)
        seq.spec_drafts += 1
        seq.spec_draft_tokens += num_draft
        seq.spec_accepted_tokens += num_accepted

    def on_finished(self, seq: Sequence) -> None:
        self._state.pop(seq.seq_id, None)
        if self.proposer is not None:
            self.proposer.forget(seq.seq_id)
            if seq.sampling.speculate:   # an opted-out request's output is not remembered either
                self.proposer.on_finished(seq.output_token_ids)
