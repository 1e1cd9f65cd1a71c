"""An engine serving SmolLM2 native (its GGUF blocks, as `make up` does), next to a copy of the file with a
truncated tensor: the native model generates and ListModels says how its
weights run; the corrupt copy fails FAILED_PRECONDITION naming the tensor, and the engine keeps serving."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from llmserve.v1 import llm_pb2, llm_pb2_grpc
from services.common.model_source import resolve_model
from services.engine.models.store import model_id_for
from services.stack import ServiceProcess, start_service
from services.worker import kernels

pytestmark = pytest.mark.skipif(kernels.quant_library() is None, reason="the block kernels need AVX2, FMA, F16C")
GREEDY = llm_pb2.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _entry(name: str, source: str, dtype: str) -> str:
    return (f"  - id: {model_id_for(name)}\n    name: {name}\n    task: text-generation\n    format: gguf\n"
            f"    source: {source}\n    dtype: {dtype}\n    context_length: 2048\n    memory_estimate_mb: 600\n")


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[llm_pb2_grpc.LLMServiceStub]:
    tmp = tmp_path_factory.mktemp("native")
    gguf = resolve_model("smollm2").path
    cut = tmp / "cut.gguf"
    shutil.copyfile(gguf, cut)
    with open(cut, "r+b") as f:
        f.truncate(60_000_000)
    store = tmp / "models.yaml"
    store.write_text("default_model: smol\nmodels:\n" + _entry("smol", str(gguf), "native")
                     + _entry("cut", str(cut), "native"))
    proc: ServiceProcess = start_service("services.engine", [
        "--model-store", str(store), "--warm-models", "smol", "--kv-cache-mb", "64", "--memory-budget-mb", "3000"],
        log_path=tmp / "engine.log")
    try:
        with grpc.insecure_channel(proc.address) as channel:
            yield llm_pb2_grpc.LLMServiceStub(channel)
    finally:
        proc.stop()


def test_native_generates_and_list_models_says_how_the_weights_run(llm):
    resp = llm.Generate(llm_pb2.GenerateRequest(model="smol", prompt="The capital of France is", sampling=GREEDY),
                        timeout=300)
    assert len(resp.token_ids) == 12
    info = {m.name: m for m in llm.ListModels(llm_pb2.ListModelsRequest(), timeout=10).models}
    assert info["smol"].loaded and info["smol"].dtype == "native"
    assert info["smol"].weights == "native blocks: 210 Q4_1, 1 Q8_0; dequantized to fp32: none"
    assert not info["cut"].loaded and info["cut"].weights == ""


def test_a_truncated_gguf_is_failed_precondition_naming_the_tensor(llm):
    with pytest.raises(grpc.RpcError) as err:
        llm.Generate(llm_pb2.GenerateRequest(model="cut", prompt="Hi", sampling=GREEDY), timeout=300)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
    assert "tensor blk." in err.value.details() and "truncated" in err.value.details(), err.value.details()
    resp = llm.Generate(llm_pb2.GenerateRequest(model="smol", prompt="Hi", sampling=GREEDY), timeout=300)
    assert len(resp.token_ids) == 12   # the other model keeps serving
