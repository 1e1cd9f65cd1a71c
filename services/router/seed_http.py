"""The seed's HTTP API, beside the OpenAI one in the router's HTTP app (the reference code's shapes).

The seed documents walk through a FastAPI server (``orca3/llm-model-inference``, chapter 3); these
routes answer its ``curl`` commands as written:

- ``POST /basic_generate {prompt}`` → ``{generated_text}``;
- ``POST /generate {prompts}`` → ``{generated_texts}``, in prompt order (one GenerateBatch);
- ``POST /generate_stream {prompt}`` → ``text/event-stream`` lines ``data: {"token": ..., "sequence_id": ...}``;
- ``GET /models`` → ``{available_models: {id: metadata}, loaded_models: {id: name}}``;
- ``POST /predict {model_id, input_data}`` → ``{predictions: [[p_0, p_1, ...]], labels}`` on a classifier
  (the class probabilities in the model's class order), ``{predictions: [vector], dimension}`` on an
  embedding model, ``{generated_text}`` on a generation model.

Optional extensions on the generation routes: ``model`` (id or name; default: the default model),
``max_tokens`` (default 20, as the reference engine) and ``temperature`` (default 1.0; 0 = greedy). Each route calls the router's ``Relay`` through the OpenAI face (``face``): the same
routing, failover, request ids, deadlines (``x-llmserve-timeout``), ``x-llmserve-*`` headers and
JSON error shape ``{"error": {message, type, param, code}}``, and whatever middleware wraps that app.
"""
from __future__ import annotations

import json
from contextlib import aclosing
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from llmserve.v1 import llm_pb2
from services.router.openai_schema import UINT32, BadRequest, checked_field, json_repr, utf8_text
from services.router.relay import Relay, StreamMetadata

CLIENT_CLOSED = 499
SEED_MAX_TOKENS = 20   # the reference engine's max_tokens (LLMEngine.max_tokens = 20), when a request sets none
# What runs a model of each store format (the reference's "framework" field).
FRAMEWORK = {"gguf": "transformers", "safetensors": "transformers", "onnx": "onnxruntime"}


class HttpFace(Protocol):
    """What these routes use of the OpenAI face (``services.router.openai_http.OpenAIApp``)."""

    relay: Relay

    def _context(self, request: Request) -> Any: ...
    def _deadline(self, request: Request, ctx: Any) -> None: ...
    async def _body(self, request: Request) -> dict[str, Any]: ...
    def _fail(self, exc: BaseException, where: str, ctx: Any) -> Response: ...
    async def _first(self, messages: Any, where: str, ctx: Any) -> tuple[Any, Response | None]: ...


UntilDisconnect = Callable[[Request, list[Any]], Awaitable[list[Any] | None]]


def _text(body: dict[str, Any], key: str) -> str:
    """A required string field, checked as the OpenAI face checks it (type, UTF-8)."""
    value = checked_field(body, key, "str")
    if value is None:
        raise BadRequest(f"'{key}' must be a string, got nothing", key)
    return value


def _optional(body: dict[str, Any], key: str, kind: str) -> Any:
    """An optional field (kind: "int", "number" or "str"), checked as the OpenAI face checks it."""
    return checked_field(body, key, kind, UINT32 if kind == "int" else None)


def _sampling(body: dict[str, Any]) -> llm_pb2.SamplingParams:
    """The optional ``max_tokens`` (default: the reference's 20) and ``temperature`` (the engine's 1.0)."""
    sampling = llm_pb2.SamplingParams()
    max_tokens = _optional(body, "max_tokens", "int")
    if max_tokens is not None and not 0 < max_tokens < 2**32:
        raise BadRequest(f"'max_tokens' must be a positive integer, got {max_tokens}", "max_tokens")
    sampling.max_tokens = SEED_MAX_TOKENS if max_tokens is None else max_tokens
    temperature = _optional(body, "temperature", "number")
    if temperature is not None:
        sampling.temperature = temperature
    return sampling


def predict_reply(reply: llm_pb2.PredictResponse, task: str = "") -> dict[str, Any]:
    """A PredictResponse in the reference's shape: ``predictions`` is one row per input."""
    kind = reply.WhichOneof("result")
    out: dict[str, Any] = {"model_id": reply.model_id}
    if kind == "classification":
        classes = list(reply.classification.classes) or list(reply.classification.labels)
        out["predictions"] = [[c.score for c in classes]]
        out["labels"] = [c.label for c in classes]
    elif kind == "embedding":
        out["predictions"] = [list(reply.embedding.values)]
        out["dimension"] = reply.embedding.dimension
    else:
        out["generated_text"] = reply.text
    return out


def models_reply(resp: llm_pb2.ListModelsResponse) -> dict[str, Any]:
    """ListModels in the reference's shape: every model's metadata by id, and the loaded ones' names."""
    available = {}
    for m in resp.models:
        available[m.id] = {
            "id": m.id, "name": m.name, "type": m.task, "framework": m.framework or FRAMEWORK.get(m.format, m.format),
            "format": m.format, "aliases": list(m.aliases), "loaded": m.loaded, "loaded_on": list(m.loaded_on),
            "context_length": m.context_length, "memory_bytes": m.memory_bytes}
    return {"available_models": available, "loaded_models": {m.id: m.name for m in resp.models if m.loaded}}


