"""Domain errors and the one interceptor that maps them to gRPC status codes.

Service code raises ``ServiceError`` subclasses with a message a person can act on; the
interceptor turns them into the matching status. Any other exception becomes ``INTERNAL``
with its message (and a logged traceback) — never ``UNKNOWN``.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any, AsyncIterator, Callable

import grpc

log = logging.getLogger("llmserve.errors")

# Trailing metadata of a RESOURCE_EXHAUSTED answer: when to try again, in milliseconds. Both keys
# carry the same number: ``retry-after-ms`` for application code (HTTP's Retry-After, in ms), and
# ``grpc-retry-pushback-ms``, which gRPC's own retry machinery honours (gRFC A6) in a client whose
# service config retries RESOURCE_EXHAUSTED: it waits that long instead of its backoff.
RETRY_AFTER_KEY = "retry-after-ms"
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"


class ServiceError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, code: grpc.StatusCode | None = None, retry_after_ms: int | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code
        self.retry_after_ms = retry_after_ms    # a hint for the client; sent as trailing metadata

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class InvalidArgument(ServiceError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(ServiceError):
    code = grpc.StatusCode.NOT_FOUND


class ResourceExhausted(ServiceError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(ServiceError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(ServiceError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(ServiceError):
    code = grpc.StatusCode.CANCELLED


class Internal(ServiceError):
    """This request failed inside the service; the service itself is fine (not UNAVAILABLE, which
    tells the router the whole engine is down)."""
    code = grpc.StatusCode.INTERNAL


class FailedPrecondition(ServiceError):
    code = grpc.StatusCode.FAILED_PRECONDITION


def clip(value: str, limit: int = 64) -> str:
    """``value`` for an error message, cut to ``limit`` characters: a client's 20 kB string echoed
    back would overflow gRPC's metadata limit and replace our status with RESOURCE_EXHAUSTED."""
    return repr(value) if len(value) <= limit else repr(value[:limit]) + f"... ({len(value)} characters)"


def retry_metadata(retry_after_ms: int) -> tuple[tuple[str, str], ...]:
    return ((RETRY_AFTER_KEY, str(retry_after_ms)), (RETRY_PUSHBACK_KEY, str(retry_after_ms)))


def retry_after_ms_of(metadata: object) -> int | None:
    """The retry hint in a call's trailing metadata, if it has one."""
    for key, value in metadata or ():  # type: ignore[attr-defined]
        if key == RETRY_AFTER_KEY:
            try:
                return max(0, int(value))
            except ValueError:
                return None
    return None


def trailing_metadata_of(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """What a call that raised ``exc`` sends besides its status: the retry hint, when there is one."""
    hint = getattr(exc, "retry_after_ms", None)
    if hint is None and isinstance(exc, grpc.RpcError) and hasattr(exc, "trailing_metadata"):
        hint = retry_after_ms_of(exc.trailing_metadata())  # an engine's hint, passed on by the router
    return retry_metadata(hint) if hint is not None else ()


def status_of(exc: BaseException, method: str) -> tuple[grpc.StatusCode, str]:
    """The status and message a call that raised ``exc`` ends with."""
    if isinstance(exc, ServiceError):
        return exc.code, exc.message
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        # An upstream call failed (router → engine): pass its status through unchanged.
        code = exc.code()  # type: ignore[attr-defined]
        details = exc.details() if hasattr(exc, "details") else str(exc)  # type: ignore[attr-defined]
        return code or grpc.StatusCode.INTERNAL, details or "upstream call failed"
    log.error("unhandled error in %s", method, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(exc).__name__}: {exc}"


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
                        await context.abort(*status_of(exc, method), trailing_metadata_of(exc))
                return stream

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    return await behavior(request, context)
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:  # noqa: BLE001
                    await context.abort(*status_of(exc, method), trailing_metadata_of(exc))
            return unary

        for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            behavior = getattr(handler, kind)
            if behavior is not None:
                return handler._replace(**{kind: wrap(behavior)})
        return handler
