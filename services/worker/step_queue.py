"""A step stream's requests, run back to back on the compute thread.

The engine keeps one step in flight: step N+1 reaches the worker while step N runs. Handed over one at a
time by the event loop (await the step, send its result, read the next, hand it over), every step began
with a round trip through the event loop: its wake-up, the result's send, the next request's conversion and
the compute thread's wake-up, ~0.9 ms a step on two busy cores (a one-row step is ~7 ms). Here the event loop
only queues each request as it arrives and sends each result as it is posted; the compute thread, once
started, runs whatever is queued in order and goes from step N to step N+1 without waiting on the loop.
"""
from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import AsyncIterator, Callable, Generic, TypeVar

from services.worker.compute import ComputeThread

Req = TypeVar("Req")
Res = TypeVar("Res")

_END = object()   # the request stream ended: after the steps queued before it, the results end


class StepQueue(Generic[Req, Res]):
    def __init__(self, compute: ComputeThread, run: Callable[[Req], Res]):
        self._compute = compute
        self._run = run   # one step, on the compute thread; answers its failures in its result
        self._loop = asyncio.get_running_loop()
        self._lock = threading.Lock()
        self._pending: deque[object] = deque()
        self._draining = False   # a drain is queued on or running on the compute thread
        self._closed = False
        self._results: asyncio.Queue[object] = asyncio.Queue()

    async def feed(self, requests: AsyncIterator[Req]) -> None:
        """Queue each request as it arrives (on the event loop); the stream's end ends the results."""
        try:
            async for request in requests:
                self._push(request)
        finally:
            self._push(_END)

    async def next_result(self) -> Res | None:
        """The next step's result, in request order; None once the request stream has ended."""
        result = await self._results.get()
        if isinstance(result, BaseException):
            raise result
        return None if result is _END else result  # type: ignore[return-value]

    def close(self) -> None:
        """Run nothing more: a step running now finishes, queued ones are dropped."""
        with self._lock:
            self._closed = True
            self._pending.clear()

    def _push(self, item: object) -> None:
        with self._lock:
            if self._closed:
                return
            self._pending.append(item)
            if self._draining:
                return
            self._draining = True
        self._compute.submit(self._drain)

    def _drain(self) -> None:   # the compute thread
        while True:
            with self._lock:
                if self._closed or not self._pending:
                    self._draining = False
                    return
                item = self._pending.popleft()
            result: object = item
            if item is not _END:
                try:
                    result = self._run(item)  # type: ignore[arg-type]
                except BaseException as exc:  # noqa: BLE001 - a bug in a step ends the stream with it, not silently
                    result = exc
            try:
                self._loop.call_soon_threadsafe(self._results.put_nowait, result)
            except RuntimeError:   # the event loop has closed: the worker is exiting
                return
