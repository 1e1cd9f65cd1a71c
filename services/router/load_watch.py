"""Follows one engine's ``EngineAdmin/WatchLoad`` stream, so routing sees the engine's own numbers.

Every router replica keeps such a stream per engine and therefore sees the same load (the
engine's queue and KV usage include every router's requests), rather than only its own calls.
A broken stream clears the report (routing falls back to this router's in-flight count) and is
reopened with backoff until the engine leaves the pool. Runs as a task on the router's event loop.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

import grpc

from llmserve.v1 import engine_admin_pb2, engine_admin_pb2_grpc
from services.common.backoff import Backoff

log = logging.getLogger("llmserve.router.load")


class LoadWatcher:
    def __init__(self, channel: grpc.aio.Channel, address: str, interval_ms: int,
                 on_report: Callable[[engine_admin_pb2.EngineLoad | None], None],
                 metadata: tuple[tuple[str, str], ...] = ()):
        self._stub = engine_admin_pb2_grpc.EngineAdminStub(channel)
        self._address = address
        self._interval_ms = interval_ms
        self._on_report = on_report
        self._metadata = metadata
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Call on the event loop."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"load-{self._address}")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        backoff = Backoff(maximum=5.0)
        while True:
            call = self._stub.WatchLoad(engine_admin_pb2.WatchLoadRequest(interval_ms=self._interval_ms),
                                        metadata=self._metadata)
            try:
                async for load in call:
                    self._on_report(load)
                    backoff.reset()
            except grpc.RpcError as exc:
                log.debug("load stream of %s ended: %s", self._address, exc.code())  # type: ignore[attr-defined]
            finally:
                call.cancel()  # a no-op once it ended; else the watcher was stopped
            self._on_report(None)
            await asyncio.sleep(backoff.next_delay())
