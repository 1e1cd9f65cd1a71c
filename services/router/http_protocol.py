"""uvicorn's h11 protocol with a read deadline: a client has ``read_timeout`` seconds to send a
request, headers and body, on a new connection or after the previous response; else the connection
is closed (a body cut short reaches the app as a disconnect).

uvicorn has only a keep-alive timeout, which starts after a response and stops at the first byte of
the next request, so a connection that never completes its headers (slowloris) or trickles its body
would be held for ever. A request that is being answered (a long stream included) is never cut.
"""
from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol


class ReadDeadlineH11Protocol(H11Protocol):
    read_timeout: float = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_read_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_read_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._disarm_read_deadline()

    def _arm_read_deadline(self) -> None:
        self._disarm_read_deadline()
        if not self.transport.is_closing():
            self._read_deadline = self.loop.call_later(self.read_timeout, self._on_read_deadline, self.cycle)

    def _disarm_read_deadline(self) -> None:
        handle = getattr(self, "_read_deadline", None)
        if handle is not None:
            handle.cancel()
            self._read_deadline = None

    def _on_read_deadline(self, cycle_when_armed: Any) -> None:
        self._read_deadline = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        no_new_request = cycle is cycle_when_armed and (cycle is None or cycle.response_complete)
        body_unfinished = cycle is not None and cycle.more_body and not cycle.response_complete
        if no_new_request or body_unfinished:
            self.logger.info("closing an HTTP connection from %s: no complete request within %.0fs",
                             "%s:%d" % self.client if self.client else "?", self.read_timeout)
            self.transport.close()


def with_read_timeout(seconds: float) -> type[ReadDeadlineH11Protocol]:
    """The protocol class to give ``uvicorn.Config(http=...)``."""
    return type("ReadDeadlineH11Protocol", (ReadDeadlineH11Protocol,), {"read_timeout": seconds})
