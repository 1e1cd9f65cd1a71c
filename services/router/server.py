"""gRPC face of the router: the public LLMService, relayed to engines.

Each call goes to the engine the pool ranks first for its model and prompt prefix. A call that
fails with UNAVAILABLE before any output (engine down, starting, or its worker gone) is retried on
the next engine. A stream whose engine dies after output was sent is *resumed* on another engine:
the router sends the prompt again with the tokens it already delivered (``resume_token_ids``) and
the new engine continues after them, so the client sees one unbroken stream (the same greedy
tokens; a seeded sample continues its random stream). The client's deadline travels with every
call, and a client cancel cancels the engine call, which frees the sequence there.

The servicer runs on an asyncio server: a relay spends its life waiting on engines, and a thread
per open stream (the sync server's model) cost more CPU per relayed token than the relaying, on
the same cores as the model. The engine pool's health checks and load watches stay on threads.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator

import grpc

from llmserve.v1 import llm_pb2, llm_pb2_grpc
from services.common.errors import ServiceError
from services.common.server import CHANNEL_OPTIONS, time_remaining
from services.router import policy
from services.router.engine_pool import Endpoint, EnginePool

if TYPE_CHECKING:
    from services.router.metrics import RouterMetrics

log = logging.getLogger("llmserve.router")

# An engine that fails a call with these is down or broken: fail over and count it in its breaker.
ENGINE_FAILURES = (grpc.StatusCode.UNAVAILABLE,)


class RouterServicer(llm_pb2_grpc.LLMServiceServicer):
    def __init__(self, pool: EnginePool, max_attempts: int, max_resumes: int = 3, affinity_prefix_chars: int = 256,
                 metrics: RouterMetrics | None = None):
        self.pool = pool
        self.metrics = metrics  # retries and resumes are counted here; the rest by metrics.instrument
        self.max_attempts = max_attempts
        self.max_resumes = max_resumes
        self.affinity_prefix_chars = affinity_prefix_chars

    async def Generate(self, request: llm_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> llm_pb2.GenerateResponse:
        return await self._unary("Generate", request, request.model, self._prefix(request), context)

    async def GenerateBatch(self, request: llm_pb2.GenerateBatchRequest,
                            context: grpc.aio.ServicerContext) -> llm_pb2.GenerateBatchResponse:
        first = request.prompts[0] if request.prompts else ""
        return await self._unary("GenerateBatch", request, request.model,
                                 policy.prefix_key(first, self.affinity_prefix_chars), context)

    async def Predict(self, request: llm_pb2.PredictRequest,
                      context: grpc.aio.ServicerContext) -> llm_pb2.PredictResponse:
        return await self._unary("Predict", request, request.model_id, "", context)

    async def GenerateStream(self, request: llm_pb2.GenerateRequest,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[llm_pb2.GenerateStreamResponse]:
        if request.resume_token_ids or request.resume_text_chars:
            raise ServiceError("resume_token_ids and resume_text_chars are internal to the router; leave them unset",
                               grpc.StatusCode.INVALID_ARGUMENT)
        if not request.request_id:
            # One id for the whole stream, even when it is resumed on another engine.
            request = _copy(request, request_id=uuid.uuid4().hex)
        prefix = self._prefix(request)
        sent_ids: list[int] = []
        sent_chars = 0
        tried: set[str] = set()
        failures = resumes = 0
        last_error: grpc.RpcError | None = None
        while True:
            ep = self._pick(request.model, prefix, tried, last_error)
            tried.add(ep.address)
            attempt = request if not sent_ids else _copy(request, resume_token_ids=sent_ids, resume_text_chars=sent_chars)
            ep.acquire()
            call = None
            try:
                call = self._relay(ep).GenerateStream(attempt, timeout=time_remaining(context))
                async for msg in call:
                    sent_ids.extend(msg.token_ids)
                    sent_chars += len(msg.text)
                    yield msg
                self.pool.on_success(ep)
                return
            except grpc.RpcError as exc:
                if not self._failed_over(ep, exc, context):
                    raise
                if sent_ids:
                    resumes += 1
                    if resumes > self.max_resumes:
                        raise
                    log.warning("engine %s died mid-stream after %d tokens (%s); resuming on another engine",
                                ep.address, len(sent_ids), exc.details())  # type: ignore[attr-defined]
                    if self.metrics is not None:
                        self.metrics.resume("GenerateStream")  # metrics
                else:
                    failures += 1
                    if failures >= self.max_attempts:
                        raise
                    log.warning("engine %s unavailable (%s); trying another", ep.address, exc.details())  # type: ignore[attr-defined]
                    if self.metrics is not None:
                        self.metrics.retry("GenerateStream")  # metrics
                last_error = exc
            finally:
                if call is not None:
                    call.cancel()  # a no-op once it ended; else the client left: free the sequence on the engine
                ep.release()

    async def ListModels(self, request: llm_pb2.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> llm_pb2.ListModelsResponse:
        """Every healthy engine's models, merged by id: ``loaded_on`` lists every engine holding one."""
        merged: dict[str, llm_pb2.ModelInfo] = {}
        errors = []
        for ep in [e for e in self.pool.endpoints if e.healthy]:
            try:
                resp = await self._relay(ep).ListModels(request, timeout=time_remaining(context) or 10.0)
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

    @staticmethod
    def _relay(ep: Endpoint) -> llm_pb2_grpc.LLMServiceStub:
        """The engine's asyncio stub, made on first use on this (the server's) event loop."""
        if ep.relay is None:
            channel = grpc.aio.insecure_channel(ep.address, options=CHANNEL_OPTIONS)
            loop = asyncio.get_running_loop()

            def close() -> None:  # called from the pool's threads when the engine leaves
                try:
                    loop.call_soon_threadsafe(lambda: loop.create_task(channel.close()))
                except RuntimeError:
                    pass  # the loop is already closed: so is the channel
            ep.relay, ep.on_close = llm_pb2_grpc.LLMServiceStub(channel), close
        return ep.relay

    def _prefix(self, request: llm_pb2.GenerateRequest) -> str:
        text = request.prompt or "".join(f"{m.role}\x00{m.content}\x00" for m in request.messages)
        return policy.prefix_key(text, self.affinity_prefix_chars)

    def _pick(self, model: str, prefix: str, tried: set[str], last_error: grpc.RpcError | None) -> Endpoint:
        try:
            return self.pool.pick(model, prefix, tried)
        except ServiceError:
            if last_error is not None:
                raise last_error from None  # no engine left: the client gets the engine's own error
            raise

    def _failed_over(self, ep: Endpoint, exc: grpc.RpcError, context: grpc.aio.ServicerContext) -> bool:
        """Record a failed engine call; True when the request should move to another engine."""
        code = exc.code()  # type: ignore[attr-defined]
        if code not in ENGINE_FAILURES or context.cancelled():
            return False
        self.pool.mark_down(ep)
        return True

    async def _unary(self, method: str, request: Any, model: str, prefix: str,
                     context: grpc.aio.ServicerContext) -> Any:
        tried: set[str] = set()
        last_error: grpc.RpcError | None = None
        for attempt in range(self.max_attempts):
            ep = self._pick(model, prefix, tried, last_error)
            tried.add(ep.address)
            ep.acquire()
            call = None
            try:
                call = getattr(self._relay(ep), method)(request, timeout=time_remaining(context))
                result = await call
                self.pool.on_success(ep)
                # Pass on what the engine said about the call (e.g. x-llmserve-load-seconds after a cold start).
                context.set_trailing_metadata(tuple((k, v) for k, v in await call.trailing_metadata() or ()
                                                    if k.startswith("x-llmserve-")))
                return result
            except grpc.RpcError as exc:
                if not self._failed_over(ep, exc, context) or attempt + 1 >= self.max_attempts:
                    raise
                log.warning("engine %s unavailable (%s); trying another", ep.address, exc.details())  # type: ignore[attr-defined]
                if self.metrics is not None:
                    self.metrics.retry(method)  # metrics
                last_error = exc
            finally:
                if call is not None:
                    call.cancel()  # a no-op once it ended; else the client left: cancel the engine call
                ep.release()
        raise AssertionError("unreachable")


def _copy(request: llm_pb2.GenerateRequest, **fields: Any) -> llm_pb2.GenerateRequest:
    out = llm_pb2.GenerateRequest()
    out.CopyFrom(request)
    for name, value in fields.items():
        if isinstance(value, list):
            del getattr(out, name)[:]
            getattr(out, name).extend(value)
        else:
            setattr(out, name, value)
    return out
