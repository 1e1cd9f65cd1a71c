"""OpenAI-compatible HTTP face of the router: /v1/models, /v1/completions, /v1/chat/completions, /v1/embeddings.

Served by uvicorn on the router's own event loop. Each route turns its JSON body into the public
protobuf request and calls the router's ``Relay`` (the same routing, failover and resumes as the
gRPC face; no second hop). Replies and errors follow OpenAI's shapes; gRPC status codes map to
HTTP ones; what the engines said about the call (request id, engine, queue time, TTFT) comes back
as ``x-llmserve-*`` response headers.
"""
from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any, AsyncIterator

import grpc
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from llmserve.v1 import llm_pb2
from services.common.error_mapping import status_of, trailing_metadata_of
from services.common.errors import retry_after_ms_of
from services.common.metrics_http import with_metrics
from services.common.security import ServerSecurity
from services.router import openai_schema as schema
from services.router.http_protocol import with_read_timeout
from services.router.http_security import HttpGuard, retry_headers, uvicorn_tls
from services.router.key_limits import KeyLimits
from services.router.openai_schema import BadRequest
from services.router.relay import CallScope, Relay, Relayed, StreamMetadata
from services.router.seed_http import SeedApi, http_error
from services.router.structured import apply_structured
from services.router.tools import ToolPlan, plan_tools, rewrite_reply, stream_chunks

log = logging.getLogger("llmserve.router.http")

# An HTTP request may set its deadline with this header (seconds); gRPC callers use their own deadline.
TIMEOUT_HEADER = "x-llmserve-timeout"
MAX_TIMEOUT_SECONDS = 86_400  # a day; past it (1e308, inf) a deadline would overflow into an instant 504
REQUEST_ID_HEADER = "x-request-id"
CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, but the log says what happened

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


