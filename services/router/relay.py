"""The router's calls to engines, with failover: what any face of the router (gRPC, HTTP) calls.

Each call goes to the engine the pool ranks first for its model and prompt prefix. One attempt
loop serves every rpc: a call that fails with UNAVAILABLE (engine down, starting, or its worker
gone) marks the engine down and moves to the next engine; a stream that already delivered output
is *resumed* there: the prompt goes again with the tokens already delivered
(``resume_token_ids``) and the new engine continues after them, so the client sees one unbroken
stream (the same greedy tokens; a seeded sample continues its random stream). The client's
deadline travels with every attempt, and a client that leaves cancels the engine call, which
frees the sequence there. An injected ``RelayObserver`` (metrics) hears of every retry and
resume the loop makes (a no-op by default).

Every call carries one request id (the request's ``request_id``, else the face's, else a new one)
to the engine, in the request and as ``x-llmserve-request-id`` metadata, and reports what the
engine said about it (``x-llmserve-*``: the engine that served it, queue time, TTFT, load time).
"""
from __future__ import annotations

import logging
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, NamedTuple, Protocol

import grpc

from llmserve.v1 import llm_pb2, llm_pb2_grpc
from services.common.call_metadata import checked_request_id, outgoing, relayed, with_request_id
from services.common.errors import InvalidArgument, ResourceExhausted, ServiceError, Unavailable, retry_after_ms_of
from services.router import policy
from services.router.engine_pool import Endpoint, EnginePool

log = logging.getLogger("llmserve.router")

# An engine that fails a call with these is down or broken: fail over and count it in its breaker.
# CANCELLED counts when our client did not cancel: the engine gave the call up (a draining engine's
# gRPC server cancels the calls it received but had not started), so another engine serves it.
ENGINE_FAILURES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


@dataclass(frozen=True)
class CallScope:
    """What the relay needs to know of the client's call, whatever face it came through."""

    deadline: float | None = None                                   # time.monotonic(); None = none
    cancelled: Callable[[], bool] = field(default=lambda: False)    # the client left
    request_id: str = ""        # the call's id (a request's own request_id wins); "" = a new one

    @classmethod
    def within(cls, seconds: float | None, cancelled: Callable[[], bool] = lambda: False,
               request_id: str = "") -> "CallScope":
        return cls(None if seconds is None else time.monotonic() + seconds, cancelled, request_id)

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())


class RelayObserver(Protocol):
    """What the attempt loop reports (``services.router.metrics.RouterMetrics`` counts it)."""

    def retry(self, method: str) -> None:
        """A ``method`` call moves to another engine before any output (its engine was unavailable)."""

    def resume(self, method: str) -> None:
        """A ``method`` stream resumes on another engine after its engine died mid-stream."""


class NullRelayObserver:
    def retry(self, method: str) -> None:
        pass

    def resume(self, method: str) -> None:
        pass


class Relayed(NamedTuple):
    response: Any
    metadata: tuple[tuple[str, str], ...]     # for the client: request id, engine, the engine's x-llmserve-* trailers


@dataclass
class StreamMetadata:
    """What a relayed stream says about itself, for the client: ``initial`` is set before the first
    message is yielded (request id, engine, queue time, TTFT), ``trailing`` once the stream ended."""

    initial: tuple[tuple[str, str], ...] = ()
    trailing: tuple[tuple[str, str], ...] = ()


