from __future__ import annotations

from typing import Iterator

import grpc
import pytest

from llmserve.v1 import llm_pb2_grpc
from services.stack import Stack, start_stack


@pytest.fixture(scope="session")
def smol_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The default model store (`make up`): SmolLM2-135M-Instruct (the default model) loaded at start, the
    embedding model and the spam detector on first use, behind router → engine → workers. In float32, chosen
    here (the store serves native): the tests compare greedy outputs with transformers' float32 model.
    In float32 the store reserves twice SmolLM2's native estimate (3,600 MiB); a 6 GiB budget keeps it loaded
    beside the encoder models (600 MiB each) the tests use between its calls, where the default 4 GiB evicted
    it for each of them and reloaded it on the next generation (a worker start each way)."""
    stack = start_stack(["--kv-cache-mb", "256", "--dtype", "float32", "--memory-budget-mb", "6144"],
                        second_http_port=0,  # the seed's :8001 too, as `make up`
                        log_dir=tmp_path_factory.mktemp("smol-logs"))
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def smol(smol_stack: Stack) -> Iterator[llm_pb2_grpc.LLMServiceStub]:
    assert smol_stack.router is not None
    with grpc.insecure_channel(smol_stack.router.address) as channel:
        yield llm_pb2_grpc.LLMServiceStub(channel)
