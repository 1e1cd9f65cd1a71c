"""Per-call metadata shared by router and engine: one request id from client to worker (the request's
``request_id`` or ``x-llmserve-request-id`` metadata), and what a call reports about itself in its
trailers (a stream also in its initial metadata): the engine that served it, queue time, TTFT."""
from __future__ import annotations

import re
import uuid
from typing import Any, Iterable

from services.common.errors import InvalidArgument, clip

REQUEST_ID_KEY = "x-llmserve-request-id"
ENGINE_KEY = "x-llmserve-engine"
QUEUE_SECONDS_KEY = "x-llmserve-queue-seconds"     # arrival at the engine → first scheduled step
TTFT_SECONDS_KEY = "x-llmserve-ttft-seconds"       # arrival at the engine → first token read by its call
# Speculative decoding, when the request was speculated: drafts verified, draft tokens, accepted tokens.
SPEC_DRAFTS_KEY = "x-llmserve-spec-drafts"
SPEC_DRAFT_TOKENS_KEY = "x-llmserve-spec-draft-tokens"
SPEC_ACCEPTED_TOKENS_KEY = "x-llmserve-spec-accepted-tokens"


# A request id travels in metadata, headers and log lines: printable ASCII without spaces, bounded.
# A request of n choices (HTTP ``n``, prompt lists) runs one sequence per choice, each with the
# client's id and a "-k" suffix: a valid id keeps valid with it.
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}(?:-[0-9]{1,4})?")


def checked_request_id(rid: str) -> str:
    """``rid`` if it can travel as metadata; INVALID_ARGUMENT otherwise (a control character in it
    would fail the call inside gRPC)."""
    if not _REQUEST_ID.fullmatch(rid):
        raise InvalidArgument(f"request_id {clip(rid)} must be 1 to 128 printable ASCII characters without spaces")
    return rid


def request_id_of(request: Any, context: Any) -> str:
    """The client's id (the request's ``request_id``, else ``x-llmserve-request-id`` metadata), else a new one."""
    rid = getattr(request, "request_id", "")
    if rid:
        return checked_request_id(rid)
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY and value:
            return checked_request_id(str(value))
    return uuid.uuid4().hex


def with_request_id(request: Any, rid: str) -> Any:
    """``request`` with ``request_id`` set to ``rid`` (a copy when it changes; messages without the field as is)."""
    if not hasattr(request, "request_id") or request.request_id == rid:
        return request
    out = type(request)()
    out.CopyFrom(request)
    out.request_id = rid
    return out


def outgoing(rid: str) -> tuple[tuple[str, str], ...]:
    """Metadata of the router's call to an engine."""
    return ((REQUEST_ID_KEY, rid),)


def relayed(engine_metadata: Iterable[tuple[str, Any]] | None, engine: str, rid: str) -> tuple[tuple[str, str], ...]:
    """What to tell the client: the engine's x-llmserve-* entries, with the router's view of who served it."""
    out = [(k, str(v)) for k, v in engine_metadata or () if k.startswith("x-llmserve-")
           and k not in (ENGINE_KEY, REQUEST_ID_KEY)]
    return ((REQUEST_ID_KEY, rid), (ENGINE_KEY, engine), *out)
