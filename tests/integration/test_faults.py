"""Faults: a worker killed mid-stream, an engine killed behind the router."""
from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from llmserve.v1 import engine_admin_pb2, engine_admin_pb2_grpc, llm_pb2, llm_pb2_grpc
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


def test_worker_killed_mid_stream_costs_no_request(engine):
    with grpc.insecure_channel(engine.address) as channel:
        stub = llm_pb2_grpc.LLMServiceStub(channel)
        admin = engine_admin_pb2_grpc.EngineAdminStub(channel)
        prompts = ["Hello, I am", "The weather is", "I want to"]
        reference = [stub.Generate(llm_pb2.GenerateRequest(prompt=p, sampling=LONG), timeout=60) for p in prompts]
        (worker_pid,) = child_pids(engine.proc.pid)

        streams = [stub.GenerateStream(llm_pb2.GenerateRequest(prompt=p, sampling=LONG), timeout=120) for p in prompts]
        firsts = [next(s) for s in streams]  # every sequence is running and has produced output
        os.kill(worker_pid, signal.SIGKILL)
        results = []
        for first, stream in zip(firsts, streams):
            parts = [first, *stream]
            results.append([t for p in parts for t in p.token_ids])
            assert parts[-1].finish_reason == llm_pb2.FINISH_REASON_LENGTH
        # recomputed on the new worker: the same greedy tokens as undisturbed runs
        assert results == [list(r.token_ids) for r in reference]
        load = admin.GetLoad(engine_admin_pb2.GetLoadRequest(), timeout=5)
        assert load.worker_restarts == 1
        assert not pid_alive(worker_pid)
        (new_worker,) = child_pids(engine.proc.pid)
        assert new_worker != worker_pid


def test_worker_killed_again_while_it_restarts_costs_no_request(engine, tmp_path):
    """The worker is SIGKILLed, then its replacement is SIGKILLed as soon as it appears (while it starts):
    the failed restart counts as one failure, the engine restarts again, and every stream in flight
    finishes with the tokens of an undisturbed run; nothing is left holding KV blocks."""
    with grpc.insecure_channel(engine.address) as channel:
        stub = llm_pb2_grpc.LLMServiceStub(channel)
        admin = engine_admin_pb2_grpc.EngineAdminStub(channel)
        prompts = ["Hello, I am", "The weather is", "I want to"]
        reference = [stub.Generate(llm_pb2.GenerateRequest(prompt=p, sampling=LONG), timeout=60) for p in prompts]
        (first_worker,) = child_pids(engine.proc.pid)

        streams = [stub.GenerateStream(llm_pb2.GenerateRequest(prompt=p, sampling=LONG), timeout=180) for p in prompts]
        firsts = [next(s) for s in streams]  # every sequence is running and has produced output
        os.kill(first_worker, signal.SIGKILL)
        (second_worker,) = wait_until(lambda: [p for p in child_pids(engine.proc.pid) if p != first_worker], 60,
                                      "the engine to spawn a new worker", interval=0.002)
        os.kill(second_worker, signal.SIGKILL)
        results = []
        for first, stream in zip(firsts, streams):
            parts = [first, *stream]
            results.append([t for p in parts for t in p.token_ids])
            assert parts[-1].finish_reason == llm_pb2.FINISH_REASON_LENGTH
        assert results == [list(r.token_ids) for r in reference]

        def idle() -> engine_admin_pb2.EngineLoad | None:
            load = admin.GetLoad(engine_admin_pb2.GetLoadRequest(), timeout=5)
            return load if not (load.num_waiting or load.num_running or load.num_kv_blocks_used) else None

        load = wait_until(idle, 30, "the engine to hold no sequences and no KV blocks")
        assert load.worker_restarts == 2
        (third_worker,) = child_pids(engine.proc.pid)
        assert third_worker not in (first_worker, second_worker)
        assert not pid_alive(first_worker) and not pid_alive(second_worker)
    assert "worker restart failed" in (tmp_path / "engine.log").read_text()


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
