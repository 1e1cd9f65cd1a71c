"""A worker start that fails in any way is a ``WorkerFailure`` (what the engine counts and retries); a
step stream whose worker could not be restarted fails the next step at once, and an encoder call
whose worker could not be restarted is UNAVAILABLE."""
from __future__ import annotations

import subprocess
import sys
import time
from typing import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2

from llmserve.worker.v1 import worker_pb2
from services import REPO_ROOT
from services.common.config import ConfigError
from services.common.errors import Unavailable
from services.engine.core.executor import WorkerFailure
from services.engine.models.encoder_client import EncoderClient
from services.engine.core.scheduler import SchedulerOutput
from services.engine.models.step_client import StepClient
from services.engine.models.worker_process import WorkerProcess, WorkerSpec
from services.worker.config import WorkerConfig
from tests.helpers import health_only_server


@pytest.fixture
def not_a_worker() -> Iterator[str]:
    """A gRPC server that is SERVING but has no Worker service: its GetInfo handshake fails."""
    with health_only_server(health_pb2.HealthCheckResponse.SERVING) as address:
        yield address


def test_a_failed_getinfo_handshake_is_a_worker_failure(not_a_worker):
    worker = WorkerProcess(WorkerSpec(model="m", worker_address=not_a_worker, start_timeout=10))
    with pytest.raises(WorkerFailure, match="GetInfo handshake"):
        worker.start()
    worker.close()


class _FlakyWorker:
    """A WorkerProcess whose first start holds and whose restarts fail (the new process dies while starting)."""

    restarts = 0
    metadata = ()

    def __init__(self) -> None:
        self.stub = self

    def start(self) -> worker_pb2.WorkerInfo:
        return worker_pb2.WorkerInfo(model_name="m", num_kv_blocks=4, block_size=16)

    def Execute(self, requests: Iterator[worker_pb2.StepRequest], metadata: object) -> Iterator[worker_pb2.StepResult]:
        return iter(())   # never reads its requests: as gRPC does once the stream has ended

    def restart(self) -> None:
        self.restarts += 1
        raise WorkerFailure("worker exited with code -9 while starting")


def test_a_step_after_a_failed_restart_fails_at_once():
    steps = StepClient(_FlakyWorker())  # type: ignore[arg-type]
    steps.start()
    with pytest.raises(WorkerFailure, match="while starting"):
        steps.restart()
    began = time.monotonic()
    with pytest.raises(WorkerFailure, match="not started"):
        steps.send(SchedulerOutput())
    with pytest.raises(WorkerFailure, match="not started"):
        steps.receive(SchedulerOutput())
    assert time.monotonic() - began < 0.5   # not the 1 s wait for a hand-off to a stream that has ended


class _Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE


class _DeadEncoderWorker:
    """An embedding worker whose process died, and whose restart fails."""

    metadata = ()

    def __init__(self) -> None:
        self.stub = self

    def Embed(self, request: object, timeout: float | None, metadata: object) -> None:
        raise _Unavailable()

    def died(self, timeout: float) -> bool:
        return True

    def restart(self) -> None:
        raise WorkerFailure("worker exited with code -9 while starting")


def test_an_encoder_call_whose_worker_cannot_be_restarted_is_unavailable():
    client = EncoderClient(_DeadEncoderWorker())  # type: ignore[arg-type]
    with pytest.raises(Unavailable, match="could not be restarted: worker exited with code -9"):
        client.embed(["hello"], timeout=5)


def test_a_worker_whose_engine_died_before_it_started_exits(tmp_path):
    """An engine killed while its worker is still importing torch leaves the worker to init before the worker
    can note its parent: the engine names itself (--parent-pid), and a worker that finds that process gone
    exits at once instead of serving forever."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    log = tmp_path / "worker.log"
    with open(log, "w") as out:
        worker = subprocess.Popen([sys.executable, "-m", "services.worker", "--port", "0", "--model", "no-such-model",
                                   "--exit-with-parent", "--parent-pid", str(gone.pid)],
                                  cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        assert worker.wait(timeout=60) == 0
    finally:
        worker.kill()
    assert f"parent process {gone.pid} is gone" in log.read_text()


def test_parent_pid_without_exit_with_parent_is_refused():
    with pytest.raises(ConfigError, match="--parent-pid needs --exit-with-parent"):
        WorkerConfig(parent_pid=12).validate()
