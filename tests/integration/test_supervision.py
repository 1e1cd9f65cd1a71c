"""Supervision under ``make up`` (issue 19): a service of the stack that dies is started again, on
its ports, and serves; the rest of the stack keeps running. Real processes."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from llmserve.v1 import llm_pb2, llm_pb2_grpc
from services.stack import Stack, start_stack
from services.supervisor import Supervisor
from tests.conftest import TINY_ENGINE_ARGS
from tests.helpers import wait_until

SHORT = llm_pb2.SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(["--model", str(tiny_model_dir), *TINY_ENGINE_ARGS], log_dir=tmp_path_factory.mktemp("sup"),
                    router_args=["--health-interval", "0.2"], supervise=True)
    yield s
    s.stop()


def generate(address: str) -> llm_pb2.GenerateResponse | None:
    try:
        with grpc.insecure_channel(address) as ch:
            return llm_pb2_grpc.LLMServiceStub(ch).Generate(llm_pb2.GenerateRequest(prompt="Hi", sampling=SHORT),
                                                           timeout=10)
    except grpc.RpcError:
        return None


def test_a_killed_router_comes_back_on_its_ports_and_serves(stack: Stack):
    assert stack.router is not None
    old, address, http = stack.router, stack.router.address, stack.http_address
    engine_pid = stack.engines[0].proc.pid
    assert generate(address) is not None
    os.kill(old.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    reply = wait_until(lambda: generate(address), 60, "the killed router to serve again at its address")
    took = time.monotonic() - killed
    wait_until(lambda: stack.router is not old, 30, "the stack to hold the new router")
    assert len(reply.token_ids) == 3
    assert stack.router is not old and stack.router.alive and stack.router.address == address
    assert stack.http_address == http  # its HTTP port too
    assert stack.engines[0].proc.pid == engine_pid and stack.engines[0].alive  # the rest kept running
    assert took < 30, took


def test_backoff_doubles_and_is_capped():
    s = Supervisor(base_delay=1, max_delay=30)
    assert [s.delay(n) for n in (1, 2, 3, 4, 5, 6, 7)] == [1, 2, 4, 8, 16, 30, 30]
