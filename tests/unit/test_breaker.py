"""The per-engine circuit breaker, with time passed in."""
from __future__ import annotations

from services.router.breaker import BreakerState, CircuitBreaker


def test_opens_after_failures_in_a_row_and_recovers_through_one_trial():
    b = CircuitBreaker(failure_threshold=3, cooldown=1.0)
    for t in range(2):
        b.on_failure(t)
        assert b.allows(t)
    b.on_failure(2.0)
    assert b.state is BreakerState.OPEN and not b.allows(2.5)
    assert b.allows(3.0)                  # half-open: one trial
    b.on_call()
    assert not b.allows(3.1)              # only one at a time
    b.on_success()
    assert b.state is BreakerState.CLOSED and b.allows(3.2)


def test_failed_trial_doubles_the_cooldown():
    b = CircuitBreaker(failure_threshold=1, cooldown=1.0, max_cooldown=3.0)
    b.on_failure(0.0)
    assert b.allows(1.0)
    b.on_call()
    b.on_failure(1.0)
    assert not b.allows(2.5) and b.allows(3.0)
    b.on_call()
    b.on_failure(3.0)
    assert not b.allows(5.9) and b.allows(6.0)   # capped at max_cooldown


def test_success_resets_the_count():
    b = CircuitBreaker(failure_threshold=2)
    b.on_failure(0.0)
    b.on_success()
    b.on_failure(1.0)
    assert b.state is BreakerState.CLOSED
