"""An unload's drain has a bound callers see (issue 19): it waits at most the stated time, and a
request that arrives meanwhile is answered UNAVAILABLE at once with a retry hint, not held."""
from __future__ import annotations

import threading
import time

import pytest

from services.common.errors import FailedPrecondition, Unavailable
from services.engine.models.drain_estimate import DrainProgress
from tests.unit.test_admission import Clock
from tests.unit.test_model_manager import FakeModel, manager, use


def test_an_unload_that_cannot_drain_gives_up_at_its_bound_and_the_model_serves_on():
    m, log = manager({"a": 100}, 1000, wait=30)
    with m.use("a"):
        started = time.monotonic()
        with pytest.raises(FailedPrecondition, match=r"1 request\(s\) in flight after the drain's bound of 0.3s"):
            m.unload("a", drain_seconds=0.3)
        took = time.monotonic() - started
    assert 0.25 < took < 2.0, took
    use(m, "a")  # still loaded, serving: no second load
    assert log == ["load a"]
    m.check_invariants()


def test_the_call_deadline_bounds_the_drain_too():
    m, _ = manager({"a": 100}, 1000, wait=30)
    with m.use("a"):
        with pytest.raises(FailedPrecondition, match="bound of 0.2s"):
            m.unload("a", timeout=0.2, drain_seconds=60)


def test_a_request_during_a_drain_is_refused_at_once_with_a_retry_hint():
    m, log = manager({"a": 100}, 1000, wait=30)
    release = threading.Event()
    holding = threading.Event()
    outcome: list[object] = []

    def hold() -> None:
        with m.use("a"):
            holding.set()
            release.wait(10)

    def unload() -> None:
        try:
            outcome.append(m.unload("a", drain_seconds=10))
        except Exception as exc:  # noqa: BLE001 - reported in the test's thread
            outcome.append(exc)

    holder = threading.Thread(target=hold)
    holder.start()
    assert holding.wait(10)
    unloader = threading.Thread(target=unload)
    unloader.start()
    deadline = time.monotonic() + 5
    while m.snapshot()[0].in_flight and time.monotonic() < deadline:
        try:
            started = time.monotonic()
            use(m, "a")  # before the drain begins this is served
        except Unavailable as exc:
            refused, refused_in = exc, time.monotonic() - started
            break
    else:
        pytest.fail("no request was refused during the drain")
    assert refused_in < 0.5 and "being unloaded" in refused.message
    assert refused.retry_after_ms is not None and 100 <= refused.retry_after_ms <= 10_000
    release.set()
    holder.join(10)
    unloader.join(10)
    assert len(outcome) == 1 and outcome[0].was_loaded  # the drain finished: unloaded
    assert log == ["load a", "close a"]
    use(m, "a")  # and the next request loads it again
    assert log[-1] == "load a"


def test_drain_progress_judges_only_a_measured_rate():
    clock = Clock()
    p = DrainProgress(bound_seconds=10, clock=clock)
    assert p.hopeless(1000, 10) == ""          # first look: nothing to judge yet
    clock.now = 0.2
    assert p.hopeless(990, 9.8) == ""          # not watched long enough
    clock.now = 1.0
    assert p.hopeless(1000, 9) == ""           # no progress measured: the bound alone decides
    assert p.hopeless(None, 9) == ""           # a model that does not say
    verdict = p.hopeless(950, 9)               # 50 tokens/s: 950 tokens need 19 s > 9 s * 1.5
    assert "950 tokens left, about 19.0s at the 50 tokens/s" in verdict and "bound of 10.0s" in verdict
    assert p.hopeless(400, 9) == ""            # 600 tokens/s: 0.7 s, fine


class SlowStreams(FakeModel):
    """A generation model whose longest request has 10,000 tokens left, falling 200 a second."""

    started = time.monotonic()

    def remaining_tokens(self) -> int:
        return int(10_000 - 200 * (time.monotonic() - self.started))


def test_an_unload_that_cannot_drain_in_its_bound_gives_up_early_saying_why():
    m, log = manager({"a": 100}, 1000, wait=30, loader=lambda e: SlowStreams(e, []))
    with m.use("a"):
        SlowStreams.started = time.monotonic()
        started = time.monotonic()
        with pytest.raises(FailedPrecondition, match=r"cannot drain in time: .* tokens left, about \d+\.\ds .* "
                                                     r"bound of 10.0s"):
            m.unload("a", drain_seconds=10)
        took = time.monotonic() - started
    assert took < 3.0, took  # judged after ~0.5 s of watching, not at the 10 s bound
    use(m, "a")  # still serving
