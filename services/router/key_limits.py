"""Per-API-key limits of the router: requests in flight and tokens per minute, on both faces.

A key's limits come from its line in ``--api-keys-file`` (``<sha256> alice max_concurrent=4
tokens_per_minute=20000``), else from ``--key-max-concurrent`` / ``--key-tokens-per-minute``
(0 = no limit). A call is admitted while its key has fewer than ``max_concurrent`` calls in flight
and used fewer than ``tokens_per_minute`` tokens (prompt + completion) in the last 60 s; what the
call uses is counted when the engine reports it (a reply's or a stream's last message's usage), as
LiteLLM's and Envoy's token budgets do. A call past either is refused at once with
RESOURCE_EXHAUSTED (HTTP 429) and a retry hint: when the oldest counted tokens leave the window,
or 1 s for concurrency. Keys are independent: one key at its limit does not slow another.

The faces admit (``KeyLimits.admit``: the gRPC ``KeyLimitInterceptor``, the HTTP guard); the
tokens are counted by ``MeteredRelay``, which wraps the relay both faces call, and finds the call's
ticket in a context variable the face set.
"""
from __future__ import annotations

import collections
import contextlib
import contextvars
import inspect
import math
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterator

import grpc

from llmserve.v1 import llm_pb2
from services.common.config import ConfigError
from services.common.errors import ResourceExhausted
from services.common.security import AUTHORIZATION, KeySet, bearer_token, read_key_file

WINDOW_SECONDS = 60.0
CONCURRENCY_RETRY_MS = 1000      # no telling when a call in flight ends: a second is a fair guess
OPTIONS = ("max_concurrent", "tokens_per_minute")


@dataclass(frozen=True)
class Limit:
    max_concurrent: int = 0          # calls in flight at once; 0 = no limit
    tokens_per_minute: int = 0       # prompt + completion tokens in the last 60 s; 0 = no limit

    @property
    def unlimited(self) -> bool:
        return not self.max_concurrent and not self.tokens_per_minute


@dataclass
class KeyUsage:
    """One key's calls in flight and the tokens it used in the window."""

    label: str
    limit: Limit
    in_flight: int = 0
    spent: collections.deque[tuple[float, int]] = field(default_factory=collections.deque)   # (when, tokens)

    def tokens_in_window(self, now: float) -> int:
        while self.spent and self.spent[0][0] <= now - WINDOW_SECONDS:
            self.spent.popleft()
        return sum(tokens for _, tokens in self.spent)

    def retry_after_ms(self, now: float) -> int:
        """When enough counted tokens will have left the window for a call to be admitted."""
        used = self.tokens_in_window(now)
        for when, tokens in self.spent:
            used -= tokens
            if used < self.limit.tokens_per_minute:
                return max(1, math.ceil((when + WINDOW_SECONDS - now) * 1000))
        return 1


class Ticket:
    """An admitted call: counts its tokens against its key, and frees its slot once (``release``)."""

    def __init__(self, usage: KeyUsage, clock: Callable[[], float]):
        self.usage = usage
        self._clock = clock
        self._released = False

    def charge(self, tokens: int) -> None:
        if tokens > 0:
            self.usage.spent.append((self._clock(), tokens))

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.usage.in_flight -= 1


CURRENT: contextvars.ContextVar[Ticket | None] = contextvars.ContextVar("llmserve_key_ticket", default=None)


