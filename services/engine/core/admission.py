"""Admission control: a bounded queue that says no, with a hint of when to come back.

The engine queues at most ``max_queue`` sequences (waiting to be scheduled, preempted ones
included). A request that would go past it is refused at once with RESOURCE_EXHAUSTED, before
it costs anything, rather than joining a queue whose wait nobody would accept.

The count is of *sequences*: those in the scheduler's queue plus those handed to the engine
loop and not yet picked up. Messages that are not sequences (an abort, say, when 50 calls expire
at once) are never counted: they cost the loop nothing and would refuse real requests.

The retry hint is the time the engine needs, at its recent finish rate, to clear a tenth of its
queue (between ``MIN_RETRY_MS`` and ``MAX_RETRY_MS``; ``IDLE_RETRY_MS`` when it has finished
nothing lately). A tenth, so that a crowd refused together comes back spread over the time the
queue takes to move, not all at once into a queue just as full. Plain Python, thread-safe.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable

from services.common.errors import ResourceExhausted

MIN_RETRY_MS = 100
MAX_RETRY_MS = 30_000
IDLE_RETRY_MS = 1_000
RATE_WINDOW_SECONDS = 10.0     # finishes older than this do not count towards the rate


class Admission:
    def __init__(self, max_queue: int, clock: Callable[[], float] = time.monotonic):
        self.max_queue = max_queue
        self._clock = clock
        self._lock = threading.Lock()
        self._num_handed_over = 0                  # admitted, not yet in the scheduler's queue
        self._finishes: deque[tuple[float, int]] = deque()  # (when, num_finished) samples

    # -- the request side ------------------------------------------------------------------

    def admit(self, num_seqs: int, num_queued: int) -> None:
        """Reserve room for ``num_seqs`` sequences (all or none) given ``num_queued`` in the
        scheduler's queue; raise ResourceExhausted with a retry hint when they do not fit."""
        with self._lock:
            waiting = num_queued + self._num_handed_over
            if waiting + num_seqs > self.max_queue:
                hint = self._retry_after_ms(waiting)
                what = f"{num_seqs} sequences" if num_seqs > 1 else "a request"
                raise ResourceExhausted(
                    f"the engine is full: {waiting} sequences wait (--max-queue {self.max_queue}), no room for "
                    f"{what}; retry in {hint} ms or on another engine", retry_after_ms=hint)
            self._num_handed_over += num_seqs

    # -- the engine loop's side ------------------------------------------------------------

    def picked_up(self, num_seqs: int = 1) -> None:
        """The loop moved admitted sequences into the scheduler's queue (or dropped them)."""
        with self._lock:
            self._num_handed_over -= num_seqs

    def on_finished(self, num_finished_total: int) -> None:
        """Record the scheduler's finish counter, for the rate behind the retry hint."""
        now = self._clock()
        with self._lock:
            if not self._finishes or self._finishes[-1][1] != num_finished_total:
                self._finishes.append((now, num_finished_total))
            while len(self._finishes) > 1 and now - self._finishes[0][0] > RATE_WINDOW_SECONDS:
                self._finishes.popleft()

    # -- views ------------------------------------------------------------------------------

    def num_waiting(self, num_queued: int) -> int:
        with self._lock:
            return num_queued + self._num_handed_over

    def retry_after_ms(self, num_queued: int) -> int:
        with self._lock:
            return self._retry_after_ms(num_queued + self._num_handed_over)

    def _retry_after_ms(self, waiting: int) -> int:
        rate = self._finish_rate()
        if rate <= 0:
            return IDLE_RETRY_MS
        ms = 1000.0 * max(1, waiting // 10) / rate
        return int(min(MAX_RETRY_MS, max(MIN_RETRY_MS, ms)))

    def _finish_rate(self) -> float:
        """Sequences finished per second over the window (0 when unknown)."""
        if len(self._finishes) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self._finishes[0], self._finishes[-1]
        if self._clock() - t1 > RATE_WINDOW_SECONDS:
            return 0.0   # nothing finished lately: the rate is unknown, not the old one
        return (n1 - n0) / max(t1 - t0, 1e-3)
