"""gRPC face of the engine: llmserve.v1.LLMService and EngineAdmin. Protobuf stays here."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import asynccontextmanager, contextmanager
from dataclasses import replace
from typing import AsyncIterator, Callable, Iterator

import grpc

from llmserve.v1 import engine_admin_pb2, engine_admin_pb2_grpc, llm_pb2, llm_pb2_grpc
from services.common.call_metadata import (ENGINE_KEY, QUEUE_SECONDS_KEY, REQUEST_ID_KEY, SPEC_ACCEPTED_TOKENS_KEY,
                                           SPEC_DRAFT_TOKENS_KEY, SPEC_DRAFTS_KEY, TTFT_SECONDS_KEY,
                                           request_id_of)
from services.common.errors import (Cancelled, DeadlineExceeded, Internal, InvalidArgument, ServiceError,
                                    Unavailable)
from services.common.server import time_remaining
from services.engine.api import validation
from services.engine.api.blocking_calls import BlockingCalls
from services.engine.api.event_channel import EventChannel, EventMailbox
from services.engine.models.manager import Lease, ModelManager
from services.engine.models.runtime import EncoderRuntime, GenerationRuntime
from services.engine.core.sequence import FinishReason, SeqEvent, Sequence, TokenLogprob

# Trailing metadata on a call that caused (or waited for) a model's cold start.
LOAD_SECONDS_KEY = "x-llmserve-load-seconds"

log = logging.getLogger("llmserve.engine")

# The one table from the engine's finish reasons to the public enum.
FINISH_REASON_PB = {
    None: llm_pb2.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: llm_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: llm_pb2.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: llm_pb2.FINISH_REASON_CANCELLED,
    FinishReason.DEADLINE: llm_pb2.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: llm_pb2.FINISH_REASON_ERROR,
    FinishReason.UNAVAILABLE: llm_pb2.FINISH_REASON_ERROR,
}


class LLMServicer(llm_pb2_grpc.LLMServiceServicer):
    """Every rpc names a model (id or name; empty = the default); the model manager loads it on a miss."""

    def __init__(self, models: ModelManager, blocking: BlockingCalls, max_batch_prompts: int, location: str):
        self.models = models
        self.blocking = blocking
        self.max_batch_prompts = max_batch_prompts
        self.location = location
        self._mailbox: EventMailbox | None = None   # made on the server's event loop, at the first call

    # -- rpcs -------------------------------------------------------------------------------

    async def Generate(self, request: llm_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> llm_pb2.GenerateResponse:
        async with self._generation(request.model, "Generate", context) as rt:
            seq = self._new_sequence(rt, request, request_id_of(request, context))
            await self._constrain(rt, request.sampling, [seq])
            first_token_at: list[float] = []
            with self._submitted(rt, [seq], context, request.resume_text_chars) as channels:
                response = await self._collect(rt, seq, channels[0], first_token_at)
            self._finished(seq, first_token_at, context)
            return response

    async def GenerateStream(self, request: llm_pb2.GenerateRequest,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[llm_pb2.GenerateStreamResponse]:
        # The lease is held until the stream ends: a model with a stream in flight is never evicted.
        async with self._generation(request.model, "GenerateStream", context) as rt:
            seq = self._new_sequence(rt, request, request_id_of(request, context))
            await self._constrain(rt, request.sampling, [seq])
            first_token_at: list[float] = []
            with self._submitted(rt, [seq], context, request.resume_text_chars) as channels:
                async for event in self._events(seq, channels[0]):
                    if not first_token_at:
                        first_token_at.append(time.monotonic())
                        await context.send_initial_metadata(self._call_metadata(seq, first_token_at))
                    yield llm_pb2.GenerateStreamResponse(
                        request_id=seq.request_id, sequence_id=seq.seq_id, model=rt.limits.name, text=event.text,
                        token_ids=event.token_ids, finish_reason=FINISH_REASON_PB[event.finish_reason],
                        usage=self._usage(seq) if event.finish_reason else None,
                        logprobs=[self._logprob_pb(rt, lp) for lp in event.logprobs])
            self._finished(seq, first_token_at, context)

    async def GenerateBatch(self, request: llm_pb2.GenerateBatchRequest,
                            context: grpc.aio.ServicerContext) -> llm_pb2.GenerateBatchResponse:
        if not request.prompts:
            raise InvalidArgument("prompts is empty; give at least one prompt")
        if len(request.prompts) > self.max_batch_prompts:
            raise InvalidArgument(f"{len(request.prompts)} prompts exceed the maximum of {self.max_batch_prompts} "
                                  "per GenerateBatch; split the batch")
        base_id = request_id_of(request, context)
        async with self._generation(request.model, "GenerateBatch", context) as rt:
            # Validate every prompt before running any, so a bad one fails the batch cleanly.
            seqs = []
            for i, prompt in enumerate(request.prompts):
                single = llm_pb2.GenerateRequest(model=request.model, prompt=prompt, sampling=request.sampling)
                try:
                    seqs.append(self._new_sequence(rt, single, f"{base_id}-{i}"))
                except ServiceError as exc:
                    raise type(exc)(f"prompts[{i}]: {exc.message}") from None
            await self._constrain(rt, request.sampling, seqs)
            with self._submitted(rt, seqs, context) as channels:
                results = [await self._collect(rt, seq, ch) for seq, ch in zip(seqs, channels)]
            return llm_pb2.GenerateBatchResponse(results=results)

    async def ListModels(self, request: llm_pb2.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> llm_pb2.ListModelsResponse:
        return llm_pb2.ListModelsResponse(models=model_infos(self.models, self.location))

    async def Predict(self, request: llm_pb2.PredictRequest,
                      context: grpc.aio.ServicerContext) -> llm_pb2.PredictResponse:
        request_id = request_id_of(request, context)
        log.info("request %s: Predict on %s", request_id, request.model_id or "the default model")
        context.set_trailing_metadata(((REQUEST_ID_KEY, request_id), (ENGINE_KEY, self.location)))
        entry = self.models.store.get(request.model_id)
        validation.predict_text(request.input_data)
        if entry.task == "text-generation":
            async with self._generation(entry.id, "Predict", context) as rt:
                seq = self._new_sequence(rt, llm_pb2.GenerateRequest(prompt=request.input_data), request_id)
                with self._submitted(rt, [seq], context) as channels:
                    response = await self._collect(rt, seq, channels[0])
                return llm_pb2.PredictResponse(model_id=entry.id, text=response.text)
        async with self._lease(entry.id, context) as lease:
            rt = lease.model
            assert isinstance(rt, EncoderRuntime)
            if entry.task == "embedding":
                vectors = await self.blocking.run(rt.client.embed, [request.input_data], time_remaining(context))
                return llm_pb2.PredictResponse(model_id=entry.id, embedding=llm_pb2.Embedding(
                    values=vectors.vectors[0].values, dimension=vectors.dimension))
            classified = await self.blocking.run(rt.client.classify, [request.input_data], time_remaining(context))
            ranked = [llm_pb2.Label(label=s.label, score=s.score) for s in classified.results[0].labels]
            by_label = {label.label: label for label in ranked}
            class_order = rt.worker.info.labels if rt.worker.info is not None else []
            return llm_pb2.PredictResponse(model_id=entry.id, classification=llm_pb2.Classification(
                labels=ranked, classes=[by_label[name] for name in class_order if name in by_label]))

    # -- model leases -------------------------------------------------------------------------

    @asynccontextmanager
    async def _lease(self, key: str, context: grpc.aio.ServicerContext) -> AsyncIterator[Lease]:
        async with self.blocking.enter(self.models.use(key, time_remaining(context))) as lease:
            if lease.load_seconds > 0:
                # This call paid (or waited for) a cold start: say how long, without changing the response.
                _add_trailers(context, ((LOAD_SECONDS_KEY, f"{lease.load_seconds:.3f}"),))
            yield lease

    @asynccontextmanager
    async def _generation(self, key: str, rpc: str,
                          context: grpc.aio.ServicerContext) -> AsyncIterator[GenerationRuntime]:
        entry = self.models.store.get(key)
        if entry.task != "text-generation":
            raise InvalidArgument(f"model {entry.name} has task {entry.task}, but {rpc} needs a text-generation "
                                  "model. Use Predict for it, or ListModels to see each model's task")
        async with self._lease(entry.id, context) as lease:
            assert isinstance(lease.model, GenerationRuntime)
            yield lease.model

    # -- helpers ------------------------------------------------------------------------------

    @staticmethod
    def _new_sequence(rt: GenerationRuntime, request: llm_pb2.GenerateRequest, request_id: str) -> Sequence:
        ids = validation.prompt_tokens(request, rt.tokenizer, rt.limits.context_length)
        sampling = validation.sampling_options(request.sampling, len(ids), rt.limits)
        resumed = validation.resume_tokens(request, sampling, rt.tokenizer)
        return Sequence(prompt_token_ids=ids, sampling=sampling, request_id=request_id or uuid.uuid4().hex,
                        output_token_ids=resumed)

    async def _constrain(self, rt: GenerationRuntime, sampling: llm_pb2.SamplingParams, seqs: list[Sequence]) -> None:
        """The request's output constraint: found in the cache at once, or compiled on the server's thread
        pool, off the event loop and the engine loop; INVALID_ARGUMENT with llguidance's reason when it
        does not compile."""
        spec = validation.constraint_spec(sampling)
        if spec is None:
            return
        assert rt.constraints is not None
        grammar = rt.constraints.cached(spec) or await self.blocking.run(rt.constraints.compile, spec)
        for seq in seqs:
            seq.sampling = replace(seq.sampling, grammar=grammar)

    @contextmanager
    def _submitted(self, rt: GenerationRuntime, seqs: list[Sequence], context: grpc.aio.ServicerContext,
                   delivered_chars: int = 0) -> Iterator[list[EventChannel]]:
        """Hand ``seqs`` to the engine for the block; when it ends for any reason (done, error, the
        client cancelled or its deadline passed) every one still in the engine is aborted and freed.
        ``delivered_chars``: of a resumed request, the text another engine already delivered."""
        remaining = time_remaining(context)
        if self._mailbox is None:
            self._mailbox = EventMailbox(asyncio.get_running_loop())
        channels: list[EventChannel] = []
        rt.engine.admit(len(seqs))  # a batch fits the queue whole or is refused whole
        try:
            for seq in seqs:
                if remaining is not None:
                    seq.deadline = time.monotonic() + remaining
                channel = EventChannel(self._mailbox)
                rt.engine.submit(seq, channel.put, delivered_chars, admitted=True)
                log.info("request %s: sequence %d queued, %d prompt tokens", seq.request_id, seq.seq_id,
                         seq.num_prompt_tokens)
                channels.append(channel)
            yield channels
        finally:
            for seq in seqs[:len(channels)]:
                if not seq.is_finished:
                    log.info("request %s: sequence %d cancelled: its call ended after %d output tokens",
                             seq.request_id, seq.seq_id, seq.num_output_tokens)
                rt.engine.abort(seq.seq_id, FinishReason.CANCELLED)  # a no-op for a finished sequence

    @staticmethod
    async def _events(seq: Sequence, channel: EventChannel) -> AsyncIterator[SeqEvent]:
        while True:
            event = await channel.get()
            if event.finish_reason is FinishReason.ERROR:
                raise Internal(event.error or "the request failed in the engine")
            if event.finish_reason is FinishReason.UNAVAILABLE:
                raise Unavailable(event.error or "the engine cannot serve this request now")
            if event.finish_reason is FinishReason.DEADLINE:
                raise DeadlineExceeded(f"deadline passed after {seq.num_output_tokens} generated tokens")
            if event.finish_reason is FinishReason.CANCELLED:
                raise Cancelled("the request was cancelled")
            yield event
            if event.finish_reason is not None:
                return

    def _call_metadata(self, seq: Sequence, first_token_at: list[float]) -> tuple[tuple[str, str], ...]:
        md = [(REQUEST_ID_KEY, seq.request_id), (ENGINE_KEY, self.location)]
        if seq.scheduled_time is not None:
            md.append((QUEUE_SECONDS_KEY, f"{seq.scheduled_time - seq.arrival_time:.4f}"))
        if first_token_at:
            md.append((TTFT_SECONDS_KEY, f"{first_token_at[0] - seq.arrival_time:.4f}"))
        if seq.spec_drafts:
            md.extend(((SPEC_DRAFTS_KEY, str(seq.spec_drafts)), (SPEC_DRAFT_TOKENS_KEY, str(seq.spec_draft_tokens)),
                       (SPEC_ACCEPTED_TOKENS_KEY, str(seq.spec_accepted_tokens))))
        return tuple(md)

    def _finished(self, seq: Sequence, first_token_at: list[float], context: grpc.aio.ServicerContext) -> None:
        md = self._call_metadata(seq, first_token_at)
        _add_trailers(context, md)
        log.info("request %s: sequence %d finished (%s), %d prompt + %d output tokens, %s", seq.request_id,
                 seq.seq_id, seq.finish_reason.value if seq.finish_reason else "?", seq.num_prompt_tokens,
                 seq.num_output_tokens, " ".join(f"{k[11:]}={v}" for k, v in md[2:]))

    async def _collect(self, rt: GenerationRuntime, seq: Sequence, channel: EventChannel,
                       first_token_at: list[float] | None = None) -> llm_pb2.GenerateResponse:
        text, ids, lps, reason = [], [], [], None
        async for event in self._events(seq, channel):
            if first_token_at is not None and not first_token_at:
                first_token_at.append(time.monotonic())
            text.append(event.text)
            ids.extend(event.token_ids)
            lps.extend(event.logprobs)
            reason = event.finish_reason
        return llm_pb2.GenerateResponse(
            request_id=seq.request_id, sequence_id=seq.seq_id, model=rt.limits.name, text="".join(text),
            token_ids=ids, finish_reason=FINISH_REASON_PB[reason], usage=self._usage(seq),
            logprobs=[self._logprob_pb(rt, lp) for lp in lps])

    @staticmethod
    def _usage(seq: Sequence) -> llm_pb2.Usage:
        return llm_pb2.Usage(prompt_tokens=seq.num_prompt_tokens, completion_tokens=seq.num_output_tokens)

    @staticmethod
    def _logprob_pb(rt: GenerationRuntime, lp: TokenLogprob) -> llm_pb2.TokenLogprob:
        text = rt.tokenizer.token_text
        return llm_pb2.TokenLogprob(
            token_id=lp.token_id, token=text(lp.token_id), logprob=lp.logprob,
            top=[llm_pb2.TopLogprob(token_id=t, token=text(t), logprob=v) for t, v in lp.top])


class EngineAdminServicer(engine_admin_pb2_grpc.EngineAdminServicer):
    # A router that hears nothing for this long re-sends nothing new, but the heartbeat proves the
    # engine (and the stream) is alive even when its load does not change.
    HEARTBEAT_SECONDS = 1.0

    def __init__(self, models: ModelManager, blocking: BlockingCalls, location: str, max_num_seqs: int = 0,
                 not_serving_reason: Callable[[], str] = lambda: ""):
        self.models = models
        self.blocking = blocking
        self.location = location
        self.max_num_seqs = max_num_seqs
        self.not_serving_reason = not_serving_reason   # why health says NOT_SERVING ("" = serving)
        self._stopping = asyncio.Event()

    def stop(self) -> None:
        """End every WatchLoad stream (graceful shutdown must not wait for them). Call on the event loop."""
        self._stopping.set()

    async def GetLoad(self, request: engine_admin_pb2.GetLoadRequest,
                      context: grpc.aio.ServicerContext) -> engine_admin_pb2.EngineLoad:
        return self._load()

    def _load(self) -> engine_admin_pb2.EngineLoad:
        """The sum over the loaded generation models (one scheduler and KV pool each)."""
        out = engine_admin_pb2.EngineLoad(memory_budget_bytes=self.models.budget_bytes,
                                          memory_used_bytes=self.models.used_bytes(),
                                          memory_reserved_bytes=self.models.reserved_bytes(),
                                          max_num_seqs=self.max_num_seqs,
                                          not_serving_reason=self.not_serving_reason())
        queried = hits = 0
        for entry, rt in self.models.loaded():
            out.loaded_models.append(entry.name)
            if isinstance(rt, GenerationRuntime):
                load = rt.engine.load()
                out.num_waiting += load.num_waiting
                out.num_running += load.num_running
                out.num_kv_blocks_total += load.num_kv_blocks_total
                out.num_kv_blocks_used += load.num_kv_blocks_used
                out.num_finished += load.num_finished
                out.num_preemptions += load.num_preemptions
                out.worker_restarts += load.worker_restarts
                out.num_cached_blocks += load.num_cached_blocks
                out.max_queue += load.max_queue
                out.retry_after_ms = max(out.retry_after_ms, load.retry_after_ms)
                queried += load.num_prefix_query_tokens
                hits += load.num_prefix_hit_tokens
        # Weighted by tokens: the share of all looked-up prompt tokens found cached, across models.
        out.prefix_cache_hit_rate = hits / queried if queried else 0.0
        return out

    async def WatchLoad(self, request: engine_admin_pb2.WatchLoadRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[engine_admin_pb2.EngineLoad]:
        interval = max(0.02, (request.interval_ms or 100) / 1000)
        last: engine_admin_pb2.EngineLoad | None = None
        last_sent = 0.0
        while not self._stopping.is_set():
            load = self._load()
            load.ClearField("num_finished")  # changes on every request; not a reason to send
            load.ClearField("memory_used_bytes")  # RSS drifts by pages: not a reason to send
            now = time.monotonic()
            if load != last or now - last_sent >= self.HEARTBEAT_SECONDS:
                yield load
                last, last_sent = load, now
            try:
                await asyncio.wait_for(self._stopping.wait(), interval)
            except asyncio.TimeoutError:
                pass

    async def LoadModel(self, request: engine_admin_pb2.LoadModelRequest,
                        context: grpc.aio.ServicerContext) -> engine_admin_pb2.LoadModelResponse:
        result = await self.blocking.run(self.models.load, request.model, time_remaining(context))
        if result.load_seconds > 0:
            _add_trailers(context, ((LOAD_SECONDS_KEY, f"{result.load_seconds:.3f}"),))
        return engine_admin_pb2.LoadModelResponse(
            model=self._info(result.entry.id), was_loaded=result.was_loaded, load_seconds=result.load_seconds,
            evicted=result.evicted)

    async def UnloadModel(self, request: engine_admin_pb2.UnloadModelRequest,
                          context: grpc.aio.ServicerContext) -> engine_admin_pb2.UnloadModelResponse:
        drain = request.drain_timeout_ms / 1000 if request.drain_timeout_ms else None  # None: --unload-drain-seconds
        result = await self.blocking.run(self.models.unload, request.model, time_remaining(context), drain)
        return engine_admin_pb2.UnloadModelResponse(model=self._info(result.entry.id), was_loaded=result.was_loaded,
                                                    freed_bytes=result.freed_bytes)

    def _info(self, model_id: str) -> llm_pb2.ModelInfo:
        return next(m for m in model_infos(self.models, self.location) if m.id == model_id)


def _add_trailers(context: grpc.ServicerContext, metadata: tuple[tuple[str, str], ...]) -> None:
    """Add to the call's trailing metadata (set_trailing_metadata alone replaces what is there)."""
    keys = {k for k, _ in metadata}
    kept = tuple((k, v) for k, v in context.trailing_metadata() or () if k not in keys)
    context.set_trailing_metadata(kept + tuple(metadata))


def _weights(rt: object) -> str:
    """How a loaded model's weights run, as its worker reported it ("" when not loaded)."""
    info = rt.worker.info if isinstance(rt, GenerationRuntime) else None
    return info.weights if info is not None else ""


def model_infos(models: ModelManager, location: str) -> list[llm_pb2.ModelInfo]:
    """The store's models as ModelInfo: loaded or not, where, measured memory, last use, load time."""
    loaded = dict((entry.id, rt) for entry, rt in models.loaded())
    out = []
    for status in models.snapshot():
        e = status.entry
        rt = loaded.get(e.id)
        context_length = e.context_length
        if isinstance(rt, GenerationRuntime):
            context_length = rt.limits.context_length
        out.append(llm_pb2.ModelInfo(
            id=e.id, name=e.name, task=e.task, format=e.format, loaded=status.loaded,
            loaded_on=[location] if status.loaded else [], memory_bytes=status.memory_bytes,
            last_used_unix_ms=status.last_used_unix_ms, context_length=context_length,
            load_seconds=status.load_seconds, estimated_memory_bytes=e.memory_estimate_bytes, dtype=e.dtype,
            aliases=e.aliases, framework="onnxruntime" if e.format == "onnx" else "transformers",
            weights=_weights(rt)))
    return out
