"""gRPC face of the worker: GetInfo, the Execute step stream, Embed and Classify. Thin: protobuf in, protobuf out.

A worker serves one model of one task: a generation worker has a ``ModelRunner`` (Execute); an
embedding worker an ``EncoderRunner`` (Embed); a classification worker an encoder and a trained
head (Embed and Classify). An rpc the loaded task cannot serve fails FAILED_PRECONDITION.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

import grpc
import torch

from llmserve.worker.v1 import worker_pb2, worker_pb2_grpc
from services.common.errors import FailedPrecondition, InvalidArgument
from services.common.sampling_pb import sampling_from_pb
from services.worker.classifier_head import ClassifierHead
from services.worker.compute import ComputeThread
from services.worker.encoder_runner import EncoderRunner
from services.worker.metrics import WorkerMetrics
from services.worker.model_runner import ModelRunner, SeqWork
from services.worker.onnx_encoder import OnnxEncoderRunner, OnnxHead
from services.worker.sampler import Sampled
from services.worker.step_queue import StepQueue

MAX_TEXTS = 256        # texts per Embed / Classify call

log = logging.getLogger("llmserve.worker.server")


def work_from_pb(s: worker_pb2.SequenceStep) -> SeqWork:
    return SeqWork(
        seq_id=s.seq_id, token_ids=list(s.token_ids), start_pos=s.start_pos, block_table=list(s.block_table),
        sample=s.sample, sampling=sampling_from_pb(s.sampling), num_generated=s.num_generated,
        prefix_token_ids=tuple(s.prefix_token_ids), input_is_last_sampled=s.input_is_last_sampled,
        grammar=s.grammar, grammar_replay=tuple(s.grammar_replay_token_ids),
        draft=tuple(s.token_ids[len(s.token_ids) - s.num_draft_tokens:]) if s.num_draft_tokens else (),
    )


def add_tokens(result: worker_pb2.StepResult, seq_ids: list[int], sampled: Sampled, failed: dict[int, str]) -> None:
    """``ModelRunner.execute``'s answer into ``result``."""
    for i, seq_id in enumerate(seq_ids):
        t = result.tokens.add(seq_id=seq_id, token_id=max(sampled.token_ids[i], 0), logprob=sampled.logprobs[i],
                              top_token_ids=sampled.top_ids[i], top_logprobs=sampled.top_logprobs[i],
                              error=sampled.errors[i])
        if sampled.accepted:   # a step with draft rows (verify.py)
            t.accepted_token_ids.extend(sampled.accepted[i])
            t.no_token = sampled.token_ids[i] < 0
    for seq_id, why in failed.items():
        result.tokens.add(seq_id=seq_id, error=why)


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, runner: ModelRunner | None, model_name: str, dtype: str, compute: ComputeThread,
                 encoder: EncoderRunner | OnnxEncoderRunner | None = None,
                 head: ClassifierHead | OnnxHead | None = None,
                 metrics: WorkerMetrics | None = None):
        self.runner = runner
        self.metrics = metrics  # None: --no-metrics
        self.compute = compute  # every torch call runs there, not on the event loop
        self.encoder = encoder
        self.head = head
        self.model_name = model_name
        self.dtype = dtype
        self.task = "text-generation" if runner is not None else ("text-classification" if head else "embedding")
        # One engine drives the KV pool at a time; a second concurrent stream would corrupt it.
        self._connected = False

    async def GetInfo(self, request: worker_pb2.GetInfoRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.WorkerInfo:
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
            load_seconds=r.load_seconds, task=self.task, weights=r.weights_summary,
        )

    async def Embed(self, request: worker_pb2.EmbedRequest,
                    context: grpc.aio.ServicerContext) -> worker_pb2.EmbedResponse:
        vectors = await self.compute.run_async(self._embed, list(request.texts), "Embed")
        return worker_pb2.EmbedResponse(vectors=[worker_pb2.Vector(values=v) for v in vectors.tolist()],
                                        dimension=vectors.shape[1])

    async def Classify(self, request: worker_pb2.ClassifyRequest,
                       context: grpc.aio.ServicerContext) -> worker_pb2.ClassifyResponse:
        if self.head is None:
            raise FailedPrecondition(f"this worker serves {self.model_name} ({self.task}), not a classifier")
        head = self.head
        scores = await self.compute.run_async(lambda texts: head.scores(self._embed(texts, "Classify")),
                                              list(request.texts))
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

    async def Execute(self, request_iterator: AsyncIterator[worker_pb2.StepRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[worker_pb2.StepResult]:
        if self.runner is None:
            raise FailedPrecondition(f"this worker serves {self.model_name} ({self.task}); Execute needs a "
                                     "text-generation model")
        runner = self.runner
        # One engine drives the KV pool at a time; a second concurrent stream would corrupt it.
        if self._connected:
            raise FailedPrecondition("another engine is already connected to this worker")
        self._connected = True
        steps = StepQueue(self.compute, lambda step: self._run_step(runner, step))
        reader = asyncio.ensure_future(steps.feed(request_iterator))
        try:
            while (result := await steps.next_result()) is not None:
                yield result
            await reader   # the engine closed its side: raise what ended the reading, if anything
        finally:
            reader.cancel()
            steps.close()
            self._connected = False

    def _run_step(self, runner: ModelRunner, step: worker_pb2.StepRequest) -> worker_pb2.StepResult:
        """One step, on the compute thread: the request's releases, the forward pass, its answer."""
        runner.release(list(step.released_seq_ids))
        for s in step.seqs:
            if s.request_id:
                log.info("request %s: sequence %d scheduled, %d tokens from position %d", s.request_id,
                         s.seq_id, len(s.token_ids), s.start_pos)
        result = worker_pb2.StepResult(step_id=step.step_id)
        started = time.perf_counter()
        try:
            seq_ids, sampled, failed = runner.execute([work_from_pb(s) for s in step.seqs])
        except Exception as exc:  # noqa: BLE001 - the step's sequences fail; the worker and its KV pool stay
            log.exception("step %d failed; failing its %d sequences", step.step_id, len(step.seqs))
            runner.release([s.seq_id for s in step.seqs])
            for s in step.seqs:
                result.tokens.add(seq_id=s.seq_id, error=f"the worker's forward pass failed: {exc}")
            return result
        if self.metrics is not None:  # metrics: the step's forward pass
            self.metrics.on_step(time.perf_counter() - started, len(step.seqs),
                                 sum(len(s.token_ids) or s.input_is_last_sampled for s in step.seqs))
        add_tokens(result, seq_ids, sampled, failed)
        return result
