"""python -m services.engine --help"""
from __future__ import annotations

import logging
import socket
import sys
import uuid

from llmserve.v1 import engine_admin_pb2, engine_admin_pb2_grpc, llm_pb2, llm_pb2_grpc
from services.common.config import load_config
from services.common.consul_client import consul_settings
from services.common.model_source import resolve_model
from services.common.server import write_port_file, LazyServicer, create_server, run_until_signal, setup_logging
from services.engine.block_manager import BlockManager
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.registration import ConsulRegistrar, EngineRegistration, advertised_host
from services.engine.executor import ExecutorConfig, ModelExecutor
from services.engine.scheduler import Scheduler, SchedulerConfig
from services.engine.server import EngineAdminServicer, LLMServicer
from services.engine.tokenizer import Tokenizer
from services.engine.validation import ModelLimits

log = logging.getLogger("llmserve.engine")
LLM_SERVICE = llm_pb2.DESCRIPTOR.services_by_name["LLMService"].full_name
ADMIN_SERVICE = engine_admin_pb2.DESCRIPTOR.services_by_name["EngineAdmin"].full_name


def main(argv: list[str] | None = None) -> None:
    config = load_config(EngineConfig, "LLMSERVE_ENGINE", argv)
    setup_logging(config.log_level)
    try:
        source = resolve_model(config.model)
    except FileNotFoundError as exc:
        log.error("%s", exc)
        sys.exit(2)
    servicers: dict[str, object] = {}
    handle = create_server(
        [lambda s: llm_pb2_grpc.add_LLMServiceServicer_to_server(LazyServicer(servicers, "llm", "the engine is starting: the model is still loading"), s),
         lambda s: engine_admin_pb2_grpc.add_EngineAdminServicer_to_server(LazyServicer(servicers, "admin", "the engine is starting"), s)],
        [LLM_SERVICE, ADMIN_SERVICE], config.host, config.port)
    log.info("engine listening on %s:%d (NOT_SERVING until the model is ready)", config.host, handle.port)

    tokenizer = Tokenizer(source)
    executor = ModelExecutor(ExecutorConfig(
        model=config.model, worker_address=config.worker, dtype=config.dtype, device=config.device,
        kv_cache_mb=config.kv_cache_mb, block_size=config.block_size, threads=config.worker_threads))
    info = executor.start()
    block_manager = BlockManager(info.num_kv_blocks, info.block_size, config.enable_prefix_caching)
    scheduler = Scheduler(SchedulerConfig(
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=info.context_length, eos_token_ids=tokenizer.eos_token_ids), block_manager)
    engine = LLMEngine(scheduler, executor, tokenizer, config.max_queue, config.max_worker_restarts)
    engine.start()
    limits = ModelLimits(
        name=source.name, id=str(uuid.uuid5(uuid.NAMESPACE_URL, f"llmserve:{source.name}")),
        context_length=info.context_length, kv_capacity_tokens=info.num_kv_blocks * info.block_size,
        default_max_tokens=config.default_max_tokens)
    servicers["llm"] = LLMServicer(engine, limits, config.max_batch_prompts, source.format,
                                   f"{config.host}:{handle.port}", info.weights_bytes + info.kv_cache_bytes)
    admin = EngineAdminServicer(engine, source.name, config.max_num_seqs)
    servicers["admin"] = admin
    handle.set_serving(True, [LLM_SERVICE, ADMIN_SERVICE])
    registrar = _registrar(config, handle.port, (source.name, limits.id))
    if registrar is not None:
        registrar.start()
    write_port_file(config.port_file, handle.port)
    log.info("engine SERVING %s on %s:%d (worker pid %s)", source.name, config.host, handle.port, executor.worker_pid)

    def on_signal() -> None:
        # Leave the catalog first so routers stop sending here while in-flight calls finish.
        if registrar is not None:
            registrar.deregister()
        admin.stop()

    def on_stop() -> None:
        engine.stop()
        executor.shutdown()

    run_until_signal(handle, on_stop, on_signal=on_signal)


def _registrar(config: EngineConfig, port: int, models: tuple[str, ...]) -> ConsulRegistrar | None:
    try:
        settings = consul_settings(config.consul_addr, config.consul_token)
    except ValueError as exc:
        log.error("%s", exc)
        sys.exit(2)
    if settings is None:
        return None
    return ConsulRegistrar(settings, EngineRegistration(
        address=advertised_host(config.host, config.advertise), port=port,
        node=config.node_name or socket.gethostname(), models=models,
        check_interval=config.consul_check_interval, check_timeout=config.consul_check_timeout,
        deregister_after=config.consul_deregister_after))


if __name__ == "__main__":
    main()
