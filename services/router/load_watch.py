"""Follows one engine's ``EngineAdmin/WatchLoad`` stream, so routing sees the engine's own numbers.

Every router replica keeps such a stream per engine and therefore sees the same load (the
engine's queue and KV usage include every router's requests), rather than only its own calls.
A broken stream clears the report (routing falls back to this router's in-flight count) and is
reopened with backoff until the engine leaves the pool.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

import grpc

from llmserve.v1 import engine_admin_pb2, engine_admin_pb2_grpc
from services.common.backoff import Backoff

log = logging.getLogger("llmserve.router.load")


class LoadWatcher:
    def __init__(self, channel: grpc.Channel, address: str, interval_ms: int,
                 on_report: Callable[[engine_admin_pb2.EngineLoad | None], None],
                 metadata: tuple[tuple[str, str], ...] = ()):
        self._stub = engine_admin_pb2_grpc.EngineAdminStub(channel)
        self._address = address
        self._interval_ms = interval_ms
        self._on_report = on_report
        self._metadata = metadata
        self._stop = threading.Event()
        self._call: grpc.Future | None = None
        self._thread = threading.Thread(target=self._run, name=f"load-{address}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        call = self._call
        if call is not None:
            call.cancel()

    def _run(self) -> None:
        backoff = Backoff(maximum=5.0)
        while not self._stop.is_set():
            try:
                self._call = self._stub.WatchLoad(engine_admin_pb2.WatchLoadRequest(interval_ms=self._interval_ms),
                                                  metadata=self._metadata)
                for load in self._call:
                    self._on_report(load)
                    backoff.reset()
            except grpc.RpcError as exc:
                if not self._stop.is_set():
                    log.debug("load stream of %s ended: %s", self._address, exc.code())  # type: ignore[attr-defined]
            self._on_report(None)
            backoff.wait(self._stop)
