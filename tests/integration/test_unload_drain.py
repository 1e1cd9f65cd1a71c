"""UnloadModel under load (issue 19): the drain waits at most its stated bound, a request for the
draining model is answered UNAVAILABLE at once with a retry hint (through the router too, which
does not take the engine for down), and the streams in flight finish whole. Real processes."""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from llmserve.v1 import engine_admin_pb2, engine_admin_pb2_grpc, llm_pb2, llm_pb2_grpc
from services.stack import Stack, start_stack
from tests.conftest import TINY_ENGINE_ARGS

LONG = llm_pb2.SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
SHORT = llm_pb2.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(["--model", str(tiny_model_dir), *TINY_ENGINE_ARGS], log_dir=tmp_path_factory.mktemp("drain"),
                    http_port=-1, router_args=["--health-interval", "0.2"])
    yield s
    s.stop()


def test_an_unload_under_load_is_bounded_and_refuses_new_requests_at_once(stack: Stack):
    assert stack.router is not None
    with grpc.insecure_channel(stack.router.address) as rch, grpc.insecure_channel(stack.engines[0].address) as ech:
        router = llm_pb2_grpc.LLMServiceStub(rch)
        admin = engine_admin_pb2_grpc.EngineAdminStub(ech)
        streams = [router.GenerateStream(llm_pb2.GenerateRequest(prompt=f"Story {i}:", sampling=LONG), timeout=300)
                   for i in range(8)]
        firsts = [next(s) for s in streams]  # all running
        unload: list[object] = []

        def call_unload() -> None:
            started = time.monotonic()
            try:
                admin.UnloadModel(engine_admin_pb2.UnloadModelRequest(drain_timeout_ms=1500), timeout=60)
                unload.append((grpc.StatusCode.OK, "", time.monotonic() - started))
            except grpc.RpcError as exc:
                unload.append((exc.code(), exc.details(), time.monotonic() - started))

        unloader = threading.Thread(target=call_unload)
        unloader.start()
        refused = None
        deadline = time.monotonic() + 1.5
        while refused is None and time.monotonic() < deadline and unloader.is_alive():
            started = time.monotonic()
            try:
                router.Generate(llm_pb2.GenerateRequest(prompt="Hi", sampling=SHORT), timeout=30)
            except grpc.RpcError as exc:
                refused = (exc.code(), exc.details(), dict(exc.trailing_metadata() or ()), time.monotonic() - started)
        unloader.join(30)
        tokens = [len(f.token_ids) + sum(len(p.token_ids) for p in s) for f, s in zip(firsts, streams)]
        after = router.Generate(llm_pb2.GenerateRequest(prompt="Hi", sampling=SHORT), timeout=60)
    assert refused is not None, "no request was refused while the model drained"
    code, details, trailers, seconds = refused
    assert code == grpc.StatusCode.UNAVAILABLE and "being unloaded" in details, details
    assert seconds < 1.0 and int(trailers["retry-after-ms"]) >= 100
    ((unload_code, unload_details, unload_seconds),) = unload
    assert unload_seconds < 4.0, unload_seconds  # the bound (1.5 s) plus a close, never ~30 s
    assert unload_code in (grpc.StatusCode.OK, grpc.StatusCode.FAILED_PRECONDITION), unload_details
    if unload_code == grpc.StatusCode.FAILED_PRECONDITION:
        assert "bound of 1.5s" in unload_details
    assert tokens == [300] * 8  # the streams in flight finished whole
    assert len(after.token_ids) == 2
