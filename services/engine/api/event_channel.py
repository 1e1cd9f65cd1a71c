"""How a sequence's output reaches the call that serves it."""
from __future__ import annotations

import asyncio

from services.engine.core.sequence import SeqEvent


class EventChannel:
    """One sequence's events, from the engine loop thread to the coroutine serving its call."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[SeqEvent] = asyncio.Queue()

    def put(self, event: SeqEvent) -> None:
        """Called on the engine loop thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:
            pass  # the event loop is closed (the process is stopping): nobody is left to read it

    async def get(self) -> SeqEvent:
        """The next event, with what queued up behind it (a slow reader gets fewer, larger messages)."""
        event = await self._queue.get()
        while event.finish_reason is None and not self._queue.empty():
            event = event.then(self._queue.get_nowait())
        return event