class HttpCall:
    """One HTTP request's call into the relay: its id, its deadline, and what the engines said about it."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.scope = CallScope(request_id=request_id)
        self._said: list[StreamMetadata | Relayed] = []

    def set_timeout(self, seconds: float) -> None:
        self.scope = CallScope.within(seconds, request_id=self.request_id)

    def record(self, said: StreamMetadata | Relayed) -> None:
        self._said.append(said)

    def headers(self) -> dict[str, str]:
        """What the call said about itself (request id, engine, queue time, TTFT) as response headers."""
        out = {REQUEST_ID_HEADER: self.request_id}
        for said in self._said:
            pairs = said.metadata if isinstance(said, Relayed) else (*said.initial, *said.trailing)
            for key, value in pairs:
                if key.startswith("x-llmserve-"):
                    out[key] = str(value)
        return out


def error_response(status: int, message: str, err_type: str, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": err_type, "param": param, "code": code}},
                        status_code=status, headers=headers)


def _error_of(exc: BaseException, where: str) -> tuple[int, str, str, str | None, str | None]:
    """(HTTP status, message, type, param, code) for an exception a call ended with."""
    if isinstance(exc, BadRequest):
        return 400, exc.message, "invalid_request_error", exc.param, None
    code, message = status_of(exc, where)
    status, err_type = HTTP_STATUS.get(code, (500, "internal_error"))
    return status, message, err_type, None, code.name.lower()


class OpenAIApp:
    """The routes, bound to the router's relay (``Relay`` or anything with its methods)."""

    def __init__(self, relay: Relay, max_choices: int = schema.MAX_CHOICES):
        self.relay = relay
        self.max_choices = max_choices
        self.app = Starlette(routes=[
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            *SeedApi(self, _until_disconnect).routes,   # the seed's /basic_generate, /generate, /models, /predict...
        ], exception_handlers={404: http_error, 405: http_error})

    # -- routes -------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        ctx = self._context(request)
        try:
            resp = await self.relay.list_models(llm_pb2.ListModelsRequest(), ctx.scope)
        except Exception as exc:  # noqa: BLE001 - every failure becomes an OpenAI error reply
            return self._fail(exc, "/v1/models", ctx)
        return JSONResponse(schema.models_reply(resp), headers=ctx.headers())

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def embeddings(self, request: Request) -> Response:
        ctx = self._context(request)
        try:
            self._deadline(request, ctx)
            body = await self._body(request)
            model, inputs, encoding = schema.embedding_request(body)
            relayed = await _until_disconnect(request, [self.relay.predict(
                llm_pb2.PredictRequest(model_id=model, input_data=text), ctx.scope) for text in inputs])
        except Exception as exc:  # noqa: BLE001
            return self._fail(exc, "/v1/embeddings", ctx)
        if relayed is None:
            return Response(status_code=CLIENT_CLOSED)
        for r in relayed:
            ctx.record(r)
        replies = [r.response for r in relayed]
        for reply in replies:
            if reply.WhichOneof("result") != "embedding":
                return error_response(400, f"model {model} is not an embedding model (its task answers with "
                                      f"{reply.WhichOneof('result')}); use /v1/models to see each model's task",
                                      "invalid_request_error", "model", headers=ctx.headers())
        return JSONResponse(schema.embeddings_reply(model, replies, encoding), headers=ctx.headers())

    # -- generation ---------------------------------------------------------------------------

    async def _generate(self, request: Request, chat: bool) -> Response:
        where = "/v1/chat/completions" if chat else "/v1/completions"
        ctx = self._context(request)
        try:
            self._deadline(request, ctx)
            body = await self._body(request)
            spec = schema.generation_request(body, chat, self.max_choices, ctx.request_id)
            apply_structured(body, spec.requests)   # response_format / structured_outputs
            plan = plan_tools(body, spec) if chat else None
        except Exception as exc:  # noqa: BLE001
            return self._fail(exc, where, ctx)
        if not spec.stream:
            try:
                relayed = await _until_disconnect(request, [self.relay.generate(r, ctx.scope) for r in spec.requests])
            except Exception as exc:  # noqa: BLE001
                return self._fail(exc, where, ctx)
            if relayed is None:
                return Response(status_code=CLIENT_CLOSED)
            for r in relayed:
                ctx.record(r)
            reply = rewrite_reply(plan, schema.generation_reply(spec, [r.response for r in relayed]))
            return JSONResponse(reply, headers=ctx.headers())
        streams = [self._stream_one(i, r, ctx) for i, r in enumerate(spec.requests)]
        merged = _merge(streams)
        first, failed = await self._first(merged, where, ctx)
        if failed is not None:
            return failed
        return StreamingResponse(self._sse(spec, first, merged, where, plan), media_type="text/event-stream",
                                 headers={**ctx.headers(), "cache-control": "no-cache"})

    async def _stream_one(self, index: int, req: llm_pb2.GenerateRequest,
                          ctx: HttpCall) -> AsyncIterator[tuple[int, llm_pb2.GenerateStreamResponse]]:
        metadata = StreamMetadata()
        ctx.record(metadata)
        async for msg in self.relay.generate_stream(req, ctx.scope, metadata):
            yield index, msg

    async def _sse(self, spec: schema.GenerationSpec, first: Any, merged: AsyncIterator[Any],
                   where: str, plan: ToolPlan | None = None) -> AsyncIterator[bytes]:
        chunks = stream_chunks(spec, plan)
        try:
            if first is not None:
                for chunk in chunks.on_message(*first):
                    yield _sse_line(chunk)
                async for index, msg in merged:
                    for chunk in chunks.on_message(index, msg):
                        yield _sse_line(chunk)
            if spec.include_usage:
                yield _sse_line(chunks.usage_chunk())
        except Exception as exc:  # noqa: BLE001 - the status line is sent: the error goes in the stream
            status, message, err_type, param, code = _error_of(exc, where)
            yield _sse_line({"error": {"message": message, "type": err_type, "param": param, "code": code}})
        finally:
            await merged.aclose()  # a client that left: cancels every engine call of this request
        yield b"data: [DONE]\n\n"

    # -- helpers ------------------------------------------------------------------------------

    @staticmethod
    def _context(request: Request) -> HttpCall:
        return HttpCall(request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex)

    @staticmethod
    def _deadline(request: Request, ctx: HttpCall) -> None:
        """Apply the x-llmserve-timeout header (seconds) to the call; a bad value is a 400."""
        raw = request.headers.get(TIMEOUT_HEADER)
        if raw is None:
            return
        try:
            timeout = float(raw)
        except ValueError:
            timeout = -1.0
        if not 0 < timeout <= MAX_TIMEOUT_SECONDS:  # NaN and inf too: no call has an infinite deadline
            raise BadRequest(f"header {TIMEOUT_HEADER} must be a number of seconds in (0, {MAX_TIMEOUT_SECONDS}], "
                             f"got {raw!r}; leave it out for no deadline")
        ctx.set_timeout(timeout)

    @staticmethod
    async def _body(request: Request) -> dict[str, Any]:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRequest(f"the request body is not valid JSON: {exc}") from None
        except RecursionError:
            raise BadRequest("the request body nests arrays or objects too deeply") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        return body

    async def _first(self, messages: Any, where: str, ctx: Any) -> tuple[Any, Response | None]:
        """A stream's first message (None when it is empty), or the HTTP error it failed with before any
        output: waiting for it makes an error before the first token a proper HTTP status."""
        try:
            return await messages.__anext__(), None
        except StopAsyncIteration:
            return None, None
        except Exception as exc:  # noqa: BLE001
            await messages.aclose()
            return None, self._fail(exc, where, ctx)

    @staticmethod
    def _fail(exc: BaseException, where: str, ctx: HttpCall) -> Response:
        status, message, err_type, param, code = _error_of(exc, where)
        log.info("request %s: %s failed with %d: %s", ctx.request_id, where, status, message)
        headers = ctx.headers()
        hint = retry_after_ms_of(trailing_metadata_of(exc))
        if hint is not None:  # an engine's or the router's retry hint
            headers.update(retry_headers(hint))
        return error_response(status, message, err_type, param, code, headers=headers)


