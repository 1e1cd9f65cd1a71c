"""Request bytes that are not the method's message are INVALID_ARGUMENT, on every server.

grpc parses a request with the handler's ``request_deserializer`` before any interceptor's wrapper
runs, and a ``DecodeError`` there (truncated or corrupt wire format, a string field that is not
UTF-8) ends the call ``UNKNOWN``. ``DecodingInterceptor`` takes the parsing over: the handler gets
raw bytes, and its behavior parses them first, so a bad message raises ``InvalidArgument``, which
the error-mapping interceptor (outside this one) sends as the call's status.

Only methods with one request (unary and server-streaming) are parsed here; a client stream (the
worker's ``Execute``, between an engine and the worker it started) keeps grpc's own parsing.
"""
from __future__ import annotations

import inspect
from typing import Any, AsyncIterator, Callable

import grpc
from google.protobuf.message import DecodeError

from services.common.errors import InvalidArgument


def parse(deserialize: Callable[[bytes], Any], raw: bytes, method: str) -> Any:
    try:
        return deserialize(raw)
    except DecodeError as exc:
        raise InvalidArgument(f"{method}: the request is not a valid protobuf message ({exc})") from None


class DecodingInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None or handler.request_streaming:
            return handler
        deserialize, method = handler.request_deserializer, handler_call_details.method
        behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary

        if inspect.isasyncgenfunction(behavior):
            async def stream(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                async for item in behavior(parse(deserialize, raw, method), context):
                    yield item
            wrapped: Callable[..., Any] = stream
        else:
            async def unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
                return await behavior(parse(deserialize, raw, method), context)
            wrapped = unary
        kind = "unary_stream" if handler.response_streaming else "unary_unary"
        return handler._replace(request_deserializer=None, **{kind: wrapped})
