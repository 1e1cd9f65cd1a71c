"""Faults on the real model, on the path `--model smollm2` serves by default (the GGUF's native blocks): a worker
restart must not leave the engine trusting dead KV memory, and a recovered request gives the tokens of an
undisturbed one (each position is recomputed by the arithmetic that first computed it: ModelRunner._entries)."""
from __future__ import annotations

import os
import signal

import grpc
import pytest

from llmserve.v1 import engine_admin_pb2, engine_admin_pb2_grpc, llm_pb2, llm_pb2_grpc
from services.stack import start_service
from tests.helpers import child_pids
from tests.integration.test_faults import check_worker_killed_again_while_it_restarts

pytestmark = pytest.mark.e2e
LONG = llm_pb2.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture
def smol_engine(tmp_path):
    proc = start_service("services.engine", ["--model", "smollm2", "--kv-cache-mb", "64"],
                         log_path=tmp_path / "engine.log")
    yield proc
    proc.stop()


SHARED_PREFIX = ("You are a careful assistant. Answer in one short sentence, in plain English, and never "
                 "use lists. The user is asking about the weather, the sea, the mountains and the city. "
                 "Keep it friendly, mention one fact you are sure of, and do not repeat the question. ")


def test_worker_restart_with_a_warm_prefix_cache_gives_the_same_tokens(smol_engine):
    """Prompts that fill several KV blocks and share a prefix: after the worker is SIGKILLed, the
    engine's prefix cache must not point at blocks whose memory died with the worker."""
    prompts = [SHARED_PREFIX + q for q in ("Hello, I am", "The weather is", "I want to", "Tell me about")]
    with grpc.insecure_channel(smol_engine.address) as channel:
        stub = llm_pb2_grpc.LLMServiceStub(channel)
        admin = engine_admin_pb2_grpc.EngineAdminStub(channel)
        reference = [list(stub.Generate(llm_pb2.GenerateRequest(prompt=p, sampling=LONG), timeout=300).token_ids)
                     for p in prompts]
        first = stub.Generate(llm_pb2.GenerateRequest(prompt=prompts[0], sampling=LONG), timeout=300)
        assert list(first.token_ids) == reference[0]
        assert first.usage.prompt_tokens > 3 * 16  # several full blocks of 16 tokens
        load = admin.GetLoad(engine_admin_pb2.GetLoadRequest(), timeout=5)
        assert load.num_cached_blocks >= 3

        # Mid-stream kill: the running sequences are recomputed on the new worker.
        streams = [stub.GenerateStream(llm_pb2.GenerateRequest(prompt=p, sampling=LONG), timeout=300)
                   for p in prompts]
        firsts = [next(s) for s in streams]
        (worker_pid,) = child_pids(smol_engine.proc.pid)
        os.kill(worker_pid, signal.SIGKILL)
        during = [[t for part in (f, *s) for t in part.token_ids] for f, s in zip(firsts, streams)]
        # After the restart: the same prompts again, now with the cache rebuilt on the new worker.
        after = [list(stub.Generate(llm_pb2.GenerateRequest(prompt=p, sampling=LONG), timeout=300).token_ids)
                 for p in prompts]
        assert admin.GetLoad(engine_admin_pb2.GetLoadRequest(), timeout=5).worker_restarts == 1
    assert during == reference
    assert after == reference


def test_worker_killed_again_while_it_restarts_gives_the_same_tokens(smol_engine, tmp_path):
    """SmolLM2's worker is SIGKILLed mid-stream, then its replacement as soon as it appears: after the
    second restart every stream in flight ends with the undisturbed greedy tokens, nothing leaked."""
    check_worker_killed_again_while_it_restarts(smol_engine, tmp_path / "engine.log", LONG)
