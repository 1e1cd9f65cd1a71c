"""Faults: a worker killed mid-stream (and its replacement killed while it starts), an engine killed behind the router."""
from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import grpc
import pytest

from llmserve.v1 import engine_admin_pb2, engine_admin_pb2_grpc, llm_pb2, llm_pb2_grpc
from services.common.process import ServiceProcess
from services.stack import start_service, start_stack
from tests.conftest import TINY_ENGINE_ARGS
from tests.helpers import child_pids, pid_alive, wait_until

LONG = llm_pb2.SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)


@pytest.fixture
def engine(tiny_model_dir, tmp_path):
    proc = start_service("services.engine", ["--model", str(tiny_model_dir), *TINY_ENGINE_ARGS],
                         log_path=tmp_path / "engine.log")
    yield proc
    proc.stop()


def streams_through(stub: llm_pb2_grpc.LLMServiceStub, fault: Callable[[], None],
                    sampling: llm_pb2.SamplingParams = LONG) -> tuple[list, list, list]:
    """Undisturbed greedy runs of three prompts, then the same prompts as streams, with ``fault()`` struck
    once every sequence is running and has produced output: (reference tokens, streamed tokens, finish reasons)."""
    prompts = ["Hello, I am", "The weather is", "I want to"]
    reference = [list(stub.Generate(llm_pb2.GenerateRequest(prompt=p, sampling=sampling), timeout=300).token_ids)
                 for p in prompts]
    streams = [stub.GenerateStream(llm_pb2.GenerateRequest(prompt=p, sampling=sampling), timeout=300) for p in prompts]
    firsts = [next(s) for s in streams]
    fault()
    parts = [[first, *stream] for first, stream in zip(firsts, streams)]
    return reference, [[t for p in ps for t in p.token_ids] for ps in parts], [ps[-1].finish_reason for ps in parts]


def test_worker_killed_mid_stream_costs_no_request(engine):
    with grpc.insecure_channel(engine.address) as channel:
        stub = llm_pb2_grpc.LLMServiceStub(channel)
        admin = engine_admin_pb2_grpc.EngineAdminStub(channel)
        (worker_pid,) = child_pids(engine.proc.pid)
        reference, results, reasons = streams_through(stub, lambda: os.kill(worker_pid, signal.SIGKILL))
        assert reasons == [llm_pb2.FINISH_REASON_LENGTH] * 3
        # recomputed on the new worker: the same greedy tokens as undisturbed runs
        assert results == reference
        load = admin.GetLoad(engine_admin_pb2.GetLoadRequest(), timeout=5)
        assert load.worker_restarts == 1
        assert not pid_alive(worker_pid)
        (new_worker,) = child_pids(engine.proc.pid)
        assert new_worker != worker_pid


def check_worker_killed_again_while_it_restarts(engine: ServiceProcess, log_path: Path,
                                                sampling: llm_pb2.SamplingParams = LONG) -> None:
    """The worker is SIGKILLed, then its replacement is SIGKILLed as soon as it appears (while it starts):
    the failed restart counts as one failure, the engine restarts again, and every stream in flight
    finishes with the tokens of an undisturbed run; nothing is left holding KV blocks."""
    with grpc.insecure_channel(engine.address) as channel:
        stub = llm_pb2_grpc.LLMServiceStub(channel)
        admin = engine_admin_pb2_grpc.EngineAdminStub(channel)
        (first_worker,) = child_pids(engine.proc.pid)
        killed = [first_worker]

        def kill_twice() -> None:
            os.kill(first_worker, signal.SIGKILL)
            (second,) = wait_until(lambda: [p for p in child_pids(engine.proc.pid) if p != first_worker], 60,
                                   "the engine to spawn a new worker", interval=0.002)
            os.kill(second, signal.SIGKILL)
            killed.append(second)

        reference, results, reasons = streams_through(stub, kill_twice, sampling)
        assert reasons == [llm_pb2.FINISH_REASON_LENGTH] * 3
        assert results == reference

        def idle() -> engine_admin_pb2.EngineLoad | None:
            load = admin.GetLoad(engine_admin_pb2.GetLoadRequest(), timeout=5)
            return load if not (load.num_waiting or load.num_running or load.num_kv_blocks_used) else None

        load = wait_until(idle, 30, "the engine to hold no sequences and no KV blocks")
        assert load.worker_restarts == 2
        (third_worker,) = child_pids(engine.proc.pid)
        assert third_worker not in killed and len(killed) == 2
        assert not any(pid_alive(pid) for pid in killed)
    assert "worker restart failed" in log_path.read_text()


def test_worker_killed_again_while_it_restarts_costs_no_request(engine, tmp_path):
    check_worker_killed_again_while_it_restarts(engine, tmp_path / "engine.log")


def test_engine_sigkill_does_not_leave_its_worker_behind(tiny_model_dir, tmp_path):
    proc = start_service("services.engine", ["--model", str(tiny_model_dir), *TINY_ENGINE_ARGS],
                         log_path=tmp_path / "engine.log")
    (worker_pid,) = child_pids(proc.proc.pid)
    proc.proc.kill()
    proc.proc.wait()
    wait_until(lambda: not pid_alive(worker_pid), 30, "the orphaned worker to exit")


def test_router_retries_on_another_engine_when_one_dies(tiny_model_dir, tmp_path):
    stack = start_stack(["--model", str(tiny_model_dir), *TINY_ENGINE_ARGS], num_engines=2,
                        router_args=["--health-interval", "0.2"], log_dir=tmp_path)
    try:
        with grpc.insecure_channel(stack.router.address) as channel:
            stub = llm_pb2_grpc.LLMServiceStub(channel)
            req = llm_pb2.GenerateRequest(prompt="Hello", sampling=llm_pb2.SamplingParams(
                temperature=0, max_tokens=4, ignore_eos=True))
            expected = stub.Generate(req, timeout=60).token_ids
            served = {stub.ListModels(llm_pb2.ListModelsRequest(), timeout=10).models[0].loaded_on[i]
                      for i in range(2)}
            assert len(served) == 2  # both engines are known and merged in ListModels
            stack.engines[0].proc.kill()
            stack.engines[0].proc.wait()

            def client() -> list[object]:
                """Each call's tokens, or its status code (collected here, checked in the test's thread)."""
                outcomes: list[object] = []
                for _ in range(5):
                    try:
                        outcomes.append(list(stub.Generate(req, timeout=60).token_ids))
                    except grpc.RpcError as exc:
                        outcomes.append(exc.code())
                return outcomes

            with ThreadPoolExecutor(3) as pool:
                futures = [pool.submit(client) for _ in range(3)]
                outcomes = [o for f in futures for o in f.result(timeout=300)]
            assert outcomes == [list(expected)] * 15
    finally:
        stack.stop()
