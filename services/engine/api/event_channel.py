"""How a sequence's output reaches the call that serves it.

The engine loop (a thread) hands each sequence's events to its ``EventChannel``; the call's
coroutine awaits them on the event loop. Events posted while the event loop has not yet run the
last hand-over join it, so a step's output for every stream costs the event loop one wake-up, not
one per stream.
"""
from __future__ import annotations

import asyncio
import threading

from services.engine.core.sequence import SeqEvent


class EventMailbox:
    """Hands (queue, event) pairs from other threads to one event loop, in batches."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue[SeqEvent], SeqEvent]] = []

    def post(self, queue: asyncio.Queue[SeqEvent], event: SeqEvent) -> None:
        with self._lock:
            self._pending.append((queue, event))
            if len(self._pending) > 1:
                return  # a hand-over is already scheduled and will take this one too
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:
            pass  # the event loop is closed (the process is stopping): nobody is left to read it

    def _deliver(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for queue, event in pending:
            queue.put_nowait(event)


class EventChannel:
    """One sequence's events, from the engine loop thread to the coroutine serving its call."""

    def __init__(self, mailbox: EventMailbox) -> None:
        self._mailbox = mailbox
        self._queue: asyncio.Queue[SeqEvent] = asyncio.Queue()

    def put(self, event: SeqEvent) -> None:
        """Called on the engine loop thread."""
        self._mailbox.post(self._queue, event)

    async def get(self) -> SeqEvent:
        """The next event, with what queued up behind it (a slow reader gets fewer, larger messages)."""
        event = await self._queue.get()
        while event.finish_reason is None and not self._queue.empty():
            event = event.then(self._queue.get_nowait())
        return event
