"""The HTTP face's mapping of gRPC failures to OpenAI errors, with the real `openai` client in process
against a relay that fails with each status (the integration tests cover the real stack)."""
from __future__ import annotations

import asyncio

import grpc
import httpx
import openai
import pytest

from llmserve.v1 import llm_pb2
from services.common.errors import ResourceExhausted
from services.router.openai_http import OpenAIApp


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class FailingRelay:
    """Fails every call with ``error``; streams fail after ``good`` messages."""

    def __init__(self, error: BaseException, good: int = 0):
        self.error = error
        self.good = good

    async def generate(self, request, scope):
        raise self.error

    async def generate_stream(self, request, scope, metadata=None):
        for i in range(self.good):
            yield llm_pb2.GenerateStreamResponse(request_id=request.request_id, text=f"t{i}", token_ids=[i])
        raise self.error

    async def predict(self, request, scope):
        raise self.error

    async def list_models(self, request, scope):
        raise self.error


def _client(relay) -> openai.AsyncOpenAI:
    transport = httpx.ASGITransport(app=OpenAIApp(relay).app)
    return openai.AsyncOpenAI(base_url="http://router/v1", api_key="unused", max_retries=0,
                              http_client=httpx.AsyncClient(transport=transport, base_url="http://router"))


CASES = [
    (grpc.StatusCode.INVALID_ARGUMENT, 400, openai.BadRequestError, "invalid_request_error"),
    (grpc.StatusCode.NOT_FOUND, 404, openai.NotFoundError, "not_found_error"),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, openai.RateLimitError, "rate_limit_error"),
    (grpc.StatusCode.UNAVAILABLE, 503, openai.InternalServerError, "service_unavailable"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504, openai.InternalServerError, "timeout"),
]


@pytest.mark.parametrize("code,status,exc_type,err_type", CASES)
def test_grpc_status_maps_to_openai_error(code, status, exc_type, err_type):
    async def run() -> list[openai.APIStatusError]:
        client = _client(FailingRelay(_rpc_error(code, "the engine said why")))
        errors = []
        for call in (lambda: client.completions.create(model="m", prompt="Hi"),
                     lambda: client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                                            stream=True),
                     lambda: client.embeddings.create(model="m", input="Hi"),
                     lambda: client.models.list()):
            try:
                await call()
            except openai.APIStatusError as exc:
                errors.append(exc)
        return errors

    errors = asyncio.run(run())
    assert len(errors) == 4
    for exc in errors:
        assert isinstance(exc, exc_type) and exc.status_code == status
        assert exc.body == {"message": "the engine said why", "type": err_type, "param": None,
                            "code": code.name.lower()}


def test_service_error_raised_in_the_router_maps_too():
    async def run() -> openai.APIStatusError:
        client = _client(FailingRelay(ResourceExhausted("queue full")))
        try:
            await client.completions.create(model="m", prompt="Hi")
        except openai.APIStatusError as exc:
            return exc
        raise AssertionError("no error")

    exc = asyncio.run(run())
    assert exc.status_code == 429 and exc.body["message"] == "queue full"


def test_error_after_the_first_token_ends_the_stream_with_an_error_event():
    async def run() -> list[str]:
        app = OpenAIApp(FailingRelay(_rpc_error(grpc.StatusCode.UNAVAILABLE, "engine died"), good=2)).app
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as http:
            resp = await http.post("/v1/completions", json={"prompt": "Hi", "stream": True})
            assert resp.status_code == 200
            return [line for line in resp.text.splitlines() if line]

    lines = asyncio.run(run())
    assert lines[-1] == "data: [DONE]"
    assert '"engine died"' in lines[-2] and '"service_unavailable"' in lines[-2]
    assert lines[0].startswith('data: {"id":"cmpl-')


def test_a_bad_timeout_header_is_400():
    async def run() -> httpx.Response:
        app = OpenAIApp(FailingRelay(_rpc_error(grpc.StatusCode.INTERNAL, "not reached"))).app
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as http:
            return await http.post("/v1/completions", json={"prompt": "Hi"}, headers={"x-llmserve-timeout": "soon"})

    resp = asyncio.run(run())
    assert resp.status_code == 400 and "x-llmserve-timeout" in resp.json()["error"]["message"]