class Relay:
    def __init__(self, pool: EnginePool, max_attempts: int, max_resumes: int = 3, affinity_prefix_chars: int = 256,
                 observer: RelayObserver | None = None):
        self.pool = pool
        self.observer = observer or NullRelayObserver()   # metrics: retries and resumes
        self.max_attempts = max_attempts
        self.max_resumes = max_resumes
        self.affinity_prefix_chars = affinity_prefix_chars

    # -- the calls --------------------------------------------------------------------------

    async def generate(self, request: llm_pb2.GenerateRequest, scope: CallScope) -> Relayed:
        _refuse_internal_fields(request)
        return await self._unary("Generate", request, request.model, self.prefix(request), scope)

    async def generate_batch(self, request: llm_pb2.GenerateBatchRequest, scope: CallScope) -> Relayed:
        first = request.prompts[0] if request.prompts else ""
        return await self._unary("GenerateBatch", request, request.model,
                                 policy.prefix_key(first, self.affinity_prefix_chars), scope)

    async def predict(self, request: llm_pb2.PredictRequest, scope: CallScope) -> Relayed:
        return await self._unary("Predict", request, request.model_id, "", scope)

    async def generate_stream(self, request: llm_pb2.GenerateRequest, scope: CallScope,
                              metadata: StreamMetadata | None = None) -> AsyncIterator[llm_pb2.GenerateStreamResponse]:
        """The stream's messages; ``metadata`` (if given) receives what the stream says about itself."""
        _refuse_internal_fields(request)
        # One id for the whole stream, even when it is resumed on another engine.
        request, rid = _identified(request, scope)
        md = metadata if metadata is not None else StreamMetadata()
        sent_ids: list[int] = []
        sent_chars = 0

        async def attempt(ep: Endpoint) -> AsyncIterator[llm_pb2.GenerateStreamResponse]:
            nonlocal sent_chars
            resumed = _copy(request, resume_token_ids=sent_ids, resume_text_chars=sent_chars) if sent_ids else request
            log.info("request %s: GenerateStream to engine %s", rid, ep.address)
            call = ep.llm.GenerateStream(resumed, timeout=scope.time_remaining(), metadata=self._metadata(rid))
            finished = False
            try:
                async for msg in call:
                    if not md.initial:  # the engine, queue time and TTFT, before the first message
                        md.initial = relayed(await call.initial_metadata(), ep.address, rid)
                    sent_ids.extend(msg.token_ids)
                    sent_chars += len(msg.text)
                    finished = msg.finish_reason != llm_pb2.FINISH_REASON_UNSPECIFIED
                    yield msg
                md.trailing = relayed(await call.trailing_metadata(), ep.address, rid)
            except grpc.RpcError as exc:
                if not finished:
                    raise
                # The last message (its finish reason, usage) was delivered and then the engine went: the stream
                # is whole, nothing is left to resume (its trailers, the timings, are lost with the engine).
                log.warning("request %s: engine %s ended the call %s after the stream's last message; the stream "
                            "is complete", rid, ep.address, exc.code().name)  # type: ignore[attr-defined]
            finally:
                call.cancel()  # a no-op once it ended; else the client left: free the sequence on the engine

        async with aclosing(self._with_failover("GenerateStream", request.model, self.prefix(request), scope,
                                                attempt, delivered=lambda: bool(sent_ids))) as messages:
            async for msg in messages:
                yield msg

    async def list_models(self, request: llm_pb2.ListModelsRequest, scope: CallScope) -> llm_pb2.ListModelsResponse:
        """Every healthy engine's models, merged by id: ``loaded_on`` lists every engine holding one."""
        merged: dict[str, llm_pb2.ModelInfo] = {}
        errors = []
        for ep in [e for e in self.pool.endpoints if e.healthy]:
            try:
                resp = await ep.llm.ListModels(request, timeout=scope.time_remaining() or 10.0,
                                             metadata=self.pool.config.dialer.metadata)
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
            raise Unavailable(f"no engine answered ListModels ({'; '.join(errors) or 'none healthy'})")
        return llm_pb2.ListModelsResponse(models=list(merged.values()))

    def prefix(self, request: llm_pb2.GenerateRequest) -> str:
        text = request.prompt or "".join(f"{m.role}\x00{m.content}\x00" for m in request.messages)
        return policy.prefix_key(text, self.affinity_prefix_chars)

    # -- the attempt loop -----------------------------------------------------------------------

    async def _unary(self, method: str, request: Any, model: str, prefix: str, scope: CallScope) -> Relayed:
        request, rid = _identified(request, scope)

        async def attempt(ep: Endpoint) -> AsyncIterator[Relayed]:
            log.info("request %s: %s to engine %s", rid, method, ep.address)
            call = getattr(ep.llm, method)(request, timeout=scope.time_remaining(), metadata=self._metadata(rid))
            try:
                response = await call
                # What the engine said about the call (queue time, TTFT, load seconds after a cold start).
                yield Relayed(response, relayed(await call.trailing_metadata(), ep.address, rid))
            finally:
                call.cancel()  # a no-op once it ended; else the client left: cancel the engine call

        results = [r async for r in self._with_failover(method, model, prefix, scope, attempt)]
        return results[-1]  # an attempt that ends without an error has yielded its one response

    async def _with_failover(self, method: str, model: str, prefix: str, scope: CallScope,
                             attempt: Callable[[Endpoint], AsyncIterator[Any]],
                             delivered: Callable[[], bool] = lambda: False) -> AsyncIterator[Any]:
        """Run ``attempt`` on the best engine, and on the next while engines fail: up to
        ``max_attempts`` before any output was ``delivered``, then up to ``max_resumes`` resumes."""
        tried: set[str] = set()
        failures = resumes = 0
        last_error: grpc.RpcError | None = None
        refusals: list[tuple[str, int | None]] = []   # engines that answered "full", with their hints
        while True:
            ep = self._pick(model, prefix, tried, last_error, refusals)
            tried.add(ep.address)
            ep.acquire()
            try:
                async with aclosing(attempt(ep)) as items:
                    async for item in items:
                        yield item
                self.pool.on_success(ep)
                return
            except grpc.RpcError as exc:
                if _is_refusal(exc) and not delivered() and not scope.cancelled():
                    # Busy, not down: the engine is fine, its queue is full. Another may have room.
                    refusals.append((ep.address, retry_after_ms_of(exc.trailing_metadata())))  # type: ignore[attr-defined]
                    self.pool.on_success(ep)
                    continue
                if _is_model_draining(exc) and not delivered() and not scope.cancelled():
                    # The engine is fine; only this model is being unloaded there. Another engine may
                    # serve it; with none left the client gets the engine's answer and its retry hint.
                    self.pool.on_success(ep)
                    last_error = exc
                    continue
                if exc.code() is grpc.StatusCode.CANCELLED and not scope.cancelled():  # type: ignore[attr-defined]
                    # Never silent: an engine call cancelled while its client stayed is worth a line.
                    log.warning("engine %s ended a call CANCELLED though the client did not cancel (%s): "
                                "failing over", ep.address, exc.details())  # type: ignore[attr-defined]
                if not self._is_engine_failure(exc, scope):
                    raise
                self.pool.mark_down(ep)
                detail = exc.details()  # type: ignore[attr-defined]
                if delivered():
                    resumes += 1
                    if resumes > self.max_resumes:
                        raise
                    log.warning("engine %s died mid-stream (%s); resuming on another engine", ep.address, detail)
                    self.observer.resume(method)
                else:
                    failures += 1
                    if failures >= self.max_attempts:
                        raise
                    log.warning("engine %s unavailable (%s); trying another", ep.address, detail)
                    self.observer.retry(method)
                last_error = exc
            finally:
                ep.release()

    def _pick(self, model: str, prefix: str, tried: set[str], last_error: grpc.RpcError | None,
              refusals: list[tuple[str, int | None]]) -> Endpoint:
        try:
            return self.pool.pick(model, prefix, tried)
        except ResourceExhausted:
            raise  # every engine left reports a full queue: shed, with their hint
        except ServiceError:
            if refusals:
                hints = [h for _, h in refusals if h is not None]
                hint = min(hints) if hints else 1000
                raise ResourceExhausted(f"every engine is full ({', '.join(a for a, _ in refusals)} refused: queue "
                                        f"at its bound); retry in {hint} ms", retry_after_ms=hint) from None
            if last_error is not None:
                raise last_error from None  # no engine left: the client gets the engine's own error
            raise

    @staticmethod
    def _is_engine_failure(exc: grpc.RpcError, scope: CallScope) -> bool:
        """Whether ``exc`` says the engine is down (not the request at fault, not the client gone)."""
        return exc.code() in ENGINE_FAILURES and not scope.cancelled()  # type: ignore[attr-defined]

    def _metadata(self, rid: str) -> tuple[tuple[str, str], ...]:
        """What every engine call carries: the request id and the router's credential at the engines."""
        return (*outgoing(rid), *self.pool.config.dialer.metadata)


def _is_refusal(exc: grpc.RpcError) -> bool:
    """The engine refused the call because its queue is full (admission control), before any work."""
    return (exc.code() is grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
            and retry_after_ms_of(exc.trailing_metadata()) is not None)  # type: ignore[attr-defined]


def _is_model_draining(exc: grpc.RpcError) -> bool:
    """The engine refused the call because the model is draining for an unload: UNAVAILABLE with a
    retry hint (an engine that is down gives none)."""
    return (exc.code() is grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
            and retry_after_ms_of(exc.trailing_metadata()) is not None)  # type: ignore[attr-defined]


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


def _identified(request: Any, scope: CallScope) -> tuple[Any, str]:
    """``request`` carrying the call's id (its own ``request_id``, else the scope's, else a new one), and the id."""
    rid = checked_request_id(getattr(request, "request_id", "") or scope.request_id or uuid.uuid4().hex)
    return with_request_id(request, rid), rid


def _refuse_internal_fields(request: llm_pb2.GenerateRequest) -> None:
    if request.resume_token_ids or request.resume_text_chars:
        raise InvalidArgument("resume_token_ids and resume_text_chars are internal to the router; leave them unset")
