"""The worker's step queue (services/worker/step_queue.py): a step stream's requests run in order on the compute
thread, back to back once started (step N+1, already queued, starts without a round trip through the event
loop), and the results come back in order; the stream's end, a close and a failing step each end it cleanly."""
from __future__ import annotations

import asyncio
import threading
from typing import AsyncIterator

import pytest

from services.worker.compute import ComputeThread
from services.worker.step_queue import StepQueue

DEADLINE = 10.0


class CountingCompute(ComputeThread):
    """The compute thread, counting the jobs handed to it."""

    def __init__(self) -> None:
        super().__init__()
        self.submitted = 0

    def submit(self, fn) -> None:  # type: ignore[no-untyped-def]
        self.submitted += 1
        super().submit(fn)


async def _requests(items: list[int]) -> AsyncIterator[int]:
    for item in items:
        yield item


def test_requests_queued_while_a_step_runs_follow_it_without_the_event_loop():
    compute = CountingCompute()
    first_running, release = threading.Event(), threading.Event()
    ran: list[tuple[int, int]] = []   # (request, thread)

    def run(request: int) -> str:
        ran.append((request, threading.get_ident()))
        if request == 1:
            first_running.set()
            release.wait(DEADLINE)
        return f"result {request}"

    # request 1 runs and blocks; 2 and 3 arrive meanwhile; then it is released
    async def scenario() -> list[str | None]:
        steps: StepQueue[int, str] = StepQueue(compute, run)
        gate = asyncio.Event()

        async def requests() -> AsyncIterator[int]:
            yield 1
            await asyncio.wait_for(asyncio.to_thread(first_running.wait, DEADLINE), DEADLINE)
            yield 2
            yield 3
            gate.set()

        feeding = asyncio.ensure_future(steps.feed(requests()))
        await asyncio.wait_for(gate.wait(), DEADLINE)
        release.set()
        results = [await asyncio.wait_for(steps.next_result(), DEADLINE) for _ in range(4)]
        await feeding
        return results

    results = asyncio.run(scenario())
    assert results == ["result 1", "result 2", "result 3", None]
    assert [r for r, _ in ran] == [1, 2, 3]
    compute_thread = compute._pool.submit(threading.get_ident).result(DEADLINE)
    assert {t for _, t in ran} == {compute_thread}
    assert compute.submitted == 1      # one job on the compute thread ran all three


def test_a_failing_step_raises_from_next_result_and_close_drops_queued_steps():
    compute = ComputeThread()
    ran: list[int] = []
    running, release = threading.Event(), threading.Event()

    def run(request: int) -> int:
        ran.append(request)
        if request == 1:
            running.set()
            release.wait(DEADLINE)
        if request == 2:
            raise RuntimeError("a bug in step 2")
        return request

    async def failing() -> None:
        steps: StepQueue[int, int] = StepQueue(compute, run)
        release.set()
        feeding = asyncio.ensure_future(steps.feed(_requests([1, 2, 3])))
        assert await asyncio.wait_for(steps.next_result(), DEADLINE) == 1
        with pytest.raises(RuntimeError, match="a bug in step 2"):
            await asyncio.wait_for(steps.next_result(), DEADLINE)
        assert await asyncio.wait_for(steps.next_result(), DEADLINE) == 3   # the stream goes on
        assert await asyncio.wait_for(steps.next_result(), DEADLINE) is None
        await feeding

    asyncio.run(failing())
    assert ran == [1, 2, 3]

    ran.clear()
    running.clear()
    release.clear()

    async def closing() -> None:
        steps: StepQueue[int, int] = StepQueue(compute, run)
        feeding = asyncio.ensure_future(steps.feed(_requests([1, 4, 5])))
        await feeding                      # all three queued
        await asyncio.wait_for(asyncio.to_thread(running.wait, DEADLINE), DEADLINE)   # 1 runs, blocked
        steps.close()
        release.set()

    asyncio.run(closing())
    assert compute._pool.submit(lambda: list(ran)).result(DEADLINE) == [1]   # 4 and 5 never ran
