"""Health that tells the truth (issue 19): an engine whose default model cannot load says NOT_SERVING,
with the reason in its log and in GetLoad, and so does a router with no other engine; it recovers
on its own once the file is fixed. And the secure setup from another working directory: relative
--tls-* paths reach the workers as the files the engine was given. Real processes."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.v1 import engine_admin_pb2, engine_admin_pb2_grpc, llm_pb2, llm_pb2_grpc
from services.common.security import TlsFiles
from services.engine.models.store import model_id_for
from tests.certs import make_ca, make_leaf
from tests.conftest import TINY_ENGINE_ARGS
from tests.helpers import REPO_ROOT, wait_until

SHORT = llm_pb2.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def health(address: str, tls: TlsFiles | None = None) -> int:
    creds = tls.channel_credentials() if tls is not None else None
    with (grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status


def launch(args: list[str], cwd: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``python -m services.engine`` started in ``cwd`` (not the repository root); its address once it listens
    (it may never say SERVING: that is what these tests look at)."""
    port_file = log.parent / f"{log.stem}.port"
    proc = subprocess.Popen([sys.executable, "-m", "services.engine", "--port", "0", "--port-file", str(port_file),
                             "--metrics-port", "0", *args], cwd=cwd, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, start_new_session=True)
    wait_until(lambda: port_file.exists() or proc.poll() is not None, 300, "the engine to listen")
    assert proc.poll() is None, log.read_text()[-3000:]
    return proc, f"127.0.0.1:{port_file.read_text().strip()}"


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def broken_default(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    model = tmp_path / "tiny"   # not there yet: the default model cannot load
    store = tmp_path / "models.yaml"
    store.write_text(f"default_model: tiny\nmodels:\n  - id: {model_id_for('tiny')}\n    name: tiny\n"
                     f"    task: text-generation\n    format: safetensors\n    source: {model}\n    dtype: float32\n"
                     "    context_length: 512\n    memory_estimate_mb: 400\n")
    log = tmp_path / "engine.log"
    proc, address = launch(["--model-store", str(store), "--load-failure-backoff-seconds", "1", *TINY_ENGINE_ARGS],
                           tmp_path, log)
    yield proc, address, log
    stop(proc)


def test_an_engine_whose_default_model_cannot_load_is_not_serving_until_it_can(broken_default, tiny_model_dir):
    proc, address, log = broken_default
    with grpc.insecure_channel(address) as ch:
        load = engine_admin_pb2_grpc.EngineAdminStub(ch).GetLoad(engine_admin_pb2.GetLoadRequest(), timeout=10)
    assert health(address) == NOT_SERVING
    assert "tiny" in load.not_serving_reason and "not found" in load.not_serving_reason
    assert "engine NOT_SERVING: the default model tiny cannot be served" in log.read_text()
    # A router with only this engine is not serving either.
    router_proc = subprocess.Popen(
        [sys.executable, "-m", "services.router", "--port", "0", "--port-file", str(log.parent / "router.port"),
         "--engines", address, "--health-interval", "0.2", "--http-port", "-1", "--no-metrics"],
        cwd=REPO_ROOT, stdout=open(log.parent / "router.log", "ab"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until((log.parent / "router.port").exists, 60, "the router to listen")
        router = f"127.0.0.1:{(log.parent / 'router.port').read_text().strip()}"
        assert health(router) == NOT_SERVING
        # Fixed on disk: the engine retries by itself and serves, and so does the router.
        shutil.copytree(tiny_model_dir, log.parent / "tiny")
        wait_until(lambda: health(address) == SERVING, 120, "the engine to load its default model and serve")
        wait_until(lambda: health(router) == SERVING, 30, "the router to see a serving engine")
        with grpc.insecure_channel(router) as ch:
            reply = llm_pb2_grpc.LLMServiceStub(ch).Generate(llm_pb2.GenerateRequest(prompt="Hi", sampling=SHORT),
                                                            timeout=60)
        with grpc.insecure_channel(address) as ch:
            load = engine_admin_pb2_grpc.EngineAdminStub(ch).GetLoad(engine_admin_pb2.GetLoadRequest(), timeout=10)
        assert len(reply.token_ids) == 4 and load.not_serving_reason == ""
    finally:
        stop(router_proc)


def test_relative_tls_paths_work_from_another_working_directory(tmp_path: Path, tiny_model_dir: Path):
    """The secure setup started outside the repository root: the engine's workers (started in the
    repository root) get the TLS files as absolute paths (they exited 2 with the relative ones)."""
    secrets = tmp_path / "secrets"
    node = make_leaf(secrets, "node", make_ca(secrets))
    rel = [os.path.relpath(p, tmp_path) for p in (node.cert, node.key, node.ca)]
    assert not any(os.path.isabs(p) for p in rel) and not (REPO_ROOT / rel[0]).exists()
    proc, address = launch(["--model", str(tiny_model_dir), "--tls-cert", rel[0], "--tls-key", rel[1],
                            "--tls-ca", rel[2], *TINY_ENGINE_ARGS], tmp_path, tmp_path / "engine.log")
    try:
        wait_until(lambda: proc.poll() is not None or health(address, node) == SERVING, 120, "the engine to serve")
        assert proc.poll() is None, (tmp_path / "engine.log").read_text()[-3000:]
        with grpc.secure_channel(address, node.channel_credentials()) as ch:
            reply = llm_pb2_grpc.LLMServiceStub(ch).Generate(llm_pb2.GenerateRequest(prompt="Hi", sampling=SHORT),
                                                            timeout=60)
        assert len(reply.token_ids) == 4
    finally:
        stop(proc)
