"""The HTTP face's guard, in process: the router's API keys on every route (those it does not know
too, and /metrics), OpenAI's error JSON for refusals, /health open."""
from __future__ import annotations

import asyncio

import httpx
from prometheus_client import CollectorRegistry, Counter

from llmserve.v1 import llm_pb2
from services.common.metrics_http import with_metrics
from services.common.security import AccessPolicy, KeySet
from services.router.http_security import HttpGuard
from services.router.openai_http import OpenAIApp

KEY = "alice-key-0123456789"


class ModelsRelay:
    async def list_models(self, request, scope):
        return llm_pb2.ListModelsResponse(models=[llm_pb2.ModelInfo(id="m", name="m")])


def _app(policy: AccessPolicy) -> HttpGuard:
    registry = CollectorRegistry()
    Counter("llmserve_router_test", "a series", registry=registry).inc()
    return HttpGuard(with_metrics(OpenAIApp(ModelsRelay()).app, registry), policy)


def _get(app: HttpGuard, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
    async def run() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as http:
            return await http.get(path, headers=headers)
    return asyncio.run(run())


def test_every_route_needs_a_valid_key():
    app = _app(AccessPolicy(client_keys=KeySet.of_keys(KEY), what="the router"))
    for path in ("/v1/models", "/metrics", "/v1/a-route-added-later", "/"):
        missing = _get(app, path)
        assert missing.status_code == 401, path
        assert missing.headers["www-authenticate"] == "Bearer"
        assert missing.json() == {"error": {
            "message": "the router needs an API key: send the header 'authorization: Bearer <key>'",
            "type": "authentication_error", "param": None, "code": "unauthenticated"}}
        wrong = _get(app, path, {"Authorization": "Bearer not-the-key"})
        assert wrong.status_code == 401 and wrong.json()["error"]["message"] == "the router: the API key is not valid"
        assert _get(app, path, {"Authorization": f"Basic {KEY}"}).status_code == 401
    ok = _get(app, "/v1/models", {"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "m"
    metrics = _get(app, "/metrics", {"authorization": f"bearer {KEY}"})
    assert metrics.status_code == 200 and "llmserve_router_test_total 1.0" in metrics.text
    assert _get(app, "/v1/a-route-added-later", {"Authorization": f"Bearer {KEY}"}).status_code == 404


def test_health_is_open_and_no_keys_means_open():
    assert _get(_app(AccessPolicy(client_keys=KeySet.of_keys(KEY))), "/health").json() == {"status": "ok"}
    assert _get(_app(AccessPolicy()), "/v1/models").status_code == 200


def test_openai_clients_send_their_api_key_as_the_bearer():
    import openai

    app = _app(AccessPolicy(client_keys=KeySet.of_keys(KEY), what="the router"))

    async def models(api_key: str) -> list[str]:
        client = openai.AsyncOpenAI(base_url="http://router/v1", api_key=api_key, max_retries=0,
                                    http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=app)))
        return [m.id async for m in client.models.list()]

    assert asyncio.run(models(KEY)) == ["m"]
    try:
        asyncio.run(models("wrong"))
        raise AssertionError("a wrong key was let in")
    except openai.AuthenticationError as exc:
        assert exc.status_code == 401 and exc.body["message"] == "the router: the API key is not valid"
