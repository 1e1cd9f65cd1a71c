"""Per-key limits: the bookkeeping with a fake clock, and both faces of the router in process (a real
grpc.aio server and the real HTTP app) over a relay whose calls wait until the test lets them end,
so "in flight" is exact: one key at its limit is refused with a retry hint, the other key is not."""
from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import httpx
import pytest

from llmserve.v1 import llm_pb2, llm_pb2_grpc
from services.common.config import ConfigError
from services.common.errors import ResourceExhausted
from services.common.security import AUTHORIZATION, AccessPolicy, ServerSecurity, hash_key, load_key_file
from services.common.server import create_server
from services.router.http_security import HttpGuard
from services.router.key_limits import KeyLimitInterceptor, KeyLimits, Limit, MeteredRelay
from services.router.openai_http import OpenAIApp
from services.router.relay import Relayed
from services.router.server import RouterServicer

ALICE, BOB = "alice-key-0123456789", "bob-key-0123456789ab"


def key_file(tmp_path: Path, *lines: str) -> str:
    path = tmp_path / f"api-{len(list(tmp_path.iterdir()))}.keys"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _auth(key: str) -> list[tuple[str, str]]:
    return [(AUTHORIZATION, f"Bearer {key}")]


def test_limits_come_from_the_key_file_or_the_flags(tmp_path):
    path = key_file(tmp_path, f"{hash_key(ALICE)} alice max_concurrent=2 tokens_per_minute=100",
                    f"{hash_key(BOB)} bob smith")
    limits = KeyLimits.from_key_file(path, Limit(max_concurrent=5))
    assert [(u.label, u.limit) for u in limits.usages] == [("alice", Limit(2, 100)), ("bob smith", Limit(5, 0))]
    assert KeyLimits.from_key_file(key_file(tmp_path, hash_key(BOB)), Limit()) is None   # nothing to count
    assert load_key_file(path, "--api-keys-file").matches(ALICE)                         # the guard reads it as before
    with pytest.raises(ConfigError, match="max_concurrent must be a whole number"):
        KeyLimits.from_key_file(key_file(tmp_path, f"{hash_key(ALICE)} max_concurrent=-1"), Limit())


def test_concurrency_and_tokens_per_minute_with_a_clock(tmp_path):
    clock = Clock()
    limits = KeyLimits.from_key_file(key_file(tmp_path, f"{hash_key(ALICE)} alice max_concurrent=2 "
                                              f"tokens_per_minute=100", f"{hash_key(BOB)} bob"), Limit())
    limits.clock = clock
    first, second = limits.admit(_auth(ALICE)), limits.admit(_auth(ALICE))
    with pytest.raises(ResourceExhausted, match="alice has 2 calls in flight") as refused:
        limits.admit(_auth(ALICE))
    assert refused.value.retry_after_ms == 1000
    assert limits.admit(_auth(BOB)) is None                       # bob has no limits: nothing counted
    assert limits.admit(_auth("not a key")) is None
    first.charge(60)
    clock.now += 10
    second.charge(50)
    first.release()
    second.release()
    second.release()                                              # once only
    assert limits.usages[0].in_flight == 0
    with pytest.raises(ResourceExhausted, match="used 110 tokens in the last 60 s") as refused:
        limits.admit(_auth(ALICE))
    assert refused.value.retry_after_ms == 50_000                 # the first 60 tokens leave the window then
    clock.now += 50
    limits.admit(_auth(ALICE)).release()                          # 50 left in the window, under 100


