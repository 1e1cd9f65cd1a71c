"""The router's HTTP face under the same security policy as its gRPC face.

``HttpGuard`` is ASGI middleware around the whole HTTP app, so every route is behind it, those
added later and ``/metrics`` included: a request needs ``Authorization: Bearer <key>`` with one of
the router's API keys (``--api-keys-file``, the same ``AccessPolicy`` and constant-time hash
compare as gRPC). None or a wrong key is 401, a valid credential that may not call the path 403,
in OpenAI's error JSON. ``/health`` is open, like ``grpc.health.v1``: it says only "ok".

``uvicorn_tls`` gives uvicorn the router's ``--tls-cert`` / ``--tls-key``, and with ``--tls-ca``
(unless ``--no-tls-client-auth``) requires a client certificate the CA signed, as the gRPC port does.
"""
from __future__ import annotations

import dataclasses
import ssl
from typing import Any, Awaitable, Callable

import grpc
from starlette.responses import JSONResponse

from services.common.security import AccessPolicy, ServerSecurity

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


def http_headers(scope: Scope) -> list[tuple[str, str]]:
    """An ASGI request's headers as (lower-case name, value) strings."""
    return [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope.get("headers", ())]


class HttpGuard:
    """Refuses HTTP requests that ``policy`` refuses, before any route runs."""

    def __init__(self, app: Asgi, policy: AccessPolicy):
        self.app = app
        self.policy = dataclasses.replace(policy, carrier="header")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.policy.open or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        refusal = self.policy.check(scope["path"], http_headers(scope))
        if refusal is None:
            await self.app(scope, receive, send)
            return
        code, message = refusal
        status, err_type = REFUSAL.get(code, (401, "authentication_error"))
        headers = {"www-authenticate": "Bearer"} if status == 401 else None
        await openai_error(status, message, err_type, code.name.lower(), headers)(scope, receive, send)


def uvicorn_tls(security: ServerSecurity) -> dict[str, Any]:
    """uvicorn's ssl options for the router's TLS files (none: plaintext)."""
    tls = security.tls
    if not tls.enabled:
        return {}
    mtls = bool(tls.ca) and security.require_client_cert
    return {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key, "ssl_ca_certs": tls.ca or None,
            "ssl_cert_reqs": ssl.CERT_REQUIRED if mtls else ssl.CERT_NONE}
