"""Draft-free speculative decoding in the scheduler: when a decode row carries a draft, and how long.

A speculating decode row runs the sequence's last token and a draft of k tokens guessed by a proposer
(``proposers/``) as one multi-token row of the ragged step; the worker verifies the draft (exact for
greedy, rejection sampling otherwise) and returns the accepted draft tokens plus one token of its own,
so a step yields 1 to k + 1 tokens for that sequence.

One step stays in flight, and a draft must follow the token the step in flight samples, which the
engine does not know yet. So a speculating sequence runs *without overlap*: while its own step is in
flight it is left out of the next one, and its draft is proposed once the token has arrived. To keep
that from costing the sequences that gain nothing, a sequence waits only when it is likely to speculate
(its known context already matches at the longest lookup length, so the proposer will very likely find
a draft) and is not backed off;
otherwise its decode row runs as without speculation, overlapped (see docs/speculative-decoding.md).

Never slower: speculation is off for a step when more sequences run than ``max_batch`` (a wide batch
already keeps the worker's matmuls busy; extra rows cost compute, and a speculating sequence gives up the
step overlap; measured here in native: 2, 3 and 4 copy-heavy streams ran 0.95x, 0.93x and 0.87-0.95x
speculation off, one stream 1.97x, so the default is 1), drafts shrink as the batch widens (at
most k / sequences running, at least ``MIN_DRAFT``), and per sequence it backs off after
drafts that were rejected: after ``n`` drafts in a row with nothing accepted it stops for 2^(n+1) tokens
(at most ``MAX_BACKOFF``). The draft length follows the sequence's acceptance: twice the last number
of accepted tokens plus one (at least ``MIN_DRAFT``; ``FIRST_DRAFT`` before any), at most k.

Exact where it must be: requests that want logprobs are not speculated (a draft's logprobs would come
from a different row shape), nor requests that opt out (``SamplingOptions.speculate``). Constrained
requests are: the worker cuts a draft at the first token the grammar forbids, masks each verification
row, and rolls its matcher back over what verification rejects (``services/worker/constraints.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from services.engine.core.proposers.ngram import NgramProposer
from services.engine.core.proposers.suffix import SuffixProposer
from services.engine.core.sequence import Sequence

METHODS = ("none", "ngram", "suffix")
MAX_BACKOFF = 64    # most tokens a sequence decodes plainly after failed drafts before it tries again
MIN_DRAFT = 2
FIRST_DRAFT = 4     # a sequence's first draft: a 9-token row costs ~2.95 one-token steps (native, AVX-512 VNNI; 4.4 AVX2)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "none"                 # none | ngram | suffix
    num_speculative_tokens: int = 8      # most draft tokens per step (k)
    prompt_lookup_min: int = 3           # shortest suffix match that proposes
    prompt_lookup_max: int = 4           # longest suffix match looked up
    max_batch: int = 1                   # speculate only while at most this many sequences run (see below)
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

    @property
    def enabled(self) -> bool:
        return self.method != "none"


class Proposer(Protocol):
    def propose(self, seq_id: int, tokens: list[int], k: int) -> tuple[list[int], int]: ...
    def forget(self, seq_id: int) -> None: ...
    def on_finished(self, output: list[int]) -> None: ...


@dataclass
class _SeqState:
    misses_in_a_row: int = 0
    resume_at: int = 0          # output length from which it may speculate again (backoff)
    last_accepted: int = -1     # accepted tokens of its last draft (-1: none yet)
    waited: bool = False        # it sat out a step for its token in flight, to draft after it


@dataclass
class SpecCounters:
    """vLLM's spec-decode counters (read by the metrics observer)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        config.validate()
        self.config = config
        self.max_model_len = max_model_len
        self.proposer: Proposer | None = None
        if config.method == "ngram":
            self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        elif config.method == "suffix":
            self.proposer = SuffixProposer(config.prompt_lookup_min, config.prompt_lookup_max,
                                           config.suffix_cache_tokens)
        self._state: dict[int, _SeqState] = {}
        self.counters = SpecCounters(accepted_per_pos=[0] * config.num_speculative_tokens)
        self.num_waits = 0      # steps a sequence sat out to draft after its token in flight

    @property
    def enabled(self) -> bool:
        return self.proposer is not None

    def step_allowed(self, num_running: int) -> bool:
        return self.proposer is not None and num_running <= self.config.max_batch

    def eligible(self, seq: Sequence) -> bool:
        s = seq.sampling
        if self.proposer is None or not s.speculate or s.logprobs is not None:
            return False
        state = self._state.get(seq.seq_id)
        return state is None or seq.num_output_tokens >= state.resume_at

    def likely(self, seq: Sequence) -> bool:
        """Whether ``seq``, with a token in flight, would probably get a draft once it arrives: its
        known context already matches (the draft after the new token is that match's continuation)."""
        assert self.proposer is not None
        draft, n = self.proposer.propose(seq.seq_id, seq.token_ids(0, seq.num_tokens), 1)
        # Only a match of the longest length looked up: a wait idles the worker for this sequence, and a
        # short match (common in free text) seldom continues into an accepted draft.
        if draft and n >= self.config.prompt_lookup_max:
            self._state.setdefault(seq.seq_id, _SeqState()).waited = True
            self.num_waits += 1
            return True
        return False

    def propose(self, seq: Sequence, budget: int, num_running: int = 1) -> list[int]:
        """A draft for ``seq`` (no token in flight), cut to its limits: max_tokens (each accepted draft token
        and the bonus token are outputs), the context, ``budget`` tokens of this step (the row's own first
        token included), and k / ``num_running`` (at least ``MIN_DRAFT``): the rows of a wider step already
        fill the matmuls' passes, so each draft token there costs nearly a plain row's share."""
        assert self.proposer is not None
        state = self._state.setdefault(seq.seq_id, _SeqState())
        waited, state.waited = state.waited, False
        k = self.config.num_speculative_tokens
        k = min(k, max(MIN_DRAFT, k // max(1, num_running)))
        k = min(k, max(MIN_DRAFT, 2 * state.last_accepted + 1) if state.last_accepted >= 0 else FIRST_DRAFT)
        k = min(k, seq.sampling.max_tokens - seq.num_output_tokens - 1, self.max_model_len - seq.num_tokens,
                budget - 1)
        if k <= 0:
            return []
        draft, _ = self.proposer.propose(seq.seq_id, seq.token_ids(0, seq.num_tokens), k)
        if not draft and waited:
            self._missed(state, seq.num_output_tokens)   # it waited for nothing: as costly as a rejection
        return draft[:k]

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
