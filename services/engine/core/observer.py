"""What the engine loop tells an observer (metrics) about its steps. Plain Python (no gRPC, no Prometheus).

The loop calls the observer at three points, on its own thread: a step was scheduled
(``on_scheduled``), a step's sampled tokens were applied (``on_tokens``, the sequences that got
one), a sequence left the engine for any reason (``on_finished``, once per sequence). Counters the
scheduler and block manager keep themselves (preemptions, prefix-cache queries and hits) are read
by the observer, not pushed. ``NullObserver`` is the default: the loop's tests need no metrics.
The Prometheus implementation is ``services.engine.metrics.GenerationStats``.
"""
from __future__ import annotations

from typing import Protocol

from services.engine.core.scheduler import SchedulerOutput
from services.engine.core.sequence import Sequence


class StepObserver(Protocol):
    def on_scheduled(self, out: SchedulerOutput) -> None:
        """A step was scheduled (its new sequences leave the queue now)."""

    def on_tokens(self, seqs: list[Sequence]) -> None:
        """A step ended: each of ``seqs`` got one new token."""

    def on_finished(self, seq: Sequence) -> None:
        """``seq`` left the engine (any reason); called once per sequence."""


class NullObserver:
    """Observes nothing: the loop calls it and nothing happens."""

    def on_scheduled(self, out: SchedulerOutput) -> None:
        pass

    def on_tokens(self, seqs: list[Sequence]) -> None:
        pass

    def on_finished(self, seq: Sequence) -> None:
        pass