class KeyLimits:
    """The limits of every API key; ``admit`` is the one way in. Lives on the router's event loop."""

    def __init__(self, keys: KeySet, usages: list[KeyUsage], clock: Callable[[], float] = time.monotonic):
        self.keys = keys
        self.usages = usages
        self.clock = clock
        self.on_refused: Callable[[str, str], None] = lambda label, limit: None   # (key label, limit name)

    @classmethod
    def from_key_file(cls, path: str, default: Limit, flag: str = "--api-keys-file") -> "KeyLimits | None":
        """None when no key has a limit (nothing to count)."""
        entries = read_key_file(path, flag)
        usages = [_usage_of(rest, default, f"{flag}: {path}", f"#{i + 1}") for i, (_, rest) in enumerate(entries)]
        if all(u.limit.unlimited for u in usages):
            return None
        return cls(KeySet(digest for digest, _ in entries), usages)

    def admit(self, headers: Iterator[tuple[str, Any]] | Any) -> Ticket | None:
        """A ticket for the call whose metadata/headers are ``headers`` (the guard already checked the
        key); None when its key has no limits. Raises ResourceExhausted past a limit."""
        presented = None
        for k, v in headers:
            if k.lower() == AUTHORIZATION and isinstance(v, str):
                presented = bearer_token(v)
                break
        index = self.keys.index_of(presented) if presented is not None else None
        if index is None:
            return None
        usage = self.usages[index]
        limit, now = usage.limit, self.clock()
        if limit.unlimited:
            return None
        if limit.max_concurrent and usage.in_flight >= limit.max_concurrent:
            self.on_refused(usage.label, "max_concurrent")
            raise ResourceExhausted(f"API key {usage.label} has {usage.in_flight} calls in flight, its limit "
                                    f"(max_concurrent={limit.max_concurrent}); retry when one ends",
                                    retry_after_ms=CONCURRENCY_RETRY_MS)
        if limit.tokens_per_minute and usage.tokens_in_window(now) >= limit.tokens_per_minute:
            self.on_refused(usage.label, "tokens_per_minute")
            raise ResourceExhausted(f"API key {usage.label} used {usage.tokens_in_window(now)} tokens in the last "
                                    f"{WINDOW_SECONDS:.0f} s, its limit (tokens_per_minute="
                                    f"{limit.tokens_per_minute})", retry_after_ms=usage.retry_after_ms(now))
        usage.in_flight += 1
        return Ticket(usage, self.clock)


    @contextlib.contextmanager
    def admitted(self, headers: Any) -> Iterator[Ticket | None]:
        """``admit``, with the ticket as the call's (``CURRENT``) until the block ends, then released.
        Each call (a gRPC handler, an HTTP request) runs in a task of its own, whose context ends with
        it: ``CURRENT`` is set, never reset (a stream's ``finally`` may run in another context)."""
        ticket = self.admit(headers)
        CURRENT.set(ticket)
        try:
            yield ticket
        finally:
            if ticket is not None:
                ticket.release()


def _usage_of(rest: str, default: Limit, where: str, unlabelled: str) -> KeyUsage:
    """A key line's label and limits: ``name=value`` words set limits, the other words are its label
    (``unlabelled`` when there are none: the key's place in the file)."""
    values = {"max_concurrent": default.max_concurrent, "tokens_per_minute": default.tokens_per_minute}
    label = []
    for word in rest.split():
        name, eq, value = word.partition("=")
        if eq and name in OPTIONS:
            if not value.isdigit():
                raise ConfigError(f"{where}: key {unlabelled}: {name} must be a whole number >= 0, got {value!r}")
            values[name] = int(value)
        else:
            label.append(word)
    return KeyUsage(" ".join(label) or unlabelled, Limit(**values))


def usage_tokens(response: Any) -> int:
    """The tokens an engine reply reports (a batch: all its results)."""
    if isinstance(response, llm_pb2.GenerateBatchResponse):
        return sum(usage_tokens(r) for r in response.results)
    usage = getattr(response, "usage", None)
    return usage.prompt_tokens + usage.completion_tokens if usage is not None else 0


def charge(response: Any) -> None:
    ticket = CURRENT.get()
    if ticket is not None:
        ticket.charge(usage_tokens(response))


class MeteredRelay:
    """The relay, counting each reply's tokens against the calling key (anything else passes through)."""

    def __init__(self, relay: Any):
        self._relay = relay

    def __getattr__(self, name: str) -> Any:
        return getattr(self._relay, name)

    async def generate(self, request: Any, scope: Any) -> Any:
        relayed = await self._relay.generate(request, scope)
        charge(relayed.response)
        return relayed

    async def generate_batch(self, request: Any, scope: Any) -> Any:
        relayed = await self._relay.generate_batch(request, scope)
        charge(relayed.response)
        return relayed

    async def generate_stream(self, request: Any, scope: Any, metadata: Any = None) -> AsyncIterator[Any]:
        async for msg in self._relay.generate_stream(request, scope, metadata):
            if msg.finish_reason:  # the last message of the sequence carries its usage
                charge(msg)
            yield msg


class KeyLimitInterceptor(grpc.aio.ServerInterceptor):
    """The gRPC face's admission: inside the error mapping (a refusal is RESOURCE_EXHAUSTED with its
    hint) and after the guard (only valid keys get here)."""

    def __init__(self, limits: KeyLimits):
        self.limits = limits

    async def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        limits = self.limits
        kind = "unary_stream" if handler.response_streaming else "unary_unary"
        behavior = getattr(handler, kind)

        if inspect.isasyncgenfunction(behavior):
            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                with limits.admitted(context.invocation_metadata() or ()):
                    async for item in behavior(request, context):
                        yield item
            return handler._replace(**{kind: stream})

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with limits.admitted(context.invocation_metadata() or ()):
                return await behavior(request, context)
        return handler._replace(**{kind: unary})
