"""Authentication on every hop, with real processes: API keys at the router, the cluster secret and
admin keys at the engine, the per-worker secret at the worker; health and reflection open."""
from __future__ import annotations

import asyncio

import re
from pathlib import Path
from typing import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llmserve.v1 import engine_admin_pb2, engine_admin_pb2_grpc, llm_pb2, llm_pb2_grpc
from llmserve.worker.v1 import worker_pb2, worker_pb2_grpc
from services.common.security import AUTHORIZATION, CLUSTER_SECRET, WORKER_SECRET, hash_key
from services.stack import Stack, start_stack
from tests.conftest import TINY_ENGINE_ARGS
from services.router.load_watch import LoadWatcher
from tests.helpers import grpcurl, wait_until

API_KEY = "api-key-for-tests-0123456789"
ADMIN_KEY = "admin-key-for-tests-0123456789"
CLUSTER = "cluster-secret-for-tests-0123456789"
SHORT = llm_pb2.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


class Secured:
    def __init__(self, stack: Stack, logs: Path):
        self.stack = stack
        self.logs = logs
        assert stack.router is not None
        self.router = stack.router.address
        self.engine = stack.engines[0].address

    def worker(self) -> tuple[int, str]:
        found = re.findall(r"started worker pid (\d+) at (\S+)", (self.logs / "engine0.log").read_text())
        assert found, "the engine log names its worker"
        return int(found[-1][0]), found[-1][1]


