"""gRPC face of the router: the public LLMService, relayed to engines.

Each call goes to the engine the pool picks. A call that fails with UNAVAILABLE before any
output (engine down, starting, or its worker gone) is retried on another engine. The client's
deadline travels with the call, and a client cancel cancels the engine call, which frees the
sequence there.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, TypeVar

import grpc

from llmserve.v1 import llm_pb2, llm_pb2_grpc
from services.common.errors import ServiceError
from services.common.server import time_remaining
from services.router.engine_pool import Endpoint, EnginePool

log = logging.getLogger("llmserve.router")
T = TypeVar("T")


class RouterServicer(llm_pb2_grpc.LLMServiceServicer):
    def __init__(self, pool: EnginePool, max_attempts: int):
        self.pool = pool
        self.max_attempts = max_attempts

    def Generate(self, request: llm_pb2.GenerateRequest, context: grpc.ServicerContext) -> llm_pb2.GenerateResponse:
        return self._unary("Generate", request, context)

    def GenerateBatch(self, request: llm_pb2.GenerateBatchRequest,
                      context: grpc.ServicerContext) -> llm_pb2.GenerateBatchResponse:
        return self._unary("GenerateBatch", request, context)

    def Predict(self, request: llm_pb2.PredictRequest, context: grpc.ServicerContext) -> llm_pb2.PredictResponse:
        return self._unary("Predict", request, context)

    def GenerateStream(self, request: llm_pb2.GenerateRequest,
                       context: grpc.ServicerContext) -> Iterator[llm_pb2.GenerateStreamResponse]:
        def attempt(ep: Endpoint) -> Iterator[llm_pb2.GenerateStreamResponse]:
            call = ep.stub.GenerateStream(request, timeout=time_remaining(context))
            context.add_callback(call.cancel)
            return call  # type: ignore[no-any-return]

        yield from self._with_retries(attempt, context, streaming=True)

    def ListModels(self, request: llm_pb2.ListModelsRequest, context: grpc.ServicerContext) -> llm_pb2.ListModelsResponse:
        """Every healthy engine's models, merged by id: ``loaded_on`` lists every engine holding one."""
        merged: dict[str, llm_pb2.ModelInfo] = {}
        errors = []
        for ep in [e for e in self.pool.endpoints if e.healthy]:
            try:
                resp = ep.stub.ListModels(request, timeout=time_remaining(context) or 10.0)
            except grpc.RpcError as exc:
                errors.append(f"{ep.address}: {exc.code().name}")  # type: ignore[attr-defined]
                continue
            for model in resp.models:
                if model.id not in merged:
                    merged[model.id] = model
                    continue
                seen = merged[model.id]
                seen.loaded = seen.loaded or model.loaded
                seen.loaded_on.extend(a for a in model.loaded_on if a not in seen.loaded_on)
                seen.last_used_unix_ms = max(seen.last_used_unix_ms, model.last_used_unix_ms)
        if not merged and (errors or not self.pool.any_healthy()):
            raise ServiceError(f"no engine answered ListModels ({'; '.join(errors) or 'none healthy'})",
                               grpc.StatusCode.UNAVAILABLE)
        return llm_pb2.ListModelsResponse(models=list(merged.values()))

    # -- relay --------------------------------------------------------------------------------

    def _unary(self, method: str, request: Any, context: grpc.ServicerContext) -> Any:
        def attempt(ep: Endpoint) -> Iterator[Any]:
            future = getattr(ep.stub, method).future(request, timeout=time_remaining(context))
            context.add_callback(future.cancel)
            result = future.result()
            # Pass on what the engine said about the call (e.g. x-llmserve-load-seconds after a cold start).
            context.set_trailing_metadata([(k, v) for k, v in future.trailing_metadata() or ()
                                           if k.startswith("x-llmserve-")])
            yield result

        return next(self._with_retries(attempt, context, streaming=False))

    def _with_retries(self, attempt: Callable[[Endpoint], Iterator[T]], context: grpc.ServicerContext,
                      streaming: bool) -> Iterator[T]:
        tried: set[str] = set()
        last_error: grpc.RpcError | None = None
        for _ in range(self.max_attempts):
            try:
                ep = self.pool.pick(tried)
            except ServiceError:
                if last_error is not None:
                    raise last_error from None
                raise
            tried.add(ep.address)
            ep.acquire()
            sent = False
            try:
                for item in attempt(ep):
                    sent = True
                    yield item
                return
            except grpc.RpcError as exc:
                code = exc.code()  # type: ignore[attr-defined]
                if code != grpc.StatusCode.UNAVAILABLE or sent or not context.is_active():
                    raise
                log.warning("engine %s unavailable (%s); trying another", ep.address, exc.details())  # type: ignore[attr-defined]
                self.pool.mark_down(ep)
                last_error = exc
            finally:
                ep.release()
        assert last_error is not None
        raise last_error
