"""python -m services.worker --help"""
from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path

# OpenMP threads sleep as soon as a parallel region ends, unless the user says otherwise. Spinning
# (libgomp's default) wins a few microseconds a region on an idle machine, and makes a step 5-15x
# slower when the cores are shared: two engines on one node, or other processes (docs/performance.md).
# libgomp reads this when torch loads it, so it is set before the import.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from llmserve.worker.v1 import worker_pb2, worker_pb2_grpc
from services.common.config import ConfigError, load_config
from services.common.exit import run_then_exit
from services.common.metrics_http import new_registry, serve_metrics
from services.common.model_source import ModelSource, resolve_model
from services.common.security import (WORKER_SECRET, WORKER_SECRET_ENV, AccessPolicy, KeySet, ServerSecurity,
                                      read_secret_file)
from services.common.server import LazyServicer, create_server, run_until_signal, setup_logging, write_port_file
from services.worker.classifier_head import load_or_train
from services.worker.compute import ComputeThread
from services.worker.config import WorkerConfig
from services.worker.encoder_runner import EncoderRunner
from services.worker.metrics import WorkerMetrics
from services.worker.model_runner import ModelRunner
from services.worker.onnx_encoder import OnnxEncoderRunner
from services.worker.server import WorkerServicer

log = logging.getLogger("llmserve.worker")


def main(argv: list[str] | None = None) -> None:
    config = load_config(WorkerConfig, "LLMSERVE_WORKER", argv)
    setup_logging(config.log_level)
    if config.exit_with_parent:
        _exit_with_parent(config.parent_pid or os.getppid())
    if config.threads > 0:
        torch.set_num_threads(config.threads)
    try:
        security = _security(config)
    except ConfigError as exc:
        log.error("%s", exc)
        sys.exit(2)
    asyncio.run(_serve(config, security))


def _security(config: WorkerConfig) -> ServerSecurity:
    """Only its engine may call a worker: the secret the engine put in our environment (or
    --secret-file for an external worker), or a client certificate with --tls-ca."""
    # Out of os.environ, so nothing this process starts inherits it.
    secret = os.environ.pop(WORKER_SECRET_ENV, "") or read_secret_file(config.secret_file, "--secret-file")
    policy = AccessPolicy(client_keys=KeySet.of_keys(secret), client_header=WORKER_SECRET,
                          transport_authenticated=bool(config.tls_ca), what="this worker")
    return ServerSecurity(policy, config.tls, reflection=config.reflection)


async def _serve(config: WorkerConfig, security: ServerSecurity) -> None:
    service_name = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
    holder: dict[str, object] = {}
    # Start serving health (NOT_SERVING) at once so the engine can tell "loading" from "dead".
    handle = await create_server([lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(
        LazyServicer(holder, "servicer", "the worker is still loading its model", WorkerServicer), s)],
                                 [service_name], config.host, config.port, security)
    log.info("worker listening on %s:%d, loading %s", config.host, handle.port, config.model)
    try:
        source = resolve_model(config.model)
        metrics = None
        if config.metrics:
            registry = new_registry()
            metrics = WorkerMetrics(registry, source.name)
            # Before the port file: a parent that reads the port file finds the metrics port beside it.
            serve_metrics(registry, config.host, config.metrics_port, config.metrics_port_file)
        compute = ComputeThread()  # loads the model and runs every forward pass (see compute.py)
        holder["servicer"] = await compute.run_async(_servicer, config, source, compute, metrics)
    except Exception as exc:  # noqa: BLE001 - any load failure ends this worker with its reason logged
        # Missing or corrupt model files: say which, and exit non-zero so the engine reports it.
        log.error("cannot load %s: %s: %s", config.model, type(exc).__name__, exc)
        await handle.server.stop(0)
        sys.exit(2)
    await handle.set_serving(True, [service_name])
    write_port_file(config.port_file, handle.port)
    log.info("worker SERVING on %s:%d", config.host, handle.port)
    await run_until_signal(handle, drain_seconds=config.drain_seconds)


def _servicer(config: WorkerConfig, source: ModelSource, compute: ComputeThread,
              metrics: WorkerMetrics | None) -> WorkerServicer:
    if config.task == "text-generation":
        runner = ModelRunner(source, config.dtype, config.device, config.kv_cache_mb * 2**20, config.block_size,
                             config.kv_cache_dtype)
        return WorkerServicer(runner, source.name, runner.weights, compute, metrics=metrics)  # native may be bf16
    onnx = OnnxEncoderRunner(source, config.onnx_file, config.threads) if config.runtime == "onnxruntime" else None
    encoder = onnx or EncoderRunner(source, config.dtype, config.device)
    head = None
    if config.task == "text-classification":
        # The same key on both runtimes: one trained head per encoder, whichever runtime trained it.
        head = load_or_train(Path(config.train_data), f"{source.path}:{source.path.stat().st_mtime_ns}", encoder.embed)
        head = onnx.head(head) if onnx is not None else head
    return WorkerServicer(None, source.name, config.dtype, compute, encoder=encoder, head=head, metrics=metrics)


def _exit_with_parent(parent: int) -> None:
    """A worker started by an engine must not outlive it (an engine killed with SIGKILL runs no cleanup).
    The engine names itself (--parent-pid): one killed while its worker was still importing torch has
    already left it to init by the time this runs."""
    import threading

    if os.getppid() != parent:
        log.warning("parent process %d is gone; worker exiting", parent)
        os._exit(0)

    def watch() -> None:
        while os.getppid() == parent:
            threading.Event().wait(1.0)
        log.warning("parent process %d is gone; worker exiting", parent)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


if __name__ == "__main__":
    run_then_exit(main)
