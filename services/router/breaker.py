"""Per-engine circuit breaker: stop sending to an engine that keeps failing.

Closed (normal) → after ``failure_threshold`` failures in a row, open: the engine gets no
traffic for ``cooldown`` seconds (doubling on every failed trial, up to ``max_cooldown``) → then
half-open: one trial call is let through; its success closes the breaker, its failure opens it
again. Health checks and discovery say whether an engine is *up*; the breaker catches engines that
look up but fail calls. Time is passed in, so tests need no clock.
"""
from __future__ import annotations

import enum
import threading


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(self, failure_threshold: int = 3, cooldown: float = 1.0, max_cooldown: float = 30.0):
        self.failure_threshold = failure_threshold
        self.base_cooldown = cooldown
        self.max_cooldown = max_cooldown
        self.state = BreakerState.CLOSED
        self.num_failures = 0            # in a row
        self._cooldown = cooldown
        self._opened_at = 0.0
        self._trial_in_flight = False
        self._lock = threading.Lock()

    def allows(self, now: float) -> bool:
        """May a call go to this engine now? (Does not reserve the half-open trial.)"""
        with self._lock:
            if self.state is BreakerState.OPEN and now - self._opened_at >= self._cooldown:
                self.state = BreakerState.HALF_OPEN
                self._trial_in_flight = False
            return self.state is BreakerState.CLOSED or (self.state is BreakerState.HALF_OPEN and not self._trial_in_flight)

    def on_call(self) -> None:
        with self._lock:
            if self.state is BreakerState.HALF_OPEN:
                self._trial_in_flight = True

    def on_success(self) -> None:
        with self._lock:
            self.state = BreakerState.CLOSED
            self.num_failures = 0
            self._cooldown = self.base_cooldown
            self._trial_in_flight = False

    def on_failure(self, now: float) -> None:
        with self._lock:
            self.num_failures += 1
            if self.state is BreakerState.HALF_OPEN:
                self._cooldown = min(self._cooldown * 2, self.max_cooldown)
                self._open(now)
            elif self.num_failures >= self.failure_threshold:
                self._open(now)

    def _open(self, now: float) -> None:
        self.state = BreakerState.OPEN
        self._opened_at = now
        self._trial_in_flight = False
