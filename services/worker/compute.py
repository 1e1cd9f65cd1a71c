"""The one thread that runs torch in a worker process.

On CPU, torch's OpenMP backend keeps a team of helper threads for each thread that starts
parallel work. With a second team in the process, libgomp counts more threads than cores and
stops spinning between parallel regions ("throttled spin"), so every op waits for its helpers
to wake from sleep. Measured on 2 cores with SmolLM2 at batch 32: a decode step ran 30-40%
slower on a gRPC thread than on the thread that had loaded the model. So the model is loaded,
and every forward pass runs, on this one long-lived thread; the server's event loop hands work
over and awaits it. On CUDA it also keeps one thread owning the device.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")


class ComputeThread:
    def __init__(self) -> None:
        # A one-thread pool keeps its thread for its whole life: every call runs on the same thread.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compute")

    def run(self, fn: Callable[..., T], *args: object) -> T:
        """Run ``fn(*args)`` on the compute thread and return its result (or raise its exception)."""
        return self._pool.submit(fn, *args).result()

    def submit(self, fn: Callable[[], object]) -> None:
        """Queue ``fn()`` on the compute thread and return at once (``fn`` handles its own failures)."""
        self._pool.submit(fn)

    async def run_async(self, fn: Callable[..., T], *args: object) -> T:
        """``run`` for a coroutine: awaits the compute thread without blocking the event loop."""
        return await asyncio.wrap_future(self._pool.submit(fn, *args))
