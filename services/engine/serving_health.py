"""Whether the engine can serve, told truthfully through gRPC health: its default model must load.

An engine whose default model's worker cannot start (a missing or corrupt file, TLS files its
workers cannot read, ...) serves nothing a client asks for without naming a model, so it must not
say SERVING: routers and Consul would keep sending it traffic. ``ServingHealth`` holds the reason
it cannot serve ("" while it can); the engine reports it in gRPC health (NOT_SERVING), in its log
(once per change) and in ``EngineAdmin/GetLoad`` (``not_serving_reason``).

Contract: ``failed(reason)`` when loading the default model failed (at start); ``run()`` then
watches, every ``interval`` seconds: the default model loaded means SERVING; a failure the load
guard remembers keeps NOT_SERVING with that reason; once that memory ends (its back-off) and at
most every ``retry_seconds`` it tries the load again itself, so an engine recovers without a
restart when the cause is fixed. A default model that is merely not loaded (evicted while idle)
does not make the engine unhealthy: the next request loads it.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from services.common.errors import ServiceError
from services.engine.models.manager import ModelManager

log = logging.getLogger("llmserve.engine")

SetServing = Callable[[bool], Awaitable[None]]


class ServingHealth:
    def __init__(self, models: ModelManager, set_serving: SetServing, load: Callable[[str], Awaitable[object]],
                 interval: float = 1.0, retry_seconds: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.models = models
        self._set_serving = set_serving
        self._load = load                    # loads a model off the event loop (the engine's blocking pool)
        self.interval = interval
        self.retry_seconds = max(retry_seconds, 5.0)   # a broken default model is not retried in a loop
        self.clock = clock
        self.reason = ""                     # why the engine cannot serve; "" = it can
        self._retry_at = 0.0
        self._published: str | None = None   # what health says now (None = nothing yet)

    async def failed(self, reason: str) -> None:
        self._retry_at = self.clock() + self.retry_seconds
        await self._publish(reason)

    async def serving(self) -> None:
        await self._publish("")

    async def check(self) -> None:
        """One look: SERVING, NOT_SERVING with the remembered reason, or a retry of the default model."""
        default = self.models.store.default
        if any(entry.id == default.id for entry, _ in self.models.loaded()):
            await self._publish("")
            return
        remembered = self.models.guard.failure(default) if self.models.guard is not None else ""
        if remembered:
            await self._publish(remembered)
        elif self.reason and self.clock() >= self._retry_at:
            log.info("trying to load the default model %s again", default.name)
            try:
                await self._load(default.id)
            except ServiceError as exc:
                await self.failed(exc.message)
            else:
                await self._publish("")

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.check()
            except Exception:  # noqa: BLE001 - the watch must outlive one bad look
                log.exception("checking the engine's health failed")

    async def _publish(self, reason: str) -> None:
        self.reason = reason
        if reason == self._published:
            return
        self._published = reason
        await self._set_serving(not reason)
        if reason:
            log.error("engine NOT_SERVING: the default model %s cannot be served: %s",
                      self.models.store.default.name, reason)
        else:
            log.info("engine SERVING: the default model %s can be served", self.models.store.default.name)
