"""gRPC face of the engine: llmserve.v1.LLMService and EngineAdmin. Protobuf stays here."""
from __future__ import annotations

import queue
import threading
import time
import uuid
from typing import Iterator

import grpc

from llmserve.v1 import engine_admin_pb2, engine_admin_pb2_grpc, llm_pb2, llm_pb2_grpc
from services.common.errors import (Cancelled, DeadlineExceeded, InvalidArgument, ResourceExhausted, ServiceError,
                                    Unavailable)
from services.common.server import time_remaining
from services.engine import validation
from services.engine.engine import LLMEngine
from services.engine.sequence import FinishReason, SeqEvent, Sequence, TokenLogprob

# The one table from the engine's finish reasons to the public enum.
FINISH_REASON_PB = {
    None: llm_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: llm_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: llm_pb2.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: llm_pb2.FINISH_REASON_CANCELLED,
    FinishReason.DEADLINE: llm_pb2.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: llm_pb2.FINISH_REASON_ERROR,
}


class LLMServicer(llm_pb2_grpc.LLMServiceServicer):
    def __init__(self, engine: LLMEngine, limits: validation.ModelLimits, max_batch_prompts: int,
                 model_format: str, location: str, memory_bytes: int):
        self.engine = engine
        self.limits = limits
        self.max_batch_prompts = max_batch_prompts
        self.model_format = model_format
        self.location = location
        self.memory_bytes = memory_bytes
        self.last_used_ms = 0

    # -- rpcs -------------------------------------------------------------------------------

    def Generate(self, request: llm_pb2.GenerateRequest, context: grpc.ServicerContext) -> llm_pb2.GenerateResponse:
        seq = self._submit(self._new_sequence(request, request.request_id), context)
        return self._collect(seq, context)

    def GenerateStream(self, request: llm_pb2.GenerateRequest,
                       context: grpc.ServicerContext) -> Iterator[llm_pb2.GenerateStreamResponse]:
        seq = self._submit(self._new_sequence(request, request.request_id), context)
        for event in self._events(seq, context):
            yield llm_pb2.GenerateStreamResponse(
                request_id=seq.request_id, sequence_id=seq.seq_id, model=self.limits.name, text=event.text,
                token_ids=event.token_ids, finish_reason=FINISH_REASON_PB[event.finish_reason],
                usage=self._usage(seq) if event.finish_reason else None,
                logprobs=[self._logprob_pb(lp) for lp in event.logprobs])

    def GenerateBatch(self, request: llm_pb2.GenerateBatchRequest,
                      context: grpc.ServicerContext) -> llm_pb2.GenerateBatchResponse:
        if not request.prompts:
            raise InvalidArgument("prompts is empty; give at least one prompt")
        if len(request.prompts) > self.max_batch_prompts:
            raise InvalidArgument(f"{len(request.prompts)} prompts exceed the maximum of {self.max_batch_prompts} "
                                  "per GenerateBatch; split the batch")
        base_id = request.request_id or uuid.uuid4().hex
        # Validate every prompt before running any, so a bad one fails the batch cleanly.
        seqs = []
        for i, prompt in enumerate(request.prompts):
            single = llm_pb2.GenerateRequest(model=request.model, prompt=prompt, sampling=request.sampling)
            try:
                seqs.append(self._new_sequence(single, f"{base_id}-{i}"))
            except ServiceError as exc:
                raise type(exc)(f"prompts[{i}]: {exc.message}") from None
        submitted: list[Sequence] = []
        try:
            for seq in seqs:
                submitted.append(self._submit(seq, context))
        except ServiceError:
            for seq in submitted:
                self.engine.abort(seq.seq_id, FinishReason.CANCELLED)
            raise
        return llm_pb2.GenerateBatchResponse(results=[self._collect(seq, context) for seq in submitted])

    def ListModels(self, request: llm_pb2.ListModelsRequest, context: grpc.ServicerContext) -> llm_pb2.ListModelsResponse:
        info = llm_pb2.ModelInfo(
            id=self.limits.id, name=self.limits.name, task="text-generation", format=self.model_format,
            loaded=True, loaded_on=[self.location], memory_bytes=self.memory_bytes,
            last_used_unix_ms=self.last_used_ms, context_length=self.limits.context_length)
        return llm_pb2.ListModelsResponse(models=[info])

    def Predict(self, request: llm_pb2.PredictRequest, context: grpc.ServicerContext) -> llm_pb2.PredictResponse:
        raise ServiceError("Predict is not implemented yet (it arrives with multi-model serving); "
                           "use Generate for text generation", grpc.StatusCode.UNIMPLEMENTED)

    # -- helpers ------------------------------------------------------------------------------

    def _new_sequence(self, request: llm_pb2.GenerateRequest, request_id: str) -> Sequence:
        validation.check_model(request.model, self.limits)
        ids = validation.prompt_tokens(request, self.engine.tokenizer)
        sampling = validation.sampling_options(request.sampling, len(ids), self.limits)
        resumed = validation.resume_tokens(request, sampling, self.engine.tokenizer)
        return Sequence(prompt_token_ids=ids, sampling=sampling, request_id=request_id or uuid.uuid4().hex,
                        output_token_ids=resumed, num_sent_chars=request.resume_text_chars)

    def _submit(self, seq: Sequence, context: grpc.ServicerContext) -> Sequence:
        remaining = time_remaining(context)
        if remaining is not None:
            seq.deadline = time.monotonic() + remaining
        self.engine.submit(seq)
        self.last_used_ms = int(time.time() * 1000)
        # Fires when the call ends for any reason; aborting a finished sequence is a no-op.
        context.add_callback(lambda: self.engine.abort(seq.seq_id, FinishReason.CANCELLED))
        return seq

    def _events(self, seq: Sequence, context: grpc.ServicerContext) -> Iterator[SeqEvent]:
        while True:
            try:
                event = seq.events.get(timeout=1.0)
            except queue.Empty:
                if not context.is_active():
                    self.engine.abort(seq.seq_id, FinishReason.CANCELLED)
                    raise Cancelled("the client cancelled the request") from None
                continue
            # Coalesce what queued up while the reader was busy: fewer messages when it falls behind.
            while event.finish_reason is None:
                try:
                    event = event.then(seq.events.get_nowait())
                except queue.Empty:
                    break
            if event.finish_reason is FinishReason.ERROR:
                raise Unavailable(event.error or "the request failed in the engine")
            if event.finish_reason is FinishReason.DEADLINE:
                raise DeadlineExceeded(f"deadline passed after {seq.num_output_tokens} generated tokens")
            if event.finish_reason is FinishReason.CANCELLED:
                raise Cancelled("the request was cancelled")
            yield event
            if event.finish_reason is not None:
                return

    def _collect(self, seq: Sequence, context: grpc.ServicerContext) -> llm_pb2.GenerateResponse:
        text, ids, lps, reason = [], [], [], None
        for event in self._events(seq, context):
            text.append(event.text)
            ids.extend(event.token_ids)
            lps.extend(event.logprobs)
            reason = event.finish_reason
        return llm_pb2.GenerateResponse(
            request_id=seq.request_id, sequence_id=seq.seq_id, model=self.limits.name, text="".join(text),
            token_ids=ids, finish_reason=FINISH_REASON_PB[reason], usage=self._usage(seq),
            logprobs=[self._logprob_pb(lp) for lp in lps])

    @staticmethod
    def _usage(seq: Sequence) -> llm_pb2.Usage:
        return llm_pb2.Usage(prompt_tokens=seq.num_prompt_tokens, completion_tokens=seq.num_output_tokens)

    def _logprob_pb(self, lp: TokenLogprob) -> llm_pb2.TokenLogprob:
        text = self.engine.tokenizer.token_text
        return llm_pb2.TokenLogprob(
            token_id=lp.token_id, token=text(lp.token_id), logprob=lp.logprob,
            top=[llm_pb2.TopLogprob(token_id=t, token=text(t), logprob=v) for t, v in lp.top])


