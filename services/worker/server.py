"""gRPC face of the worker: GetInfo and the Execute step stream. Thin: protobuf in, protobuf out."""
from __future__ import annotations

import logging
import threading
import time
from typing import Iterator

import grpc

from llmserve.worker.v1 import worker_pb2, worker_pb2_grpc
from services.common.errors import FailedPrecondition, InvalidArgument
from services.worker.model_runner import ModelRunner, SeqWork

log = logging.getLogger("llmserve.worker.server")


def work_from_pb(s: worker_pb2.SequenceStep) -> SeqWork:
    p = s.sampling
    return SeqWork(
        seq_id=s.seq_id, token_ids=list(s.token_ids), start_pos=s.start_pos, block_table=list(s.block_table),
        sample=s.sample, temperature=p.temperature, top_p=p.top_p or 1.0, top_k=p.top_k,
        seed=p.seed if p.has_seed else None, repetition_penalty=p.repetition_penalty or 1.0,
        num_logprobs=p.num_logprobs, num_generated=s.num_generated,
        prefix_token_ids=tuple(s.prefix_token_ids),
    )


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, runner: ModelRunner, model_name: str, dtype: str):
        self.runner = runner
        self.model_name = model_name
        self.dtype = dtype
        # One engine drives the KV pool at a time; a second concurrent stream would corrupt it.
        self._exclusive = threading.Lock()

    def GetInfo(self, request: worker_pb2.GetInfoRequest, context: grpc.ServicerContext) -> worker_pb2.WorkerInfo:
        r = self.runner
        return worker_pb2.WorkerInfo(
            model_name=self.model_name, vocab_size=r.vocab_size, context_length=r.context_length,
            num_kv_blocks=r.pool.num_blocks, block_size=r.pool.block_size, dtype=self.dtype,
            device=str(r.device), weights_bytes=r.weights_bytes, kv_cache_bytes=r.pool.nbytes,
            load_seconds=r.load_seconds,
        )

    def Execute(self, request_iterator: Iterator[worker_pb2.StepRequest],
                context: grpc.ServicerContext) -> Iterator[worker_pb2.StepResult]:
        if not self._exclusive.acquire(blocking=False):
            raise FailedPrecondition("another engine is already connected to this worker")
        try:
            for step in request_iterator:
                self.runner.release(list(step.released_seq_ids))
                started = time.perf_counter()
                try:
                    seq_ids, sampled = self.runner.execute([work_from_pb(s) for s in step.seqs])
                except ValueError as exc:
                    raise InvalidArgument(f"step {step.step_id}: {exc}") from None
                result = worker_pb2.StepResult(step_id=step.step_id, forward_seconds=time.perf_counter() - started)
                for i, seq_id in enumerate(seq_ids):
                    result.tokens.add(seq_id=seq_id, token_id=sampled.token_ids[i], logprob=sampled.logprobs[i],
                                      top_token_ids=sampled.top_ids[i], top_logprobs=sampled.top_logprobs[i])
                yield result
        finally:
            self._exclusive.release()
