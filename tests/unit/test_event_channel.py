"""Events posted on another thread reach each channel's reader, in order, coalesced when it lags."""
from __future__ import annotations

import asyncio
import threading

from services.engine.api.event_channel import EventChannel, EventMailbox
from services.engine.core.sequence import FinishReason, SeqEvent


def test_events_from_another_thread_arrive_in_order_for_every_channel():
    async def main() -> dict[int, tuple[str, FinishReason | None]]:
        mailbox = EventMailbox(asyncio.get_running_loop())
        channels = [EventChannel(mailbox) for _ in range(8)]

        def engine_loop() -> None:
            for step in range(50):
                for ch in channels:
                    ch.put(SeqEvent((step,), f"{step},"))
            for ch in channels:
                ch.put(SeqEvent((), "end", finish_reason=FinishReason.LENGTH))

        async def read(ch: EventChannel) -> tuple[str, FinishReason | None]:
            text = ""
            while True:
                event = await asyncio.wait_for(ch.get(), timeout=10)
                text += event.text
                if event.finish_reason is not None:
                    return text, event.finish_reason

        thread = threading.Thread(target=engine_loop)
        thread.start()
        results = await asyncio.gather(*(read(ch) for ch in channels))
        thread.join(timeout=10)
        return dict(enumerate(results))

    expected = "".join(f"{i}," for i in range(50)) + "end"
    assert asyncio.run(main()) == {i: (expected, FinishReason.LENGTH) for i in range(8)}