class WaitingRelay:
    """Every call waits for ``release``; replies report 7 tokens."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started = 0

    async def generate(self, request, scope):
        self.started += 1
        await self.release.wait()
        return Relayed(llm_pb2.GenerateResponse(text="ok", usage=llm_pb2.Usage(prompt_tokens=3, completion_tokens=4)),
                       ())


async def _wait_for(predicate, what: str) -> None:
    for _ in range(500):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def _limits(tmp_path: Path) -> tuple[KeyLimits, str]:
    path = key_file(tmp_path, f"{hash_key(ALICE)} alice max_concurrent=2", f"{hash_key(BOB)} bob max_concurrent=2")
    limits = KeyLimits.from_key_file(path, Limit())
    assert limits is not None
    return limits, path


def test_the_http_face_limits_each_key_on_its_own(tmp_path):
    limits, path = _limits(tmp_path)
    relay = WaitingRelay()
    policy = AccessPolicy(client_keys=load_key_file(path, "--api-keys-file"), what="the router")
    app = HttpGuard(OpenAIApp(MeteredRelay(relay)).app, policy, limits)

    async def run() -> tuple[list[httpx.Response], httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router") as http:
            def post(key: str):
                return http.post("/v1/completions", json={"prompt": "Hi"}, headers={"authorization": f"Bearer {key}"})
            held = [asyncio.ensure_future(post(ALICE)) for _ in range(2)]
            await _wait_for(lambda: relay.started == 2, "alice's two calls to reach the relay")
            refused = await post(ALICE)
            bob = asyncio.ensure_future(post(BOB))
            await _wait_for(lambda: relay.started == 3, "bob's call to reach the relay")
            relay.release.set()
            done = await asyncio.gather(*held)
            again = await post(ALICE)
            return [*done, again, await bob], refused, again

    answered, refused, again = asyncio.run(run())
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.headers["retry-after-ms"] == "1000"
    assert refused.json()["error"]["type"] == "rate_limit_error" and "alice has 2 calls" in refused.json()["error"]["message"]
    assert [r.status_code for r in answered] == [200] * 4
    assert limits.usages[0].in_flight == 0 and sum(t for _, t in limits.usages[0].spent) == 21   # 3 calls × 7


def test_the_grpc_face_limits_each_key_on_its_own(tmp_path):
    limits, path = _limits(tmp_path)
    relay = WaitingRelay()
    security = ServerSecurity(AccessPolicy(client_keys=load_key_file(path, "--api-keys-file"), what="the router"))

    async def run() -> tuple[grpc.aio.AioRpcError, list[str]]:
        handle = await create_server(
            [lambda s: llm_pb2_grpc.add_LLMServiceServicer_to_server(RouterServicer(MeteredRelay(relay)), s)], [],
            "127.0.0.1", 0, security, [KeyLimitInterceptor(limits)])
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}") as ch:
                stub = llm_pb2_grpc.LLMServiceStub(ch)

                def call(key: str):
                    return stub.Generate(llm_pb2.GenerateRequest(prompt="Hi"), metadata=_auth(key), timeout=30)
                held = [asyncio.ensure_future(call(ALICE)) for _ in range(2)]
                await _wait_for(lambda: relay.started == 2, "alice's two calls to reach the relay")
                try:
                    await call(ALICE)
                    raise AssertionError("alice's third call was admitted")
                except grpc.aio.AioRpcError as exc:
                    refused = exc
                bob = asyncio.ensure_future(call(BOB))
                await _wait_for(lambda: relay.started == 3, "bob's call to reach the relay")
                relay.release.set()
                texts = [r.text for r in await asyncio.gather(*held, bob, call(ALICE))]
        finally:
            await handle.server.stop(0)
        return refused, texts

    refused, texts = asyncio.run(run())
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "alice has 2 calls" in refused.details()
    assert dict(refused.trailing_metadata())["retry-after-ms"] == "1000"
    assert texts == ["ok"] * 4
    assert limits.usages[0].in_flight == 0 and limits.usages[1].in_flight == 0


class FullRelay:
    async def generate(self, request, scope):
        raise ResourceExhausted("every engine's queue is full", retry_after_ms=2500)


def test_an_engines_retry_hint_reaches_http_clients_too():
    async def run() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=OpenAIApp(FullRelay()).app),
                                     base_url="http://router") as http:
            return await http.post("/v1/completions", json={"prompt": "Hi"})

    resp = asyncio.run(run())
    assert resp.status_code == 429 and resp.headers["retry-after"] == "3" and resp.headers["retry-after-ms"] == "2500"
