"""Per-key limits on both faces of a real router (router → engine → worker, tiny model): a key past
its tokens per minute or its calls in flight is refused with a retry hint on gRPC and HTTP, while
another key's calls go through."""
from __future__ import annotations

from typing import Iterator, NamedTuple

import grpc
import httpx
import pytest

from llmserve.v1 import llm_pb2, llm_pb2_grpc
from services.common.security import AUTHORIZATION, hash_key
from services.stack import ServiceProcess, Stack, start_service
from tests.helpers import wait_until

ALICE, BOB, CAROL = "alice-key-0123456789", "bob-key-0123456789ab", "carol-key-0123456789"


class Limited(NamedTuple):
    router: llm_pb2_grpc.LLMServiceStub
    http: str


@pytest.fixture(scope="module")
def limited(tiny_stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Limited]:
    d = tmp_path_factory.mktemp("key-limits")
    (d / "api.keys").write_text(f"{hash_key(ALICE)} alice tokens_per_minute=20\n"
                                f"{hash_key(BOB)} bob max_concurrent=1\n"
                                f"{hash_key(CAROL)} carol\n")
    proc: ServiceProcess = start_service("services.router", [
        "--engines", tiny_stack.engines[0].address, "--api-keys-file", str(d / "api.keys"), "--http-port", "0",
        "--http-port-file", str(d / "http.port"), "--health-interval", "0.2"], log_path=d / "router.log")
    try:
        with grpc.insecure_channel(proc.address) as channel:
            yield Limited(llm_pb2_grpc.LLMServiceStub(channel), f"http://127.0.0.1:{(d / 'http.port').read_text().strip()}")
    finally:
        proc.stop()


def _generate(stub: llm_pb2_grpc.LLMServiceStub, key: str, max_tokens: int = 4) -> grpc.StatusCode:
    try:
        stub.Generate(llm_pb2.GenerateRequest(prompt="Hello", sampling=llm_pb2.SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, temperature=0)), metadata=[(AUTHORIZATION, f"Bearer {key}")],
            timeout=60)
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc  # type: ignore[return-value]


def _post(limited: Limited, key: str) -> httpx.Response:
    return httpx.post(f"{limited.http}/v1/completions", headers={"authorization": f"Bearer {key}"},
                      json={"prompt": "Hello", "max_tokens": 2}, timeout=60)


def test_a_key_past_its_tokens_per_minute_waits_and_another_does_not(limited: Limited):
    assert _generate(limited.router, ALICE, max_tokens=24) is grpc.StatusCode.OK   # 24 + the prompt > 20
    refused = _generate(limited.router, ALICE)
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused  # type: ignore[union-attr]
    assert "alice used" in refused.details() and "tokens_per_minute=20" in refused.details()  # type: ignore[union-attr]
    hint = int(dict(refused.trailing_metadata())["retry-after-ms"])  # type: ignore[union-attr]
    assert 50_000 < hint <= 60_000
    http = _post(limited, ALICE)
    assert http.status_code == 429 and http.json()["error"]["type"] == "rate_limit_error"
    assert 50 <= int(http.headers["retry-after"]) <= 60
    assert _generate(limited.router, CAROL) is grpc.StatusCode.OK
    assert _post(limited, CAROL).status_code == 200
    metrics = httpx.get(f"{limited.http}/metrics", headers={"authorization": f"Bearer {CAROL}"}, timeout=30).text
    assert 'llmserve_router_key_limit_refusals_total{key="alice",limit="tokens_per_minute"} 2.0' in metrics


def test_a_key_at_its_calls_in_flight_is_refused_and_another_is_not(limited: Limited):
    held = limited.router.GenerateStream(llm_pb2.GenerateRequest(prompt="Hello", sampling=llm_pb2.SamplingParams(
        max_tokens=480, ignore_eos=True)), metadata=[(AUTHORIZATION, f"Bearer {BOB}")], timeout=120)
    try:
        next(held)   # bob's one slot is held while this stream runs
        http = _post(limited, BOB)
        refused = _generate(limited.router, BOB)
        carol = _post(limited, CAROL)
        rest = sum(1 for _ in held)
    finally:
        held.cancel()
    assert rest > 0, "the held stream ended before the checks: they prove nothing"
    assert http.status_code == 429 and http.headers["retry-after"] == "1", http.text
    assert "bob has 1 calls in flight" in http.json()["error"]["message"]
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[union-attr]
    assert dict(refused.trailing_metadata())["retry-after-ms"] == "1000"  # type: ignore[union-attr]
    assert carol.status_code == 200
    wait_until(lambda: _post(limited, BOB).status_code == 200, 30, "bob's slot to be free once his stream ended")
