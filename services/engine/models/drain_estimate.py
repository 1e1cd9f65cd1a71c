"""Whether an unload's drain can finish in its bound, from the work its requests in flight have left.

``remaining_tokens(scheduler)`` is the most tokens any of a model's sequences may still generate
(its ``max_tokens`` left, or its context left, whichever ends it first). ``DrainProgress`` watches
that number fall while the drain waits: once it has watched ``observe_seconds``, the rate it fell at
projects when the longest request ends. A drain that cannot end within its bound (with ``slack``
to spare) is given up at once, saying why, instead of holding the model's new requests off for the
whole bound and failing anyway. A model that makes no measurable progress (or does not report its
work) is not judged: the bound alone decides.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from services.engine.core.scheduler import Scheduler


def remaining_tokens(scheduler: Scheduler) -> int | None:
    """The most tokens one of the scheduler's sequences may still generate; None when unreadable now."""
    try:
        # Read from another thread than the engine loop's: copies, and a mutation mid-copy is "ask later".
        seqs = list(scheduler.running) + list(scheduler.waiting)
    except RuntimeError:
        return None
    limit = scheduler.config.max_model_len
    return max((min(s.sampling.max_tokens - s.num_output_tokens, limit - s.num_tokens) for s in seqs), default=0)


@dataclass
class DrainProgress:
    bound_seconds: float
    observe_seconds: float = 0.5         # watch this long before judging a rate
    slack: float = 1.5                   # give up only when the projection exceeds the time left this much
    clock: Callable[[], float] = time.monotonic
    _first: tuple[float, int] | None = field(default=None, init=False)

    def hopeless(self, remaining: int | None, left_seconds: float) -> str:
        """Why the drain cannot finish in the ``left_seconds`` it has ('' when it may, or cannot be told)."""
        if remaining is None:
            return ""
        now = self.clock()
        if self._first is None:
            self._first = (now, remaining)
            return ""
        t0, r0 = self._first
        if now - t0 < self.observe_seconds or remaining >= r0 or remaining <= 0:
            return ""
        rate = (r0 - remaining) / (now - t0)
        needed = remaining / rate
        if needed <= left_seconds * self.slack:
            return ""
        return (f"the longest request in flight has up to {remaining} tokens left, about {needed:.1f}s at the "
                f"{rate:.0f} tokens/s it runs at, past the drain's bound of {self.bound_seconds:.1f}s")