class EngineAdminServicer(engine_admin_pb2_grpc.EngineAdminServicer):
    # A router that hears nothing for this long re-sends nothing new, but the heartbeat proves the
    # engine (and the stream) is alive even when its load does not change.
    HEARTBEAT_SECONDS = 1.0

    def __init__(self, engine: LLMEngine, model_name: str, max_num_seqs: int = 0):
        self.engine = engine
        self.model_name = model_name
        self.max_num_seqs = max_num_seqs
        self._stopping = threading.Event()

    def stop(self) -> None:
        """End every WatchLoad stream (graceful shutdown must not wait for them)."""
        self._stopping.set()

    def GetLoad(self, request: engine_admin_pb2.GetLoadRequest,
                context: grpc.ServicerContext) -> engine_admin_pb2.EngineLoad:
        load = self.engine.load()
        return engine_admin_pb2.EngineLoad(
            num_waiting=load.num_waiting, num_running=load.num_running,
            num_kv_blocks_total=load.num_kv_blocks_total, num_kv_blocks_used=load.num_kv_blocks_used,
            loaded_models=[self.model_name], num_finished=load.num_finished,
            num_preemptions=load.num_preemptions, worker_restarts=load.worker_restarts,
            prefix_cache_hit_rate=load.prefix_cache_hit_rate, num_cached_blocks=load.num_cached_blocks,
            max_num_seqs=self.max_num_seqs)

    def WatchLoad(self, request: engine_admin_pb2.WatchLoadRequest,
                  context: grpc.ServicerContext) -> Iterator[engine_admin_pb2.EngineLoad]:
        interval = max(0.02, (request.interval_ms or 100) / 1000)
        last: engine_admin_pb2.EngineLoad | None = None
        last_sent = 0.0
        while context.is_active() and not self._stopping.is_set():
            load = self.GetLoad(engine_admin_pb2.GetLoadRequest(), context)
            load.ClearField("num_finished")  # changes on every request; not a reason to send
            now = time.monotonic()
            if load != last or now - last_sent >= self.HEARTBEAT_SECONDS:
                yield load
                last, last_sent = load, now
            self._stopping.wait(interval)
