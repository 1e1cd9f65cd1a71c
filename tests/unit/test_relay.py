"""The router's attempt loop with fake engines: failover, resume, limits (no server, no network)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from llmserve.v1 import llm_pb2
from services.common.errors import Unavailable
from services.router.engine_pool import PoolConfig
from services.router.relay import CallScope, Relay, StreamMetadata


def rpc_error(code: grpc.StatusCode, details: str = "") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details or code.name)


class UnaryCall:
    def __init__(self, outcome: Any, metadata: tuple = ()):
        self.outcome, self.metadata, self.cancelled = outcome, metadata, False

    def __await__(self):
        async def result():
            if isinstance(self.outcome, BaseException):
                raise self.outcome
            return self.outcome
        return result().__await__()

    async def trailing_metadata(self):
        return self.metadata

    def cancel(self) -> None:
        self.cancelled = True


class StreamCall:
    def __init__(self, messages: list[llm_pb2.GenerateStreamResponse], error: BaseException | None,
                 metadata: tuple = ()):
        self.messages, self.error, self.metadata, self.cancelled = messages, error, metadata, False

    async def __aiter__(self):
        for msg in self.messages:
            yield msg
        if self.error is not None:
            raise self.error

    async def initial_metadata(self):
        return self.metadata

    async def trailing_metadata(self):
        return self.metadata

    def cancel(self) -> None:
        self.cancelled = True


@dataclass(eq=False)
class FakeEngine:
    """Answers Generate with ``unary`` and GenerateStream with ``stream`` (messages, then an error or not)."""

    address: str
    unary: Any = None
    stream: tuple[list[llm_pb2.GenerateStreamResponse], BaseException | None] = ([], None)
    metadata: tuple = ()
    requests: list[Any] = field(default_factory=list)
    call_metadata: list[Any] = field(default_factory=list)    # the metadata each call was sent with
    in_flight: int = 0

    @property
    def llm(self) -> "FakeEngine":
        return self

    def acquire(self) -> None:
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1

    def Generate(self, request: Any, timeout: float | None = None, metadata: Any = None) -> UnaryCall:
        self.requests.append(request)
        self.call_metadata.append(metadata)
        return UnaryCall(self.unary, self.metadata)

    def GenerateStream(self, request: Any, timeout: float | None = None, metadata: Any = None) -> StreamCall:
        self.requests.append(request)
        self.call_metadata.append(metadata)
        return StreamCall(*self.stream, self.metadata)


class FakePool:
    def __init__(self, *engines: FakeEngine):
        self.config = PoolConfig()   # no TLS, no cluster secret
        self.engines = list(engines)
        self.down: list[str] = []
        self.succeeded: list[str] = []

    def pick(self, model: str, prefix: str, exclude: set[str]) -> FakeEngine:
        for ep in self.engines:
            if ep.address not in exclude and ep.address not in self.down:
                return ep
        raise Unavailable("no healthy engine available")

    def mark_down(self, ep: FakeEngine) -> None:
        self.down.append(ep.address)

    def on_success(self, ep: FakeEngine) -> None:
        self.succeeded.append(ep.address)


def chunk(text: str, ids: list[int], finish: bool = False) -> llm_pb2.GenerateStreamResponse:
    return llm_pb2.GenerateStreamResponse(text=text, token_ids=ids, finish_reason=(
        llm_pb2.FINISH_REASON_LENGTH if finish else llm_pb2.FINISH_REASON_UNSPECIFIED))


REQUEST = llm_pb2.GenerateRequest(prompt="Hello")


def test_a_unary_call_moves_to_the_next_engine_when_one_is_down():
    a = FakeEngine("a", unary=rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused"))
    b = FakeEngine("b", unary=llm_pb2.GenerateResponse(text="hi"),
                   metadata=(("x-llmserve-load-seconds", "1.5"), ("other", "x")))
    pool = FakePool(a, b)
    relayed = asyncio.run(Relay(pool, max_attempts=3).generate(REQUEST, CallScope(request_id="r-1")))
    assert relayed.response.text == "hi"
    # The call's id and the engine that served it, then only llmserve's own trailers of the engine.
    assert relayed.metadata == (("x-llmserve-request-id", "r-1"), ("x-llmserve-engine", "b"),
                                ("x-llmserve-load-seconds", "1.5"))
    # Both engines got the call's id, in the request and as metadata.
    assert [r.request_id for r in a.requests + b.requests] == ["r-1", "r-1"]
    assert a.call_metadata == b.call_metadata == [(("x-llmserve-request-id", "r-1"),)]
    assert (pool.down, pool.succeeded) == (["a"], ["b"])
    assert a.in_flight == b.in_flight == 0


def test_an_error_of_the_request_is_not_retried():
    a = FakeEngine("a", unary=rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "bad prompt"))
    b = FakeEngine("b", unary=llm_pb2.GenerateResponse(text="hi"))
    pool = FakePool(a, b)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(Relay(pool, max_attempts=3).generate(REQUEST, CallScope()))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (pool.down, b.requests) == ([], [])


def test_attempts_are_bounded_and_the_client_gets_the_engines_error():
    engines = [FakeEngine(n, unary=rpc_error(grpc.StatusCode.UNAVAILABLE, f"{n} is down")) for n in "abc"]
    pool = FakePool(*engines)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(Relay(pool, max_attempts=2).generate(REQUEST, CallScope()))
    assert (err.value.code(), err.value.details()) == (grpc.StatusCode.UNAVAILABLE, "b is down")
    assert pool.down == ["a", "b"] and engines[2].requests == []


def test_a_client_that_left_does_not_fail_over():
    a = FakeEngine("a", unary=rpc_error(grpc.StatusCode.UNAVAILABLE))
    b = FakeEngine("b", unary=llm_pb2.GenerateResponse(text="hi"))
    pool = FakePool(a, b)
    with pytest.raises(grpc.aio.AioRpcError):
        asyncio.run(Relay(pool, max_attempts=3).generate(REQUEST, CallScope(cancelled=lambda: True)))
    assert (pool.down, b.requests) == ([], [])


def test_a_stream_that_breaks_after_output_resumes_after_what_was_delivered():
    a = FakeEngine("a", stream=([chunk("Hel", [1, 2]), chunk("lo", [3])], rpc_error(grpc.StatusCode.UNAVAILABLE)))
    b = FakeEngine("b", stream=([chunk(" world", [4, 5], finish=True)], None))
    pool = FakePool(a, b)

    async def run() -> list[llm_pb2.GenerateStreamResponse]:
        return [m async for m in Relay(pool, max_attempts=3).generate_stream(REQUEST, CallScope())]

    messages = asyncio.run(run())
    assert "".join(m.text for m in messages) == "Hello world"
    assert [t for m in messages for t in m.token_ids] == [1, 2, 3, 4, 5]
    first, resumed = a.requests[0], b.requests[0]
    assert first.request_id and resumed.request_id == first.request_id   # one id across engines
    assert (list(resumed.resume_token_ids), resumed.resume_text_chars) == ([1, 2, 3], 5)
    assert (pool.down, pool.succeeded) == (["a"], ["b"])


def test_a_stream_whose_engine_dies_after_its_last_message_is_complete():
    """The engine sent the message with the finish reason, then died before the call's status: the client has the
    whole stream, so it ends there; a resume would carry every token already (max_tokens of them: refused)."""
    a = FakeEngine("a", stream=([chunk("Hel", [1, 2]), chunk("lo", [3], finish=True)],
                                rpc_error(grpc.StatusCode.UNAVAILABLE)))
    b = FakeEngine("b", stream=([chunk(" world", [4, 5], finish=True)], None))
    pool = FakePool(a, b)

    async def run() -> list[llm_pb2.GenerateStreamResponse]:
        return [m async for m in Relay(pool, max_attempts=3).generate_stream(REQUEST, CallScope())]

    messages = asyncio.run(run())
    assert [t for m in messages for t in m.token_ids] == [1, 2, 3]
    assert messages[-1].finish_reason == llm_pb2.FINISH_REASON_LENGTH
    assert b.requests == []                      # no resume
    a_broken = FakeEngine("a", stream=([chunk("Hel", [1, 2])], rpc_error(grpc.StatusCode.UNAVAILABLE)))
    pool = FakePool(a_broken, b)                 # without the finish reason it still resumes
    assert [t for m in asyncio.run(run()) for t in m.token_ids] == [1, 2, 4, 5]


def test_resumes_are_bounded():
    broken = ([chunk("x", [1])], rpc_error(grpc.StatusCode.UNAVAILABLE))
    pool = FakePool(*[FakeEngine(n, stream=broken) for n in "abcd"])

    async def run() -> list[llm_pb2.GenerateStreamResponse]:
        return [m async for m in Relay(pool, max_attempts=3, max_resumes=2).generate_stream(REQUEST, CallScope())]

    with pytest.raises(grpc.aio.AioRpcError):
        asyncio.run(run())
    assert pool.down == ["a", "b", "c"]   # the first engine, then two resumes


class RecordingObserver:
    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def retry(self, method: str) -> None:
        self.events.append(("retry", method))

    def resume(self, method: str) -> None:
        self.events.append(("resume", method))


def test_the_attempt_loop_reports_each_retry_and_each_resume_to_its_observer():
    observer = RecordingObserver()
    down = FakeEngine("a", unary=rpc_error(grpc.StatusCode.UNAVAILABLE))
    up = FakeEngine("b", unary=llm_pb2.GenerateResponse(text="hi"))
    asyncio.run(Relay(FakePool(down, up), max_attempts=3, observer=observer).generate(REQUEST, CallScope()))
    assert observer.events == [("retry", "Generate")]

    observer.events.clear()
    broken = FakeEngine("a", stream=([chunk("Hel", [1])], rpc_error(grpc.StatusCode.UNAVAILABLE)))
    refused = FakeEngine("b", stream=([], rpc_error(grpc.StatusCode.UNAVAILABLE)))
    good = FakeEngine("c", stream=([chunk("lo", [2], finish=True)], None))
    relay = Relay(FakePool(broken, refused, good), max_attempts=3, observer=observer)

    async def run() -> str:
        return "".join([m.text async for m in relay.generate_stream(REQUEST, CallScope())])

    assert asyncio.run(run()) == "Hello"
    # b failed after output had been delivered: that is a second resume, not a retry
    assert observer.events == [("resume", "GenerateStream"), ("resume", "GenerateStream")]


def test_a_request_error_is_neither_a_retry_nor_a_resume():
    observer = RecordingObserver()
    bad = FakeEngine("a", unary=rpc_error(grpc.StatusCode.INVALID_ARGUMENT))
    with pytest.raises(grpc.aio.AioRpcError):
        asyncio.run(Relay(FakePool(bad), max_attempts=3, observer=observer).generate(REQUEST, CallScope()))
    assert observer.events == []


def test_a_resumed_stream_reports_the_first_engine_up_front_and_the_last_at_the_end():
    a = FakeEngine("a", stream=([chunk("Hel", [1])], rpc_error(grpc.StatusCode.UNAVAILABLE)),
                   metadata=(("x-llmserve-ttft-seconds", "0.1"),))
    b = FakeEngine("b", stream=([chunk("lo", [2], finish=True)], None), metadata=(("x-llmserve-ttft-seconds", "0.2"),))
    metadata = StreamMetadata()

    async def run() -> list[tuple]:
        seen = []
        async for _ in Relay(FakePool(a, b), max_attempts=3).generate_stream(REQUEST, CallScope(), metadata):
            seen.append(metadata.initial)   # known before the first message reaches the client
        return seen

    seen = asyncio.run(run())
    rid = a.requests[0].request_id
    assert seen == [(("x-llmserve-request-id", rid), ("x-llmserve-engine", "a"), ("x-llmserve-ttft-seconds", "0.1"))] * 2
    assert metadata.trailing == (("x-llmserve-request-id", rid), ("x-llmserve-engine", "b"),
                                 ("x-llmserve-ttft-seconds", "0.2"))
