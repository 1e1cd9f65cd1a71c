"""What a loaded model is inside the engine: its worker process, and for generation its own engine loop.

``RuntimeFactory`` is the model manager's loader: it turns a store entry into a running
``GenerationRuntime`` (tokenizer + step stream to its worker + scheduler/block manager + LLMEngine)
or ``EncoderRuntime`` (a client of a worker that embeds, or embeds and classifies). ``close`` ends the
worker process, so an unloaded model's memory goes back to the OS.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from services.common.errors import FailedPrecondition
from services.common.model_source import resolve_model
from services.engine.core.block_manager import BlockManager
from services.engine.models.constraints import ConstraintCompiler
from services.engine.config import EngineConfig
from services.engine.core.engine import LLMEngine
from services.engine.models.drain_estimate import remaining_tokens
from services.engine.models.encoder_client import EncoderClient
from services.engine.models.observer import RuntimeObserver
from services.engine.core.executor import WorkerFailure
from services.engine.models.store import ModelEntry
from services.engine.core.scheduler import Scheduler, SchedulerConfig
from services.engine.core.speculation import Speculator
from services.engine.models.step_client import StepClient
from services.engine.models.tokenizer import Tokenizer
from services.engine.models.worker_process import WorkerProcess, WorkerSpec

log = logging.getLogger("llmserve.engine.runtime")


@dataclass(frozen=True)
class ModelLimits:
    name: str
    id: str
    context_length: int
    kv_capacity_tokens: int       # tokens the whole KV cache holds: one sequence can never exceed it
    default_max_tokens: int


@dataclass
class GenerationRuntime:
    entry: ModelEntry
    steps: StepClient
    engine: LLMEngine
    tokenizer: Tokenizer
    limits: ModelLimits
    constraints: ConstraintCompiler | None = None   # output constraints, compiled for this tokenizer

    @property
    def worker(self) -> WorkerProcess:
        return self.steps.worker

    def memory_bytes(self) -> int:
        return self.steps.worker.memory_bytes()

    def remaining_tokens(self) -> int | None:
        """The most tokens a request in flight may still generate (an unload's drain weighs it)."""
        return remaining_tokens(self.engine.scheduler)

    def close(self) -> None:
        self.engine.stop()
        self.steps.shutdown()


@dataclass
class EncoderRuntime:
    entry: ModelEntry
    client: EncoderClient

    @property
    def worker(self) -> WorkerProcess:
        return self.client.worker

    def memory_bytes(self) -> int:
        return self.client.worker.memory_bytes()

    def close(self) -> None:
        self.client.worker.close()


Runtime = GenerationRuntime | EncoderRuntime


class RuntimeFactory:
    def __init__(self, config: EngineConfig, external_worker: str = "", external_secret: str = "",
                 metrics: RuntimeObserver | None = None):
        self.config = config
        self.metrics = metrics  # None: no metrics recorded, workers started with --no-metrics
        self.external_worker = external_worker  # only in --model mode: one model, one external worker
        self.external_secret = external_secret  # what that worker expects (--worker-secret-file)

    def __call__(self, entry: ModelEntry) -> Runtime:
        try:
            source = resolve_model(entry.source)
        except FileNotFoundError as exc:
            raise FailedPrecondition(f"model {entry.name} cannot be loaded: {exc}") from None
        c = self.config
        worker = WorkerProcess(WorkerSpec(
            model=entry.source, task=entry.task, train_data=entry.train_data, worker_address=self.external_worker,
            runtime="onnxruntime" if entry.format == "onnx" else "transformers", onnx_file=entry.onnx_file,
            dtype=entry.dtype, device=c.device, kv_cache_mb=c.kv_pool_mb, block_size=c.block_size,
            kv_cache_dtype=c.kv_cache_dtype if entry.dtype == "native" else "auto",
            threads=c.worker_threads, tls=c.tls, external_secret=self.external_secret,
            metrics=self.metrics is not None))
        steps = StepClient(worker)
        try:
            if entry.task != "text-generation":
                worker.start()
                return EncoderRuntime(entry, EncoderClient(worker))
            # The tokenizer loads (importing transformers, seconds) while the worker process starts.
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer-load") as pool:
                tokenizer_load = pool.submit(Tokenizer, source)
                info = steps.start()
                tokenizer = tokenizer_load.result()
        except (WorkerFailure, OSError, ValueError) as exc:
            worker.close()
            raise FailedPrecondition(f"model {entry.name} could not be loaded from {source.path}: {exc} "
                                     "(the engine log has the worker's reason; is the file missing or corrupt?)") from None
        block_manager = BlockManager(info.num_kv_blocks, info.block_size, self.config.enable_prefix_caching)
        context_length = min(entry.context_length or info.context_length, info.context_length)
        scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
            max_model_len=context_length, eos_token_ids=tokenizer.eos_token_ids,
            long_prefill_token_threshold=c.long_prefill_token_threshold,
            max_long_partial_prefills=c.max_long_partial_prefills), block_manager,
            Speculator(c.speculative(), context_length))
        stats = self.metrics.for_model(entry.name, scheduler) if self.metrics is not None else None
        engine = LLMEngine(scheduler, steps, tokenizer.decode, c.max_queue, c.max_worker_restarts, stats)
        engine.start()
        limits = ModelLimits(name=entry.name, id=entry.id, context_length=context_length,
                             kv_capacity_tokens=info.num_kv_blocks * info.block_size,
                             default_max_tokens=c.default_max_tokens)
        constraints = ConstraintCompiler(lambda: tokenizer.hf, info.vocab_size,
                                         self.metrics.constraints.for_model(entry.name) if self.metrics else None)
        return GenerationRuntime(entry, steps, engine, tokenizer, limits, constraints)
