"""The error-mapping interceptor: a handler's exception becomes its call's status, and a call that is
already over when the status goes out ends quietly (no traceback in the server's log)."""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
import pytest
from grpc._cython.cygrpc import ExecuteBatchError  # what a send on a call that core has closed raises

from services.common.error_mapping import ErrorMappingInterceptor
from services.common.errors import DeadlineExceeded


class Details:
    method = "/llmserve.v1.LLMService/Generate"


class Context:
    """The two outcomes of ``ServicerContext.abort``: the status went out (grpc raises ``AbortError``),
    or the call had already ended (the deadline passed at that moment: the send fails)."""

    def __init__(self, call_over: bool):
        self.call_over = call_over
        self.aborted: list[tuple[Any, ...]] = []

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: tuple = ()) -> None:
        self.aborted.append((code, details))
        if self.call_over:
            raise ExecuteBatchError('Failed "execute_batch": (SendInitialMetadataOperation, SendStatusFromServerOperation)')
        raise grpc.aio.AbortError("Locally aborted.")


def wrapped(kind: str) -> Any:
    async def unary(request: Any, context: Any) -> Any:
        raise DeadlineExceeded("deadline passed after 0 generated tokens")

    async def stream(request: Any, context: Any) -> Any:
        yield "first"
        raise DeadlineExceeded("deadline passed after 1 generated tokens")

    plain = (grpc.unary_unary_rpc_method_handler(unary) if kind == "unary"
             else grpc.unary_stream_rpc_method_handler(stream))

    async def continuation(details: Any) -> Any:
        return plain

    mapped = asyncio.run(ErrorMappingInterceptor().intercept_service(continuation, Details()))
    return mapped.unary_unary if kind == "unary" else mapped.unary_stream


async def call(behavior: Any, kind: str, context: Context) -> list[Any]:
    if kind == "unary":
        return [await behavior(None, context)]
    return [item async for item in behavior(None, context)]


@pytest.mark.parametrize("kind", ["unary", "stream"])
def test_an_error_becomes_the_status(kind):
    context = Context(call_over=False)
    with pytest.raises(grpc.aio.AbortError):
        asyncio.run(call(wrapped(kind), kind, context))
    assert context.aborted == [(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed after "
                                + ("0" if kind == "unary" else "1") + " generated tokens")]


@pytest.mark.parametrize("kind", ["unary", "stream"])
def test_a_call_already_over_ends_quietly(kind, caplog):
    """Its status cannot be sent any more: the handler ends as a cancelled one, which grpc logs at debug
    level, instead of letting grpc's ExecuteBatchError out (logged with a traceback)."""
    context = Context(call_over=True)
    with caplog.at_level(logging.DEBUG), pytest.raises(asyncio.CancelledError):
        asyncio.run(call(wrapped(kind), kind, context))
    assert len(context.aborted) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