async def _until_disconnect(request: Request, calls: list[Any]) -> list[Any] | None:
    """Run the calls together; cancel them all when one fails or the client disconnects (which ends
    the engine sequences, as a gRPC client's cancel does)."""
    tasks = [asyncio.ensure_future(c) for c in calls]
    everything = asyncio.gather(*tasks)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([everything, watcher], return_when=asyncio.FIRST_COMPLETED)
        if not everything.done():
            return None  # the client left: the calls are cancelled below
        return everything.result()
    finally:
        watcher.cancel()
        for t in tasks:
            t.cancel()
        if not everything.done():
            everything.cancel()
        await asyncio.gather(everything, return_exceptions=True)


def _sse_line(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _merge(streams: list[AsyncIterator[Any]]) -> AsyncIterator[Any]:
    """Items of several async iterators as they come; the one stream of n=1 is passed through as is."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    done = object()
    q: asyncio.Queue[Any] = asyncio.Queue()

    async def pump(it: AsyncIterator[Any]) -> None:
        try:
            async for item in it:
                await q.put(item)
            await q.put(done)
        except BaseException as exc:  # noqa: BLE001 - handed to the reader
            await q.put(exc)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            item = await q.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def serve_http(relay: Relay, host: str, port: int, port_file: str = "",
                     security: ServerSecurity = ServerSecurity(),
                     registry: CollectorRegistry | None = None,
                     read_timeout: float = 30.0, limits: KeyLimits | None = None) -> tuple[Any, "asyncio.Task[None]"]:
    """Start uvicorn for the OpenAI face on the running loop; returns (server, its task) once it listens.

    ``security``: the router's API keys and TLS files, applied to every HTTP route (``HttpGuard``,
    ``uvicorn_tls``); ``registry``: also served at ``/metrics``, behind the same guard;
    ``read_timeout``: seconds a client has to send a whole request (``http_protocol``); ``limits``:
    the API keys' limits, admitted by the guard.
    Stop it with ``server.should_exit = True`` and await the task.
    """
    import contextlib

    import uvicorn

    class _EmbeddedServer(uvicorn.Server):
        def capture_signals(self) -> Any:
            return contextlib.nullcontext()  # the router's loop handles SIGTERM/SIGINT and stops us

    from services.common.server import write_port_file

    app: Any = OpenAIApp(relay).app
    if registry is not None:
        app = with_metrics(app, registry)
    config = uvicorn.Config(HttpGuard(app, security.policy, limits), host=host, port=port, log_level="warning",
                            access_log=False, log_config=None,  # keep the router's logging setup
                            lifespan="off", timeout_graceful_shutdown=5, http=with_read_timeout(read_timeout),
                            timeout_keep_alive=5, **uvicorn_tls(security))
    server = _EmbeddedServer(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()  # raises why it could not start
            raise OSError(f"cannot serve HTTP on {host}:{port}")
        await asyncio.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    write_port_file(port_file, bound)
    log.info("OpenAI-compatible HTTP on %s://%s:%d/v1", "https" if security.tls.enabled else "http", host, bound)
    return server, task
