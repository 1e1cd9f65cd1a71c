"""A worker step where some sequences cannot run: they fail alone, the others sample, the stream lives on."""
from __future__ import annotations

import queue

import grpc
import pytest

from llmserve.worker.v1 import worker_pb2, worker_pb2_grpc
from services.stack import start_service


@pytest.fixture
def worker(tiny_model_dir, tmp_path):
    proc = start_service("services.worker", ["--model", str(tiny_model_dir), "--kv-cache-mb", "4",
                                             "--threads", "1"], log_path=tmp_path / "worker.log")
    yield proc
    proc.stop()


def step(seq_id: int, tokens: list[int], blocks: list[int], **sampling: float) -> worker_pb2.SequenceStep:
    return worker_pb2.SequenceStep(seq_id=seq_id, token_ids=tokens, start_pos=0, block_table=blocks, sample=True,
                                   sampling=worker_pb2.WorkerSampling(num_logprobs=-1, **sampling))


def test_a_poisoned_sequence_fails_alone_and_the_worker_keeps_serving(worker):
    requests: queue.Queue[worker_pb2.StepRequest | None] = queue.Queue()
    with grpc.insecure_channel(worker.address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        info = stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=30)
        results = stub.Execute(iter(requests.get, None), timeout=120)
        prompt = [1, 400, 500, 600]
        requests.put(worker_pb2.StepRequest(step_id=1, seqs=[step(1, prompt, [0])]))
        alone = next(results).tokens[0]

        requests.put(worker_pb2.StepRequest(step_id=2, released_seq_ids=[1], seqs=[
            step(2, prompt, [1], temperature=1e-45),                      # scores overflow to inf
            step(4, prompt, [info.num_kv_blocks + 5]),                    # block outside the pool
            step(5, prompt, [3]),                                         # a healthy greedy sequence
        ]))
        mixed = {t.seq_id: t for t in next(results).tokens}
        requests.put(worker_pb2.StepRequest(step_id=3, released_seq_ids=[2, 4, 5], seqs=[step(6, prompt, [4])]))
        after = next(results).tokens[0]
        requests.put(None)
    assert sorted(mixed) == [2, 4, 5]
    assert "not finite" in mixed[2].error
    assert "block id out of range" in mixed[4].error
    assert mixed[5].error == "" and mixed[5].token_id == alone.token_id
    assert after.error == "" and after.token_id == alone.token_id
