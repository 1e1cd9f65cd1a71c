"""A broken model cannot be turned against the good ones (issue 19): with a budget that fits one
model and a store entry that is a truncated copy of the GGUF, requests for it fail fast and the
loaded default model is never evicted. Real engine and worker processes."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from llmserve.v1 import engine_admin_pb2, engine_admin_pb2_grpc, llm_pb2, llm_pb2_grpc
from services.common.model_source import resolve_model
from services.engine.models.store import model_id_for
from services.stack import ServiceProcess, start_service
from tests.conftest import TINY_ENGINE_ARGS
from tests.helpers import child_pids

SHORT = llm_pb2.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def entry(name: str, source: Path, fmt: str) -> str:
    return (f"  - id: {model_id_for(name)}\n    name: {name}\n    task: text-generation\n    format: {fmt}\n"
            f"    source: {source}\n    dtype: float32\n    context_length: 512\n    memory_estimate_mb: 400\n")


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    tmp = tmp_path_factory.mktemp("load-guard")
    truncated = tmp / "SmolLM2-truncated.gguf"
    with open(resolve_model("smollm2").path, "rb") as f:
        truncated.write_bytes(f.read(50_000_000))  # a copy cut short: header whole, tensors past the end
    store = tmp / "models.yaml"
    store.write_text("default_model: tiny\nmodels:\n" + entry("tiny", tiny_model_dir, "safetensors")
                     + entry("broken", truncated, "gguf"))
    # 600 MiB holds one 400 MiB model: loading the broken one would have to evict the default.
    proc = start_service("services.engine", ["--model-store", str(store), "--memory-budget-mb", "600",
                                             "--warm-models", "default", *TINY_ENGINE_ARGS],
                         log_path=tmp / "engine.log")
    yield proc
    proc.stop()


def test_a_truncated_model_fails_fast_and_evicts_nothing(engine):
    (worker,) = child_pids(engine.proc.pid)
    with grpc.insecure_channel(engine.address) as channel:
        llm = llm_pb2_grpc.LLMServiceStub(channel)
        admin = engine_admin_pb2_grpc.EngineAdminStub(channel)
        seconds, errors = [], []
        for _ in range(3):
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                llm.Generate(llm_pb2.GenerateRequest(model="broken", prompt="Hello", sampling=SHORT), timeout=60)
            seconds.append(time.monotonic() - started)
            errors.append(err.value)
        with pytest.raises(grpc.RpcError) as retried:
            admin.LoadModel(engine_admin_pb2.LoadModelRequest(model="broken"), timeout=60)  # an explicit retry
        load = admin.GetLoad(engine_admin_pb2.GetLoadRequest(), timeout=10)
        reply = llm.Generate(llm_pb2.GenerateRequest(prompt="Hello", sampling=SHORT), timeout=60)
    assert [e.code() for e in errors] == [grpc.StatusCode.FAILED_PRECONDITION] * 3
    assert all("SmolLM2-truncated.gguf" in e.details() and "truncated" in e.details() for e in errors)
    assert "not retried for another" in errors[1].details()  # remembered, with the back-off left
    assert max(seconds[1:]) < 1.0, seconds
    assert retried.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "not retried" not in retried.value.details()  # LoadModel cleared the memory and checked again
    # The healthy default model was never evicted: the same worker serves it, warm.
    assert list(load.loaded_models) == ["tiny"] and child_pids(engine.proc.pid) == [worker]
    assert len(reply.token_ids) == 4