class SeedApi:
    def __init__(self, face: HttpFace, until_disconnect: UntilDisconnect):
        self.face = face
        self.until_disconnect = until_disconnect
        self.routes = [
            Route("/basic_generate", self.basic_generate, methods=["POST"]),
            Route("/generate", self.generate, methods=["POST"]),
            Route("/generate_stream", self.generate_stream, methods=["POST"]),
            Route("/models", self.models, methods=["GET"]),
            Route("/predict", self.predict, methods=["POST"]),
        ]

    async def basic_generate(self, request: Request) -> Response:
        async def call(body: dict[str, Any], ctx: Any) -> list[Any]:
            req = llm_pb2.GenerateRequest(model=_optional(body, "model", "str") or "", prompt=_text(body, "prompt"),
                                          sampling=_sampling(body))
            return [self.face.relay.generate(req, ctx.scope)]
        return await self._unary(request, "/basic_generate", call, lambda r: {"generated_text": r[0].text})

    async def generate(self, request: Request) -> Response:
        async def call(body: dict[str, Any], ctx: Any) -> list[Any]:
            prompts = body.get("prompts")
            if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
                raise BadRequest("'prompts' must be a non-empty array of strings", "prompts")
            prompts = [utf8_text(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
            req = llm_pb2.GenerateBatchRequest(model=_optional(body, "model", "str") or "", prompts=prompts,
                                               sampling=_sampling(body))
            return [self.face.relay.generate_batch(req, ctx.scope)]
        return await self._unary(request, "/generate", call,
                                 lambda r: {"generated_texts": [result.text for result in r[0].results]})

    async def predict(self, request: Request) -> Response:
        async def call(body: dict[str, Any], ctx: Any) -> list[Any]:
            req = llm_pb2.PredictRequest(model_id=_text(body, "model_id"), input_data=_text(body, "input_data"))
            return [self.face.relay.predict(req, ctx.scope)]
        return await self._unary(request, "/predict", call, lambda r: predict_reply(r[0]))

    async def models(self, request: Request) -> Response:
        ctx = self.face._context(request)
        try:
            resp = await self.face.relay.list_models(llm_pb2.ListModelsRequest(), ctx.scope)
        except Exception as exc:  # noqa: BLE001 - every failure becomes a JSON error reply
            return self.face._fail(exc, "/models", ctx)
        return JSONResponse(models_reply(resp), headers=ctx.headers())

    async def generate_stream(self, request: Request) -> Response:
        where = "/generate_stream"
        ctx = self.face._context(request)
        try:
            self.face._deadline(request, ctx)
            body = await self.face._body(request)
            req = llm_pb2.GenerateRequest(model=_optional(body, "model", "str") or "", prompt=_text(body, "prompt"),
                                          sampling=_sampling(body))
        except Exception as exc:  # noqa: BLE001
            return self.face._fail(exc, where, ctx)
        metadata = StreamMetadata()
        ctx.record(metadata)
        messages = self.face.relay.generate_stream(req, ctx.scope, metadata)
        first, failed = await self.face._first(messages, where, ctx)
        if failed is not None:
            return failed
        return StreamingResponse(self._events(first, messages, where, ctx), media_type="text/event-stream",
                                 headers={**ctx.headers(), "cache-control": "no-cache"})

    async def _events(self, first: llm_pb2.GenerateStreamResponse | None,
                      messages: AsyncIterator[llm_pb2.GenerateStreamResponse], where: str, ctx: Any) -> AsyncIterator[bytes]:
        async with aclosing(messages):  # a client that left: cancels the engine's sequence
            try:
                if first is not None:
                    if chunk := _event(first):
                        yield chunk
                    async for msg in messages:
                        if chunk := _event(msg):
                            yield chunk
            except Exception as exc:  # noqa: BLE001 - the status line is sent: the error goes in the stream
                yield b"data: " + self.face._fail(exc, where, ctx).body + b"\n\n"

    async def _unary(self, request: Request, where: str,
                     call: Callable[[dict[str, Any], Any], Awaitable[list[Any]]],
                     reply: Callable[[list[Any]], dict[str, Any]]) -> Response:
        ctx = self.face._context(request)
        try:
            self.face._deadline(request, ctx)
            relayed = await self.until_disconnect(request, await call(await self.face._body(request), ctx))
        except Exception as exc:  # noqa: BLE001
            return self.face._fail(exc, where, ctx)
        if relayed is None:
            return Response(status_code=CLIENT_CLOSED)
        for r in relayed:
            ctx.record(r)
        return JSONResponse(reply([r.response for r in relayed]), headers=ctx.headers())


async def http_error(request: Request, exc: Exception) -> Response:
    """An unknown path or method in the HTTP face's JSON error shape, naming what is served."""
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    err_type = "not_found_error" if status == 404 else "invalid_request_error"
    message = (f"{request.method} {request.url.path}: {exc.detail if isinstance(exc, HTTPException) else exc}; this "
               "server answers /v1/models, /v1/completions, /v1/chat/completions, /v1/embeddings, and the seed's "
               "POST /basic_generate, /generate, /generate_stream, /predict and GET /models")
    headers = getattr(exc, "headers", None)
    return JSONResponse({"error": {"message": message, "type": err_type, "param": None, "code": None}},
                        status_code=status, headers=headers)


def _event(msg: llm_pb2.GenerateStreamResponse) -> bytes:
    if not msg.text:
        return b""  # the last message may carry only the finish reason and usage
    line = json.dumps({"token": msg.text, "sequence_id": str(msg.sequence_id)}, ensure_ascii=False)
    return b"data: " + line.encode() + b"\n\n"
