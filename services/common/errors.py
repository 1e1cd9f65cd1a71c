"""Domain errors: what went wrong, with a message a person can act on. Plain Python (no gRPC).

Each names the gRPC status it stands for; ``services.common.error_mapping`` turns it into that
status at the server's edge.
"""
from __future__ import annotations

from typing import Any

# Trailing metadata of a RESOURCE_EXHAUSTED answer: when to try again, in milliseconds. Both keys
# carry the same number: ``retry-after-ms`` for application code (HTTP's Retry-After, in ms), and
# ``grpc-retry-pushback-ms``, which gRPC's own retry machinery honours (gRFC A6) in a client whose
# service config retries RESOURCE_EXHAUSTED: it waits that long instead of its backoff.
RETRY_AFTER_KEY = "retry-after-ms"
RETRY_PUSHBACK_KEY = "grpc-retry-pushback-ms"


class ServiceError(Exception):
    code: str = "INTERNAL"     # the name of a grpc.StatusCode

    def __init__(self, message: str, code: Any = None, retry_after_ms: int | None = None):
        """``code``: a ``grpc.StatusCode`` or its name, to override the class's. ``retry_after_ms``:
        a hint for the client, sent as trailing metadata."""
        super().__init__(message)
        if code is not None:
            self.code = getattr(code, "name", code)
        self.retry_after_ms = retry_after_ms

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class InvalidArgument(ServiceError):
    code = "INVALID_ARGUMENT"


class NotFound(ServiceError):
    code = "NOT_FOUND"


class ResourceExhausted(ServiceError):
    code = "RESOURCE_EXHAUSTED"


class Unavailable(ServiceError):
    code = "UNAVAILABLE"


class DeadlineExceeded(ServiceError):
    code = "DEADLINE_EXCEEDED"


class Cancelled(ServiceError):
    code = "CANCELLED"


class Internal(ServiceError):
    """This request failed inside the service; the service itself is fine (not UNAVAILABLE, which
    tells the router the whole engine is down)."""
    code = "INTERNAL"


class FailedPrecondition(ServiceError):
    code = "FAILED_PRECONDITION"


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
