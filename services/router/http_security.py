"""The router's HTTP face under the same security policy as its gRPC face.

``HttpGuard`` is ASGI middleware around the whole HTTP app, so every route is behind it, those
added later and ``/metrics`` included: a request needs ``Authorization: Bearer <key>`` with one of
the router's API keys (``--api-keys-file``, the same ``AccessPolicy`` and constant-time hash
compare as gRPC). None or a wrong key is 401, a valid credential that may not call the path 403,
in OpenAI's error JSON. ``/health`` is open, like ``grpc.health.v1``: it says only "ok". With
``limits``, an admitted request holds its key's slot until its response is sent (a stream to its
end); past a key's limit it is 429 with ``retry-after`` (s) and ``retry-after-ms``.

``uvicorn_tls`` gives uvicorn the router's ``--tls-cert`` / ``--tls-key``, and with ``--tls-ca``
(unless ``--no-tls-client-auth``) requires a client certificate the CA signed, as the gRPC port does.
"""
from __future__ import annotations

import dataclasses
import math
import ssl
from typing import Any, Awaitable, Callable

import grpc
from starlette.responses import JSONResponse

from services.common.errors import RETRY_AFTER_KEY, ResourceExhausted
from services.common.security import AccessPolicy, ServerSecurity
from services.router.key_limits import CONCURRENCY_RETRY_MS, CURRENT, KeyLimits

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Asgi = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health"})

# A refusal's HTTP status and OpenAI error type.
REFUSAL = {
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
}


def openai_error(status: int, message: str, err_type: str, code: str | None = None,
                 headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI's error JSON, for refusals made before any route runs."""
    return JSONResponse({"error": {"message": message, "type": err_type, "param": None, "code": code}},
                        status_code=status, headers=headers)


def retry_headers(retry_after_ms: int) -> dict[str, str]:
    """A retry hint as HTTP says it (``retry-after``, whole seconds) and to the millisecond."""
    return {"retry-after": str(math.ceil(retry_after_ms / 1000)), RETRY_AFTER_KEY: str(retry_after_ms)}


def http_headers(scope: Scope) -> list[tuple[str, str]]:
    """An ASGI request's headers as (lower-case name, value) strings."""
    return [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope.get("headers", ())]


class HttpGuard:
    """Refuses HTTP requests that ``policy`` refuses, before any route runs."""

    def __init__(self, app: Asgi, policy: AccessPolicy, limits: KeyLimits | None = None):
        self.app = app
        self.policy = dataclasses.replace(policy, carrier="header")
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.policy.open or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = http_headers(scope)
        refusal = self.policy.check(scope["path"], headers)
        if refusal is None:
            await self._admitted(scope, receive, send, headers)
            return
        code, message = refusal
        status, err_type = REFUSAL.get(code, (401, "authentication_error"))
        challenge = {"www-authenticate": "Bearer"} if status == 401 else None
        await openai_error(status, message, err_type, code.name.lower(), challenge)(scope, receive, send)

    async def _admitted(self, scope: Scope, receive: Receive, send: Send, headers: list[tuple[str, str]]) -> None:
        if self.limits is None:
            await self.app(scope, receive, send)
            return
        try:
            ticket = self.limits.admit(headers)
        except ResourceExhausted as exc:
            await openai_error(429, exc.message, "rate_limit_error", "resource_exhausted",
                               retry_headers(exc.retry_after_ms or CONCURRENCY_RETRY_MS))(scope, receive, send)
            return
        CURRENT.set(ticket)  # this request's task: MeteredRelay counts its tokens against the key
        try:
            await self.app(scope, receive, send)
        finally:
            if ticket is not None:
                ticket.release()


def uvicorn_tls(security: ServerSecurity) -> dict[str, Any]:
    """uvicorn's ssl options for the router's TLS files (none: plaintext)."""
    tls = security.tls
    if not tls.enabled:
        return {}
    mtls = bool(tls.ca) and security.require_client_cert
    return {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key, "ssl_ca_certs": tls.ca or None,
            "ssl_cert_reqs": ssl.CERT_REQUIRED if mtls else ssl.CERT_NONE}
