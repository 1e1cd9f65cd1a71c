"""The one interceptor that maps exceptions to gRPC status codes, for every server.

Service code raises ``ServiceError`` subclasses (``services.common.errors``); the interceptor turns
them into the matching status. An upstream call's error keeps its status. Any other exception
becomes ``INTERNAL`` with its message (and a logged traceback) — never ``UNKNOWN``.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
from typing import Any, AsyncIterator, Callable

import grpc

from services.common.errors import ServiceError, retry_after_ms_of, retry_metadata

log = logging.getLogger("llmserve.errors")


def status_of(exc: BaseException, method: str) -> tuple[grpc.StatusCode, str]:
    """The status and message a call that raised ``exc`` ends with."""
    if isinstance(exc, ServiceError):
        return grpc.StatusCode[exc.code], exc.message
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        # An upstream call failed (router → engine): pass its status through unchanged.
        code = exc.code()  # type: ignore[attr-defined]
        details = exc.details() if hasattr(exc, "details") else str(exc)  # type: ignore[attr-defined]
        return code or grpc.StatusCode.INTERNAL, details or "upstream call failed"
    log.error("unhandled error in %s", method, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(exc).__name__}: {exc}"


def trailing_metadata_of(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """What a call that raised ``exc`` sends besides its status: the retry hint, when there is one."""
    hint = getattr(exc, "retry_after_ms", None)
    if hint is None and isinstance(exc, grpc.RpcError) and hasattr(exc, "trailing_metadata"):
        hint = retry_after_ms_of(exc.trailing_metadata())  # an engine's hint, passed on by the router
    return retry_metadata(hint) if hint is not None else ()


async def end_call(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    """End the call with ``exc``'s status (raises grpc's ``AbortError``, as ``context.abort`` does).

    When the call ended first (its deadline passed, or its client left, at that very moment), gRPC has
    already given it a status and sending another fails (grpc's ``ExecuteBatchError``, logged with a
    traceback unless grpc has seen the close by then): the handler then ends quietly, as a cancelled one."""
    try:
        await context.abort(*status_of(exc, method), trailing_metadata_of(exc))
    except grpc.aio.AbortError:
        raise
    except Exception as lost:  # noqa: BLE001 - only a call that is already over fails to take its status
        log.debug("%s was over before its status (%s) could be sent: %s", method, type(exc).__name__, lost)
        raise asyncio.CancelledError from None


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every handler (coroutine or async generator) so exceptions map to status codes."""

    async def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method

        def wrap(behavior: Callable[..., Any]) -> Callable[..., Any]:
            if inspect.isasyncgenfunction(behavior):
                async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                    try:
                        async for item in behavior(request, context):
                            yield item
                    except grpc.aio.AbortError:
                        raise
                    except Exception as exc:  # noqa: BLE001 - the point of this interceptor
                        await end_call(context, exc, method)
                return stream

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    return await behavior(request, context)
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:  # noqa: BLE001
                    await end_call(context, exc, method)
            return unary

        for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            behavior = getattr(handler, kind)
            if behavior is not None:
                return handler._replace(**{kind: wrap(behavior)})
        return handler
