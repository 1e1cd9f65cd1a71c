"""The engine's servers are asyncio; what blocks runs on threads, not on the event loop."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, asynccontextmanager
from typing import Any, AsyncIterator, Callable, TypeVar

T = TypeVar("T")


class BlockingCalls:
    """Runs what blocks (waiting for a model load, an encoder worker's reply) off the event loop."""

    def __init__(self, max_threads: int):
        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="blocking")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    @asynccontextmanager
    async def enter(self, cm: AbstractContextManager[T]) -> AsyncIterator[T]:
        """``with cm`` where entering blocks: entered on a thread; exited even if the call is cancelled
        while it waits (the thread's entry then undoes itself when it completes)."""
        entering = asyncio.get_running_loop().run_in_executor(self._pool, cm.__enter__)
        try:
            value = await asyncio.shield(entering)
        except asyncio.CancelledError:
            entering.add_done_callback(lambda f: f.cancelled() or f.exception() or cm.__exit__(None, None, None))
            raise
        try:
            yield value
        finally:
            cm.__exit__(None, None, None)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
