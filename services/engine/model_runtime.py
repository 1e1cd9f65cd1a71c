"""What a loaded model is inside the engine: its worker process, and for generation its own engine loop.

``RuntimeFactory`` is the model manager's loader: it turns a store entry into a running
``GenerationRuntime`` (tokenizer + executor + scheduler/block manager + LLMEngine) or
``EncoderRuntime`` (an executor whose worker embeds, or embeds and classifies). ``close`` ends the
worker process, so an unloaded model's memory goes back to the OS.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from llmserve.worker.v1 import worker_pb2
from services.common.errors import FailedPrecondition
from services.common.model_source import resolve_model
from services.engine.block_manager import BlockManager
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.executor import ExecutorConfig, ModelExecutor, WorkerFailure
from services.engine.metrics import EngineMetrics
from services.engine.model_store import ModelEntry
from services.engine.scheduler import Scheduler, SchedulerConfig
from services.engine.tokenizer import Tokenizer
from services.engine.validation import ModelLimits

log = logging.getLogger("llmserve.engine.runtime")


@dataclass
class GenerationRuntime:
    entry: ModelEntry
    executor: ModelExecutor
    engine: LLMEngine
    limits: ModelLimits
    info: worker_pb2.WorkerInfo

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def memory_bytes(self) -> int:
        return self.executor.memory_bytes()

    def close(self) -> None:
        self.engine.stop()
        self.executor.shutdown()


@dataclass
class EncoderRuntime:
    entry: ModelEntry
    executor: ModelExecutor
    info: worker_pb2.WorkerInfo

    def memory_bytes(self) -> int:
        return self.executor.memory_bytes()

    def close(self) -> None:
        self.executor.shutdown()


Runtime = GenerationRuntime | EncoderRuntime


class RuntimeFactory:
    def __init__(self, config: EngineConfig, external_worker: str = "", metrics: EngineMetrics | None = None):
        self.config = config
        self.metrics = metrics  # None: no metrics recorded, workers started with --no-metrics
        self.external_worker = external_worker  # only in --model mode: one model, one external worker

    def __call__(self, entry: ModelEntry) -> Runtime:
        try:
            source = resolve_model(entry.source)
        except FileNotFoundError as exc:
            raise FailedPrecondition(f"model {entry.name} cannot be loaded: {exc}") from None
        c = self.config
        executor = ModelExecutor(ExecutorConfig(
            model=entry.source, task=entry.task, train_data=entry.train_data, worker_address=self.external_worker,
            dtype=entry.dtype, device=c.device, kv_cache_mb=c.kv_cache_mb, block_size=c.block_size,
            threads=c.worker_threads, metrics=self.metrics is not None))
        try:
            info = executor.start()
            if entry.task != "text-generation":
                return EncoderRuntime(entry, executor, info)
            tokenizer = Tokenizer(source)
        except (WorkerFailure, OSError, ValueError) as exc:
            executor.shutdown()
            raise FailedPrecondition(f"model {entry.name} could not be loaded from {source.path}: {exc} "
                                     "(the engine log has the worker's reason; is the file missing or corrupt?)") from None
        block_manager = BlockManager(info.num_kv_blocks, info.block_size, self.config.enable_prefix_caching)
        context_length = min(entry.context_length or info.context_length, info.context_length)
        scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
            max_model_len=context_length, eos_token_ids=tokenizer.eos_token_ids), block_manager)
        stats = self.metrics.for_model(entry.name, scheduler) if self.metrics is not None else None
        engine = LLMEngine(scheduler, executor, tokenizer, c.max_queue, c.max_worker_restarts, stats)
        engine.start()
        limits = ModelLimits(name=entry.name, id=entry.id, context_length=context_length,
                             kv_capacity_tokens=info.num_kv_blocks * info.block_size,
                             default_max_tokens=c.default_max_tokens)
        return GenerationRuntime(entry, executor, engine, limits, info)
