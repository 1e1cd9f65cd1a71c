"""gRPC face of the worker: GetInfo, the Execute step stream, Embed and Classify. Thin: protobuf in, protobuf out.

A worker serves one model of one task: a generation worker has a ``ModelRunner`` (Execute); an
embedding worker an ``EncoderRunner`` (Embed); a classification worker an encoder and a trained
head (Embed and Classify). An rpc the loaded task cannot serve fails FAILED_PRECONDITION.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Iterator

import grpc
import torch

from llmserve.worker.v1 import worker_pb2, worker_pb2_grpc
from services.common.errors import FailedPrecondition, InvalidArgument
from services.worker.classifier_head import ClassifierHead
from services.worker.compute import ComputeThread
from services.worker.encoder_runner import EncoderRunner
from services.worker.metrics import WorkerMetrics
from services.worker.model_runner import ModelRunner, SeqWork

MAX_TEXTS = 256        # texts per Embed / Classify call

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
    def __init__(self, runner: ModelRunner | None, model_name: str, dtype: str, compute: ComputeThread,
                 encoder: EncoderRunner | None = None, head: ClassifierHead | None = None,
                 metrics: WorkerMetrics | None = None):
        self.runner = runner
        self.metrics = metrics  # None: --no-metrics
        self.compute = compute  # every torch call runs there, not on the gRPC thread
        self.encoder = encoder
        self.head = head
        self.model_name = model_name
        self.dtype = dtype
        self.task = "text-generation" if runner is not None else ("text-classification" if head else "embedding")
        # One engine drives the KV pool at a time; a second concurrent stream would corrupt it.
        self._exclusive = threading.Lock()

    def GetInfo(self, request: worker_pb2.GetInfoRequest, context: grpc.ServicerContext) -> worker_pb2.WorkerInfo:
        r = self.runner
        if r is None:
            e = self.encoder
            assert e is not None
            return worker_pb2.WorkerInfo(
                model_name=self.model_name, context_length=e.context_length, dtype=self.dtype, device=str(e.device),
                weights_bytes=e.weights_bytes, load_seconds=e.load_seconds, task=self.task,
                embedding_dimension=e.dimension, labels=self.head.labels if self.head else [],
                heldout_accuracy=self.head.heldout_accuracy if self.head else 0.0)
        return worker_pb2.WorkerInfo(
            model_name=self.model_name, vocab_size=r.vocab_size, context_length=r.context_length,
            num_kv_blocks=r.pool.num_blocks, block_size=r.pool.block_size, dtype=self.dtype,
            device=str(r.device), weights_bytes=r.weights_bytes, kv_cache_bytes=r.pool.nbytes,
            load_seconds=r.load_seconds, task=self.task,
        )

    def Embed(self, request: worker_pb2.EmbedRequest, context: grpc.ServicerContext) -> worker_pb2.EmbedResponse:
        vectors = self.compute.run(self._embed, list(request.texts), "Embed")
        return worker_pb2.EmbedResponse(vectors=[worker_pb2.Vector(values=v) for v in vectors.tolist()],
                                        dimension=vectors.shape[1])

    def Classify(self, request: worker_pb2.ClassifyRequest,
                 context: grpc.ServicerContext) -> worker_pb2.ClassifyResponse:
        if self.head is None:
            raise FailedPrecondition(f"this worker serves {self.model_name} ({self.task}), not a classifier")
        head = self.head
        scores = self.compute.run(lambda texts: head.scores(self._embed(texts, "Classify")), list(request.texts))
        response = worker_pb2.ClassifyResponse()
        for row in scores.tolist():
            ranked = sorted(zip(self.head.labels, row), key=lambda pair: -pair[1])
            response.results.add(labels=[worker_pb2.LabelScore(label=label, score=score) for label, score in ranked])
        return response

    def _embed(self, texts: list[str], rpc: str) -> torch.Tensor:  # [N, dim]
        if self.encoder is None:
            raise FailedPrecondition(f"this worker serves {self.model_name} ({self.task}); {rpc} needs an "
                                     "embedding or classification model")
        if not texts or len(texts) > MAX_TEXTS:
            raise InvalidArgument(f"{rpc} takes 1 to {MAX_TEXTS} texts, got {len(texts)}")
        if any(not t.strip() for t in texts):
            raise InvalidArgument(f"{rpc}: texts must not be empty")
        started = time.perf_counter()
        vectors = self.encoder.embed(texts)
        if self.metrics is not None:  # metrics
            self.metrics.on_embed(time.perf_counter() - started, len(texts))
        return vectors

    def Execute(self, request_iterator: Iterator[worker_pb2.StepRequest],
                context: grpc.ServicerContext) -> Iterator[worker_pb2.StepResult]:
        if self.runner is None:
            raise FailedPrecondition(f"this worker serves {self.model_name} ({self.task}); Execute needs a "
                                     "text-generation model")
        runner = self.runner
        if not self._exclusive.acquire(blocking=False):
            raise FailedPrecondition("another engine is already connected to this worker")
        try:
            for step in request_iterator:
                runner.release(list(step.released_seq_ids))
                started = time.perf_counter()
                try:
                    seq_ids, sampled = self.compute.run(runner.execute, [work_from_pb(s) for s in step.seqs])
                except ValueError as exc:
                    raise InvalidArgument(f"step {step.step_id}: {exc}") from None
                result = worker_pb2.StepResult(step_id=step.step_id, forward_seconds=time.perf_counter() - started)
                if self.metrics is not None:  # metrics
                    self.metrics.on_step(result.forward_seconds, len(step.seqs), sum(len(s.token_ids) for s in step.seqs))
                for i, seq_id in enumerate(seq_ids):
                    result.tokens.add(seq_id=seq_id, token_id=sampled.token_ids[i], logprob=sampled.logprobs[i],
                                      top_token_ids=sampled.top_ids[i], top_logprobs=sampled.top_logprobs[i])
                yield result
        finally:
            self._exclusive.release()
