"""Calls to an embedding or classification worker (``Embed`` / ``Classify``), restarting a dead one.

A call that finds our worker process dead (UNAVAILABLE, and the process reapable) starts a new one
and retries once; concurrent failed calls restart it once between them. A restart that fails is
UNAVAILABLE for the call.
"""
from __future__ import annotations

import threading
from typing import Any

import grpc

from llmserve.worker.v1 import worker_pb2
from services.common.errors import Unavailable
from services.engine.core.executor import WorkerFailure
from services.engine.models.worker_process import WorkerProcess


class EncoderClient:
    def __init__(self, worker: WorkerProcess):
        self.worker = worker
        self._restart_lock = threading.Lock()
        self._generation = 0   # bumped by each restart: a failed call restarts only the worker it used

    def embed(self, texts: list[str], timeout: float | None) -> worker_pb2.EmbedResponse:
        return self._call("Embed", worker_pb2.EmbedRequest(texts=texts), timeout)  # type: ignore[no-any-return]

    def classify(self, texts: list[str], timeout: float | None) -> worker_pb2.ClassifyResponse:
        return self._call("Classify", worker_pb2.ClassifyRequest(texts=texts), timeout)  # type: ignore[no-any-return]

    def _call(self, method: str, request: Any, timeout: float | None) -> Any:
        generation = self._generation  # the worker this call talks to
        try:
            return getattr(self.worker.stub, method)(request, timeout=timeout, metadata=self.worker.metadata)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE:  # type: ignore[attr-defined]
                raise
            with self._restart_lock:
                if generation == self._generation:  # nobody restarted it meanwhile
                    if not self.worker.died(timeout=5):
                        raise exc from None  # alive (or not ours): a real error, not a dead worker
                    try:
                        self.worker.restart()
                    except WorkerFailure as restart_exc:
                        raise Unavailable(f"worker is down and could not be restarted: {restart_exc}") from None
                    self._generation += 1
            return getattr(self.worker.stub, method)(request, timeout=timeout, metadata=self.worker.metadata)
