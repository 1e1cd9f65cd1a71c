"""A sequence: one prompt's tokens, progress and outcome. Plain Python (no torch, no gRPC)."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from services.common.sampling import SamplingOptions


class SequenceStatus(enum.Enum):
    WAITING = "waiting"          # queued, holds no KV blocks
    RUNNING = "running"          # holds KV blocks, scheduled every step
    PREEMPTED = "preempted"      # blocks taken back; waits to be recomputed from scratch
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"                # EOS token or a stop string
    LENGTH = "length"            # max_tokens or the model's context
    CANCELLED = "cancelled"      # client cancelled
    DEADLINE = "deadline"        # the call's deadline passed
    ERROR = "error"              # this request failed (e.g. its sampling); the engine serves the others: INTERNAL
    UNAVAILABLE = "unavailable"  # the engine cannot serve it (worker unrecoverable, shutting down): UNAVAILABLE


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class SeqEvent:
    """What a request's reader receives: new tokens/text, and the finish reason on the last event."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    error: str = ""

    def then(self, later: "SeqEvent") -> "SeqEvent":
        """This event followed by ``later``, as one (a slow reader gets fewer, larger messages)."""
        return SeqEvent(self.token_ids + later.token_ids, self.text + later.text, self.logprobs + later.logprobs,
                        later.finish_reason, later.error)


_ids = itertools.count(1)


@dataclass(eq=False)
class Sequence:
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    request_id: str = ""
    deadline: float | None = None           # time.monotonic() value
    seq_id: int = field(default_factory=lambda: next(_ids))
    output_token_ids: list[int] = field(default_factory=list)   # resumed after a failover: starts pre-filled
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0            # tokens whose K/V are in its blocks or written by a step already sent
    num_pending_tokens: int = 0             # output tokens that steps already sent will sample (not known yet)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)   # chained SHA-256 hashes of the full blocks, in order
    finish_reason: FinishReason | None = None
    finish_detail: str = ""                 # why, for ERROR / UNAVAILABLE: the message the client gets
    arrival_time: float = field(default_factory=time.monotonic)   # metrics: queue time, TTFT, e2e latency
    scheduled_time: float | None = None     # when it was first scheduled (the end of its queue time)
    # Speculative decoding (core/speculation.py): the draft a step in flight verifies for it (how many of
    # its tokens come back is not known until it is read; () when none), what it has been drafted and
    # accepted so far, and how many tokens the last step gave it.
    draft_in_flight: tuple[int, ...] = ()
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    num_new_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]