@pytest.fixture(scope="module")
def secured(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    d = tmp_path_factory.mktemp("secured")
    (d / "api.keys").write_text(f"{hash_key(API_KEY)} tests\n")
    (d / "admin.keys").write_text(f"{hash_key(ADMIN_KEY)}\n")
    (d / "cluster.secret").write_text(CLUSTER + "\n")
    stack = start_stack(["--model", str(tiny_model_dir), *TINY_ENGINE_ARGS, "--cluster-secret-file",
                         str(d / "cluster.secret"), "--admin-keys-file", str(d / "admin.keys"), "--no-reflection"],
                        router_args=["--api-keys-file", str(d / "api.keys"), "--cluster-secret-file",
                                     str(d / "cluster.secret"), "--health-interval", "0.2"], log_dir=d)
    yield Secured(stack, d)
    stack.stop()


def _code(call: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()  # type: ignore[operator]
    return info.value


def test_router_needs_an_api_key(secured: Secured) -> None:
    with grpc.insecure_channel(secured.router) as ch:
        stub = llm_pb2_grpc.LLMServiceStub(ch)
        request = llm_pb2.GenerateRequest(prompt="Hello", sampling=SHORT)
        err = _code(lambda: stub.Generate(request, timeout=30))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "authorization: Bearer <key>" in err.details()
        err = _code(lambda: stub.Generate(request, timeout=30, metadata=[(AUTHORIZATION, "Bearer " + API_KEY[:-1])]))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "not valid" in err.details()
        stream = stub.GenerateStream(request, timeout=30)
        assert _code(lambda: list(stream)).code() == grpc.StatusCode.UNAUTHENTICATED
        # The router's own credential at the engines is not a client key here.
        err = _code(lambda: stub.Generate(request, timeout=30, metadata=[(CLUSTER_SECRET, CLUSTER)]))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        # With the key: the whole path works (the router presents the cluster secret to the engine).
        ok = stub.Generate(request, timeout=60, metadata=[(AUTHORIZATION, f"Bearer {API_KEY}")])
        assert len(ok.token_ids) == 4
        chunks = list(stub.GenerateStream(request, timeout=60, metadata=[(AUTHORIZATION, f"Bearer {API_KEY}")]))
        assert sum(len(c.token_ids) for c in chunks) == 4
        models = stub.ListModels(llm_pb2.ListModelsRequest(), timeout=30,
                                 metadata=[(AUTHORIZATION, f"Bearer {API_KEY}")])
        assert models.models


def test_health_and_reflection_stay_open_and_no_reflection_closes_it(secured: Secured) -> None:
    for address in (secured.router, secured.engine, secured.worker()[1]):
        with grpc.insecure_channel(address) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING, address
    listed = grpcurl("-plaintext", secured.router, "list")
    assert listed.returncode == 0 and "llmserve.v1.LLMService" in listed.stdout, listed.stderr
    closed = grpcurl("-plaintext", secured.engine, "list")          # the engine runs --no-reflection
    assert closed.returncode != 0 and "llmserve.v1.LLMService" not in closed.stdout
    assert "does not support the reflection API" in closed.stderr, closed.stderr


def test_engine_accepts_only_routers_and_admins(secured: Secured) -> None:
    with grpc.insecure_channel(secured.engine) as ch:
        llm = llm_pb2_grpc.LLMServiceStub(ch)
        admin = engine_admin_pb2_grpc.EngineAdminStub(ch)
        request = llm_pb2.GenerateRequest(prompt="Hello", sampling=SHORT)
        err = _code(lambda: llm.Generate(request, timeout=30))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED and CLUSTER_SECRET in err.details()
        assert _code(lambda: llm.Generate(request, timeout=30, metadata=[(CLUSTER_SECRET, "guess" * 5)])).code() \
            == grpc.StatusCode.UNAUTHENTICATED
        assert _code(lambda: admin.GetLoad(engine_admin_pb2.GetLoadRequest(), timeout=10)).code() \
            == grpc.StatusCode.UNAUTHENTICATED
        # An API key of the router is nothing here either.
        assert _code(lambda: llm.Generate(request, timeout=30, metadata=[(AUTHORIZATION, f"Bearer {API_KEY}")])
                     ).code() == grpc.StatusCode.UNAUTHENTICATED
        router = [(CLUSTER_SECRET, CLUSTER)]
        assert len(llm.Generate(request, timeout=60, metadata=router).token_ids) == 4
        load = admin.GetLoad(engine_admin_pb2.GetLoadRequest(), timeout=10, metadata=router)
        assert load.num_kv_blocks_total > 0
        unload = engine_admin_pb2.UnloadModelRequest(model="")
        err = _code(lambda: admin.UnloadModel(unload, timeout=30, metadata=router))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "admin key" in err.details()
        err = _code(lambda: admin.UnloadModel(unload, timeout=30))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "admin key" in err.details()
        err = _code(lambda: admin.UnloadModel(unload, timeout=30, metadata=[(AUTHORIZATION, f"Bearer {API_KEY}")]))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        # The admin key works, and the model is still loaded afterwards (LoadModel of a loaded model).
        admin_md = [(AUTHORIZATION, f"Bearer {ADMIN_KEY}")]
        loaded = admin.LoadModel(engine_admin_pb2.LoadModelRequest(model=""), timeout=60, metadata=admin_md)
        assert loaded.was_loaded and loaded.model.loaded


def test_worker_accepts_only_its_engine(secured: Secured) -> None:
    pid, address = secured.worker()
    # The secret travels in the environment, never on the command line (world-readable in /proc).
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    assert "secret" not in cmdline.lower()
    with grpc.insecure_channel(address) as ch:
        worker = worker_pb2_grpc.WorkerStub(ch)
        err = _code(lambda: worker.GetInfo(worker_pb2.GetInfoRequest(), timeout=10))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        for guess in (CLUSTER, ADMIN_KEY):
            assert _code(lambda: worker.GetInfo(worker_pb2.GetInfoRequest(), timeout=10,
                                                metadata=[(WORKER_SECRET, guess)])).code() \
                == grpc.StatusCode.UNAUTHENTICATED
        steps = worker.Execute(iter([worker_pb2.StepRequest(step_id=1)]), timeout=10)
        assert _code(lambda: list(steps)).code() == grpc.StatusCode.UNAUTHENTICATED
    # ...while the engine, which holds the secret, still drives it.
    with grpc.insecure_channel(secured.router) as ch:
        ok = llm_pb2_grpc.LLMServiceStub(ch).Generate(llm_pb2.GenerateRequest(prompt="Hi there", sampling=SHORT),
                                                      timeout=60, metadata=[(AUTHORIZATION, f"Bearer {API_KEY}")])
        assert len(ok.token_ids) == 4


def test_the_routers_load_watch_presents_the_cluster_secret(secured: Secured) -> None:
    async def watch(metadata: tuple[tuple[str, str], ...]) -> list[engine_admin_pb2.EngineLoad | None]:
        """Run the router's load watcher on an event loop until it got a report or was refused."""
        reports: list[engine_admin_pb2.EngineLoad | None] = []
        async with grpc.aio.insecure_channel(secured.engine) as ch:
            watcher = LoadWatcher(ch, secured.engine, 100, reports.append, metadata)
            watcher.start()
            try:
                deadline = asyncio.get_running_loop().time() + 30
                while not reports and asyncio.get_running_loop().time() < deadline:
                    await asyncio.sleep(0.05)
            finally:
                watcher.stop()
        return reports

    with_secret = asyncio.run(watch(((CLUSTER_SECRET, CLUSTER),)))
    without = asyncio.run(watch(()))
    assert any(r is not None for r in with_secret), "no load report with the cluster secret"
    assert without and all(r is None for r in without), "the engine streamed load to a caller without the secret"
